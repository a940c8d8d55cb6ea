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

use crate::backend::StreamId;

pub trait Drafter: Send {
    /// A stream begins; its state already holds `start` rows (a restored
    /// prefix) whose features this drafter has not seen.
    fn open(&mut self, _stream: StreamId, _start: usize) {}

    /// Take in `rows` feature rows of `stream` (each `features.len() / rows`
    /// wide; empty when the backend taps no features), in order.
    fn absorb(&mut self, stream: StreamId, features: &[f32], rows: usize);

    /// Propose tokens to follow `last`, the newest token of `stream` (sampled
    /// but not yet fed). May be empty; the lane trims it to its budget.
    fn propose(&mut self, stream: StreamId, last: u32) -> Vec<u32>;

    /// The stream is gone; drop its state.
    fn forget(&mut self, stream: StreamId);
}
