//! One round: run a plan in one backend call, then hand its results to
//! the streams.
//!
//! Every round's decode token rows come back as one [`Picked`], whatever
//! was picked, and go through one finish path: each stream's rows are
//! sampled in turn inside the draft verification loop (a stream without a
//! draft has one row). A chunk rides in the same call; a chunk alone goes
//! through `prefill_step`, the whole pass's chunk body.

use anyhow::{anyhow, bail, Result};

use super::masks::{commit, sample_logits, Checked, Held, PickMasks};
use super::pacer::{to_replayed, Budget, Ran, Shape};
use super::plan::{plan, Decoder, LaneView, Memory, Prefill, RoundPlan};
use super::run::Core;
use super::stream::{sample_row, Phase};
use super::FinishReason;
use crate::backend::{Backend, Chunk, Draw, Penalty, Pick, Picked, RoundMasks, Step, StreamId};
use crate::pass::{CutPlan, StepOutcome};
use crate::sampling::Sampled;

/// The most of the loop's own time between two calls the pacer believes
/// (more is a wait for work, not work).
const MAX_OVERHEAD: f64 = 2e-3;

/// What the round after the one being run will carry, as far as the lane
/// can tell a round early (see [`Step::next_chunk`], [`Step::next_plain`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    Unknown,
    /// The decode rows alone: no prompt is under way, or the pacer times
    /// them mid-pass.
    Plain,
    /// A prompt chunk: its stream, start and end.
    Chunk(StreamId, usize, usize),
}

impl Core {
    /// Plan the round, making room until it fits, and run it; true when
    /// anything moved.
    pub(super) fn turn(&mut self) -> bool {
        let mut changed = self.encode_step();
        let plan = loop {
            self.begin_pass();
            let p = plan(&self.view());
            match p.short {
                Some(short) if self.make_room(short) => changed = true,
                _ => break p,
            }
        };
        self.rotate = plan.rotate;
        self.chunk_waited = plan.chunk_left_out;
        if plan.is_empty() {
            return changed;
        }
        self.run_round(plan);
        true
    }

    /// One step of the image rows of the oldest pass that still needs
    /// them, between rounds, sized by the pacer as a chunk would be: the
    /// decoding streams wait a small step, not the whole tower. The pass
    /// takes no chunk until its images are made. Returns whether a step ran.
    fn encode_step(&mut self) -> bool {
        let Some(at) = self.running.iter().position(|s| matches!(&s.phase, Phase::Prefilling { pass, .. } if pass.images_pending())) else {
            return false;
        };
        let decoding = self.running.iter().filter(|s| matches!(s.phase, Phase::Decoding { .. }));
        let next = decoding.fold(Shape::default(), |sh, s| match &s.phase {
            Phase::Decoding { draft, .. } => Shape { decode_rows: sh.decode_rows + 1 + draft.len(), decode_ctx: sh.decode_ctx + s.len, ..sh },
            _ => sh,
        });
        let budget = self.pacer.encode_budget(next);
        let t = self.backend.now();
        let Phase::Prefilling { pass, .. } = &mut self.running[at].phase else { unreachable!("found above") };
        let made = pass.encode_step(&mut *self.backend, budget);
        let took = self.backend.now().saturating_duration_since(t);
        self.stats.image_encode_secs += took.as_secs_f64();
        // Not the loop's own time: the pacer sets it aside from the next round's.
        self.round_end = self.round_end.map(|e| e + took);
        tracing::trace!(?budget, ms = took.as_secs_f64() * 1e3, "image encoding step");
        match made {
            Ok((n, step)) => {
                self.pacer.encoded(step.work, took.as_secs_f64(), step.next, budget.is_some());
                self.stats.images_encoded += n.unwrap_or(0) as u64;
            }
            Err(e) => {
                self.backend.drop_images(self.running[at].id);
                self.running[at].fail(format!("prefill failed: {e:#}"));
            }
        }
        true
    }

    /// The plain data the plan reads.
    fn view(&self) -> LaneView<'_> {
        let decoding: Vec<Decoder<'_>> = (self.running.iter().enumerate())
            .filter_map(|(at, s)| match &s.phase {
                Phase::Decoding { last, draft } => Some(Decoder {
                    at,
                    id: s.id,
                    last: *last,
                    len: s.len,
                    room: s.room(),
                    draft,
                    max_draft: s.draft_tokens,
                    need: s.need(self.caps.picks.penalties),
                }),
                _ => None,
            })
            .collect();
        let prefill = self.running.iter().enumerate().find_map(|(at, s)| match &s.phase {
            Phase::Prefilling { pass, .. } if !pass.images_pending() => Some(Prefill { at, id: s.id, cuts: pass.plan(), pos: pass.pos() }),
            _ => None,
        });
        let next =
            Shape { decode_rows: decoding.iter().map(|d| 1 + d.draft.len()).sum(), decode_ctx: decoding.iter().map(|d| d.len).sum(), ..Shape::default() };
        let budget = prefill.as_ref().map_or(Budget::Chunk(None), |p| match self.announced {
            // The last round named this chunk as the next: keep to it.
            Some((id, start, end)) if id == p.id && start == p.pos => Budget::Chunk(Some(end - start)),
            _ => match self.budget(p.id, p.pos, p.cuts, next, false) {
                // Not named, beside a round the backend started without it
                // (on the H200 a first 32-row chunk so made a 4.4-5.1 ms
                // gap, and the unlaunched round after it 2.9 ms, against
                // 1.9 ms for a named one): named now, run in the next round.
                Budget::Chunk(Some(rows))
                    if self.caps.launches_ahead
                        && next.decode_rows > 0
                        && (self.caps.replayed_chunk_rows == 0 || rows <= self.caps.replayed_chunk_rows)
                        && self.held != Some((p.id, p.pos)) =>
                {
                    Budget::Name
                }
                b => b,
            },
        });
        let memory = self.caps.reports_fill.then(|| {
            let fill = self.backend.fill();
            Memory { free_blocks: fill.blocks_free(), block_tokens: fill.block_tokens }
        });
        LaneView {
            decoding,
            prefill,
            budget,
            max_batch: if self.caps.max_batch == 0 { usize::MAX } else { self.caps.max_batch },
            max_draft: self.max_draft(),
            draft_max_streams: self.cfg.draft_max_streams,
            vocab: self.caps.vocab_size,
            picks: self.caps.picks,
            memory,
            rotate: self.rotate,
            chunk_waited: self.chunk_waited,
        }
    }

    /// The pacer's budget for the chunk of `stream`'s pass (cut by `cuts`)
    /// from `pos`, beside decode rows of shape `next`, kept to the sizes
    /// the backend replays within the rows to the pass's next cut.
    /// `timed`: a plain round of the decode rows runs before this chunk's
    /// (see [`Pacer::budget`]).
    fn budget(&self, stream: StreamId, pos: usize, cuts: &CutPlan, next: Shape, timed: bool) -> Budget {
        let left = cuts.chunk_end_capped(pos, None) - pos;
        let b = self.pacer.budget(stream, pos, next, timed, left);
        to_replayed(b, left, next.decode_rows > 0, self.caps.replayed_chunk_rows, self.caps.pads_chunks)
    }

    /// What the round after `plan` will carry if its decode rows come as
    /// planned (the same streams, a token further): the prompt pass's next
    /// chunk after `plan`'s, sized now (a round early) by the pacer, or
    /// [`Next::Plain`] where the pacer will time the decode rows alone, or
    /// no prompt is being prefilled at all (a prompt that arrives waits a
    /// round for a backend that started the next round without it: see
    /// `Budget::Name`). Unknown when `plan` decodes nothing or the pass
    /// ends in it.
    fn announce(&self, plan: &RoundPlan) -> Next {
        if plan.rows.is_empty() {
            return Next::Unknown;
        }
        if !self.running.iter().any(|s| matches!(s.phase, Phase::Prefilling { .. })) {
            return Next::Plain;
        }
        let Some((id, pass)) = self.running.iter().find_map(|s| match &s.phase {
            Phase::Prefilling { pass, .. } if !pass.images_pending() => Some((s.id, pass)),
            _ => None,
        }) else {
            return Next::Unknown;
        };
        let pos = plan.chunk.filter(|c| c.stream == id).map_or(pass.pos(), |c| c.end);
        if pos >= pass.plan().prompt_len {
            return Next::Unknown;
        }
        let decode_rows = plan.rows.iter().map(|r| r.tokens.len()).sum();
        let decode_ctx = plan.at.iter().map(|&at| self.running[at].len + 1).sum();
        // A plan without the chunk times the decode rows alone: the pacer
        // need not ask for that again in the round after.
        let timed = plan.chunk.is_none();
        match self.budget(id, pos, pass.plan(), Shape { decode_rows, decode_ctx, ..Shape::default() }, timed) {
            Budget::Chunk(Some(rows)) => Next::Chunk(id, pos, pass.plan().chunk_end_capped(pos, Some(rows))),
            Budget::Measure => Next::Plain,
            _ => Next::Unknown,
        }
    }

    /// The penalised streams' penalties for a round of `plan` picked where
    /// the logits are, on each of their token rows: a draft's row counts
    /// the drafts before it, as verifying them accepts them.
    fn penalties(&self, plan: &RoundPlan) -> Vec<Penalty> {
        let mut out = Vec::new();
        let mut row = 0;
        for (r, &at) in plan.rows.iter().zip(&plan.at) {
            let sampler = &self.running[at].sampler;
            if sampler.penalised() {
                // tokens[0] is the last token, accepted already; tokens[1..] the drafts.
                sampler.row_penalties(&r.tokens[1..], row, &mut out);
            }
            row += r.tokens.len() as u32;
        }
        out
    }

    /// Each token row's draw for a [`Pick::Draw`] round of `plan`: its
    /// stream's filters and next numbers, a draft's rows taking them in turn.
    fn draws(&self, plan: &RoundPlan) -> Vec<Draw> {
        let mut out = Vec::new();
        for (r, &at) in plan.rows.iter().zip(&plan.at) {
            self.running[at].sampler.draws(r.tokens.len(), &mut out);
        }
        out
    }

    /// Run `plan` (not empty) and hand its results to its streams.
    pub(super) fn run_round(&mut self, plan: RoundPlan) {
        let decode_rows: usize = plan.rows.iter().map(|r| r.tokens.len()).sum();
        // The drafter absorbs the decode rows' features after verifying
        // them; copied now, while they are valid.
        let dim = self.drafter.as_ref().map_or(0, |_| self.caps.feature_dim);
        let mut features = Vec::new();
        let mut picked = None;
        self.pacer.starting(plan.chunk.map(|c| (c.stream, c.end - c.start)));
        let announced = self.announce(&plan);
        self.announced = match announced {
            Next::Chunk(id, start, end) => Some((id, start, end)),
            _ => None,
        };
        if plan.chunk.is_none() && !plan.rows.is_empty() {
            // The prefill's chunk waited this round (named or not): it
            // waits no more.
            self.held = self.running.iter().find_map(|s| match &s.phase {
                Phase::Prefilling { pass, .. } => Some((s.id, pass.pos())),
                _ => None,
            });
        }
        // The announced chunk's rows (its pass's prompt is shared, so the
        // pass stays free to run this round's chunk).
        let next = self.announced.and_then(|(id, start, end)| match &self.running.iter().find(|s| s.id == id)?.phase {
            Phase::Prefilling { pass, .. } => Some((id, start, end, pass.prompt().clone(), pass.wants_logits_at(end))),
            _ => None,
        });
        let next_plain = announced == Next::Plain;
        let next_drafts = self.drafts_next(&plan);
        let next_chunk = next.as_ref().map(|(id, start, end, prompt, want)| (*id, Chunk { start: *start, tokens: &prompt[*start..*end], want_logits: *want }));
        let picks_on_device = plan.pick != Pick::Logits;
        let pick_masks = picks_on_device.then(|| PickMasks::of(&self.running, &self.mask_workers, &plan.rows, &plan.at)).flatten();
        let masks = pick_masks.as_ref().map(|m| m as &dyn RoundMasks);
        let penalties = if picks_on_device { self.penalties(&plan) } else { Vec::new() };
        let draws = if plan.pick == Pick::Draw { self.draws(&plan) } else { Vec::new() };
        // The round's step; a chunk, if any, goes in where the pass cuts it.
        let step = Step { next_chunk, next_plain, next_drafts, masks, penalties: &penalties, draws: &draws, ..Step::new(&plan.rows, None, plan.pick) };
        let t = self.backend.now();
        let stepped = match plan.chunk {
            None => {
                let out = self.backend.round(step);
                features = leading_features(&*self.backend, decode_rows * dim);
                picked = Some(out.map(|o| o.picked));
                None
            }
            Some(c) => {
                let s = &mut self.running[c.at];
                let drafter = self.drafter.as_deref_mut().filter(|_| s.draft_tokens > 0);
                let Phase::Prefilling { pass, paused } = &mut s.phase else { unreachable!("a planned chunk's stream is prefilling") };
                *paused = false;
                pass.set_max_rows(c.max_rows);
                debug_assert_eq!(pass.next_chunk(), (c.start, c.end));
                let backend = &mut *self.backend;
                Some(if plan.rows.is_empty() {
                    pass.step(backend, drafter)
                } else {
                    pass.step_via(backend, drafter, decode_rows, |b, stream, chunk| {
                        let out = b.round(Step { chunk: Some((stream, chunk)), ..step });
                        features = leading_features(b, decode_rows * dim);
                        let (p, logits) = match out {
                            Ok(o) => (Ok(o.picked), Ok(o.chunk_logits)),
                            Err(e) => (Err(anyhow!("{e:#}")), Err(e)),
                        };
                        picked = Some(p);
                        logits
                    })
                })
            }
        };
        let end = self.backend.now();
        let secs = end.saturating_duration_since(t).as_secs_f64();
        let masked = pick_masks.is_some();
        drop(pick_masks);
        // The loop's own time since the last call (an idle wait is not).
        let overhead = self.round_end.map_or(0.0, |e| t.saturating_duration_since(e).as_secs_f64()).min(MAX_OVERHEAD);
        self.round_end = Some(end);
        tracing::trace!(decode_rows, chunk_rows = plan.chunk.map_or(0, |c| c.end - c.start), pick = ?plan.pick, ms = secs * 1e3, overhead_ms = overhead * 1e3, "round");
        if picked.as_ref().is_none_or(Result::is_ok) && stepped.as_ref().is_none_or(Result::is_ok) {
            let decode_ctx = plan.rows.iter().map(|r| self.running.iter().find(|s| s.id == r.stream).map_or(0, |s| s.len)).sum();
            let (chunk_rows, chunk_start) = plan.chunk.map_or((0, 0), |c| (c.end - c.start, c.start));
            let shape = Shape { decode_rows, decode_ctx, chunk_rows, chunk_start };
            self.pacer.ran(Ran { shape, chunk: plan.chunk.map(|c| c.stream), secs, overhead });
        }
        self.count_round(&plan, decode_rows, secs);
        if let (Some(c), Some(stepped)) = (plan.chunk, stepped) {
            self.finish_chunk(c.at, stepped);
        }
        if !plan.rows.is_empty() {
            let picked = picked.unwrap_or_else(|| Err(anyhow!("the round did not run")));
            self.finish_rows(&plan, picked, masked, &features);
        }
    }

    fn count_round(&mut self, plan: &RoundPlan, decode_rows: usize, secs: f64) {
        if plan.rows.is_empty() {
            return;
        }
        let over = self.cfg.itl_target.is_some_and(|t| secs > t.as_secs_f64());
        let st = &mut self.stats;
        st.rounds_over_target += over as u64;
        st.decode_rounds += 1;
        st.decode_streams += plan.rows.len() as u64;
        st.decode_rows += decode_rows as u64;
        st.max_decode_batch = st.max_decode_batch.max(plan.rows.len());
        if plan.chunk.is_some() {
            st.fused_rounds += 1;
            st.longest_fused_round_secs = st.longest_fused_round_secs.max(secs);
        } else {
            st.plain_round_secs += secs;
            st.plain_rounds += 1;
            st.longest_plain_round_secs = st.longest_plain_round_secs.max(secs);
        }
    }

    /// Account for a prompt chunk: keep its mark, and after the pass's
    /// last chunk sample the first token.
    fn finish_chunk(&mut self, at: usize, stepped: Result<StepOutcome>) {
        let s = &mut self.running[at];
        let out = match stepped {
            Ok(o) => o,
            Err(e) => return s.fail(format!("prefill failed: {e:#}")),
        };
        self.stats.prefill_chunks += 1;
        self.stats.prefill_tokens += (out.end - out.start) as u64;
        if let Some((n, took)) = out.images {
            self.stats.images_encoded += n as u64;
            self.stats.image_encode_secs += took.as_secs_f64();
        }
        s.len = out.end;
        let planned = matches!(&s.phase, Phase::Prefilling { pass, .. } if pass.plan().marks.binary_search(&out.end).is_ok());
        match out.mark {
            Some(m) => {
                self.stats.marks_kept += 1;
                for d in self.prefix.insert(m, s.cache_salt, &s.prompt[..out.end]) {
                    self.backend.drop_mark(d);
                    self.stats.marks_dropped += 1;
                }
            }
            // The backend had no room for it (its mark slots are full, say):
            // the oldest mark gives way, so the cache keeps taking new ones.
            None if planned => {
                self.drop_lru_mark();
            }
            None => {}
        }
        let s = &mut self.running[at];
        if !out.done {
            return;
        }
        if s.warm {
            return s.finish(FinishReason::Warmed, String::new());
        }
        let vocab = self.caps.vocab_size;
        let logits = match out.logits {
            Some(l) if l.len() == vocab => l,
            other => return s.fail(format!("the backend returned {} logits for the last prompt row, expected {vocab}", other.map_or(0, |l| l.len()))),
        };
        let mut logits = logits;
        match self.check(at, &mut logits) {
            Checked::Take => self.first_token(at, logits),
            Checked::Refused => self.hold(at, Held::First(logits)),
            Checked::Failed => {}
        }
    }

    /// Sample the first token of the stream at `at` from its prompt's
    /// last-row logits.
    pub(super) fn first_token(&mut self, at: usize, mut logits: Vec<f32>) {
        let s = &mut self.running[at];
        let sampled = match sample_logits(s, &mut logits, 0, &mut self.stats) {
            Ok(x) => x,
            Err(f) => return s.failed(f),
        };
        let last = sampled.token;
        if !self.emit(at, sampled) {
            let propose = self.proposing(1);
            let s = &mut self.running[at];
            let draft = self.drafter.as_mut().filter(|_| propose && s.draft_tokens > 0).map(|d| d.propose(s.id, last)).unwrap_or_default();
            s.phase = Phase::Decoding { last, draft };
            self.send_guide(at);
        }
    }

    /// Emit a sampled token of the stream at `at` and commit it to its
    /// constraint; true when the stream has ended (a stop, its length, or
    /// the grammar complete).
    fn emit(&mut self, at: usize, sampled: Sampled) -> bool {
        let s = &mut self.running[at];
        let token = sampled.token;
        if s.emit(sampled, &self.cfg.eos_ids, &*self.text, &mut self.stats) {
            return true;
        }
        match commit(s, token) {
            Ok(false) => false,
            Ok(true) => {
                let tail = s.text.finish();
                s.finish(FinishReason::Stop, tail);
                true
            }
            Err(e) => {
                s.fail_grammar(format!("the grammar refused token {token}: {e}"));
                true
            }
        }
    }

    /// Every decode row's results, or every stream of the round fails,
    /// told why.
    fn finish_rows(&mut self, plan: &RoundPlan, picked: Result<Picked>, masked: bool, features: &[f32]) {
        let total: usize = plan.rows.iter().map(|r| r.tokens.len()).sum();
        let mut picked = match picked.and_then(|p| check(p, plan.pick, masked, total, self.caps.vocab_size)) {
            Ok(p) => p,
            Err(e) => return plan.at.iter().for_each(|&at| self.running[at].fail(format!("decode round failed: {e:#}"))),
        };
        match plan.pick {
            Pick::Argmax => self.stats.greedy_rounds += 1,
            Pick::TopK(_) => self.stats.top_rounds += 1,
            Pick::Draw if matches!(picked, Picked::Tokens(_)) => self.stats.draw_rounds += 1,
            Pick::Draw | Pick::Logits => {}
        }
        // Masks the backend's pick took reach their streams first.
        self.mask_workers.rows_pending = plan.at.iter().map(|&at| self.running[at].id).collect();
        self.take_masks();
        let (dim, vocab) = (self.caps.feature_dim, self.caps.vocab_size);
        let mut offset = 0;
        for (row, &at) in plan.rows.iter().zip(&plan.at) {
            let n = row.tokens.len();
            let id = self.running[at].id;
            let kept = features.get(offset * dim..(offset + n) * dim).unwrap_or(&[]);
            let checked = match &mut picked {
                // A guided stream's rows came back as logits (see `masks`).
                Picked::Logits(l) if n == 1 => self.check(at, &mut l[offset * vocab..(offset + 1) * vocab]),
                Picked::Logits(_) if !self.masks_ready(at) => Checked::Refused,
                _ => Checked::Take,
            };
            match (checked, &picked) {
                (Checked::Take, _) => self.verify(at, &row.tokens, &mut picked, offset, kept),
                (Checked::Refused, Picked::Logits(l)) => {
                    let logits = l[offset * vocab..(offset + n) * vocab].to_vec();
                    self.hold(at, Held::Round { fed: row.tokens.clone(), logits, features: kept.to_vec() });
                }
                (Checked::Refused, _) => unreachable!("only logits rows are held"),
                (Checked::Failed, _) => {}
            }
            self.mask_workers.rows_pending.retain(|&p| p != id);
            offset += n;
        }
    }

    /// One stream's token rows (`fed`: its last token, then the draft),
    /// from `offset` on: sample each in turn; a row's result is kept while
    /// the token sampled before it matched the draft it fed, so output is
    /// what it would be without the draft. Then rewind the rejected rows,
    /// let the drafter absorb the kept rows, and take its next proposal.
    pub(super) fn verify(&mut self, at: usize, fed: &[u32], picked: &mut Picked, offset: usize, features: &[f32]) {
        let draft = &fed[1..];
        let vocab = self.caps.vocab_size;
        let mut kept = 0;
        let mut last = None;
        let mut ended = false;
        for j in 0..=draft.len() {
            let s = &mut self.running[at];
            let sampled = match sample_row(s, picked, offset + j, j, vocab, &mut self.stats) {
                Ok(x) => x,
                Err(f) => return s.failed(f),
            };
            let tok = sampled.token;
            kept = j + 1;
            if self.emit(at, sampled) {
                ended = true;
                break;
            }
            last = Some(tok);
            if draft.get(j) != Some(&tok) {
                break;
            }
            self.stats.draft_accepted += 1;
        }
        self.stats.draft_proposed += draft.len() as u64;
        if !draft.is_empty() {
            let accepted = kept.saturating_sub(1).min(draft.len());
            let hist = &mut self.stats.draft_accept_lengths;
            let i = accepted.min(ACCEPT_LENGTHS - 1);
            if hist.len() <= i {
                hist.resize(i + 1, 0);
            }
            hist[i] += 1;
        }
        let Some(last) = last.filter(|_| !ended) else { return };
        let s = &mut self.running[at];
        s.len += kept;
        if kept <= draft.len() {
            if let Err(e) = self.backend.rewind(s.id, s.len) {
                return s.fail(format!("rewinding rejected drafts failed: {e:#}"));
            }
        }
        let dim = features.len() / (draft.len() + 1);
        let propose = self.proposing(0);
        let s = &mut self.running[at];
        let next = match self.drafter.as_mut().filter(|_| s.draft_tokens > 0) {
            Some(d) => {
                d.absorb(s.id, &fed[..kept], features.get(..kept * dim).unwrap_or(&[]));
                if propose {
                    d.propose(s.id, last)
                } else {
                    Vec::new()
                }
            }
            None => Vec::new(),
        };
        s.phase = Phase::Decoding { last, draft: next };
        self.send_guide(at);
    }
}

/// Buckets of `LaneStats::draft_accept_lengths` (the last holds longer ones).
pub const ACCEPT_LENGTHS: usize = 17;

impl Core {
    /// Most draft tokens a round may verify per stream (0 without a drafter).
    pub(super) fn max_draft(&self) -> usize {
        if self.drafter.is_some() {
            self.cfg.max_draft
        } else {
            0
        }
    }

    /// Whether a stream of `plan` will likely feed a draft in the next
    /// round: the drafter proposes after this one and may give it tokens.
    fn drafts_next(&self, plan: &RoundPlan) -> bool {
        let Some(d) = self.drafter.as_deref() else { return false };
        self.proposing(0) && plan.at.iter().map(|&at| &self.running[at]).any(|s| s.draft_tokens > 0 && d.may_propose(s.id))
    }

    /// Whether streams ask the drafter for proposals now: not while more
    /// streams decode (and `joining` more are about to) than
    /// `draft_max_streams`, since their drafts would not run.
    pub(super) fn proposing(&self, joining: usize) -> bool {
        joining + self.running.iter().filter(|s| matches!(s.phase, Phase::Decoding { .. })).count() <= self.cfg.draft_max_streams
    }
}

/// The first `n` floats of the backend's features (empty if it has fewer).
fn leading_features(backend: &dyn Backend, n: usize) -> Vec<f32> {
    backend.features().and_then(|f| f.get(..n)).unwrap_or(&[]).to_vec()
}

/// `picked` if it is what `pick` asked for, one entry per token row (or
/// logits, for an argmax or top-k round with `masked` rows: a mask was
/// late; or for a draw round, which a backend may return whole).
fn check(picked: Picked, pick: Pick, masked: bool, rows: usize, vocab: usize) -> Result<Picked> {
    let ok = match (&picked, pick) {
        (Picked::Logits(l), Pick::Logits) => l.len() == rows * vocab,
        (Picked::Logits(l), Pick::Argmax | Pick::TopK(_)) if masked => l.len() == rows * vocab,
        (Picked::Logits(l), Pick::Draw) => l.len() == rows * vocab,
        (Picked::Tokens(t), Pick::Argmax | Pick::Draw) => t.len() == rows,
        (Picked::Top(c), Pick::TopK(k)) => c.len() == rows && c.iter().all(|r| r.len() == k),
        _ => false,
    };
    if !ok {
        let got = match &picked {
            Picked::Logits(l) => format!("{} logits", l.len()),
            Picked::Tokens(t) => format!("{} tokens", t.len()),
            Picked::Top(c) => format!("{} candidate rows", c.len()),
        };
        bail!("the backend returned {got} for a round of {rows} rows of {vocab} asking for {pick:?}");
    }
    Ok(picked)
}
