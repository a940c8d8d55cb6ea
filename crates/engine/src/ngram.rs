//! Prompt lookup: a drafter with no weights. It proposes what followed the
//! latest earlier occurrence of the stream's last `n` tokens (the longest
//! `n` that occurs), in the prompt or in the output so far. It wins where
//! the output copies its input (edits of given code or text) and costs
//! verified rows where it does not, so each stream proposes about as many
//! tokens as it had accepted lately, and backs off while its proposals
//! keep failing.

use std::collections::HashMap;

use crate::backend::StreamId;
use crate::drafter::{Drafter, Gate};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NgramConfig {
    /// Shortest and longest suffix matched.
    pub min_n: usize,
    pub max_n: usize,
    /// Most tokens proposed at once.
    pub max_tokens: usize,
    /// After this many proposals in a row with nothing accepted, the stream
    /// proposes nothing for as many rounds (0: never back off).
    pub patience: usize,
}

impl Default for NgramConfig {
    fn default() -> Self {
        NgramConfig { min_n: 2, max_n: 4, max_tokens: 8, patience: 4 }
    }
}

struct Seq {
    tokens: Vec<u32>,
    gate: Gate,
    /// The last proposal found a match, so the next is expected to as well
    /// (copies run on; text that repeats nothing finds none).
    matched: bool,
}

pub struct PromptLookup {
    cfg: NgramConfig,
    streams: HashMap<StreamId, Seq>,
}

impl PromptLookup {
    pub fn new(cfg: NgramConfig) -> PromptLookup {
        PromptLookup { cfg, streams: HashMap::new() }
    }

    fn seq(&mut self, stream: StreamId) -> &mut Seq {
        let cfg = &self.cfg;
        self.streams.entry(stream).or_insert_with(|| Seq { tokens: Vec::new(), gate: Gate::new(cfg.max_tokens, cfg.patience), matched: true })
    }
}

/// The `k` tokens after the latest earlier occurrence of the longest suffix
/// of `seq` of `min_n..=max_n` tokens. The copy may run on into the tokens
/// it proposes (as LZ77 copies overlap), so a run or a cycle continues.
pub fn lookup(seq: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
    let len = seq.len();
    for n in (min_n.max(1)..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &seq[len - n..];
        // Latest start first; the occurrence must end before the suffix does.
        if let Some(i) = (0..len - n).rev().find(|&i| &seq[i..i + n] == suffix) {
            let mut ext = seq.to_vec();
            for j in 0..k {
                ext.push(ext[i + n + j]);
            }
            return ext.split_off(len);
        }
    }
    Vec::new()
}

impl Drafter for PromptLookup {
    fn open(&mut self, stream: StreamId, prefix: &[u32]) {
        self.streams.remove(&stream);
        self.seq(stream).tokens = prefix.to_vec();
    }

    fn absorb(&mut self, stream: StreamId, tokens: &[u32], _features: &[f32]) {
        let s = self.seq(stream);
        s.gate.absorbed(tokens.len());
        s.tokens.extend_from_slice(tokens);
    }

    fn propose(&mut self, stream: StreamId, last: u32) -> Vec<u32> {
        let (min_n, max_n) = (self.cfg.min_n, self.cfg.max_n);
        let s = self.seq(stream);
        let k = s.gate.allow();
        if k == 0 {
            return Vec::new();
        }
        s.tokens.push(last);
        let out = lookup(&s.tokens, min_n, max_n, k);
        // `last` is absorbed with the round that feeds it.
        s.tokens.pop();
        s.gate.proposed(out.len());
        s.matched = !out.is_empty();
        out
    }

    /// Told from the last proposal: a copy runs on, and text that repeats
    /// nothing finds no match round after round (where a round started
    /// ahead pays).
    fn may_propose(&self, stream: StreamId) -> bool {
        self.streams.get(&stream).is_none_or(|s| s.matched && !s.gate.skipping())
    }

    fn forget(&mut self, stream: StreamId) {
        self.streams.remove(&stream);
    }

    fn cap(&mut self, stream: StreamId, max: usize) {
        self.seq(stream).gate.cap(max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_suffix_proposes_what_followed_it_last() {
        // "7 8" occurs twice; the longer "6 7 8" only at the start.
        let seq = [6, 7, 8, 1, 2, 7, 8, 3, 4, 6, 7, 8];
        assert_eq!(lookup(&seq, 1, 3, 3), vec![1, 2, 7]);
        assert_eq!(lookup(&seq, 1, 2, 3), vec![3, 4, 6]);
        assert_eq!(lookup(&seq, 1, 2, 1), vec![3]);
        // No earlier occurrence of any suffix of at least 2: nothing.
        assert_eq!(lookup(&[1, 2, 3, 4], 2, 3, 4), Vec::<u32>::new());
        // A run and a cycle continue past the end of what was seen.
        assert_eq!(lookup(&[5, 5, 5], 1, 2, 4), vec![5, 5, 5, 5]);
        assert_eq!(lookup(&[9, 1, 2, 3, 1, 2], 2, 2, 5), vec![3, 1, 2, 3, 1]);
    }

    #[test]
    fn a_proposal_is_expected_after_a_match_not_after_none() {
        let mut d = PromptLookup::new(NgramConfig { min_n: 2, max_n: 3, max_tokens: 4, patience: 0 });
        d.open(1, &[1, 2, 3, 4, 5]);
        assert!(d.may_propose(1), "nothing known yet");
        assert_eq!(d.propose(1, 6), Vec::<u32>::new());
        assert!(!d.may_propose(1), "no match last time");
        d.absorb(1, &[6], &[]);
        // "5 6" then "1 2": "1 2" occurred before.
        d.absorb(1, &[1], &[]);
        assert_eq!(d.propose(1, 2), vec![3, 4], "a stream starts at 2 tokens");
        assert!(d.may_propose(1));
    }

    #[test]
    fn a_stream_backs_off_while_nothing_is_accepted() {
        let cfg = NgramConfig { min_n: 1, max_n: 2, max_tokens: 4, patience: 2 };
        let mut d = PromptLookup::new(cfg);
        d.open(1, &[1, 2, 1, 2, 1, 2]);
        assert_eq!(d.propose(1, 1), vec![2, 1]);
        d.absorb(1, &[1], &[]);
        assert_eq!(d.propose(1, 2), vec![1], "nothing accepted: one token next");
        assert!(d.may_propose(1));
        d.absorb(1, &[2], &[]);
        // Rejected twice in a row: two rounds propose nothing (and it says
        // so before each), then it tries again.
        assert!(!d.may_propose(1));
        assert_eq!(d.propose(1, 1), Vec::<u32>::new());
        d.absorb(1, &[1], &[]);
        assert!(!d.may_propose(1));
        assert_eq!(d.propose(1, 2), Vec::<u32>::new());
        d.absorb(1, &[2], &[]);
        assert!(d.may_propose(1));
        assert_eq!(d.propose(1, 1), vec![2]);
        // An accepted draft resets the count (and doubles the budget).
        d.absorb(1, &[1, 2], &[]);
        assert_eq!(d.propose(1, 1), vec![2, 1]);
        d.absorb(1, &[1], &[]);
        assert_eq!(d.propose(1, 2), vec![1], "one miss is not a streak");
    }
}
