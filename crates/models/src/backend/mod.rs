//! Serves any [`Model`] on any [`Device`] to the engine: per-stream block
//! tables over one paged KV pool, marks as shared blocks, and one forward
//! per round.
//!
//! Attention-only models cache their KV by block: the pool's ids and the
//! index of which tokens each block holds are the engine's [`BlockPool`];
//! the rows live here, on the device. Every full block of a stream started
//! with `attach_prefix` is cached under its prompt's salt and stays after
//! the stream ends, until the pool needs the room; a later stream shares
//! the blocks its prompt begins with (a partly matching last block is
//! copied, since the stream writes on in it). Sliding-window layers keep
//! their KV in a group of their own (vLLM's hybrid KV-cache manager): a
//! second, smaller pool of block ids and a second table per stream, from
//! which a stream lets go of each block whose rows no query of its can see
//! any more (see [`WindowGroup`]). Recurrent state cannot be
//! rebuilt from blocks, so models that keep it cache prefixes as marks,
//! which the lane places.
//!
//! A round's decode rows and its prompt chunk run as one batch. Rounds
//! whose streams each run a few rows (decode, drafts) are keyed
//! ([`Batch::key`]), so a device can record them once and replay them.
//! Launching ahead lives here, below the engine: after a greedy round of
//! one token per stream the device is told to start the same round one
//! token further at once (attention-only models, whose stray KV past a
//! stream's length is harmless), with the prompt chunk the step named for
//! it (`Step::next_chunk`), if any. When the next round asks for those
//! rows they are already computed; rows it asks for beyond them (a stream
//! that joined) run in a forward of their own, and a round started with a
//! chunk serves only the very step it was started for.

use std::borrow::Cow;
use std::collections::HashMap;

use anyhow::{bail, ensure, Result};
use braid_engine::{
    replayed_size, replayed_size_up, window_start, Backend, BlockPool, BlockTable, Capabilities, Chunk, DecodeRow, Draw, Encoded, Fill, MarkId, Penalty, Pick,
    Picked, Picks, PromptImage, RoundMasks, RoundOut, Step, StreamId, IMAGE_IDS,
};
use braid_ops::{Device, DrawRow, Forward, KvDtype, RowPick, RowPicked};

use crate::{Batch, Memory, Model, Scratch};

/// How a forward's decode rows are picked: a step's pick with its masks,
/// penalties and draws.
#[derive(Clone, Copy)]
struct Picking<'a> {
    pick: Pick,
    masks: Option<&'a dyn RoundMasks>,
    penalties: &'a [Penalty],
    draws: &'a [Draw],
}

impl<'a> Picking<'a> {
    fn of(step: &Step<'a>) -> Picking<'a> {
        Picking { pick: step.pick, masks: step.masks, penalties: step.penalties, draws: step.draws }
    }
}

/// `tokens` run as `rows` rows: the last token stands in for the rows past
/// its end (see `ModelBackend::chunk_rows`).
fn pad(tokens: &[u32], rows: usize) -> Cow<'_, [u32]> {
    match tokens.last() {
        Some(&last) if rows > tokens.len() => Cow::Owned(tokens.iter().copied().chain(std::iter::repeat_n(last, rows - tokens.len())).collect()),
        _ => Cow::Borrowed(tokens),
    }
}

/// A lane's draw as the device takes it (see `RowPick::Draw`).
pub fn device_draw(d: &Draw) -> DrawRow {
    // A number just below 1 stays below 1 in f32.
    let below_one = 1.0 - f32::EPSILON / 2.0;
    DrawRow { temperature: d.temperature, top_k: d.top_k.min(u32::MAX as usize) as u32, top_p: d.top_p, min_p: d.min_p, u: (d.u as f32).min(below_one) }
}

mod ahead;
mod layout;
mod picks;
mod rows;
mod taps;

use ahead::{Launched, NextRound};
pub use layout::KvLayout;
use layout::WindowGroup;
use picks::{empty, launched_rows, merge, merge_rows, resolve, select, select_rows};
use rows::{image_rows, RowArrays};
pub use taps::{DeviceTaps, SharedTaps};

/// Forwards whose streams each run at most this many rows (decode, drafts)
/// are keyed for replay, and so are those that add a prompt chunk of a
/// replayed size up to [`REPLAY_CHUNK_ROWS`] (the sizes the lane's
/// pacer keeps to where the device replays: see
/// `Capabilities::replayed_chunk_rows`). Other chunks run eagerly: their
/// sizes rarely recur, and on the H200 a recording (3–5 ms) cost more than
/// the round it was for.
const REPLAY_ROWS: usize = 16;

/// The largest prompt chunk keyed beside decode rows. 256, not 64: on the
/// H200 a replayed 256-row chunk adds ~1.5 ms to a round of six decoding
/// streams and a 128-row one ~1.2 ms, so a latency target of 3–5 ms takes
/// an 1800-token prompt in 8–15 rounds instead of the 28 that 64-row
/// chunks needed (a chunk run eagerly costs 11–23 ms: never larger).
pub const REPLAY_CHUNK_ROWS: usize = 256;

/// Rows a stream may be rewound below the start of its last forward and
/// still find the window its window layers read (a rewind further is
/// refused). The lane's draft rounds rewind no lower than a verifying
/// forward's start; a mark restored and cut back by a row or two, or a
/// draft model's backend, which feeds its drafts a forward each and cuts
/// back the ones rejected (up to 16 below the last forward's start), go
/// lower.
pub const REWIND_ROWS: usize = 16;

#[derive(Clone, Debug)]
pub struct BackendConfig {
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// KV capacity in tokens, over all streams (rounded up to blocks).
    pub kv_tokens: usize,
    /// Most streams held at once.
    pub max_streams: usize,
    /// Most rows one round may carry.
    pub max_batch: usize,
    /// Longest stream; 0 = the model's own context length.
    pub context: usize,
    /// Marks kept at once (each holds a state row for recurrent models).
    pub max_marks: usize,
    /// How the KV pool stores k and v (f16 by default; f32 for exact runs).
    pub kv_dtype: KvDtype,
    /// Sliding-window layers keep only their window, in a group of blocks
    /// of their own (the default); false keeps every row in them too, in
    /// the full layers' blocks (a reference for tests).
    pub window_kv: bool,
}

impl Default for BackendConfig {
    fn default() -> Self {
        BackendConfig {
            block_tokens: 16,
            kv_tokens: 32768,
            max_streams: 64,
            max_batch: 256,
            context: 0,
            max_marks: 64,
            kv_dtype: KvDtype::F16,
            window_kv: true,
        }
    }
}

struct StreamState {
    table: BlockTable,
    /// The stream's blocks in the window group (empty without one): as
    /// many entries as `table`, the leading ones let go.
    win: BlockTable,
    len: usize,
    /// Row in `Memory::state`.
    slot: u32,
}

/// A pass's image rows: each image's prompt rows `(start, end)` and its
/// rows on the device, in the same order.
struct Images<T> {
    spans: Vec<(usize, usize)>,
    rows: Vec<T>,
}

/// A pass's image rows being made, a step at a time
/// (`encode_images_step`): the image next and where its encoding stands
/// (`Model::encode_image_step`'s cursor), the rows made so far.
struct Encoding<T> {
    image: usize,
    at: usize,
    rows: Vec<T>,
}

struct Mark {
    blocks: Vec<u32>,
    /// The window group's blocks of the mark's window (and rewind slack),
    /// from block `win_first` of the stream's table.
    win_blocks: Vec<u32>,
    win_first: usize,
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
    /// Full KV blocks are cached for later prompts (attention only: a
    /// stream can start from blocks alone).
    caches_blocks: bool,
    cfg: BackendConfig,
    /// Which blocks are free, held or cached (the full layers', and every
    /// layer's where there is no window group).
    pool: BlockPool,
    /// The window group, when window layers keep only their window.
    win: Option<WindowGroup>,
    /// The model has window layers, kept over the full blocks
    /// (`BackendConfig::window_kv` off): they read the full group's rows.
    window_over_full: bool,
    streams: HashMap<StreamId, StreamState>,
    marks: HashMap<MarkId, Mark>,
    next_mark: MarkId,
    /// The round launched ahead, if one is running.
    launched: Option<Launched>,
    /// The last round carried a prompt chunk: a pass is under way, so the
    /// next round will likely carry one too (no launching ahead).
    chunk_last: bool,
    /// The streams of the last round's decode rows.
    last_rows: Vec<StreamId>,
    /// One row of logits gathered from `scratch.logits` (a chunk's last row).
    row: D::Tensor,
    /// The most logits rows a forward has left: `scratch.logits` holds
    /// that many without moving (tensors only grow).
    logit_rows_held: usize,
    /// Width of one tapped layer's rows (0: no taps; see `set_feature_layers`).
    tap_width: usize,
    /// The last forward's feature rows: every row's tapped layers side by
    /// side, in `scratch.taps` order (none while `shared_taps`).
    features: Vec<f32>,
    /// Where the tapped rows stay on the device for a drafter there
    /// (`share_taps`), instead of `features`.
    shared_taps: Option<SharedTaps<D>>,
    /// The image rows of the passes under way (`encode_images`).
    images: HashMap<StreamId, Images<D::Tensor>>,
    /// The image rows being made.
    encoding: HashMap<StreamId, Encoding<D::Tensor>>,
}

impl<D: Device> ModelBackend<D> {
    pub fn new(dev: D, model: Box<dyn Model<D>>, mut cfg: BackendConfig) -> Result<ModelBackend<D>> {
        ensure!(cfg.block_tokens > 0, "block_tokens must be positive");
        if cfg.context == 0 {
            cfg.context = model.context();
        }
        let rewindable = model.layer_states().iter().all(|l| l.rewindable());
        let caches_blocks = rewindable && model.state_size() == 0;
        let layout = KvLayout::of(model.as_ref(), &cfg)?;
        let blocks_total = layout.spec.group_blocks[0];
        let win = layout.window.map(|w| WindowGroup { pool: BlockPool::new(layout.spec.group_blocks[1], cfg.block_tokens), window: w });
        let window_over_full = layout.over_full;
        let kv = dev.kv_pool(&layout.spec, cfg.kv_dtype)?;
        let state_size = model.state_size();
        let (stream_rows, mark_rows) = if state_size > 0 { (cfg.max_streams, cfg.max_marks) } else { (0, 0) };
        let state = dev.tensor(stream_rows + mark_rows, state_size);
        let mut scratch = Scratch::new(&dev);
        let mut mem = Memory { kv, state };
        // Let the device see one forward before serving (it may fold
        // weights and build kernels now, never later): one row at position
        // 0 of block 0 and state row 0, all free until a stream takes them.
        let blocks = [0u32];
        let batch = Batch::warm_up(&blocks);
        if stream_rows > 0 || state_size == 0 {
            dev.prepare(&mut || model.forward(&dev, &batch, &mut mem, &mut scratch))?;
        }
        let row = dev.tensor(0, 0);
        Ok(ModelBackend {
            free_slots: (0..cfg.max_streams as u32).rev().collect(),
            free_mark_slots: (stream_rows as u32..(stream_rows + mark_rows) as u32).rev().collect(),
            rewindable,
            caches_blocks,
            dev,
            model,
            mem,
            scratch,
            pool: BlockPool::new(blocks_total, cfg.block_tokens),
            window_over_full,
            win,
            cfg,
            streams: HashMap::new(),
            marks: HashMap::new(),
            next_mark: 1,
            launched: None,
            chunk_last: false,
            logit_rows_held: 0,
            last_rows: Vec::new(),
            row,
            tap_width: 0,
            features: Vec::new(),
            shared_taps: None,
            images: HashMap::new(),
            encoding: HashMap::new(),
        })
    }

    /// Tap the output rows of target layers `layers` (0-based, in the order a
    /// drafter's config names them; any but the last), each `width` wide (the
    /// model's hidden size), in every forward from now on: `features()` then
    /// holds each row's taps side by side. An empty list stops tapping.
    pub fn set_feature_layers(&mut self, layers: &[usize], width: usize) -> Result<()> {
        let n = self.model.layer_states().len();
        if let Some(&l) = layers.iter().find(|&&l| l >= n) {
            bail!("feature layer {l} does not exist: the model has {n} layers (0..{})", n.saturating_sub(1));
        }
        // Drafters are trained on transformers' `hidden_states[l + 1]`, which
        // for the last layer is the final norm's output, not the layer's.
        if let Some(&l) = layers.iter().find(|&&l| l + 1 == n) {
            bail!(
                "feature layer {l} is the model's last: transformers hands drafters that row after the final norm, which braid does not tap (tap layers 0..{})",
                n.saturating_sub(2)
            );
        }
        ensure!(layers.is_empty() || width > 0, "feature taps need a positive width");
        self.scratch.taps = layers.to_vec();
        self.tap_width = if layers.is_empty() { 0 } else { width };
        self.features.clear();
        // A round launched ahead ran without the taps.
        self.drop_launched();
        Ok(())
    }

    /// The width of a feature row on the host: every tap side by side (0:
    /// no taps, or none copied to the host: `shared_taps`).
    fn feature_dim(&self) -> usize {
        if self.shared_taps.is_some() {
            return 0;
        }
        self.scratch.taps.len() * self.tap_width
    }

    /// The tapped rows of the forward just run, side by side on the host.
    fn collect_features(&mut self, rows: usize) -> Result<()> {
        let taps = self.scratch.taps.len();
        if taps == 0 || self.shared_taps.is_some() {
            return Ok(());
        }
        let w = self.tap_width;
        self.features.resize(rows * taps * w, 0.0);
        for (i, t) in self.scratch.tapped.iter().enumerate().take(taps) {
            let shape = self.dev.shape(t);
            ensure!(shape == (rows, w), "feature tap {i} holds {}x{} rows, expected {rows}x{w}", shape.0, shape.1);
            let data = self.dev.download(t)?;
            for r in 0..rows {
                self.features[(r * taps + i) * w..(r * taps + i + 1) * w].copy_from_slice(&data[r * w..(r + 1) * w]);
            }
        }
        Ok(())
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    pub fn model(&self) -> &dyn Model<D> {
        self.model.as_ref()
    }

    fn alloc_block(&mut self) -> Result<u32> {
        self.pool.alloc().ok_or_else(|| anyhow::anyhow!("KV pool full ({} blocks of {} tokens)", self.pool.total(), self.cfg.block_tokens))
    }

    /// Give `stream` blocks for `len` rows, in both groups; all-or-nothing.
    fn reserve(&mut self, stream: StreamId, len: usize) -> Result<()> {
        ensure!(len <= self.cfg.context, "stream would hold {len} tokens, past the context of {}", self.cfg.context);
        let st = self.streams.get_mut(&stream).expect("checked by the caller");
        if let Some(w) = &self.win {
            let need = len.div_ceil(self.cfg.block_tokens).saturating_sub(st.win.blocks.len());
            ensure!(need <= w.pool.available(), "KV pool full: the window layers need {need} more blocks, {} free", w.pool.available());
        }
        self.pool.grow(&mut st.table, len).map_err(anyhow::Error::msg)?;
        if let Some(w) = &mut self.win {
            w.pool.grow(&mut st.win, len).expect("counted above");
        }
        Ok(())
    }

    /// Whether a chunk of a size that does not replay may run as the next
    /// replayed size (`Capabilities::pads_chunks`): the device replays,
    /// the pad rows' KV past the stream's length is overwritten before
    /// any read (attention only: no recurrent state takes them in), and
    /// no feature taps would hand them to a drafter.
    fn pads_chunks(&self) -> bool {
        self.dev.caps().replays && self.rewindable && self.tap_width == 0 && self.shared_taps.is_none()
    }

    /// The rows a chunk of `stream` beside `decode_rows` decode rows runs
    /// as: its own, or where it can be padded, the next replayed size
    /// (within the replayed sizes, the round's rows and the context).
    fn chunk_rows(&self, stream: StreamId, c: &Chunk<'_>, decode_rows: usize) -> usize {
        let n = c.tokens.len();
        if decode_rows == 0 || !self.pads_chunks() || self.images.contains_key(&stream) {
            return n;
        }
        match replayed_size_up(n) {
            m if m <= REPLAY_CHUNK_ROWS && decode_rows + m <= self.cfg.max_batch && c.start + m <= self.cfg.context => m,
            _ => n,
        }
    }

    /// [`Self::chunk_rows`], its pad rows' blocks given to `stream` where
    /// the pool has them; else the chunk's own rows (their blocks are the
    /// caller's to give).
    fn reserve_padded(&mut self, stream: StreamId, c: &Chunk<'_>, decode_rows: usize) -> usize {
        match self.chunk_rows(stream, c, decode_rows) {
            n if n > c.tokens.len() && self.reserve(stream, c.start + n).is_ok() => n,
            _ => c.tokens.len(),
        }
    }

    /// Blocks of `stream`'s window group (held, and entries in all), for tests.
    pub fn window_blocks(&self, stream: StreamId) -> Option<(usize, usize)> {
        self.streams.get(&stream).filter(|_| self.win.is_some()).map(|st| (st.win.held(), st.win.blocks.len()))
    }

    /// The step ran: its tokens are the new rows of its streams, for the
    /// block cache to seal the blocks they filled. After a failed step the
    /// rows are uncertain, so its streams cache nothing more.
    fn record(&mut self, step: &Step<'_>, ok: bool) {
        let parts = step.rows.iter().map(|r| (r.stream, r.tokens.as_slice())).chain(step.chunk.map(|(s, c)| (s, c.tokens)));
        for (stream, tokens) in parts {
            let Some(st) = self.streams.get_mut(&stream) else { continue };
            if ok {
                self.pool.append(&mut st.table, tokens);
                if let Some(w) = &mut self.win {
                    w.pool.append(&mut st.win, tokens);
                }
            } else {
                st.table.unkey();
                st.win.unkey();
            }
        }
    }

    fn has_state(&self) -> bool {
        self.model.state_size() > 0
    }

    /// Check a step (open streams, contiguous chunk, token ids, batch
    /// size) and give its streams the blocks they need.
    fn reserve_step(&mut self, step: &Step<'_>) -> Result<()> {
        let vocab = self.model.vocab();
        let mut total = 0;
        for r in step.rows {
            let Some(st) = self.streams.get(&r.stream) else { bail!("stream {} is not open", r.stream) };
            ensure!(!r.tokens.is_empty(), "a decode row of stream {} without tokens", r.stream);
            ensure!(r.tokens.iter().all(|&t| (t as usize) < vocab), "token id out of range (vocab {vocab})");
            total += r.tokens.len();
            let len = st.len + r.tokens.len();
            self.reserve(r.stream, len)?;
        }
        if let Some((stream, chunk)) = &step.chunk {
            ensure!(step.rows.iter().all(|r| r.stream != *stream), "stream {stream} is both decoding and prefilling");
            let Some(st) = self.streams.get(stream) else { bail!("stream {stream} is not open") };
            ensure!(st.len == chunk.start, "stream {stream} holds {} rows, the chunk starts at {}", st.len, chunk.start);
            ensure!(!chunk.tokens.is_empty(), "empty chunk");
            let (start, end) = (chunk.start, chunk.start + chunk.tokens.len());
            let spans = self.images.get(stream).map_or(&[][..], |m| &m.spans[..]);
            let in_image = |r: usize| spans.iter().any(|&(a, b)| (a..b).contains(&r));
            ensure!(
                chunk.tokens.iter().enumerate().all(|(i, &t)| (t as usize) < vocab || (t >= IMAGE_IDS && in_image(start + i))),
                "token id out of range (vocab {vocab}), or an image row whose image rows were not made"
            );
            if let Some(&(a, b)) = spans.iter().find(|&&(a, b)| a < end && end < b) {
                bail!("the chunk {start}..{end} of stream {stream} ends inside the image at rows {a}..{b}");
            }
            // The pad rows' blocks where the pool has them (`run` pads only
            // what is reserved), and the chunk's own.
            self.reserve_padded(*stream, chunk, total);
            total += chunk.tokens.len();
            self.reserve(*stream, chunk.start + chunk.tokens.len())?;
        }
        ensure!(total <= self.cfg.max_batch, "a round of {total} rows exceeds max batch {}", self.cfg.max_batch);
        Ok(())
    }

    /// One forward over `parts`, each stream's rows from its current
    /// length; leaves the logits of `logit_rows` in `scratch.logits` and
    /// advances every part's stream.
    fn forward(&mut self, parts: &[(StreamId, &[u32])], logit_rows: &[usize], chunk: bool) -> Result<()> {
        let bt = self.cfg.block_tokens;
        let rows = RowArrays::new(&self.streams, bt, parts, self.win.is_some());
        let mut batch = rows.batch(&self.streams, parts, logit_rows, self.window_over_full);
        // Only the last part can be a prompt chunk, and only it holds image rows.
        let lent = match parts.last() {
            Some(&(id, toks)) => self.images.get_mut(&id).map(|m| {
                let start = self.streams[&id].len;
                let first = batch.tokens.len() - toks.len();
                batch.images = image_rows(&m.spans, start, start + toks.len(), first);
                self.scratch.images = std::mem::take(&mut m.rows);
                id
            }),
            None => None,
        };
        // Only the last part can be a prompt chunk.
        let (rows, tail) = if chunk { parts.split_at(parts.len().saturating_sub(1)) } else { (parts, &[][..]) };
        let replayed = rows.iter().all(|p| p.1.len() <= REPLAY_ROWS) && tail.iter().all(|p| p.1.len() <= REPLAY_CHUNK_ROWS && replayed_size(p.1.len()));
        let key = (batch.images.is_empty() && replayed).then(|| batch.key());
        let (dev, model, mem, scratch) = (&self.dev, &self.model, &mut self.mem, &mut self.scratch);
        let ran = dev.forward(Forward { key, tokens: batch.tokens }, &mut || model.forward(dev, &batch, mem, scratch));
        if let Some(id) = lent {
            self.images.get_mut(&id).expect("lent above").rows = std::mem::take(&mut self.scratch.images);
        }
        ran?;
        // A forward found launched ahead ran no host code: its logits keep
        // the rows the round before's pick gave them (`pick_rows`).
        let cols = self.dev.shape(&self.scratch.logits).1;
        self.dev.resize(&mut self.scratch.logits, logit_rows.len(), cols);
        let rows = batch.tokens.len();
        drop(batch);
        self.logit_rows_held = self.logit_rows_held.max(logit_rows.len());
        self.collect_features(rows)?;
        for &(id, toks) in parts {
            let st = self.streams.get_mut(&id).expect("checked by reserve_step");
            // Window rows before this forward's first row's window (less
            // the rewind slack) are read by no later query.
            if let Some(w) = &mut self.win {
                w.pool.drop_front(&mut st.win, window_start(st.len.saturating_sub(REWIND_ROWS), w.window, bt));
            }
            st.len += toks.len();
        }
        Ok(())
    }

    /// `pick` of the logits rows (one per decode token row), on the device
    /// where it can, after `penalties` (whole rows come back raw); with
    /// `ahead` (an argmax), the round after `rows` (with its named chunk, if
    /// any) is prepared and launched on the device with the tokens picked.
    fn pick_rows(
        &mut self,
        rows: &[DecodeRow],
        pick: Pick,
        allowed: Option<&[u32]>,
        penalties: &[Penalty],
        draws: &[Draw],
        ahead: Option<Option<(StreamId, Chunk<'_>)>>,
    ) -> Result<Picked> {
        let penalties: Vec<braid_ops::Penalty> =
            penalties.iter().map(|p| braid_ops::Penalty { row: p.row, col: p.token, repeat: p.repeat, sub: p.sub }).collect();
        let n = self.dev.shape(&self.scratch.logits).0;
        if let Some(next) = ahead {
            self.prepare_ahead(rows, next);
            // A named chunk that wants logits left one more row's shape
            // (its buffer held it: `ahead_chunk_ready`).
            let cols = self.dev.shape(&self.scratch.logits).1;
            self.dev.resize(&mut self.scratch.logits, n, cols);
        }
        let rows_drawn: Vec<DrawRow>;
        let on_device = match pick {
            Pick::Logits => None,
            Pick::Argmax => Some(allowed.map_or(RowPick::Argmax, RowPick::ArgmaxAllowed)),
            Pick::TopK(k) => {
                ensure!((1..=self.dev.caps().top_k).contains(&k), "top-{k} candidates are not found on this device");
                Some(allowed.map_or(RowPick::TopK(k), |a| RowPick::TopKAllowed(k, a)))
            }
            Pick::Draw => {
                ensure!(self.dev.caps().draw && draws.len() == n, "{} draws for {n} rows on a device that draws: {}", draws.len(), self.dev.caps().draw);
                rows_drawn = draws.iter().map(device_draw).collect();
                Some(RowPick::Draw(&rows_drawn, allowed))
            }
        };
        let picked = match on_device {
            None => Picked::Logits(self.dev.download(&self.scratch.logits)?),
            Some(p) => match (pick, self.dev.pick(&self.scratch.logits, p, &penalties, pick == Pick::Argmax && ahead.is_some())?) {
                (Pick::Argmax, RowPicked::Argmax(t)) | (Pick::Draw, RowPicked::Drawn(t)) => Picked::Tokens(t),
                (Pick::TopK(_), RowPicked::TopK(t)) => Picked::Top(t),
                (_, other) => bail!("the device answered a {pick:?} pick with {other:?}"),
            },
        };
        ensure!(picked.rows(self.model.vocab()) == n, "picked {} rows of {n}", picked.rows(self.model.vocab()));
        if let Some(next) = ahead {
            self.launched = Some(Launched { rows: launched_rows(rows, &picked), with_chunk: next.is_some(), gone: Vec::new() });
        }
        Ok(picked)
    }

    /// One forward for `rows` and the chunk: the decode rows' picks, and
    /// the chunk's last-row logits when asked (`penalties`: the step's).
    /// `next`: what the step says of the next round (`Step::next_chunk`,
    /// `Step::next_plain`), `None` where the round after may not be
    /// launched ahead (see [`ModelBackend::may_launch_ahead`]).
    fn run(&mut self, rows: &[DecodeRow], chunk: Option<(StreamId, Chunk<'_>)>, picking: Picking<'_>, next: Option<NextRound<'_>>) -> Result<RoundOut> {
        let pick = picking.pick;
        // Nothing to run (a round launched ahead served every row): no
        // forward, which on a GPU would record an empty graph.
        if rows.is_empty() && chunk.is_none() {
            return Ok(RoundOut { picked: empty(pick), chunk_logits: None });
        }
        let mut parts: Vec<(StreamId, &[u32])> = rows.iter().map(|r| (r.stream, r.tokens.as_slice())).collect();
        let total: usize = rows.iter().map(|r| r.tokens.len()).sum();
        let mut logit_rows: Vec<usize> = (0..total).collect();
        let padded;
        if let Some((stream, c)) = &chunk {
            // Reserved by `reserve_step` already, but for a chunk run beside
            // fewer rows than its step (part of it was launched ahead).
            padded = pad(c.tokens, self.reserve_padded(*stream, c, total));
            parts.push((*stream, &padded));
            if c.want_logits {
                logit_rows.push(total + c.tokens.len() - 1);
            }
        }
        self.forward(&parts, &logit_rows, chunk.is_some())?;
        if let Some((stream, c)) = &chunk {
            // The pad rows are not the stream's: their KV lies past its length.
            self.streams.get_mut(stream).expect("checked by reserve_step").len = c.start + c.tokens.len();
        }
        self.keep_taps(&parts, |_| true);
        let chunk_logits = match chunk {
            Some((_, c)) if c.want_logits => {
                self.dev.gather_rows(&self.scratch.logits, &[total], &mut self.row);
                let l = self.dev.download(&self.row)?;
                self.dev.resize(&mut self.scratch.logits, total, self.model.vocab());
                Some(l)
            }
            _ => None,
        };
        if total == 0 {
            return Ok(RoundOut { picked: empty(pick), chunk_logits });
        }
        // Asked now, with the forward on its way.
        let (pick, allowed) = resolve(pick, picking.masks, total, self.model.vocab());
        let ahead = next.and_then(|n| self.ahead(rows, chunk.is_some(), pick, n));
        let picked = self.pick_rows(rows, pick, allowed.as_deref(), picking.penalties, picking.draws, ahead)?;
        Ok(RoundOut { picked, chunk_logits })
    }

    /// Free the blocks of streams gone (their slots are free already).
    fn release(&mut self, gone: Vec<(StreamId, StreamState)>) {
        for (_, st) in gone {
            self.pool.free_table(st.table);
            if let Some(w) = &mut self.win {
                w.pool.free_table(st.win);
            }
        }
    }

    /// The round's forwards: the round launched ahead where it serves,
    /// the rest (and the chunk) now.
    fn run_step(&mut self, step: &Step<'_>) -> Result<RoundOut> {
        let launched = self.launched.as_ref().map_or(0, |l| l.rows.len());
        let served = self.take_launched(step)?;
        let out = if served.is_empty() {
            self.run(step.rows, step.chunk, Picking::of(step), Some(NextRound::of(step)))?
        } else if served.len() == step.rows.len() && step.chunk.is_none() {
            // Every row asked for was launched: the round launched ahead,
            // or it with rows no longer asked for (a stream gone, one
            // sitting out) or in another order. Its logits are put in the
            // step's order on the device, and the round goes on as the very
            // round launched: picked there, the next launched ahead (else a
            // stream leaving left the next round to run cold: 1.3-1.7 ms
            // against 1.07 on the H100).
            if launched != served.len() || served.iter().any(|&(i, j)| i != j) {
                let from: Vec<usize> = served.iter().map(|&(_, j)| j).collect();
                self.dev.gather_rows(&self.scratch.logits, &from, &mut self.row);
                self.dev.gather_rows(&self.row, &(0..from.len()).collect::<Vec<_>>(), &mut self.scratch.logits);
                let fw = self.feature_dim();
                if fw > 0 {
                    self.features = select_rows(&self.features, from.into_iter(), fw);
                }
            }
            let total = step.rows.iter().map(|r| r.tokens.len()).sum();
            let (pick, allowed) = resolve(step.pick, step.masks, total, self.model.vocab());
            let ahead = self.ahead(step.rows, false, pick, NextRound::of(step));
            RoundOut { picked: self.pick_rows(step.rows, pick, allowed.as_deref(), step.penalties, step.draws, ahead)?, chunk_logits: None }
        } else {
            // Part of the round was launched ahead; the rest (and the chunk)
            // run now. Guided, penalised or drawn rows take logits here (the
            // lane masks, penalises and samples them): a rare round, not
            // worth splitting their masks, penalties and draws.
            let pick = if step.masks.is_some() || !step.penalties.is_empty() || step.pick == Pick::Draw { Pick::Logits } else { step.pick };
            let all = self.pick_rows(&[], pick, None, &[], &[], None)?;
            let vocab = self.model.vocab();
            let first = select(&all, served.iter().map(|&(_, j)| j), vocab);
            let (fw, launched_features) = (self.feature_dim(), std::mem::take(&mut self.features));
            let rest: Vec<DecodeRow> = (0..step.rows.len()).filter(|i| !served.iter().any(|&(k, _)| k == *i)).map(|i| step.rows[i].clone()).collect();
            let second = self.run(&rest, step.chunk, Picking { pick, masks: None, penalties: &[], draws: &[] }, None)?;
            let served_rows: Vec<usize> = served.iter().map(|&(i, _)| i).collect();
            if fw > 0 {
                // The step's rows in order, then the chunk's (the second forward's last).
                let rest_rows: usize = rest.iter().map(|r| r.tokens.len()).sum();
                let chunk = self.features.split_off(rest_rows * fw);
                let first = select_rows(&launched_features, served.iter().map(|&(_, j)| j), fw);
                self.features = merge_rows(step.rows, &served_rows, first, std::mem::take(&mut self.features), fw);
                self.features.extend(chunk);
            }
            RoundOut { picked: merge(step.rows, &served_rows, first, second.picked, vocab), chunk_logits: second.chunk_logits }
        };
        self.chunk_last = step.chunk.is_some();
        self.last_rows = step.rows.iter().map(|r| r.stream).collect();
        Ok(out)
    }
}

impl<D: Device> Backend for ModelBackend<D> {
    fn lost(&self) -> Option<String> {
        self.dev.lost().map(|e| format!("{} lost: {e}", self.dev.name()))
    }

    fn capabilities(&self) -> Capabilities {
        let caps = self.dev.caps();
        Capabilities {
            chunk_invariant: self.model.chunk_invariant() && caps.batch_invariant,
            batch_invariant: caps.batch_invariant,
            reports_fill: true,
            supports_marks: !self.has_state() || self.cfg.max_marks > 0,
            prefix_blocks: self.caches_blocks,
            supports_rewind: self.rewindable,
            max_batch: self.cfg.max_batch,
            max_context: self.cfg.context,
            vocab_size: self.model.vocab(),
            images: self.model.vision().is_some(),
            feature_dim: self.feature_dim(),
            // Every device's pick applies penalties (the default on the rows it downloads).
            picks: Picks { argmax: caps.argmax, top_k: caps.top_k, penalties: true, draw: caps.draw },
            replayed_chunk_rows: if caps.replays { REPLAY_CHUNK_ROWS } else { 0 },
            launches_ahead: caps.ahead && self.rewindable,
            pads_chunks: self.pads_chunks(),
        }
    }

    fn fill(&self) -> Fill {
        Fill {
            blocks_used: self.pool.in_use(),
            blocks_total: self.pool.total(),
            blocks_cached: self.pool.cached(),
            blocks_evicted: self.pool.evicted(),
            blocks_ahead: self.streams.values().map(|s| s.table.blocks.len().saturating_sub(s.len.div_ceil(self.cfg.block_tokens))).sum(),
            block_tokens: self.cfg.block_tokens,
            slots_used: self.streams.len(),
            slots_total: self.cfg.max_streams,
            window_blocks_used: self.win.as_ref().map_or(0, |w| w.pool.in_use()),
            window_blocks_total: self.win.as_ref().map_or(0, |w| w.pool.total()),
            window_blocks_cached: self.win.as_ref().map_or(0, |w| w.pool.cached()),
            window_blocks_evicted: self.win.as_ref().map_or(0, |w| w.pool.evicted()),
        }
    }

    fn open(&mut self, stream: StreamId) -> Result<()> {
        ensure!(!self.streams.contains_key(&stream), "stream {stream} is already open");
        let Some(slot) = self.free_slots.pop() else { bail!("all {} stream slots are taken", self.cfg.max_streams) };
        if self.has_state() {
            self.dev.zero_rows(&mut self.mem.state, &[slot]);
        }
        self.streams.insert(stream, StreamState { table: BlockTable::default(), win: BlockTable::default(), len: 0, slot });
        Ok(())
    }

    fn round(&mut self, step: Step<'_>) -> Result<RoundOut> {
        if let Err(e) = self.reserve_step(&step) {
            self.drop_launched();
            return Err(e);
        }
        let out = self.run_step(&step);
        self.record(&step, out.is_ok());
        out
    }

    fn features(&self) -> Option<&[f32]> {
        (self.feature_dim() > 0).then_some(self.features.as_slice())
    }

    fn cancel_prefill(&mut self, _stream: StreamId) {
        // Chunks run synchronously: between chunks there is nothing in
        // flight, and the state already ends at the last chunk.
    }

    fn attach_prefix(&mut self, stream: StreamId, prompt: &[u32], salt: u64, max_len: usize) -> Result<usize> {
        let Some(st) = self.streams.get_mut(&stream) else { bail!("stream {stream} is not open") };
        ensure!(st.len == 0 && st.table.blocks.is_empty(), "stream {stream} is not empty");
        if !self.caches_blocks {
            return Ok(0);
        }
        let max_len = max_len.min(self.cfg.context);
        let (got, win_copy) = match &mut self.win {
            Some(w) => self.pool.attach_windowed(&mut st.table, &mut w.pool, &mut st.win, prompt, salt, max_len, w.window),
            None => (self.pool.attach(&mut st.table, prompt, salt, max_len), None),
        };
        st.len = got.rows;
        for (group, copy) in [(0, got.copy), (1, win_copy)] {
            if let Some((src, dst)) = copy {
                self.dev.kv_copy_blocks(&mut self.mem.kv, group, &[src], &[dst]);
            }
        }
        Ok(got.rows)
    }

    fn keep_mark(&mut self, stream: StreamId) -> Result<MarkId> {
        let Some(st) = self.streams.get(&stream) else { bail!("stream {stream} is not open") };
        let bt = self.cfg.block_tokens;
        let used = st.len.div_ceil(bt);
        let blocks = st.table.blocks[..used].to_vec();
        // The window blocks of the mark's window, and the rewind slack.
        let (win_first, win_blocks) = match &self.win {
            Some(w) => {
                let first = window_start(st.len.saturating_sub(REWIND_ROWS), w.window, bt).max(st.win.dropped()).min(used);
                (first, st.win.blocks[first..used].to_vec())
            }
            None => (0, Vec::new()),
        };
        let (len, stream_slot) = (st.len, st.slot);
        let slot = if self.has_state() {
            let Some(m) = self.free_mark_slots.pop() else { bail!("all {} mark slots are taken", self.cfg.max_marks) };
            self.dev.copy_rows(&mut self.mem.state, &[stream_slot], &[m]);
            Some(m)
        } else {
            None
        };
        for &b in &blocks {
            self.pool.retain(b);
        }
        if let Some(w) = &mut self.win {
            win_blocks.iter().for_each(|&b| w.pool.retain(b));
        }
        let id = self.next_mark;
        self.next_mark += 1;
        self.marks.insert(id, Mark { blocks, win_blocks, win_first, len, slot });
        Ok(id)
    }

    fn restore_mark(&mut self, stream: StreamId, mark: MarkId) -> Result<usize> {
        let Some(m) = self.marks.get(&mark) else { bail!("no mark {mark}") };
        let Some(st) = self.streams.get(&stream) else { bail!("stream {stream} is not open") };
        ensure!(st.len == 0 && st.table.blocks.is_empty(), "stream {stream} is not empty");
        let (len, mut blocks, mark_slot) = (m.len, m.blocks.clone(), m.slot);
        let (mut win_blocks, win_first) = (m.win_blocks.clone(), m.win_first);
        let bt = self.cfg.block_tokens;
        // Full blocks are shared read-only; a partly filled last block is
        // copied (in both groups), since this stream will write into its free tail.
        if len % bt != 0 {
            let dst = self.alloc_block()?;
            let win_dst = match &mut self.win {
                Some(w) => match w.pool.alloc() {
                    Some(b) => Some(b),
                    None => {
                        self.pool.release(dst);
                        bail!("KV pool full: no window block left for the mark's last block");
                    }
                },
                None => None,
            };
            let src = blocks.pop().expect("a partial block");
            self.dev.kv_copy_blocks(&mut self.mem.kv, 0, &[src], &[dst]);
            blocks.iter().for_each(|&b| self.pool.retain(b));
            blocks.push(dst);
            if let (Some(w), Some(wdst)) = (&mut self.win, win_dst) {
                let wsrc = win_blocks.pop().expect("a partial window block");
                self.dev.kv_copy_blocks(&mut self.mem.kv, 1, &[wsrc], &[wdst]);
                win_blocks.iter().for_each(|&b| w.pool.retain(b));
                win_blocks.push(wdst);
            }
        } else {
            blocks.iter().for_each(|&b| self.pool.retain(b));
            if let Some(w) = &mut self.win {
                win_blocks.iter().for_each(|&b| w.pool.retain(b));
            }
        }
        let st = self.streams.get_mut(&stream).expect("checked above");
        st.table.blocks = blocks;
        if self.win.is_some() {
            st.win = BlockTable::dropped_before(win_blocks, win_first);
        }
        st.len = len;
        if let Some(ms) = mark_slot {
            let slot = st.slot;
            self.dev.copy_rows(&mut self.mem.state, &[ms], &[slot]);
        }
        Ok(len)
    }

    fn drop_mark(&mut self, mark: MarkId) {
        if let Some(m) = self.marks.remove(&mark) {
            for &b in &m.blocks {
                self.pool.release(b);
            }
            if let Some(w) = &mut self.win {
                m.win_blocks.iter().for_each(|&b| w.pool.release(b));
            }
            self.free_mark_slots.extend(m.slot);
        }
    }

    fn rewind(&mut self, stream: StreamId, len: usize) -> Result<()> {
        ensure!(self.rewindable, "this model keeps recurrent state, which cannot be rewound");
        let Some(st) = self.streams.get_mut(&stream) else { bail!("stream {stream} is not open") };
        ensure!(len <= st.len, "cannot rewind stream {stream} forward from {} to {len}", st.len);
        let bt = self.cfg.block_tokens;
        if let Some(w) = &self.win {
            ensure!(
                window_start(len, w.window, bt) >= st.win.dropped(),
                "cannot rewind stream {stream} to {len}: its window layers let go of the rows before {} (rewinds of up to {REWIND_ROWS} rows below a forward's start are kept)",
                st.win.dropped() * bt
            );
        }
        st.len = len;
        // The block it writes on in must be its own: a shared one is copied.
        if let Some((src, dst)) = self.pool.truncate(&mut st.table, len).map_err(anyhow::Error::msg)? {
            self.dev.kv_copy_blocks(&mut self.mem.kv, 0, &[src], &[dst]);
        }
        if let Some(w) = &mut self.win {
            if let Some((src, dst)) = w.pool.truncate(&mut st.win, len).map_err(anyhow::Error::msg)? {
                self.dev.kv_copy_blocks(&mut self.mem.kv, 1, &[src], &[dst]);
            }
        }
        Ok(())
    }

    fn encode_images(&mut self, stream: StreamId, images: &[PromptImage]) -> Result<()> {
        while !self.encode_images_step(stream, images, None)?.done {}
        Ok(())
    }

    fn encode_images_step(&mut self, stream: StreamId, images: &[PromptImage], budget: Option<u64>) -> Result<Encoded> {
        ensure!(self.streams.contains_key(&stream), "stream {stream} is not open");
        let Some(tokens) = self.model.vision().map(|v| v.tokens) else { bail!("this model takes no images") };
        let e = self.encoding.entry(stream).or_insert(Encoding { image: 0, at: 0, rows: Vec::new() });
        let (mut work, mut next) = (0, 0);
        if let Some(m) = images.get(e.image) {
            let n = e.image;
            let made = if m.len == tokens {
                self.model.encode_image_step(&self.dev, &m.pixels, &mut e.at, budget)
            } else {
                Err(anyhow::anyhow!("it takes {} prompt rows; the model makes {tokens} per image", m.len))
            };
            match made {
                Err(err) => {
                    self.encoding.remove(&stream);
                    return Err(anyhow::anyhow!("image {n} of stream {stream}: {err:#}"));
                }
                Ok(step) => {
                    (work, next) = (step.work, step.next);
                    if let Some(rows) = step.rows {
                        e.rows.push(rows);
                        (e.image, e.at) = (e.image + 1, 0);
                    }
                }
            }
        }
        if e.image < images.len() {
            return Ok(Encoded { done: false, work, next });
        }
        let e = self.encoding.remove(&stream).expect("entered above");
        self.images.insert(stream, Images { spans: images.iter().map(|m| (m.start, m.end())).collect(), rows: e.rows });
        Ok(Encoded { done: true, work, next })
    }

    fn drop_images(&mut self, stream: StreamId) {
        self.images.remove(&stream);
        self.encoding.remove(&stream);
    }

    fn forget(&mut self, stream: StreamId) {
        self.images.remove(&stream);
        self.encoding.remove(&stream);
        self.forget_taps(stream);
        let Some(st) = self.streams.remove(&stream) else { return };
        self.free_slots.push(st.slot);
        match self.launched.as_mut() {
            // The launched round serves others still: keep what it reads.
            Some(l) if !l.with_chunk && l.rows.iter().any(|r| r.0 == stream) && l.rows.iter().any(|r| self.streams.contains_key(&r.0)) => {
                l.gone.push((stream, st))
            }
            // None of its streams is left to serve.
            Some(l) if l.rows.iter().all(|r| !self.streams.contains_key(&r.0)) => {
                self.drop_launched();
                self.release(vec![(stream, st)]);
            }
            _ => self.release(vec![(stream, st)]),
        }
    }
}
