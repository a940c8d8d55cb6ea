//! Request bodies: parsed from JSON by hand, field by field, so that every
//! wrong type or out-of-range value is a 400 naming the field (serde's
//! derive would give one opaque message). Unknown fields are ignored.

use braid_engine::{SamplingParams, StopRules};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::guide::Spec;
use crate::logsafe::clip;

/// The most top-logprob entries a request may ask for per token.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// The most stop strings a request may give.
pub const MAX_STOP: usize = 16;

/// The chat roles a message may have.
pub const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Which endpoint a body was sent to; some fields differ between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// The fields both endpoints share, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Common {
    pub model: Option<String>,
    /// Every choice's sampling; each choice offsets the seed by its index.
    pub sampling: SamplingParams,
    /// `max_tokens` as asked (`None`: up to the end of the context), the
    /// stop strings and `ignore_eos`; the model's stop ids are added when
    /// the streams are submitted.
    pub stop: StopRules,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub user: Option<String>,
    /// Logprobs asked for: `Some(k)` gives the chosen token's logprob and
    /// the `k` most likely alternatives.
    pub logprobs: Option<usize>,
    /// What the output must follow (`response_format`, or the `grammar` /
    /// `regex` / `json_schema` extensions); `None`: free text.
    pub format: Option<Spec>,
    /// The prefix cache to use (vLLM's `cache_salt`): only requests with
    /// the same salt share cached prompts.
    pub cache_salt: Option<String>,
    /// `"speculative": {"method", "num_speculative_tokens"}` as asked.
    pub speculative: Option<SpecAsk>,
}

/// A request's speculative decoding: `method` (`ngram`, `draft`, `dflash`,
/// `dspark`, or `none` to decode without), and at most `tokens` drafts
/// verified per round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecAsk {
    pub method: String,
    pub tokens: Option<usize>,
}

/// Methods `speculative.method` may name.
pub const SPEC_METHODS: &[&str] = &["ngram", "draft", "dflash", "dspark", "none"];

fn speculative(f: &Fields) -> Result<Option<SpecAsk>, ApiError> {
    let o = match f.0.get("speculative") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => Fields(o),
        Some(other) => return Err(f.wrong("speculative", "an object", other)),
    };
    let method = match o.str("method")? {
        Some(m) if SPEC_METHODS.contains(&m) => m.to_string(),
        Some(m) => return Err(ApiError::param("speculative.method", format!("`speculative.method` must be one of {}, got {m:?}.", SPEC_METHODS.join(", ")))),
        None => return Err(ApiError::param("speculative.method", "`speculative` needs a `method`.")),
    };
    let tokens = match o.int("num_speculative_tokens")? {
        None => None,
        Some(k) if k < 0 => {
            return Err(ApiError::param("speculative.num_speculative_tokens", format!("`num_speculative_tokens` must be at least 0, got {k}.")))
        }
        Some(k) => Some(usize::try_from(k).unwrap_or(usize::MAX)),
    };
    Ok(Some(SpecAsk { method, tokens }))
}

/// One chat message, content flattened to text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant turn's tool calls.
    pub tool_calls: Vec<CallIn>,
    /// A `tool` turn: the call it answers.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
    /// The message's `image_url` parts, in order; each stood in `content`
    /// where it holds `images::PLACE`.
    pub images: Vec<ImagePart>,
}

/// An `image_url` content part: where it was (for errors) and its URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImagePart {
    pub at: String,
    pub url: String,
}

/// A tool call in the history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallIn {
    pub id: String,
    pub name: String,
    /// JSON text, as the API carries it.
    pub arguments: String,
}

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The JSON schema of its arguments (`{"type": "object"}` if none).
    pub parameters: Value,
    /// The request's `tools` entry as given (for the chat template).
    pub raw: Value,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub common: Common,
    pub messages: Vec<Message>,
    pub tools: Vec<Tool>,
    pub tool_choice: ToolChoice,
    pub parallel_tool_calls: bool,
}

/// One prompt of a completions request: text, or token ids as given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    pub common: Common,
    /// One or more prompts; each gets `n` choices.
    pub prompts: Vec<Prompt>,
}

/// Parses the raw body into a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid("The request body is empty; send a JSON object."));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(ApiError::invalid(format!("The request body must be a JSON object, got {}.", type_name(&other)))),
        Err(e) => Err(ApiError::invalid(format!("The request body is not valid JSON: {e}."))),
    }
}

pub fn parse_chat(map: &Map<String, Value>, max_n: usize) -> Result<ChatRequest, ApiError> {
    let f = Fields(map);
    let messages = match map.get("messages") {
        None | Some(Value::Null) => return Err(ApiError::param("messages", "`messages` is required.")),
        Some(Value::Array(items)) => items,
        Some(other) => return Err(f.wrong("messages", "an array of messages", other)),
    };
    if messages.is_empty() {
        return Err(ApiError::param("messages", "`messages` must hold at least one message."));
    }
    let messages = messages.iter().enumerate().map(|(i, m)| message(i, m)).collect::<Result<Vec<_>, _>>()?;

    // Chat takes `logprobs: bool` and `top_logprobs: int`.
    let want = f.bool("logprobs")?.unwrap_or(false);
    let top = f.int("top_logprobs")?;
    let logprobs = match (want, top) {
        (false, Some(k)) if k > 0 => return Err(ApiError::param("top_logprobs", "`top_logprobs` needs `logprobs` set to true.")),
        (false, _) => None,
        (true, None) => Some(0),
        (true, Some(k)) => Some(top_count("top_logprobs", k)?),
    };
    let max_tokens = match f.int("max_completion_tokens")? {
        Some(v) => Some(v),
        None => f.int("max_tokens")?,
    };
    let param = if f.0.get("max_completion_tokens").is_some_and(|v| !v.is_null()) { "max_completion_tokens" } else { "max_tokens" };
    let common = common(&f, max_n, logprobs, max_tokens, param)?;
    let tools = tools(&f)?;
    let tool_choice = tool_choice(&f, &tools)?;
    let parallel_tool_calls = f.bool("parallel_tool_calls")?.unwrap_or(true);
    if common.format.is_some() && matches!(tool_choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::param("tool_choice", "A forced tool call (`tool_choice` required or named) cannot also follow `response_format`."));
    }
    Ok(ChatRequest { common, messages, tools, tool_choice, parallel_tool_calls })
}

fn tools(f: &Fields) -> Result<Vec<Tool>, ApiError> {
    let items = match f.get("tools") {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(other) => return Err(f.wrong("tools", "an array of tools", other)),
    };
    let mut out: Vec<Tool> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Value::Object(t) = item else { return Err(Fields::wrong_at(&at, "a tool object", item)) };
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => return Err(ApiError::param(&at, format!("Tools of type `{}` are not supported; only `function`.", clip(other)))),
            None => return Err(ApiError::param(&at, format!("`{at}.type` is required (\"function\")."))),
        }
        let Some(Value::Object(func)) = t.get("function") else {
            return Err(ApiError::param(&format!("{at}.function"), format!("`{at}.function` must be an object with a `name`.")));
        };
        let name = match func.get("name") {
            Some(Value::String(n)) if !n.is_empty() && n.len() <= 64 && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') => n.clone(),
            _ => return Err(ApiError::param(&format!("{at}.function.name"), format!("`{at}.function.name` must be 1 to 64 letters, digits, `_` or `-`."))),
        };
        if out.iter().any(|o| o.name == name) {
            return Err(ApiError::param(&format!("{at}.function.name"), format!("Two tools are named `{name}`.")));
        }
        let parameters = match func.get("parameters") {
            None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(other) => return Err(Fields::wrong_at(&format!("{at}.function.parameters"), "a JSON schema object", other)),
        };
        out.push(Tool { name, parameters, raw: item.clone() });
    }
    Ok(out)
}

fn tool_choice(f: &Fields, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let default = if tools.is_empty() { ToolChoice::None } else { ToolChoice::Auto };
    let choice = match f.get("tool_choice") {
        None => default,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => default,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::param(
                    "tool_choice",
                    format!("`tool_choice` must be \"none\", \"auto\", \"required\" or a named function, got \"{}\".", clip(other)),
                ))
            }
        },
        Some(Value::Object(o)) => match o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) if tools.iter().any(|t| t.name == name) => ToolChoice::Named(name.to_string()),
            Some(name) => return Err(ApiError::param("tool_choice", format!("`tool_choice` names `{}`, which is not among `tools`.", clip(name)))),
            None => return Err(ApiError::param("tool_choice", "`tool_choice` as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}.")),
        },
        Some(other) => return Err(f.wrong("tool_choice", "a string or an object", other)),
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::param("tool_choice", "`tool_choice` asks for a tool call, but the request has no `tools`."));
    }
    Ok(choice)
}

/// `response_format`, or one of the extensions `grammar` (Lark),
/// `regex` and `json_schema` (llama.cpp's); at most one of them.
fn format(f: &Fields) -> Result<Option<Spec>, ApiError> {
    let mut found: Vec<(&str, Spec)> = Vec::new();
    match f.get("response_format") {
        None => {}
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push(("response_format", Spec::JsonObject)),
            Some("json_schema") => {
                let Some(Value::Object(js)) = o.get("json_schema") else {
                    return Err(ApiError::param("response_format.json_schema", "`response_format.json_schema` must be an object with a `schema`."));
                };
                let schema = match js.get("schema") {
                    Some(s @ Value::Object(_)) => s.clone(),
                    Some(other) => return Err(Fields::wrong_at("response_format.json_schema.schema", "a JSON schema object", other)),
                    None => return Err(ApiError::param("response_format.json_schema.schema", "`response_format.json_schema.schema` is required.")),
                };
                let strict = matches!(js.get("strict"), Some(Value::Bool(true)));
                found.push(("response_format", Spec::JsonSchema { schema, strict }));
            }
            Some(other) => {
                return Err(ApiError::param(
                    "response_format.type",
                    format!("`response_format.type` must be text, json_object or json_schema, got `{}`.", clip(other)),
                ))
            }
            None => return Err(ApiError::param("response_format.type", "`response_format.type` is required.")),
        },
        Some(other) => return Err(f.wrong("response_format", "an object", other)),
    }
    if let Some(g) = f.str("grammar")? {
        found.push(("grammar", Spec::Lark(g.to_string())));
    }
    if let Some(r) = f.str("regex")? {
        found.push(("regex", Spec::Regex(r.to_string())));
    }
    match f.get("json_schema") {
        None => {}
        Some(s @ Value::Object(_)) => found.push(("json_schema", Spec::JsonSchema { schema: s.clone(), strict: false })),
        Some(other) => return Err(f.wrong("json_schema", "a JSON schema object", other)),
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
        return Err(ApiError::param(
            found[1].0,
            format!("Give at most one of {}; got {}.", "`response_format`, `grammar`, `regex`, `json_schema`", names.join(" and ")),
        ));
    }
    Ok(found.pop().map(|(_, s)| s))
}

pub fn parse_completion(map: &Map<String, Value>, max_n: usize) -> Result<CompletionRequest, ApiError> {
    let f = Fields(map);
    let prompts = prompts(&f)?;
    let logprobs = match f.int("logprobs")? {
        None => None,
        Some(k) => Some(top_count("logprobs", k)?),
    };
    // Features that would change the answer's meaning are refused rather
    // than silently ignored.
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::param("echo", "`echo` is not supported."));
    }
    if f.str("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::param("suffix", "`suffix` is not supported."));
    }
    if let Some(best_of) = f.int("best_of")? {
        let n = f.int("n")?.unwrap_or(1);
        if best_of != n && best_of != 1 {
            return Err(ApiError::param("best_of", "`best_of` is not supported (only equal to `n`)."));
        }
    }
    let max_tokens = f.int("max_tokens")?;
    let common = common(&f, max_n, logprobs, max_tokens, "max_tokens")?;
    Ok(CompletionRequest { common, prompts })
}

fn common(f: &Fields, max_n: usize, logprobs: Option<usize>, max_tokens: Option<i64>, max_tokens_param: &str) -> Result<Common, ApiError> {
    let model = f.str("model")?.map(str::to_string);
    let max_tokens = match max_tokens {
        None => None,
        Some(v) if v < 1 => return Err(ApiError::param(max_tokens_param, format!("`{max_tokens_param}` must be at least 1, got {v}."))),
        Some(v) => Some(usize::try_from(v).unwrap_or(usize::MAX)),
    };
    let temperature = f.range("temperature", 0.0, 2.0)?.unwrap_or(1.0);
    // Checked as the f32 the sampler uses: 1e-300 is 0 there.
    let top_p = f.num("top_p")?.map(|p| p as f32);
    if let Some(p) = top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::param("top_p", format!("`top_p` must be in (0, 1] (and at least {:e}), got {p}.", f32::MIN_POSITIVE)));
        }
    }
    let top_k = match f.int("top_k")? {
        None => 0,
        Some(k) if k < -1 => return Err(ApiError::param("top_k", format!("`top_k` must be -1 or 0 (off) or positive, got {k}."))),
        // Clients send -1 for off as well as 0.
        Some(k) => usize::try_from(k.max(0)).unwrap_or(usize::MAX),
    };
    let min_p = f.range("min_p", 0.0, 1.0)?.unwrap_or(0.0);
    let seed = match f.0.get("seed") {
        None | Some(Value::Null) => None,
        // Negative seeds are fine: only the bits matter.
        Some(Value::Number(n)) if n.is_u64() => n.as_u64(),
        Some(Value::Number(n)) if n.is_i64() => n.as_i64().map(|v| v as u64),
        Some(Value::Number(n)) => return Err(ApiError::param("seed", format!("`seed` must be a 64-bit integer, got {n}."))),
        Some(other) => return Err(f.wrong("seed", "an integer", other)),
    };
    let stop = stops(f)?;
    let presence_penalty = f.range("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    let frequency_penalty = f.range("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    let repetition_penalty = match f.num("repetition_penalty")? {
        None => 1.0,
        Some(r) if r as f32 > 0.0 && (r as f32).is_finite() => r,
        Some(r) => return Err(ApiError::param("repetition_penalty", format!("`repetition_penalty` must be above 0 and below {:e}, got {r}.", f32::MAX))),
    };
    let n = match f.int("n")? {
        None => 1,
        Some(n) if n < 1 => return Err(ApiError::param("n", format!("`n` must be at least 1, got {n}."))),
        Some(n) if n as u64 > max_n as u64 => return Err(ApiError::param("n", format!("`n` must be at most {max_n}, got {n}."))),
        Some(n) => n as usize,
    };
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.0.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => Fields(o).bool("include_usage")?.unwrap_or(false),
        Some(other) => return Err(f.wrong("stream_options", "an object", other)),
    };
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    let user = f.str("user")?.map(str::to_string);
    let cache_salt = salt(f)?;
    if let Some(bias) = f.0.get("logit_bias") {
        match bias {
            Value::Null => {}
            Value::Object(o) if o.is_empty() => {}
            Value::Object(_) => return Err(ApiError::param("logit_bias", "`logit_bias` is not supported.")),
            other => return Err(f.wrong("logit_bias", "an object", other)),
        }
    }
    Ok(Common {
        model,
        sampling: SamplingParams {
            temperature: temperature as f32,
            top_k,
            top_p: top_p.unwrap_or(1.0),
            min_p: min_p as f32,
            repetition_penalty: repetition_penalty as f32,
            presence_penalty: presence_penalty as f32,
            frequency_penalty: frequency_penalty as f32,
            seed,
            ..SamplingParams::default()
        },
        stop: StopRules { max_tokens, stop_ids: Vec::new(), stop_strings: stop, ignore_eos },
        n,
        stream,
        include_usage,
        user,
        logprobs,
        format: format(f)?,
        cache_salt,
        speculative: speculative(f)?,
    })
}

fn salt(f: &Fields) -> Result<Option<String>, ApiError> {
    match f.str("cache_salt")? {
        Some("") => Err(ApiError::param("cache_salt", "`cache_salt` must not be empty.")),
        s => Ok(s.map(str::to_string)),
    }
}

/// What `/v1/warm` feeds into the prefix cache.
#[derive(Clone, Debug, PartialEq)]
pub enum WarmInput {
    Prompt(Prompt),
    /// Rendered by the chat template as the start of a later chat (no
    /// assistant turn opened).
    Chat(Vec<Message>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct WarmRequest {
    pub model: Option<String>,
    pub input: WarmInput,
    pub cache_salt: Option<String>,
}

/// A `/v1/warm` body: `prompt` (text or token ids) or `messages`, and
/// optionally `model` and `cache_salt`.
pub fn parse_warm(map: &Map<String, Value>) -> Result<WarmRequest, ApiError> {
    let f = Fields(map);
    let model = f.str("model")?.map(str::to_string);
    let cache_salt = salt(&f)?;
    let has = |k: &str| map.get(k).is_some_and(|v| !v.is_null());
    let input = match (has("prompt"), has("messages")) {
        (true, true) => return Err(ApiError::param("messages", "Send `prompt` or `messages`, not both.")),
        (false, false) => return Err(ApiError::param("prompt", "`prompt` or `messages` is required.")),
        (true, false) => match prompts(&f)?.as_slice() {
            [one] => WarmInput::Prompt(one.clone()),
            _ => return Err(ApiError::param("prompt", "`prompt` must be one prompt (text or token ids); send one request per prefix.")),
        },
        (false, true) => WarmInput::Chat(parse_chat(map, 1)?.messages),
    };
    Ok(WarmRequest { model, input, cache_salt })
}

fn top_count(param: &str, k: i64) -> Result<usize, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS as i64).contains(&k) {
        return Err(ApiError::param(param, format!("`{param}` must be between 0 and {MAX_TOP_LOGPROBS}, got {k}.")));
    }
    Ok(k as usize)
}

fn stops(f: &Fields) -> Result<Vec<String>, ApiError> {
    let list = match f.0.get("stop") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::String(s) => out.push(s.clone()),
                    other => return Err(f.wrong(&format!("stop[{i}]"), "a string", other)),
                }
            }
            out
        }
        Some(other) => return Err(f.wrong("stop", "a string or an array of strings", other)),
    };
    if list.len() > MAX_STOP {
        return Err(ApiError::param("stop", format!("`stop` may hold at most {MAX_STOP} strings, got {}.", list.len())));
    }
    // An empty stop string would end every stream at once; OpenAI ignores it.
    Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
}

fn prompts(f: &Fields) -> Result<Vec<Prompt>, ApiError> {
    let empty = || ApiError::param("prompt", "`prompt` must not be empty.");
    let value = match f.0.get("prompt") {
        None | Some(Value::Null) => return Err(ApiError::param("prompt", "`prompt` is required.")),
        Some(v) => v,
    };
    let out = match value {
        Value::String(s) => vec![Prompt::Text(s.clone())],
        Value::Array(items) if items.is_empty() => return Err(empty()),
        // An array of numbers is one prompt of token ids.
        Value::Array(items) if items[0].is_number() => {
            vec![Prompt::Tokens(token_ids("prompt", items)?)]
        }
        Value::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let param = format!("prompt[{i}]");
                match item {
                    Value::String(s) => out.push(Prompt::Text(s.clone())),
                    Value::Array(ids) => out.push(Prompt::Tokens(token_ids(&param, ids)?)),
                    other => {
                        return Err(f.wrong(&param, "a string or an array of token ids", other));
                    }
                }
            }
            out
        }
        other => return Err(f.wrong("prompt", "a string, an array of strings, or token ids", other)),
    };
    for p in &out {
        let is_empty = match p {
            Prompt::Text(s) => s.is_empty(),
            Prompt::Tokens(t) => t.is_empty(),
        };
        if is_empty {
            return Err(empty());
        }
    }
    Ok(out)
}

fn token_ids(param: &str, items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| ApiError::param(param, format!("`{param}[{i}]` must be a token id (a non-negative integer), got {v}.")))
        })
        .collect()
}

fn message(i: usize, m: &Value) -> Result<Message, ApiError> {
    let param = format!("messages[{i}]");
    let Value::Object(o) = m else {
        return Err(Fields::wrong_at(&param, "an object with `role` and `content`", m));
    };
    let role = match o.get("role") {
        Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.clone(),
        // A role is template markup's business: only the known ones pass,
        // so none can smuggle text into the turn header.
        Some(Value::String(r)) => {
            return Err(ApiError::param(&format!("{param}.role"), format!("`{param}.role` must be one of {}, got `{}`.", ROLES.join(", "), clip(r))))
        }
        None | Some(Value::Null) => return Err(ApiError::param(&format!("{param}.role"), format!("`{param}.role` is required."))),
        Some(other) => return Err(Fields::wrong_at(&format!("{param}.role"), "a non-empty string", other)),
    };
    let mut images = Vec::new();
    let content = match o.get("content") {
        // Assistant turns that only carried tool calls have no content.
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let at = format!("{param}.content[{j}]");
                let Value::Object(p) = part else {
                    return Err(Fields::wrong_at(&at, "a content part object", part));
                };
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    (Some("text"), _) => {
                        return Err(ApiError::param(&at, format!("`{at}.text` must be a string.")));
                    }
                    (Some("image_url"), _) => {
                        // `{"url": ..., "detail": ...}`, or (some clients) the URL itself.
                        let url = match p.get("image_url") {
                            Some(Value::String(u)) => u.clone(),
                            Some(Value::Object(u)) => match u.get("url") {
                                Some(Value::String(u)) => u.clone(),
                                _ => return Err(ApiError::param(&format!("{at}.image_url.url"), format!("`{at}.image_url.url` must be a string."))),
                            },
                            _ => return Err(ApiError::param(&format!("{at}.image_url"), format!("`{at}.image_url` must be an object with a `url`."))),
                        };
                        text.push(crate::images::PLACE);
                        images.push(ImagePart { at: format!("{at}.image_url"), url });
                    }
                    (Some(other), _) => {
                        return Err(ApiError::param(&at, format!("Content parts of type `{}` are not supported; only `text` and `image_url`.", clip(other))))
                    }
                    (None, _) => return Err(ApiError::param(&at, format!("`{at}.type` is required."))),
                }
            }
            text
        }
        Some(other) => return Err(Fields::wrong_at(&format!("{param}.content"), "a string or an array of content parts", other)),
    };
    let text = |key: &str| -> Result<Option<String>, ApiError> {
        match o.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(Fields::wrong_at(&format!("{param}.{key}"), "a string", other)),
        }
    };
    let (tool_call_id, name) = (text("tool_call_id")?, text("name")?);
    let tool_calls = match o.get("tool_calls") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(calls)) => calls.iter().enumerate().map(|(j, c)| call_in(&format!("{param}.tool_calls[{j}]"), c)).collect::<Result<_, _>>()?,
        Some(other) => return Err(Fields::wrong_at(&format!("{param}.tool_calls"), "an array of tool calls", other)),
    };
    if role == "tool" && tool_call_id.is_none() {
        return Err(ApiError::param(&format!("{param}.tool_call_id"), format!("`{param}` has role `tool` but no `tool_call_id`.")));
    }
    Ok(Message { role, content, tool_calls, tool_call_id, name, images })
}

fn call_in(at: &str, c: &Value) -> Result<CallIn, ApiError> {
    let func = c.get("function").filter(|f| f.is_object()).ok_or_else(|| ApiError::param(at, format!("`{at}.function` must be an object.")))?;
    let name = func.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
    let name = name.ok_or_else(|| ApiError::param(&format!("{at}.function.name"), format!("`{at}.function.name` is required.")))?.to_string();
    let arguments = match func.get("arguments") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(a)) => a.clone(),
        // Some clients send the arguments as an object.
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(other) => return Err(Fields::wrong_at(&format!("{at}.function.arguments"), "a JSON string", other)),
    };
    let id = c.get("id").and_then(Value::as_str).unwrap_or_default().to_string();
    Ok(CallIn { id, name, arguments })
}

/// Typed access to a body's fields; `null` counts as absent.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn wrong(&self, param: &str, want: &str, got: &Value) -> ApiError {
        Fields::wrong_at(param, want, got)
    }

    fn wrong_at(param: &str, want: &str, got: &Value) -> ApiError {
        ApiError::param(param, format!("`{param}` must be {want}, got {}.", type_name(got)))
    }

    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn num(&self, name: &str) -> Result<Option<f64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(other) => Err(self.wrong(name, "a number", other)),
        }
    }

    /// A number in `lo..=hi`.
    fn range(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        match self.num(name)? {
            Some(v) if !(lo..=hi).contains(&v) => Err(ApiError::param(name, format!("`{name}` must be between {lo} and {hi}, got {v}."))),
            v => Ok(v),
        }
    }

    fn int(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => match (n.as_i64(), n.as_u64()) {
                (Some(v), _) => Ok(Some(v)),
                // Above i64::MAX: still an integer, just a huge one.
                (None, Some(_)) => Ok(Some(i64::MAX)),
                _ => Err(ApiError::param(name, format!("`{name}` must be an integer, got {n}."))),
            },
            Some(other) => Err(self.wrong(name, "an integer", other)),
        }
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.wrong(name, "a boolean", other)),
        }
    }

    fn str(&self, name: &str) -> Result<Option<&str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong(name, "a string", other)),
        }
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The lane's `Request::draft_tokens` for a request that asked `ask`:
/// the lane's default, none (`Some(0)`), or a cap; a method this server
/// does not draft with is a 400 naming the one it does.
pub(crate) fn draft_tokens(spec: &crate::Speculation, ask: Option<&SpecAsk>) -> Result<Option<usize>, ApiError> {
    let Some(ask) = ask else { return Ok(spec.opt_in.then_some(0)) };
    if ask.method == "none" || ask.tokens == Some(0) {
        return Ok(Some(0));
    }
    match spec.method.as_deref() {
        Some(m) if m == ask.method => Ok(ask.tokens),
        Some(m) => Err(ApiError::param("speculative.method", format!("This server drafts with `{m}`, not `{}` (or ask for `none`).", ask.method))),
        None => Err(ApiError::param(
            "speculative.method",
            format!("This server has no drafter, so `{}` is not available (it starts with one by --drafter or --draft-model).", ask.method),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Speculation;

    fn ask(body: Value) -> Result<Option<SpecAsk>, ApiError> {
        let Value::Object(o) = body else { unreachable!() };
        speculative(&Fields(&o))
    }

    #[test]
    fn speculative_is_parsed_and_checked_against_the_servers_drafter() {
        let ngram = ask(serde_json::json!({"speculative": {"method": "ngram", "num_speculative_tokens": 3}})).unwrap().unwrap();
        assert_eq!(ngram, SpecAsk { method: "ngram".into(), tokens: Some(3) });
        assert_eq!(ask(serde_json::json!({})).unwrap(), None);
        for bad in [
            serde_json::json!({"speculative": "ngram"}),
            serde_json::json!({"speculative": {"method": "eagle"}}),
            serde_json::json!({"speculative": {}}),
            serde_json::json!({"speculative": {"method": "draft", "num_speculative_tokens": -1}}),
        ] {
            assert!(ask(bad.clone()).is_err(), "{bad} was accepted");
        }
        let served = Speculation { method: Some("ngram".into()), opt_in: false };
        assert_eq!(draft_tokens(&served, None).unwrap(), None, "every request drafts by default");
        assert_eq!(draft_tokens(&served, Some(&ngram)).unwrap(), Some(3));
        let none = SpecAsk { method: "none".into(), tokens: None };
        assert_eq!(draft_tokens(&served, Some(&none)).unwrap(), Some(0));
        let draft = SpecAsk { method: "draft".into(), tokens: None };
        let e = draft_tokens(&served, Some(&draft)).unwrap_err();
        assert!(format!("{e:?}").contains("drafts with `ngram`"), "{e:?}");
        let opt_in = Speculation { opt_in: true, ..served };
        assert_eq!(draft_tokens(&opt_in, None).unwrap(), Some(0), "opt-in: a request that does not ask drafts nothing");
        assert_eq!(draft_tokens(&opt_in, Some(&ngram)).unwrap(), Some(3));
        let e = draft_tokens(&Speculation::default(), Some(&ngram)).unwrap_err();
        assert!(format!("{e:?}").contains("no drafter"), "{e:?}");
        assert_eq!(draft_tokens(&Speculation::default(), Some(&none)).unwrap(), Some(0));
    }
}
