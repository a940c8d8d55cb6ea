//! Incremental detokenizing for streamed output.

use std::ops::Deref;

use super::Tokenizer;

/// Turns token ids into text one at a time.
///
/// A token can end in the middle of a UTF-8 character (byte-level BPE and
/// `<0xXX>` byte tokens split emoji and CJK characters); those bytes are held
/// back until the character is complete, so every chunk is whole characters.
/// Bytes that can never become valid UTF-8 come out as U+FFFD, exactly as
/// [`Tokenizer::decode`] would write them, so the chunks joined equal
/// `decode` of all the ids.
///
/// `T` is anything that derefs to a [`Tokenizer`]: `&Tokenizer`, `Arc<Tokenizer>`.
pub struct StreamDecoder<T: Deref<Target = Tokenizer>> {
    tok: T,
    pending: Vec<u8>,
}

impl<T: Deref<Target = Tokenizer>> StreamDecoder<T> {
    pub fn new(tok: T) -> Self {
        StreamDecoder { tok, pending: Vec::new() }
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// Adds one token; returns the text that is now complete (maybe empty).
    pub fn push(&mut self, id: u32) -> String {
        let bytes = self.tok.token_bytes(id);
        self.pending.extend_from_slice(bytes);
        self.take_complete()
    }

    /// Bytes held back for an unfinished character.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Ends the stream: held-back bytes of an unfinished character come out as U+FFFD.
    pub fn flush(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut at = 0;
        loop {
            match std::str::from_utf8(&self.pending[at..]) {
                Ok(s) => {
                    out.push_str(s);
                    at = self.pending.len();
                    break;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // `valid_up_to` bytes are valid UTF-8, so this never falls back.
                    out.push_str(std::str::from_utf8(&self.pending[at..at + good]).unwrap_or_default());
                    at += good;
                    match e.error_len() {
                        // Invalid whatever follows: replace it, as lossy decoding does.
                        Some(n) => {
                            out.push('\u{FFFD}');
                            at += n;
                        }
                        // An unfinished character at the end: keep it for later.
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..at);
        out
    }
}
