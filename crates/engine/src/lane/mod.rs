//! The lane: one backend on its own thread, and the loop that shares it
//! between streams.
//!
//! Each turn of the loop (a *round*): take arrivals and cancels, admit what
//! fits, plan the round (`plan`: every decoding stream's next token or
//! verified draft, and at most one prompt chunk of the oldest prefilling
//! stream, as much of it as the `pacer` allows), run it in one
//! [`Backend::round`], and emit tokens and finishes.
//! Decode rows and the chunk share one forward, so the chunk adds only its
//! own rows' cost to the others' round: a long prompt never freezes the
//! streams already decoding. An idle lane blocks on its channel.
//!
//! The units: `event` and `stats` (what callers see), `stream` (one
//! stream's phase and stop rules), `plan` (the pure scheduling policy),
//! `pacer` (how many prompt rows a round may take), `memory` (admission
//! and making room), `open` (a stream's start: slot, cached prefix, cuts),
//! `round` (running a plan and handing its results to the streams),
//! `masks` (guided streams' masks, computed off the lane's thread) and
//! `run` (the loop).

mod event;
mod masks;
mod memory;
mod open;
mod pacer;
mod plan;
mod round;
mod run;
mod stats;
mod stream;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use event::{Event, EventSink, FinishReason, FnSink, Request, SubmitError, Timing, Usage};
pub use pacer::RoundCost;
pub use stats::LaneStats;

use crate::backend::{Backend, Capabilities, StreamId};
use crate::drafter::Drafter;
use crate::sampling::SamplingParams;
use crate::stop::TokenText;
use run::Core;

/// How a lane schedules. The defaults suit a server.
#[derive(Clone, Debug, PartialEq)]
pub struct LaneConfig {
    /// The prompt chunk cap: most prompt rows in one chunk (also capped by
    /// the backend's `max_batch`, which counts every row of a round).
    pub chunk_tokens: usize,
    /// A smaller per-step cap for fairness, applied only where cut sizes
    /// are free (`Capabilities::free_cuts`; others keep the whole pass's cuts).
    pub max_rows: Option<usize>,
    /// Most streams admitted at once (prefilling + decoding). Also capped by
    /// the backend's `max_batch`, so a decode round holds every decoding
    /// stream.
    pub max_running: usize,
    /// Most streams waiting for admission; submissions beyond it are
    /// rejected with [`SubmitError::QueueFull`].
    pub queue_capacity: usize,
    /// Longest stream (prompt + completion), in tokens; also capped by the
    /// backend's context and, for backends that report fill, by its pool.
    pub max_context: usize,
    /// The model's end-of-generation token ids (EOS, EOT, ...). Requests
    /// can ignore them with `StopRules::ignore_eos`.
    pub eos_ids: Vec<u32>,
    /// Completion tokens of memory set aside for each admitted stream (at
    /// most its `max_tokens`): a stream is admitted only when its prompt
    /// plus this reserve fits. A stream may grow past its reserve while
    /// memory lasts; when a decode round no longer fits (after dropping
    /// drafts and cached marks), the newest streams end with `length`.
    pub decode_reserve: usize,
    /// Most marks the prefix cache keeps (least recently used go first);
    /// 0 turns prefix caching off, the backend's block cache included. A
    /// backend that caches KV blocks itself (`prefix_blocks`) gets no marks.
    pub prefix_marks: usize,
    /// Keep a mark every `mark_every` prompt tokens (0: none on the way).
    pub mark_every: usize,
    /// Keep a mark at the end of each prompt (so the same prompt again, or
    /// the next turn of a conversation, which extends it, starts there).
    pub mark_prompt_end: bool,
    /// Most draft tokens verified per stream and round (0 turns drafting off).
    pub max_draft: usize,
    /// Rounds with more decoding streams than this carry no drafts, and
    /// no stream asks the drafter for one while there are: a large batch
    /// already fills the device, so a verified row costs about what a
    /// decoded one does, and rejected rows and the drafter's own forwards
    /// would cost aggregate throughput. Drafting resumes as the batch shrinks.
    pub draft_max_streams: usize,
    /// While other streams decode, size each prompt chunk (which runs in
    /// their round's forward) so it adds about this fraction to the round
    /// (where cut sizes are free: `Capabilities::free_cuts`). The lane
    /// measures both as it runs (see `pacer`). 0.15 keeps the others'
    /// inter-token gap near its usual value (on a 2-core CPU one prompt row
    /// costs about that much of a 4-stream round, and a step is at least
    /// one row); larger values give the newcomer a faster first token
    /// instead. `None` runs whole chunks (`chunk_tokens`, capped by
    /// `max_rows`). An `itl_target` takes its place.
    pub prefill_share: Option<f32>,
    /// The longest a decoding stream should wait between two tokens while
    /// a prompt is prefilled beside it: each chunk gets the most rows that
    /// a cost model, fitted as the lane runs, predicts within the target
    /// (at least one row a round; where cut sizes are free). `None`: no
    /// target (`prefill_share` or whole chunks).
    pub itl_target: Option<Duration>,
    /// Rounds timed before serving (`braid serve`'s warm-up on a GPU),
    /// which the latency target's cost model starts from.
    pub round_costs: Vec<RoundCost>,
    /// Threads computing guided streams' masks (started with the first
    /// guided stream). A mask is computed while the round's forward runs,
    /// so one thread keeps up with several streams on a CPU lane; more
    /// help a GPU lane with many guided streams and short rounds.
    pub mask_threads: usize,
}

impl Default for LaneConfig {
    fn default() -> Self {
        LaneConfig {
            chunk_tokens: 512,
            max_rows: None,
            max_running: 32,
            queue_capacity: 256,
            max_context: usize::MAX,
            eos_ids: Vec::new(),
            decode_reserve: 256,
            prefix_marks: 64,
            mark_every: 1024,
            mark_prompt_end: true,
            max_draft: 8,
            draft_max_streams: 4,
            prefill_share: None,
            itl_target: None,
            round_costs: Vec::new(),
            mask_threads: 2,
        }
    }
}

struct StreamShared {
    cancelled: AtomicBool,
    /// Queue position; `usize::MAX` when not queued.
    position: AtomicUsize,
}

/// Controls one submitted stream. Dropping it cancels the stream.
pub struct StreamControl {
    pub id: StreamId,
    shared: Arc<StreamShared>,
    tx: Sender<Command>,
}

impl StreamControl {
    /// Cancel the stream; it ends with `Finished { reason: Cancelled }`
    /// (unless it has ended already). Its slot and memory return.
    pub fn cancel(&self) {
        if !self.shared.cancelled.swap(true, Ordering::SeqCst) {
            let _ = self.tx.send(Command::Wake);
        }
    }

    /// Streams ahead of this one in the admission queue, or `None` once
    /// it is admitted (or before the lane has seen it).
    pub fn queue_position(&self) -> Option<usize> {
        match self.shared.position.load(Ordering::SeqCst) {
            usize::MAX => None,
            p => Some(p),
        }
    }
}

impl Drop for StreamControl {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// A submitted stream: its events, and control over it. Iterating yields
/// events until the stream's last one. Dropping it cancels the stream.
pub struct StreamHandle {
    pub id: StreamId,
    events: Receiver<Event>,
    control: StreamControl,
}

impl StreamHandle {
    /// The next event, waiting for it; `None` after the last one.
    pub fn recv(&self) -> Option<Event> {
        self.events.recv().ok()
    }

    /// The next event if one is ready.
    pub fn try_recv(&self) -> Result<Event, TryRecvError> {
        self.events.try_recv()
    }

    pub fn recv_timeout(&self, timeout: Duration) -> Result<Event, RecvTimeoutError> {
        self.events.recv_timeout(timeout)
    }

    /// See [`StreamControl::cancel`].
    pub fn cancel(&self) {
        self.control.cancel()
    }

    /// See [`StreamControl::queue_position`].
    pub fn queue_position(&self) -> Option<usize> {
        self.control.queue_position()
    }

    pub fn control(&self) -> &StreamControl {
        &self.control
    }
}

impl Iterator for StreamHandle {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        self.recv()
    }
}

enum Command {
    Submit(Box<Pending>),
    Wake,
    Shutdown,
}

struct Pending {
    id: StreamId,
    req: Request,
    warm: bool,
    sink: Box<dyn EventSink>,
    shared: Arc<StreamShared>,
    submitted: Instant,
}

struct LaneShared {
    stats: Mutex<LaneStats>,
    /// The lane thread gave up (see `Core::run`).
    dead: AtomicBool,
    queued: AtomicUsize,
    submitted: AtomicU64,
    rejected: AtomicU64,
    next_id: AtomicU64,
}

/// Limits the submitting side checks before anything reaches the lane.
#[derive(Clone, Debug)]
struct Limits {
    max_context: usize,
    vocab: usize,
    queue_capacity: usize,
    /// The prefix cache is on (marks, or the backend's blocks).
    caching: bool,
    /// The backend makes image rows.
    images: bool,
    /// Most rows a round carries (an image's rows run in one chunk).
    max_batch: usize,
}

/// One device with one model, and the thread that owns it.
pub struct Lane {
    tx: Sender<Command>,
    shared: Arc<LaneShared>,
    thread: Option<JoinHandle<()>>,
    caps: Capabilities,
    config: LaneConfig,
    limits: Limits,
}

impl Lane {
    /// Start a lane thread that owns `backend`. `text` turns tokens into
    /// text for stop strings and events.
    pub fn spawn(backend: Box<dyn Backend>, text: Arc<dyn TokenText>, config: LaneConfig) -> Lane {
        Lane::spawn_with_drafter(backend, None, text, config)
    }

    /// As [`Lane::spawn`], with a speculative drafter. Drafting needs a
    /// backend that `supports_rewind`; with one that does not, the drafter
    /// is never used.
    pub fn spawn_with_drafter(backend: Box<dyn Backend>, drafter: Option<Box<dyn Drafter>>, text: Arc<dyn TokenText>, mut config: LaneConfig) -> Lane {
        let caps = backend.capabilities();
        let fill = backend.fill();
        config.chunk_tokens = config.chunk_tokens.max(1);
        if caps.max_batch > 0 {
            config.chunk_tokens = config.chunk_tokens.min(caps.max_batch);
        }
        config.max_rows = config.max_rows.map(|r| r.max(1));
        config.queue_capacity = config.queue_capacity.max(1);
        config.max_running = config.max_running.max(1);
        if caps.max_batch > 0 {
            config.max_running = config.max_running.min(caps.max_batch);
        }
        if !caps.supports_marks && !caps.prefix_blocks {
            config.prefix_marks = 0;
        }
        let mut max_context = config.max_context;
        if caps.max_context > 0 {
            max_context = max_context.min(caps.max_context);
        }
        if caps.reports_fill && fill.blocks_total > 0 {
            max_context = max_context.min(fill.blocks_total * fill.block_tokens.max(1));
        }
        config.max_context = max_context;
        let limits = Limits {
            max_context,
            vocab: caps.vocab_size,
            queue_capacity: config.queue_capacity,
            caching: config.prefix_marks > 0,
            images: caps.images,
            max_batch: caps.max_batch,
        };
        let shared = Arc::new(LaneShared {
            stats: Mutex::new(LaneStats { fill, ..LaneStats::default() }),
            dead: AtomicBool::new(false),
            queued: AtomicUsize::new(0),
            submitted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
        });
        let (tx, rx) = mpsc::channel();
        let drafting = drafter.is_some() && caps.supports_rewind && config.max_draft > 0;
        let core = Core::new(backend, drafter.filter(|_| drafting), text, config.clone(), rx, tx.clone(), shared.clone());
        let thread = std::thread::Builder::new().name("braid-lane".into()).spawn(move || core.run()).ok();
        Lane { tx, shared, thread, caps, config, limits }
    }

    /// Submit a request; its events arrive on the returned handle.
    pub fn submit(&self, req: Request) -> Result<StreamHandle, SubmitError> {
        let (tx, rx) = mpsc::channel();
        let control = self.submit_with(req, Box::new(tx))?;
        Ok(StreamHandle { id: control.id, events: rx, control })
    }

    /// Submit a request whose events go to `sink`.
    pub fn submit_with(&self, req: Request, sink: Box<dyn EventSink>) -> Result<StreamControl, SubmitError> {
        let r = self.validate(&req, false).and_then(|_| self.enqueue(req, false, sink));
        if r.is_err() {
            self.shared.rejected.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// Warm the prefix cache: run `prefix` through the model with no
    /// completion and keep what it cached (its KV blocks, or marks along
    /// the way and at its end), so a later prompt that starts with it
    /// begins there. The feed is stepped like any prompt, so decoding
    /// streams do not stall. Its handle sees `Started` and
    /// `Finished { reason: Warmed }`.
    pub fn warm(&self, prefix: Vec<u32>) -> Result<StreamHandle, SubmitError> {
        let (tx, rx) = mpsc::channel();
        let control = self.warm_with(Request::new(prefix), Box::new(tx))?;
        Ok(StreamHandle { id: control.id, events: rx, control })
    }

    /// [`Lane::warm`] of `req.prompt` under `req.cache_salt` (and its
    /// `prefix_hint`), its events going to `sink`; sampling and stop rules
    /// are not used.
    pub fn warm_with(&self, req: Request, sink: Box<dyn EventSink>) -> Result<StreamControl, SubmitError> {
        let r = if !self.limits.caching {
            Err(SubmitError::Unsupported("the backend keeps no marks or blocks (or the prefix cache is off), so there is nothing to warm".into()))
        } else {
            let req = Request { sampling: SamplingParams::greedy(), stop: Default::default(), logprobs: None, ..req };
            self.validate(&req, true).map(|_| req)
        };
        let r = r.and_then(|req| self.enqueue(req, true, sink));
        if r.is_err() {
            self.shared.rejected.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn validate(&self, req: &Request, warm: bool) -> Result<(), SubmitError> {
        let l = &self.limits;
        if req.prompt.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        validate_images(req, l.images, l.max_batch)?;
        if l.vocab > 0 {
            let in_image = |i: usize| req.images.iter().any(|m| (m.start..m.end()).contains(&i));
            if let Some((_, &t)) = req.prompt.iter().enumerate().find(|&(i, &t)| t as usize >= l.vocab && !in_image(i)) {
                return Err(SubmitError::Invalid(format!("token id {t} is outside the vocabulary of {} tokens", l.vocab)));
            }
        }
        req.sampling.validate().map_err(SubmitError::Invalid)?;
        if req.stop.max_tokens == Some(0) {
            return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
        }
        let needed = req.prompt.len() + if warm { 0 } else { req.stop.max_tokens.unwrap_or(1) };
        if needed > l.max_context {
            return Err(SubmitError::TooLong {
                prompt_tokens: req.prompt.len(),
                max_tokens: if warm { None } else { req.stop.max_tokens },
                max_context: l.max_context,
            });
        }
        Ok(())
    }

    fn enqueue(&self, req: Request, warm: bool, sink: Box<dyn EventSink>) -> Result<StreamControl, SubmitError> {
        let cap = self.limits.queue_capacity;
        let q = &self.shared.queued;
        q.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < cap).then_some(n + 1)).map_err(|_| SubmitError::QueueFull { capacity: cap })?;
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(StreamShared { cancelled: AtomicBool::new(false), position: AtomicUsize::new(usize::MAX) });
        let pending = Pending { id, req, warm, sink, shared: shared.clone(), submitted: Instant::now() };
        if self.tx.send(Command::Submit(Box::new(pending))).is_err() {
            q.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Closed);
        }
        self.shared.submitted.fetch_add(1, Ordering::Relaxed);
        Ok(StreamControl { id, shared, tx: self.tx.clone() })
    }

    /// Counters and gauges as of the last round.
    pub fn stats(&self) -> LaneStats {
        let mut s = self.shared.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        s.queued = self.shared.queued.load(Ordering::SeqCst);
        s.submitted = self.shared.submitted.load(Ordering::Relaxed);
        s.rejected = self.shared.rejected.load(Ordering::Relaxed);
        s
    }

    /// False once the lane thread has stopped for good after a failure
    /// (or could not start): nothing submitted will run.
    pub fn alive(&self) -> bool {
        !self.shared.dead.load(Ordering::SeqCst) && self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// What the backend declared.
    pub fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    /// The configuration in effect (after clamping to the backend).
    pub fn config(&self) -> &LaneConfig {
        &self.config
    }

    /// Longest stream (prompt + completion) this lane accepts.
    pub fn max_context(&self) -> usize {
        self.limits.max_context
    }

    /// Cancel every stream (they end with `Cancelled`) and join the thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = self.tx.send(Command::Shutdown);
            let _ = t.join();
        }
    }
}

/// A request's images lie in its prompt, ascending and apart, over the rows
/// that name them; only a backend that makes image rows takes any.
fn validate_images(req: &Request, supported: bool, max_batch: usize) -> Result<(), SubmitError> {
    if req.images.is_empty() {
        return Ok(());
    }
    if !supported {
        return Err(SubmitError::Unsupported("this model takes no images".into()));
    }
    let mut next = 0;
    for (n, m) in req.images.iter().enumerate() {
        if m.len == 0 || m.start < next || m.end() > req.prompt.len() {
            return Err(SubmitError::Invalid(format!(
                "image {n} takes prompt rows {}..{} of {}: images must be non-empty, ascending, apart and inside the prompt",
                m.start,
                m.end(),
                req.prompt.len()
            )));
        }
        if m.len > max_batch {
            return Err(SubmitError::Invalid(format!("image {n} takes {} rows, more than the {max_batch} a round of this backend carries", m.len)));
        }
        if !crate::backend::image_token_ids(m.hash, m.len).eq(req.prompt[m.start..m.end()].iter().copied()) {
            return Err(SubmitError::Invalid(format!("image {n}: the prompt rows {}..{} do not hold its ids (image_token_ids)", m.start, m.end())));
        }
        next = m.end();
    }
    Ok(())
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.stop();
    }
}
