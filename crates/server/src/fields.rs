//! The request fields braid reads, per route: any other field is logged by
//! name (it is ignored), and with `--strict` refused with a 400 naming it.
//! Also `chat_template_kwargs`, passed to the chat template as variables.

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::ServerConfig;

/// Fields that change nothing here but that clients send routinely.
const HARMLESS: &[&str] = &["store", "metadata", "service_tier"];

const SAMPLING: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "max_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "user",
    "seed",
    "ignore_eos",
    "cache_salt",
    "speculative",
    "grammar",
    "regex",
    "json_schema",
    "response_format",
];

const CHAT: &[&str] = &["messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"];

const COMPLETIONS: &[&str] = &["prompt", "echo", "suffix", "best_of"];

/// The Responses fields passed on unchanged to the chat request it becomes
/// (`responses::chat_body`); one list, so the two cannot drift apart.
pub(crate) const RESPONSES_AS_CHAT: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stream",
    "user",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "cache_salt",
    "speculative",
];

/// The Responses fields read on their own (besides `RESPONSES_AS_CHAT`).
const RESPONSES: &[&str] =
    &["input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "previous_response_id", "reasoning", "truncation", "include"];

/// The fields of `map` that `route` does not read, in the body's order.
pub(crate) fn unknown<'a>(route: &str, map: &'a Map<String, Value>) -> Vec<&'a str> {
    let known = |k: &str| {
        HARMLESS.contains(&k)
            || match route {
                "/v1/chat/completions" => SAMPLING.contains(&k) || CHAT.contains(&k),
                "/v1/completions" => SAMPLING.contains(&k) || COMPLETIONS.contains(&k),
                "/v1/responses" => RESPONSES.contains(&k) || RESPONSES_AS_CHAT.contains(&k),
                _ => true,
            }
    };
    map.keys().map(String::as_str).filter(|k| !known(k)).collect()
}

/// Logs the fields of `map` that `route` ignores; under `--strict`, a 400
/// naming them.
pub(crate) fn check(cfg: &ServerConfig, route: &str, map: &Map<String, Value>) -> Result<(), ApiError> {
    let unknown = unknown(route, map);
    if unknown.is_empty() {
        return Ok(());
    }
    let names = unknown.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ");
    if cfg.strict {
        return Err(ApiError::param(unknown[0], format!("Unknown fields for {route}: {names} (the server runs with --strict).")).with_code("unknown_field"));
    }
    tracing::warn!(endpoint = route, fields = %unknown.join(","), "ignoring unknown request fields");
    Ok(())
}

/// `chat_template_kwargs`: extra variables for the chat template (e.g.
/// `enable_thinking`), as an object.
pub(crate) fn template_kwargs(map: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    match map.get("chat_template_kwargs") {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(o)) => {
            // The template's own variables are the server's to set.
            if let Some(k) = o.keys().find(|k| matches!(k.as_str(), "messages" | "tools" | "add_generation_prompt" | "bos_token" | "eos_token")) {
                return Err(ApiError::param("chat_template_kwargs", format!("`chat_template_kwargs` may not set `{k}`; the server sets it.")));
            }
            Ok(o.clone())
        }
        Some(_) => Err(ApiError::param("chat_template_kwargs", "`chat_template_kwargs` must be an object of template variables.")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unknown_fields_are_named_per_route() {
        let body = json!({"model": "m", "messages": [], "foo": 1, "store": true, "prompt": "x"});
        let map = body.as_object().unwrap();
        assert_eq!(unknown("/v1/chat/completions", map), ["foo", "prompt"]);
        assert_eq!(unknown("/v1/completions", map), ["messages", "foo"]);
    }
}
