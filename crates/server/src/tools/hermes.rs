//! Hermes-style calls, as Qwen2.5 / Qwen3 / Hermes templates teach them:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! one block per call. Also braid's form for templates that know no tools.

use super::json_call::JsonCalls;
use super::{Body, Marked, Piece};
use crate::params::CallIn;

pub(super) const OPEN: &str = "<tool_call>";
pub(super) const CLOSE: &str = "</tool_call>";

/// The calls of one block: JSON objects, streamed.
pub(super) struct JsonBody {
    calls: JsonCalls,
    announced: bool,
}

impl JsonBody {
    pub(super) fn new(args_keys: &'static [&'static str]) -> JsonBody {
        JsonBody { calls: JsonCalls::new(args_keys), announced: false }
    }
}

impl Body for JsonBody {
    fn feed(&mut self, mut text: &str, out: &mut Vec<Piece>) {
        let before = out.len();
        while !text.is_empty() {
            if self.calls.between() {
                // Between objects only the next `{` counts.
                match text.find('{') {
                    Some(i) => text = &text[i..],
                    None => break,
                }
                self.calls.open();
            }
            let taken = self.calls.push(text, out);
            text = &text[taken..];
        }
        self.announced |= out[before..].iter().any(|p| matches!(p, Piece::Call(_)));
    }

    fn end(&mut self, _out: &mut Vec<Piece>) -> bool {
        // An unfinished object is dropped: the block as a whole goes out
        // as content if no call came of it.
        let _ = self.calls.finish();
        std::mem::take(&mut self.announced)
    }
}

pub(super) fn parser() -> Marked<JsonBody> {
    Marked::new(OPEN, CLOSE, JsonBody::new(&["arguments"]))
}

/// `schema` (one call object) in blocks, one or (`many`) several.
pub(super) fn grammar(schema: &serde_json::Value, many: bool) -> String {
    let rest = if many { " (\"\\n\" call)*" } else { "" };
    format!("start: call{rest}\ncall: \"{OPEN}\\n\" %json {schema} \"\\n{CLOSE}\"\n")
}

/// The tools, for a template that does not show them.
pub(super) fn prompt(tools: &[String]) -> String {
    format!(
        "# Tools\n\nYou may call functions to answer the user. Their signatures, one JSON object per line:\n<tools>\n{}\n</tools>\n\n\
         To call a function, write a JSON object with its name and arguments between <tool_call></tool_call> tags:\n\
         {OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}",
        tools.join("\n")
    )
}

/// Past calls, as the model would have written them.
pub(super) fn render(calls: &[CallIn]) -> String {
    let blocks: Vec<String> = calls
        .iter()
        .map(|c| {
            let name = serde_json::Value::String(c.name.clone());
            format!("{OPEN}\n{{\"name\": {name}, \"arguments\": {}}}\n{CLOSE}", c.arguments.trim())
        })
        .collect();
    blocks.join("\n")
}

#[cfg(test)]
mod tests {
    use super::super::tests::run;
    use super::*;

    #[test]
    fn calls_between_tags_become_pieces_and_the_rest_is_content() {
        let out = run(
            &mut parser(),
            &[
                "Let me check.\n<tool",
                "_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Pa",
                "ris\"}}\n</tool_call>\n<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>",
            ],
        );
        assert_eq!(
            out,
            vec![
                Piece::Text("Let me check.\n".into()),
                Piece::Call("weather".into()),
                Piece::Args("{\"city\": \"Paris\"}".into()),
                Piece::Text("\n".into()),
                Piece::Call("time".into()),
                Piece::Args("{}".into()),
            ]
        );
    }

    #[test]
    fn text_that_only_looks_like_a_call_stays_content() {
        assert_eq!(run(&mut parser(), &["a < b and <tool", "_c"]), vec![Piece::Text("a < b and <tool_c".into())]);
        assert_eq!(run(&mut parser(), &["<tool_call>not json</tool_call>"]), vec![Piece::Text("<tool_call>not json</tool_call>".into())]);
        // Cut off inside the arguments (max_tokens): the call stands, its
        // arguments as far as they came.
        assert_eq!(
            run(&mut parser(), &["<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": "]),
            vec![Piece::Call("f".into()), Piece::Args("{\"a\": ".into())]
        );
    }
}
