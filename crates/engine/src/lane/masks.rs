//! Guided streams: their masks, computed off the lane's thread.
//!
//! A guided stream's [`Constraint`] travels. As soon as the stream's
//! newest token is committed (on the lane thread: commits are fast, and
//! say at once when the grammar is complete), the constraint goes to a
//! mask worker with the stream's draft. The worker computes the mask of
//! the stream's next row, and one per draft token (consuming each, then
//! rolling back), while the lane runs the round's forward. When the
//! round's results come back the masks are usually there; when they are
//! not, the stream's rows wait ([`Phase::Waiting`]) and the lane goes on
//! with the other streams, sampling the waiting ones once their masks
//! come (a worker wakes the lane). So a slow mask delays its own stream,
//! never the others.
//!
//! A guided stream's rows are picked where the backend picks argmax or
//! top-k (`Need::MaskedArgmax` greedy, `Need::MaskedTop` sampled among its
//! top k): the backend asks for the round's masks when it picks
//! ([`PickMasks`]), after its forward is on its way, so the masks the
//! workers finish meanwhile apply on the device and no logits row moves.
//! A mask still on its way is waited for a little ([`MASK_WAIT`]); when it
//! is missing after that, the round returns logits and the stream waits as
//! above. Guided streams with penalties, logprobs or no
//! top-k take whole logits rows and their masks apply on the host.
//!
//! A greedy stream whose rows come back whole anyway (a backend that picks
//! nothing, the CPU's) computes no mask ahead ([`Guided::Checks`]): its
//! token is its row's argmax when the grammar takes that token (one
//! token's bytes through the grammar, microseconds). Only when the grammar
//! refuses it does a worker compute the mask, the row waiting for it as a
//! late mask's rows do; the lane waits for it a little ([`CHECK_WAIT`])
//! before the next round, which it would otherwise miss. The token is the
//! masked argmax either way; a model that follows its grammar leaves the
//! mask workers idle, and on a CPU they take the forward's cores. A round
//! with draft rows computes its masks ahead, as before.
//!
//! A greedy stream picked on the device needs its masks when the backend
//! picks; when one comes late, the round returns logits. Such a stream
//! keeps a copy of its constraint on the lane's thread ([`Checker`]): the
//! row's argmax is checked there, and when the grammar takes it the
//! stream goes on at once instead of sitting out a round for the mask.
//! The constraint with the worker falls behind by the tokens so taken; it
//! takes them when it comes back, its masks (stale) dropped, and goes back
//! for masks where the stream now is. Coming back while the round that
//! holds the stream's next row is being finished, it stays here without
//! masks until that row's token is taken (by the checker again), then
//! goes: sent at once, it would be behind again by that token, and every
//! round after would return logits.

use std::cell::RefCell;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::run::{panic_text, Core};
use super::stats::LaneStats;
use super::stream::{Failed, Phase, Stream};
use super::Command;
use crate::backend::{DecodeRow, Picked, RoundMasks, StreamId};
use crate::guide::{Constraint, TokenMask};
use crate::sampling::{Sampled, Sampler};

/// How long a backend's pick waits for a guided row's mask still on its
/// way. The round's forward runs meanwhile; without the mask the round
/// returns logits and launches nothing ahead. On the H100 a guided stream
/// whose masks took 4-10 µs decoded 17% slower than a free one (rounds of
/// 1.21 ms against 1.03): a round launched ahead asks for its masks as it
/// is called, before the worker has the mask of the token just committed.
const MASK_WAIT: Duration = Duration::from_micros(500);

/// How long the lane waits, before its next round, for the mask of a
/// token a checking stream's grammar refused: without it the stream sits
/// that round out. A CPU round takes 10-30 ms; SmolLM2's masks 0.1-0.6 ms,
/// Qwen2.5's 0.3-1.4.
const CHECK_WAIT: Duration = Duration::from_millis(1);

/// A guided stream's constraint: with a worker, or here with the masks of
/// the stream's next rows (mask `j` for the row after draft token `j - 1`;
/// none when it came back behind its checker).
pub(super) enum Guided {
    Away,
    Here {
        constraint: Box<dyn Constraint>,
        masks: Vec<TokenMask>,
    },
    /// Greedy, no penalty, no logprobs, rows back whole: each token is
    /// checked first, and a mask computed only when it is refused.
    Checks(Box<dyn Constraint>),
}

impl Guided {
    /// The mask of the stream's row `j` of the round (None past those
    /// computed: such a row cannot be reached, see [`masks_for`]).
    pub fn mask(&self, j: usize) -> Option<&TokenMask> {
        match self {
            Guided::Here { masks, .. } => masks.get(j),
            Guided::Away | Guided::Checks(_) => None,
        }
    }

    /// The mask for row `j`, which its stream samples within: missing is
    /// the lane's own error (such rows are held, never sampled).
    pub(super) fn mask_for(&self, j: usize) -> Result<&TokenMask, Failed> {
        self.mask(j).ok_or_else(|| no_mask(j))
    }

    /// Accept a sampled token; true when the grammar is complete.
    pub fn commit(&mut self, token: u32) -> Result<bool, String> {
        match self {
            Guided::Here { constraint, .. } | Guided::Checks(constraint) => constraint.commit(token),
            Guided::Away => Err("the constraint was committed to while a worker held it".into()),
        }
    }

    /// Here, but without masks: back behind the stream's checker.
    fn bare(&self) -> bool {
        matches!(self, Guided::Here { masks, .. } if masks.is_empty())
    }

    /// Its stream's rows cannot be sampled yet: the constraint is with a
    /// worker, or here without masks.
    fn waits(&self) -> bool {
        matches!(self, Guided::Away) || self.bare()
    }
}

fn no_mask(j: usize) -> Failed {
    Failed::Other(format!("no mask for row {j} of a guided stream"))
}

/// The argmax of `row` and whether `c` allows it. Only for a stream that
/// samples greedily with no penalty ([`greedy_plain`]): the row is left as
/// it was.
fn argmax_allowed(sampler: &mut Sampler, c: &mut dyn Constraint, row: &mut [f32]) -> Result<(Sampled, bool), Failed> {
    let first = sampler.sample_masked(row, None, None);
    let allowed = guarded(|| c.allows(first.token))?;
    Ok((first, allowed))
}

/// Sample a logits row of `s` (its row `j` of a round): within the row's
/// mask when guided, or for a stream that checks first, the argmax if its
/// grammar takes it, else the argmax within the mask computed now. `row`
/// is scratch (see [`crate::Sampler::sample_masked`]).
pub(super) fn sample_logits(s: &mut Stream, row: &mut [f32], j: usize, stats: &mut LaneStats) -> Result<Sampled, Failed> {
    let mask = match &mut s.guided {
        // A row the lane has not checked (a draft's that came late): the
        // mask, if needed, is computed here.
        Some(Guided::Checks(c)) => {
            let (first, allowed) = argmax_allowed(&mut s.sampler, &mut **c, row)?;
            if allowed {
                return Ok(first);
            }
            stats.guided_masks += 1;
            let mask = guarded(|| c.mask())?;
            return Ok(s.sampler.sample_masked(row, None, Some(&mask)));
        }
        // A row whose mask came late or stale, its argmax checked (`check_late`).
        Some(g) if g.mask(j).is_none() && s.checker.is_some() => {
            let ch = s.checker.as_mut().expect("matched above");
            return match argmax_allowed(&mut s.sampler, &mut *ch.constraint, row)? {
                (first, true) => Ok(first),
                (_, false) => Err(no_mask(j)),
            };
        }
        Some(g) => Some(g.mask_for(j)?),
        None => None,
    };
    Ok(s.sampler.sample_masked(row, s.logprobs, mask))
}

/// A copy of a guided stream's constraint, kept on the lane's thread (see
/// the module's doc).
pub(super) struct Checker {
    constraint: Box<dyn Constraint>,
    /// Tokens the stream took while its constraint was with a worker.
    behind: Vec<u32>,
}

/// Commit a sampled token to the stream's constraint (and its checker);
/// true when the grammar is complete.
pub(super) fn commit(s: &mut Stream, token: u32) -> Result<bool, String> {
    let checked = match &mut s.checker {
        Some(ch) => Some(ch.constraint.commit(token)?),
        None => None,
    };
    match (&mut s.guided, &mut s.checker, checked) {
        (Some(Guided::Away), Some(ch), Some(complete)) => {
            ch.behind.push(token);
            Ok(complete)
        }
        (Some(g), ..) => g.commit(token),
        (None, ..) => Ok(false),
    }
}

/// `f`, a grammar's call on the lane's thread: its error is the
/// grammar's, and a panic in it the stream's error, as on a worker (see
/// [`run`]).
fn guarded<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, Failed> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(Failed::Grammar),
        Err(p) => Err(Failed::Other(format!("the grammar panicked: {}", panic_text(&*p)))),
    }
}

/// Greedy, with no penalty or logprobs: its row's argmax is its token, and
/// taking it leaves the row as it was.
fn greedy_plain(s: &Stream) -> bool {
    s.sampler.params().is_greedy() && !s.sampler.penalised() && s.logprobs.is_none()
}

/// What checking a row's argmax found (see [`Core::check`]).
pub(super) enum Checked {
    /// Sample the row: no check was due, or the grammar takes the argmax.
    Take,
    /// The grammar refused it: the row waits for its mask.
    Refused,
    /// The grammar failed; so did the stream.
    Failed,
}

/// Results a waiting stream's rows left, to sample once its masks come.
pub(super) enum Held {
    /// The prompt's last-row logits (the first token).
    First(Vec<f32>),
    /// A decode round's rows: the tokens they fed (the last token, then
    /// the draft verified), their logits rows and their feature rows.
    Round { fed: Vec<u32>, logits: Vec<f32>, features: Vec<f32> },
}

impl Held {
    /// The draft tokens the held rows verify (a mask is needed for each).
    fn draft(&self) -> Vec<u32> {
        match self {
            Held::Round { fed, .. } => fed[1..].to_vec(),
            Held::First(_) => Vec::new(),
        }
    }
}

struct Job {
    stream: StreamId,
    constraint: Box<dyn Constraint>,
    draft: Vec<u32>,
}

struct Done {
    stream: StreamId,
    constraint: Box<dyn Constraint>,
    masks: Result<Vec<TokenMask>, Failed>,
}

/// The mask workers: threads started with the first guided stream, fed
/// one job per stream and round.
pub(super) struct MaskWorkers {
    threads: usize,
    /// Wakes the lane when a job is done (it may be waiting for nothing else).
    wake: Sender<Command>,
    jobs: Option<Sender<Job>>,
    done_tx: Sender<Done>,
    done: Receiver<Done>,
    /// Jobs done that a backend's pick took from `done` (see [`PickMasks`]),
    /// for [`Core::take_masks`].
    early: RefCell<Vec<Done>>,
    /// Checking streams whose refused token's mask a worker computes.
    refused: Vec<StreamId>,
    /// Streams whose rows of the round being finished are not sampled yet.
    pub(super) rows_pending: Vec<StreamId>,
}

impl MaskWorkers {
    pub fn new(threads: usize, wake: Sender<Command>) -> MaskWorkers {
        let (done_tx, done) = mpsc::channel();
        MaskWorkers { threads: threads.max(1), wake, jobs: None, done_tx, done, early: RefCell::new(Vec::new()), refused: Vec::new(), rows_pending: Vec::new() }
    }

    fn send(&mut self, job: Job) {
        if self.jobs.is_none() {
            self.jobs = self.spawn();
        }
        let job = match &self.jobs {
            Some(tx) => match tx.send(job) {
                Ok(()) => return,
                Err(mpsc::SendError(job)) => job,
            },
            None => job,
        };
        // No worker could start: compute here rather than never.
        let _ = self.done_tx.send(run(job));
    }

    /// Wait until `until` for the refused tokens' masks (kept in `early`).
    fn wait_refused(&mut self, until: Instant) {
        let early = self.early.get_mut();
        early.extend(self.done.try_iter());
        while self.refused.iter().any(|id| !early.iter().any(|d| d.stream == *id)) {
            match self.done.recv_timeout(until.saturating_duration_since(Instant::now())) {
                Ok(done) => early.push(done),
                Err(_) => break,
            }
        }
        self.refused.clear();
    }

    fn spawn(&self) -> Option<Sender<Job>> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut started = 0;
        for i in 0..self.threads {
            let (rx, done, wake) = (rx.clone(), self.done_tx.clone(), self.wake.clone());
            let worker = move || loop {
                let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                let Ok(job) = job else { return };
                if done.send(run(job)).is_err() {
                    return;
                }
                let _ = wake.send(Command::Wake);
            };
            started += usize::from(std::thread::Builder::new().name(format!("braid-mask-{i}")).spawn(worker).is_ok());
        }
        (started > 0).then_some(tx)
    }
}

/// One stream's token rows in a round, as [`PickMasks`] sees them.
enum RowsOf {
    Free(usize),
    Here(usize, Vec<TokenMask>),
    Away(usize, StreamId),
    /// A stream that checks first has no masks to give, nor one whose
    /// worker is behind it: their rows come back whole.
    Checks,
}

/// The masks of an argmax round's guided rows (see [`RoundMasks`]): those
/// here when the round was planned, and those a worker finishes before the
/// backend picks.
pub(super) struct PickMasks<'a> {
    rows: Vec<RowsOf>,
    workers: &'a MaskWorkers,
}

impl PickMasks<'_> {
    /// The masks of a round of `rows`, from the streams at `at` of
    /// `running`; None when none of them is guided.
    pub fn of<'a>(running: &[Stream], workers: &'a MaskWorkers, rows: &[DecodeRow], at: &[usize]) -> Option<PickMasks<'a>> {
        let guided = at.iter().any(|&a| running[a].guided.is_some());
        let rows = rows.iter().map(|r| r.tokens.len()).zip(at).map(|(n, &a)| match &running[a].guided {
            None => RowsOf::Free(n),
            // Back behind its checker: no masks until its next token.
            Some(g) if g.bare() => RowsOf::Checks,
            Some(Guided::Here { masks, .. }) => RowsOf::Here(n, masks.clone()),
            // Behind: the worker's masks are for an earlier place.
            Some(Guided::Away) if running[a].checker.as_ref().is_some_and(|c| !c.behind.is_empty()) => RowsOf::Checks,
            Some(Guided::Away) => RowsOf::Away(n, running[a].id),
            Some(Guided::Checks(_)) => RowsOf::Checks,
        });
        guided.then(|| PickMasks { rows: rows.collect(), workers })
    }
}

impl RoundMasks for PickMasks<'_> {
    fn masks(&self) -> Option<Vec<Option<TokenMask>>> {
        let mut early = self.workers.early.borrow_mut();
        early.extend(self.workers.done.try_iter());
        let deadline = Instant::now() + MASK_WAIT;
        while self.rows.iter().any(|r| matches!(r, RowsOf::Away(_, id) if !early.iter().any(|d| d.stream == *id))) {
            match self.workers.done.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(done) => early.push(done),
                Err(_) => break,
            }
        }
        let mut out = Vec::new();
        for r in &self.rows {
            let (n, masks) = match r {
                RowsOf::Free(n) => (*n, None),
                RowsOf::Here(n, masks) => (*n, Some(masks.as_slice())),
                RowsOf::Away(n, id) => match early.iter().rev().find(|d| d.stream == *id)?.masks.as_ref() {
                    Ok(masks) => (*n, Some(masks.as_slice())),
                    // The stream fails when the lane takes it.
                    Err(_) => return None,
                },
                RowsOf::Checks => return None,
            };
            // Rows past a stream's masks are never sampled (see `masks_for`).
            out.extend((0..n).map(|j| masks.and_then(|m| m.get(j)).cloned()));
        }
        Some(out)
    }
}

/// A job's masks. A grammar that panics fails its stream (as a grammar
/// error does) and leaves the worker serving the others: the stream would
/// otherwise wait for ever for masks that never come.
fn run(mut job: Job) -> Done {
    let t = std::time::Instant::now();
    let masks = guarded(|| masks_for(&mut *job.constraint, &job.draft));
    tracing::trace!(stream = job.stream, rows = masks.as_ref().map_or(0, Vec::len), ms = t.elapsed().as_secs_f64() * 1e3, "masks");
    Done { stream: job.stream, constraint: job.constraint, masks }
}

/// The mask of the next row, then one per draft token while the draft
/// follows the grammar: draft token `i` is consumed (if the mask before
/// it allows it and it does not complete the grammar) and the next mask
/// computed; then the drafts are rolled back. A row past the masks is
/// never sampled: reaching it takes a sampled token equal to a draft
/// token its mask forbids, or one that ended the stream.
fn masks_for(c: &mut dyn Constraint, draft: &[u32]) -> Result<Vec<TokenMask>, String> {
    let mut masks = vec![c.mask()?];
    let mut consumed = 0;
    for &t in draft {
        if !masks[consumed].allows(t) {
            break;
        }
        let complete = c.commit(t)?;
        consumed += 1;
        if complete {
            break;
        }
        masks.push(c.mask()?);
    }
    c.rollback(consumed)?;
    Ok(masks)
}

impl Core {
    /// A new stream with a guide starts its constraint, and its first mask
    /// is computed while it queues and prefills.
    pub(super) fn start_guide(&mut self, s: &mut Stream) {
        let Some(guide) = s.sampler.params().guide.clone() else { return };
        match guide.start() {
            Ok(constraint) if self.checks_first(s) => s.guided = Some(Guided::Checks(constraint)),
            Ok(constraint) => {
                if greedy_plain(s) {
                    s.checker = constraint.fork().map(|constraint| Checker { constraint, behind: Vec::new() });
                }
                self.mask_workers.send(Job { stream: s.id, constraint, draft: Vec::new() });
                s.guided = Some(Guided::Away);
            }
            Err(e) => s.fail_grammar(format!("the grammar could not start: {e}")),
        }
    }

    /// Whether `s` checks its tokens first ([`Guided::Checks`]): greedy,
    /// with no penalty or logprobs (its row's argmax is then its token, the
    /// row left as it was), on a backend that picks nothing (its rows come
    /// back whole anyway; a backend that picks on the device needs the
    /// masks when it picks).
    fn checks_first(&self, s: &Stream) -> bool {
        let picks = self.caps.picks;
        greedy_plain(s) && !picks.argmax && picks.top_k == 0 && !picks.draw
    }

    /// For a lone row of the stream at `at` that came back as logits:
    /// whether it is sampled now or waits for its mask. A stream that
    /// checks first checks its argmax; one whose mask is late, by its
    /// checker if it has one.
    pub(super) fn check(&mut self, at: usize, row: &mut [f32]) -> Checked {
        if self.masks_ready(at) {
            self.check_first(at, row)
        } else {
            self.check_late(at, row)
        }
    }

    /// For a stream whose mask came late, whether its checker takes the
    /// argmax of its logits `row` (no checker: it waits for the mask).
    fn check_late(&mut self, at: usize, row: &mut [f32]) -> Checked {
        let s = &mut self.running[at];
        let Some(ch) = s.checker.as_mut() else { return Checked::Refused };
        match argmax_allowed(&mut s.sampler, &mut *ch.constraint, row) {
            Ok((_, true)) => {
                self.stats.guided_checks += 1;
                Checked::Take
            }
            // The caller holds the row (see `hold`).
            Ok((_, false)) => Checked::Refused,
            Err(f) => {
                s.failed(f);
                Checked::Failed
            }
        }
    }

    /// Hand the constraint of the stream at `at` (decoding, its newest
    /// token committed) to a worker for its next rows' masks.
    /// A stream that checks first keeps its constraint while it has no
    /// draft to verify.
    pub(super) fn send_guide(&mut self, at: usize) {
        let checks = matches!(&self.running[at].phase, Phase::Decoding { draft, .. } if draft.is_empty()) && self.checks_first(&self.running[at]);
        let s = &mut self.running[at];
        let Phase::Decoding { draft, .. } = &s.phase else { return };
        match s.guided.take() {
            Some(Guided::Here { constraint, .. } | Guided::Checks(constraint)) if checks => s.guided = Some(Guided::Checks(constraint)),
            Some(Guided::Here { constraint, .. } | Guided::Checks(constraint)) => {
                self.mask_workers.send(Job { stream: s.id, constraint, draft: draft.clone() });
                s.guided = Some(Guided::Away);
            }
            other => s.guided = other,
        }
    }

    /// For a stream that checks first, whether the grammar takes the argmax
    /// of its logits `row`; when it refuses it, a worker computes the mask
    /// (the caller holds the row for it).
    fn check_first(&mut self, at: usize, row: &mut [f32]) -> Checked {
        let s = &mut self.running[at];
        let Some(Guided::Checks(c)) = &mut s.guided else { return Checked::Take };
        match argmax_allowed(&mut s.sampler, &mut **c, row) {
            Ok((_, true)) => {
                self.stats.guided_checks += 1;
                Checked::Take
            }
            Ok((_, false)) => {
                let Some(Guided::Checks(constraint)) = s.guided.replace(Guided::Away) else { unreachable!("matched above") };
                self.mask_workers.send(Job { stream: s.id, constraint, draft: Vec::new() });
                self.mask_workers.refused.push(s.id);
                Checked::Refused
            }
            Err(f) => {
                s.failed(f);
                Checked::Failed
            }
        }
    }

    /// Hand finished masks to their streams (dropped if a stream is gone).
    /// A constraint the stream's checker went on without takes the tokens
    /// taken meanwhile and goes back for masks where the stream now is
    /// (see the module's doc).
    pub(super) fn take_masks(&mut self) {
        let early = std::mem::take(self.mask_workers.early.get_mut());
        let mut behind = Vec::new();
        for done in early.into_iter().chain(std::iter::from_fn(|| self.mask_workers.done.try_recv().ok())) {
            let Some(s) = self.running.iter_mut().chain(self.queue.iter_mut()).find(|s| s.id == done.stream) else { continue };
            if s.ended() {
                continue;
            }
            let taken = s.checker.as_mut().map(|c| std::mem::take(&mut c.behind)).unwrap_or_default();
            match done.masks {
                Ok(masks) if taken.is_empty() => {
                    self.stats.guided_masks += masks.len() as u64;
                    // Draft tokens past the masks are never accepted:
                    // they need not run.
                    if let Phase::Decoding { draft, .. } = &mut s.phase {
                        draft.truncate(masks.len() - 1);
                    }
                    s.guided = Some(Guided::Here { constraint: done.constraint, masks });
                }
                Ok(_) => {
                    let mut constraint = done.constraint;
                    match taken.iter().try_for_each(|&t| constraint.commit(t).map(drop)) {
                        Ok(()) => {
                            s.guided = Some(Guided::Here { constraint, masks: Vec::new() });
                            behind.push(s.id);
                        }
                        Err(e) => s.fail_grammar(e),
                    }
                }
                Err(f) => s.failed(f),
            }
        }
        // Back for masks where the stream now is (one per draft token its
        // held or next rows verify), unless its row in the round being
        // finished is still to take its token.
        for id in behind {
            let Some(s) = self.running.iter_mut().find(|s| s.id == id) else { continue };
            let draft = match &s.phase {
                Phase::Waiting(held) => held.draft(),
                Phase::Decoding { .. } if self.mask_workers.rows_pending.contains(&id) => continue,
                Phase::Decoding { draft, .. } => draft.clone(),
                _ => continue,
            };
            let Some(Guided::Here { constraint, .. }) = s.guided.replace(Guided::Away) else { continue };
            self.mask_workers.send(Job { stream: id, constraint, draft });
        }
    }

    /// Whether the stream at `at` can sample now: it has no guide, or its
    /// masks are back (a constraint back behind its checker has none).
    pub(super) fn masks_ready(&mut self, at: usize) -> bool {
        if matches!(self.running[at].guided, Some(Guided::Away)) {
            self.take_masks();
        }
        !self.running[at].guided.as_ref().is_some_and(Guided::waits)
    }

    /// Park a stream's results until its masks come. A constraint here
    /// without masks (back behind its checker) goes to a worker for them.
    pub(super) fn hold(&mut self, at: usize, held: Held) {
        self.stats.mask_waits += 1;
        let s = &mut self.running[at];
        if s.guided.as_ref().is_some_and(Guided::bare) {
            let Some(Guided::Here { constraint, .. }) = s.guided.replace(Guided::Away) else { unreachable!("bare is here") };
            self.mask_workers.send(Job { stream: s.id, constraint, draft: held.draft() });
        }
        s.phase = Phase::Waiting(held);
    }

    /// Sample the waiting streams whose masks came; true if any did.
    pub(super) fn settle(&mut self) -> bool {
        if !self.mask_workers.refused.is_empty() {
            self.mask_workers.wait_refused(Instant::now() + CHECK_WAIT);
        }
        self.take_masks();
        let mut moved = false;
        for at in 0..self.running.len() {
            let s = &mut self.running[at];
            if !matches!(s.phase, Phase::Waiting(_)) || s.guided.as_ref().is_some_and(Guided::waits) {
                continue;
            }
            let Phase::Waiting(held) = std::mem::replace(&mut s.phase, Phase::Decoding { last: 0, draft: Vec::new() }) else { continue };
            moved = true;
            match held {
                Held::First(logits) => self.first_token(at, logits),
                Held::Round { fed, logits, features } => self.verify(at, &fed, &mut Picked::Logits(logits), 0, &features),
            }
        }
        moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allows tokens above the last committed one (`0..vocab` at the start),
    /// complete at `done`; logs its calls.
    struct Rising {
        seq: Vec<u32>,
        vocab: u32,
        done: u32,
        calls: Vec<String>,
    }

    impl Constraint for Rising {
        fn mask(&mut self) -> Result<TokenMask, String> {
            self.calls.push(format!("mask@{}", self.seq.len()));
            let from = self.seq.last().map_or(0, |&t| t + 1);
            Ok(TokenMask::of(self.vocab as usize, from..self.vocab))
        }
        fn allows(&mut self, token: u32) -> Result<bool, String> {
            Ok(token < self.vocab && self.seq.last().is_none_or(|&t| token > t))
        }
        fn commit(&mut self, token: u32) -> Result<bool, String> {
            self.calls.push(format!("commit {token}"));
            self.seq.push(token);
            Ok(token == self.done)
        }
        fn rollback(&mut self, tokens: usize) -> Result<(), String> {
            self.calls.push(format!("rollback {tokens}"));
            self.seq.truncate(self.seq.len() - tokens);
            Ok(())
        }
    }

    #[test]
    fn draft_masks_stop_where_the_draft_leaves_the_grammar() {
        let mut c = Rising { seq: vec![3], vocab: 16, done: 15, calls: Vec::new() };
        // 5 and 7 rise; 6 does not: masks for rows 0, 1, 2 (after 5, 7).
        let masks = masks_for(&mut c, &[5, 7, 6, 9]).unwrap();
        assert_eq!(masks.len(), 3);
        assert!(masks[0].allows(4) && !masks[0].allows(3));
        assert!(masks[2].allows(8) && !masks[2].allows(7));
        assert_eq!(c.seq, vec![3], "the drafts were rolled back");
        assert_eq!(c.calls, ["mask@1", "commit 5", "mask@2", "commit 7", "mask@3", "rollback 2"]);
        // A draft token that completes the grammar: no row after it.
        let mut c = Rising { seq: vec![3], vocab: 16, done: 9, calls: Vec::new() };
        assert_eq!(masks_for(&mut c, &[5, 9, 12]).unwrap().len(), 2);
        assert_eq!(c.seq, vec![3]);
        assert_eq!(c.calls.last().unwrap(), "rollback 2");
    }
}
