//! Structured outputs over llguidance: the model's vocabulary as a token
//! trie, request grammars (JSON schemas, Lark, regexes) compiled into the
//! engine's [`Guide`], and llguidance's matcher as the engine's
//! [`Constraint`].
//!
//! The trie holds each token's bytes as braid's tokenizer decodes them
//! (byte-level BPE characters mapped back to bytes, SentencePiece `▁` as a
//! space and `<0xXX>` as that byte), and control tokens as llguidance's
//! special-token spelling (`\xff` + their text), so a grammar can name
//! them (`<|tool_call_start|>`) and no JSON string can hold one. Bytes a
//! grammar forces are tokenized by the model's own tokenizer where it can
//! tokenize a piece on its own (byte-level BPE); elsewhere llguidance
//! leaves the choice to the model, under the mask.

use std::sync::Arc;

use anyhow::{anyhow, Result};
use braid_engine::{Constraint, Grammar, Guide, TokenMask};
use braid_formats::tokenizer::{TokenKind, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{json, Value};

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum Spec {
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// JSON valid under `schema`. `strict` refuses schema keywords the
    /// grammar cannot enforce (a 400) instead of ignoring them.
    JsonSchema { schema: Value, strict: bool },
    /// A grammar in llguidance's Lark dialect (tool calls, `grammar`).
    Lark(String),
    /// A regular expression the whole output matches (`regex`).
    Regex(String),
}

/// The JSON layout the grammar writes: OpenAI's separators and no free
/// whitespace, so a small model cannot wander in blank space.
pub fn json_layout() -> Value {
    json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false})
}

/// `schema` with braid's JSON layout, unless it sets its own (`x-guidance`),
/// and `lenient` (ignore keywords the grammar cannot enforce) unless strict.
pub fn with_layout(schema: &Value, strict: bool) -> Result<Value, String> {
    let Value::Object(map) = schema else {
        return Err("the schema must be a JSON object".into());
    };
    let mut map = map.clone();
    if !map.contains_key("x-guidance") {
        let mut opts = json_layout();
        opts["lenient"] = Value::Bool(!strict);
        map.insert("x-guidance".into(), opts);
    }
    Ok(Value::Object(map))
}

/// Compiles grammars for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// The trie of `tok`'s vocabulary; `stop_ids` are the tokens that end
    /// a generation (allowed where the grammar is complete).
    pub fn new(tok: &Arc<Tokenizer>, stop_ids: &[u32]) -> Result<Grammars> {
        Self::with_slices(tok, stop_ids, &slices())
    }

    fn with_slices(tok: &Arc<Tokenizer>, stop_ids: &[u32], slices: &[String]) -> Result<Grammars> {
        let n = tok.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| match tok.kind(id) {
                Some(TokenKind::Control | TokenKind::Unknown) => {
                    let text = tok.token_text(id).unwrap_or("");
                    if text.is_empty() {
                        Vec::new()
                    } else {
                        [&[TokTrie::SPECIAL_TOKEN_MARKER][..], text.as_bytes()].concat()
                    }
                }
                _ => tok.token_bytes(id).to_vec(),
            })
            .collect();
        let eos = tok.eos().or_else(|| stop_ids.first().copied()).ok_or_else(|| anyhow!("the tokenizer names no end-of-text token"))?;
        let info = TokRxInfo { tok_bos: tok.bos(), ..TokRxInfo::new(n as u32, eos) };
        let mut ends = stop_ids.to_vec();
        if ends.is_empty() {
            ends.push(eos);
        }
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&ends);
        let env: TokEnv = Arc::new(Vocab { canonical: tok.encode_piece("a").is_some(), trie, tok: tok.clone() });
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), slices)?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A guide for `spec`, or why llguidance refuses it.
    pub fn compile(&self, spec: &Spec) -> Result<Guide, String> {
        let grammar = match spec {
            Spec::JsonObject => TopLevelGrammar::from_json_schema(with_layout(&json!({"type": "object"}), false)?),
            Spec::JsonSchema { schema, strict } => TopLevelGrammar::from_json_schema(with_layout(schema, *strict)?),
            Spec::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
            Spec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| format!("{e:#}"))?;
        // A grammar whose start fails (nothing it could produce), or whose
        // forced opening does (a schema no finite JSON satisfies forces
        // `{"c": {"c": ...` past the parser's limits), is the request's
        // fault, found now rather than mid-stream. The library's message
        // goes on with its parser state: the first line says it.
        let mut probe = Matcher::new(Ok(parser.clone()));
        if probe.get_error().is_none() {
            probe.consume_ff_tokens();
        }
        if let Some(e) = probe.get_error() {
            return Err(e.lines().next().unwrap_or_default().to_string());
        }
        Ok(Guide::new(Compiled(parser)))
    }
}

/// The token slices whose masks llguidance computes once and applies
/// whole where a JSON string's body allows every token of the slice: its
/// own (string pieces of up to 10 and 30 characters, any, whitespace),
/// and pieces of each length up to 8, one of which fits what is left of a
/// string shorter than 10 characters, so only longer tokens are walked.
/// Under `bench_guided.py`'s strings of 3-8 characters, tokens drawn
/// uniformly from each mask (a random-weight model's pick), 425 masks:
/// SmolLM2's 49k tokens mean 159 -> 139 µs, p90 578 -> 405 against pieces
/// of 4 and 8 only; Qwen2.5's 151k mean 543 -> 434 µs, p90 1,586 -> 1,152.
/// The parser factory takes ~35 ms (SmolLM2) to ~130 ms (Qwen2.5) longer
/// to build, once a model.
fn slices() -> Vec<String> {
    let mut s = SlicedBiasComputer::json_slices();
    s.extend((1..=8).map(|n| format!(r#"[^"\\\x00-\x1F\x7F]{{1,{n}}}"#)));
    s
}

/// The tokenizer as llguidance sees it.
struct Vocab {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
    canonical: bool,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s).ok().and_then(|t| self.tok.encode_piece(t)) {
            Some(ids) => ids,
            None => self.trie.greedy_tokenize(s),
        }
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

/// A compiled grammar; each stream follows a clone of its fresh parser
/// (clones share the lexer's cache, which warms up for all of them).
struct Compiled(TokenParser);

impl Grammar for Compiled {
    fn start(&self) -> Result<Box<dyn Constraint>, String> {
        let m = Matcher::new(Ok(self.0.clone()));
        match m.get_error() {
            Some(e) => Err(e),
            None => {
                let canonical = m.tok_env().is_ok_and(|env| env.tokenize_is_canonical());
                Ok(Box::new(Follow { m, canonical }))
            }
        }
    }
}

struct Follow {
    m: Matcher,
    /// Its vocabulary tokenizes a piece as the model's does: forced bytes
    /// then become forced tokens (see [`Follow::allows`]).
    canonical: bool,
}

impl Constraint for Follow {
    fn mask(&mut self) -> Result<TokenMask, String> {
        self.m.compute_mask().map(|v| TokenMask::from_words(v.into())).map_err(|e| format!("{e:#}"))
    }

    /// The token's bytes through the parser, as the mask would have it:
    /// where the grammar forces bytes a canonical tokenizer tokenizes, the
    /// mask allows only the first of those tokens (llguidance's
    /// fast-forward), so a token that would merely fit the bytes is refused
    /// too. (braid's grammars never turn forcing off.)
    fn allows(&mut self, token: u32) -> Result<bool, String> {
        if self.m.is_stopped() {
            return Ok(false);
        }
        if self.canonical {
            if let Some(&first) = self.m.compute_ff_tokens().first() {
                return Ok(first == token);
            }
        }
        self.m.validate_tokens(&[token]).map(|n| n == 1).map_err(|e| format!("{e:#}"))
    }

    fn commit(&mut self, token: u32) -> Result<bool, String> {
        self.m.consume_token(token).map_err(|e| format!("{e:#}"))?;
        Ok(self.m.is_stopped())
    }

    fn rollback(&mut self, tokens: usize) -> Result<(), String> {
        self.m.rollback(tokens).map_err(|e| format!("{e:#}"))
    }

    /// A deep clone: a plain one shares the lexer's cache, behind a lock
    /// a mask computation holds.
    fn fork(&self) -> Option<Box<dyn Constraint>> {
        Some(Box::new(Follow { m: self.m.deep_clone(), canonical: self.canonical }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::{Tool, ToolChoice};
    use crate::tools::Toolset;
    use braid_formats::tokenizer::GgufTokenizerSpec;

    /// One token per byte (GPT-2's byte characters), and an end token.
    fn bytes_tokenizer() -> Arc<Tokenizer> {
        let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let mut shifted = 0;
        let mut tokens: Vec<String> = (0..=255u8)
            .map(|b| {
                if printable(b) {
                    (b as char).to_string()
                } else {
                    shifted += 1;
                    char::from_u32(255 + shifted).unwrap().to_string()
                }
            })
            .collect();
        tokens.push("<|endoftext|>".into());
        let mut types = vec![1; 256];
        types.push(3);
        let spec = GgufTokenizerSpec {
            model: "gpt2".into(),
            tokens,
            token_types: Some(types),
            merges: Some(Vec::new()),
            eos: Some(256),
            add_bos: Some(false),
            ..GgufTokenizerSpec::default()
        };
        Arc::new(Tokenizer::from_spec(spec).unwrap())
    }

    /// Feed `text` byte by byte: each must be allowed; true when the
    /// grammar is complete at the end.
    fn follows(g: &Guide, text: &str) -> Result<bool, String> {
        let mut c = g.start()?;
        let mut done = false;
        for (i, &b) in text.as_bytes().iter().enumerate() {
            if !c.mask()?.allows(b as u32) {
                return Err(format!("byte {i} ({:?}) refused after {:?}", b as char, &text[..i]));
            }
            done = c.commit(b as u32)?;
        }
        Ok(done)
    }

    #[test]
    fn schemas_compile_and_bind_the_output() {
        let g = Grammars::new(&bytes_tokenizer(), &[256]).unwrap();
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}}, "required": ["n", "tag"], "additionalProperties": false});
        let guide = g.compile(&Spec::JsonSchema { schema, strict: true }).unwrap();
        assert_eq!(follows(&guide, r#"{"n": 12, "tag": "b"}"#), Ok(true));
        assert!(follows(&guide, r#"{"n":12"#).is_err(), "the layout is braid's: a space after the colon");
        assert!(follows(&guide, r#"{"n": 1, "tag": "c"#).is_err());
        // The end token is allowed only where the JSON is complete.
        let object = g.compile(&Spec::JsonObject).unwrap();
        let mut c = object.start().unwrap();
        assert!(!c.mask().unwrap().allows(256));
        let regex = g.compile(&Spec::Regex("[0-9]{3}-[a-z]+".into())).unwrap();
        assert_eq!(follows(&regex, "123-ab"), Ok(false));
        assert!(follows(&regex, "12a").is_err());
    }

    // braid's token slices change how fast a mask comes, not what it
    // allows: along a reply of short bounded strings, SmolLM2's masks
    // equal those of llguidance's own slices.
    #[test]
    fn short_string_slices_give_the_same_masks() {
        let Some(path) = braid_formats::cache::cached_model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
            eprintln!("SKIP: SmolLM2 not in the model cache (run `braid fetch smollm2`)");
            return;
        };
        let tok = Arc::new(Tokenizer::from_gguf(&braid_formats::gguf::Gguf::open(&path).unwrap()).unwrap());
        let ours = Grammars::new(&tok, &tok.stop_ids()).unwrap();
        let theirs = Grammars::with_slices(&tok, &tok.stop_ids(), &SlicedBiasComputer::json_slices()).unwrap();
        let schema = json!({"type": "object", "properties": {"items": {"type": "array", "minItems": 4, "maxItems": 4, "items": {"type": "string", "minLength": 3, "maxLength": 8}}}, "required": ["items"], "additionalProperties": false});
        let spec = Spec::JsonSchema { schema, strict: true };
        let (a, b) = (ours.compile(&spec).unwrap(), theirs.compile(&spec).unwrap());
        let ids = tok.encode(r#"{"items": ["apple", "sun", "riverbed", "stone"]}"#, false).unwrap();
        let (mut ca, mut cb) = (a.start().unwrap(), b.start().unwrap());
        for (i, &t) in ids.iter().enumerate() {
            let (ma, mb) = (ca.mask().unwrap(), cb.mask().unwrap());
            assert!(ma.allows(t), "token {i} refused");
            let differ = (0..tok.vocab_size() as u32).find(|&x| ma.allows(x) != mb.allows(x));
            assert_eq!(differ, None, "the masks before token {i} differ");
            assert_eq!(ca.commit(t).unwrap(), cb.commit(t).unwrap());
        }
    }

    /// Along `ids` (which the grammar takes), `allows` says of each token
    /// of `check` what the mask before it says; a fork made halfway says
    /// the same from there on.
    fn allows_agrees_with_masks(g: &Guide, ids: &[u32], check: impl Fn(&TokenMask) -> Vec<u32>) {
        let (mut c, mut probe) = (g.start().unwrap(), g.start().unwrap());
        for (i, &t) in ids.iter().enumerate() {
            if i == ids.len() / 2 {
                probe = c.fork().expect("llguidance's matcher forks");
            }
            let mask = c.mask().unwrap();
            assert!(mask.allows(t), "token {i} refused by its mask");
            for x in check(&mask) {
                assert_eq!(probe.allows(x).unwrap(), mask.allows(x), "token {x} before token {i}");
            }
            c.commit(t).unwrap();
            probe.commit(t).unwrap();
        }
    }

    // A greedy stream checks its argmax with `allows` and computes a mask
    // only when refused: the two must agree, where bytes are forced (the
    // mask then allows one token) and where the model chooses.
    #[test]
    fn a_token_check_says_what_the_mask_says() {
        let tok = bytes_tokenizer();
        let g = Grammars::new(&tok, &[256]).unwrap();
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["ab", "abc"]}}, "name": {"type": "string", "maxLength": 4}}, "required": ["n", "tags", "name"], "additionalProperties": false});
        let cases = [
            (Spec::JsonSchema { schema, strict: true }, r#"{"n": -12, "tags": ["abc", "ab"], "name": "x\"y"}"#),
            (Spec::JsonObject, r#"{"a": [1, {"b": null}], "c": "d"}"#),
            (Spec::Regex("[0-9]{2}-(ab|cd)+".into()), "42-abcdab"),
        ];
        for (spec, text) in cases {
            let guide = g.compile(&spec).unwrap();
            let mut ids: Vec<u32> = text.bytes().map(u32::from).collect();
            let end = matches!(spec, Spec::Regex(_)).then_some(256);
            ids.extend(end);
            allows_agrees_with_masks(&guide, &ids, |_| (0..257).collect());
        }
        // SmolLM2's vocabulary, where tokens span JSON's pieces: every
        // allowed token and one in seven of the rest, at every step.
        let Some(path) = braid_formats::cache::cached_model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
            eprintln!("SKIP: SmolLM2 not in the model cache (run `braid fetch smollm2`)");
            return;
        };
        let tok = Arc::new(Tokenizer::from_gguf(&braid_formats::gguf::Gguf::open(&path).unwrap()).unwrap());
        let g = Grammars::new(&tok, &tok.stop_ids()).unwrap();
        let n = tok.vocab_size() as u32;
        let words = json!({"type": "object", "properties": {"items": {"type": "array", "minItems": 3, "maxItems": 3, "items": {"type": "string", "minLength": 3, "maxLength": 8}}}, "required": ["items"], "additionalProperties": false});
        let record = json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days", "unit"], "additionalProperties": false});
        let cases = [(words, r#"{"items": ["apple", "riverbed", "sun"]}"#), (record, r#"{"city": "Paris, France", "days": 3, "unit": "celsius"}"#)];
        for (schema, text) in cases {
            let guide = g.compile(&Spec::JsonSchema { schema, strict: true }).unwrap();
            let ids = tok.encode(text, false).unwrap();
            allows_agrees_with_masks(&guide, &ids, |m| (0..n).filter(|&x| m.allows(x) || x % 7 == 0).collect());
        }
    }

    #[test]
    fn a_grammar_llguidance_refuses_is_an_error_not_a_panic() {
        let g = Grammars::new(&bytes_tokenizer(), &[256]).unwrap();
        for bad in [
            Spec::JsonSchema { schema: json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}), strict: true },
            Spec::JsonSchema { schema: json!({"type": "strnig"}), strict: true },
            Spec::JsonSchema { schema: json!(true), strict: false },
            Spec::Lark("start: foo".into()),
            Spec::Regex("(unclosed".into()),
            // Every object must hold another: no finite output.
            Spec::JsonSchema {
                schema: json!({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}}, "$ref": "#/$defs/n"}),
                strict: false,
            },
        ] {
            let e = g.compile(&bad).expect_err(&format!("{bad:?} compiled"));
            assert!(!e.is_empty());
        }
    }

    // The grammars that force a call, for every syntax, compile and take
    // a call the parser reads back.
    #[test]
    fn forced_call_grammars_take_their_calls() {
        let g = Grammars::new(&bytes_tokenizer(), &[256]).unwrap();
        let params = json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]});
        let tool = Tool { name: "weather".into(), raw: json!({"type": "function", "function": {"name": "weather", "parameters": params}}), parameters: params };
        let cases = [
            ("<tool_call>", "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}\n</tool_call>"),
            ("<|eot_id|> \"parameters\"", "{\"name\": \"weather\", \"parameters\": {\"city\": \"Oslo\"}}"),
            ("<start_of_turn>", "```tool_code\n[weather(city=\"Oslo\", days=2)]\n```"),
        ];
        for (template, call) in cases {
            let set = Toolset::new(template, vec![tool.clone()], ToolChoice::Named("weather".into()), true).unwrap();
            let lark = set.grammar().unwrap();
            let guide = g.compile(&Spec::Lark(lark.clone())).unwrap_or_else(|e| panic!("{e}\n{lark}"));
            assert_eq!(follows(&guide, call), Ok(true), "{lark}");
            let mut p = set.parser();
            let mut out = Vec::new();
            p.push(call, &mut out);
            p.finish(&mut out);
            assert!(matches!(&out[0], crate::tools::Piece::Call(n) if n == "weather"), "{out:?}");
        }
    }
}
