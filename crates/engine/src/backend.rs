//! The backend contract: the one trait a lane drives.
//!
//! A backend owns a model on one device and the per-stream state (KV blocks,
//! conv/SSM state). It knows nothing of scheduling: the engine plans every
//! cut and every batch, and the backend runs exactly what it is handed.
//! Capabilities are declared up front; the engine never probes by failing.

use anyhow::Result;

/// Names one stream for the backend. Chosen by the engine, unique per lane.
pub type StreamId = u64;

/// Names one kept snapshot of a stream's state (see [`Backend::keep_mark`]).
pub type MarkId = u64;

/// What a backend declares about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Results are bit-identical under any chunking of a prompt pass; only
    /// then may the engine cap a step to `max_rows`.
    pub chunk_invariant: bool,
    /// `fill()` reports real memory use.
    pub reports_fill: bool,
    /// `keep_mark` / `restore_mark` work.
    pub supports_marks: bool,
    /// `rewind` can drop rows from the end of a stream's state (attention
    /// KV can; conv/SSM state cannot).
    pub supports_rewind: bool,
    /// Most token rows one decode round may carry.
    pub max_batch: usize,
    /// Longest a stream may grow (prompt + generated), in tokens.
    pub max_context: usize,
    /// Width of one logits row.
    pub vocab_size: usize,
    /// Width of one feature row (0 when the backend taps no features).
    pub feature_dim: usize,
    /// `decode_round_greedy` works and is cheaper than `decode_round` plus
    /// sampling on the host (the logits stay where they were computed).
    pub greedy_rounds: bool,
    /// Most candidates per row `decode_round_top` returns (0: it does not
    /// work): rounds of top-k samplers then move k values a row instead of
    /// a whole logits row.
    pub top_rounds: usize,
}

/// How full the backend's state memory is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fill {
    /// KV blocks in use, and how many the pool holds.
    pub blocks_used: usize,
    pub blocks_total: usize,
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// Stream state slots in use, and how many there are.
    pub slots_used: usize,
    pub slots_total: usize,
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
}

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
#[derive(Clone, Debug)]
pub struct DecodeRow {
    pub stream: StreamId,
    pub tokens: Vec<u32>,
}

pub trait Backend: Send {
    fn capabilities(&self) -> Capabilities;

    /// Current fill. Backends that do not report fill return `Fill::default()`.
    fn fill(&self) -> Fill;

    /// Take a state slot for a new stream (empty, position 0).
    fn open(&mut self, stream: StreamId) -> Result<()>;

    /// Run one chunk of `stream`'s prompt pass. The stream's state must hold
    /// exactly `chunk.start` rows. Returns the last row's logits when asked.
    fn prefill_step(&mut self, stream: StreamId, chunk: Chunk<'_>) -> Result<Option<Vec<f32>>>;

    /// Stop a prompt pass between chunks; the state stays at the last
    /// chunk's end, so a later `prefill_step` resumes there.
    fn cancel_prefill(&mut self, stream: StreamId);

    /// One batched forward for every row: appends each row's tokens to its
    /// stream and returns one logits row per token, in order, flattened
    /// (`sum(tokens) * vocab_size` floats).
    fn decode_round(&mut self, rows: &[DecodeRow]) -> Result<Vec<f32>>;

    /// A decode round of one token per row that returns each row's most
    /// likely next token (the first on ties) instead of its logits.
    /// `same_next`: the engine expects its next call to be this round
    /// again, each stream one token further (no stream ends by length with
    /// this token, no prompt waits to join), so a backend may start that
    /// round before returning; a stop token may still end a stream.
    fn decode_round_greedy(&mut self, _rows: &[DecodeRow], _same_next: bool) -> Result<Vec<u32>> {
        anyhow::bail!("this backend does not pick greedy tokens itself")
    }

    /// A decode round of one token per row that returns each row's `k`
    /// largest logits with their tokens, largest first (the lower token
    /// first on ties, NaN as -inf), instead of the whole row; `k` is at
    /// most `Capabilities::top_rounds`.
    fn decode_round_top(&mut self, _rows: &[DecodeRow], _k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        anyhow::bail!("this backend does not return top-k candidates")
    }

    /// A decode round and one prompt chunk of another stream in one
    /// forward, so the forward's fixed cost (every layer's launches and
    /// hand-offs) is paid once: the chunk then costs only its own rows.
    /// Returns what `decode_round` and `prefill_step` would. The default
    /// runs the two one after the other.
    fn decode_round_with_chunk(&mut self, rows: &[DecodeRow], stream: StreamId, chunk: Chunk<'_>) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        let logits = self.decode_round(rows)?;
        let last = self.prefill_step(stream, chunk)?;
        Ok((logits, last))
    }

    /// Feature rows of the last forward (prefill chunk or decode round),
    /// one per token row, `feature_dim` wide; valid until the next forward.
    fn features(&self) -> Option<&[f32]> {
        None
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
}
