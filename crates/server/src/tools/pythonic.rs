//! Pythonic calls, `[get_weather(city="Paris"), get_time()]`: LFM2 writes
//! them between its `<|tool_call_start|>` and `<|tool_call_end|>` tokens,
//! Gemma (as Google's function-calling guide prompts it) in a
//! ```` ```tool_code ```` fence. A block is read when it closes, and each
//! call's keyword arguments become a JSON object.

use serde_json::{Map, Value};

use super::{Body, Marked, Piece};
use crate::params::{CallIn, Tool};

pub(super) struct PyBody {
    text: String,
}

impl Body for PyBody {
    fn feed(&mut self, text: &str, _out: &mut Vec<Piece>) {
        self.text.push_str(text);
    }

    fn end(&mut self, out: &mut Vec<Piece>) -> bool {
        let text = std::mem::take(&mut self.text);
        match parse_calls(&text) {
            Some(calls) if !calls.is_empty() => {
                for (name, args) in calls {
                    out.push(Piece::Call(name));
                    out.push(Piece::Args(Value::Object(args).to_string()));
                }
                true
            }
            _ => false,
        }
    }
}

pub(super) fn parser(open: &'static str, close: &'static str) -> Marked<PyBody> {
    Marked::new(open, close, PyBody { text: String::new() })
}

/// `[f(a=1, b="x"), g()]` (brackets optional) as names and arguments;
/// `None` if it is not that.
fn parse_calls(text: &str) -> Option<Vec<(String, Map<String, Value>)>> {
    let mut p = Py { s: text.trim().as_bytes(), i: 0 };
    let bracketed = p.eat(b'[');
    let mut calls = Vec::new();
    loop {
        p.ws();
        if p.done() || (bracketed && p.peek() == Some(b']')) {
            break;
        }
        let name = p.ident()?;
        p.expect(b'(')?;
        let mut args = Map::new();
        loop {
            p.ws();
            if p.eat(b')') {
                break;
            }
            let key = p.ident()?;
            p.expect(b'=')?;
            args.insert(key, p.value()?);
            p.ws();
            if !p.eat(b',') {
                p.expect(b')')?;
                break;
            }
        }
        calls.push((name, args));
        p.ws();
        if !p.eat(b',') {
            break;
        }
    }
    if bracketed {
        p.expect(b']')?;
    }
    p.ws();
    p.done().then_some(calls)
}

struct Py<'a> {
    s: &'a [u8],
    i: usize,
}

impl Py<'_> {
    fn done(&self) -> bool {
        self.i >= self.s.len()
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn eat(&mut self, b: u8) -> bool {
        self.ws();
        let ok = self.peek() == Some(b);
        self.i += usize::from(ok);
        ok
    }

    fn expect(&mut self, b: u8) -> Option<()> {
        self.eat(b).then_some(())
    }

    fn ident(&mut self) -> Option<String> {
        self.ws();
        let start = self.i;
        while self.peek().is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.') {
            self.i += 1;
        }
        (self.i > start).then(|| String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
    }

    /// A Python literal (JSON's spellings of true/false/null too).
    fn value(&mut self) -> Option<Value> {
        self.ws();
        match self.peek()? {
            q @ (b'"' | b'\'') => self.string(q).map(Value::String),
            b'[' | b'(' => {
                let close = if self.peek() == Some(b'[') { b']' } else { b')' };
                self.i += 1;
                let mut items = Vec::new();
                while !self.eat(close) {
                    items.push(self.value()?);
                    if !self.eat(b',') {
                        self.expect(close)?;
                        break;
                    }
                }
                Some(Value::Array(items))
            }
            b'{' => {
                self.i += 1;
                let mut map = Map::new();
                while !self.eat(b'}') {
                    let key = match self.value()? {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    self.expect(b':')?;
                    map.insert(key, self.value()?);
                    if !self.eat(b',') {
                        self.expect(b'}')?;
                        break;
                    }
                }
                Some(Value::Object(map))
            }
            _ => {
                let start = self.i;
                while self.peek().is_some_and(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+' | b'_')) {
                    self.i += 1;
                }
                let word = std::str::from_utf8(&self.s[start..self.i]).ok()?;
                match word {
                    "True" | "true" => Some(Value::Bool(true)),
                    "False" | "false" => Some(Value::Bool(false)),
                    "None" | "null" => Some(Value::Null),
                    w => serde_json::from_str::<serde_json::Number>(w).ok().map(Value::Number),
                }
            }
        }
    }

    fn string(&mut self, quote: u8) -> Option<String> {
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let b = self.peek()?;
            self.i += 1;
            match b {
                b'\\' => {
                    let e = self.peek()?;
                    self.i += 1;
                    match e {
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'r' => out.push(b'\r'),
                        b'u' => {
                            let hex = std::str::from_utf8(self.s.get(self.i..self.i + 4)?).ok()?;
                            let c = char::from_u32(u32::from_str_radix(hex, 16).ok()?)?;
                            self.i += 4;
                            out.extend_from_slice(c.to_string().as_bytes());
                        }
                        other => out.push(other),
                    }
                }
                b if b == quote => return String::from_utf8(out).ok(),
                b => out.push(b),
            }
        }
    }
}

/// Calls of the tools in `tools` between `open` and `close` (Lark
/// terminals: a quoted string, or a special token's name), one or
/// (`many`) several. Keyword values follow each parameter's schema as
/// JSON, which Python reads too (the parser takes `true` for `True`).
pub(super) fn grammar(tools: &[&Tool], many: bool, open: &str, close: &str) -> String {
    let rest = if many { " (\", \" call)*" } else { "" };
    let mut g = format!("start: {open} \"[\" call{rest} \"]\" {close}\n");
    let calls: Vec<String> = (0..tools.len()).map(|i| format!("c{i}")).collect();
    g.push_str(&format!("call: {}\n", calls.join(" | ")));
    for (i, t) in tools.iter().enumerate() {
        let props = t.parameters.get("properties").and_then(Value::as_object);
        let kws: Vec<String> = props
            .into_iter()
            .flatten()
            .filter(|(k, _)| !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
            .enumerate()
            .map(|(j, (k, schema))| {
                let schema = crate::guide::with_layout(schema, false).unwrap_or_else(|_| serde_json::json!({}));
                g.push_str(&format!("k{i}_{j}: \"{k}=\" %json {schema}\n"));
                format!("k{i}_{j}")
            })
            .collect();
        let args = if kws.is_empty() { String::new() } else { format!(" (a{i} (\", \" a{i})*)?") };
        g.push_str(&format!("c{i}: \"{}(\"{args} \")\"\n", t.name));
        if !kws.is_empty() {
            g.push_str(&format!("a{i}: {}\n", kws.join(" | ")));
        }
    }
    g
}

/// Gemma's tool prompt (after Google's function-calling guide).
pub(super) fn gemma_prompt(tools: &[String]) -> String {
    format!(
        "You have access to functions. If you decide to call any of them, write the calls as a Python list in a tool_code block, \
         and nothing else:\n```tool_code\n[func_name(param=value, ...)]\n```\nThe results come back in a tool_output block.\n\
         The functions, as JSON:\n{}",
        tools.join("\n")
    )
}

/// Past calls as a Python list.
pub(super) fn render(calls: &[CallIn]) -> String {
    let items: Vec<String> = calls
        .iter()
        .map(|c| {
            let args = serde_json::from_str::<Map<String, Value>>(&c.arguments).unwrap_or_default();
            let kws: Vec<String> = args.iter().map(|(k, v)| format!("{k}={}", py(v))).collect();
            format!("{}({})", c.name, kws.join(", "))
        })
        .collect();
    format!("[{}]", items.join(", "))
}

/// A JSON value as a Python literal.
fn py(v: &Value) -> String {
    match v {
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Null => "None".into(),
        Value::Array(a) => format!("[{}]", a.iter().map(py).collect::<Vec<_>>().join(", ")),
        Value::Object(o) => format!("{{{}}}", o.iter().map(|(k, v)| format!("{}: {}", Value::String(k.clone()), py(v))).collect::<Vec<_>>().join(", ")),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::run;
    use super::*;
    use serde_json::json;

    #[test]
    fn lfm2_and_gemma_blocks_become_calls() {
        let mut lfm = parser("<|tool_call_start|>", "<|tool_call_end|>");
        let out = run(&mut lfm, &["Sure. <|tool_call_start|>[get_weather(city=\"Par", "is\", days=3, metric=True), now()]<|tool_call_end|>"]);
        assert_eq!(
            out,
            vec![
                Piece::Text("Sure. ".into()),
                Piece::Call("get_weather".into()),
                Piece::Args(json!({"city": "Paris", "days": 3, "metric": true}).to_string()),
                Piece::Call("now".into()),
                Piece::Args("{}".into()),
            ]
        );
        let mut gemma = parser("```tool_code", "```");
        let out = run(&mut gemma, &["```tool_code\nconvert(amount=200, to='EUR', tags=['a', None])\n```"]);
        assert_eq!(out, vec![Piece::Call("convert".into()), Piece::Args(json!({"amount": 200, "to": "EUR", "tags": ["a", null]}).to_string())]);
        let out = run(&mut parser("```tool_code", "```"), &["```tool_code\nprint(1 +)\n```"]);
        assert_eq!(out, vec![Piece::Text("```tool_code\nprint(1 +)\n```".into())]);
    }

    #[test]
    fn past_calls_render_as_python() {
        let c = CallIn { id: "x".into(), name: "f".into(), arguments: r#"{"a": "b", "ok": false, "n": [1, null]}"#.into() };
        assert_eq!(render(&[c]), "[f(a=\"b\", ok=False, n=[1, None])]");
    }
}
