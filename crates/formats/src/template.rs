//! Chat templates: the Jinja template a model ships (`tokenizer.chat_template`
//! in a GGUF, `chat_template` in `tokenizer_config.json`), rendered with
//! minijinja the way Hugging Face transformers renders it:
//!
//! * `trim_blocks` and `lstrip_blocks` on (transformers sets both);
//! * Python string/dict methods (`.strip()`, `.startswith()`, `.items()`, ...)
//!   through minijinja-contrib's pycompat;
//! * `raise_exception(msg)` fails the render with `msg`;
//! * `strftime_now(fmt)` formats the current UTC time;
//! * `tojson` writes JSON as Python's `json.dumps(ensure_ascii=False)` does
//!   (`", "` and `": "` separators, `indent=`, `sort_keys=`), not HTML-escaped.
//!
//! The context holds `messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token`, and any extra variables the caller passes.

use std::fmt::Write as _;

use anyhow::{anyhow, Result};
use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Deserializer, Serialize};

use crate::gguf::Gguf;
use crate::tokenizer::Tokenizer;

const NAME: &str = "chat template";

/// One chat message.
///
/// Deserializes from OpenAI-style JSON: `content` may be a string, null, or a
/// list of parts, whose `text` parts are joined.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default, deserialize_with = "content_text")]
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

fn content_text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Content {
        Text(String),
        Parts(Vec<Part>),
        Null(()),
    }
    #[derive(Deserialize)]
    struct Part {
        #[serde(rename = "type")]
        kind: Option<String>,
        text: Option<String>,
    }
    Ok(match Content::deserialize(d)? {
        Content::Text(s) => s,
        Content::Null(()) => String::new(),
        Content::Parts(parts) => {
            let mut out = String::new();
            for p in parts {
                if let (None | Some("text"), Some(t)) = (p.kind.as_deref(), p.text) {
                    out.push_str(&t);
                } else {
                    return Err(serde::de::Error::custom("only text parts are supported in message content"));
                }
            }
            out
        }
    })
}

/// A compiled chat template. `Send + Sync`.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("source_len", &self.source.len()).finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`. A syntax error is returned with its line.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| anyhow!("chat template syntax config: {e}"))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_owned()).map_err(|e| describe(&e, source))?;
        Ok(ChatTemplate { env, source: source.to_owned(), bos_token: bos_token.to_owned(), eos_token: eos_token.to_owned() })
    }

    /// The GGUF's `tokenizer.chat_template`, with the tokenizer's BOS/EOS
    /// texts; `None` when the file has none.
    pub fn from_gguf(g: &Gguf, tok: &Tokenizer) -> Result<Option<ChatTemplate>> {
        let Some(src) = g.opt_str("tokenizer.chat_template")? else {
            return Ok(None);
        };
        let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("");
        ChatTemplate::new(src, text(tok.bos()), text(tok.eos())).map(Some).map_err(|e| anyhow!("{}: {e:#}", g.path().display()))
    }

    /// The `chat_template` of a parsed `tokenizer_config.json` (a string, or
    /// a list of `{name, template}` of which "default" is taken), with its
    /// `bos_token` / `eos_token`; `None` when it has none. (Newer repositories
    /// ship `chat_template.jinja` instead: pass its text to [`new`](Self::new).)
    pub fn from_tokenizer_config(config: &serde_json::Value) -> Result<Option<ChatTemplate>> {
        let src = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.as_str(),
            Some(serde_json::Value::Array(list)) => {
                let named = |want: &str| list.iter().find(|t| t.get("name").and_then(|n| n.as_str()) == Some(want));
                let Some(t) = named("default").or_else(|| list.first()) else {
                    return Ok(None);
                };
                t.get("template").and_then(|s| s.as_str()).ok_or_else(|| anyhow!("tokenizer_config chat_template entry has no `template` string"))?
            }
            Some(other) => return Err(anyhow!("tokenizer_config chat_template is neither a string nor a list: {other}")),
        };
        let token = |key: &str| {
            let v = config.get(key);
            v.and_then(|v| v.as_str().or_else(|| v.get("content")?.as_str())).unwrap_or("")
        };
        ChatTemplate::new(src, token("bos_token"), token("eos_token")).map(Some)
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the prompt for `messages`; with `add_generation_prompt` it
    /// ends with the opening of the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// Like [`render`](Self::render), with messages of any shape (tool calls,
    /// structured content: anything serializable) and extra context variables
    /// (`tools`, `enable_thinking`, ...).
    pub fn render_with<M: Serialize>(&self, messages: &[M], add_generation_prompt: bool, extra: &serde_json::Map<String, serde_json::Value>) -> Result<String> {
        let mut ctx: std::collections::BTreeMap<String, Value> = extra.iter().map(|(k, v)| (k.clone(), Value::from(Serde(v)))).collect();
        ctx.insert("messages".into(), Value::from(Serde(messages)));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        ctx.insert("bos_token".into(), Value::from(self.bos_token.as_str()));
        ctx.insert("eos_token".into(), Value::from(self.eos_token.as_str()));
        let tmpl = self.env.get_template(NAME).map_err(|e| describe(&e, &self.source))?;
        tmpl.render(ctx).map_err(|e| describe(&e, &self.source))
    }
}

/// Templates known by name, for models that ship none (a base model) or
/// ship a wrong one: `--chat-template NAME`.
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "chatml",
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    ),
    (
        "llama3",
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}\
         {% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    ),
    (
        "gemma",
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m.role == 'assistant' else 'user' %}\
         <start_of_turn>{{ role }}\n{% if m.role == 'system' %}{{ m.content | trim }}\n\n{% else %}{{ m.content | trim }}<end_of_turn>\n{% endif %}{% endfor %}\
         {% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    ),
    (
        "plain",
        "{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}\n\n{% else %}{{ m.role | capitalize }}: {{ m.content }}\n{% endif %}{% endfor %}\
         {% if add_generation_prompt %}Assistant:{% endif %}",
    ),
];

/// The file a model folder (or a model file's folder) may hold its
/// template in, as newer Hugging Face repositories ship it.
pub const TEMPLATE_FILE: &str = "chat_template.jinja";

/// Where the template a model is served with came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TemplateSource {
    /// `--chat-template FILE`, or `chat_template.jinja` beside the model.
    File(std::path::PathBuf),
    /// `--chat-template NAME`, one of [`BUILTIN`].
    Builtin(&'static str),
    /// The model's own (GGUF metadata, `tokenizer_config.json`).
    Model,
    /// None at all: chat requests are refused.
    None,
}

impl std::fmt::Display for TemplateSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TemplateSource::File(p) => write!(f, "file {}", p.display()),
            TemplateSource::Builtin(n) => write!(f, "builtin {n}"),
            TemplateSource::Model => f.write_str("model"),
            TemplateSource::None => f.write_str("none"),
        }
    }
}

/// The template a model is served with, first found of: `flag` (a file,
/// or a [`BUILTIN`] name), `chat_template.jinja` beside the model (inside
/// a model folder, or in a model file's folder), the model's own `own`.
/// `tok` gives the BOS/EOS texts.
pub fn select(flag: Option<&str>, model: &std::path::Path, own: Option<ChatTemplate>, tok: &Tokenizer) -> Result<(Option<ChatTemplate>, TemplateSource)> {
    let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_string();
    let (bos, eos) = (text(tok.bos()), text(tok.eos()));
    let from_file = |path: &std::path::Path| -> Result<(Option<ChatTemplate>, TemplateSource)> {
        let src = std::fs::read_to_string(path).map_err(|e| anyhow!("could not read the chat template {}: {e}", path.display()))?;
        let t = ChatTemplate::new(&src, &bos, &eos).map_err(|e| anyhow!("{}: {e:#}", path.display()))?;
        Ok((Some(t), TemplateSource::File(path.to_path_buf())))
    };
    if let Some(flag) = flag {
        let path = std::path::Path::new(flag);
        if path.is_file() {
            return from_file(path);
        }
        let Some(&(name, src)) = BUILTIN.iter().find(|(n, _)| *n == flag) else {
            let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
            return Err(anyhow!("--chat-template {flag}: no such file, and not a built-in template ({})", names.join(", ")));
        };
        return Ok((Some(ChatTemplate::new(src, &bos, &eos)?), TemplateSource::Builtin(name)));
    }
    let dir = if model.is_dir() { Some(model) } else { model.parent() };
    if let Some(beside) = dir.map(|d| d.join(TEMPLATE_FILE)).filter(|p| p.is_file()) {
        return from_file(&beside);
    }
    Ok(match own {
        Some(t) => (Some(t), TemplateSource::Model),
        None => (None, TemplateSource::None),
    })
}

/// An error message that says what went wrong and where in the template.
fn describe(e: &Error, source: &str) -> anyhow::Error {
    // The template's own message says what is wrong; no location needed.
    if let (ErrorKind::InvalidOperation, Some(d)) = (e.kind(), e.detail()) {
        if d.starts_with(RAISED) {
            return anyhow!("chat template: {d}");
        }
    }
    let what = match e.detail() {
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    };
    let mut msg = format!("chat template: {what}");
    if let Some(line) = e.line() {
        let text = source.lines().nth(line.saturating_sub(1)).unwrap_or("").trim();
        let mut shown: String = text.chars().take(100).collect();
        if shown.len() < text.len() {
            shown.push('…');
        }
        let _ = write!(msg, " (line {line}: `{shown}`)");
    }
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        let _ = write!(msg, ": {s}");
        src = s.source();
    }
    anyhow!(msg)
}

const RAISED: &str = "the template raised an exception: ";

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{msg}")))
}

fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    Ok(Value::from(strftime(&format, secs)))
}

/// Formats a Unix time (UTC) with the common strftime directives; an
/// unknown directive is written as is.
pub fn strftime(format: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (h, mi, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    // Civil date from days since 1970-01-01 (proleptic Gregorian; eras of 400 years).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wday = (days + 3).rem_euclid(7); // 1970-01-01 was a Thursday; 0 = Monday
    let month = MONTHS[(m - 1) as usize];
    let day = DAYS[wday as usize];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{y}"),
            Some('y') => write!(out, "{:02}", y.rem_euclid(100)),
            Some('m') => write!(out, "{m:02}"),
            Some('d') => write!(out, "{d:02}"),
            Some('e') => write!(out, "{d:2}"),
            Some('H') => write!(out, "{h:02}"),
            Some('I') => write!(out, "{:02}", if h % 12 == 0 { 12 } else { h % 12 }),
            Some('p') => write!(out, "{}", if h < 12 { "AM" } else { "PM" }),
            Some('M') => write!(out, "{mi:02}"),
            Some('S') => write!(out, "{s:02}"),
            Some('j') => write!(out, "{yday:03}"),
            Some('B') => write!(out, "{month}"),
            Some('b') | Some('h') => write!(out, "{}", &month[..3]),
            Some('A') => write!(out, "{day}"),
            Some('a') => write!(out, "{}", &day[..3]),
            Some('F') => write!(out, "{y}-{m:02}-{d:02}"),
            Some('T') => write!(out, "{h:02}:{mi:02}:{s:02}"),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False,
/// indent=indent, separators=separators, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")),
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let json = serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: cannot serialize: {e}")))?;
    let style = JsonStyle { indent, item_sep, key_sep, sort_keys: sort_keys.unwrap_or(false) };
    let mut out = String::new();
    write_json(&mut out, &json, &style, 0);
    Ok(Value::from_safe_string(out))
}

struct JsonStyle {
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn write_json(out: &mut String, v: &serde_json::Value, st: &JsonStyle, depth: usize) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = st.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Number(n) => {
            let _ = write!(out, "{n}");
        }
        J::String(s) => write_json_str(out, s),
        J::Array(a) if a.is_empty() => out.push_str("[]"),
        J::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(&st.item_sep);
                }
                newline(out, depth + 1);
                write_json(out, x, st, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(m) if m.is_empty() => out.push_str("{}"),
        J::Object(m) => {
            let mut entries: Vec<(&String, &J)> = m.iter().collect();
            if st.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&st.item_sep);
                }
                newline(out, depth + 1);
                write_json_str(out, k);
                out.push_str(&st.key_sep);
                write_json(out, x, st, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
    }
}

fn write_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_takes_the_flag_then_the_file_beside_then_the_models_own() {
        use crate::tokenizer::GgufTokenizerSpec;
        let tokens = ["<s>", "</s>", "a"].map(String::from).to_vec();
        let spec = GgufTokenizerSpec {
            model: "gpt2".into(),
            tokens,
            token_types: Some(vec![3, 3, 1]),
            merges: Some(Vec::new()),
            bos: Some(0),
            eos: Some(1),
            ..Default::default()
        };
        let tok = Tokenizer::from_spec(spec).unwrap();
        let dir = std::env::temp_dir().join(format!("braid-template-select-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("model.gguf");
        let own = || Some(ChatTemplate::new("own", "", "").unwrap());
        let pick = |flag: Option<&str>, own: Option<ChatTemplate>| select(flag, &model, own, &tok).map(|(t, s)| (t.map(|t| t.source().to_string()), s));

        assert_eq!(pick(None, own()).unwrap(), (Some("own".into()), TemplateSource::Model));
        assert_eq!(pick(None, None).unwrap(), (None, TemplateSource::None));
        let beside = dir.join(TEMPLATE_FILE);
        std::fs::write(&beside, "{{ bos_token }}beside").unwrap();
        let (t, s) = select(None, &model, own(), &tok).unwrap();
        assert_eq!(s, TemplateSource::File(beside.clone()));
        assert_eq!(t.unwrap().render(&[ChatMessage::new("user", "x")], false).unwrap(), "<s>beside", "BOS text from the tokenizer");
        assert_eq!(pick(Some("chatml"), own()).unwrap().1, TemplateSource::Builtin("chatml"));
        let other = dir.join("other.jinja");
        std::fs::write(&other, "other").unwrap();
        assert_eq!(pick(Some(other.to_str().unwrap()), own()).unwrap(), (Some("other".into()), TemplateSource::File(other.clone())));
        let e = pick(Some("nope"), own()).unwrap_err().to_string();
        assert!(e.contains("nope") && e.contains("chatml, llama3, gemma, plain"), "{e}");
        std::fs::write(&other, "{% if %}").unwrap();
        let e = pick(Some(other.to_str().unwrap()), own()).unwrap_err().to_string();
        assert!(e.contains("other.jinja"), "a broken file is named: {e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn builtin_templates_compile_and_render() {
        for (name, src) in BUILTIN {
            let t = ChatTemplate::new(src, "<s>", "</s>").unwrap_or_else(|e| panic!("{name}: {e:#}"));
            let msgs = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")];
            let text = t.render(&msgs, true).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert!(text.contains("Hi") && text.contains("Be brief."), "{name}: {text}");
        }
        let chatml = ChatTemplate::new(BUILTIN[0].1, "", "").unwrap();
        assert_eq!(chatml.render(&[ChatMessage::new("user", "Hi")], true).unwrap(), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(strftime("%A %B %j %I%p %%", t), "Thursday February 060 01PM %");
        assert_eq!(strftime("%F %T", 0), "1970-01-01 00:00:00");
        assert_eq!(strftime("%a", 0), "Thu");
        // 1969-12-31 23:59:59, before the epoch.
        assert_eq!(strftime("%F %T %a", -1), "1969-12-31 23:59:59 Wed");
    }
}
