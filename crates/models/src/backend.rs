//! Serves any [`Model`] on any [`Device`] to the engine: per-stream block
//! tables over one paged KV pool, marks as shared blocks, batched forwards.

use std::collections::HashMap;

use anyhow::{bail, ensure, Result};
use braid_engine::{Backend, Capabilities, Chunk, DecodeRow, Fill, MarkId, StreamId};
use braid_ops::{AttnSeq, Device, KvDtype, KvPoolSpec};

use crate::{Batch, Memory, Model, Scratch};

/// A decode round's rows as the forward's `(stream, tokens)` parts.
fn round_parts(rows: &[DecodeRow]) -> Vec<(StreamId, &[u32])> {
    rows.iter().map(|r| (r.stream, r.tokens.as_slice())).collect()
}

/// Rounds whose streams each run at most this many rows (decode, drafts)
/// go through `Device::replay` (CUDA graphs); prompt chunks, whose shapes
/// rarely recur, run directly.
const REPLAY_ROWS: usize = 16;

#[derive(Clone, Debug)]
pub struct BackendConfig {
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// KV capacity in tokens, over all streams (rounded up to blocks).
    pub kv_tokens: usize,
    /// Most streams held at once.
    pub max_streams: usize,
    /// Most rows one decode round may carry.
    pub max_batch: usize,
    /// Longest stream; 0 = the model's own context length.
    pub context: usize,
    /// Marks kept at once (each holds a state row for recurrent models).
    pub max_marks: usize,
    /// How the KV pool stores k and v (f16 by default; f32 for exact runs).
    pub kv_dtype: KvDtype,
}

impl Default for BackendConfig {
    fn default() -> Self {
        BackendConfig { block_tokens: 16, kv_tokens: 32768, max_streams: 64, max_batch: 256, context: 0, max_marks: 64, kv_dtype: KvDtype::F16 }
    }
}

struct StreamState {
    blocks: Vec<u32>,
    len: usize,
    /// Row in `Memory::state`.
    slot: u32,
}

struct Mark {
    blocks: Vec<u32>,
    len: usize,
    /// Row in `Memory::state` holding the snapshot (recurrent models).
    slot: Option<u32>,
}

pub struct ModelBackend<D: Device> {
    dev: D,
    model: Box<dyn Model<D>>,
    mem: Memory<D>,
    scratch: Scratch<D>,
    /// Free rows of `mem.state`: stream slots and mark slots.
    free_slots: Vec<u32>,
    free_mark_slots: Vec<u32>,
    /// Every layer's state can be cut back (attention only).
    rewindable: bool,
    cfg: BackendConfig,
    blocks_total: usize,
    free: Vec<u32>,
    /// Owners of each block: streams and marks.
    refs: Vec<u32>,
    streams: HashMap<StreamId, StreamState>,
    marks: HashMap<MarkId, Mark>,
    next_mark: MarkId,
}

impl<D: Device> ModelBackend<D> {
    pub fn new(dev: D, model: Box<dyn Model<D>>, mut cfg: BackendConfig) -> Result<ModelBackend<D>> {
        ensure!(cfg.block_tokens > 0, "block_tokens must be positive");
        if cfg.context == 0 {
            cfg.context = model.context();
        }
        let blocks_total = cfg.kv_tokens.div_ceil(cfg.block_tokens).max(1);
        let spec = KvPoolSpec { blocks: blocks_total, block_tokens: cfg.block_tokens, layers: model.kv_layers() };
        let kv = dev.kv_pool_as(&spec, cfg.kv_dtype)?;
        let state_size = model.state_size();
        let (stream_rows, mark_rows) = if state_size > 0 { (cfg.max_streams, cfg.max_marks) } else { (0, 0) };
        let state = dev.tensor(stream_rows + mark_rows, state_size);
        let scratch = Scratch::new(&dev);
        let rewindable = model.layer_states().iter().all(|l| l.rewindable());
        Ok(ModelBackend {
            free_slots: (0..cfg.max_streams as u32).rev().collect(),
            free_mark_slots: (stream_rows as u32..(stream_rows + mark_rows) as u32).rev().collect(),
            rewindable,
            dev,
            model,
            mem: Memory { kv, state },
            scratch,
            free: (0..blocks_total as u32).rev().collect(),
            refs: vec![0; blocks_total],
            blocks_total,
            cfg,
            streams: HashMap::new(),
            marks: HashMap::new(),
            next_mark: 1,
        })
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    pub fn model(&self) -> &dyn Model<D> {
        self.model.as_ref()
    }

    fn alloc_block(&mut self) -> Result<u32> {
        let b = self.free.pop().ok_or_else(|| anyhow::anyhow!("KV pool full ({} blocks of {} tokens)", self.blocks_total, self.cfg.block_tokens))?;
        self.refs[b as usize] = 1;
        Ok(b)
    }

    fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let r = &mut self.refs[b as usize];
            *r -= 1;
            if *r == 0 {
                self.free.push(b);
            }
        }
    }

    /// Give `stream` blocks for `len` rows; all-or-nothing.
    fn reserve(&mut self, stream: StreamId, len: usize) -> Result<()> {
        ensure!(len <= self.cfg.context, "stream would hold {len} tokens, past the context of {}", self.cfg.context);
        let have = self.streams[&stream].blocks.len();
        let need = len.div_ceil(self.cfg.block_tokens).saturating_sub(have);
        ensure!(need <= self.free.len(), "KV pool full: {need} more blocks needed, {} free", self.free.len());
        for _ in 0..need {
            let b = self.alloc_block()?;
            self.streams.get_mut(&stream).unwrap().blocks.push(b);
        }
        Ok(())
    }

    fn has_state(&self) -> bool {
        self.model.state_size() > 0
    }

    /// Check a prompt chunk and give its stream the blocks it needs.
    fn reserve_chunk(&mut self, stream: StreamId, chunk: &Chunk<'_>) -> Result<()> {
        let Some(st) = self.streams.get(&stream) else { bail!("stream {stream} is not open") };
        ensure!(st.len == chunk.start, "stream {stream} holds {} rows, the chunk starts at {}", st.len, chunk.start);
        ensure!(!chunk.tokens.is_empty(), "empty chunk");
        let vocab = self.model.vocab();
        ensure!(chunk.tokens.iter().all(|&t| (t as usize) < vocab), "token id out of range (vocab {vocab})");
        self.reserve(stream, chunk.start + chunk.tokens.len())
    }

    /// Check a decode round and give its streams the blocks they need;
    /// returns its rows.
    fn reserve_round(&mut self, rows: &[DecodeRow]) -> Result<usize> {
        let total: usize = rows.iter().map(|r| r.tokens.len()).sum();
        ensure!(total <= self.cfg.max_batch, "decode round of {total} rows exceeds max batch {}", self.cfg.max_batch);
        let vocab = self.model.vocab();
        for r in rows {
            let Some(st) = self.streams.get(&r.stream) else { bail!("stream {} is not open", r.stream) };
            ensure!(r.tokens.iter().all(|&t| (t as usize) < vocab), "token id out of range (vocab {vocab})");
            let len = st.len + r.tokens.len();
            self.reserve(r.stream, len)?;
        }
        Ok(total)
    }

    /// Run rows for several streams in one forward; leaves logits for
    /// `logit_rows` in `scratch.logits`.
    fn forward(&mut self, parts: &[(StreamId, &[u32])], logit_rows: &[usize]) -> Result<()> {
        let bt = self.cfg.block_tokens;
        let rows = RowArrays::new(&self.streams, bt, parts);
        let batch = rows.batch(&self.streams, parts, logit_rows);
        let (dev, model, mem, scratch) = (&self.dev, &self.model, &mut self.mem, &mut self.scratch);
        let decode = parts.iter().all(|p| p.1.len() <= REPLAY_ROWS);
        if decode {
            // A decode round: its shape recurs round after round.
            dev.replay_keyed(batch.key(), batch.tokens, &mut || model.forward(dev, &batch, mem, scratch))?;
        } else {
            model.forward(dev, &batch, mem, scratch)?;
        }
        drop(batch);
        for &(id, toks) in parts {
            self.streams.get_mut(&id).unwrap().len += toks.len();
        }
        // While the device runs this round, do the host work of the round
        // most likely next: the same streams one token further (when their
        // blocks already hold it). This round's tokens stand in for its.
        let one_each = parts.iter().all(|p| p.1.len() == 1);
        if decode && one_each && dev.replays_ahead() && parts.iter().all(|(id, _)| self.streams[id].len < self.streams[id].blocks.len() * bt) {
            let next = RowArrays::new(&self.streams, bt, parts);
            let batch = next.batch(&self.streams, parts, logit_rows);
            dev.replay_ahead(batch.key(), batch.tokens, &mut || model.forward(dev, &batch, mem, scratch));
        }
        Ok(())
    }

    /// [`ModelBackend::forward`], then the logits on the host.
    fn run(&mut self, parts: &[(StreamId, &[u32])], logit_rows: &[usize]) -> Result<Vec<f32>> {
        self.forward(parts, logit_rows)?;
        self.dev.download(&self.scratch.logits)
    }
}

/// A forward's host arrays over `(stream, tokens)` parts, each stream's
/// rows starting at its current length.
struct RowArrays {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    /// Each part's (first row, rows, KV rows after it).
    ranges: Vec<(usize, usize, usize)>,
    state_slots: Vec<u32>,
}

impl RowArrays {
    fn new(streams: &HashMap<StreamId, StreamState>, bt: usize, parts: &[(StreamId, &[u32])]) -> RowArrays {
        let mut r =
            RowArrays { tokens: Vec::new(), positions: Vec::new(), slots: Vec::new(), ranges: Vec::new(), state_slots: Vec::with_capacity(parts.len()) };
        for &(id, toks) in parts {
            let st = &streams[&id];
            let start = st.len;
            r.state_slots.push(st.slot);
            r.ranges.push((r.tokens.len(), toks.len(), start + toks.len()));
            for (i, &t) in toks.iter().enumerate() {
                let pos = start + i;
                r.tokens.push(t);
                r.positions.push(pos as u32);
                r.slots.push(st.blocks[pos / bt] * bt as u32 + (pos % bt) as u32);
            }
        }
        r
    }

    fn batch<'a>(&'a self, streams: &'a HashMap<StreamId, StreamState>, parts: &[(StreamId, &[u32])], logit_rows: &'a [usize]) -> Batch<'a> {
        let seqs = parts
            .iter()
            .zip(&self.ranges)
            .map(|(&(id, _), &(q_start, q_len, kv_len))| AttnSeq { q_start, q_len, kv_len, blocks: &streams[&id].blocks, window: None })
            .collect();
        Batch { tokens: &self.tokens, positions: &self.positions, slots: &self.slots, seqs, logit_rows, state_slots: &self.state_slots }
    }
}

impl<D: Device> Backend for ModelBackend<D> {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            chunk_invariant: self.model.chunk_invariant() && self.dev.batch_invariant(),
            reports_fill: true,
            supports_marks: !self.has_state() || self.cfg.max_marks > 0,
            supports_rewind: self.rewindable,
            max_batch: self.cfg.max_batch,
            max_context: self.cfg.context,
            vocab_size: self.model.vocab(),
            feature_dim: 0,
            greedy_rounds: self.dev.argmax_on_device(),
            top_rounds: self.dev.top_k_on_device(),
        }
    }

    fn fill(&self) -> Fill {
        Fill {
            blocks_used: self.blocks_total - self.free.len(),
            blocks_total: self.blocks_total,
            block_tokens: self.cfg.block_tokens,
            slots_used: self.streams.len(),
            slots_total: self.cfg.max_streams,
        }
    }

    fn open(&mut self, stream: StreamId) -> Result<()> {
        ensure!(!self.streams.contains_key(&stream), "stream {stream} is already open");
        let Some(slot) = self.free_slots.pop() else { bail!("all {} stream slots are taken", self.cfg.max_streams) };
        if self.has_state() {
            self.dev.zero_rows(&mut self.mem.state, &[slot]);
        }
        self.streams.insert(stream, StreamState { blocks: Vec::new(), len: 0, slot });
        Ok(())
    }

    fn prefill_step(&mut self, stream: StreamId, chunk: Chunk<'_>) -> Result<Option<Vec<f32>>> {
        self.reserve_chunk(stream, &chunk)?;
        let last = [chunk.tokens.len() - 1];
        let rows: &[usize] = if chunk.want_logits { &last } else { &[] };
        let logits = self.run(&[(stream, chunk.tokens)], rows)?;
        Ok(chunk.want_logits.then_some(logits))
    }

    fn cancel_prefill(&mut self, _stream: StreamId) {
        // Chunks run synchronously: between chunks there is nothing in
        // flight, and the state already ends at the last chunk.
    }

    fn decode_round(&mut self, rows: &[DecodeRow]) -> Result<Vec<f32>> {
        let total = self.reserve_round(rows)?;
        let parts = round_parts(rows);
        let logit_rows: Vec<usize> = (0..total).collect();
        self.run(&parts, &logit_rows)
    }

    fn decode_round_greedy(&mut self, rows: &[DecodeRow], same_next: bool) -> Result<Vec<u32>> {
        ensure!(rows.iter().all(|r| r.tokens.len() == 1), "a greedy round takes one token per row");
        let total = self.reserve_round(rows)?;
        let parts = round_parts(rows);
        let logit_rows: Vec<usize> = (0..total).collect();
        self.forward(&parts, &logit_rows)?;
        if self.rewindable && same_next {
            // The round expected next runs while the engine handles these
            // tokens; if it is not the one asked for, it only wrote KV past
            // each stream's length (no recurrent state here).
            self.dev.argmax_rows_launch_ahead(&self.scratch.logits)
        } else {
            self.dev.argmax_rows(&self.scratch.logits)
        }
    }

    fn decode_round_top(&mut self, rows: &[DecodeRow], k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        ensure!(rows.iter().all(|r| r.tokens.len() == 1), "a top-k round takes one token per row");
        ensure!((1..=self.dev.top_k_on_device()).contains(&k), "top-{k} candidates are not found on this device");
        let total = self.reserve_round(rows)?;
        let parts = round_parts(rows);
        let logit_rows: Vec<usize> = (0..total).collect();
        self.forward(&parts, &logit_rows)?;
        self.dev.top_k_rows(&self.scratch.logits, k)
    }

    fn decode_round_with_chunk(&mut self, rows: &[DecodeRow], stream: StreamId, chunk: Chunk<'_>) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        ensure!(rows.iter().all(|r| r.stream != stream), "stream {stream} is both decoding and prefilling");
        let total = self.reserve_round(rows)?;
        self.reserve_chunk(stream, &chunk)?;
        let mut parts = round_parts(rows);
        parts.push((stream, chunk.tokens));
        let mut logit_rows: Vec<usize> = (0..total).collect();
        if chunk.want_logits {
            logit_rows.push(total + chunk.tokens.len() - 1);
        }
        let mut logits = self.run(&parts, &logit_rows)?;
        let last = chunk.want_logits.then(|| logits.split_off(total * self.model.vocab()));
        Ok((logits, last))
    }

    fn keep_mark(&mut self, stream: StreamId) -> Result<MarkId> {
        let Some(st) = self.streams.get(&stream) else { bail!("stream {stream} is not open") };
        let used = st.len.div_ceil(self.cfg.block_tokens);
        let blocks = st.blocks[..used].to_vec();
        let (len, stream_slot) = (st.len, st.slot);
        let slot = if self.has_state() {
            let Some(m) = self.free_mark_slots.pop() else { bail!("all {} mark slots are taken", self.cfg.max_marks) };
            self.dev.copy_rows(&mut self.mem.state, &[stream_slot], &[m]);
            Some(m)
        } else {
            None
        };
        for &b in &blocks {
            self.refs[b as usize] += 1;
        }
        let id = self.next_mark;
        self.next_mark += 1;
        self.marks.insert(id, Mark { blocks, len, slot });
        Ok(id)
    }

    fn restore_mark(&mut self, stream: StreamId, mark: MarkId) -> Result<usize> {
        let Some(m) = self.marks.get(&mark) else { bail!("no mark {mark}") };
        let Some(st) = self.streams.get(&stream) else { bail!("stream {stream} is not open") };
        ensure!(st.len == 0 && st.blocks.is_empty(), "stream {stream} is not empty");
        let (len, mut blocks, mark_slot) = (m.len, m.blocks.clone(), m.slot);
        let bt = self.cfg.block_tokens;
        // Full blocks are shared read-only; a partly filled last block is
        // copied, since this stream will write into its free tail.
        let partial = len % bt != 0;
        if partial {
            let src = blocks.pop().unwrap();
            let dst = self.alloc_block()?;
            self.dev.kv_copy_blocks(&mut self.mem.kv, &[src], &[dst]);
            for &b in &blocks {
                self.refs[b as usize] += 1;
            }
            blocks.push(dst);
        } else {
            for &b in &blocks {
                self.refs[b as usize] += 1;
            }
        }
        let st = self.streams.get_mut(&stream).unwrap();
        st.blocks = blocks;
        st.len = len;
        if let Some(ms) = mark_slot {
            let slot = st.slot;
            self.dev.copy_rows(&mut self.mem.state, &[ms], &[slot]);
        }
        Ok(len)
    }

    fn drop_mark(&mut self, mark: MarkId) {
        if let Some(m) = self.marks.remove(&mark) {
            self.release(&m.blocks);
            self.free_mark_slots.extend(m.slot);
        }
    }

    fn rewind(&mut self, stream: StreamId, len: usize) -> Result<()> {
        ensure!(self.rewindable, "this model keeps recurrent state, which cannot be rewound");
        let Some(st) = self.streams.get_mut(&stream) else { bail!("stream {stream} is not open") };
        ensure!(len <= st.len, "cannot rewind stream {stream} forward from {} to {len}", st.len);
        st.len = len;
        let keep = len.div_ceil(self.cfg.block_tokens);
        let dropped: Vec<u32> = st.blocks.split_off(keep);
        self.release(&dropped);
        Ok(())
    }

    fn forget(&mut self, stream: StreamId) {
        if let Some(st) = self.streams.remove(&stream) {
            self.release(&st.blocks);
            self.free_slots.push(st.slot);
        }
    }
}
