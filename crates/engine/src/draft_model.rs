//! A draft model: a smaller model of the same tokenizer proposes the next
//! tokens greedily, one forward per token, on a backend of its own (the
//! same device as the target, usually).
//!
//! Each stream keeps the tokens the lane has absorbed (the true sequence)
//! and the tokens its draft backend holds; they agree up to where the last
//! proposal went wrong, and the backend is rewound there before it is fed
//! again. Prompt chunks are fed as they are absorbed, so the draft model's
//! prefill is paced with the target's, but only while the lane drafts
//! ([`Drafter::pace`]): a batch too large to draft costs the draft model
//! nothing, and a stream that drafts again later catches up [`CATCH_UP`]
//! rows a round first. A proposal feeds what is left and the newest token
//! in one forward, then each proposed token but the last. Its length
//! follows the stream's acceptance ([`Gate`]).

use std::collections::HashMap;

use anyhow::{bail, ensure, Result};

use crate::backend::{Backend, Chunk, DecodeRow, Pick, Picked, Step, StreamId};
use crate::drafter::{Drafter, Gate};
use crate::sampling::argmax;

/// Rows a stream's draft model is fed a round, proposing nothing, while it
/// is further behind than this (its prompt was absorbed while the lane did
/// not draft): a whole prompt in one call would stall that round.
pub const CATCH_UP: usize = 32;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraftModelConfig {
    /// Most tokens proposed at once.
    pub max_tokens: usize,
    /// After this many proposals in a row with nothing accepted, the stream
    /// proposes nothing for as many rounds (0: never back off).
    pub patience: usize,
}

impl Default for DraftModelConfig {
    fn default() -> Self {
        DraftModelConfig { max_tokens: 6, patience: 4 }
    }
}

struct Seq {
    /// The stream's tokens as the lane absorbed them.
    tokens: Vec<u32>,
    /// The tokens the draft backend holds for it.
    held: Vec<u32>,
    gate: Gate,
    /// The backend refused this stream (no slot, past its context): it
    /// proposes nothing until it is opened again.
    broken: bool,
}

impl Seq {
    /// How many of the held tokens are the absorbed ones.
    fn agreed(&self) -> usize {
        self.held.iter().zip(&self.tokens).take_while(|(a, b)| a == b).count()
    }
}

pub struct DraftModel {
    backend: Box<dyn Backend>,
    cfg: DraftModelConfig,
    streams: HashMap<StreamId, Seq>,
    /// Whether the lane drafts now ([`Drafter::pace`]).
    drafting: bool,
    /// Why the last feed failed, for tests and logs.
    pub last_error: Option<String>,
}

impl DraftModel {
    /// A drafter over `backend` (the draft model's, empty). Drafting needs
    /// to cut rejected tokens from its state, so the backend must rewind.
    pub fn new(backend: Box<dyn Backend>, cfg: DraftModelConfig) -> Result<DraftModel> {
        let caps = backend.capabilities();
        ensure!(caps.supports_rewind, "the draft model keeps state that cannot be rewound (only attention-only models draft)");
        ensure!(cfg.max_tokens > 0, "a draft model that proposes 0 tokens drafts nothing");
        Ok(DraftModel { backend, cfg, streams: HashMap::new(), drafting: true, last_error: None })
    }

    /// Width of the draft model's logits rows (its vocabulary).
    pub fn vocab(&self) -> usize {
        self.backend.capabilities().vocab_size
    }

    /// The absorbed tokens of `stream` its draft backend does not hold.
    fn behind(&self, stream: StreamId) -> usize {
        let s = &self.streams[&stream];
        s.tokens.len() - s.agreed()
    }

    /// A feed of `stream` failed: it proposes nothing until opened again.
    fn broke(&mut self, stream: StreamId, e: anyhow::Error) {
        self.last_error = Some(format!("{e:#}"));
        self.streams.get_mut(&stream).expect("present").broken = true;
    }

    /// Bring the draft backend's rows for `stream` up to its absorbed
    /// tokens followed by `extra`, in as few forwards as its batch allows;
    /// the logits of the last row when `extra` is given. With `most`, at
    /// most that many absorbed tokens (and no `extra` unless all fit).
    fn feed(&mut self, stream: StreamId, extra: Option<u32>, most: Option<usize>) -> Result<Option<Vec<f32>>> {
        let caps = self.backend.capabilities();
        let s = self.streams.get_mut(&stream).expect("checked by the caller");
        let same = s.agreed();
        if same < s.held.len() {
            self.backend.rewind(stream, same)?;
            s.held.truncate(same);
        }
        let mut todo = s.tokens[same..].to_vec();
        let extra = match most {
            Some(n) if todo.len() > n => {
                todo.truncate(n);
                None
            }
            _ => extra,
        };
        todo.extend(extra);
        if s.held.len() + todo.len() > caps.max_context {
            bail!("the draft model's context of {} tokens is full", caps.max_context);
        }
        let cap = if caps.max_batch == 0 { todo.len().max(1) } else { caps.max_batch };
        let mut logits = None;
        let pieces = todo.chunks(cap).count();
        for (i, piece) in todo.chunks(cap).enumerate() {
            let want = extra.is_some() && i + 1 == pieces;
            let chunk = Chunk { start: s.held.len(), tokens: piece, want_logits: want };
            let out = self.backend.prefill_step(stream, chunk);
            match out {
                Ok(l) => {
                    s.held.extend_from_slice(piece);
                    logits = l;
                }
                Err(e) => {
                    // Nothing was appended; the next feed starts here.
                    return Err(e);
                }
            }
        }
        Ok(logits.filter(|_| extra.is_some()))
    }

    /// Up to `k` greedy tokens after `last`.
    fn draft(&mut self, stream: StreamId, last: u32, k: usize) -> Result<Vec<u32>> {
        let caps = self.backend.capabilities();
        let vocab = caps.vocab_size;
        let logits = self.feed(stream, Some(last), None)?;
        let logits = match logits {
            Some(l) if l.len() == vocab => l,
            other => bail!("the draft model returned {} logits for its last row, expected {vocab}", other.map_or(0, |l| l.len())),
        };
        let mut out = vec![argmax(&logits)];
        let room = caps.max_context.saturating_sub(self.streams[&stream].held.len());
        let pick = if caps.picks.argmax { Pick::Argmax } else { Pick::Logits };
        while out.len() < k.min(room + 1) {
            let t = *out.last().expect("one token at least");
            let rows = [DecodeRow { stream, tokens: vec![t] }];
            let next = match self.backend.round(Step::new(&rows, None, pick))?.picked {
                Picked::Tokens(t) if t.len() == 1 => t[0],
                Picked::Logits(l) if l.len() == vocab => argmax(&l),
                other => bail!("the draft model returned {} rows for one", other.rows(vocab)),
            };
            self.streams.get_mut(&stream).expect("present").held.push(t);
            out.push(next);
        }
        Ok(out)
    }
}

impl Drafter for DraftModel {
    fn open(&mut self, stream: StreamId, prefix: &[u32]) {
        self.forget(stream);
        let broken = match self.backend.open(stream) {
            Ok(()) => false,
            Err(e) => {
                self.last_error = Some(format!("{e:#}"));
                true
            }
        };
        let gate = Gate::new(self.cfg.max_tokens, self.cfg.patience);
        self.streams.insert(stream, Seq { tokens: prefix.to_vec(), held: Vec::new(), gate, broken });
    }

    fn absorb(&mut self, stream: StreamId, tokens: &[u32], _features: &[f32]) {
        let Some(s) = self.streams.get_mut(&stream) else { return };
        s.gate.absorbed(tokens.len());
        s.tokens.extend_from_slice(tokens);
        // A prompt chunk is fed now, in the round that ran it. A decode
        // round's rows wait for the next proposal's forward: after a
        // verified proposal that is one accepted token at most, and a
        // stream that proposes nothing for a while (one row a round: a
        // large batch, see `LaneConfig::draft_max_streams`) costs the draft
        // model nothing until it proposes again. (A one-row prompt chunk
        // waits too; it is caught up with the rest.)
        let behind = s.tokens.len().saturating_sub(s.held.len());
        if self.drafting && !s.broken && tokens.len() >= 2 && behind >= 2 {
            if let Err(e) = self.feed(stream, None, None) {
                self.broke(stream, e);
            }
        }
    }

    fn propose(&mut self, stream: StreamId, last: u32) -> Vec<u32> {
        let Some(s) = self.streams.get_mut(&stream) else { return Vec::new() };
        if s.broken {
            return Vec::new();
        }
        let k = s.gate.allow();
        if k == 0 {
            return Vec::new();
        }
        if self.behind(stream) > CATCH_UP {
            if let Err(e) = self.feed(stream, None, Some(CATCH_UP)) {
                self.broke(stream, e);
            }
            return Vec::new();
        }
        match self.draft(stream, last, k) {
            Ok(t) => {
                self.last_error = None;
                self.streams.get_mut(&stream).expect("present").gate.proposed(t.len());
                t
            }
            // No proposal costs only speed: the stream decodes one token.
            Err(e) => {
                self.broke(stream, e);
                Vec::new()
            }
        }
    }

    fn may_propose(&self, stream: StreamId) -> bool {
        self.streams.get(&stream).is_some_and(|s| !s.broken && !s.gate.skipping()) && self.behind(stream) <= CATCH_UP
    }

    fn forget(&mut self, stream: StreamId) {
        if self.streams.remove(&stream).is_some() {
            self.backend.forget(stream);
        }
    }

    fn cap(&mut self, stream: StreamId, max: usize) {
        if let Some(s) = self.streams.get_mut(&stream) {
            s.gate.cap(max);
        }
    }

    fn pace(&mut self, drafting: bool) {
        self.drafting = drafting;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{fake_next, Call, CallLog, FakeBackend, FakeConfig};

    /// The fake model's greedy continuation of `seq`.
    fn greedy(seq: &[u32], n: usize, vocab: usize) -> Vec<u32> {
        let mut s = seq.to_vec();
        for _ in 0..n {
            s.push(fake_next(*s.last().unwrap(), s.len(), vocab));
        }
        s.split_off(seq.len())
    }

    #[test]
    fn it_drafts_the_draft_models_greedy_tokens_and_rewinds_what_was_rejected() {
        let log = CallLog::default();
        let fake = FakeBackend::new(FakeConfig::default(), log.clone());
        let mut d = DraftModel::new(Box::new(fake), DraftModelConfig { max_tokens: 4, patience: 0 }).unwrap();
        let prompt: Vec<u32> = (1..=9).collect();
        d.open(7, &[]);
        d.absorb(7, &prompt[..5], &[]);
        d.absorb(7, &prompt[5..], &[]);
        // Both prompt chunks (start, rows) were fed as they came.
        assert_eq!(log.chunks(7), vec![(0, 5), (5, 4)]);
        let last = 40;
        let mut seq = prompt.clone();
        seq.push(last);
        let p = d.propose(7, last);
        assert_eq!(p, greedy(&seq, 2, 64), "the gate starts at 2");
        // The target kept `last` alone and sampled another token than the
        // first draft.
        d.absorb(7, &[last], &[]);
        let other = (p[0] + 1) % 64;
        seq.push(other);
        log.clear();
        let q = d.propose(7, other);
        assert_eq!(q, greedy(&seq, 1, 64), "none accepted: one next");
        // The rejected draft was held (it was fed to draft the second), so
        // the backend went back to the kept tokens before the forward.
        assert_eq!(log.snapshot()[0], Call::Rewind { stream: 7, len: 10 });
        assert_eq!(log.chunks(7), vec![(10, 1)]);
        // All accepted: the last draft (never fed) goes in with the new token.
        d.absorb(7, &[other, q[0]], &[]);
        seq.push(q[0]);
        let next = fake_next(q[0], seq.len(), 64);
        seq.push(next);
        log.clear();
        let r = d.propose(7, next);
        assert_eq!(r, greedy(&seq, 2, 64), "all accepted: doubled");
        let calls = log.snapshot();
        assert!(!calls.iter().any(|c| matches!(c, Call::Rewind { .. })), "{calls:?}");
        assert_eq!(log.chunks(7), vec![(11, 2)]);
        // One forward per further draft token.
        assert_eq!(calls.iter().filter(|c| c.decodes(7)).count(), 1);
        d.forget(7);
        assert!(log.snapshot().contains(&Call::Forget(7)));
    }

    #[test]
    fn rows_absorbed_after_the_prompt_wait_for_a_proposal() {
        let log = CallLog::default();
        let mut d = DraftModel::new(Box::new(FakeBackend::new(FakeConfig::default(), log.clone())), DraftModelConfig::default()).unwrap();
        // A stream that decodes before it ever proposes (it started in a
        // large batch): its one-row rounds feed nothing.
        d.open(4, &[]);
        d.absorb(4, &[1, 2, 3, 4], &[]);
        log.clear();
        for t in 5..9 {
            d.absorb(4, &[t], &[]);
        }
        assert!(log.snapshot().is_empty(), "{:?}", log.snapshot());
        d.open(3, &[]);
        d.absorb(3, &[1, 2, 3, 4], &[]);
        d.propose(3, 5);
        // Rounds that ask for no proposal (a large batch): nothing runs.
        log.clear();
        for t in 5..30 {
            d.absorb(3, &[t], &[]);
        }
        assert!(log.snapshot().is_empty(), "{:?}", log.snapshot());
        // The next proposal catches up in one forward: back to the five
        // rows that agree, then rows 6..=29 and the new token.
        d.propose(3, 30);
        assert_eq!(log.chunks(3)[0], (5, 25));
    }

    #[test]
    fn while_the_lane_does_not_draft_prompts_wait_and_a_stream_catches_up_before_it_proposes() {
        let log = CallLog::default();
        let mut d = DraftModel::new(Box::new(FakeBackend::new(FakeConfig::default(), log.clone())), DraftModelConfig::default()).unwrap();
        let prompt: Vec<u32> = (0..80).map(|i| (i * 7 % 60) as u32 + 1).collect();
        // A large batch: the prompt's chunks cost the draft model nothing.
        d.pace(false);
        d.open(2, &[]);
        log.clear();
        for c in prompt.chunks(16) {
            d.absorb(2, c, &[]);
        }
        assert!(log.snapshot().is_empty(), "{:?}", log.snapshot());
        // Drafting again: CATCH_UP rows a round, proposing nothing, until
        // the rest fits one proposal's forward; then the greedy drafts.
        d.pace(true);
        let last = 9;
        assert!(d.propose(2, last).is_empty());
        assert!(d.propose(2, last).is_empty());
        assert_eq!(log.chunks(2), vec![(0, CATCH_UP), (CATCH_UP, CATCH_UP)]);
        let mut seq = prompt.clone();
        seq.push(last);
        assert_eq!(d.propose(2, last), greedy(&seq, 2, 64));
        assert_eq!(log.chunks(2)[2], (2 * CATCH_UP, prompt.len() - 2 * CATCH_UP + 1));
    }

    #[test]
    fn a_stream_past_the_draft_models_context_proposes_nothing() {
        let mut cfg = FakeConfig::default();
        cfg.caps.max_context = 8;
        let mut d = DraftModel::new(Box::new(FakeBackend::new(cfg, CallLog::default())), DraftModelConfig::default()).unwrap();
        d.open(1, &[]);
        d.absorb(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9], &[]);
        assert_eq!(d.propose(1, 3), Vec::<u32>::new());
        assert!(d.last_error.as_deref().unwrap_or("").contains("context"), "{:?}", d.last_error);
    }

    #[test]
    fn a_backend_that_cannot_rewind_is_refused() {
        let mut cfg = FakeConfig::default();
        cfg.caps.supports_rewind = false;
        let e = DraftModel::new(Box::new(FakeBackend::new(cfg, CallLog::default())), DraftModelConfig::default()).err().unwrap();
        assert!(e.to_string().contains("rewound"), "{e}");
    }
}
