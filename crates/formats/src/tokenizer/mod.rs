//! Tokenizers: the one inside a GGUF file (`tokenizer.ggml.*`) and Hugging
//! Face `tokenizer.json`.
//!
//! GGUF tokenizers follow llama.cpp, so that token ids equal llama.cpp's:
//!
//! * special-token text in the input (control, user-defined and unknown
//!   tokens, e.g. `<|im_start|>`) is cut out first and becomes that token
//!   (llama.cpp's `parse_special = true`); see [`special`]. Text a client
//!   sent goes into a chat template [`quote`](Tokenizer::quote)d, and the
//!   rendered prompt is tokenized with
//!   [`encode_rendered`](Tokenizer::encode_rendered): there only the
//!   template's own markup becomes control tokens, so a message cannot
//!   forge a turn (llama.cpp's `parse_special = false` for user text);
//! * `gpt2` vocabularies (byte-level BPE, e.g. SmolLM2) split the remaining
//!   text with the regexes of the `tokenizer.ggml.pre` type and merge by rank;
//!   see [`bpe`];
//! * `llama` vocabularies (SentencePiece BPE, e.g. Gemma 3) escape spaces as
//!   `▁` and merge bigrams by score, with `<0xXX>` byte fallback; see [`spm`].
//!
//! `tokenizer.json` files are run by the `tokenizers` crate; see [`hf`].
//!
//! Decoding is per token: [`Tokenizer::token_bytes`] gives the raw bytes a
//! token stands for, and [`Tokenizer::decode`] / [`StreamDecoder`] join them.
//! No model-specific clean-up (leading-space stripping, " ." joining) is
//! applied, so a generated continuation decodes the same whole or streamed.

mod bpe;
mod hf;
mod special;
mod spm;
mod stream;

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

use crate::gguf::Gguf;

pub use stream::StreamDecoder;

/// What kind of token a vocabulary entry is (GGUF `tokenizer.ggml.token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenKind {
    Undefined,
    Normal,
    Unknown,
    /// Control tokens (`<bos>`, `<|im_end|>`): never produced by plain text,
    /// decoded to nothing unless asked for.
    Control,
    /// User-defined tokens: matched as whole tokens in the input, decoded to
    /// their text (Gemma's runs of spaces and newlines, for instance).
    UserDefined,
    Unused,
    /// SentencePiece byte-fallback tokens `<0xXX>`.
    Byte,
}

impl TokenKind {
    /// From the GGUF token type number; unknown numbers are `Undefined`, as in llama.cpp.
    pub fn from_gguf(t: i32) -> TokenKind {
        match t {
            1 => TokenKind::Normal,
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => TokenKind::Undefined,
        }
    }

    /// Tokens whose text is cut out of the input before the model tokenizes it.
    fn is_matched_in_text(self) -> bool {
        matches!(self, TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown)
    }
}

/// The tokenizer fields of a GGUF file, as plain data.
///
/// [`Tokenizer::from_gguf`] reads these from a file; tests and tools can also
/// fill one by hand and call [`Tokenizer::from_spec`]. `None` in the `add_*`
/// fields means "the default of the model type", as llama.cpp does.
#[derive(Clone, Debug, Default)]
pub struct GgufTokenizerSpec {
    /// `tokenizer.ggml.model`: "gpt2" or "llama".
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer type of a gpt2 vocabulary.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    pub token_types: Option<Vec<i32>>,
    /// "left right" pairs, highest priority first (gpt2 only).
    pub merges: Option<Vec<String>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

impl GgufTokenizerSpec {
    /// Reads the `tokenizer.ggml.*` keys. Errors name the file and the key.
    pub fn from_gguf(g: &Gguf) -> Result<GgufTokenizerSpec> {
        let file = g.path().display();
        let model = g.get_str("tokenizer.ggml.model").with_context(|| format!("{file}: no tokenizer in this GGUF"))?.to_owned();
        let tokens: Vec<String> = g.get_str_array("tokenizer.ggml.tokens")?.into_iter().map(str::to_owned).collect();
        let opt_vec = |key: &str| g.get(key).is_some();
        let id = |key: &str| -> Result<Option<u32>> {
            Ok(match g.get(key) {
                None => None,
                Some(_) => Some(g.get_u32(key)?),
            })
        };
        Ok(GgufTokenizerSpec {
            model,
            pre: g.opt_str("tokenizer.ggml.pre")?.map(str::to_owned),
            tokens,
            scores: if opt_vec("tokenizer.ggml.scores") { Some(g.get_f32_array("tokenizer.ggml.scores")?) } else { None },
            token_types: if opt_vec("tokenizer.ggml.token_type") { Some(g.get_i32_array("tokenizer.ggml.token_type")?) } else { None },
            merges: if opt_vec("tokenizer.ggml.merges") {
                Some(g.get_str_array("tokenizer.ggml.merges")?.into_iter().map(str::to_owned).collect())
            } else {
                None
            },
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            eot: id("tokenizer.ggml.eot_token_id")?,
            eom: id("tokenizer.ggml.eom_token_id")?,
            unk: id("tokenizer.ggml.unknown_token_id")?,
            add_bos: g.opt_bool("tokenizer.ggml.add_bos_token")?,
            add_eos: g.opt_bool("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: g.opt_bool("tokenizer.ggml.add_space_prefix")?,
        })
    }
}

/// Token texts that end a generation (llama.cpp's end-of-generation list).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    // fill-in-the-middle pad / repo / file separators (Qwen coders)
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
];

enum Model {
    Bpe(bpe::Bpe),
    Spm(spm::Spm),
    Hf(Box<hf::Hf>),
}

/// A tokenizer: text ↔ token ids. `Send + Sync`; share it behind an `Arc`.
pub struct Tokenizer {
    tokens: Vec<String>,
    kinds: Vec<TokenKind>,
    index: HashMap<String, u32>,
    /// `token_bytes` of every id, end to end; id i is `pieces[offs[i]..offs[i+1]]`.
    pieces: Vec<u8>,
    piece_offs: Vec<u32>,
    specials: special::SpecialMatcher,
    /// The control and unknown tokens' texts: what [`Tokenizer::quote`]
    /// guards in request text.
    controls: special::SpecialMatcher,
    model: Model,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    stop: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.model {
            Model::Bpe(_) => "gpt2 (byte-level BPE)",
            Model::Spm(_) => "llama (SentencePiece BPE)",
            Model::Hf(_) => "tokenizer.json",
        };
        f.debug_struct("Tokenizer").field("kind", &kind).field("vocab_size", &self.tokens.len()).field("bos", &self.bos).field("eos", &self.eos).finish()
    }
}

impl Tokenizer {
    /// The tokenizer stored in a GGUF file (`tokenizer.ggml.model` "gpt2" or "llama").
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
        let spec = GgufTokenizerSpec::from_gguf(g)?;
        Self::from_spec(spec).with_context(|| format!("{}: bad tokenizer", g.path().display()))
    }

    /// Builds a GGUF-style tokenizer from its fields.
    pub fn from_spec(spec: GgufTokenizerSpec) -> Result<Tokenizer> {
        let GgufTokenizerSpec { model, pre, mut tokens, scores, token_types, merges, bos, eos, eot, eom, unk, add_bos, add_eos, add_space_prefix } = spec;
        let n = tokens.len();
        if n == 0 {
            bail!("the vocabulary (tokenizer.ggml.tokens) is empty");
        }
        if n > u32::MAX as usize {
            bail!("the vocabulary has {n} tokens, more than token ids can address");
        }
        if let Some(s) = &scores {
            if s.len() != n {
                bail!("tokenizer.ggml.scores has {} entries for {n} tokens", s.len());
            }
        }
        let mut kinds: Vec<TokenKind> = match &token_types {
            Some(t) if t.len() != n => {
                bail!("tokenizer.ggml.token_type has {} entries for {n} tokens", t.len())
            }
            Some(t) => t.iter().map(|&t| TokenKind::from_gguf(t)).collect(),
            None => vec![TokenKind::Normal; n],
        };
        // llama.cpp renames empty tokens so that every text maps to one id.
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.is_empty() {
                *t = format!("[EMPTY_{i}]");
            }
        }
        let check = |what: &str, id: Option<u32>| -> Result<Option<u32>> {
            match id {
                Some(i) if i as usize >= n => {
                    bail!("{what} token id {i} is outside the vocabulary of {n}")
                }
                _ => Ok(id),
            }
        };
        let is_spm = match model.as_str() {
            "gpt2" => false,
            "llama" => true,
            other => bail!("tokenizer model `{other}` is not supported (only `gpt2` byte-level BPE and `llama` SentencePiece)"),
        };
        // Model-type defaults, as llama.cpp: SentencePiece vocabularies put
        // <s>=1 and </s>=2 and add BOS and a space prefix unless told otherwise.
        let (bos, eos) = if is_spm { (bos.or(Some(1).filter(|_| n > 1)), eos.or(Some(2).filter(|_| n > 2))) } else { (bos, eos) };
        let bos = check("BOS", bos)?;
        let eos = check("EOS", eos)?;
        let eot = check("EOT", eot)?;
        let eom = check("EOM", eom)?;
        let unk = check("UNK", unk)?;

        let mut index = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            // On duplicate texts the later id wins, as in llama.cpp.
            index.insert(t.clone(), i as u32);
        }

        // Tokens that end generation are control tokens even where the file says otherwise.
        let mut stop: Vec<u32> = Vec::new();
        for t in EOG_TEXTS {
            if let Some(&id) = index.get(*t) {
                stop.push(id);
                kinds[id as usize] = TokenKind::Control;
            }
        }
        stop.extend([eos, eot, eom].into_iter().flatten());
        stop.sort_unstable();
        stop.dedup();

        let (model, default_add_bos, default_space_prefix) = if is_spm {
            let scores = scores.unwrap_or_else(|| vec![0.0; n]);
            (Model::Spm(spm::Spm::new(&index, scores, unk)?), true, true)
        } else {
            let merges = merges.ok_or_else(|| anyhow!("a gpt2 tokenizer needs merges (tokenizer.ggml.merges), and there are none"))?;
            let pre = pre.as_deref().unwrap_or("default");
            let b = bpe::Bpe::new(&index, &merges, pre)?;
            let add_bos = b.default_add_bos();
            (Model::Bpe(b), add_bos, false)
        };
        let add_bos = add_bos.unwrap_or(default_add_bos);
        let add_eos = add_eos.unwrap_or(false);
        if add_bos && bos.is_none() {
            bail!("the tokenizer adds a BOS token but names none (tokenizer.ggml.bos_token_id)");
        }
        if add_eos && eos.is_none() {
            bail!("the tokenizer adds an EOS token but names none (tokenizer.ggml.eos_token_id)");
        }

        let (pieces, piece_offs) = build_pieces(&tokens, &kinds, |text, out| match &model {
            Model::Spm(_) => spm::piece_bytes(text, out),
            _ => bpe::piece_bytes(text, out),
        })?;
        let specials = special::SpecialMatcher::new(
            tokens.iter().zip(&kinds).enumerate().filter_map(|(i, (t, k))| k.is_matched_in_text().then_some((i as u32, t.as_str()))),
        );
        let controls = controls_of(&tokens, &kinds);
        Ok(Tokenizer {
            tokens,
            kinds,
            index,
            pieces,
            piece_offs,
            specials,
            controls,
            model,
            bos,
            eos,
            add_bos,
            add_eos,
            add_space_prefix: add_space_prefix.unwrap_or(default_space_prefix),
            stop,
        })
    }

    /// A Hugging Face `tokenizer.json`, run by the `tokenizers` crate.
    ///
    /// `tokenizer_config` is the parsed `tokenizer_config.json`, if any: its
    /// `bos_token`, `eos_token` and `add_bos_token` / `add_eos_token` are used.
    pub fn from_tokenizer_json(path: &Path, tokenizer_config: Option<&serde_json::Value>) -> Result<Tokenizer> {
        hf::load(path, tokenizer_config)
    }

    /// [`from_tokenizer_json`](Self::from_tokenizer_json) of text already
    /// read; `name` stands for the file in messages.
    pub fn from_tokenizer_json_str(text: &str, name: &str, tokenizer_config: Option<&serde_json::Value>) -> Result<Tokenizer> {
        hf::load_str(text, Path::new(name), tokenizer_config)
    }

    /// Text to token ids. Special-token text in `text` (e.g. `<|im_start|>`)
    /// becomes that token. `add_special` adds BOS (and EOS) where the model
    /// adds them.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_guarded(text, add_special, &Guard::None)
    }

    /// Text to token ids with no control token read from it (llama.cpp's
    /// `parse_special = false`): `<|im_start|>` in `text` is those
    /// characters. User-defined tokens still match, as in llama.cpp.
    pub fn encode_text(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_guarded(text, add_special, &Guard::All)
    }

    /// Request text (a message's content, a tool's description) made safe
    /// to render into a chat template: each control token's text in it is
    /// marked, so that [`encode_rendered`](Self::encode_rendered) reads it
    /// as plain text. The marks are two Unicode noncharacters, so they are
    /// taken out of `text` first; nothing else changes (a template's
    /// `.strip()` or `startswith` sees the same text), and text without
    /// control-token text comes back as it was.
    pub fn quote<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
        let has_marks = text.contains([QUOTE_OPEN, QUOTE_CLOSE]);
        let frags = self.controls.partition(text);
        if !has_marks && !frags.iter().any(|f| matches!(f, special::Fragment::Token(_))) {
            return std::borrow::Cow::Borrowed(text);
        }
        let mut out = String::with_capacity(text.len() + 8);
        for f in frags {
            match f {
                special::Fragment::Text(t) => out.extend(t.chars().filter(|c| *c != QUOTE_OPEN && *c != QUOTE_CLOSE)),
                special::Fragment::Token(id) => {
                    out.push(QUOTE_OPEN);
                    out.push_str(&self.tokens[id as usize]);
                    out.push(QUOTE_CLOSE);
                }
            }
        }
        std::borrow::Cow::Owned(out)
    }

    /// A rendered chat template to token ids: like [`encode`](Self::encode),
    /// except that text [`quote`](Self::quote)d into it never becomes a
    /// control token (its marks are dropped). A mark the template cut in
    /// two guards everything up to the next closing mark: the safe way.
    pub fn encode_rendered(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        if !text.contains([QUOTE_OPEN, QUOTE_CLOSE]) {
            return self.encode(text, add_special);
        }
        let mut clean = String::with_capacity(text.len());
        let mut guarded = Vec::with_capacity(text.len());
        let mut inside = false;
        for c in text.chars() {
            match c {
                QUOTE_OPEN => inside = true,
                QUOTE_CLOSE => inside = false,
                c => {
                    clean.push(c);
                    guarded.extend(std::iter::repeat_n(inside, c.len_utf8()));
                }
            }
        }
        self.encode_guarded(&clean, add_special, &Guard::Bytes(guarded))
    }

    /// Whether a control or unknown token may be read at `start..start+len`.
    fn may_match(&self, guard: &Guard, start: usize, len: usize, id: u32) -> bool {
        if !self.is_control(id) {
            return true;
        }
        match guard {
            Guard::None => true,
            Guard::All => false,
            Guard::Bytes(g) => !g[start..start + len].iter().any(|&b| b),
        }
    }

    fn encode_guarded(&self, text: &str, add_special: bool, guard: &Guard) -> Result<Vec<u32>> {
        // Positions are kept in 32 bits inside; no prompt comes near this.
        if text.len() > i32::MAX as usize {
            bail!("text of {} bytes is too long to tokenize", text.len());
        }
        if let Model::Hf(h) = &self.model {
            let bos = self.add_bos.then_some(self.bos).flatten();
            return match guard {
                Guard::None => h.encode(text, add_special, bos),
                Guard::All => h.encode_plain(text, add_special, bos),
                Guard::Bytes(g) => h.encode_guarded(text, add_special, bos, g),
            };
        }
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        // A space prefix goes before the first text and after each special
        // token (llama.cpp's SentencePiece behavior; off for Gemma).
        let mut prev_special = true;
        for frag in self.specials.partition_with(text, |start, len, id| self.may_match(guard, start, len, id)) {
            match frag {
                special::Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                special::Fragment::Text(s) => {
                    match &self.model {
                        Model::Bpe(b) => b.encode(&self.index, s, &mut out),
                        Model::Spm(m) => {
                            let prefix = self.add_space_prefix && prev_special;
                            m.encode(&self.index, s, prefix, &mut out)?
                        }
                        Model::Hf(_) => unreachable!("handled above"),
                    }
                    prev_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    /// `text` tokenized as a piece of a longer text: no BOS, no
    /// special-token matching, no space prefix. `None` for vocabularies
    /// where a piece does not tokenize on its own as it would inside the
    /// whole (SentencePiece, `tokenizer.json`); byte-level BPE splits at
    /// its pre-tokenizer's boundaries, so there it does. Constrained
    /// decoding uses it to force the tokens a grammar allows only one way.
    pub fn encode_piece(&self, text: &str) -> Option<Vec<u32>> {
        match &self.model {
            Model::Bpe(b) => {
                let mut out = Vec::with_capacity(text.len() / 3 + 1);
                b.encode(&self.index, text, &mut out);
                Some(out)
            }
            Model::Spm(_) | Model::Hf(_) => None,
        }
    }

    /// Token ids to text: the tokens' bytes joined (control tokens give
    /// nothing), invalid UTF-8 replaced by U+FFFD. Unknown ids are skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Like [`decode`](Self::decode), but control and unknown tokens are
    /// written as their text (`<|im_end|>`).
    pub fn decode_with_special(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            match self.kind(id) {
                Some(TokenKind::Control | TokenKind::Unknown) => bytes.extend_from_slice(self.tokens[id as usize].as_bytes()),
                _ => bytes.extend_from_slice(self.token_bytes(id)),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The raw bytes a token stands for: byte-level BPE characters mapped back
    /// to bytes; SentencePiece `▁` as a space and `<0xXX>` as that byte;
    /// user-defined tokens as their text. Control, unknown and unused tokens,
    /// and ids outside the vocabulary, give no bytes (their text is
    /// [`token_text`](Self::token_text)). A byte-level or byte token can be a
    /// fragment of a UTF-8 character.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let i = id as usize;
        if i >= self.tokens.len() {
            return &[];
        }
        &self.pieces[self.piece_offs[i] as usize..self.piece_offs[i + 1] as usize]
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether `encode(.., true)` puts BOS first.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Tokens that end a generation: EOS, EOT, and the end-of-turn tokens
    /// llama.cpp recognizes by text (`<|im_end|>`, `<end_of_turn>`,
    /// `<|eot_id|>`, `<|endoftext|>`, ...). Sorted, no duplicates.
    pub fn stop_ids(&self) -> Vec<u32> {
        self.stop.clone()
    }

    pub fn is_stop(&self, id: u32) -> bool {
        self.stop.binary_search(&id).is_ok()
    }

    /// The id of a vocabulary entry by its exact text (`"<|im_end|>"`, `"Ġworld"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.index.get(text).copied()
    }

    /// A vocabulary entry's text as stored (`"Ġworld"`, `"▁world"`, `"<0x0A>"`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        let t = self.tokens.get(id as usize)?;
        (self.kinds[id as usize] != TokenKind::Undefined || !t.is_empty()).then_some(t.as_str())
    }

    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// True for control and unknown tokens (those [`decode`](Self::decode) drops).
    pub fn is_control(&self, id: u32) -> bool {
        matches!(self.kind(id), Some(TokenKind::Control | TokenKind::Unknown))
    }

    /// An incremental decoder over this tokenizer.
    pub fn stream_decoder(&self) -> StreamDecoder<&Tokenizer> {
        StreamDecoder::new(self)
    }
}

/// Marks around control-token text quoted from a request: Unicode
/// noncharacters, which no tokenizer or template gives a meaning.
const QUOTE_OPEN: char = '\u{FDD0}';
const QUOTE_CLOSE: char = '\u{FDD1}';

/// Where control tokens may not be read from the text being encoded.
enum Guard {
    None,
    All,
    /// Per byte of the text: true where it came from a request.
    Bytes(Vec<bool>),
}

/// A matcher over the control and unknown tokens' texts.
fn controls_of(tokens: &[String], kinds: &[TokenKind]) -> special::SpecialMatcher {
    special::SpecialMatcher::new(
        tokens
            .iter()
            .zip(kinds)
            .enumerate()
            .filter(|(_, (_, k))| matches!(k, TokenKind::Control | TokenKind::Unknown))
            .map(|(i, (t, _))| (i as u32, t.as_str())),
    )
}

/// Lays out every token's decoded bytes end to end.
fn build_pieces(tokens: &[String], kinds: &[TokenKind], normal: impl Fn(&str, &mut Vec<u8>)) -> Result<(Vec<u8>, Vec<u32>)> {
    let mut pieces = Vec::with_capacity(tokens.iter().map(String::len).sum());
    let mut offs = Vec::with_capacity(tokens.len() + 1);
    offs.push(0u32);
    for (t, k) in tokens.iter().zip(kinds) {
        match k {
            TokenKind::Normal => normal(t, &mut pieces),
            TokenKind::UserDefined => pieces.extend_from_slice(t.as_bytes()),
            TokenKind::Byte => match spm::parse_byte_token(t) {
                Some(b) => pieces.push(b),
                None => normal(t, &mut pieces),
            },
            // llama.cpp writes nothing for these unless asked for specials.
            TokenKind::Control | TokenKind::Unknown | TokenKind::Unused | TokenKind::Undefined => {}
        }
        let end = u32::try_from(pieces.len()).map_err(|_| anyhow!("the decoded vocabulary exceeds 4 GiB"))?;
        offs.push(end);
    }
    Ok((pieces, offs))
}
