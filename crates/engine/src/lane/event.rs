//! What a lane's callers hand in and get back: requests, events, and why
//! a submission was refused.

use std::sync::mpsc::Sender;
use std::time::Duration;

use crate::backend::PromptImage;
use crate::sampling::SamplingParams;
use crate::stop::StopRules;

/// One generation request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Request {
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopRules,
    /// Report each token's logprob and this many top alternatives.
    pub logprobs: Option<usize>,
    /// The prefix cache this stream reads and fills: streams share cached
    /// prompts only under the same salt (0: the shared cache), so one
    /// client cannot learn another's prompts from `cached_tokens` or timing.
    pub cache_salt: u64,
    /// A prompt position worth a mark, because later prompts likely share
    /// the rows before it: the end of the rendered system turn, say. Used
    /// by backends whose state cannot be rebuilt from cached blocks.
    pub prefix_hint: Option<usize>,
    /// The prompt's images, ascending and apart, each over prompt rows that
    /// hold its [`image_token_ids`](crate::backend::image_token_ids).
    pub images: Vec<PromptImage>,
    /// Most draft tokens verified per round for this stream: `None` takes
    /// the lane's `max_draft`, `Some(0)` keeps the drafter off it (it never
    /// sees the stream), more than `max_draft` is `max_draft`.
    pub draft_tokens: Option<usize>,
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
    /// A warm feed completed (see [`Lane::warm`](super::Lane::warm)).
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
    /// The prompt pass begins (at admission, or once the passes admitted
    /// before it are done, so it can reuse what they cached);
    /// `cached_tokens` of the prompt come from the prefix cache.
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
    /// The request's grammar could not be followed (it allowed nothing
    /// more, or grew past the grammar library's limits): the request's
    /// fault, not the server's; nothing follows.
    GrammarError(String),
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

/// Where a stream's events go. [`Lane::submit`](super::Lane::submit) uses a std channel;
/// [`Lane::submit_with`](super::Lane::submit_with) takes any sink (an async channel's sender, say).
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
