//! Recording fakes: a backend, a drafter and a token text that log every
//! call, so tests (here and in crates that drive a lane, such as the
//! server's) can assert the exact sequence of chunks, rounds, cancels,
//! marks and absorbs without a model.
//!
//! The fake model is deterministic: after a sequence whose last token is
//! `t` and whose length is `n`, the most likely next token is
//! [`fake_next`]`(t, n, vocab)`. Feature rows are `[token, position]`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, ensure, Result};

use crate::backend::{Backend, Capabilities, Chunk, DecodeRow, Fill, MarkId, StreamId};
use crate::drafter::Drafter;
use crate::stop::TokenText;

/// The fake model's next token after a sequence of length `len` ending in
/// `last`.
pub fn fake_next(last: u32, len: usize, vocab: usize) -> u32 {
    ((last as u64 * 31 + len as u64 * 17 + 7) % vocab.max(1) as u64) as u32
}

/// One logged call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Open(StreamId),
    Prefill {
        stream: StreamId,
        start: usize,
        tokens: Vec<u32>,
        want_logits: bool,
    },
    CancelPrefill(StreamId),
    /// The next `Decode` returned greedy tokens, not logits; the engine
    /// expected the same round next (`same_next`).
    Greedy {
        streams: Vec<StreamId>,
        same_next: bool,
    },
    /// A decode round that returned top-k candidates (k, streams).
    Top(usize, Vec<StreamId>),
    /// The next `Decode` and `Prefill` ran in one forward.
    Fused,
    /// One decode round: each row's stream and tokens, in order.
    Decode(Vec<(StreamId, Vec<u32>)>),
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
    Rewind {
        stream: StreamId,
        len: usize,
    },
    Forget(StreamId),
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

    /// `(start, len)` of every prefill chunk of `stream`, in order.
    pub fn chunks(&self, stream: StreamId) -> Vec<(usize, usize)> {
        self.snapshot()
            .into_iter()
            .filter_map(|c| match c {
                Call::Prefill { stream: s, start, tokens, .. } if s == stream => Some((start, tokens.len())),
                _ => None,
            })
            .collect()
    }
}

/// What the fake backend declares and how big its memory is.
#[derive(Clone, Debug)]
pub struct FakeConfig {
    pub caps: Capabilities,
    pub block_tokens: usize,
    pub blocks_total: usize,
    pub slots_total: usize,
    /// Sleep in every decode round (to let a test act between rounds).
    pub decode_delay: Option<Duration>,
    /// Sleep in every prefill step.
    pub prefill_delay: Option<Duration>,
    /// While a test holds this lock, the lane stops at its next `open`,
    /// `prefill_step` or `decode_round` (after logging the call), so the
    /// test can line up arrivals deterministically.
    pub hold: Option<Arc<Mutex<()>>>,
    /// Log [`Call::Fused`] before the decode round and the chunk that a
    /// `decode_round_with_chunk` runs together.
    pub log_fused: bool,
}

impl Default for FakeConfig {
    fn default() -> Self {
        FakeConfig {
            caps: Capabilities {
                chunk_invariant: false,
                reports_fill: true,
                supports_marks: true,
                supports_rewind: true,
                max_batch: 64,
                max_context: 4096,
                vocab_size: 64,
                feature_dim: 2,
                greedy_rounds: false,
                top_rounds: 0,
            },
            block_tokens: 4,
            blocks_total: 4096,
            slots_total: 32,
            decode_delay: None,
            prefill_delay: None,
            hold: None,
            log_fused: false,
        }
    }
}

/// A backend that logs every call and enforces the contract (a chunk must
/// start at the stream's length, a restore needs an empty stream, ...).
pub struct FakeBackend {
    cfg: FakeConfig,
    log: CallLog,
    streams: HashMap<StreamId, Vec<u32>>,
    marks: HashMap<MarkId, Vec<u32>>,
    next_mark: MarkId,
    features: Vec<f32>,
}

impl FakeBackend {
    pub fn new(cfg: FakeConfig, log: CallLog) -> FakeBackend {
        FakeBackend { cfg, log, streams: HashMap::new(), marks: HashMap::new(), next_mark: 1, features: Vec::new() }
    }

    fn logits_after(&self, seq: &[u32]) -> Vec<f32> {
        let v = self.cfg.caps.vocab_size;
        let target = fake_next(seq.last().copied().unwrap_or(0), seq.len(), v) as usize;
        // The target is the most likely; the rest fall off with distance.
        (0..v).map(|j| -(((j + v - target) % v) as f32) * 0.5).collect()
    }

    /// Wait while a test holds the lane (see [`FakeConfig::hold`]).
    fn wait_hold(&self) {
        if let Some(h) = self.cfg.hold.clone() {
            drop(h.lock().unwrap_or_else(|e| e.into_inner()));
        }
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let v = self.cfg.caps.vocab_size;
        ensure!(tokens.iter().all(|&t| (t as usize) < v), "token id out of range (vocab {v})");
        Ok(())
    }

    fn used_blocks(&self) -> usize {
        let b = self.cfg.block_tokens.max(1);
        self.streams.values().chain(self.marks.values()).map(|s| s.len().div_ceil(b)).sum()
    }
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
            block_tokens: self.cfg.block_tokens,
            slots_used: self.streams.len(),
            slots_total: self.cfg.slots_total,
        }
    }

    fn open(&mut self, stream: StreamId) -> Result<()> {
        self.log.push(Call::Open(stream));
        self.wait_hold();
        ensure!(!self.streams.contains_key(&stream), "stream {stream} is already open");
        ensure!(self.streams.len() < self.cfg.slots_total, "no free slot");
        self.streams.insert(stream, Vec::new());
        Ok(())
    }

    fn prefill_step(&mut self, stream: StreamId, chunk: Chunk<'_>) -> Result<Option<Vec<f32>>> {
        self.log.push(Call::Prefill { stream, start: chunk.start, tokens: chunk.tokens.to_vec(), want_logits: chunk.want_logits });
        self.wait_hold();
        if let Some(d) = self.cfg.prefill_delay {
            std::thread::sleep(d);
        }
        self.check_tokens(chunk.tokens)?;
        ensure!(!chunk.tokens.is_empty(), "empty chunk");
        let Some(seq) = self.streams.get(&stream) else { bail!("stream {stream} is not open") };
        ensure!(seq.len() == chunk.start, "stream {stream} holds {} rows, the chunk starts at {}", seq.len(), chunk.start);
        let len = seq.len() + chunk.tokens.len();
        ensure!(len <= self.cfg.caps.max_context, "past the context");
        let free = self.cfg.blocks_total.saturating_sub(self.used_blocks());
        let b = self.cfg.block_tokens.max(1);
        ensure!(len.div_ceil(b) - seq.len().div_ceil(b) <= free, "KV pool full");
        self.features.clear();
        for (i, &t) in chunk.tokens.iter().enumerate() {
            self.features.extend_from_slice(&[t as f32, (chunk.start + i) as f32]);
        }
        let seq = self.streams.get_mut(&stream).expect("checked above");
        seq.extend_from_slice(chunk.tokens);
        let seq = seq.clone();
        Ok(chunk.want_logits.then(|| self.logits_after(&seq)))
    }

    fn cancel_prefill(&mut self, stream: StreamId) {
        self.log.push(Call::CancelPrefill(stream));
    }

    fn decode_round(&mut self, rows: &[DecodeRow]) -> Result<Vec<f32>> {
        self.log.push(Call::Decode(rows.iter().map(|r| (r.stream, r.tokens.clone())).collect()));
        self.wait_hold();
        if let Some(d) = self.cfg.decode_delay {
            std::thread::sleep(d);
        }
        let total: usize = rows.iter().map(|r| r.tokens.len()).sum();
        ensure!(total <= self.cfg.caps.max_batch, "round of {total} rows over max batch {}", self.cfg.caps.max_batch);
        let b = self.cfg.block_tokens.max(1);
        let mut need = 0;
        for r in rows {
            self.check_tokens(&r.tokens)?;
            let Some(seq) = self.streams.get(&r.stream) else { bail!("stream {} is not open", r.stream) };
            let len = seq.len() + r.tokens.len();
            ensure!(len <= self.cfg.caps.max_context, "stream {} would hold {len} rows, past the context", r.stream);
            need += len.div_ceil(b) - seq.len().div_ceil(b);
        }
        ensure!(need <= self.cfg.blocks_total.saturating_sub(self.used_blocks()), "KV pool full");
        let mut out = Vec::with_capacity(total * self.cfg.caps.vocab_size);
        self.features.clear();
        for r in rows {
            for &t in &r.tokens {
                let seq = self.streams.get_mut(&r.stream).expect("checked above");
                seq.push(t);
                let pos = seq.len() - 1;
                let seq = seq.clone();
                out.extend(self.logits_after(&seq));
                self.features.extend_from_slice(&[t as f32, pos as f32]);
            }
        }
        Ok(out)
    }

    fn decode_round_greedy(&mut self, rows: &[DecodeRow], same_next: bool) -> Result<Vec<u32>> {
        ensure!(self.cfg.caps.greedy_rounds, "greedy rounds are off in this fake");
        ensure!(rows.iter().all(|r| r.tokens.len() == 1), "a greedy round takes one token per row");
        self.log.push(Call::Greedy { streams: rows.iter().map(|r| r.stream).collect(), same_next });
        let logits = self.decode_round(rows)?;
        Ok(logits.chunks(self.cfg.caps.vocab_size.max(1)).map(crate::sampling::argmax).collect())
    }

    fn decode_round_top(&mut self, rows: &[DecodeRow], k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        ensure!(k >= 1 && k <= self.cfg.caps.top_rounds, "top-{k} rounds are off in this fake");
        ensure!(rows.iter().all(|r| r.tokens.len() == 1), "a top-k round takes one token per row");
        self.log.push(Call::Top(k, rows.iter().map(|r| r.stream).collect()));
        let logits = self.decode_round(rows)?;
        Ok(logits.chunks(self.cfg.caps.vocab_size.max(1)).map(|row| crate::sampling::top_n(row, k)).collect())
    }

    fn decode_round_with_chunk(&mut self, rows: &[DecodeRow], stream: StreamId, chunk: Chunk<'_>) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        if self.cfg.log_fused {
            self.log.push(Call::Fused);
        }
        let logits = self.decode_round(rows)?;
        let last = self.prefill_step(stream, chunk)?;
        Ok((logits, last))
    }

    fn features(&self) -> Option<&[f32]> {
        (self.cfg.caps.feature_dim > 0).then_some(&self.features[..])
    }

    fn keep_mark(&mut self, stream: StreamId) -> Result<MarkId> {
        ensure!(self.cfg.caps.supports_marks, "this backend does not support marks");
        let Some(seq) = self.streams.get(&stream) else { bail!("stream {stream} is not open") };
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
        Ok(())
    }

    fn forget(&mut self, stream: StreamId) {
        self.log.push(Call::Forget(stream));
        self.streams.remove(&stream);
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
    fn open(&mut self, stream: StreamId, start: usize) {
        self.pos.insert(stream, start);
    }

    fn absorb(&mut self, stream: StreamId, features: &[f32], rows: usize) {
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
