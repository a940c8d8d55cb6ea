//! Recording fakes: a backend, a drafter and a token text that log every
//! call, so tests (here and in crates that drive a lane, such as the
//! server's) can assert the exact sequence of chunks, rounds, cancels,
//! marks and absorbs without a model.
//!
//! With `prefix_blocks` declared, the fake keeps its memory in a
//! [`BlockPool`], as a model backend does, so cached blocks, eviction and
//! salts behave as they would on a device.
//!
//! The fake model is deterministic: after a sequence whose last token is
//! `t` and whose length is `n`, the most likely next token is
//! [`fake_next`]`(t, n, vocab)`. Feature rows are `[token, position]`.
//! The fake grammar ([`FakeGrammar`]) forbids a known set of tokens at each
//! step, so a test can compute the guided continuation on its own.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};

use crate::backend::{Backend, Capabilities, Chunk, DecodeRow, Encoded, Fill, MarkId, Pick, Picked, Picks, PromptImage, RoundOut, Step, StreamId};
use crate::blocks::{BlockPool, BlockTable};
use crate::drafter::Drafter;
use crate::guide::{Constraint, Grammar, TokenMask};
use crate::sampling::{argmax, draw_row, top_n};
use crate::stop::TokenText;

/// The fake model's next token after a sequence of length `len` ending in
/// `last`.
pub fn fake_next(last: u32, len: usize, vocab: usize) -> u32 {
    ((last as u64 * 31 + len as u64 * 17 + 7) % vocab.max(1) as u64) as u32
}

/// The fake model's logits after `seq`: [`fake_next`] is the most likely
/// token, and the others fall off with their distance from it (mod `vocab`).
pub fn fake_logits(seq: &[u32], vocab: usize) -> Vec<f32> {
    let target = fake_next(seq.last().copied().unwrap_or(0), seq.len(), vocab) as usize;
    (0..vocab).map(|j| -(((j + vocab - target) % vocab) as f32) * 0.5).collect()
}

/// One prompt chunk as the backend was handed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkCall {
    pub stream: StreamId,
    pub start: usize,
    pub tokens: Vec<u32>,
    pub want_logits: bool,
}

/// One logged call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Open(StreamId),
    /// `prefill_step`: a chunk in a forward of its own.
    Prefill(ChunkCall),
    /// `round`: each decode row's stream and tokens in order, the chunk
    /// that shared the forward, what was picked per token row, and what
    /// it said of the next round (`Step::next_chunk`, `Step::next_plain`,
    /// `Step::next_drafts`).
    Round {
        rows: Vec<(StreamId, Vec<u32>)>,
        chunk: Option<ChunkCall>,
        pick: Pick,
        next_chunk: Option<ChunkCall>,
        next_plain: bool,
        next_drafts: bool,
    },
    CancelPrefill(StreamId),
    KeepMark {
        stream: StreamId,
        mark: MarkId,
        len: usize,
    },
    RestoreMark {
        stream: StreamId,
        mark: MarkId,
        len: usize,
    },
    DropMark(MarkId),
    /// `attach_prefix`: the rows the stream started with, under `salt`.
    AttachPrefix {
        stream: StreamId,
        salt: u64,
        max_len: usize,
        len: usize,
    },
    Rewind {
        stream: StreamId,
        len: usize,
    },
    Forget(StreamId),
    /// `encode_images`: each image's `(start, len, hash)`.
    EncodeImages {
        stream: StreamId,
        images: Vec<(usize, usize, u64)>,
    },
    DropImages(StreamId),
    /// `encode_images_step`, the `n`th for its pass (from 1), with its
    /// budget (each does one unit of work).
    EncodeStep {
        stream: StreamId,
        n: usize,
        budget: Option<u64>,
    },
    /// Logged by [`FakeDrafter`].
    Absorb {
        stream: StreamId,
        rows: usize,
    },
    Propose {
        stream: StreamId,
        tokens: Vec<u32>,
    },
}

impl Call {
    /// The prompt chunk this call ran, alone or in a round.
    pub fn chunk(&self) -> Option<&ChunkCall> {
        match self {
            Call::Prefill(c) | Call::Round { chunk: Some(c), .. } => Some(c),
            _ => None,
        }
    }

    /// The decode rows of a round (empty for other calls).
    pub fn rows(&self) -> &[(StreamId, Vec<u32>)] {
        match self {
            Call::Round { rows, .. } => rows,
            _ => &[],
        }
    }

    /// Whether this is a round with a decode row of `stream`.
    pub fn decodes(&self, stream: StreamId) -> bool {
        self.rows().iter().any(|r| r.0 == stream)
    }
}

/// A shared, append-only call log.
#[derive(Clone, Debug, Default)]
pub struct CallLog(Arc<Mutex<Vec<Call>>>);

impl CallLog {
    pub fn push(&self, c: Call) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(c);
    }

    pub fn snapshot(&self) -> Vec<Call> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// `(start, len)` of every prompt chunk of `stream` (alone or in a
    /// round), in order.
    pub fn chunks(&self, stream: StreamId) -> Vec<(usize, usize)> {
        self.snapshot().iter().filter_map(Call::chunk).filter(|c| c.stream == stream).map(|c| (c.start, c.tokens.len())).collect()
    }

    /// The pick of every round with decode rows, in order.
    pub fn picks(&self) -> Vec<Pick> {
        self.snapshot().iter().filter_map(|c| if let Call::Round { rows, pick, .. } = c { (!rows.is_empty()).then_some(*pick) } else { None }).collect()
    }
}

/// What the fake backend declares and how big its memory is.
#[derive(Clone, Debug)]
pub struct FakeConfig {
    pub caps: Capabilities,
    pub block_tokens: usize,
    pub blocks_total: usize,
    pub slots_total: usize,
    /// Most marks held at once (`keep_mark` fails beyond it), as a model
    /// backend's mark slots; `None`: no limit.
    pub max_marks: Option<usize>,
    /// Sleep in every round with decode rows (to let a test act between rounds).
    pub decode_delay: Option<Duration>,
    /// A scripted cost: every round takes `f(decode rows, chunk rows)` on
    /// the backend's own clock ([`Backend::now`]), which only rounds move,
    /// so the lane's pacer sees the script's costs exactly (pacing tests;
    /// no real time passes, so a loaded machine cannot skew them).
    pub round_cost: Option<fn(usize, usize) -> Duration>,
    /// Sleep in every call that runs a prompt chunk.
    pub prefill_delay: Option<Duration>,
    /// Ask a round's masks as it begins, before its delay (a GPU's round
    /// launched ahead picks as soon as it is called), not after.
    pub masks_first: bool,
    /// Rounds whose masks were asked for and not all there (the round then
    /// returns logits).
    pub masks_missing: Arc<AtomicUsize>,
    /// While a test holds this lock, the lane stops at its next `open`,
    /// `prefill_step` or `round` (after logging the call), so the test can
    /// line up arrivals deterministically.
    pub hold: Option<Arc<Mutex<()>>>,
    /// Calls of `encode_images_step` a pass's images take (each logged as
    /// `Call::EncodeStep`); the last makes them as `encode_images` does.
    pub encode_steps: usize,
}

impl Default for FakeConfig {
    fn default() -> Self {
        FakeConfig {
            caps: Capabilities {
                chunk_invariant: false,
                batch_invariant: true,
                reports_fill: true,
                supports_marks: true,
                prefix_blocks: false,
                supports_rewind: true,
                max_batch: 64,
                max_context: 4096,
                vocab_size: 64,
                images: true,
                feature_dim: 2,
                picks: Picks::default(),
                replayed_chunk_rows: 0,
                pads_chunks: false,
                launches_ahead: false,
            },
            block_tokens: 4,
            blocks_total: 4096,
            slots_total: 32,
            max_marks: None,
            decode_delay: None,
            round_cost: None,
            prefill_delay: None,
            masks_first: false,
            masks_missing: Arc::default(),
            hold: None,
            encode_steps: 1,
        }
    }
}

/// A backend that logs every call and enforces the contract (a chunk must
/// start at the stream's length, a round fits the batch and the memory,
/// picks are only asked for when declared, a restore needs an empty
/// stream, ...).
pub struct FakeBackend {
    cfg: FakeConfig,
    log: CallLog,
    streams: HashMap<StreamId, Vec<u32>>,
    /// The streams' blocks, with `prefix_blocks`.
    pool: BlockPool,
    tables: HashMap<StreamId, BlockTable>,
    marks: HashMap<MarkId, Vec<u32>>,
    next_mark: MarkId,
    features: Vec<f32>,
    /// Each stream's image rows, as `encode_images` made them.
    images: HashMap<StreamId, Vec<PromptImage>>,
    /// `encode_images_step` calls so far, per stream being encoded.
    encoding: HashMap<StreamId, usize>,
    /// With `round_cost`, the clock's reading: its start and the scripted
    /// time since.
    clock: (Instant, Duration),
}

impl FakeBackend {
    pub fn new(cfg: FakeConfig, log: CallLog) -> FakeBackend {
        let pool = BlockPool::new(cfg.blocks_total, cfg.block_tokens);
        FakeBackend {
            cfg,
            log,
            streams: HashMap::new(),
            pool,
            tables: HashMap::new(),
            marks: HashMap::new(),
            next_mark: 1,
            features: Vec::new(),
            encoding: HashMap::new(),
            images: HashMap::new(),
            clock: (Instant::now(), Duration::ZERO),
        }
    }

    fn logits_after(&self, seq: &[u32]) -> Vec<f32> {
        fake_logits(seq, self.cfg.caps.vocab_size)
    }

    /// Wait while a test holds the lane (see [`FakeConfig::hold`]).
    fn wait_hold(&self) {
        if let Some(h) = self.cfg.hold.clone() {
            drop(h.lock().unwrap_or_else(|e| e.into_inner()));
        }
    }

    fn used_blocks(&self) -> usize {
        let b = self.cfg.block_tokens.max(1);
        let marks: usize = self.marks.values().map(|s| s.len().div_ceil(b)).sum();
        if self.cfg.caps.prefix_blocks {
            return self.pool.in_use() + marks;
        }
        marks + self.streams.values().map(|s| s.len().div_ceil(b)).sum::<usize>()
    }

    /// Check a whole step against the contract before anything changes.
    fn check(&self, step: &Step<'_>) -> Result<()> {
        let caps = &self.cfg.caps;
        match step.pick {
            Pick::Logits => {}
            Pick::Argmax => ensure!(caps.picks.argmax, "argmax picks are not declared by this fake"),
            Pick::TopK(k) => ensure!(k >= 1 && k <= caps.picks.top_k, "top-{k} picks are not declared by this fake (top_k {})", caps.picks.top_k),
            Pick::Draw => ensure!(caps.picks.draw, "draw picks are not declared by this fake"),
        }
        let token_rows: usize = step.rows.iter().map(|r| r.tokens.len()).sum();
        ensure!(
            step.draws.len() == if step.pick == Pick::Draw { token_rows } else { 0 },
            "{} draws for a {:?} round of {token_rows} token rows",
            step.draws.len(),
            step.pick
        );
        ensure!(step.penalties.is_empty() || caps.picks.penalties, "penalties are not declared by this fake");
        ensure!(
            step.penalties.iter().all(|p| (p.row as usize) < token_rows && (p.token as usize) < caps.vocab_size),
            "a penalty outside the round's {token_rows} token rows"
        );
        let mut parts: Vec<(StreamId, &[u32], Option<usize>)> = step.rows.iter().map(|r| (r.stream, &r.tokens[..], None)).collect();
        if let Some((stream, c)) = &step.chunk {
            ensure!(!c.tokens.is_empty(), "empty chunk");
            self.check_images(*stream, c)?;
            parts.push((*stream, c.tokens, Some(c.start)));
        }
        let total: usize = parts.iter().map(|p| p.1.len()).sum();
        ensure!(total <= caps.max_batch, "round of {total} rows over max batch {}", caps.max_batch);
        let b = self.cfg.block_tokens.max(1);
        let mut need = 0;
        for (i, &(stream, tokens, start)) in parts.iter().enumerate() {
            ensure!(parts[..i].iter().all(|p| p.0 != stream), "stream {stream} appears twice in one round");
            let image_row = |i: usize| start.is_some_and(|s| self.images.get(&stream).is_some_and(|m| m.iter().any(|m| (m.start..m.end()).contains(&(s + i)))));
            ensure!(
                tokens.iter().enumerate().all(|(i, &t)| (t as usize) < caps.vocab_size || image_row(i)),
                "token id out of range (vocab {})",
                caps.vocab_size
            );
            let Some(seq) = self.streams.get(&stream) else { bail!("stream {stream} is not open") };
            if let Some(start) = start {
                ensure!(seq.len() == start, "stream {stream} holds {} rows, the chunk starts at {start}", seq.len());
            }
            let len = seq.len() + tokens.len();
            ensure!(len <= caps.max_context, "stream {stream} would hold {len} rows, past the context");
            need += len.div_ceil(b) - seq.len().div_ceil(b);
        }
        ensure!(need <= self.cfg.blocks_total.saturating_sub(self.used_blocks()), "KV pool full");
        Ok(())
    }

    /// A chunk's image rows are made (by `encode_images`), and the chunk
    /// ends no image early.
    fn check_images(&self, stream: StreamId, c: &Chunk<'_>) -> Result<()> {
        let (start, end) = (c.start, c.start + c.tokens.len());
        for (i, &t) in c.tokens.iter().enumerate() {
            if t >= crate::backend::IMAGE_IDS {
                let at = start + i;
                let m = self.images.get(&stream).and_then(|m| m.iter().find(|m| (m.start..m.end()).contains(&at)));
                ensure!(m.is_some(), "stream {stream}: row {at} is an image row, but no image rows were made for it");
            }
        }
        for m in self.images.get(&stream).into_iter().flatten() {
            ensure!(!(m.start < end && end < m.end()), "stream {stream}: the chunk {start}..{end} splits the image at {}..{}", m.start, m.end());
        }
        Ok(())
    }

    /// Append `tokens` to `stream`; each row's features, and its logits
    /// when asked for.
    fn append(&mut self, stream: StreamId, tokens: &[u32], logits: Option<&mut Vec<f32>>) {
        let seq = self.streams.get_mut(&stream).expect("checked");
        let start = seq.len();
        seq.extend_from_slice(tokens);
        if let Some(t) = self.tables.get_mut(&stream) {
            self.pool.grow(t, start + tokens.len()).expect("checked: the round fits");
            self.pool.append(t, tokens);
        }
        let seq = seq.clone();
        for (i, &t) in tokens.iter().enumerate() {
            self.features.extend_from_slice(&[t as f32, (start + i) as f32]);
        }
        if let Some(out) = logits {
            for n in start + 1..=seq.len() {
                out.extend(self.logits_after(&seq[..n]));
            }
        }
    }

    /// The body of `round` and `prefill_step`, after logging.
    fn run(&mut self, step: Step<'_>) -> Result<RoundOut> {
        self.wait_hold();
        let ask = |step: &Step<'_>| step.masks.filter(|_| step.pick != Pick::Logits).map(|m| m.masks());
        let first = self.cfg.masks_first.then(|| ask(&step));
        if let (false, Some(d)) = (step.rows.is_empty(), self.cfg.decode_delay) {
            std::thread::sleep(d);
        }
        if let (Some(_), Some(d)) = (step.chunk, self.cfg.prefill_delay) {
            std::thread::sleep(d);
        }
        if let Some(cost) = self.cfg.round_cost {
            let decode: usize = step.rows.iter().map(|r| r.tokens.len()).sum();
            self.clock.1 += cost(decode, step.chunk.map_or(0, |(_, c)| c.tokens.len()));
        }
        self.check(&step)?;
        self.features.clear();
        let mut logits = Vec::new();
        for r in step.rows {
            self.append(r.stream, &r.tokens, Some(&mut logits));
        }
        let chunk_logits = step.chunk.and_then(|(stream, c)| {
            self.append(stream, c.tokens, None);
            c.want_logits.then(|| self.logits_after(&self.streams[&stream]))
        });
        let vocab = self.cfg.caps.vocab_size.max(1);
        let masks = first.unwrap_or_else(|| ask(&step));
        if let Some(None) = masks {
            self.cfg.masks_missing.fetch_add(1, Ordering::SeqCst);
        }
        if let Some(Some(masks)) = &masks {
            // The pick below is within each guided row's mask.
            logits.chunks_mut(vocab).zip(masks).for_each(|(row, m)| m.iter().for_each(|m| m.apply(row)));
        }
        if step.pick != Pick::Logits && !matches!(masks, Some(None)) {
            // Picked here: after the penalties (rows that come back whole come raw).
            for p in step.penalties {
                let l = &mut logits[p.row as usize * vocab + p.token as usize];
                *l = p.apply(*l);
            }
        }
        let picked = match (step.pick, masks) {
            (Pick::Logits, _) | (_, Some(None)) => Picked::Logits(logits),
            (Pick::Argmax, _) => Picked::Tokens(logits.chunks(vocab).map(argmax).collect()),
            (Pick::TopK(k), _) => Picked::Top(logits.chunks(vocab).map(|row| top_n(row, k)).collect()),
            // Drawn as the host's sampler draws, so a lane drawing here
            // gives the tokens it samples from whole rows.
            (Pick::Draw, _) => Picked::Tokens(logits.chunks(vocab).zip(step.draws).map(|(row, d)| draw_row(row, d)).collect()),
        };
        Ok(RoundOut { picked, chunk_logits })
    }
}

fn chunk_call(stream: StreamId, c: &Chunk<'_>) -> ChunkCall {
    ChunkCall { stream, start: c.start, tokens: c.tokens.to_vec(), want_logits: c.want_logits }
}

impl Backend for FakeBackend {
    fn capabilities(&self) -> Capabilities {
        self.cfg.caps.clone()
    }

    fn fill(&self) -> Fill {
        if !self.cfg.caps.reports_fill {
            return Fill::default();
        }
        Fill {
            blocks_used: self.used_blocks(),
            blocks_total: self.cfg.blocks_total,
            blocks_cached: self.pool.cached(),
            blocks_evicted: self.pool.evicted(),
            block_tokens: self.cfg.block_tokens,
            slots_used: self.streams.len(),
            slots_total: self.cfg.slots_total,
            ..Fill::default()
        }
    }

    fn open(&mut self, stream: StreamId) -> Result<()> {
        self.log.push(Call::Open(stream));
        self.wait_hold();
        ensure!(!self.streams.contains_key(&stream), "stream {stream} is already open");
        ensure!(self.streams.len() < self.cfg.slots_total, "no free slot");
        self.streams.insert(stream, Vec::new());
        if self.cfg.caps.prefix_blocks {
            self.tables.insert(stream, BlockTable::default());
        }
        Ok(())
    }

    fn round(&mut self, step: Step<'_>) -> Result<RoundOut> {
        let rows = step.rows.iter().map(|r: &DecodeRow| (r.stream, r.tokens.clone())).collect();
        let chunk = step.chunk.map(|(s, c)| chunk_call(s, &c));
        self.log.push(Call::Round {
            rows,
            chunk,
            pick: step.pick,
            next_chunk: step.next_chunk.map(|(s, c)| chunk_call(s, &c)),
            next_plain: step.next_plain,
            next_drafts: step.next_drafts,
        });
        self.run(step)
    }

    fn prefill_step(&mut self, stream: StreamId, chunk: Chunk<'_>) -> Result<Option<Vec<f32>>> {
        self.log.push(Call::Prefill(chunk_call(stream, &chunk)));
        Ok(self.run(Step::new(&[], Some((stream, chunk)), Pick::Logits))?.chunk_logits)
    }

    fn cancel_prefill(&mut self, stream: StreamId) {
        self.log.push(Call::CancelPrefill(stream));
    }

    fn features(&self) -> Option<&[f32]> {
        (self.cfg.caps.feature_dim > 0).then_some(&self.features[..])
    }

    fn now(&self) -> Instant {
        match self.cfg.round_cost {
            Some(_) => self.clock.0 + self.clock.1,
            None => Instant::now(),
        }
    }

    fn attach_prefix(&mut self, stream: StreamId, prompt: &[u32], salt: u64, max_len: usize) -> Result<usize> {
        ensure!(self.cfg.caps.prefix_blocks, "this fake caches no blocks");
        ensure!(self.streams.get(&stream).is_some_and(Vec::is_empty), "stream {stream} is not open and empty");
        let table = self.tables.get_mut(&stream).expect("opened with a table");
        let rows = self.pool.attach(table, prompt, salt, max_len).rows;
        self.log.push(Call::AttachPrefix { stream, salt, max_len, len: rows });
        self.streams.insert(stream, prompt[..rows].to_vec());
        Ok(rows)
    }

    fn keep_mark(&mut self, stream: StreamId) -> Result<MarkId> {
        ensure!(self.cfg.caps.supports_marks, "this backend does not support marks");
        let Some(seq) = self.streams.get(&stream) else { bail!("stream {stream} is not open") };
        ensure!(self.cfg.max_marks.is_none_or(|m| self.marks.len() < m), "all mark slots are taken");
        let mark = self.next_mark;
        self.next_mark += 1;
        self.log.push(Call::KeepMark { stream, mark, len: seq.len() });
        self.marks.insert(mark, seq.clone());
        Ok(mark)
    }

    fn restore_mark(&mut self, stream: StreamId, mark: MarkId) -> Result<usize> {
        ensure!(self.cfg.caps.supports_marks, "this backend does not support marks");
        let Some(m) = self.marks.get(&mark) else { bail!("no mark {mark}") };
        let Some(seq) = self.streams.get(&stream) else { bail!("stream {stream} is not open") };
        ensure!(seq.is_empty(), "stream {stream} is not empty");
        let m = m.clone();
        self.log.push(Call::RestoreMark { stream, mark, len: m.len() });
        let len = m.len();
        if let Some(t) = self.tables.get_mut(&stream) {
            self.pool.grow(t, len).map_err(anyhow::Error::msg)?;
        }
        self.streams.insert(stream, m);
        Ok(len)
    }

    fn drop_mark(&mut self, mark: MarkId) {
        self.log.push(Call::DropMark(mark));
        self.marks.remove(&mark);
    }

    fn rewind(&mut self, stream: StreamId, len: usize) -> Result<()> {
        self.log.push(Call::Rewind { stream, len });
        ensure!(self.cfg.caps.supports_rewind, "this backend cannot rewind");
        let Some(seq) = self.streams.get_mut(&stream) else { bail!("stream {stream} is not open") };
        ensure!(len <= seq.len(), "cannot rewind forward");
        seq.truncate(len);
        if let Some(t) = self.tables.get_mut(&stream) {
            self.pool.truncate(t, len).map_err(anyhow::Error::msg)?;
        }
        Ok(())
    }

    fn encode_images(&mut self, stream: StreamId, images: &[PromptImage]) -> Result<()> {
        self.log.push(Call::EncodeImages { stream, images: images.iter().map(|m| (m.start, m.len, m.hash)).collect() });
        ensure!(self.streams.contains_key(&stream), "stream {stream} is not open");
        let held = self.images.entry(stream).or_default();
        ensure!(held.is_empty(), "stream {stream}: image rows made again before drop_images");
        held.extend_from_slice(images);
        Ok(())
    }

    fn encode_images_step(&mut self, stream: StreamId, images: &[PromptImage], budget: Option<u64>) -> Result<Encoded> {
        let n = self.encoding.get(&stream).copied().unwrap_or(0) + 1;
        self.log.push(Call::EncodeStep { stream, n, budget });
        ensure!(self.streams.contains_key(&stream), "stream {stream} is not open");
        if n < self.cfg.encode_steps.max(1) {
            self.encoding.insert(stream, n);
            return Ok(Encoded { done: false, work: 1, next: 0 });
        }
        self.encoding.remove(&stream);
        self.encode_images(stream, images).map(|()| Encoded { done: true, work: 1, next: 0 })
    }

    fn drop_images(&mut self, stream: StreamId) {
        self.log.push(Call::DropImages(stream));
        self.images.remove(&stream);
        self.encoding.remove(&stream);
    }

    fn forget(&mut self, stream: StreamId) {
        self.log.push(Call::Forget(stream));
        self.images.remove(&stream);
        self.encoding.remove(&stream);
        self.streams.remove(&stream);
        if let Some(t) = self.tables.remove(&stream) {
            self.pool.free_table(t);
        }
    }
}

/// Any backend, stopped at its next `open` while a test holds the lock, so
/// the test can submit a burst that the lane admits together (a real
/// model's rounds are too quick to race against).
pub struct Held<B> {
    pub inner: B,
    pub hold: Arc<Mutex<()>>,
}

impl<B: Backend> Backend for Held<B> {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn fill(&self) -> Fill {
        self.inner.fill()
    }
    fn open(&mut self, stream: StreamId) -> Result<()> {
        drop(self.hold.lock().unwrap_or_else(|e| e.into_inner()));
        self.inner.open(stream)
    }
    fn round(&mut self, step: Step<'_>) -> Result<RoundOut> {
        self.inner.round(step)
    }
    fn prefill_step(&mut self, stream: StreamId, chunk: Chunk<'_>) -> Result<Option<Vec<f32>>> {
        self.inner.prefill_step(stream, chunk)
    }
    fn cancel_prefill(&mut self, stream: StreamId) {
        self.inner.cancel_prefill(stream)
    }
    fn features(&self) -> Option<&[f32]> {
        self.inner.features()
    }
    fn now(&self) -> Instant {
        self.inner.now()
    }
    fn attach_prefix(&mut self, stream: StreamId, prompt: &[u32], salt: u64, max_len: usize) -> Result<usize> {
        self.inner.attach_prefix(stream, prompt, salt, max_len)
    }
    fn keep_mark(&mut self, stream: StreamId) -> Result<MarkId> {
        self.inner.keep_mark(stream)
    }
    fn restore_mark(&mut self, stream: StreamId, mark: MarkId) -> Result<usize> {
        self.inner.restore_mark(stream, mark)
    }
    fn drop_mark(&mut self, mark: MarkId) {
        self.inner.drop_mark(mark)
    }
    fn rewind(&mut self, stream: StreamId, len: usize) -> Result<()> {
        self.inner.rewind(stream, len)
    }
    fn encode_images(&mut self, stream: StreamId, images: &[PromptImage]) -> Result<()> {
        self.inner.encode_images(stream, images)
    }
    fn encode_images_step(&mut self, stream: StreamId, images: &[PromptImage], budget: Option<u64>) -> Result<Encoded> {
        self.inner.encode_images_step(stream, images, budget)
    }
    fn drop_images(&mut self, stream: StreamId) {
        self.inner.drop_images(stream)
    }
    fn forget(&mut self, stream: StreamId) {
        self.inner.forget(stream)
    }
    fn lost(&self) -> Option<String> {
        self.inner.lost()
    }
}

/// A drafter that knows the fake model and is right except where told to
/// be wrong: in each proposal, draft `i` is corrupted when
/// `(position + i) % wrong_every == 0`. It logs every absorb and checks the
/// features it is fed are `[token, position]` rows in order.
pub struct FakeDrafter {
    log: CallLog,
    vocab: usize,
    block: usize,
    wrong_every: usize,
    /// Per stream: rows absorbed so far (the stream's length).
    pos: HashMap<StreamId, usize>,
    /// Feature rows that did not carry the expected position.
    pub feature_errors: Arc<Mutex<usize>>,
}

impl FakeDrafter {
    pub fn new(log: CallLog, vocab: usize, block: usize, wrong_every: usize) -> FakeDrafter {
        FakeDrafter { log, vocab, block, wrong_every, pos: HashMap::new(), feature_errors: Arc::new(Mutex::new(0)) }
    }
}

impl Drafter for FakeDrafter {
    fn open(&mut self, stream: StreamId, prefix: &[u32]) {
        self.pos.insert(stream, prefix.len());
    }

    fn absorb(&mut self, stream: StreamId, tokens: &[u32], features: &[f32]) {
        let rows = tokens.len();
        self.log.push(Call::Absorb { stream, rows });
        let pos = self.pos.entry(stream).or_insert(0);
        for r in 0..rows {
            let at = features.get(r * 2 + 1).copied();
            if at != Some((*pos + r) as f32) {
                *self.feature_errors.lock().unwrap_or_else(|e| e.into_inner()) += 1;
            }
        }
        *pos += rows;
    }

    fn propose(&mut self, stream: StreamId, last: u32) -> Vec<u32> {
        let pos = self.pos.get(&stream).copied().unwrap_or(0);
        let mut out = Vec::new();
        let mut t = last;
        for i in 0..self.block {
            // `last` sits at `pos`, so the sequence is `pos + 1 + i` long.
            let mut next = fake_next(t, pos + 1 + i, self.vocab);
            if self.wrong_every > 0 && (pos + i) % self.wrong_every == 0 {
                next = (next + 1) % self.vocab as u32;
            }
            out.push(next);
            t = next;
        }
        self.log.push(Call::Propose { stream, tokens: out.clone() });
        out
    }

    fn forget(&mut self, stream: StreamId) {
        self.pos.remove(&stream);
    }
}

/// Token text for fakes: token `i` is the `i`-th entry of a table (ids past
/// it print as lowercase letters).
#[derive(Clone, Debug, Default)]
pub struct FakeText {
    pub table: Vec<Vec<u8>>,
}

impl TokenText for FakeText {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        match self.table.get(id as usize) {
            Some(b) => b.clone(),
            None => vec![b'a' + (id % 26) as u8],
        }
    }
}

/// Whether the fake grammar lets token `t` follow `n` completion tokens:
/// all but those with `(t + n) % every == 0`.
pub fn fake_allows(every: usize, n: usize, t: u32) -> bool {
    !(t as usize + n).is_multiple_of(every.max(1))
}

/// The fake model's greedy continuation under the fake grammar: at each
/// step the most likely allowed token (the fake's logits fall off with
/// distance above the target, so the first allowed one from it up).
pub fn fake_guided(prompt: &[u32], n: usize, vocab: usize, every: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for i in 0..n {
        let target = fake_next(*seq.last().unwrap_or(&0), seq.len(), vocab);
        let t = (0..vocab as u32).map(|d| (target + d) % vocab as u32).find(|&t| fake_allows(every, i, t)).unwrap_or(target);
        seq.push(t);
    }
    seq[prompt.len()..].to_vec()
}

/// A grammar over the fake vocabulary (see [`fake_allows`]), complete after
/// `length` tokens if set. Its constraints refuse a token the rule forbids
/// (so a stream that sampled outside its mask fails), count the masks they
/// compute and the tokens they check, and take `delay` per mask (to be
/// slower than a round), or `slow` for every `slow_every`-th.
#[derive(Clone, Debug, Default)]
pub struct FakeGrammar {
    pub vocab: usize,
    pub every: usize,
    pub length: Option<usize>,
    pub delay: Option<Duration>,
    /// Every `slow_every`-th mask takes `slow` instead (0: none).
    pub slow_every: usize,
    pub slow: Duration,
    pub masks: Arc<AtomicUsize>,
    /// Tokens checked one at a time ([`Constraint::allows`]).
    pub checks: Arc<AtomicUsize>,
}

struct FakeConstraint {
    grammar: FakeGrammar,
    seq: Vec<u32>,
}

impl Grammar for FakeGrammar {
    fn start(&self) -> Result<Box<dyn Constraint>, String> {
        Ok(Box::new(FakeConstraint { grammar: self.clone(), seq: Vec::new() }))
    }
}

impl Constraint for FakeConstraint {
    fn mask(&mut self) -> Result<TokenMask, String> {
        let g = &self.grammar;
        let nth = g.masks.fetch_add(1, Ordering::SeqCst) + 1;
        match g.delay {
            _ if g.slow_every > 0 && nth.is_multiple_of(g.slow_every) => std::thread::sleep(g.slow),
            Some(d) => std::thread::sleep(d),
            None => {}
        }
        let n = self.seq.len();
        Ok(TokenMask::of(g.vocab, (0..g.vocab as u32).filter(|&t| fake_allows(g.every, n, t))))
    }

    fn allows(&mut self, token: u32) -> Result<bool, String> {
        let g = &self.grammar;
        g.checks.fetch_add(1, Ordering::SeqCst);
        Ok((token as usize) < g.vocab && fake_allows(g.every, self.seq.len(), token))
    }

    fn commit(&mut self, token: u32) -> Result<bool, String> {
        let n = self.seq.len();
        if !fake_allows(self.grammar.every, n, token) || self.grammar.length.is_some_and(|l| n >= l) {
            return Err(format!("token {token} is not allowed after {n} tokens"));
        }
        self.seq.push(token);
        Ok(self.grammar.length == Some(self.seq.len()))
    }

    fn rollback(&mut self, tokens: usize) -> Result<(), String> {
        let keep = self.seq.len().checked_sub(tokens).ok_or("rolled back past the start")?;
        self.seq.truncate(keep);
        Ok(())
    }

    fn fork(&self) -> Option<Box<dyn Constraint>> {
        Some(Box::new(FakeConstraint { grammar: self.grammar.clone(), seq: self.seq.clone() }))
    }
}
