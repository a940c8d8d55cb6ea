//! One stream as the lane keeps it: its phase (which includes how it
//! ended), its sampler and stop rules, and where its events go.

use std::sync::Arc;
use std::time::Instant;

use super::masks::{sample_logits, Checker, Guided, Held};
use super::plan::Need;
use super::{Event, EventSink, FinishReason, LaneStats, Pending, StreamShared, Timing, Usage};
use crate::backend::{Picked, PromptImage, StreamId};
use crate::guide::TokenMask;
use crate::pass::Pass;
use crate::sampling::{Sampled, Sampler};
use crate::stop::{StopRules, TextStops, TokenText};

/// Where a stream is: queued → admitted → prefilling → decoding → ended.
pub(super) enum Phase {
    /// Waiting for admission (no backend slot yet).
    Queued,
    /// Holds a slot; its pass begins when the passes before it are done.
    Admitted,
    /// In its prompt pass. `paused`: the pass was stopped between chunks
    /// (`cancel_prefill`) for lack of memory, and resumes when it fits.
    Prefilling { pass: Pass, paused: bool },
    /// `last` is the newest sampled token, fed in the next round; `draft`
    /// the drafter's proposal to follow it, verified in the same round.
    Decoding { last: u32, draft: Vec<u32> },
    /// A guided stream whose rows ran before its masks were ready: their
    /// results wait here, and the stream sits out rounds until a worker
    /// hands the masks back (the other streams go on).
    Waiting(Held),
    /// Its last event is sent (or its receiver is gone); the sweep
    /// removes it and returns its slot.
    Ended(End),
}

/// How a stream ended, for the lane's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum End {
    /// Stop, length, or a warm feed completed.
    Finished,
    /// Cancelled, left, or cut by shutdown.
    Cancelled,
    /// An error event ended it.
    Failed,
}

pub(super) struct Stream {
    pub id: StreamId,
    pub prompt: Arc<[u32]>,
    /// A warm feed: a prompt pass with no completion.
    pub warm: bool,
    pub logprobs: Option<usize>,
    pub stop: StopRules,
    pub cache_salt: u64,
    pub prefix_hint: Option<usize>,
    pub images: Arc<[PromptImage]>,
    /// Most draft tokens a round verifies for it (0: it does not draft).
    pub draft_tokens: usize,
    pub sink: Box<dyn EventSink>,
    pub shared: Arc<StreamShared>,
    pub phase: Phase,
    pub sampler: Sampler,
    /// The stream's constraint and its masks, when its sampling has a guide.
    pub guided: Option<Guided>,
    /// A greedy guided stream picked on the device: a copy of its
    /// constraint on the lane's thread (see `masks`).
    pub checker: Option<Checker>,
    pub text: TextStops,
    /// Tokens sampled so far.
    pub completion: usize,
    /// Rows in the backend state.
    pub len: usize,
    /// Prompt rows restored from the prefix cache.
    pub cached: usize,
    /// Prompt + completion may not pass this.
    pub max_total: usize,
    /// Tokens of memory claimed at admission (prompt + reserve).
    pub claim: usize,
    pub submitted: Instant,
    pub admitted: Option<Instant>,
    pub first_token: Option<Instant>,
    /// The queue position last told to the caller.
    pub sent_position: Option<usize>,
}

impl Stream {
    /// A queued stream for a submission; `decode_reserve` tokens of memory
    /// are claimed for its completion (at most what it may generate).
    pub fn new(p: Pending, max_context: usize, decode_reserve: usize, vocab: usize, max_draft: usize) -> Stream {
        let prompt: Arc<[u32]> = p.req.prompt.into();
        let max_total = match (p.warm, p.req.stop.max_tokens) {
            (true, _) => prompt.len(),
            (false, Some(m)) => (prompt.len() + m).min(max_context),
            (false, None) => max_context,
        };
        let reserve = decode_reserve.min(max_total.saturating_sub(prompt.len()));
        Stream {
            id: p.id,
            sampler: Sampler::new(&p.req.sampling, &prompt),
            guided: None,
            checker: None,
            text: TextStops::new(&p.req.stop.stop_strings),
            claim: prompt.len() + reserve,
            prompt,
            warm: p.warm,
            logprobs: p.req.logprobs.map(|n| n.min(vocab)),
            stop: p.req.stop,
            cache_salt: p.req.cache_salt,
            prefix_hint: p.req.prefix_hint,
            images: p.req.images.into(),
            draft_tokens: p.req.draft_tokens.unwrap_or(max_draft).min(max_draft),
            sink: p.sink,
            shared: p.shared,
            phase: Phase::Queued,
            completion: 0,
            len: 0,
            cached: 0,
            max_total,
            submitted: p.submitted,
            admitted: None,
            first_token: None,
            sent_position: None,
        }
    }

    pub fn ended(&self) -> bool {
        matches!(self.phase, Phase::Ended(_))
    }

    /// Decoding, or waiting for the masks of rows it decoded.
    pub fn decoding(&self) -> bool {
        matches!(self.phase, Phase::Decoding { .. } | Phase::Waiting(_))
    }

    /// Admitted or in its pass: not decoding yet.
    pub fn prefilling(&self) -> bool {
        matches!(self.phase, Phase::Admitted | Phase::Prefilling { .. })
    }

    pub fn send(&mut self, ev: Event) {
        if !self.sink.send(ev) {
            // The receiver is gone: forget the stream.
            self.phase = Phase::Ended(End::Cancelled);
        }
    }

    fn usage(&self) -> Usage {
        Usage { prompt_tokens: self.prompt.len(), completion_tokens: self.completion, cached_tokens: self.cached }
    }

    fn timing(&self) -> Timing {
        let now = Instant::now();
        Timing { queued: self.admitted.unwrap_or(now) - self.submitted, ttft: self.first_token.map(|t| t - self.submitted), total: now - self.submitted }
    }

    /// End with `reason` (once), releasing `tail`.
    pub fn finish(&mut self, reason: FinishReason, tail: String) {
        if self.ended() {
            return;
        }
        let (usage, timing) = (self.usage(), self.timing());
        self.send(Event::Finished { reason, usage, tail, timing });
        if !self.ended() {
            self.phase = Phase::Ended(if reason == FinishReason::Cancelled { End::Cancelled } else { End::Finished });
        }
    }

    /// End with an error (once).
    pub fn fail(&mut self, msg: String) {
        self.end_failed(Event::Error(msg));
    }

    /// The stream's grammar could not be followed: the request's fault.
    pub fn fail_grammar(&mut self, msg: String) {
        self.end_failed(Event::GrammarError(msg));
    }

    fn end_failed(&mut self, event: Event) {
        if self.ended() {
            return;
        }
        self.send(event);
        self.phase = Phase::Ended(End::Failed);
    }

    /// End the stream with `f`.
    pub fn failed(&mut self, f: Failed) {
        match f {
            Failed::Grammar(m) => self.fail_grammar(m),
            Failed::Other(m) => self.fail(m),
        }
    }

    /// Room for more tokens (prompt + completion below `max_total`).
    pub fn room(&self) -> usize {
        self.max_total.saturating_sub(self.prompt.len() + self.completion)
    }

    /// What sampling this stream's rows needs from a round (see `Need::of`).
    pub fn need(&self, penalties_picked: bool) -> Need {
        Need::of(&self.sampler, self.logprobs, penalties_picked)
    }

    /// Record one sampled token and tell the caller; true when the stream
    /// has ended. A final EOS / stop token id gets no `Token` event.
    pub fn emit(&mut self, sampled: Sampled, eos: &[u32], text: &dyn TokenText, stats: &mut LaneStats) -> bool {
        let t = sampled.token;
        self.completion += 1;
        stats.generated_tokens += 1;
        self.first_token.get_or_insert_with(Instant::now);
        self.sampler.accept(t);
        if self.stop.stop_ids.contains(&t) || (!self.stop.ignore_eos && eos.contains(&t)) {
            let tail = self.text.finish();
            self.finish(FinishReason::Stop, tail);
            return true;
        }
        let released = self.text.push(&text.token_bytes(t));
        let mut out = released.text;
        let reason = if released.stop.is_some() {
            Some(FinishReason::Stop)
        } else if self.room() == 0 {
            out.push_str(&self.text.finish());
            Some(FinishReason::Length)
        } else {
            None
        };
        self.send(Event::Token { id: t, text: out, logprob: sampled.logprob, top: sampled.top });
        if let Some(r) = reason {
            self.finish(r, String::new());
        }
        self.ended()
    }

    /// Count this (ended) stream in the lane's totals.
    pub fn count_end(&self, stats: &mut LaneStats) {
        match self.phase {
            Phase::Ended(End::Failed) => stats.errors += 1,
            Phase::Ended(End::Cancelled) => stats.cancelled += 1,
            _ => stats.finished += 1,
        }
    }
}

/// Why a row could not be sampled: its grammar (see [`Stream::fail_grammar`]),
/// or anything else (a backend's broken result, a grammar library's panic).
pub(super) enum Failed {
    Grammar(String),
    Other(String),
}

/// Sample token row `row` of a round for `s` (its row `j`): its sampler
/// over the logits (within its mask, when guided), over the top
/// candidates (found within the mask), or the backend's argmax or draw as
/// it is (within the mask).
pub(super) fn sample_row(s: &mut Stream, picked: &mut Picked, row: usize, j: usize, vocab: usize, stats: &mut LaneStats) -> Result<Sampled, Failed> {
    if let Picked::Logits(l) = picked {
        return sample_logits(s, &mut l[row * vocab..(row + 1) * vocab], j, stats).and_then(|x| within_vocab(x, vocab));
    }
    // A guided row past its masks is never reached (see `masks`); a stream
    // that checks first has its rows back whole.
    let mask = match &s.guided {
        Some(Guided::Checks(_)) => return Err(Failed::Other("a guided stream that checks its tokens first had its row picked by the backend".into())),
        Some(g) => Some(g.mask_for(j)?),
        None => None,
    };
    let sampled = match picked {
        Picked::Logits(_) => unreachable!("taken above"),
        // Every allowed logit -inf or NaN (a broken row): as on the host,
        // the lowest allowed token.
        // An argmax, or a token drawn with the number the sampler would
        // have drawn next (its generator moves past it).
        Picked::Tokens(t) => {
            s.sampler.drawn();
            Sampled { token: within(mask, t[row]), logprob: None, top: Vec::new() }
        }
        Picked::Top(c) => Sampled { token: within(mask, s.sampler.sample_top(&c[row])), logprob: None, top: Vec::new() },
    };
    within_vocab(sampled, vocab)
}

fn within_vocab(sampled: Sampled, vocab: usize) -> Result<Sampled, Failed> {
    if sampled.token as usize >= vocab {
        return Err(Failed::Other(format!("the backend picked token {}, past the vocabulary of {vocab}", sampled.token)));
    }
    Ok(sampled)
}

/// `token` within `mask`, if any (see [`TokenMask::allowed_or_first`]).
fn within(mask: Option<&TokenMask>, token: u32) -> u32 {
    mask.map_or(token, |m| m.allowed_or_first(token))
}
