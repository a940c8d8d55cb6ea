//! The backend contract: the one trait a lane drives.
//!
//! A backend owns a model on one device and the per-stream state (KV blocks,
//! conv/SSM state). It knows nothing of scheduling: the engine plans every
//! cut and every batch, and the backend runs exactly what it is handed, in
//! one call per round ([`Backend::round`]). Capabilities are declared up
//! front; the engine never probes by failing. Whatever a backend does ahead
//! of time (starting the next round, recorded graphs) it decides from the
//! steps it was given, one of which may name the next round's prompt chunk
//! ([`Step::next_chunk`]).

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;

use crate::guide::TokenMask;

/// Names one stream for the backend. Chosen by the engine, unique per lane.
pub type StreamId = u64;

/// Names one kept snapshot of a stream's state (see [`Backend::keep_mark`]).
pub type MarkId = u64;

/// What a backend can pick on the device instead of returning whole
/// logits rows (see [`Pick`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Picks {
    /// [`Pick::Argmax`] is cheaper than moving logits to the host. A
    /// backend that offers it honours [`Step::masks`] too.
    pub argmax: bool,
    /// Most candidates per row [`Pick::TopK`] returns (0: not offered).
    pub top_k: usize,
    /// [`Step::penalties`] are applied before an argmax or top-k pick, so
    /// a penalised stream's row need not come back whole.
    pub penalties: bool,
    /// [`Pick::Draw`] runs where the logits are: sampled rows (top-p,
    /// min-p, plain temperature) need not come back whole.
    pub draw: bool,
}

/// One decode token row's sampling in a [`Pick::Draw`] round: its
/// sampler's filters and the uniform number in [0, 1) its next draw
/// takes. A backend returns a token drawn from the row's distribution
/// under those filters (temperature 0: the argmax), the same token for the
/// same row and `u`; where it draws it is its own (see
/// [`crate::sampling::draw_row`] for how the host does).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    pub temperature: f32,
    /// 0: no top-k filter.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub u: f64,
}

/// A sampler's penalty on one logit of a round's decode token rows (see
/// [`Step::penalties`]): the repetition penalty first (a positive logit
/// divided by `repeat`, any other multiplied; 1: none), then `sub`
/// subtracted (presence and frequency), in f32, as
/// [`crate::Sampler`] applies them to a whole row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalty {
    /// The token row, counted over the round's decode rows.
    pub row: u32,
    pub token: u32,
    pub repeat: f32,
    pub sub: f32,
}

impl Penalty {
    pub fn apply(&self, l: f32) -> f32 {
        let l = if self.repeat == 1.0 {
            l
        } else if l > 0.0 {
            l / self.repeat
        } else {
            l * self.repeat
        };
        l - self.sub
    }
}

/// What a backend declares about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Results are bit-identical under any chunking of a prompt pass.
    pub chunk_invariant: bool,
    /// A row's results are bit-identical whatever else shares its forward
    /// (false where kernels are chosen by the batch's shape, as cuBLAS does).
    pub batch_invariant: bool,
    /// `fill()` reports real memory use.
    pub reports_fill: bool,
    /// `keep_mark` / `restore_mark` work.
    pub supports_marks: bool,
    /// The backend caches every full KV block of the streams started with
    /// [`Backend::attach_prefix`] (content-addressed, kept after they end,
    /// evicted least recently used when the pool needs room), so a stream
    /// can start from any earlier prompt's blocks. The lane then keeps no
    /// marks: they would only duplicate those blocks.
    pub prefix_blocks: bool,
    /// `rewind` can drop rows from the end of a stream's state (attention
    /// KV can; conv/SSM state cannot).
    pub supports_rewind: bool,
    /// Most token rows one round may carry (decode rows, drafts and the
    /// prompt chunk together).
    pub max_batch: usize,
    /// Longest a stream may grow (prompt + generated), in tokens.
    pub max_context: usize,
    /// Width of one logits row.
    pub vocab_size: usize,
    /// The backend makes image rows ([`Backend::encode_images`]).
    pub images: bool,
    /// Width of one feature row (0 when the backend taps no features).
    pub feature_dim: usize,
    /// What the backend picks where the logits are.
    pub picks: Picks,
    /// Beside decode rows, a prompt chunk of a replayed size
    /// ([`replayed_size`]) up to this many rows runs as a recorded forward
    /// replayed (a CUDA graph), far cheaper than one run afresh; the pacer
    /// keeps shared chunks to those sizes (0: any size costs the same).
    pub replayed_chunk_rows: usize,
    /// A chunk beside decode rows whose size does not replay runs as the
    /// next replayed size up (within `replayed_chunk_rows`), the rows past
    /// its end fed stand-in tokens. Their KV lands past the stream's
    /// length, where any later row overwrites it before it is read
    /// (attention-only models), so the results are the chunk's own. A
    /// pass's last rows then take one round, not one per bit of the
    /// remainder (on the H100, SmolLM2's 1799-row arrival ended in chunks
    /// of 24, 8, 4, 2 and 1 rows: five rounds for 39 rows).
    pub pads_chunks: bool,
    /// After a greedy round the backend starts the round after on the
    /// device before it is asked (with the chunk [`Step::next_chunk`]
    /// names): a chunk the round before did not name then runs as a
    /// forward of its own beside the round started without it, twice a
    /// round's work in one gap. The lane names a pass's first chunk a round
    /// before it runs it.
    pub launches_ahead: bool,
}

/// Whether a chunk of `rows` is one of the sizes a replaying backend keys
/// beside decode rows: a power of two, 24, or from 48 rows also 3, 5 or 7
/// times a power of two of at least 16 (48, 80, 96, 112, 160, 192, 224,
/// ...). Past 32 rows a doubling is a large step in a round's time (on the
/// H200 64 rows add ~0.5 ms to a 1.5 ms round, 128 ~0.85), and a latency
/// target falls between them. So is 16 to 32 where kernels change: on the
/// H100, SmolLM2's shape beside six streams, 16 rows add 0.21 ms to a
/// 1.15 ms round, 24 rows 0.35 and 32 rows 0.62–0.67.
pub fn replayed_size(rows: usize) -> bool {
    let odd = rows >> rows.trailing_zeros().min(usize::BITS - 1);
    rows.is_power_of_two() || rows == 24 || (rows >= 48 && matches!(odd, 3 | 5 | 7) && rows / odd >= 16)
}

/// The least replayed size of at least `rows` rows: what a chunk of `rows`
/// runs as where the backend pads it (`Capabilities::pads_chunks`).
pub fn replayed_size_up(rows: usize) -> usize {
    (rows.max(1)..).find(|&n| replayed_size(n)).expect("sizes go on")
}

/// The replayed sizes up to `most`, largest first.
pub fn replayed_sizes(most: usize) -> impl Iterator<Item = usize> {
    (1..=most).rev().filter(|&n| replayed_size(n))
}

/// How full the backend's state memory is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fill {
    /// KV blocks held by streams and marks, and how many the pool holds.
    pub blocks_used: usize,
    pub blocks_total: usize,
    /// Blocks the prefix cache alone holds: not in `blocks_used`, so free
    /// as far as admission goes (the backend evicts them when it needs room).
    pub blocks_cached: usize,
    /// Cached blocks evicted so far to make room (a running count).
    pub blocks_evicted: u64,
    /// Of `blocks_used`, those held past streams' lengths: given early for
    /// rows not written yet (a round started ahead, a chunk named for the
    /// next round). The lane's plan counts the blocks those rows need, so
    /// for it these are free ([`Fill::blocks_free`]).
    pub blocks_ahead: usize,
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// Stream state slots in use, and how many there are.
    pub slots_used: usize,
    pub slots_total: usize,
    /// The window group's blocks (sliding-window layers that keep only
    /// their window; all 0 when the model has none): held by streams and
    /// marks, in all, and cached alone. The `blocks_*` above count the
    /// layers that keep every row, so a long stream claims them alone: a
    /// stream holds no more window blocks than those, and the backend
    /// sizes the group for every stream's and mark's window, so admission
    /// reads `blocks_*` only.
    pub window_blocks_used: usize,
    pub window_blocks_total: usize,
    pub window_blocks_cached: usize,
    /// Cached window blocks evicted so far (a running count).
    pub window_blocks_evicted: u64,
}

impl Capabilities {
    /// Whether the engine may choose a pass's cut sizes (cap a chunk to
    /// `max_rows`, pace it to a round): the results do not depend on the
    /// cuts, or they never were bit-identical from one batch to the next,
    /// so no cut is more faithful than another. Otherwise a pass keeps the
    /// whole pass's cuts, so stepped and whole passes give the same bits.
    pub fn free_cuts(&self) -> bool {
        self.chunk_invariant || !self.batch_invariant
    }
}

impl Fill {
    /// KV blocks a stream of `tokens` tokens needs.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens.max(1))
    }

    /// Whether one more stream needing `tokens` tokens fits now.
    pub fn fits(&self, tokens: usize) -> bool {
        self.slots_used < self.slots_total && self.blocks_used + self.blocks_for(tokens) <= self.blocks_total
    }

    /// Blocks not in use (cached ones included: they give way), and those
    /// given ahead: the blocks a round's plan may count on for the rows it
    /// adds.
    pub fn blocks_free(&self) -> usize {
        self.blocks_total.saturating_sub(self.blocks_used) + self.blocks_ahead.min(self.blocks_used)
    }
}

/// An image in a prompt: its rows take the prompt's rows `start .. start +
/// len`, whose token ids stand for the image's content (see
/// [`image_token_ids`]), so the prefix cache keys them by it.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptImage {
    pub start: usize,
    pub len: usize,
    /// A hash of the image's content (its decoded pixels).
    pub hash: u64,
    /// The model's input for it: pixels as the model's preprocessor
    /// makes them (for Gemma 3: `[3, side, side]`, normalised).
    pub pixels: Arc<[f32]>,
}

impl PromptImage {
    pub fn end(&self) -> usize {
        self.start + self.len
    }
}

/// The prompt token ids that stand for an image's `len` rows: ids from its
/// content hash, each row its own, all at or above `IMAGE_IDS` (above any
/// vocabulary), so two prompts share cached rows only where they hold the
/// same image at the same place. The backend runs them as image rows.
pub fn image_token_ids(hash: u64, len: usize) -> impl Iterator<Item = u32> {
    (0..len as u64).map(move |i| {
        let mut x = hash ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        // splitmix64's finaliser: neighbouring rows get unrelated ids.
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        IMAGE_IDS | (x ^ (x >> 31)) as u32 & !IMAGE_IDS
    })
}

/// The lowest id [`image_token_ids`] gives (the top bit set).
pub const IMAGE_IDS: u32 = 1 << 31;

/// One chunk of a prompt pass: rows `start .. start + tokens.len()` of the
/// stream's prompt. The engine plans it; the backend runs exactly it.
#[derive(Clone, Copy, Debug)]
pub struct Chunk<'a> {
    pub start: usize,
    pub tokens: &'a [u32],
    /// Return the logits of the chunk's last row (the pass's last chunk).
    pub want_logits: bool,
}

/// One stream's rows in a decode round: usually one token (the last one
/// sampled); a drafter's verification adds its proposed block after it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeRow {
    pub stream: StreamId,
    pub tokens: Vec<u32>,
}

/// What a round returns for each decode token row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// The whole logits row.
    Logits,
    /// The row's most likely token (the first on ties), among those its
    /// mask allows when the step has [`Step::masks`].
    Argmax,
    /// The row's `k` largest logits with their tokens, largest first (the
    /// lower token first on ties, NaN as -inf); `k` at most `Picks::top_k`.
    TopK(usize),
    /// Each row's token drawn where the logits are, as [`Step::draws`]
    /// says for that row (after its penalties, within its mask), returned
    /// as [`Picked::Tokens`].
    Draw,
}

/// One round: the decode rows of every decoding stream (each one token, or
/// a token and a draft to verify), at most one prompt chunk of another
/// stream, and what to return per decode token row. Either part may be
/// empty. Both run in one forward, so its fixed cost is paid once.
#[derive(Clone, Copy, Debug)]
pub struct Step<'a> {
    pub rows: &'a [DecodeRow],
    pub chunk: Option<(StreamId, Chunk<'a>)>,
    pub pick: Pick,
    /// The prompt chunk the engine will put in the next round, if that
    /// round's decode rows are these streams' next tokens: a backend that
    /// starts a greedy round before it is asked for (see
    /// `ModelBackend`) starts it with this chunk, so a prompt pass does
    /// not keep the decoding streams waiting on the host between rounds.
    /// The next step still says what runs: a round started for nothing
    /// leaves nothing behind.
    pub next_chunk: Option<(StreamId, Chunk<'a>)>,
    /// The next round will carry no prompt chunk (none is under way, or
    /// the engine times the decode rows alone mid-pass): such a backend
    /// may start it even right after a round with a chunk, where a round
    /// started without one would otherwise likely serve only part of the
    /// next.
    pub next_plain: bool,
    /// Some stream of this round will likely feed a draft in the next (a
    /// drafter is proposing for it): a round started ahead, one token a
    /// stream, would serve only part of that round, and the device would
    /// run it before the round asked for (twice a round's time), so such a
    /// backend starts none.
    pub next_drafts: bool,
    /// Guided rows of an argmax round: where the backend finds their masks
    /// when it picks (see [`RoundMasks`]).
    pub masks: Option<&'a dyn RoundMasks>,
    /// The penalised streams' penalties, applied before an argmax or top-k
    /// pick where [`Picks::penalties`] says so (a round whose rows come
    /// back whole returns them raw: the host applies them).
    pub penalties: &'a [Penalty],
    /// A [`Pick::Draw`] round's draws, one per decode token row.
    pub draws: &'a [Draw],
}

impl<'a> Step<'a> {
    /// A step that names no next chunk and has no masks.
    pub fn new(rows: &'a [DecodeRow], chunk: Option<(StreamId, Chunk<'a>)>, pick: Pick) -> Step<'a> {
        Step { rows, chunk, pick, next_chunk: None, next_plain: false, next_drafts: false, masks: None, penalties: &[], draws: &[] }
    }
}

impl fmt::Debug for dyn RoundMasks + '_ {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RoundMasks")
    }
}

/// The masks of an argmax round's guided rows, asked for once, when the
/// backend picks: after the forward is on its way, so masks computed
/// meanwhile (on the lane's mask workers) count. The picks then stay on
/// the device, and a round with guided greedy streams may launch the next
/// one ahead like any greedy round.
pub trait RoundMasks {
    /// One entry per decode token row, in order: the tokens the row may
    /// pick (None: any). None when a guided row's mask is not there yet:
    /// the backend returns [`Picked::Logits`] instead, and the lane samples
    /// that stream once its mask comes.
    fn masks(&self) -> Option<Vec<Option<TokenMask>>>;
}

/// What the decode rows of a round returned, one entry per token row in
/// order (`sum(tokens)` rows).
#[derive(Clone, Debug, PartialEq)]
pub enum Picked {
    /// `rows * vocab_size` floats.
    Logits(Vec<f32>),
    Tokens(Vec<u32>),
    Top(Vec<Vec<(u32, f32)>>),
}

impl Picked {
    /// Token rows this holds (`vocab` wide for logits).
    pub fn rows(&self, vocab: usize) -> usize {
        match self {
            Picked::Logits(l) => l.len() / vocab.max(1),
            Picked::Tokens(t) => t.len(),
            Picked::Top(t) => t.len(),
        }
    }
}

/// What a round produced.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundOut {
    pub picked: Picked,
    /// The chunk's last-row logits, when the chunk asked for them.
    pub chunk_logits: Option<Vec<f32>>,
}

/// What one [`Backend::encode_images_step`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Encoded {
    /// Every image of the pass is made.
    pub done: bool,
    /// The work the step did, in the units of its budget.
    pub work: u64,
    /// The kind of the next step: steps of one kind take about the same
    /// time per unit of work (those of others may not: a vision tower's
    /// attention reads every key per row), so the lane sizes each step
    /// from the last of its kind.
    pub next: u32,
}

pub trait Backend: Send {
    fn capabilities(&self) -> Capabilities;

    /// Current fill. Backends that do not report fill return `Fill::default()`.
    fn fill(&self) -> Fill;

    /// Take a state slot for a new stream (empty, position 0).
    fn open(&mut self, stream: StreamId) -> Result<()>;

    /// Run one round (see [`Step`]): each decode row's tokens are appended
    /// to its stream, the chunk's to its stream (which must hold exactly
    /// `chunk.start` rows). On error nothing is appended.
    fn round(&mut self, step: Step<'_>) -> Result<RoundOut>;

    /// The whole pass's chunk body: one chunk with no decode rows. Returns
    /// the last row's logits when asked.
    fn prefill_step(&mut self, stream: StreamId, chunk: Chunk<'_>) -> Result<Option<Vec<f32>>> {
        Ok(self.round(Step::new(&[], Some((stream, chunk)), Pick::Logits))?.chunk_logits)
    }

    /// A round of decode rows alone, returning their logits (for tools and
    /// tests; the lane calls `round`).
    fn decode_logits(&mut self, rows: &[DecodeRow]) -> Result<Vec<f32>> {
        match self.round(Step::new(rows, None, Pick::Logits))?.picked {
            Picked::Logits(l) => Ok(l),
            other => anyhow::bail!("a round asked for logits returned {} other rows", other.rows(self.capabilities().vocab_size)),
        }
    }

    /// Make the image rows of a pass (the images its chunks will reach),
    /// once, at the pass's first chunk; the backend keeps them until
    /// [`Backend::drop_images`] and runs each chunk's image rows from them
    /// (a chunk never ends inside an image).
    fn encode_images(&mut self, _stream: StreamId, _images: &[PromptImage]) -> Result<()> {
        anyhow::bail!("this model takes no images")
    }

    /// Make part of what [`Backend::encode_images`] makes, resuming where
    /// the last call stopped: about `budget` units of work (the backend's
    /// own measure, which it reports back; at least some progress; `None`:
    /// a step of its own choosing), [`Encoded::done`] once all of `images`
    /// are made and kept. The lane calls it between rounds, each step sized
    /// from the time the work it reported took, so a large vision tower
    /// holds the decoding streams up a small step at a time, not for its
    /// whole run. The same `images` each call.
    fn encode_images_step(&mut self, stream: StreamId, images: &[PromptImage], budget: Option<u64>) -> Result<Encoded> {
        let _ = budget;
        self.encode_images(stream, images).map(|()| Encoded { done: true, work: 0, next: 0 })
    }

    /// The pass is done (or its images failed): its image rows, made or
    /// in the making, are no longer needed.
    fn drop_images(&mut self, _stream: StreamId) {}

    /// Stop a prompt pass between chunks; the state stays at the last
    /// chunk's end, so a later chunk resumes there.
    fn cancel_prefill(&mut self, stream: StreamId);

    /// Feature rows of the last round, one per token row (the decode token
    /// rows in order, then the chunk's rows), `feature_dim` wide; valid
    /// until the next round.
    fn features(&self) -> Option<&[f32]> {
        None
    }

    /// Start `stream` (open and empty) from the longest prefix of `prompt`
    /// the backend's block cache holds under `salt`, at most `max_len` rows,
    /// and from now on cache its full blocks under `salt` as they fill.
    /// Returns the rows it now holds (0 when nothing matched). Only backends
    /// that declare `prefix_blocks` cache anything.
    fn attach_prefix(&mut self, _stream: StreamId, _prompt: &[u32], _salt: u64, _max_len: usize) -> Result<usize> {
        Ok(0)
    }

    /// Snapshot `stream`'s state at its current length.
    fn keep_mark(&mut self, _stream: StreamId) -> Result<MarkId> {
        anyhow::bail!("this backend does not support marks")
    }

    /// Set `stream`'s state (an open, empty stream) to a kept mark; returns
    /// the mark's length in rows.
    fn restore_mark(&mut self, _stream: StreamId, _mark: MarkId) -> Result<usize> {
        anyhow::bail!("this backend does not support marks")
    }

    fn drop_mark(&mut self, _mark: MarkId) {}

    /// Drop rows so `stream` holds exactly `len` rows (rejected draft tokens).
    fn rewind(&mut self, _stream: StreamId, _len: usize) -> Result<()> {
        anyhow::bail!("this backend cannot rewind")
    }

    /// The stream is gone: free its slot and memory.
    fn forget(&mut self, stream: StreamId);

    /// Why no later call can succeed, once that is so: a device fault that
    /// poisons every call after it (a CUDA error leaves its context so).
    /// After a failed call the lane asks; `Some` stops it (every stream
    /// fails with the reason, the lane says it is dead, so a supervisor
    /// restarts the server). `None`, the default: failures are the calls'
    /// own.
    fn lost(&self) -> Option<String> {
        None
    }

    /// The clock the lane times rounds by, for its pacer: the wall clock,
    /// unless the backend keeps time of its own (a fake whose rounds cost
    /// what a script says, so pacing tests do not hang on a loaded
    /// machine's timing).
    fn now(&self) -> Instant {
        Instant::now()
    }
}
