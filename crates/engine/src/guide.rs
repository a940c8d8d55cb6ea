//! Constrained decoding: a grammar (a JSON schema, a regex, a tool call's
//! shape) that a stream's tokens must follow.
//!
//! A [`Guide`] holds a compiled grammar and rides in the stream's
//! [`SamplingParams`](crate::SamplingParams); each stream that follows it
//! starts its own [`Constraint`], the grammar's state over the tokens
//! accepted so far. The constraint answers which tokens may come next (a
//! [`TokenMask`], the slow part: tens of µs to ms) and takes the token
//! sampled (fast). The lane asks for masks on worker threads while the
//! round's forward runs, applies them on the host where the stream
//! samples, and commits tokens on its own thread; see `lane::masks`.
//!
//! The engine knows no grammar language: the server implements these
//! traits over llguidance.

use std::fmt;
use std::sync::Arc;

/// The tokens a constraint allows next: one bit per token id (bit `t % 32`
/// of word `t / 32`). Ids past its end are not allowed.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
}

impl TokenMask {
    pub fn from_words(words: Vec<u32>) -> TokenMask {
        TokenMask { words }
    }

    /// A mask allowing exactly `tokens`, over `vocab` ids.
    pub fn of(vocab: usize, tokens: impl IntoIterator<Item = u32>) -> TokenMask {
        let mut words = vec![0u32; vocab.div_ceil(32)];
        for t in tokens {
            if let Some(w) = words.get_mut(t as usize / 32) {
                *w |= 1 << (t % 32);
            }
        }
        TokenMask { words }
    }

    pub fn allows(&self, token: u32) -> bool {
        self.words.get(token as usize / 32).is_some_and(|w| w & (1 << (token % 32)) != 0)
    }

    /// The bits, 32 tokens a word.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// The lowest token it allows.
    pub fn first(&self) -> Option<u32> {
        self.words.iter().enumerate().find(|(_, &w)| w != 0).map(|(i, w)| i as u32 * 32 + w.trailing_zeros())
    }

    /// `token` if allowed, else the lowest token allowed (`token` when
    /// none is): what a broken row, every allowed logit -inf or NaN,
    /// samples.
    pub fn allowed_or_first(&self, token: u32) -> u32 {
        if self.allows(token) {
            token
        } else {
            self.first().unwrap_or(token)
        }
    }

    /// How many tokens it allows.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Set every disallowed token's logit to -inf. Whole words are filled
    /// at once: a JSON mask mostly forbids, so this stays a few µs for a
    /// large vocabulary.
    pub fn apply(&self, logits: &mut [f32]) {
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            match self.words.get(w).copied().unwrap_or(0) {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                bits => {
                    for (i, l) in chunk.iter_mut().enumerate() {
                        if bits & (1 << i) == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
    }
}

impl fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenMask({} allowed)", self.count())
    }
}

/// A compiled grammar. Shared by every stream that follows it (the `n`
/// choices of a request), each through its own [`Constraint`].
pub trait Grammar: Send + Sync {
    /// A fresh state at the grammar's start.
    fn start(&self) -> Result<Box<dyn Constraint>, String>;
}

/// One stream's place in a grammar. Errors are messages for the stream's
/// caller (the stream fails with them).
pub trait Constraint: Send {
    /// The tokens allowed after those committed so far. Never empty: a
    /// constraint with nothing to allow fails instead.
    fn mask(&mut self) -> Result<TokenMask, String>;

    /// Whether the next token may be `token`: exactly what
    /// [`Constraint::mask`] would say of it, without walking the vocabulary
    /// (one token's bytes through the grammar). A greedy stream whose rows
    /// come back whole calls it on the lane's thread for every token, and
    /// computes a mask only when it says no, so it must be cheap.
    fn allows(&mut self, token: u32) -> Result<bool, String>;

    /// Accept `token` (which the last mask allowed). `Ok(true)` when the
    /// grammar is complete: nothing may follow, and the stream ends.
    fn commit(&mut self, token: u32) -> Result<bool, String>;

    /// Take back the last `tokens` committed (for masks computed ahead,
    /// over a draft).
    fn rollback(&mut self, tokens: usize) -> Result<(), String>;

    /// An independent copy in the same place, sharing nothing that would
    /// make one wait while the other computes a mask (None: this grammar
    /// cannot be copied). A greedy stream picked on the device keeps one
    /// on the lane's thread to check a token whose mask came late.
    fn fork(&self) -> Option<Box<dyn Constraint>> {
        None
    }
}

/// A grammar as a stream's sampling parameters carry it. Two guides are
/// equal when they share the grammar.
#[derive(Clone)]
pub struct Guide(Arc<dyn Grammar>);

impl Guide {
    pub fn new(grammar: impl Grammar + 'static) -> Guide {
        Guide(Arc::new(grammar))
    }

    pub fn start(&self) -> Result<Box<dyn Constraint>, String> {
        self.0.start()
    }
}

impl PartialEq for Guide {
    fn eq(&self, other: &Guide) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl fmt::Debug for Guide {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Guide")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_allows_its_tokens_and_nothing_past_its_end() {
        let m = TokenMask::of(70, [0, 31, 32, 69, 500]);
        assert!(m.allows(0) && m.allows(31) && m.allows(32) && m.allows(69));
        assert!(!m.allows(1) && !m.allows(68) && !m.allows(70) && !m.allows(500));
        assert_eq!(m.count(), 4);
        let mut logits: Vec<f32> = (0..80).map(|i| i as f32).collect();
        m.apply(&mut logits);
        for (i, l) in logits.iter().enumerate() {
            assert_eq!(l.is_finite(), [0, 31, 32, 69].contains(&i), "token {i}");
        }
        let all = TokenMask::from_words(vec![u32::MAX; 2]);
        let mut row = vec![1.0; 64];
        all.apply(&mut row);
        assert!(row.iter().all(|&l| l == 1.0));
    }
}
