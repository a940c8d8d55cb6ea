//! SentencePiece-style BPE (GGUF `tokenizer.ggml.model = "llama"`), as llama.cpp runs it.
//!
//! The text's spaces become `▁` (with one `▁` in front when the model adds a
//! space prefix); every UTF-8 character starts as its own symbol; then, over
//! and over, the adjacent pair whose joined text is the vocabulary entry with
//! the highest score is merged (ties: leftmost). Candidate pairs sit in a
//! priority queue and stale ones are skipped when popped, so a text of n
//! characters costs O(n log n). A final symbol that is no vocabulary entry
//! (a character the vocabulary lacks) is written as its UTF-8 bytes through
//! the `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use anyhow::{bail, Result};

use super::bpe::ord_by_cmp;

pub(crate) struct Spm {
    scores: Vec<f32>,
    /// The token for each byte value: `<0xXX>`, else the one-byte text, else UNK.
    byte_tokens: [Option<u32>; 256],
}

#[derive(Clone, Copy)]
struct Symbol {
    start: u32,
    len: u32,
    prev: i32,
    next: i32,
}

struct Bigram {
    score: f32,
    left: i32,
    right: i32,
    /// Byte length of the joined text; a popped pair whose symbols no longer
    /// add up to this has been changed by another merge and is stale.
    size: u32,
}

ord_by_cmp!(Bigram);
impl Ord for Bigram {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}

impl Spm {
    pub(crate) fn new(index: &HashMap<String, u32>, scores: Vec<f32>, unk: Option<u32>) -> Result<Spm> {
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = index
                .get(&hex)
                .or_else(|| {
                    // A lone byte is a string only below 0x80.
                    (b < 0x80).then(|| index.get(&(b as u8 as char).to_string())).flatten()
                })
                .copied()
                .or(unk);
        }
        Ok(Spm { scores, byte_tokens })
    }

    /// Appends the tokens of one plain-text stretch.
    pub(crate) fn encode(&self, index: &HashMap<String, u32>, raw: &str, space_prefix: bool, out: &mut Vec<u32>) -> Result<()> {
        let mut text = String::with_capacity(raw.len() + 3);
        if space_prefix {
            text.push(' ');
        }
        text.push_str(raw);
        let text = text.replace(' ', "▁");
        if text.is_empty() {
            return Ok(());
        }
        if text.len() > i32::MAX as usize {
            bail!("text of {} bytes is too long to tokenize", text.len());
        }

        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, ch) in text.char_indices() {
            let i = symbols.len() as i32;
            symbols.push(Symbol { start: start as u32, len: ch.len_utf8() as u32, prev: i - 1, next: i + 1 });
        }
        if let Some(last) = symbols.last_mut() {
            last.next = -1;
        }

        let mut heap = BinaryHeap::with_capacity(symbols.len());
        let try_add = |heap: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: i32, right: i32| {
            if left < 0 || right < 0 {
                return;
            }
            let (l, r) = (symbols[left as usize], symbols[right as usize]);
            let joined = &text[l.start as usize..(r.start + r.len) as usize];
            if let Some(&id) = index.get(joined) {
                heap.push(Bigram { score: self.scores.get(id as usize).copied().unwrap_or(0.0), left, right, size: l.len + r.len });
            }
        };
        for i in 1..symbols.len() as i32 {
            try_add(&mut heap, &symbols, i - 1, i);
        }
        while let Some(bg) = heap.pop() {
            let (l, r) = (symbols[bg.left as usize], symbols[bg.right as usize]);
            if l.len == 0 || r.len == 0 || l.len + r.len != bg.size {
                continue;
            }
            // Merge the right symbol into the left one and unlink it.
            symbols[bg.left as usize].len += r.len;
            symbols[bg.left as usize].next = r.next;
            symbols[bg.right as usize].len = 0;
            if r.next >= 0 {
                symbols[r.next as usize].prev = bg.left;
            }
            try_add(&mut heap, &symbols, l.prev, bg.left);
            try_add(&mut heap, &symbols, bg.left, r.next);
        }

        let mut i = 0i32;
        while i >= 0 {
            let s = symbols[i as usize];
            let piece = &text[s.start as usize..(s.start + s.len) as usize];
            match index.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        match self.byte_tokens[b as usize] {
                            Some(id) => out.push(id),
                            None => bail!("the vocabulary has no token for {piece:?} and no byte-fallback token <0x{b:02X}>"),
                        }
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }
}

/// `<0xAB>` → 0xAB.
pub(crate) fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The bytes of a normal SentencePiece token: `▁` stands for a space.
pub(crate) fn piece_bytes(text: &str, out: &mut Vec<u8>) {
    let mut rest = text;
    while let Some(p) = rest.find('▁') {
        out.extend_from_slice(&rest.as_bytes()[..p]);
        out.push(b' ');
        rest = &rest[p + '▁'.len_utf8()..];
    }
    out.extend_from_slice(rest.as_bytes());
}
