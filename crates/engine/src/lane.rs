//! The lane: one backend on its own thread, and the loop that shares it
//! between streams.
//!
//! Each turn of the loop (a *round*): take arrivals and cancels, admit what
//! fits, run one decode round (every decoding stream gets its next token,
//! or its verified draft) and one prefill step (one chunk of the oldest
//! prefilling stream), emitting tokens and finishes as they happen. When
//! both are due they share one forward (the backend's
//! `decode_round_with_chunk`), so the chunk adds only its own rows' cost to
//! the others' round. A long prompt therefore never freezes the streams
//! already decoding. An idle lane blocks on its channel.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::{Backend, Capabilities, DecodeRow, Fill, StreamId};
use crate::drafter::Drafter;
use crate::pass::{CutPlan, Pass};
use crate::prefix::PrefixIndex;
use crate::sampling::{Sampled, Sampler, SamplingParams};
use crate::stop::{StopRules, TextStops, TokenText};

/// How a lane schedules. The defaults suit a server.
#[derive(Clone, Debug, PartialEq)]
pub struct LaneConfig {
    /// The prompt chunk cap: most prompt rows in one prefill step.
    pub chunk_tokens: usize,
    /// A smaller per-step cap for fairness, applied only to backends that
    /// declare `chunk_invariant` (others keep the whole pass's cuts).
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
    /// 0 turns prefix caching off.
    pub prefix_marks: usize,
    /// Keep a mark every `mark_every` prompt tokens (0: none on the way).
    pub mark_every: usize,
    /// Keep a mark at the end of each prompt (so the next turn of a
    /// conversation, which extends it, starts there).
    pub mark_prompt_end: bool,
    /// Most draft tokens verified per stream and round (0 turns drafting off).
    pub max_draft: usize,
    /// While other streams decode, size each prefill step (which runs inside
    /// their decode round's forward) so it adds about this fraction to the
    /// round (chunk-invariant backends only, whose results do not depend on
    /// the cut). The lane measures both as it runs. 0.15 keeps the others'
    /// inter-token gap near its usual value (on a 2-core CPU one prompt row
    /// costs about that much of a 4-stream round, and a step is at least
    /// one row); larger values give the newcomer a faster first token
    /// instead. `None` runs whole chunks (`chunk_tokens`, capped by
    /// `max_rows`).
    pub prefill_share: Option<f32>,
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
            prefill_share: None,
        }
    }
}

/// One generation request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Request {
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopRules,
    /// Report each token's logprob and this many top alternatives.
    pub logprobs: Option<usize>,
}

impl Request {
    /// A request with default sampling and stop rules.
    pub fn new(prompt: Vec<u32>) -> Request {
        Request { prompt, ..Request::default() }
    }
}

/// Why a stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// An EOS / stop token id or a stop string.
    Stop,
    /// `max_tokens`, the context, or the memory ran out.
    Length,
    /// The caller cancelled, left, or the lane shut down.
    Cancelled,
    /// A warm feed completed (see [`Lane::warm`]).
    Warmed,
}

impl FinishReason {
    /// The OpenAI spelling (`"stop"`, `"length"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Warmed => "warmed",
        }
    }
}

/// Token counts of one stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Tokens sampled, including a final EOS / stop token.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache (not recomputed).
    pub cached_tokens: usize,
}

/// Where one stream's time went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timing {
    /// Submission to admission.
    pub queued: Duration,
    /// Submission to the first token (None if there was none).
    pub ttft: Option<Duration>,
    /// Submission to the end.
    pub total: Duration,
}

/// What a stream reports. A stream's last event is exactly one `Finished`
/// or `Error`; then its channel closes.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Waiting for admission, with `position` streams ahead (0: next).
    /// Sent when the stream has to wait and whenever the position changes.
    Queued { position: usize },
    /// Admitted; `cached_tokens` of the prompt come from the prefix cache.
    Started { cached_tokens: usize },
    /// One sampled token. `text` is the text it released: possibly empty
    /// (an unfinished character, or text held back while it may begin a
    /// stop string), possibly more than its own (held text let go).
    /// `logprob` / `top` are filled when the request asked for logprobs.
    /// A final EOS / stop token id gets no `Token` event.
    Token { id: u32, text: String, logprob: Option<f32>, top: Vec<(u32, f32)> },
    /// The end. `tail` is text released only now (held-back text when an
    /// EOS token ends the stream); append it to the output.
    Finished { reason: FinishReason, usage: Usage, tail: String, timing: Timing },
    /// The stream failed (a backend error); nothing follows.
    Error(String),
}

/// Why a submission was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubmitError {
    /// The request is malformed (empty prompt, bad token id, bad sampling
    /// parameters, ...); the text says what is wrong.
    Invalid(String),
    /// Prompt + `max_tokens` (or the prompt alone) exceeds the context.
    TooLong { prompt_tokens: usize, max_tokens: Option<usize>, max_context: usize },
    /// The admission queue is full (HTTP 503).
    QueueFull { capacity: usize },
    /// The lane cannot do this (e.g. warm without mark support).
    Unsupported(String),
    /// The lane has shut down.
    Closed,
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::Invalid(m) => write!(f, "invalid request: {m}"),
            SubmitError::TooLong { prompt_tokens, max_tokens: Some(m), max_context } => write!(
                f,
                "this model's maximum context length is {max_context} tokens, but {} were requested ({prompt_tokens} in the prompt, {m} for the completion)",
                prompt_tokens + m
            ),
            SubmitError::TooLong { prompt_tokens, max_tokens: None, max_context } => write!(
                f,
                "this model's maximum context length is {max_context} tokens, but the prompt holds {prompt_tokens} (at least one more is needed for the completion)"
            ),
            SubmitError::QueueFull { capacity } => write!(f, "the server is busy: all {capacity} queue places are taken"),
            SubmitError::Unsupported(m) => write!(f, "unsupported: {m}"),
            SubmitError::Closed => write!(f, "the lane has shut down"),
        }
    }
}

impl std::error::Error for SubmitError {}

/// Where a stream's events go. [`Lane::submit`] uses a std channel;
/// [`Lane::submit_with`] takes any sink (an async channel's sender, say).
pub trait EventSink: Send {
    /// Deliver one event; `false` when the receiver is gone (the lane then
    /// forgets the stream).
    fn send(&mut self, event: Event) -> bool;
    /// Whether the receiver is gone; checked every round.
    fn is_closed(&self) -> bool {
        false
    }
}

impl EventSink for Sender<Event> {
    fn send(&mut self, event: Event) -> bool {
        Sender::send(self, event).is_ok()
    }
}

/// An [`EventSink`] from a closure returning whether the receiver is still there.
pub struct FnSink<F>(pub F);

impl<F: FnMut(Event) -> bool + Send> EventSink for FnSink<F> {
    fn send(&mut self, event: Event) -> bool {
        (self.0)(event)
    }
}

/// Counters and gauges of one lane.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaneStats {
    /// Streams waiting for admission (including submissions in transit).
    pub queued: usize,
    pub prefilling: usize,
    pub decoding: usize,
    /// The backend's fill after the last round (default if not reported).
    pub fill: Fill,
    /// Marks held by the prefix cache.
    pub marks: usize,
    pub submitted: u64,
    /// Submissions refused (invalid, too long, queue full).
    pub rejected: u64,
    pub admitted: u64,
    /// Streams that ended with Stop or Length (or a warm feed completed).
    pub finished: u64,
    /// Streams cancelled, left, or cut by shutdown.
    pub cancelled: u64,
    /// Streams that ended with an error.
    pub errors: u64,
    pub prefill_chunks: u64,
    pub prefill_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Passes stopped between chunks for lack of memory.
    pub prefill_pauses: u64,
    pub decode_rounds: u64,
    /// Decode rounds that ran a prompt chunk in the same forward.
    pub fused_rounds: u64,
    /// Decode rounds whose tokens the backend picked (greedy, no logits moved).
    pub greedy_rounds: u64,
    /// Decode rounds whose tokens were drawn from the backend's top-k
    /// candidates (k values a row moved, not the row).
    pub top_rounds: u64,
    /// Seconds spent in plain decode rounds (the backend call alone).
    pub plain_round_secs: f64,
    pub plain_rounds: u64,
    /// The longest plain round and the longest fused one (backend calls).
    pub longest_plain_round_secs: f64,
    pub longest_fused_round_secs: f64,
    /// The first fused rounds' times in ms (at most 32), for finding where a
    /// long one sits in a pass.
    pub first_fused_rounds_ms: Vec<f32>,
    /// Streams in decode rounds, summed (÷ rounds = mean batch).
    pub decode_streams: u64,
    /// Token rows in decode rounds, summed (drafts included).
    pub decode_rows: u64,
    pub max_decode_batch: usize,
    /// Tokens sampled (first tokens included).
    pub generated_tokens: u64,
    pub draft_proposed: u64,
    pub draft_accepted: u64,
    pub marks_kept: u64,
    pub marks_dropped: u64,
    /// Completed loop iterations.
    pub rounds: u64,
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
    marks: bool,
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
        config.max_rows = config.max_rows.map(|r| r.max(1));
        config.queue_capacity = config.queue_capacity.max(1);
        config.max_running = config.max_running.max(1);
        if caps.max_batch > 0 {
            config.max_running = config.max_running.min(caps.max_batch);
        }
        if !caps.supports_marks {
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
        let limits = Limits { max_context, vocab: caps.vocab_size, queue_capacity: config.queue_capacity, marks: config.prefix_marks > 0 };
        let shared = Arc::new(LaneShared {
            stats: Mutex::new(LaneStats { fill, ..LaneStats::default() }),
            queued: AtomicUsize::new(0),
            submitted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
        });
        let (tx, rx) = mpsc::channel();
        let drafting = drafter.is_some() && caps.supports_rewind && config.max_draft > 0;
        let core = Core {
            backend,
            drafter: if drafting { drafter } else { None },
            text,
            caps: caps.clone(),
            cfg: config.clone(),
            max_context,
            rx,
            shared: shared.clone(),
            queue: VecDeque::new(),
            running: Vec::new(),
            prefix: PrefixIndex::new(config.prefix_marks),
            stats: LaneStats::default(),
            shutdown: false,
            rotate: 0,
            round_secs: 0.0,
            last_step: None,
            fused_since_plain: 0,
        };
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
    /// completion and keep its marks (along the way and at its end), so a
    /// later prompt that starts with it begins there. The feed is stepped
    /// like any prompt, so decoding streams do not stall. Its handle sees
    /// `Started` and `Finished { reason: Warmed }`.
    pub fn warm(&self, prefix: Vec<u32>) -> Result<StreamHandle, SubmitError> {
        let r = if !self.limits.marks {
            Err(SubmitError::Unsupported("the backend keeps no marks (or the prefix cache is off), so there is nothing to warm".into()))
        } else {
            let req = Request { prompt: prefix, sampling: SamplingParams::greedy(), ..Request::default() };
            self.validate(&req, true).map(|_| req)
        };
        let (tx, rx) = mpsc::channel();
        let r = r.and_then(|req| self.enqueue(req, true, Box::new(tx)));
        match r {
            Ok(control) => Ok(StreamHandle { id: control.id, events: rx, control }),
            Err(e) => {
                self.shared.rejected.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    fn validate(&self, req: &Request, warm: bool) -> Result<(), SubmitError> {
        let l = &self.limits;
        if req.prompt.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        if l.vocab > 0 {
            if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= l.vocab) {
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

impl Drop for Lane {
    fn drop(&mut self) {
        self.stop();
    }
}

enum Phase {
    Queued,
    Prefilling(Pass),
    Decoding,
}

struct Stream {
    id: StreamId,
    prompt: Arc<[u32]>,
    warm: bool,
    logprobs: Option<usize>,
    stop: StopRules,
    sink: Box<dyn EventSink>,
    shared: Arc<StreamShared>,
    phase: Phase,
    sampler: Sampler,
    text: TextStops,
    /// Tokens sampled so far.
    completion: usize,
    /// The newest sampled token, fed in the next decode round.
    last: u32,
    /// Rows in the backend state.
    len: usize,
    cached: usize,
    /// Prompt + completion may not pass this.
    max_total: usize,
    /// Tokens of memory claimed at admission (prompt + reserve).
    claim: usize,
    /// The pass was stopped (`cancel_prefill`) for lack of memory.
    paused: bool,
    open: bool,
    submitted: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    sent_position: Option<usize>,
    /// Ended (event sent or receiver gone); the sweep removes it.
    done: bool,
    cancelled: bool,
    errored: bool,
}

impl Stream {
    fn send(&mut self, ev: Event) {
        if !self.sink.send(ev) {
            // The receiver is gone: forget the stream.
            self.done = true;
            self.cancelled = true;
        }
    }

    fn usage(&self) -> Usage {
        Usage { prompt_tokens: self.prompt.len(), completion_tokens: self.completion, cached_tokens: self.cached }
    }

    fn timing(&self) -> Timing {
        let now = Instant::now();
        Timing { queued: self.admitted.unwrap_or(now) - self.submitted, ttft: self.first_token.map(|t| t - self.submitted), total: now - self.submitted }
    }

    fn finish(&mut self, reason: FinishReason, tail: String) {
        if self.done {
            return;
        }
        let (usage, timing) = (self.usage(), self.timing());
        self.send(Event::Finished { reason, usage, tail, timing });
        self.done = true;
        if reason == FinishReason::Cancelled {
            self.cancelled = true;
        }
    }

    fn fail(&mut self, msg: String) {
        if self.done {
            return;
        }
        self.send(Event::Error(msg));
        self.done = true;
        self.errored = true;
    }

    /// Room for more tokens (prompt + completion below `max_total`).
    fn room(&self) -> usize {
        self.max_total.saturating_sub(self.prompt.len() + self.completion)
    }
}

/// What `emit` needs besides the stream.
struct EmitCtx<'a> {
    eos: &'a [u32],
    text: &'a dyn TokenText,
}

/// Record one sampled token and tell the stream; true when it has ended.
fn emit(s: &mut Stream, sampled: Sampled, ctx: &EmitCtx<'_>, stats: &mut LaneStats) -> bool {
    let t = sampled.token;
    s.completion += 1;
    stats.generated_tokens += 1;
    if s.first_token.is_none() {
        s.first_token = Some(Instant::now());
    }
    s.sampler.accept(t);
    if s.stop.stop_ids.contains(&t) || (!s.stop.ignore_eos && ctx.eos.contains(&t)) {
        let tail = s.text.finish();
        s.finish(FinishReason::Stop, tail);
        return true;
    }
    let released = s.text.push(&ctx.text.token_bytes(t));
    let mut text = released.text;
    let reason = if released.stop.is_some() {
        Some(FinishReason::Stop)
    } else if s.room() == 0 {
        text.push_str(&s.text.finish());
        Some(FinishReason::Length)
    } else {
        None
    };
    s.send(Event::Token { id: t, text, logprob: sampled.logprob, top: sampled.top });
    if let Some(r) = reason {
        s.finish(r, String::new());
    }
    s.done
}

/// How long an idle lane with waiting work sleeps before looking again (it
/// wakes at once on any command).
const IDLE_POLL: Duration = Duration::from_millis(20);

/// A planned decode round.
#[derive(Default)]
struct RoundPlan {
    /// Indices into `running`, with each one's draft and rows.
    batch: Vec<usize>,
    drafts: Vec<Vec<u32>>,
    rows: Vec<DecodeRow>,
    /// Token rows in all.
    total: usize,
    /// KV blocks the round adds.
    blocks: usize,
}

/// Whether a prefill step can run now.
enum Prefill {
    /// Nothing to prefill, or waiting for memory.
    Idle,
    /// No chunk ran, but something changed (a mark dropped, a stream failed).
    Progress,
    /// `running[i]`'s next chunk is sized and fits.
    Ready(usize),
}

/// Rows of the first prefill step under `prefill_share`, before any cost is
/// known: small, since in a shared forward each row adds its full cost to
/// the others' round (the steering grows it by half at most per step).
const FIRST_STEP_ROWS: usize = 1;

/// Under `prefill_share`, a plain decode round every this many fused ones.
const REMEASURE_EVERY: usize = 8;

/// Moving average that follows changes within a few samples.
fn ema(old: f64, new: f64) -> f64 {
    if old == 0.0 {
        new
    } else {
        0.7 * old + 0.3 * new
    }
}

struct Core {
    backend: Box<dyn Backend>,
    drafter: Option<Box<dyn Drafter>>,
    text: Arc<dyn TokenText>,
    caps: Capabilities,
    cfg: LaneConfig,
    max_context: usize,
    rx: Receiver<Command>,
    shared: Arc<LaneShared>,
    queue: VecDeque<Stream>,
    /// Admitted streams, oldest first.
    running: Vec<Stream>,
    prefix: PrefixIndex,
    stats: LaneStats,
    shutdown: bool,
    rotate: usize,
    /// Recent decode round duration (a moving average), and the last
    /// prefill step's rows and seconds, for `prefill_share`.
    round_secs: f64,
    last_step: Option<(StreamId, usize, f64)>,
    /// Rounds fused with a chunk since the last plain one.
    fused_since_plain: usize,
}

impl Core {
    fn run(mut self) {
        // A panic (in a backend, say) must not leave streams waiting
        // forever: each gets an error, and the lane closes (later
        // submissions see `SubmitError::Closed`).
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_loop()));
        if let Err(p) = r {
            let what = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
            let msg = format!("the lane failed: {what}");
            while let Ok(c) = self.rx.try_recv() {
                if let Command::Submit(p) = c {
                    let s = self.new_stream(*p);
                    self.queue.push_back(s);
                }
            }
            for s in self.queue.iter_mut().chain(self.running.iter_mut()) {
                s.fail(msg.clone());
            }
            let gone = self.queue.len();
            self.shared.queued.fetch_sub(gone, Ordering::SeqCst);
            for s in self.queue.drain(..).chain(self.running.drain(..)) {
                count_end(&mut self.stats, &s);
            }
            *self.shared.stats.lock().unwrap_or_else(|e| e.into_inner()) = self.stats.clone();
        }
    }

    fn run_loop(&mut self) {
        let mut progress = true;
        loop {
            let idle = self.queue.is_empty() && self.running.is_empty();
            self.intake(idle, !progress);
            if self.shutdown {
                break;
            }
            self.check_cancels();
            self.sweep();
            progress = self.admit();
            self.send_positions();
            progress |= self.round();
            self.sweep();
            self.stats.rounds += 1;
            self.publish();
        }
        self.close();
    }

    /// One decode round and one prefill step: in one forward when both
    /// are due (the forward's fixed cost paid once), else each alone.
    fn round(&mut self) -> bool {
        // Under `prefill_share` a chunk is sized against a plain round's
        // time, so fuse only once one has been measured.
        let fuse = self.drafter.is_none() && (self.cfg.prefill_share.is_none() || self.round_secs > 0.0);
        let prefilling = self.prefilling();
        // Every few fused rounds, a plain round re-measures the others'
        // round (it grows with their contexts); the chunk waits for it.
        let remeasure = self.cfg.prefill_share.is_some() && self.fused_since_plain >= REMEASURE_EVERY;
        if !(fuse && prefilling) || remeasure {
            let decoded = self.decode_round();
            self.sweep();
            if decoded {
                self.fused_since_plain = 0;
                if remeasure {
                    return true;
                }
            }
            return self.prefill_step() | decoded;
        }
        let Some(plan) = self.plan_round() else { return self.prefill_step() };
        if plan.rows.is_empty() {
            self.sweep();
            self.prefill_step();
            return true;
        }
        match self.prepare_prefill(plan.blocks) {
            Prefill::Ready(i) => self.fused_round(plan, i),
            Prefill::Idle | Prefill::Progress => self.plain_round(plan),
        }
        true
    }

    /// Take commands: block while there is nothing to do, wait briefly when
    /// the last round made no progress, else just drain.
    fn intake(&mut self, idle: bool, stalled: bool) {
        let first = if idle {
            self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
        } else if stalled {
            self.rx.recv_timeout(IDLE_POLL)
        } else {
            Err(RecvTimeoutError::Timeout)
        };
        match first {
            Ok(c) => self.command(c),
            Err(RecvTimeoutError::Disconnected) => self.shutdown = true,
            Err(RecvTimeoutError::Timeout) => {}
        }
        loop {
            match self.rx.try_recv() {
                Ok(c) => self.command(c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.shutdown = true;
                    break;
                }
            }
        }
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Submit(p) => {
                let s = self.new_stream(*p);
                self.queue.push_back(s);
            }
            Command::Wake => {}
            Command::Shutdown => self.shutdown = true,
        }
    }

    fn new_stream(&self, p: Pending) -> Stream {
        let prompt: Arc<[u32]> = p.req.prompt.into();
        let max_total = match (p.warm, p.req.stop.max_tokens) {
            (true, _) => prompt.len(),
            (false, Some(m)) => (prompt.len() + m).min(self.max_context),
            (false, None) => self.max_context,
        };
        let reserve = self.cfg.decode_reserve.min(max_total.saturating_sub(prompt.len()));
        Stream {
            id: p.id,
            sampler: Sampler::new(&p.req.sampling, &prompt),
            text: TextStops::new(&p.req.stop.stop_strings),
            claim: prompt.len() + reserve,
            prompt,
            warm: p.warm,
            logprobs: p.req.logprobs.map(|n| n.min(self.caps.vocab_size)),
            stop: p.req.stop,
            sink: p.sink,
            shared: p.shared,
            phase: Phase::Queued,
            completion: 0,
            last: 0,
            len: 0,
            cached: 0,
            max_total,
            paused: false,
            open: false,
            submitted: p.submitted,
            admitted: None,
            first_token: None,
            sent_position: None,
            done: false,
            cancelled: false,
            errored: false,
        }
    }

    /// Streams whose caller cancelled or left end now.
    fn check_cancels(&mut self) {
        for s in self.queue.iter_mut().chain(self.running.iter_mut()) {
            if !s.done && (s.shared.cancelled.load(Ordering::SeqCst) || s.sink.is_closed()) {
                s.finish(FinishReason::Cancelled, String::new());
            }
        }
    }

    /// Remove ended streams; admitted ones are forgotten by the backend
    /// (their slot and memory return) and the drafter.
    fn sweep(&mut self) {
        let before = self.queue.len();
        let stats = &mut self.stats;
        self.queue.retain(|s| {
            if s.done {
                count_end(stats, s);
                s.shared.position.store(usize::MAX, Ordering::SeqCst);
            }
            !s.done
        });
        let left = before - self.queue.len();
        if left > 0 {
            self.shared.queued.fetch_sub(left, Ordering::SeqCst);
        }
        if self.running.iter().any(|s| s.done) {
            let (gone, keep): (Vec<Stream>, Vec<Stream>) = std::mem::take(&mut self.running).into_iter().partition(|s| s.done);
            self.running = keep;
            for s in gone {
                count_end(&mut self.stats, &s);
                if s.open {
                    self.backend.forget(s.id);
                    if let Some(d) = self.drafter.as_mut() {
                        d.forget(s.id);
                    }
                }
            }
        }
    }

    fn drop_lru_mark(&mut self) -> bool {
        match self.prefix.pop_lru() {
            Some(m) => {
                self.backend.drop_mark(m);
                self.stats.marks_dropped += 1;
                true
            }
            None => false,
        }
    }

    /// Blocks claimed by running streams but not yet in use.
    fn outstanding(&self, fill: &Fill) -> usize {
        self.running.iter().map(|s| fill.blocks_for(s.claim).saturating_sub(fill.blocks_for(s.len))).sum()
    }

    /// Admit queued streams, in order, while they fit.
    fn admit(&mut self) -> bool {
        let mut progress = false;
        while let Some(claim) = self.queue.front().map(|s| s.claim) {
            if self.running.len() >= self.cfg.max_running {
                break;
            }
            if self.caps.reports_fill {
                let fill = self.backend.fill();
                let outstanding = self.outstanding(&fill);
                let adjusted = Fill { blocks_used: fill.blocks_used + outstanding, ..fill };
                if !adjusted.fits(claim) {
                    // Marks may hold memory this stream could use: drop the
                    // oldest if freeing marks could make room.
                    let streams: usize = self.running.iter().map(|s| fill.blocks_for(s.len)).sum();
                    let without_marks = streams + outstanding + fill.blocks_for(claim);
                    let could = fill.slots_used < fill.slots_total && without_marks <= fill.blocks_total;
                    if could && self.drop_lru_mark() {
                        progress = true;
                        continue;
                    }
                    if self.running.is_empty() && self.prefix.is_empty() {
                        let need = fill.blocks_for(claim);
                        let Some(mut s) = self.queue.pop_front() else { break };
                        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                        s.shared.position.store(usize::MAX, Ordering::SeqCst);
                        s.fail(format!(
                            "the stream needs {need} KV blocks and a free slot, but the backend reports {} of {} blocks and {} of {} slots in use with nothing running",
                            fill.blocks_used, fill.blocks_total, fill.slots_used, fill.slots_total
                        ));
                        count_end(&mut self.stats, &s);
                        progress = true;
                        continue;
                    }
                    break;
                }
            }
            let Some(s) = self.queue.pop_front() else { break };
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            s.shared.position.store(usize::MAX, Ordering::SeqCst);
            self.start(s);
            progress = true;
        }
        progress
    }

    /// Open an admitted stream, restore the longest cached prefix, and plan
    /// its pass.
    fn start(&mut self, mut s: Stream) {
        s.admitted = Some(Instant::now());
        if let Err(e) = self.backend.open(s.id) {
            s.fail(format!("the backend could not open a stream: {e:#}"));
            count_end(&mut self.stats, &s);
            return;
        }
        s.open = true;
        self.stats.admitted += 1;
        let n = s.prompt.len();
        let mut planned = 0;
        if self.cfg.prefix_marks > 0 {
            // A normal pass must run at least its last row (for logits).
            let max_len = if s.warm { n } else { n - 1 };
            if let Some((mark, len)) = self.prefix.lookup(&s.prompt, max_len) {
                match self.backend.restore_mark(s.id, mark) {
                    Ok(l) if l == len => planned = len,
                    Ok(_) => {
                        // The mark does not hold what the index says: drop it
                        // and start clean.
                        self.prefix.remove(mark);
                        self.backend.drop_mark(mark);
                        self.stats.marks_dropped += 1;
                        self.backend.forget(s.id);
                        if let Err(e) = self.backend.open(s.id) {
                            s.open = false;
                            s.fail(format!("the backend could not open a stream: {e:#}"));
                            count_end(&mut self.stats, &s);
                            return;
                        }
                    }
                    Err(_) => {
                        self.prefix.remove(mark);
                        self.backend.drop_mark(mark);
                        self.stats.marks_dropped += 1;
                    }
                }
            }
        }
        let mut marks = Vec::new();
        if self.cfg.prefix_marks > 0 {
            if self.cfg.mark_every > 0 {
                let every = self.cfg.mark_every;
                marks.extend((planned / every + 1..).map(|k| k * every).take_while(|&p| p <= n));
            }
            if (self.cfg.mark_prompt_end || s.warm) && n > planned {
                marks.push(n);
            }
            marks.sort_unstable();
            marks.dedup();
            marks = self.prefix.missing(&s.prompt, &marks);
        }
        let plan = CutPlan {
            prompt_len: n,
            chunk_tokens: self.cfg.chunk_tokens,
            planned_start: planned,
            marks,
            max_rows: self.cfg.max_rows,
            chunk_invariant: self.caps.chunk_invariant,
        };
        if let Some(d) = self.drafter.as_mut() {
            d.open(s.id, planned);
        }
        s.len = planned;
        s.cached = planned;
        self.stats.cached_tokens += planned as u64;
        s.phase = Phase::Prefilling(Pass::new(s.id, s.prompt.clone(), plan, !s.warm));
        s.send(Event::Started { cached_tokens: planned });
        if s.warm && planned == n {
            s.finish(FinishReason::Warmed, String::new());
        }
        self.running.push(s);
    }

    fn send_positions(&mut self) {
        for (i, s) in self.queue.iter_mut().enumerate() {
            if s.sent_position != Some(i) && !s.done {
                s.sent_position = Some(i);
                s.shared.position.store(i, Ordering::SeqCst);
                s.send(Event::Queued { position: i });
            }
        }
    }

    /// Plan the decode round over every decoding stream (rotating if there
    /// are more than a round can carry), with drafts when a drafter is set.
    /// `None` when no stream decodes; a plan without rows when every
    /// stream had to end for lack of memory.
    fn plan_round(&mut self) -> Option<RoundPlan> {
        let mut batch: Vec<usize> = (0..self.running.len()).filter(|&i| !self.running[i].done && matches!(self.running[i].phase, Phase::Decoding)).collect();
        if batch.is_empty() {
            return None;
        }
        let cap = if self.caps.max_batch == 0 { usize::MAX } else { self.caps.max_batch };
        if batch.len() > cap {
            let r = self.rotate % batch.len();
            batch.rotate_left(r);
            batch.truncate(cap);
            self.rotate = self.rotate.wrapping_add(cap);
        }
        let vocab = self.caps.vocab_size;
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); batch.len()];
        if let Some(d) = self.drafter.as_mut() {
            let mut budget = cap.saturating_sub(batch.len());
            for (k, &i) in batch.iter().enumerate() {
                let s = &self.running[i];
                let mut block = d.propose(s.id, s.last);
                if let Some(bad) = block.iter().position(|&t| t as usize >= vocab) {
                    block.truncate(bad);
                }
                block.truncate(self.cfg.max_draft.min(s.room().saturating_sub(1)).min(budget));
                budget -= block.len();
                drafts[k] = block;
            }
        }
        // KV blocks the round adds (counted where the backend reports fill).
        let mut blocks = 0;
        if self.caps.reports_fill {
            // The round must fit in memory: shed drafts, then marks, then
            // finish the newest streams with `length`.
            loop {
                let fill = self.backend.fill();
                let free = fill.blocks_total.saturating_sub(fill.blocks_used);
                let need: usize = batch
                    .iter()
                    .zip(&drafts)
                    .map(|(&i, d)| {
                        let len = self.running[i].len;
                        fill.blocks_for(len + 1 + d.len()) - fill.blocks_for(len)
                    })
                    .sum();
                if need <= free {
                    blocks = need;
                    break;
                }
                if drafts.iter().any(|d| !d.is_empty()) {
                    drafts.iter_mut().for_each(Vec::clear);
                    continue;
                }
                if self.drop_lru_mark() {
                    continue;
                }
                let Some(k) = (0..batch.len()).max_by_key(|&k| batch[k]) else { break };
                let s = &mut self.running[batch[k]];
                let tail = s.text.finish();
                s.finish(FinishReason::Length, tail);
                batch.remove(k);
                drafts.remove(k);
                if batch.is_empty() {
                    return Some(RoundPlan::default());
                }
            }
        }

        let rows: Vec<DecodeRow> = batch
            .iter()
            .zip(&drafts)
            .map(|(&i, d)| {
                let s = &self.running[i];
                let mut tokens = Vec::with_capacity(1 + d.len());
                tokens.push(s.last);
                tokens.extend_from_slice(d);
                DecodeRow { stream: s.id, tokens }
            })
            .collect();
        let total: usize = rows.iter().map(|r| r.tokens.len()).sum();
        self.stats.decode_rounds += 1;
        self.stats.decode_streams += rows.len() as u64;
        self.stats.decode_rows += total as u64;
        self.stats.max_decode_batch = self.stats.max_decode_batch.max(rows.len());
        Some(RoundPlan { batch, drafts, rows, total, blocks })
    }

    /// Run a planned round on its own.
    fn decode_round(&mut self) -> bool {
        let Some(plan) = self.plan_round() else { return false };
        if plan.rows.is_empty() {
            return true;
        }
        self.plain_round(plan);
        true
    }

    /// A planned round in a forward of its own: greedy tokens picked by the
    /// backend when every row allows it, else logits sampled here.
    fn plain_round(&mut self, plan: RoundPlan) {
        let t = Instant::now();
        if self.greedy_round(&plan) {
            let tokens = self.backend.decode_round_greedy(&plan.rows, self.same_round_next(&plan));
            self.note_plain_round(t.elapsed().as_secs_f64());
            self.finish_greedy_round(plan, tokens);
            return;
        }
        if let Some(k) = self.top_round(&plan) {
            let cands = self.backend.decode_round_top(&plan.rows, k);
            self.note_plain_round(t.elapsed().as_secs_f64());
            self.finish_top_round(plan, k, cands);
            return;
        }
        let logits = self.backend.decode_round(&plan.rows);
        self.note_plain_round(t.elapsed().as_secs_f64());
        self.finish_round(plan, logits);
    }

    /// Every stream of the round samples from its row's k largest logits
    /// alone (greedy or top-k, no penalty, no logprobs), k within what the
    /// backend returns, and there are no drafts: the k to ask for.
    fn top_round(&self, plan: &RoundPlan) -> Option<usize> {
        let most = self.caps.top_rounds.min(self.caps.vocab_size.saturating_sub(1));
        if most == 0 || !plan.drafts.iter().all(Vec::is_empty) {
            return None;
        }
        plan.batch.iter().try_fold(1, |k, &i| {
            let s = &self.running[i];
            let need = s.sampler.needs_only_top().filter(|&n| n <= most && s.logprobs.is_none())?;
            Some(k.max(need))
        })
    }

    /// Draw each stream's token from its candidates, then emit as a
    /// greedy round does.
    fn finish_top_round(&mut self, plan: RoundPlan, k: usize, cands: anyhow::Result<Vec<Vec<(u32, f32)>>>) {
        let n = plan.batch.len();
        let check = |c: &Vec<Vec<(u32, f32)>>| {
            (c.len() != n || c.iter().any(|r| r.len() != k))
                .then(|| format!("the backend returned {} candidate rows for a round of {n} rows (k = {k})", c.len()))
        };
        let Some(cands) = self.round_ok(&plan.batch, cands, check) else { return };
        let tokens: Vec<u32> = plan.batch.iter().zip(&cands).map(|(&i, c)| self.running[i].sampler.sample_top(c)).collect();
        self.stats.top_rounds += 1;
        self.emit_picked(plan, tokens);
    }

    /// Every stream of the round takes the argmax with nothing to report
    /// beside it, and there are no drafts: the backend may pick.
    fn greedy_round(&self, plan: &RoundPlan) -> bool {
        self.caps.greedy_rounds
            && plan.drafts.iter().all(Vec::is_empty)
            && plan.batch.iter().all(|&i| {
                let s = &self.running[i];
                s.logprobs.is_none() && s.sampler.plain_greedy()
            })
    }

    /// Whether the next round is likely this one again, each stream one
    /// token further: none of its streams ends by length with this round's
    /// token, and no prompt is being prefilled (its chunks join the next
    /// rounds). A backend may start that round early (the CUDA one does);
    /// when it does not come, that work was for nothing.
    fn same_round_next(&self, plan: &RoundPlan) -> bool {
        plan.batch.iter().all(|&i| self.running[i].room() > 1) && !self.prefilling()
    }

    /// Some stream is in its prompt pass.
    fn prefilling(&self) -> bool {
        self.running.iter().any(|s| !s.done && matches!(s.phase, Phase::Prefilling(_)))
    }

    /// Emit the tokens a greedy round picked.
    fn finish_greedy_round(&mut self, plan: RoundPlan, tokens: anyhow::Result<Vec<u32>>) {
        let n = plan.batch.len();
        let check = |t: &Vec<u32>| (t.len() != n).then(|| format!("the backend picked {} tokens for a round of {n} rows", t.len()));
        let Some(tokens) = self.round_ok(&plan.batch, tokens, check) else { return };
        self.stats.greedy_rounds += 1;
        self.emit_picked(plan, tokens);
    }

    /// Emit one picked token per stream of the round.
    fn emit_picked(&mut self, plan: RoundPlan, tokens: Vec<u32>) {
        let batch = plan.batch;
        let ctx = EmitCtx { eos: &self.cfg.eos_ids, text: &*self.text };
        for (&i, &tok) in batch.iter().zip(&tokens) {
            let s = &mut self.running[i];
            if tok as usize >= self.caps.vocab_size {
                s.fail(format!("the backend picked token {tok}, past the vocabulary of {}", self.caps.vocab_size));
                continue;
            }
            s.len += 1;
            if !emit(s, Sampled { token: tok, logprob: None, top: Vec::new() }, &ctx, &mut self.stats) {
                s.last = tok;
            }
        }
    }

    /// A round's result from the backend, if it is one and `check` finds
    /// nothing wrong with it; else every stream of the round fails, told why.
    fn round_ok<T>(&mut self, batch: &[usize], r: anyhow::Result<T>, check: impl FnOnce(&T) -> Option<String>) -> Option<T> {
        let msg = match r {
            Ok(v) => match check(&v) {
                None => return Some(v),
                Some(m) => m,
            },
            Err(e) => format!("decode round failed: {e:#}"),
        };
        batch.iter().for_each(|&i| self.running[i].fail(msg.clone()));
        None
    }

    fn note_plain_round(&mut self, secs: f64) {
        self.round_secs = ema(self.round_secs, secs);
        self.stats.plain_round_secs += secs;
        self.stats.plain_rounds += 1;
        self.stats.longest_plain_round_secs = self.stats.longest_plain_round_secs.max(secs);
    }

    /// Sample the round's logits: emit, verify drafts, rewind rejects.
    fn finish_round(&mut self, plan: RoundPlan, logits: anyhow::Result<Vec<f32>>) {
        let RoundPlan { batch, drafts, total, .. } = plan;
        let vocab = self.caps.vocab_size;

        let check =
            |l: &Vec<f32>| (l.len() != total * vocab).then(|| format!("the backend returned {} logits for a round of {total} rows of {vocab}", l.len()));
        let Some(mut logits) = self.round_ok(&batch, logits, check) else { return };
        let features: Option<Vec<f32>> = match self.drafter {
            Some(_) => Some(self.backend.features().map(<[f32]>::to_vec).unwrap_or_default()),
            None => None,
        };
        let dim = self.caps.feature_dim;

        let ctx = EmitCtx { eos: &self.cfg.eos_ids, text: &*self.text };
        let mut offset = 0;
        for (k, &i) in batch.iter().enumerate() {
            let s = &mut self.running[i];
            let draft = &drafts[k];
            let rows_k = 1 + draft.len();
            // Verify: sample each row in turn; a row's result is kept while
            // the token sampled before it matched the draft it fed.
            let mut kept = 0;
            let mut ended = false;
            for j in 0..rows_k {
                let row = &mut logits[(offset + j) * vocab..(offset + j + 1) * vocab];
                let sampled = s.sampler.sample(row, s.logprobs);
                let tok = sampled.token;
                kept = j + 1;
                if emit(s, sampled, &ctx, &mut self.stats) {
                    ended = true;
                    break;
                }
                s.last = tok;
                if j < draft.len() && draft[j] == tok {
                    self.stats.draft_accepted += 1;
                } else {
                    break;
                }
            }
            self.stats.draft_proposed += draft.len() as u64;
            if !ended {
                s.len += kept;
                if kept < rows_k {
                    if let Err(e) = self.backend.rewind(s.id, s.len) {
                        s.fail(format!("rewinding rejected drafts failed: {e:#}"));
                    }
                }
                if let (Some(d), Some(f)) = (self.drafter.as_mut(), features.as_ref()) {
                    if !s.done {
                        let slice = f.get(offset * dim..(offset + kept) * dim).unwrap_or(&[]);
                        d.absorb(s.id, slice, kept);
                    }
                }
            }
            offset += rows_k;
        }
    }

    /// The per-step row cap: `max_rows`, tightened by `prefill_share` while
    /// other streams decode. A step costs a fixed part plus a part per row,
    /// both unknown and changing with the position, so the size is steered
    /// by the last step: scaled by budget / time taken, growing by half at most.
    fn step_rows(&self, stream: StreamId) -> Option<usize> {
        let decoding = self.running.iter().any(|s| !s.done && matches!(s.phase, Phase::Decoding));
        let share = match self.cfg.prefill_share {
            Some(f) if decoding && self.round_secs > 0.0 => f as f64,
            _ => return self.cfg.max_rows,
        };
        let rows = match self.last_step {
            // A new pass probes afresh: costs depend on the position.
            Some((id, rows, secs)) if id == stream => {
                let budget = share * self.round_secs;
                let scaled = (rows as f64 * budget / secs.max(1e-6)) as usize;
                // Grow by half at most: one overshoot is one long gap.
                scaled.clamp(1, rows + rows / 2 + 1)
            }
            _ => FIRST_STEP_ROWS,
        };
        Some(self.cfg.max_rows.map_or(rows, |m| m.min(rows)))
    }

    /// Get the oldest prefilling stream's next chunk ready: size it, and
    /// check that it fits in memory beside `round_blocks` (the blocks the
    /// decode round it may share a forward with will take).
    fn prepare_prefill(&mut self, round_blocks: usize) -> Prefill {
        let Some(i) = self.running.iter().position(|s| !s.done && matches!(s.phase, Phase::Prefilling(_))) else {
            return Prefill::Idle;
        };
        let step_rows = self.step_rows(self.running[i].id);
        if let Phase::Prefilling(pass) = &mut self.running[i].phase {
            pass.set_max_rows(step_rows);
        }
        if self.caps.reports_fill {
            let fill = self.backend.fill();
            let Phase::Prefilling(pass) = &self.running[i].phase else { return Prefill::Idle };
            let (start, end) = pass.next_chunk();
            let need = fill.blocks_for(end) - fill.blocks_for(start);
            if need + round_blocks > fill.blocks_total.saturating_sub(fill.blocks_used) {
                if self.drop_lru_mark() {
                    return Prefill::Progress;
                }
                let decoding = self.running.iter().any(|s| !s.done && matches!(s.phase, Phase::Decoding));
                let s = &mut self.running[i];
                if let Phase::Prefilling(pass) = &mut s.phase {
                    if !s.paused {
                        // Stop between chunks; resume when memory frees.
                        pass.cancel(&mut *self.backend);
                        s.paused = true;
                        self.stats.prefill_pauses += 1;
                    }
                }
                if !decoding {
                    // Nothing will free memory: give up on this stream.
                    s.fail(format!("KV memory is full: the next chunk needs {need} blocks, {} of {} are in use", fill.blocks_used, fill.blocks_total));
                    return Prefill::Progress;
                }
                return Prefill::Idle;
            }
        }
        Prefill::Ready(i)
    }

    /// One chunk of the oldest prefilling stream, on its own.
    fn prefill_step(&mut self) -> bool {
        let i = match self.prepare_prefill(0) {
            Prefill::Ready(i) => i,
            Prefill::Progress => return true,
            Prefill::Idle => return false,
        };
        let drafter = self.drafter.as_deref_mut();
        let s = &mut self.running[i];
        s.paused = false;
        let Phase::Prefilling(pass) = &mut s.phase else { return false };
        let t = Instant::now();
        let stepped = pass.step(&mut *self.backend, drafter);
        let secs = t.elapsed().as_secs_f64();
        self.finish_prefill(i, stepped, secs);
        true
    }

    /// A decode round and the next prompt chunk in one forward. Only
    /// without a drafter (whose features would interleave).
    fn fused_round(&mut self, plan: RoundPlan, i: usize) {
        let mut round_logits: Option<anyhow::Result<Vec<f32>>> = None;
        let s = &mut self.running[i];
        s.paused = false;
        let Phase::Prefilling(pass) = &mut s.phase else { return };
        let rows = &plan.rows;
        let t = Instant::now();
        let stepped = pass.step_via(&mut *self.backend, None, |b, stream, chunk| match b.decode_round_with_chunk(rows, stream, chunk) {
            Ok((logits, last)) => {
                round_logits = Some(Ok(logits));
                Ok(last)
            }
            Err(e) => {
                round_logits = Some(Err(anyhow::anyhow!("{e:#}")));
                Err(e)
            }
        });
        // The chunk's own cost: the forward less a plain round's.
        let secs = t.elapsed().as_secs_f64();
        self.stats.longest_fused_round_secs = self.stats.longest_fused_round_secs.max(secs);
        if self.stats.first_fused_rounds_ms.len() < 32 {
            self.stats.first_fused_rounds_ms.push((secs * 1e3) as f32);
        }
        self.stats.fused_rounds += 1;
        self.fused_since_plain += 1;
        self.finish_prefill(i, stepped, (secs - self.round_secs).max(0.1 * secs));
        let logits = round_logits.unwrap_or_else(|| Err(anyhow::anyhow!("the prompt chunk was not run")));
        self.finish_round(plan, logits);
    }

    /// Account for a prompt chunk run in `secs`: keep its mark, and on
    /// the pass's last chunk sample the first token.
    fn finish_prefill(&mut self, i: usize, stepped: anyhow::Result<crate::pass::StepOutcome>, secs: f64) {
        let s = &mut self.running[i];
        if let Ok(o) = &stepped {
            self.last_step = Some((s.id, o.end - o.start, secs));
        }
        let out = match stepped {
            Ok(o) => o,
            Err(e) => {
                s.fail(format!("prefill failed: {e:#}"));
                return;
            }
        };
        self.stats.prefill_chunks += 1;
        self.stats.prefill_tokens += (out.end - out.start) as u64;
        s.len = out.end;
        if let Some(m) = out.mark {
            self.stats.marks_kept += 1;
            for d in self.prefix.insert(m, &s.prompt[..out.end]) {
                self.backend.drop_mark(d);
                self.stats.marks_dropped += 1;
            }
        }
        if !out.done {
            return;
        }
        if s.warm {
            s.finish(FinishReason::Warmed, String::new());
            return;
        }
        let mut logits = match out.logits {
            Some(l) if l.len() == self.caps.vocab_size => l,
            other => {
                s.fail(format!("the backend returned {} logits for the last prompt row, expected {}", other.map_or(0, |l| l.len()), self.caps.vocab_size));
                return;
            }
        };
        let sampled = s.sampler.sample(&mut logits, s.logprobs);
        let tok = sampled.token;
        let ctx = EmitCtx { eos: &self.cfg.eos_ids, text: &*self.text };
        if !emit(s, sampled, &ctx, &mut self.stats) {
            s.last = tok;
            s.phase = Phase::Decoding;
        }
    }

    fn publish(&mut self) {
        let mut st = self.stats.clone();
        st.prefilling = self.running.iter().filter(|s| matches!(s.phase, Phase::Prefilling(_))).count();
        st.decoding = self.running.iter().filter(|s| matches!(s.phase, Phase::Decoding)).count();
        st.fill = self.backend.fill();
        st.marks = self.prefix.len();
        *self.shared.stats.lock().unwrap_or_else(|e| e.into_inner()) = st;
    }

    /// Shutdown: every stream, queued, running or still in the channel,
    /// ends with `Cancelled`; marks are dropped.
    fn close(&mut self) {
        while let Ok(c) = self.rx.try_recv() {
            if let Command::Submit(p) = c {
                let s = self.new_stream(*p);
                self.queue.push_back(s);
            }
        }
        for s in self.queue.iter_mut().chain(self.running.iter_mut()) {
            s.finish(FinishReason::Cancelled, String::new());
        }
        self.sweep();
        for m in self.prefix.marks() {
            self.prefix.remove(m);
            self.backend.drop_mark(m);
        }
        self.publish();
    }
}

fn count_end(stats: &mut LaneStats, s: &Stream) {
    if s.errored {
        stats.errors += 1;
    } else if s.cancelled {
        stats.cancelled += 1;
    } else {
        stats.finished += 1;
    }
}
