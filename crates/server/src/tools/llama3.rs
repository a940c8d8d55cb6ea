//! Llama 3.1 / 3.2 JSON calls, as their templates ask for them: the whole
//! reply is `{"name": "f", "parameters": {...}}` (after an optional
//! `<|python_tag|>`), several separated by `;`. A reply that does not
//! begin with `{` is content.

use super::hermes::JsonBody;
use super::{Body, CallParser, Piece};
use crate::params::CallIn;

const TAG: &str = "<|python_tag|>";

pub struct Llama3 {
    /// Whether the reply is calls; unknown until its first visible byte.
    calls: Option<bool>,
    /// The reply so far while undecided, and all of it once it is calls.
    head: String,
    body: JsonBody,
}

impl Default for Llama3 {
    fn default() -> Llama3 {
        Llama3 { calls: None, head: String::new(), body: JsonBody::new(&["parameters", "arguments"]) }
    }
}

impl CallParser for Llama3 {
    fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        match self.calls {
            Some(true) => {
                // Kept, in case no call comes of it.
                self.head.push_str(text);
                return self.body.feed(text, out);
            }
            Some(false) => return out.push(Piece::Text(text.to_string())),
            None => self.head.push_str(text),
        }
        let start = self.head.trim_start();
        let rest = start.strip_prefix(TAG).unwrap_or(start).trim_start();
        if rest.is_empty() || TAG.starts_with(start) {
            return;
        }
        let is_calls = rest.starts_with('{');
        self.calls = Some(is_calls);
        if is_calls {
            let from = self.head.len() - rest.len();
            let calls = self.head[from..].to_string();
            self.body.feed(&calls, out);
        } else {
            out.push(Piece::Text(std::mem::take(&mut self.head)));
        }
    }

    fn finish(&mut self, out: &mut Vec<Piece>) {
        let head = std::mem::take(&mut self.head);
        if self.calls == Some(true) {
            if !self.body.end(out) {
                out.push(Piece::Text(head));
            }
        } else if !head.is_empty() {
            out.push(Piece::Text(head));
        }
    }
}

/// One call object, or (`many`) several joined by `; `.
pub(super) fn grammar(schema: &serde_json::Value, many: bool) -> String {
    let rest = if many { " (\"; \" call)*" } else { "" };
    format!("start: call{rest}\ncall: %json {schema}\n")
}

pub(super) fn render(calls: &[CallIn]) -> String {
    let objs: Vec<String> =
        calls.iter().map(|c| format!("{{\"name\": {}, \"parameters\": {}}}", serde_json::Value::String(c.name.clone()), c.arguments.trim())).collect();
    objs.join("; ")
}

#[cfg(test)]
mod tests {
    use super::super::tests::run;
    use super::*;

    #[test]
    fn a_reply_of_objects_is_calls_and_prose_is_content() {
        let out =
            run(&mut Llama3::default(), &["  <|python_", "tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; ", "{\"name\": \"b\", \"parameters\": {}}"]);
        assert_eq!(out, vec![Piece::Call("a".into()), Piece::Args("{\"x\": 1}".into()), Piece::Call("b".into()), Piece::Args("{}".into())]);
        assert_eq!(run(&mut Llama3::default(), &["It is ", "{sunny}"]), vec![Piece::Text("It is {sunny}".into())]);
    }
}
