//! Byte-level BPE (GGUF `tokenizer.ggml.model = "gpt2"`), as llama.cpp runs it.
//!
//! 1. Pre-tokenize: the pre-tokenizer type (`tokenizer.ggml.pre`) names a
//!    list of regexes; each one, in turn, cuts every piece so far into its
//!    matches and the stretches between them (both kept).
//! 2. Each piece's UTF-8 bytes become byte-level symbols (GPT-2's byte →
//!    printable character table), one symbol per byte.
//! 3. Adjacent symbols are merged by merge rank (lowest first; ties:
//!    leftmost) until no listed pair is left.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Result};
use tokenizers::utils::SysRegex;

/// GPT-2's split regex, as llama.cpp lists it (the final `\s+` alternative of
/// the original is not needed: stretches no regex matches are kept anyway).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str =
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str =
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const BLOOM: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";

/// The regexes of a pre-tokenizer type, and whether the type defaults to
/// adding BOS and to using a word that is a whole vocabulary entry as is
/// (llama.cpp's `ignore_merges`).
fn pre_tokenizer(pre: &str) -> Option<(Vec<&'static str>, bool)> {
    Some(match pre {
        "default" => (vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"], false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => (vec![LLAMA3], true),
        "dbrx" | "smaug-bpe" | "chatglm-bpe" => (vec![LLAMA3], false),
        "falcon" => (vec![r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"], false),
        // Digits one by one, then GPT-2 (SmolLM, StarCoder family).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => (vec![r"\p{N}", GPT2], false),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v1-en" | "jina-v2-es" | "jina-v2-de" | "jina-v2-code" | "roberta-bpe" | "mpt"
        | "olmo" | "jais" => (vec![GPT2], false),
        "qwen2" | "stablelm2" | "megrez" => (vec![QWEN2], false),
        "deepseek-coder" => (vec![r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"], false),
        "poro-chat" | "bloom" | "gpt3-finnish" => (vec![BLOOM], false),
        "viking" => (vec![BLOOM, r"\p{N}"], false),
        _ => return None,
    })
}

/// Pre-tokenizer types that add BOS by default in llama.cpp.
fn adds_bos_by_default(pre: &str) -> bool {
    matches!(pre, "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "tekken" | "chameleon")
}

pub(crate) struct Bpe {
    regexes: Vec<SysRegex>,
    /// (left id, right id) → (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// The token of each byte's byte-level character.
    byte_tokens: [Option<u32>; 256],
    ignore_merges: bool,
    add_bos: bool,
}

#[derive(Clone, Copy)]
struct Symbol {
    /// u32::MAX: no vocabulary entry (never merges, written as nothing).
    id: u32,
    len: u32,
    prev: i32,
    next: i32,
}

struct Bigram {
    rank: u32,
    left: i32,
    right: i32,
    size: u32,
    merged: u32,
}

/// `PartialEq`, `Eq` and `PartialOrd` of a type from its own `Ord`: the
/// merge heaps order pairs by a key, not by every field (so no derive).
macro_rules! ord_by_cmp {
    ($t:ty) => {
        impl PartialEq for $t {
            fn eq(&self, o: &Self) -> bool {
                self.cmp(o) == std::cmp::Ordering::Equal
            }
        }
        impl Eq for $t {}
        impl PartialOrd for $t {
            fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(o))
            }
        }
    };
}
pub(super) use ord_by_cmp;

ord_by_cmp!(Bigram);
impl Ord for Bigram {
    /// Max-heap order: lowest rank first, then the leftmost pair.
    fn cmp(&self, o: &Self) -> Ordering {
        o.rank.cmp(&self.rank).then(o.left.cmp(&self.left))
    }
}

impl Bpe {
    pub(crate) fn new(index: &HashMap<String, u32>, merges: &[String], pre: &str) -> Result<Bpe> {
        let (exprs, ignore_merges) = pre_tokenizer(pre).ok_or_else(|| anyhow!("pre-tokenizer type `{pre}` (tokenizer.ggml.pre) is not supported"))?;
        let regexes = exprs.iter().map(|e| SysRegex::new(e).map_err(|err| anyhow!("pre-tokenizer regex {e:?}: {err}"))).collect::<Result<Vec<_>>>()?;
        let table = byte_to_char();
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = index.get(table[b].encode_utf8(&mut [0; 4]) as &str).copied();
        }
        let mut map = HashMap::with_capacity(merges.len());
        let mut joined = String::new();
        for (rank, m) in merges.iter().enumerate() {
            // "left right"; the split is the first space after the first byte,
            // so that a left side starting with a space still parses.
            let Some(sp) = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                bail!("merge {rank} ({m:?}) is not two tokens separated by a space");
            };
            let (l, r) = (&m[..sp], &m[sp + 1..]);
            joined.clear();
            joined.push_str(l);
            joined.push_str(r);
            // A merge whose parts or result are not in the vocabulary can
            // never give a token; skip it rather than reject the file.
            if let (Some(&a), Some(&b), Some(&c)) = (index.get(l), index.get(r), index.get(&joined)) {
                map.entry((a, b)).or_insert((rank as u32, c));
            }
        }
        Ok(Bpe { regexes, merges: map, byte_tokens, ignore_merges, add_bos: adds_bos_by_default(pre) })
    }

    pub(crate) fn default_add_bos(&self) -> bool {
        self.add_bos
    }

    /// Cuts `text` into pre-tokenizer pieces.
    fn split<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut pieces = vec![text];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for p in pieces {
                let mut pos = 0;
                for (s, e) in re.find_iter(p) {
                    if s > pos {
                        next.push(&p[pos..s]);
                    }
                    if e > s {
                        next.push(&p[s..e]);
                    }
                    pos = e;
                }
                if pos < p.len() {
                    next.push(&p[pos..]);
                }
            }
            pieces = next;
        }
        pieces
    }

    /// Appends the tokens of one plain-text stretch.
    pub(crate) fn encode(&self, index: &HashMap<String, u32>, text: &str, out: &mut Vec<u32>) {
        let table = byte_to_char();
        let mut symbols: Vec<Symbol> = Vec::new();
        let mut heap = BinaryHeap::new();
        let mut word = String::new();
        for piece in self.split(text) {
            if self.ignore_merges {
                word.clear();
                word.extend(piece.bytes().map(|b| table[b as usize]));
                if let Some(&id) = index.get(&word) {
                    out.push(id);
                    continue;
                }
            }
            symbols.clear();
            heap.clear();
            let n = piece.len() as i32;
            for (i, &b) in piece.as_bytes().iter().enumerate() {
                let i = i as i32;
                symbols.push(Symbol { id: self.byte_tokens[b as usize].unwrap_or(u32::MAX), len: 1, prev: i - 1, next: if i + 1 == n { -1 } else { i + 1 } });
            }
            let try_add = |heap: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: i32, right: i32| {
                if left < 0 || right < 0 {
                    return;
                }
                let (l, r) = (symbols[left as usize], symbols[right as usize]);
                if let Some(&(rank, merged)) = self.merges.get(&(l.id, r.id)) {
                    heap.push(Bigram { rank, left, right, size: l.len + r.len, merged });
                }
            };
            for i in 1..n {
                try_add(&mut heap, &symbols, i - 1, i);
            }
            while let Some(bg) = heap.pop() {
                let (l, r) = (symbols[bg.left as usize], symbols[bg.right as usize]);
                if l.len == 0 || r.len == 0 || l.len + r.len != bg.size {
                    continue;
                }
                let left = &mut symbols[bg.left as usize];
                left.len += r.len;
                left.next = r.next;
                left.id = bg.merged;
                symbols[bg.right as usize].len = 0;
                if r.next >= 0 {
                    symbols[r.next as usize].prev = bg.left;
                }
                try_add(&mut heap, &symbols, l.prev, bg.left);
                try_add(&mut heap, &symbols, bg.left, r.next);
            }
            let mut i = if n > 0 { 0 } else { -1 };
            while i >= 0 {
                let s = symbols[i as usize];
                if s.id != u32::MAX {
                    out.push(s.id);
                }
                i = s.next;
            }
        }
    }
}

/// GPT-2's table: each byte's printable stand-in character. Printable
/// Latin-1 bytes stand for themselves; the other 68 map to U+0100.. in order.
fn byte_to_char() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = ['\0'; 256];
        let mut extra = 0u32;
        for (b, slot) in t.iter_mut().enumerate() {
            let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
            let cp = if printable {
                b as u32
            } else {
                extra += 1;
                0xFF + extra
            };
            *slot = char::from_u32(cp).unwrap_or('\u{FFFD}');
        }
        t
    })
}

/// The bytes of a normal byte-level token. A character outside the table
/// (not produced by byte-level encoding) is kept as its UTF-8.
pub(crate) fn piece_bytes(text: &str, out: &mut Vec<u8>) {
    static REV: OnceLock<[u8; 68]> = OnceLock::new();
    // The bytes that map to U+0100.., in order.
    let rev = REV.get_or_init(|| {
        let mut r = [0u8; 68];
        for (b, &c) in byte_to_char().iter().enumerate() {
            if let Some(k) = (c as u32).checked_sub(0x100) {
                if let Some(slot) = r.get_mut(k as usize) {
                    *slot = b as u8;
                }
            }
        }
        r
    });
    for c in text.chars() {
        let cp = c as u32;
        match cp {
            0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF => out.push(cp as u8),
            0x100..=0x143 => out.push(rev[(cp - 0x100) as usize]),
            _ => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_round_trips() {
        let t = byte_to_char();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        for b in 0..=255u8 {
            let mut out = Vec::new();
            piece_bytes(&t[b as usize].to_string(), &mut out);
            assert_eq!(out, vec![b]);
        }
    }
}
