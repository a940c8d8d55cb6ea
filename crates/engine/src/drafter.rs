//! Speculative block drafting fed by the target's features.
//!
//! A block drafter (DFlash / DSpark style) reads feature rows tapped from
//! the target model. The lane hands it every prefill chunk's features and,
//! after each round, the features of a stream's rows that were kept (the
//! fed token and the accepted drafts). Then, as soon as a stream has a new
//! newest token, it asks for a block; the stream's next round feeds
//! `[last_token, draft...]` (the plan may trim it), and the lane keeps
//! the longest prefix that the stream's own sampler agrees with, so output
//! is the same as without a drafter (token for token under greedy, and
//! under a seeded sampler too: one random draw per emitted token either
//! way).
//!
//! Rows come with their token ids as well as their features: a block
//! drafter reads the features, a prompt-lookup or draft-model drafter the
//! tokens.

use crate::backend::StreamId;

pub trait Drafter: Send {
    /// A stream begins; its state already holds the rows of `prefix` (a
    /// restored prefix) whose features this drafter has not seen.
    fn open(&mut self, _stream: StreamId, _prefix: &[u32]) {}

    /// Take in the next rows of `stream`, in order: their token ids and
    /// their feature rows (each `features.len() / tokens.len()` wide; empty
    /// when the backend taps no features).
    fn absorb(&mut self, stream: StreamId, tokens: &[u32], features: &[f32]);

    /// Propose tokens to follow `last`, the newest token of `stream` (sampled
    /// but not yet fed). May be empty; the lane trims it to its budget.
    fn propose(&mut self, stream: StreamId, last: u32) -> Vec<u32>;

    /// The stream is gone; drop its state.
    fn forget(&mut self, stream: StreamId);
}
