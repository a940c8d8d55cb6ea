//! JSON call objects, `{"name": "f", "arguments": {...}}`, as they stream:
//! the call is announced once its name is read, and its arguments go out
//! as they arrive. An object written another way (arguments first, say)
//! is read whole when it closes.

use serde_json::Value;

use super::Piece;

/// Reads one call object at a time; `args_keys` name the arguments
/// member (`arguments`, or Llama's `parameters`).
pub struct JsonCalls {
    args_keys: &'static [&'static str],
    /// The current object's text so far.
    raw: String,
    state: State,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// No object open.
    Between,
    /// Reading up to the arguments' first byte.
    Head,
    /// Inside the arguments, streamed from `from` on.
    Args { from: usize, scan: Scan },
    /// The arguments are out; the object's own `}` is still to come.
    Tail { scan: Scan },
    /// Not in the usual order: the whole object is read first.
    Whole { scan: Scan },
}

/// Nesting over JSON text: depth, and whether inside a string.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Scan {
    at: usize,
    depth: usize,
    in_str: bool,
    esc: bool,
}

impl Scan {
    /// Scan `text` from `self.at`; the index just past the byte that
    /// brings the depth back to `floor`, if one does.
    fn run(&mut self, text: &str, floor: usize) -> Option<usize> {
        let bytes = text.as_bytes();
        while self.at < bytes.len() {
            let b = bytes[self.at];
            self.at += 1;
            if self.in_str {
                match (self.esc, b) {
                    (true, _) => self.esc = false,
                    (false, b'\\') => self.esc = true,
                    (false, b'"') => self.in_str = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => self.in_str = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == floor {
                        return Some(self.at);
                    }
                }
                _ => {}
            }
        }
        None
    }
}

/// Where the usual head `{"name": "f", "<key>": ` stands in `raw`.
enum Head {
    Incomplete,
    /// Not this shape.
    Other,
    /// The name, and where the arguments start.
    Found(String, usize),
}

fn head(raw: &str, keys: &[&str]) -> Head {
    let mut p = Lex { s: raw.as_bytes(), i: 0, failed: false };
    let steps = (|| {
        p.lit(b"{")?;
        p.lit(b"\"name\"")?;
        p.lit(b":")?;
        let name = p.name()?;
        p.lit(b",")?;
        let key_ok = keys.iter().map(|k| format!("\"{k}\"")).any(|k| p.peek_lit(k.as_bytes()));
        if !key_ok {
            // A partial key may still become one of them.
            return if keys.iter().any(|k| format!("\"{k}\"").as_bytes().starts_with(p.rest_trimmed())) { Some(Err(true)) } else { Some(Err(false)) };
        }
        p.lit(b":")?;
        p.ws();
        if p.i >= p.s.len() {
            return None;
        }
        Some(Ok((name, p.i)))
    })();
    match steps {
        None if p.failed => Head::Other,
        None => Head::Incomplete,
        Some(Err(true)) => Head::Incomplete,
        Some(Err(false)) => Head::Other,
        Some(Ok((name, at))) => Head::Found(name, at),
    }
}

/// A tiny matcher over the head: `None` means the text ran out (or, with
/// `failed` set, did not match).
struct Lex<'a> {
    s: &'a [u8],
    i: usize,
    failed: bool,
}

impl Lex<'_> {
    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
    }

    fn rest_trimmed(&self) -> &[u8] {
        let mut j = self.i;
        while self.s.get(j).is_some_and(u8::is_ascii_whitespace) {
            j += 1;
        }
        &self.s[j..]
    }

    fn peek_lit(&mut self, lit: &[u8]) -> bool {
        let save = self.i;
        let ok = self.lit(lit).is_some();
        if !ok {
            self.i = save;
            self.failed = false;
        }
        ok
    }

    fn lit(&mut self, lit: &[u8]) -> Option<()> {
        self.ws();
        let rest = &self.s[self.i..];
        if rest.starts_with(lit) {
            self.i += lit.len();
            Some(())
        } else {
            self.failed = !lit.starts_with(rest);
            None
        }
    }

    /// A string without escapes (function names have none).
    fn name(&mut self) -> Option<String> {
        self.lit(b"\"")?;
        let start = self.i;
        while let Some(&b) = self.s.get(self.i) {
            match b {
                b'"' => {
                    self.i += 1;
                    return Some(String::from_utf8_lossy(&self.s[start..self.i - 1]).into_owned());
                }
                b'\\' => {
                    self.failed = true;
                    return None;
                }
                _ => self.i += 1,
            }
        }
        None
    }
}

impl JsonCalls {
    pub fn new(args_keys: &'static [&'static str]) -> JsonCalls {
        JsonCalls { args_keys, raw: String::new(), state: State::Between }
    }

    /// No object is open.
    pub fn between(&self) -> bool {
        self.state == State::Between
    }

    /// Start an object at its `{` (the caller saw it).
    pub fn open(&mut self) {
        self.raw.clear();
        self.state = State::Head;
    }

    /// Feed text of the open object; returns how much of `text` it took
    /// (all of it, unless the object closed inside it).
    pub fn push(&mut self, text: &str, out: &mut Vec<Piece>) -> usize {
        let base = self.raw.len();
        self.raw.push_str(text);
        loop {
            match self.state {
                State::Between => return text.len(),
                State::Head => match head(&self.raw, self.args_keys) {
                    Head::Incomplete => return text.len(),
                    Head::Other => self.state = State::Whole { scan: Scan::default() },
                    Head::Found(name, at) => {
                        out.push(Piece::Call(name));
                        if matches!(self.raw.as_bytes()[at], b'{' | b'[') {
                            self.state = State::Args { from: at, scan: Scan { at, ..Scan::default() } };
                        } else {
                            // Arguments that are not an object: read whole.
                            out.pop();
                            self.state = State::Whole { scan: Scan::default() };
                        }
                    }
                },
                State::Args { from, mut scan } => match scan.run(&self.raw, 0) {
                    None => {
                        if self.raw.len() > from {
                            out.push(Piece::Args(self.raw[from..].to_string()));
                        }
                        self.state = State::Args { from: self.raw.len(), scan };
                        return text.len();
                    }
                    Some(end) => {
                        out.push(Piece::Args(self.raw[from..end].to_string()));
                        // Back inside the call object itself.
                        self.state = State::Tail { scan: Scan { depth: 1, ..scan } };
                    }
                },
                State::Tail { mut scan } | State::Whole { mut scan } => {
                    let whole = matches!(self.state, State::Whole { .. });
                    match scan.run(&self.raw, 0) {
                        None => {
                            self.state = if whole { State::Whole { scan } } else { State::Tail { scan } };
                            return text.len();
                        }
                        Some(end) => {
                            if whole {
                                self.read_whole(&self.raw[..end], out);
                            }
                            self.state = State::Between;
                            return end.saturating_sub(base);
                        }
                    }
                }
            }
        }
    }

    /// The text ended inside an object: the text of one that never
    /// announced its call (it is content after all).
    pub fn finish(&mut self) -> Option<String> {
        let open = matches!(self.state, State::Head | State::Whole { .. });
        self.state = State::Between;
        let raw = std::mem::take(&mut self.raw);
        (open && !raw.is_empty()).then_some(raw)
    }

    fn read_whole(&self, raw: &str, out: &mut Vec<Piece>) {
        let v: Option<Value> = serde_json::from_str(raw).ok();
        let name = v.as_ref().and_then(|v| v.get("name")).and_then(Value::as_str);
        let args = v.as_ref().and_then(|v| self.args_keys.iter().find_map(|k| v.get(*k)));
        match (name, args) {
            (Some(name), Some(args)) => {
                out.push(Piece::Call(name.to_string()));
                let text = match args {
                    // Arguments given as a JSON string already.
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                out.push(Piece::Args(text));
            }
            _ => out.push(Piece::Text(raw.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(parts: &[&str]) -> (Vec<Piece>, Vec<usize>) {
        let mut c = JsonCalls::new(&["arguments"]);
        c.open();
        let mut out = Vec::new();
        let taken = parts.iter().map(|p| c.push(p, &mut out)).collect();
        out.extend(c.finish().map(Piece::Text));
        (out, taken)
    }

    #[test]
    fn the_call_is_announced_at_its_name_and_arguments_stream() {
        let (out, taken) = feed(&["{\"na", "me\": \"get_", "weather\", \"argu", "ments\": {\"city\": \"Pa", "ris}\", \"n\": [1", "]}} tail"]);
        assert_eq!(out[0], Piece::Call("get_weather".into()));
        let args: String = out[1..].iter().map(|p| if let Piece::Args(a) = p { a.as_str() } else { panic!("{p:?}") }).collect();
        assert_eq!(args, "{\"city\": \"Paris}\", \"n\": [1]}");
        assert!(out.len() > 2, "the arguments came in one piece");
        assert_eq!(taken.last(), Some(&3), "the object ends at its own closing brace");
    }

    #[test]
    fn other_orders_are_read_whole_and_junk_is_text() {
        let (out, _) = feed(&["{\"arguments\": {\"a\": 1}, ", "\"name\": \"f\"}"]);
        assert_eq!(out, vec![Piece::Call("f".into()), Piece::Args("{\"a\":1}".into())]);
        let (out, _) = feed(&["{\"answer\": 42"]);
        assert_eq!(out, vec![Piece::Text("{\"answer\": 42".into())]);
    }
}
