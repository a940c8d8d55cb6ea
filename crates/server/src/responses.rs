//! `POST /v1/responses`, the stateless subset of OpenAI's Responses API,
//! over the chat path: the body becomes a chat body (`input` as text or
//! items, `instructions` as the system turn, `text.format` as
//! `response_format`, function `tools`), goes through the same
//! validation, template and lane, and the answer is written back as a
//! `response` object or, streamed, as the Responses API's typed events
//! (`response.created` … `response.output_text.delta` …
//! `response.completed`). Nothing is stored: `previous_response_id` is
//! refused. And `POST /v1/embeddings`, which no loaded model serves yet.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use braid_engine::FinishReason;
use serde_json::{json, Map, Value};

use crate::api::{self, Delta, Run, Update, Writer};
use crate::error::ApiError;
use crate::params::{self, Endpoint};
use crate::App;

const ROUTE: &str = "/v1/responses";

pub(crate) async fn responses(State(app): State<Arc<App>>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    match answer(app, &headers, body).await {
        Ok(res) => res,
        Err(e) => {
            tracing::info!(endpoint = ROUTE, status = e.status.as_u16(), error = %e.message, "request refused");
            e.into_response()
        }
    }
}

async fn answer(app: Arc<App>, headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body = body.map_err(|r| ApiError { status: r.status(), ..ApiError::invalid(format!("Could not read the request body: {}", r.body_text())) })?;
    let map = params::parse_object(&body)?;
    crate::fields::check(&app.cfg, ROUTE, &map)?;
    let chat = chat_body(&map)?;
    let meta = Meta::new(&map);
    let mut started = api::start(app, Endpoint::Chat, headers, &chat, arrived).await?;
    (started.run.id, started.run.route) = (meta.id.clone(), ROUTE);
    if started.stream {
        return Ok(api::stream_response(started.run, started.rx, started.cancel, Events::new(meta)));
    }
    let run = api::whole(started.run, started.rx, started.cancel).await?;
    let output = whole_output(&meta, &run);
    Ok(axum::Json(meta.object(&run, status(&run), output)).into_response())
}

/// The request's fields the response object echoes.
struct Meta {
    id: String,
    instructions: Value,
    max_output_tokens: Value,
    temperature: Value,
    top_p: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: bool,
    text: Value,
    user: Value,
}

impl Meta {
    fn new(map: &Map<String, Value>) -> Meta {
        let get = |k: &str| map.get(k).cloned().unwrap_or(Value::Null);
        Meta {
            id: format!("resp_{}", api::random_id()),
            instructions: get("instructions"),
            max_output_tokens: get("max_output_tokens"),
            temperature: get("temperature"),
            top_p: get("top_p"),
            tools: map.get("tools").cloned().unwrap_or_else(|| json!([])),
            tool_choice: map.get("tool_choice").cloned().unwrap_or_else(|| json!("auto")),
            parallel_tool_calls: map.get("parallel_tool_calls").and_then(Value::as_bool).unwrap_or(true),
            text: map.get("text").cloned().filter(Value::is_object).unwrap_or_else(|| json!({"format": {"type": "text"}})),
            user: get("user"),
        }
    }

    fn message_id(&self) -> String {
        format!("msg_{}", &self.id[5..])
    }

    fn call_item_id(&self, k: usize) -> String {
        format!("fc_{}_{k}", &self.id[5..])
    }

    /// The `response` object; `usage` once the run is over.
    fn object(&self, run: &Run, status: Status, output: Vec<Value>) -> Value {
        let over = !matches!(status, Status::InProgress);
        let incomplete = match status {
            Status::Incomplete => json!({"reason": "max_output_tokens"}),
            _ => Value::Null,
        };
        let error = match &status {
            Status::Failed(e) => json!({"code": e.code.unwrap_or("server_error"), "message": e.message}),
            _ => Value::Null,
        };
        json!({
            "id": self.id,
            "object": "response",
            "created_at": run.created,
            "status": status.name(),
            "error": error,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "model": run.model,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": null,
            "reasoning": {"effort": null, "summary": null},
            "store": false,
            "temperature": self.temperature,
            "text": self.text,
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": if over { usage(run) } else { Value::Null },
            "user": self.user,
            "metadata": {},
        })
    }
}

enum Status {
    InProgress,
    Completed,
    Incomplete,
    Failed(ApiError),
}

impl Status {
    fn name(&self) -> &'static str {
        match self {
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Incomplete => "incomplete",
            Status::Failed(_) => "failed",
        }
    }
}

fn status(run: &Run) -> Status {
    match run.choices.first().and_then(|c| c.finish) {
        Some(FinishReason::Length) => Status::Incomplete,
        _ => Status::Completed,
    }
}

fn usage(run: &Run) -> Value {
    let input: usize = run.prompt_lens.iter().sum();
    let output: usize = run.choices.iter().map(|c| c.tokens).sum();
    let cached = run.choices.first().map_or(0, |c| c.cached);
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input + output,
    })
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([text_part(text)]) };
    json!({"id": id, "type": "message", "status": status, "role": "assistant", "content": content})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"id": id, "type": "function_call", "status": status, "call_id": call_id, "name": name, "arguments": arguments})
}

/// A whole run's output items: the message (unless only calls came), then
/// the calls.
fn whole_output(meta: &Meta, run: &Run) -> Vec<Value> {
    let Some(c) = run.choices.first() else { return Vec::new() };
    let text = if c.parser.is_none() { c.text.as_str() } else { c.content.trim() };
    let mut out = Vec::new();
    if !text.is_empty() || c.calls.is_empty() {
        out.push(message_item(&meta.message_id(), text, "completed"));
    }
    for (k, call) in c.calls.iter().enumerate() {
        out.push(call_item(&meta.call_item_id(k), &call.id, &call.name, call.arguments.trim(), "completed"));
    }
    out
}

/// The Responses API's streamed events, from the chat path's updates.
struct Events {
    meta: Meta,
    seq: u64,
    /// Items done, in output order.
    done: Vec<Value>,
    /// The message item being written: its output index and text.
    message: Option<(usize, String)>,
    /// Whitespace before any message text: held back, so a reply of only
    /// tool calls opens no message for the newline before its call.
    blank: String,
    /// The call being written: its output index, call index, call id,
    /// name and arguments.
    call: Option<(usize, usize, String, String, String)>,
}

impl Events {
    fn new(meta: Meta) -> Events {
        Events { meta, seq: 0, done: Vec::new(), message: None, blank: String::new(), call: None }
    }

    fn event(&mut self, kind: &str, mut data: Value, out: &mut VecDeque<Bytes>) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        out.push_back(Bytes::from(format!("event: {kind}\ndata: {data}\n\n")));
    }

    fn text(&mut self, t: &str, out: &mut VecDeque<Bytes>) {
        if t.is_empty() {
            return;
        }
        if self.message.is_none() && t.trim().is_empty() {
            self.blank.push_str(t);
            return;
        }
        self.close_call(out);
        let delta = std::mem::take(&mut self.blank) + t;
        if self.message.is_none() {
            let index = self.done.len();
            let item = message_item(&self.meta.message_id(), "", "in_progress");
            self.event("response.output_item.added", json!({"output_index": index, "item": item}), out);
            let part = text_part("");
            self.event("response.content_part.added", json!({"item_id": self.meta.message_id(), "output_index": index, "content_index": 0, "part": part}), out);
            self.message = Some((index, String::new()));
        }
        let Some((index, text)) = self.message.as_mut() else { return };
        text.push_str(&delta);
        let index = *index;
        let data = json!({"item_id": self.meta.message_id(), "output_index": index, "content_index": 0, "delta": delta, "logprobs": []});
        self.event("response.output_text.delta", data, out);
    }

    fn close_message(&mut self, out: &mut VecDeque<Bytes>) {
        let Some((index, text)) = self.message.take() else { return };
        let id = self.meta.message_id();
        self.event("response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}), out);
        self.event("response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": text_part(&text)}), out);
        let item = message_item(&id, &text, "completed");
        self.event("response.output_item.done", json!({"output_index": index, "item": item}), out);
        self.done.push(item);
    }

    fn open_call(&mut self, k: usize, call_id: String, name: String, out: &mut VecDeque<Bytes>) {
        self.close_message(out);
        self.close_call(out);
        self.blank.clear();
        let index = self.done.len();
        let item = call_item(&self.meta.call_item_id(k), &call_id, &name, "", "in_progress");
        self.event("response.output_item.added", json!({"output_index": index, "item": item}), out);
        self.call = Some((index, k, call_id, name, String::new()));
    }

    fn args(&mut self, text: &str, out: &mut VecDeque<Bytes>) {
        let Some((index, k, _, _, args)) = self.call.as_mut() else { return };
        args.push_str(text);
        let (index, id) = (*index, self.meta.call_item_id(*k));
        self.event("response.function_call_arguments.delta", json!({"item_id": id, "output_index": index, "delta": text}), out);
    }

    fn close_call(&mut self, out: &mut VecDeque<Bytes>) {
        let Some((index, k, call_id, name, args)) = self.call.take() else { return };
        let id = self.meta.call_item_id(k);
        let args = args.trim().to_string();
        self.event("response.function_call_arguments.done", json!({"item_id": id, "output_index": index, "arguments": args}), out);
        let item = call_item(&id, &call_id, &name, &args, "completed");
        self.event("response.output_item.done", json!({"output_index": index, "item": item}), out);
        self.done.push(item);
    }

    fn deltas(&mut self, deltas: Vec<Delta>, out: &mut VecDeque<Bytes>) {
        for d in deltas {
            match d {
                Delta::Content(t) => self.text(&t, out),
                Delta::Call { index, id, name } => self.open_call(index, id, name, out),
                Delta::Args { text, .. } => self.args(&text, out),
            }
        }
    }
}

impl Writer for Events {
    fn opening(&mut self, run: &Run, out: &mut VecDeque<Bytes>) {
        let response = self.meta.object(run, Status::InProgress, Vec::new());
        self.event("response.created", json!({"response": response}), out);
        self.event("response.in_progress", json!({"response": response}), out);
    }

    fn update(&mut self, _run: &Run, update: Update, out: &mut VecDeque<Bytes>) {
        match update {
            Update::Token { text, .. } => self.text(&text, out),
            Update::Deltas { deltas, .. } => self.deltas(deltas, out),
            Update::Finished { text, deltas, .. } => {
                self.text(&text, out);
                self.deltas(deltas, out);
            }
            Update::Error(_) | Update::Nothing => {}
        }
    }

    fn closing(&mut self, run: &Run, out: &mut VecDeque<Bytes>) {
        self.close_message(out);
        self.close_call(out);
        if self.done.is_empty() {
            // An empty reply is still one (empty) message.
            let item = message_item(&self.meta.message_id(), "", "completed");
            self.event("response.output_item.added", json!({"output_index": 0, "item": item}), out);
            self.event("response.output_item.done", json!({"output_index": 0, "item": item}), out);
            self.done.push(item);
        }
        let status = status(run);
        let kind = if matches!(status, Status::Incomplete) { "response.incomplete" } else { "response.completed" };
        let response = self.meta.object(run, status, std::mem::take(&mut self.done));
        self.event(kind, json!({"response": response}), out);
    }

    fn failed(&mut self, run: &Run, error: ApiError, out: &mut VecDeque<Bytes>) {
        let response = self.meta.object(run, Status::Failed(error), std::mem::take(&mut self.done));
        self.event("response.failed", json!({"response": response}), out);
    }
}

/// The chat body a Responses body stands for.
fn chat_body(map: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    if map.get("previous_response_id").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::param(
            "previous_response_id",
            "This server stores no responses: send the whole conversation in `input` instead of `previous_response_id`.",
        ));
    }
    let mut messages = Vec::new();
    match map.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(ApiError::param("instructions", "`instructions` must be a string.")),
    }
    match map.get("input") {
        None | Some(Value::Null) => return Err(ApiError::param("input", "`input` is required.")),
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) if items.is_empty() => return Err(ApiError::param("input", "`input` must hold at least one item.")),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                input_item(i, item, &mut messages)?;
            }
        }
        Some(_) => return Err(ApiError::param("input", "`input` must be a string or an array of input items.")),
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    // Fields that mean the same in both APIs.
    for &k in crate::fields::RESPONSES_AS_CHAT {
        if let Some(v) = map.get(k) {
            chat.insert(k.into(), v.clone());
        }
    }
    if let Some(v) = map.get("max_output_tokens") {
        chat.insert("max_tokens".into(), v.clone());
    }
    if let Some(tools) = map.get("tools").filter(|v| !v.is_null()) {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    match map.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(s @ Value::String(_)) => {
            chat.insert("tool_choice".into(), s.clone());
        }
        Some(Value::Object(o)) => match (o.get("type").and_then(Value::as_str), o.get("name").and_then(Value::as_str)) {
            (Some("function"), Some(name)) => {
                chat.insert("tool_choice".into(), json!({"type": "function", "function": {"name": name}}));
            }
            _ => return Err(ApiError::param("tool_choice", "`tool_choice` as an object must be {\"type\": \"function\", \"name\": ...}.")),
        },
        Some(_) => return Err(ApiError::param("tool_choice", "`tool_choice` must be a string or an object.")),
    }
    if let Some(format) = map.get("text").and_then(|t| t.get("format")).filter(|v| !v.is_null()) {
        chat.insert("response_format".into(), response_format(format)?);
    }
    Ok(chat)
}

/// One `input` item as chat messages: a message, a function call (joined
/// to the assistant turn before it), or a function call's output.
fn input_item(i: usize, item: &Value, messages: &mut Vec<Value>) -> Result<(), ApiError> {
    let at = format!("input[{i}]");
    let Value::Object(o) = item else { return Err(ApiError::param(&at, format!("`{at}` must be an input item object."))) };
    let text = |k: &str| o.get(k).and_then(Value::as_str).map(str::to_string);
    match o.get("type").and_then(Value::as_str) {
        None | Some("message") => {
            let role = match o.get("role").and_then(Value::as_str) {
                // The developer's turn is what chat templates call system.
                Some("developer") => "system",
                Some(r @ ("system" | "user" | "assistant")) => r,
                Some(other) => {
                    return Err(ApiError::param(&format!("{at}.role"), format!("`{at}.role` must be user, assistant, system or developer, got `{other}`.")))
                }
                None => return Err(ApiError::param(&format!("{at}.role"), format!("`{at}.role` is required."))),
            };
            let content = content_text(&format!("{at}.content"), o.get("content"))?;
            messages.push(json!({"role": role, "content": content}));
        }
        Some("function_call") => {
            let (Some(call_id), Some(name)) = (text("call_id"), text("name")) else {
                return Err(ApiError::param(&at, format!("`{at}` (a function_call) needs `call_id` and `name`.")));
            };
            let call = json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": text("arguments").unwrap_or_else(|| "{}".into())}});
            match messages.last_mut() {
                Some(last) if last["role"] == "assistant" && last["tool_calls"].is_array() => {
                    if let Some(calls) = last["tool_calls"].as_array_mut() {
                        calls.push(call);
                    }
                }
                _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        Some("function_call_output") => {
            let Some(call_id) = text("call_id") else { return Err(ApiError::param(&at, format!("`{at}` (a function_call_output) needs `call_id`."))) };
            let output = content_text(&format!("{at}.output"), o.get("output"))?;
            messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
        }
        // The model's own reasoning from an earlier turn: nothing to render.
        Some("reasoning") => {}
        Some(other) => return Err(ApiError::param(&at, format!("Input items of type `{other}` are not supported."))),
    }
    Ok(())
}

/// Text content: a string, or parts of type input_text / output_text.
fn content_text(at: &str, v: Option<&Value>) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                    (Some(kind), _) => {
                        return Err(ApiError::param(&format!("{at}[{j}]"), format!("Content parts of type `{kind}` are not supported; only text.")))
                    }
                    (None, _) => return Err(ApiError::param(&format!("{at}[{j}]"), format!("`{at}[{j}].type` is required."))),
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::param(at, format!("`{at}` must be a string or an array of content parts."))),
    }
}

/// Responses tools (`{"type": "function", "name", "parameters", ...}`)
/// as chat tools (the function in its own object).
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let Value::Array(items) = tools else { return Err(ApiError::param("tools", "`tools` must be an array of tools.")) };
    let mut out = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => return Err(ApiError::param(&format!("tools[{i}]"), format!("Tools of type `{other}` are not supported; only `function`."))),
            None => return Err(ApiError::param(&format!("tools[{i}]"), format!("`tools[{i}].type` is required (\"function\")."))),
        }
        let mut func = Map::new();
        for k in ["name", "description", "parameters", "strict"] {
            if let Some(v) = t.get(k) {
                func.insert(k.into(), v.clone());
            }
        }
        out.push(json!({"type": "function", "function": func}));
    }
    Ok(Value::Array(out))
}

/// `text.format` as chat's `response_format`.
fn response_format(format: &Value) -> Result<Value, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(json!({"type": "text"})),
        Some("json_object") => Ok(json!({"type": "json_object"})),
        Some("json_schema") => {
            let Some(schema) = format.get("schema") else {
                return Err(ApiError::param("text.format.schema", "`text.format.schema` is required for `json_schema`."));
            };
            let name = format.get("name").cloned().unwrap_or_else(|| json!("response"));
            let strict = format.get("strict").cloned().unwrap_or(Value::Null);
            Ok(json!({"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}))
        }
        Some(other) => Err(ApiError::param("text.format.type", format!("`text.format.type` must be text, json_object or json_schema, got `{other}`."))),
        None => Err(ApiError::param("text.format.type", "`text.format.type` is required.")),
    }
}

/// `POST /v1/embeddings`: no architecture braid loads makes embeddings yet.
pub(crate) async fn embeddings(State(app): State<Arc<App>>) -> Response {
    ApiError::param(
        "model",
        format!("`{}` is a generative model; /v1/embeddings needs an embedding model, and none is loaded on this server.", app.cfg.model_name),
    )
    .with_code("model_not_embedding")
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Result<Map<String, Value>, ApiError> {
        chat_body(body.as_object().unwrap())
    }

    #[test]
    fn input_items_become_chat_messages() {
        let c = chat(json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 9,
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{\"city\":\"Oslo\"}"},
                {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}},
        }))
        .unwrap();
        let roles: Vec<&str> = c["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "system", "user", "assistant", "tool"]);
        assert_eq!(c["messages"][2]["content"], "Weather?");
        assert_eq!(c["messages"][3]["tool_calls"].as_array().unwrap().len(), 2, "consecutive calls are one assistant turn");
        assert_eq!(c["messages"][4]["tool_call_id"], "c1");
        assert_eq!(c["max_tokens"], 9);
        assert_eq!(c["tools"][0]["function"]["name"], "get");
        assert_eq!(c["tool_choice"]["function"]["name"], "get");
        assert_eq!(c["response_format"]["json_schema"]["strict"], true);
    }

    #[test]
    fn stored_state_and_other_tools_are_refused() {
        let e = chat(json!({"input": "x", "previous_response_id": "resp_1"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("previous_response_id"));
        let e = chat(json!({"input": "x", "tools": [{"type": "web_search"}]})).unwrap_err();
        assert!(e.message.contains("web_search"), "{}", e.message);
        assert_eq!(chat(json!({})).unwrap_err().param.as_deref(), Some("input"));
    }
}
