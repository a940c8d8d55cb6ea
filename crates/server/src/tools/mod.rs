//! Tool calling: which syntax the model writes calls in (read off its chat
//! template), the tools and the call history in its prompt, a grammar that
//! forces a call (`tool_choice` required or named), and the output parsed
//! back into OpenAI's `tool_calls` as it streams.
//!
//! One module per syntax: `hermes` (`<tool_call>{json}</tool_call>`:
//! Qwen2.5, Qwen3, Hermes, and braid's fallback for templates that know no
//! tools, such as SmolLM2's), `llama3` (bare `{"name", "parameters"}`
//! objects), `pythonic` (`[f(a=1)]` lists: LFM2 between its
//! `<|tool_call_start|>` tokens, Gemma in a `tool_code` fence). `json_call`
//! streams the JSON syntaxes' arguments as they come.

mod hermes;
mod json_call;
mod llama3;
mod pythonic;

use serde_json::{json, Map, Value};

use crate::guide::with_layout;
use crate::params::{CallIn, Message, Tool, ToolChoice};

/// What a parser makes of the output, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Plain content.
    Text(String),
    /// A new call (the next index) of this function.
    Call(String),
    /// More of the newest call's arguments (JSON text).
    Args(String),
}

/// Turns a stream of output text into pieces. Text that may start a call
/// is held back until it is clear.
pub trait CallParser: Send {
    fn push(&mut self, text: &str, out: &mut Vec<Piece>);
    /// The output ended: release what is held.
    fn finish(&mut self, out: &mut Vec<Piece>);
}

/// The inside of a marked call block (`<tool_call>…</tool_call>`).
trait Body: Send {
    /// More of the block's text.
    fn feed(&mut self, text: &str, out: &mut Vec<Piece>);
    /// The block ended (its close marker, or the output's end); false if
    /// it held no call, so its text is content.
    fn end(&mut self, out: &mut Vec<Piece>) -> bool;
}

/// Content with call blocks between an open and a close marker. Text that
/// may be the start of a marker is held back until it is clear.
struct Marked<B> {
    open: &'static str,
    close: &'static str,
    body: B,
    inside: bool,
    /// Text not yet handed on.
    buf: String,
    /// The current block's text, for when it holds no call.
    block: String,
}

impl<B: Body> Marked<B> {
    fn new(open: &'static str, close: &'static str, body: B) -> Marked<B> {
        Marked { open, close, body, inside: false, buf: String::new(), block: String::new() }
    }

    fn end_block(&mut self, closed: bool, out: &mut Vec<Piece>) {
        if !self.body.end(out) {
            let close = if closed { self.close } else { "" };
            out.push(Piece::Text(format!("{}{}{close}", self.open, self.block)));
        }
        self.block.clear();
        self.inside = false;
    }
}

/// The length of the longest end of `text` that starts `marker`.
fn partial(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1)).rev().find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])).unwrap_or(0)
}

impl<B: Body> CallParser for Marked<B> {
    fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        self.buf.push_str(text);
        loop {
            let marker = if self.inside { self.close } else { self.open };
            let (ready, found) = match self.buf.find(marker) {
                Some(i) => (i, true),
                None => (self.buf.len() - partial(&self.buf, marker), false),
            };
            let head: String = self.buf.drain(..ready).collect();
            if self.inside {
                self.block.push_str(&head);
                self.body.feed(&head, out);
            } else if !head.is_empty() {
                out.push(Piece::Text(head));
            }
            if !found {
                return;
            }
            self.buf.drain(..marker.len());
            if self.inside {
                self.end_block(true, out);
            } else {
                self.inside = true;
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<Piece>) {
        let rest = std::mem::take(&mut self.buf);
        if self.inside {
            self.block.push_str(&rest);
            self.body.feed(&rest, out);
            self.end_block(false, out);
        } else if !rest.is_empty() {
            out.push(Piece::Text(rest));
        }
    }
}

/// A model family's tool-call syntax.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Syntax {
    Hermes,
    Llama3,
    /// LFM2: a pythonic list between `<|tool_call_start|>` and `<|tool_call_end|>`.
    Lfm2,
    /// Gemma: a pythonic list in a ```` ```tool_code ```` fence.
    GemmaCode,
}

/// How one request's tools reach the model and come back.
pub struct Toolset {
    pub syntax: Syntax,
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    pub parallel: bool,
    /// The template renders `tools` itself.
    native_tools: bool,
    /// The template renders assistant `tool_calls` itself.
    native_calls: bool,
    /// The template renders `tool` messages itself.
    native_results: bool,
}

impl Syntax {
    /// The syntax of the model whose template this is.
    pub fn of(template: &str) -> Syntax {
        if template.contains("<|tool_call_start|>") {
            Syntax::Lfm2
        } else if template.contains("<tool_call>") {
            Syntax::Hermes
        } else if template.contains("<|python_tag|>") || (template.contains("<|eot_id|>") && template.contains("\"parameters\"")) {
            Syntax::Llama3
        } else if template.contains("<start_of_turn>") {
            Syntax::GemmaCode
        } else {
            Syntax::Hermes
        }
    }
}

impl Toolset {
    /// `None` when the request calls no tools (none given, or
    /// `tool_choice: none`: then the model is not shown them either).
    pub fn new(template: &str, tools: Vec<Tool>, choice: ToolChoice, parallel: bool) -> Option<Toolset> {
        if tools.is_empty() || choice == ToolChoice::None {
            return None;
        }
        let syntax = Syntax::of(template);
        Some(Toolset {
            syntax,
            tools,
            choice,
            parallel,
            native_tools: template.contains("tools"),
            native_calls: template.contains("tool_calls"),
            native_results: template.contains("\"tool\"") || template.contains("'tool'"),
        })
    }

    /// The template's variables: `tools` as the request gave them, when
    /// the template renders them.
    pub fn template_vars(&self) -> Map<String, Value> {
        let mut vars = Map::new();
        if self.native_tools {
            vars.insert("tools".into(), self.tools.iter().map(|t| t.raw.clone()).collect());
        }
        vars
    }

    /// The messages as the template takes them. Arguments become objects
    /// (templates write them with `tojson`). Where the template knows no
    /// tools, the tools go into the system message, past calls into the
    /// assistant's content and results into user turns, in the syntax's
    /// own form.
    pub fn messages(&self, messages: &[Message]) -> Vec<Value> {
        let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
        for m in messages {
            if m.role == "tool" && !self.native_results {
                let text = self.result_text(&m.content);
                // Consecutive results share one user turn (templates that
                // alternate roles refuse two in a row).
                match out.last_mut() {
                    Some(last) if last["role"] == "user" && last.get("tool_results").is_some() => {
                        let joined = format!("{}\n{text}", last["content"].as_str().unwrap_or(""));
                        last["content"] = Value::String(joined);
                    }
                    _ => out.push(json!({"role": "user", "content": text, "tool_results": true})),
                }
                continue;
            }
            let mut v = message_value(m);
            if !m.tool_calls.is_empty() && !self.native_calls {
                let calls = self.calls_text(&m.tool_calls);
                let content = if m.content.is_empty() { calls } else { format!("{}\n{calls}", m.content) };
                v["content"] = Value::String(content);
                v.as_object_mut().map(|o| o.remove("tool_calls"));
            }
            out.push(v);
        }
        for v in &mut out {
            v.as_object_mut().map(|o| o.remove("tool_results"));
        }
        if !self.native_tools {
            let prompt = self.prompt();
            match out.first_mut() {
                Some(first) if first["role"] == "system" => {
                    let content = format!("{}\n\n{prompt}", first["content"].as_str().unwrap_or(""));
                    first["content"] = Value::String(content);
                }
                _ => out.insert(0, json!({"role": "system", "content": prompt})),
            }
        }
        out
    }

    /// The tools a call may name: all of them, or the one named.
    fn callable(&self) -> Vec<&Tool> {
        match &self.choice {
            ToolChoice::Named(n) => self.tools.iter().filter(|t| &t.name == n).collect(),
            _ => self.tools.iter().collect(),
        }
    }

    /// A Lark grammar for the output when a call is forced (`required`,
    /// or a named function: then exactly one call of it).
    pub fn grammar(&self) -> Option<String> {
        let many = self.parallel && self.choice == ToolChoice::Required;
        match self.choice {
            ToolChoice::Required | ToolChoice::Named(_) => {}
            _ => return None,
        }
        let tools = self.callable();
        Some(match self.syntax {
            Syntax::Hermes => hermes::grammar(&call_schema(&tools, "arguments"), many),
            Syntax::Llama3 => llama3::grammar(&call_schema(&tools, "parameters"), many),
            Syntax::Lfm2 => pythonic::grammar(&tools, many, "<|tool_call_start|>", "<|tool_call_end|>"),
            Syntax::GemmaCode => pythonic::grammar(&tools, many, "\"```tool_code\\n\"", "\"\\n```\""),
        })
    }

    pub fn parser(&self) -> Box<dyn CallParser> {
        match self.syntax {
            Syntax::Hermes => Box::new(hermes::parser()),
            Syntax::Llama3 => Box::new(llama3::Llama3::default()),
            Syntax::Lfm2 => Box::new(pythonic::parser("<|tool_call_start|>", "<|tool_call_end|>")),
            Syntax::GemmaCode => Box::new(pythonic::parser("```tool_code", "```")),
        }
    }

    /// The tools described for a template that does not render them.
    fn prompt(&self) -> String {
        let list: Vec<String> = self.tools.iter().map(|t| t.raw.to_string()).collect();
        match self.syntax {
            Syntax::GemmaCode => pythonic::gemma_prompt(&list),
            _ => hermes::prompt(&list),
        }
    }

    fn calls_text(&self, calls: &[CallIn]) -> String {
        match self.syntax {
            Syntax::Hermes => hermes::render(calls),
            Syntax::Llama3 => llama3::render(calls),
            Syntax::Lfm2 => format!("<|tool_call_start|>{}<|tool_call_end|>", pythonic::render(calls)),
            Syntax::GemmaCode => format!("```tool_code\n{}\n```", pythonic::render(calls)),
        }
    }

    fn result_text(&self, content: &str) -> String {
        match self.syntax {
            Syntax::GemmaCode => format!("```tool_output\n{content}\n```"),
            _ => format!("<tool_response>\n{content}\n</tool_response>"),
        }
    }
}

/// A message as a template sees it (`tool_calls` with object arguments).
pub fn message_value(m: &Message) -> Value {
    let mut v = json!({"role": m.role, "content": m.content});
    if !m.tool_calls.is_empty() {
        let calls: Vec<Value> = m
            .tool_calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments_value(&c.arguments)}}))
            .collect();
        v["tool_calls"] = Value::Array(calls);
    }
    if let Some(id) = &m.tool_call_id {
        v["tool_call_id"] = Value::String(id.clone());
    }
    if let Some(n) = &m.name {
        v["name"] = Value::String(n.clone());
    }
    v
}

/// Arguments text as a JSON value (as it is, if it is not JSON).
fn arguments_value(args: &str) -> Value {
    serde_json::from_str(args).unwrap_or_else(|_| Value::String(args.to_string()))
}

/// The JSON schema of one call object: `{"name": <one of the tools>,
/// "<args_key>": <its parameters>}`, in that order, laid out as braid
/// writes JSON.
fn call_schema(tools: &[&Tool], args_key: &str) -> Value {
    let options: Vec<Value> = tools
        .iter()
        .map(|t| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, args_key: t.parameters},
                "required": ["name", args_key],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = if options.len() == 1 { options[0].clone() } else { json!({"anyOf": options}) };
    with_layout(&schema, false).unwrap_or(schema)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn run(p: &mut dyn CallParser, parts: &[&str]) -> Vec<Piece> {
        let mut out = Vec::new();
        for part in parts {
            p.push(part, &mut out);
        }
        p.finish(&mut out);
        // Adjacent pieces of one kind joined, as a client reading the
        // stream would see them.
        let mut joined: Vec<Piece> = Vec::new();
        for piece in out {
            match (joined.last_mut(), piece) {
                (Some(Piece::Text(a)), Piece::Text(b)) | (Some(Piece::Args(a)), Piece::Args(b)) => a.push_str(&b),
                (_, p) => joined.push(p),
            }
        }
        joined
    }

    fn tool(name: &str) -> Tool {
        let parameters = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
        Tool { name: name.into(), raw: json!({"type": "function", "function": {"name": name, "parameters": parameters}}), parameters }
    }

    fn msg(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into(), tool_calls: Vec::new(), tool_call_id: None, name: None, images: Vec::new() }
    }

    #[test]
    fn the_syntax_comes_from_the_template() {
        assert_eq!(Syntax::of("{{ '<tool_call>' }} {% if tools %}"), Syntax::Hermes);
        assert_eq!(Syntax::of("<|tool_call_start|> <|tool_list_start|>"), Syntax::Lfm2);
        assert_eq!(Syntax::of("<|start_header_id|> \"parameters\" <|eot_id|>"), Syntax::Llama3);
        assert_eq!(Syntax::of("<start_of_turn>user"), Syntax::GemmaCode);
        assert_eq!(Syntax::of("<|im_start|>"), Syntax::Hermes);
    }

    // A template that knows no tools (SmolLM2's) gets them in a system
    // message, the assistant's past calls in its content and the results
    // as a user turn; one that does gets them as they are.
    #[test]
    fn history_reaches_templates_with_and_without_tool_support() {
        let mut call = msg("assistant", "");
        call.tool_calls = vec![CallIn { id: "call_1".into(), name: "weather".into(), arguments: "{\"city\": \"Paris\"}".into() }];
        let mut result = msg("tool", "{\"temp\": 21}");
        result.tool_call_id = Some("call_1".into());
        let history = [msg("user", "Weather in Paris?"), call, result];
        let plain = Toolset::new("<|im_start|>{{ m.content }}", vec![tool("weather")], ToolChoice::Auto, true).unwrap();
        let m = plain.messages(&history);
        assert_eq!(m[0]["role"], "system");
        assert!(m[0]["content"].as_str().unwrap().contains("\"name\":\"weather\""));
        assert_eq!(m[2]["content"], "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
        assert!(m[2].get("tool_calls").is_none());
        assert_eq!(m[3], json!({"role": "user", "content": "<tool_response>\n{\"temp\": 21}\n</tool_response>"}));
        assert!(plain.template_vars().is_empty());
        let native = Toolset::new("{% if tools %}<tool_call>{{ tool_calls }} 'tool'", vec![tool("weather")], ToolChoice::Auto, true).unwrap();
        let m = native.messages(&history);
        assert_eq!(m.len(), 3);
        assert_eq!(m[1]["tool_calls"][0]["function"]["arguments"], json!({"city": "Paris"}));
        assert_eq!(m[2]["tool_call_id"], "call_1");
        assert_eq!(native.template_vars()["tools"][0]["function"]["name"], "weather");
    }

    #[test]
    fn a_grammar_only_when_a_call_is_forced() {
        let set = |choice| Toolset::new("<tool_call>", vec![tool("a"), tool("b")], choice, true).unwrap();
        assert!(set(ToolChoice::Auto).grammar().is_none());
        let required = set(ToolChoice::Required).grammar().unwrap();
        assert!(required.contains("\"const\":\"a\"") && required.contains("\"const\":\"b\""), "{required}");
        let named = set(ToolChoice::Named("b".into())).grammar().unwrap();
        assert!(!named.contains("\"const\":\"a\"") && named.contains("\"const\":\"b\""), "{named}");
        assert!(Toolset::new("<tool_call>", vec![tool("a")], ToolChoice::None, true).is_none());
    }
}
