//! Shared harness for the tiny random fixtures in `testdata/fixtures/<name>/`
//! (see `scripts/fixtures/README.md`): load a fixture and its transformers
//! reference, run passes through [`ModelBackend`] the way the engine does,
//! and compare logits.
//!
//! Use from a test file with `mod fixtures_common; use fixtures_common::*;`.
//! A family's tests usually are:
//!
//! ```ignore
//! let fx = Fixture::load("lfm2");
//! fx.check_states();                      // layer_states() against meta.json
//! fx.check_full(1e-4);                    // one prefill, every row's logits
//! fx.check_incremental(1e-4);             // prefill 24, then one token per round
//! fx.check_stepped(1e-4);                 // chunk caps 1, 3, 7, whole (bit-identical if chunk_invariant)
//! fx.check_marks(1e-4);                   // keep a mark mid-prompt, restore it into a new stream
//! fx.check_multi_stream();                // several streams in one round == each alone
//! ```
//!
//! Every pass goes through `decode_round` with the chunk as one stream's
//! rows, which returns logits for every row (the same forward as
//! `prefill_step`, which returns only the last row; `check_stepped` checks
//! that too).

#![allow(dead_code)]

/// One `#[test]` per `name => check(args)`: `Fixture::load(fixture).check(args)`,
/// so a failure names the family and the check.
#[macro_export]
macro_rules! fixture_checks {
    ($fixture:expr; $($test:ident => $check:ident($($arg:expr),*)),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                Fixture::load($fixture).$check($($arg),*);
            }
        )*
    };
}

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::sync::{Arc, Mutex};

use braid_engine::{image_token_ids, Backend, Chunk, DecodeRow, Drafter, Event, PromptImage, StreamHandle, StreamId, TokenText};
use braid_models::dflash::DFlashDrafter;
use braid_models::{BackendConfig, LayerState, ModelBackend};
use braid_ops::cpu::Cpu;
use braid_ops::{Device, KvDtype};
use serde_json::Value;

/// Chunk caps of the stepped passes; `usize::MAX` is the whole prompt.
pub const CAPS: [usize; 4] = [1, 3, 7, usize::MAX];
/// Tokens fed before decoding one at a time (as `logits_incremental`).
pub const PREFILL: usize = 24;

pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures")
}

/// The prompt `tokens` with each run of `image_token` made an image: its
/// ids named by the image's hash (1000, 1001, … in order) and its pixels
/// the next `per` values of `pixels` (a vision fixture's `pixel_values`).
pub fn image_prompt(tokens: &[u32], image_token: u32, pixels: &[f32], per: usize) -> (Vec<u32>, Vec<PromptImage>) {
    let mut prompt = tokens.to_vec();
    let mut images = Vec::new();
    let mut i = 0;
    while i < prompt.len() {
        if prompt[i] != image_token {
            i += 1;
            continue;
        }
        let len = prompt[i..].iter().take_while(|&&t| t == image_token).count();
        let n = images.len();
        let hash = 1000 + n as u64;
        prompt.splice(i..i + len, image_token_ids(hash, len));
        images.push(PromptImage { start: i, len, hash, pixels: pixels[n * per..(n + 1) * per].into() });
        i += len;
    }
    (prompt, images)
}

/// A tensor of `reference.safetensors`, decoded to f32 (I64 ids included).
#[derive(Clone, Debug)]
pub struct RefTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Read every tensor of a safetensors file (F32 and I64 only; enough for the references).
pub fn read_safetensors(path: &Path) -> HashMap<String, RefTensor> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap_or_else(|e| panic!("{}: bad header: {e}", path.display()));
    let data = &bytes[8 + n..];
    let mut out = HashMap::new();
    for (name, e) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        let shape: Vec<usize> = e["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        let off: Vec<usize> = e["data_offsets"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        let raw = &data[off[0]..off[1]];
        let vals: Vec<f32> = match e["dtype"].as_str().unwrap() {
            "F32" => raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
            "I64" => raw.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f32).collect(),
            d => panic!("{}: tensor {name} has dtype {d}, the harness reads F32 and I64", path.display()),
        };
        out.insert(name.clone(), RefTensor { shape, data: vals });
    }
    out
}

/// Where two logit tables differ most.
#[derive(Clone, Copy, Debug)]
pub struct Diff {
    pub max: f32,
    pub row: usize,
    pub col: usize,
}

pub fn diff(got: &[f32], want: &[f32], cols: usize) -> Diff {
    assert_eq!(got.len(), want.len(), "logit tables of different sizes");
    let mut d = Diff { max: 0.0, row: 0, col: 0 };
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let x = (a - b).abs();
        // NaN must fail: it counts as an infinite difference.
        let x = if x.is_nan() { f32::INFINITY } else { x };
        if x > d.max {
            d = Diff { max: x, row: i / cols, col: i % cols };
        }
    }
    d
}

pub fn assert_close(what: &str, got: &[f32], want: &[f32], cols: usize, tol: f32) -> Diff {
    let d = diff(got, want, cols);
    eprintln!("{what}: max |diff| {:.3e} (row {}, col {})", d.max, d.row, d.col);
    assert!(
        d.max <= tol,
        "{what}: max |diff| {:.3e} at row {} col {} (got {}, want {}) over {tol:.1e}",
        d.max,
        d.row,
        d.col,
        got[d.row * cols + d.col],
        want[d.row * cols + d.col]
    );
    d
}

pub fn assert_bit_identical(what: &str, got: &[f32], want: &[f32], cols: usize) {
    assert_eq!(got.len(), want.len(), "{what}: sizes differ");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits()) {
        panic!(
            "{what}: not bit-identical: first at row {} col {} ({} vs {}), max |diff| {:.3e}",
            i / cols,
            i % cols,
            got[i],
            want[i],
            diff(got, want, cols).max
        );
    }
}

/// The backend settings the checks use: an f32 KV pool (f16 k/v alone
/// would move these logits by ~1e-3), small blocks (so passes cross many
/// block boundaries and marks share partial blocks), room for a few streams.
pub fn backend_config() -> BackendConfig {
    BackendConfig { block_tokens: 4, kv_tokens: 4096, max_streams: 8, max_batch: 512, context: 0, max_marks: 8, kv_dtype: KvDtype::F32, window_kv: true }
}

/// One fixture: the model folder, its transformers reference and meta.json.
pub struct Fixture {
    pub name: String,
    pub dir: PathBuf,
    pub meta: Value,
    pub config: Value,
    pub reference: HashMap<String, RefTensor>,
    pub tokens: Vec<u32>,
    pub vocab: usize,
}

impl Fixture {
    pub fn load(name: &str) -> Fixture {
        let dir = fixtures_dir().join(name);
        let json = |f: &str| -> Value {
            let p = dir.join(f);
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
        };
        let (meta, config) = (json("meta.json"), json("config.json"));
        let reference = read_safetensors(&dir.join("reference.safetensors"));
        let tokens: Vec<u32> = reference["tokens"].data.iter().map(|&t| t as u32).collect();
        let vocab = reference["logits_full"].shape[1];
        Fixture { name: name.to_string(), dir, meta, config, reference, tokens, vocab }
    }

    /// A reference logit table (`logits_full`, `logits_incremental`, ...).
    pub fn logits(&self, key: &str) -> &[f32] {
        &self.reference.get(key).unwrap_or_else(|| panic!("{}: reference has no {key}", self.name)).data
    }

    /// A fresh backend over the fixture's model on the CPU.
    pub fn backend(&self) -> ModelBackend<Cpu> {
        self.backend_with(backend_config())
    }

    pub fn backend_with(&self, cfg: BackendConfig) -> ModelBackend<Cpu> {
        let dev = Cpu::new(None);
        let (_src, model) = braid_models::open(&dev, &self.dir).unwrap_or_else(|e| panic!("{}: load failed: {e:#}", self.name));
        assert_eq!(model.vocab(), self.vocab, "{}: vocab", self.name);
        ModelBackend::new(dev, model, cfg).unwrap()
    }

    /// The per-layer state kinds meta.json declares.
    pub fn expected_states(&self) -> Vec<LayerState> {
        self.meta["state_per_layer"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| match s["kind"].as_str().unwrap() {
                "kv" => match s.get("window").and_then(Value::as_u64) {
                    Some(w) => LayerState::SlidingKv { window: w as usize },
                    None => LayerState::Kv,
                },
                "conv" => LayerState::Conv,
                "mamba2" | "ssm" => LayerState::Ssm,
                "linear_attention" => LayerState::LinearAttention,
                "gated_deltanet" => LayerState::DeltaNet,
                "none" => LayerState::None,
                k => panic!("{}: unknown state kind {k} in meta.json", self.name),
            })
            .collect()
    }

    pub fn check_states(&self) {
        let be = self.backend();
        assert_eq!(be.model().layer_states(), self.expected_states(), "{}: layer_states() against meta.json", self.name);
    }

    /// The whole sequence as one prefill, logits for every row, against `logits_full`.
    pub fn check_full(&self, tol: f32) -> Vec<f32> {
        let mut be = self.backend();
        let got = stepped(&mut be, 1, &self.tokens, usize::MAX);
        assert_close(&format!("{} full", self.name), &got, self.logits("logits_full"), self.vocab, tol);
        got
    }

    /// Prefill 24, then one token per decode round, against `logits_incremental`.
    pub fn check_incremental(&self, tol: f32) {
        let mut be = self.backend();
        let got = incremental(&mut be, 1, &self.tokens, PREFILL);
        assert_close(&format!("{} incremental", self.name), &got, self.logits("logits_incremental"), self.vocab, tol);
    }

    /// Chunk caps 1, 3, 7 and whole: the same logits at every position
    /// (bit-identical where the model declares chunk invariance, else within
    /// `tol`), each within `tol` of `logits_full`; and `prefill_step` gives
    /// the last row of the whole pass.
    pub fn check_stepped(&self, tol: f32) {
        let mut be = self.backend();
        let invariant = be.model().chunk_invariant();
        let whole = stepped(&mut be, 1, &self.tokens, usize::MAX);
        for (i, &cap) in CAPS.iter().enumerate() {
            let id = 10 + i as StreamId;
            let got = stepped(&mut be, id, &self.tokens, cap);
            let what = if cap == usize::MAX { format!("{} whole", self.name) } else { format!("{} chunk cap {cap}", self.name) };
            if invariant {
                assert_bit_identical(&what, &got, &whole, self.vocab);
            } else {
                assert_close(&what, &got, &whole, self.vocab, tol);
            }
            assert_close(&format!("{what} vs logits_full"), &got, self.logits("logits_full"), self.vocab, tol);
            be.forget(id);
        }
        // prefill_step (what the engine calls) returns the same last row.
        be.open(99).unwrap();
        let mut start = 0;
        let mut last = None;
        for c in self.tokens.chunks(7) {
            let want_logits = start + c.len() == self.tokens.len();
            last = be.prefill_step(99, Chunk { start, tokens: c, want_logits }).unwrap();
            start += c.len();
        }
        let last = last.expect("prefill_step returned no logits for the last chunk");
        let n = self.tokens.len();
        let want = &whole[(n - 1) * self.vocab..];
        if invariant {
            assert_bit_identical(&format!("{} prefill_step", self.name), &last, want, self.vocab);
        } else {
            assert_close(&format!("{} prefill_step", self.name), &last, want, self.vocab, tol);
        }
    }

    /// Keep marks mid-prompt (inside a block and on a block boundary),
    /// restore each into a fresh stream, and continue: the continuation's
    /// logits match the uninterrupted pass. The marked stream itself goes
    /// on undisturbed.
    pub fn check_marks(&self, tol: f32) {
        let mut be = self.backend();
        let invariant = be.model().chunk_invariant();
        let n = self.tokens.len();
        let whole = stepped(&mut be, 1, &self.tokens, usize::MAX);
        let bt = backend_config().block_tokens;
        for (i, &m) in [13usize, 4 * bt].iter().enumerate() {
            let a = 20 + 2 * i as StreamId;
            let b = a + 1;
            be.open(a).unwrap();
            let head = run_rows(&mut be, a, &self.tokens[..m]);
            let mark = be.keep_mark(a).unwrap();
            let rest_a = run_rows(&mut be, a, &self.tokens[m..]);
            be.open(b).unwrap();
            assert_eq!(be.restore_mark(b, mark).unwrap(), m);
            // Drop the mark and the original stream first: the restored
            // stream must not depend on either.
            be.drop_mark(mark);
            be.forget(a);
            let rest_b = run_rows(&mut be, b, &self.tokens[m..]);
            be.forget(b);
            let got_a: Vec<f32> = head.iter().chain(&rest_a).cloned().collect();
            let got_b: Vec<f32> = head.iter().chain(&rest_b).cloned().collect();
            let (wa, wb) = (format!("{} marked stream (mark at {m})", self.name), format!("{} restored stream (mark at {m})", self.name));
            if invariant {
                assert_bit_identical(&wa, &got_a, &whole, self.vocab);
                assert_bit_identical(&wb, &got_b, &whole, self.vocab);
            } else {
                assert_close(&wa, &got_a, &whole, self.vocab, tol);
                assert_close(&wb, &got_b, &whole, self.vocab, tol);
            }
        }
        assert_eq!(be.fill().blocks_used, n.div_ceil(bt), "{}: blocks leaked by marks", self.name);
    }

    /// Several streams with different prompts of different lengths through
    /// one backend: prefill each (interleaved, in chunks), then decode rounds
    /// holding one row of every stream (one round also carries a several-row
    /// chunk of one stream). Each stream's logits must be bit-identical to
    /// the same stream run alone in a fresh backend.
    pub fn check_multi_stream(&self) {
        let n = self.tokens.len();
        // Different prompts: rotations and a reversal of the fixture's tokens.
        let prompts: Vec<Vec<u32>> = vec![
            self.tokens[..9].to_vec(),
            self.tokens.iter().rev().take(17).cloned().collect(),
            self.tokens.iter().cycle().skip(11).take(23).cloned().collect(),
            self.tokens.iter().cycle().skip(30).take(5).cloned().collect(),
        ];
        // Decode tokens of each stream (fixed, as if sampled), rounds of one
        // row; in round 2 stream 0 carries four rows (a drafter's block).
        let rounds = 6;
        let feed = |s: usize, r: usize| -> Vec<u32> {
            let k = if s == 0 && r == 2 { 4 } else { 1 };
            (0..k).map(|j| self.tokens[(7 * s + 5 * r + j) % n]).collect()
        };
        // Together.
        let mut be = self.backend();
        for s in 0..prompts.len() {
            be.open(s as StreamId).unwrap();
        }
        let mut together: Vec<Vec<f32>> = vec![Vec::new(); prompts.len()];
        let longest = prompts.iter().map(Vec::len).max().unwrap();
        // Interleave prefill chunks of 5 across streams.
        for c in (0..longest).step_by(5) {
            for (s, p) in prompts.iter().enumerate() {
                if c < p.len() {
                    let end = (c + 5).min(p.len());
                    together[s].extend(run_rows(&mut be, s as StreamId, &p[c..end]));
                }
            }
        }
        for r in 0..rounds {
            let rows: Vec<DecodeRow> = (0..prompts.len()).map(|s| DecodeRow { stream: s as StreamId, tokens: feed(s, r) }).collect();
            let logits = be.decode_logits(&rows).unwrap();
            let mut at = 0;
            for (s, row) in rows.iter().enumerate() {
                let k = row.tokens.len() * self.vocab;
                together[s].extend_from_slice(&logits[at..at + k]);
                at += k;
            }
        }
        // Alone.
        for (s, p) in prompts.iter().enumerate() {
            let mut be = self.backend();
            be.open(0).unwrap();
            let mut alone = Vec::new();
            for c in p.chunks(5) {
                alone.extend(run_rows(&mut be, 0, c));
            }
            for r in 0..rounds {
                alone.extend(run_rows(&mut be, 0, &feed(s, r)));
            }
            assert_bit_identical(&format!("{} stream {s} batched vs alone", self.name), &together[s], &alone, self.vocab);
        }
    }
}

/// Feed `tokens` to an open stream as one decode round of its rows; the
/// logits of every row.
pub fn run_rows(be: &mut ModelBackend<Cpu>, stream: StreamId, tokens: &[u32]) -> Vec<f32> {
    be.decode_logits(&[DecodeRow { stream, tokens: tokens.to_vec() }]).unwrap()
}

/// Open `stream` and feed `tokens` in chunks of at most `cap`; every row's logits.
pub fn stepped(be: &mut ModelBackend<Cpu>, stream: StreamId, tokens: &[u32], cap: usize) -> Vec<f32> {
    be.open(stream).unwrap();
    let mut out = Vec::new();
    for c in tokens.chunks(cap.min(tokens.len()).max(1)) {
        out.extend(run_rows(be, stream, c));
    }
    out
}

/// Open `stream`, prefill `prefill` tokens at once, then one token per round.
pub fn incremental(be: &mut ModelBackend<Cpu>, stream: StreamId, tokens: &[u32], prefill: usize) -> Vec<f32> {
    be.open(stream).unwrap();
    let mut out = run_rows(be, stream, &tokens[..prefill]);
    for t in &tokens[prefill..] {
        out.extend(run_rows(be, stream, std::slice::from_ref(t)));
    }
    out
}

/// Every family that has a fixture, for the tests that run them all.
pub const FAMILIES: [&str; 14] = [
    "llama",
    "qwen2",
    "qwen2_tied",
    "qwen3",
    "gemma3_text",
    "gemma4_text",
    "gemma4_text_moe",
    "lfm2",
    "lfm2_moe",
    "nemotron_h",
    "minimax",
    "minimax_m2",
    "minimax_m3_vl_text",
    "qwen3_next",
];

/// The fixtures have no tokenizer; stop strings are not exercised through a lane.
pub struct NoText;

impl TokenText for NoText {
    fn token_bytes(&self, _id: u32) -> Vec<u8> {
        Vec::new()
    }
}

/// The tokens a lane's stream sends, panicking on an error event.
pub fn tokens(h: StreamHandle) -> Vec<u32> {
    h.filter_map(|e| match e {
        Event::Token { id, .. } => Some(id),
        Event::Error(e) => panic!("{e}"),
        _ => None,
    })
    .collect()
}

/// What the lane handed a drafter: each absorb's stream, tokens and features.
pub type Absorbs = Arc<Mutex<Vec<(StreamId, Vec<u32>, Vec<f32>)>>>;

/// A proposal's stream, tokens and block logits.
pub type Proposal = (StreamId, Vec<u32>, Vec<f32>);
pub type Proposals = Arc<Mutex<Vec<Proposal>>>;

/// A DFlash or DSpark drafter recording what it absorbs and proposes; a
/// failed proposal fails the test.
pub struct Recording<D: Device> {
    pub inner: DFlashDrafter<D>,
    pub absorbs: Absorbs,
    pub proposals: Proposals,
}

impl<D: Device> Drafter for Recording<D> {
    fn open(&mut self, stream: StreamId, prefix: &[u32]) {
        self.inner.open(stream, prefix)
    }
    fn absorb(&mut self, stream: StreamId, tokens: &[u32], features: &[f32]) {
        self.absorbs.lock().unwrap().push((stream, tokens.to_vec(), features.to_vec()));
        self.inner.absorb(stream, tokens, features)
    }
    fn propose(&mut self, stream: StreamId, last: u32) -> Vec<u32> {
        let p = self.inner.propose(stream, last);
        assert_eq!(self.inner.last_error, None, "the drafter failed");
        if !p.is_empty() {
            self.proposals.lock().unwrap().push((stream, p.clone(), self.inner.last_logits.clone()));
        }
        p
    }
    fn forget(&mut self, stream: StreamId) {
        self.inner.forget(stream)
    }
    fn cap(&mut self, stream: StreamId, max: usize) {
        self.inner.cap(stream, max)
    }
    fn may_propose(&self, stream: StreamId) -> bool {
        self.inner.may_propose(stream)
    }
    fn pace(&mut self, drafting: bool) {
        self.inner.pace(drafting)
    }
}
