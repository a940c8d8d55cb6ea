//! What the server needs from a lane, in the server's own terms: submit a
//! generation, receive its events on an async channel, read the lane's
//! numbers. The real lane is adapted in `lane.rs`; tests may plug in fakes.

use tokio::sync::mpsc::UnboundedSender;

/// Sampling settings, as validated from a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// `0` is greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// `0`: off.
    pub top_k: usize,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
}

/// One stream to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub sampling: Sampling,
    pub max_tokens: usize,
    /// Token ids that end the stream besides the model's own (EOS).
    pub stop_ids: Vec<u32>,
    pub stop_strings: Vec<String>,
    /// Keep going past the model's end-of-generation tokens.
    pub ignore_eos: bool,
    /// `Some(k)`: report each token's logprob and the `k` most likely.
    pub logprobs: Option<usize>,
}

/// Why a stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` or the end of the context.
    Length,
    /// Cancelled (client gone, or shutdown).
    Cancelled,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Cancelled => "cancelled",
        }
    }
}

/// One thing that happened to a stream.
#[derive(Clone, Debug, PartialEq)]
pub enum GenEvent {
    Queued {
        position: usize,
    },
    Started {
        cached_tokens: usize,
    },
    /// A sampled token, and the text it released (may be empty: text that
    /// could start a stop string is held back).
    Token {
        id: u32,
        text: String,
        logprob: Option<f32>,
        top: Vec<(u32, f32)>,
    },
    /// The end. `text` is whatever was still held back (often empty).
    Finished {
        reason: Finish,
        text: String,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    Error(String),
}

/// Where a stream's events go: one channel per HTTP request, shared by its
/// choices, each event tagged with its choice index. When the receiver is
/// dropped (the client left), the stream must be cancelled.
#[derive(Clone, Debug)]
pub struct Sink {
    pub index: usize,
    pub tx: UnboundedSender<(usize, GenEvent)>,
}

impl Sink {
    /// False once nobody listens any more.
    pub fn send(&self, event: GenEvent) -> bool {
        self.tx.send((self.index, event)).is_ok()
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// Why a stream was not taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The queue is full: answer 503 with Retry-After.
    Overloaded(String),
    /// Prompt plus completion do not fit in the context.
    TooLong { prompt: usize, max_tokens: usize, context: usize },
    /// The request is unusable for another reason (400).
    Invalid(String),
    /// The lane is gone (shut down or failed): 503.
    Closed(String),
}

/// The lane's numbers for `/metrics`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaneNumbers {
    pub queued: usize,
    pub running: usize,
    /// KV blocks in use, and how many the pool holds.
    pub fill_used: usize,
    pub fill_total: usize,
    pub prefill_chunks: u64,
    pub prefill_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    pub decode_rounds: u64,
    /// Streams in decode rounds, summed: mean batch = this / rounds.
    pub decode_streams: u64,
    pub max_decode_batch: usize,
    /// Decode rounds whose tokens came from the device: greedy picks, and
    /// draws from top-k candidates (no logits rows moved).
    pub greedy_rounds: u64,
    pub top_rounds: u64,
    pub cancelled: u64,
    pub rejected: u64,
}

/// Keeps a submitted stream alive; dropping it cancels the stream (the
/// request is over, or its client left).
#[derive(Default)]
pub struct Ticket {
    _guard: Option<Box<dyn Send + Sync>>,
}

impl Ticket {
    pub fn new(guard: impl Send + Sync + 'static) -> Ticket {
        Ticket { _guard: Some(Box::new(guard)) }
    }
}

/// A lane as the server sees it.
pub trait Generator: Send + Sync + 'static {
    /// Queue a stream; its events go to `sink` until it ends. The stream
    /// is cancelled when the ticket is dropped or the sink's receiver is.
    fn submit(&self, req: GenRequest, sink: Sink) -> Result<Ticket, Refusal>;
    fn numbers(&self) -> LaneNumbers;
    /// Stop the lane (running streams end); called once, at shutdown.
    fn shutdown(&self);
}
