//! Hugging Face `tokenizer.json`, run by the `tokenizers` crate.
//!
//! Encoding (normalizer, pre-tokenizer, model, added tokens, post-processor)
//! is the crate's. Decoding is ours, per token, so that [`super::StreamDecoder`]
//! works the same for every tokenizer: byte-level vocabularies (a `ByteLevel`
//! decoder or pre-tokenizer) map characters back to bytes; the others read `▁`
//! as a space and `<0xXX>` as a byte. Added tokens marked `special` are
//! control tokens; other added tokens are user-defined (decoded as their text).

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use super::{bpe, build_pieces, special, spm, Model, TokenKind, Tokenizer, EOG_TEXTS};

pub(crate) struct Hf {
    tok: tokenizers::Tokenizer,
    /// The same tokenizer with special added tokens read as text
    /// (transformers' `split_special_tokens`).
    plain: tokenizers::Tokenizer,
    add_eos: Option<u32>,
}

impl Hf {
    pub(crate) fn encode(&self, text: &str, add_special: bool, add_bos: Option<u32>) -> Result<Vec<u32>> {
        self.encode_with(&self.tok, text, add_special, add_bos, add_special)
    }

    /// `text` with no special token read from it.
    pub(crate) fn encode_plain(&self, text: &str, add_special: bool, add_bos: Option<u32>) -> Result<Vec<u32>> {
        self.encode_with(&self.plain, text, add_special, add_bos, add_special)
    }

    /// `text` where the bytes `guarded` marks read no special token: the
    /// text is cut where guarded stretches begin and end, and each piece
    /// encoded on its own (the cuts only ever fall beside quoted control
    /// token text, so ordinary prompts encode whole).
    pub(crate) fn encode_guarded(&self, text: &str, add_special: bool, add_bos: Option<u32>, guarded: &[bool]) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut start = 0;
        while start < text.len() {
            let g = guarded[start];
            let end = (start..text.len()).find(|&i| guarded[i] != g && text.is_char_boundary(i)).unwrap_or(text.len());
            let first = start == 0;
            let tok = if g { &self.plain } else { &self.tok };
            ids.extend(self.encode_with(tok, &text[start..end], add_special && first, add_bos.filter(|_| first), false)?);
            start = end;
        }
        if add_special {
            if let Some(e) = self.add_eos {
                if ids.last() != Some(&e) {
                    ids.push(e);
                }
            }
        }
        Ok(ids)
    }

    fn encode_with(&self, tok: &tokenizers::Tokenizer, text: &str, add_special: bool, add_bos: Option<u32>, add_eos: bool) -> Result<Vec<u32>> {
        // The tokenizers crate panics on some malformed files (a template
        // naming a special token it lacks): an error here, not a crash.
        let enc = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tok.encode_fast(text, add_special)))
            .map_err(|_| anyhow!("tokenizer.json is malformed: the tokenizers crate failed while encoding"))?
            .map_err(|e| anyhow!("tokenizer.json could not encode the text: {e}"))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special {
            // tokenizer_config.json can ask for BOS/EOS that the
            // post-processor does not add; add them once.
            if let Some(b) = add_bos {
                if ids.first() != Some(&b) {
                    ids.insert(0, b);
                }
            }
            if let Some(e) = self.add_eos.filter(|_| add_eos) {
                if ids.last() != Some(&e) {
                    ids.push(e);
                }
            }
        }
        Ok(ids)
    }
}

/// A `bos_token`-style entry of tokenizer_config.json: a string or `{"content": ..}`.
fn config_token<'a>(config: Option<&'a Value>, key: &str) -> Option<&'a str> {
    let v = config?.get(key)?;
    v.as_str().or_else(|| v.get("content")?.as_str())
}

/// Whether any object in `v` has `"type": "ByteLevel"`.
fn mentions_byte_level(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.get("type").and_then(Value::as_str) == Some("ByteLevel") || m.values().any(mentions_byte_level),
        Value::Array(a) => a.iter().any(mentions_byte_level),
        _ => false,
    }
}

pub(crate) fn load(path: &Path, config: Option<&Value>) -> Result<Tokenizer> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    load_str(&text, path, config)
}

/// A `tokenizer.json` already read (`path` names it in messages).
pub(crate) fn load_str(text: &str, path: &Path, config: Option<&Value>) -> Result<Tokenizer> {
    let file = path.display();
    let raw: Value = serde_json::from_str(text).with_context(|| format!("{file}: not valid JSON"))?;
    let tok = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_str(text))
        .map_err(|_| anyhow!("{file}: malformed: the tokenizers crate failed while loading it"))?
        .map_err(|e| anyhow!("{file}: not a tokenizer.json the tokenizers crate can load: {e}"))?;
    let byte_level = raw.get("decoder").is_some_and(mentions_byte_level) || raw.get("pre_tokenizer").is_some_and(mentions_byte_level);

    let vocab = tok.get_vocab(true);
    let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
    if n == 0 {
        bail!("{file}: the vocabulary is empty");
    }
    let mut tokens = vec![String::new(); n];
    let mut kinds = vec![TokenKind::Undefined; n];
    for (t, &id) in &vocab {
        let i = id as usize;
        tokens[i] = t.clone();
        kinds[i] = if !byte_level && spm::parse_byte_token(t).is_some() { TokenKind::Byte } else { TokenKind::Normal };
    }
    for (id, added) in tok.get_added_tokens_decoder() {
        if let Some(k) = kinds.get_mut(id as usize) {
            *k = if added.special { TokenKind::Control } else { TokenKind::UserDefined };
        }
    }
    let index: HashMap<String, u32> = vocab;

    let lookup = |key: &str| -> Result<Option<u32>> {
        match config_token(config, key) {
            None => Ok(None),
            Some(t) => index.get(t).copied().map(Some).ok_or_else(|| anyhow!("{file}: tokenizer_config {key} {t:?} is not in the vocabulary")),
        }
    };
    let bos = lookup("bos_token")?;
    let eos = lookup("eos_token")?;
    let flag = |key: &str| config.and_then(|c| c.get(key)).and_then(Value::as_bool);
    let mut plain = tok.clone();
    plain.set_encode_special_tokens(true);
    let hf = Hf { tok, plain, add_eos: if flag("add_eos_token") == Some(true) { eos } else { None } };
    // A post-processor that cannot run is found now, not on the first request.
    hf.encode("a", true, None).with_context(|| format!("{file}: its post-processor cannot run"))?;
    // Without a config flag, BOS is "added" when the post-processor puts it first.
    let add_bos = match (flag("add_bos_token"), bos) {
        (_, None) => false,
        (Some(f), Some(_)) => f,
        (None, Some(b)) => hf.encode("", true, None)?.first() == Some(&b),
    };

    let mut stop: Vec<u32> = EOG_TEXTS.iter().filter_map(|t| index.get(*t).copied()).collect();
    for &id in &stop {
        kinds[id as usize] = TokenKind::Control;
    }
    stop.extend(eos);
    stop.sort_unstable();
    stop.dedup();

    let (pieces, piece_offs) = build_pieces(&tokens, &kinds, |t, out| if byte_level { bpe::piece_bytes(t, out) } else { spm::piece_bytes(t, out) })
        .with_context(|| format!("{file}: bad vocabulary"))?;
    let controls = super::controls_of(&tokens, &kinds);
    Ok(Tokenizer {
        tokens,
        kinds,
        index,
        pieces,
        piece_offs,
        // The tokenizers crate matches added tokens itself.
        specials: special::SpecialMatcher::new(std::iter::empty()),
        controls,
        model: Model::Hf(Box::new(hf)),
        bos,
        eos,
        add_bos,
        add_eos: false,
        add_space_prefix: false,
        stop,
    })
}
