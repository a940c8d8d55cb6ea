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

    /// Whether the next [`Drafter::propose`] for `stream` may give tokens
    /// (false: it will surely give none, e.g. its [`Gate`] is skipping
    /// rounds). The lane tells a backend that starts rounds ahead whether
    /// drafts are likely next ([`crate::Step::next_drafts`]).
    fn may_propose(&self, _stream: StreamId) -> bool {
        true
    }

    /// The stream is gone; drop its state.
    fn forget(&mut self, stream: StreamId);

    /// Propose at most `max` tokens at once for `stream` (its request's
    /// cap; called after `open`), so no forward is spent on tokens the
    /// round would trim.
    fn cap(&mut self, _stream: StreamId, _max: usize) {}

    /// Whether the lane drafts now, its streams that prefill counted as
    /// decoding (not while the batch is larger than
    /// `LaneConfig::draft_max_streams`), said before each turn. A drafter
    /// may put off work that only drafting needs (a draft model's prefill)
    /// while it does not, and catch up when it does.
    fn pace(&mut self, _drafting: bool) {}
}

/// How long a stream's next proposal should be, from how its recent ones
/// fared: a proposal that was wholly accepted doubles the length (up to
/// `max`), one that was not sets it to one more than was accepted, and
/// `patience` proposals in a row with nothing accepted skip as many rounds,
/// twice as many after each further such streak (up to [`MAX_SKIP`]) until
/// a draft is accepted again.
/// A rejected token costs a verified row, and a drafter's forward costs as
/// much per row, so a stream a drafter cannot predict stops paying for it.
#[derive(Clone, Debug)]
pub struct Gate {
    max: usize,
    patience: usize,
    budget: usize,
    proposed: usize,
    misses: usize,
    skip: usize,
    /// Rounds the next streak of misses skips.
    backoff: usize,
}

/// Most rounds a streak of misses skips: a stream whose text changes
/// character is tried again within this many tokens.
pub const MAX_SKIP: usize = 64;

impl Gate {
    /// A stream's gate: its first proposal holds 2 tokens (at most `max`);
    /// `patience` 0 never skips.
    pub fn new(max: usize, patience: usize) -> Gate {
        Gate { max, patience, budget: 2.min(max), proposed: 0, misses: 0, skip: 0, backoff: patience }
    }

    /// The stream absorbed `rows` rows; after a proposal, those are the fed
    /// token and the drafts accepted.
    pub fn absorbed(&mut self, rows: usize) {
        if self.proposed == 0 {
            return;
        }
        let accepted = rows.saturating_sub(1);
        self.budget = if accepted >= self.proposed { (2 * self.budget).min(self.max) } else { accepted + 1 }.max(1);
        if accepted > 0 {
            self.misses = 0;
            self.backoff = self.patience;
        } else {
            self.misses += 1;
            if self.patience > 0 && self.misses >= self.patience {
                self.skip = self.backoff;
                self.backoff = (2 * self.backoff).min(MAX_SKIP);
                self.misses = 0;
            }
        }
        self.proposed = 0;
    }

    /// Tokens the proposal about to be made may hold (0: make none).
    pub fn allow(&mut self) -> usize {
        if self.skip > 0 {
            self.skip -= 1;
            return 0;
        }
        self.budget
    }

    /// Whether the next [`Gate::allow`] gives 0 (a streak of misses is
    /// being sat out).
    pub fn skipping(&self) -> bool {
        self.skip > 0
    }

    /// The proposal made holds `n` tokens.
    pub fn proposed(&mut self, n: usize) {
        self.proposed = n;
    }

    /// Allow at most `max` tokens from now on (at least 1).
    pub fn cap(&mut self, max: usize) {
        self.max = self.max.min(max.max(1));
        self.budget = self.budget.min(self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::Gate;

    #[test]
    fn the_gate_follows_acceptance() {
        let mut g = Gate::new(6, 2);
        assert_eq!(g.allow(), 2, "a stream starts with 2");
        // A round: `proposed` drafted, `absorbed` rows kept (the accepted
        // ones and the next token), then the next round's allowance.
        for (proposed, absorbed, allow, why) in
            [(2, 3, 4, "all accepted: doubled"), (4, 5, 6, "doubled up to max"), (6, 2, 2, "one accepted: two next"), (2, 1, 1, "none accepted: one next")]
        {
            g.proposed(proposed);
            g.absorbed(absorbed);
            assert_eq!(g.allow(), allow, "{why}");
        }
        g.proposed(1);
        g.absorbed(1);
        // Two misses in a row: two rounds skipped, then it tries again.
        assert!(g.skipping());
        assert_eq!((g.allow(), g.allow()), (0, 0));
        assert!(!g.skipping(), "the next allowance is not 0");
        assert_eq!(g.allow(), 1);
        // Two more: four rounds skipped.
        g.proposed(1);
        g.absorbed(1);
        g.allow();
        g.proposed(1);
        g.absorbed(1);
        assert_eq!((0..5).map(|_| g.allow()).collect::<Vec<_>>(), vec![0, 0, 0, 0, 1]);
        // An accepted draft brings the skip back to `patience`.
        g.proposed(1);
        g.absorbed(2);
        for _ in 0..2 {
            let n = g.allow();
            g.proposed(n);
            g.absorbed(1);
        }
        assert_eq!((g.allow(), g.allow(), g.allow()), (0, 0, 1));
        // Absorbs with no proposal out (prompt chunks, skipped rounds) change nothing.
        g.absorbed(7);
        assert_eq!(g.allow(), 1);
    }
}
