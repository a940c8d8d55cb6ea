//! The GPU benchmark behind `braid bench --device cuda`: the device's two
//! ceilings (copy bandwidth, bf16 GEMM rate), then decode rounds at several
//! stream counts and one long prefill of a model, with the ratios to those
//! ceilings. Everything runs through `ModelBackend`'s `round`, the call the
//! lane makes (one batched forward per round, every stream its own length,
//! paged KV, greedy picks on the device), so the figures are the serving
//! path's.

use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use braid_engine::{Backend, Chunk, DecodeRow, Pick, Picked, Step};
use braid_ops::cuda::Cuda;
use braid_ops::Device;

use crate::llama::LlamaConfig;
use crate::{BackendConfig, Model, ModelBackend};

#[derive(Clone, Debug)]
pub struct GpuBenchOpts {
    /// Stream counts of the decode runs.
    pub streams: Vec<usize>,
    /// Prompt tokens each stream holds before decoding.
    pub prompt: usize,
    /// Timed decode rounds (after `warmup` untimed ones).
    pub rounds: usize,
    pub warmup: usize,
    /// Tokens of the prefill run (one chunk).
    pub prefill: usize,
    /// Run decode rounds as CUDA graphs (and also eagerly, for comparison, when `compare_eager`).
    pub graphs: bool,
    pub compare_eager: bool,
    /// Measure the copy bandwidth and GEMM rate first.
    pub ceilings: bool,
}

impl Default for GpuBenchOpts {
    fn default() -> Self {
        GpuBenchOpts { streams: vec![1, 8, 32, 64], prompt: 128, rounds: 64, warmup: 8, prefill: 2048, graphs: true, compare_eager: true, ceilings: true }
    }
}

#[derive(Clone, Debug, Default)]
pub struct DecodeRun {
    pub streams: usize,
    pub graphs: bool,
    pub tok_s: f64,
    pub ms_per_round: f64,
    /// Weights + KV read per round over the measured copy bandwidth, as tokens/s.
    pub hbm_bound_tok_s: f64,
}

#[derive(Clone, Debug, Default)]
pub struct GpuBenchReport {
    pub device: String,
    pub copy_gb_s: f64,
    pub gemm_tflops: f64,
    pub weight_bytes: f64,
    pub decode: Vec<DecodeRun>,
    pub prefill_tokens: usize,
    pub prefill_tok_s: f64,
    pub prefill_tflops: f64,
}

impl GpuBenchReport {
    /// A Markdown table of the results and the targets' ratios.
    pub fn table(&self) -> String {
        let mut s = String::new();
        s += &format!("device: {}\n\n", self.device);
        if self.copy_gb_s > 0.0 {
            s += &format!(
                "| ceiling | value |\n| --- | --- |\n| copy bandwidth (read + write) | {:.0} GB/s |\n| bf16 GEMM 8192³ | {:.0} TFLOP/s |\n\n",
                self.copy_gb_s, self.gemm_tflops
            );
        }
        s += &format!("weights read per round: {:.3} GB\n\n", self.weight_bytes / 1e9);
        s += "| streams | graphs | tokens/s | ms/round | HBM bound tok/s | of bound |\n| --- | --- | --- | --- | --- | --- |\n";
        for d in &self.decode {
            s += &format!(
                "| {} | {} | {:.0} | {:.3} | {:.0} | {:.0}% |\n",
                d.streams,
                if d.graphs { "yes" } else { "no" },
                d.tok_s,
                d.ms_per_round,
                d.hbm_bound_tok_s,
                100.0 * d.tok_s / d.hbm_bound_tok_s.max(1e-9)
            );
        }
        if self.prefill_tokens > 0 {
            s += &format!(
                "\nprefill {} tokens: {:.0} tokens/s, {:.0} TFLOP/s ({:.0}% of the measured GEMM rate)\n",
                self.prefill_tokens,
                self.prefill_tok_s,
                self.prefill_tflops,
                100.0 * self.prefill_tflops / self.gemm_tflops.max(1e-9)
            );
        }
        s
    }

    /// The numbers as JSON (for scripts/gpu/compare.py).
    pub fn json(&self) -> String {
        let dec: Vec<String> = self
            .decode
            .iter()
            .map(|d| {
                format!(
                    "{{\"streams\":{},\"graphs\":{},\"tok_s\":{:.1},\"ms_per_round\":{:.4},\"hbm_bound_tok_s\":{:.1}}}",
                    d.streams, d.graphs, d.tok_s, d.ms_per_round, d.hbm_bound_tok_s
                )
            })
            .collect();
        format!(
            "{{\"device\":{:?},\"copy_gb_s\":{:.1},\"gemm_tflops\":{:.1},\"weight_bytes\":{:.0},\"decode\":[{}],\"prefill_tokens\":{},\"prefill_tok_s\":{:.1},\"prefill_tflops\":{:.1}}}",
            self.device,
            self.copy_gb_s,
            self.gemm_tflops,
            self.weight_bytes,
            dec.join(","),
            self.prefill_tokens,
            self.prefill_tok_s,
            self.prefill_tflops
        )
    }
}

/// Linear-layer weights of a Llama-shaped model in elements: per layer, and the head.
fn llama_params(c: &LlamaConfig) -> (f64, f64) {
    let (h, q, kv, f) = (c.hidden as f64, (c.heads * c.head_dim) as f64, (c.kv_heads * c.head_dim) as f64, c.ffn as f64);
    let layer = h * q + 2.0 * h * kv + q * h + 3.0 * h * f;
    (layer * c.layers as f64, c.vocab as f64 * h)
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as u32
    }
}

/// The backend the benchmark drives: the model behind the same round call
/// the lane makes, with room for `streams` streams of `tokens` each.
pub fn backend(dev: &Cuda, model: Box<dyn Model<Cuda>>, streams: usize, tokens: usize) -> Result<ModelBackend<Cuda>> {
    let cfg = BackendConfig { kv_tokens: streams * (tokens + 32), max_streams: streams.max(1), max_batch: 4096.max(streams), ..BackendConfig::default() };
    ModelBackend::new(dev.clone(), model, cfg)
}

/// Stream ids the benchmark opens (any would do; the lane's start at 1).
const FIRST_ID: u64 = 1 << 40;

/// Open `streams` streams and run each one's random prompt of `prompt`
/// tokens (one chunk each); returns each one's first greedy token.
fn prompts(be: &mut ModelBackend<Cuda>, streams: usize, prompt: usize) -> Result<Vec<u32>> {
    let vocab = be.capabilities().vocab_size;
    let mut rng = Rng(0x9e3779b97f4a7c15 ^ streams as u64);
    let mut last = Vec::with_capacity(streams);
    for i in 0..streams {
        let id = FIRST_ID + i as u64;
        be.open(id)?;
        let toks: Vec<u32> = (0..prompt).map(|_| rng.below(vocab)).collect();
        let logits = be.prefill_step(id, Chunk { start: 0, tokens: &toks, want_logits: true })?.context("no logits for the prompt's last row")?;
        last.push(braid_ops::argmax_host(&logits));
    }
    Ok(last)
}

/// Decode `rounds` greedy rounds (after `warmup`) of `streams` streams that
/// each hold `prompt` tokens first, through `Backend::round`; returns
/// tokens/s and each round's tokens.
pub fn decode_run(be: &mut ModelBackend<Cuda>, streams: usize, prompt: usize, warmup: usize, rounds: usize, graphs: bool) -> Result<(f64, Vec<Vec<u32>>)> {
    decode_inner(be, streams, prompt, warmup, rounds, graphs, None)
}

/// GPU time per kernel of `rounds` eager decode rounds of `streams` streams.
pub fn decode_profile(be: &mut ModelBackend<Cuda>, streams: usize, prompt: usize, rounds: usize) -> Result<String> {
    let mut rep = String::new();
    decode_inner(be, streams, prompt, 2, rounds, false, Some(&mut rep))?;
    Ok(rep)
}

fn decode_inner(
    be: &mut ModelBackend<Cuda>,
    streams: usize,
    prompt: usize,
    warmup: usize,
    rounds: usize,
    graphs: bool,
    profile: Option<&mut String>,
) -> Result<(f64, Vec<Vec<u32>>)> {
    ensure!(streams > 0 && prompt > 0, "decode_run: streams and prompt must be positive");
    let dev = be.device().clone();
    let mut last = prompts(be, streams, prompt)?;
    dev.set_graphs(graphs);
    let mut out = Vec::with_capacity(rounds);
    let mut t0 = Instant::now();
    for r in 0..warmup + rounds {
        if r == warmup {
            dev.sync()?;
            if profile.is_some() {
                dev.profile_start();
            }
            t0 = Instant::now();
        }
        let rows: Vec<DecodeRow> = last.iter().enumerate().map(|(i, &t)| DecodeRow { stream: FIRST_ID + i as u64, tokens: vec![t] }).collect();
        match be.round(Step::new(&rows, None, Pick::Argmax))?.picked {
            Picked::Tokens(t) => last = t,
            other => bail!("an argmax round returned {other:?}"),
        }
        if r >= warmup {
            out.push(last.clone());
        }
    }
    let t = t0.elapsed().as_secs_f64();
    dev.set_graphs(true);
    for i in 0..streams {
        be.forget(FIRST_ID + i as u64);
    }
    if let Some(p) = profile {
        *p = dev.profile_report()?;
    }
    Ok(((streams * rounds) as f64 / t, out))
}

/// One prompt chunk of `tokens` tokens (logits for the last row only)
/// through `Backend::prefill_step`; returns the median seconds of three
/// after one warm-up.
pub fn prefill_run(be: &mut ModelBackend<Cuda>, tokens: usize) -> Result<f64> {
    prefill_inner(be, tokens, None)
}

/// GPU time per kernel of one prompt chunk of `tokens` tokens.
pub fn prefill_profile(be: &mut ModelBackend<Cuda>, tokens: usize) -> Result<String> {
    let mut rep = String::new();
    prefill_inner(be, tokens, Some(&mut rep))?;
    Ok(rep)
}

fn prefill_inner(be: &mut ModelBackend<Cuda>, tokens: usize, profile: Option<&mut String>) -> Result<f64> {
    let dev = be.device().clone();
    let mut rng = Rng(7);
    let vocab = be.capabilities().vocab_size;
    let toks: Vec<u32> = (0..tokens).map(|_| rng.below(vocab)).collect();
    let mut times = Vec::new();
    let profiling = profile.is_some();
    for i in 0..4 {
        be.open(FIRST_ID)?;
        dev.sync()?;
        if i == 3 && profiling {
            dev.profile_start();
        }
        let t = Instant::now();
        be.prefill_step(FIRST_ID, Chunk { start: 0, tokens: &toks, want_logits: true })?;
        times.push(t.elapsed().as_secs_f64());
        be.forget(FIRST_ID);
    }
    if let Some(p) = profile {
        *p = dev.profile_report()?;
    }
    let mut timed = times[1..].to_vec();
    timed.sort_by(f64::total_cmp);
    Ok(timed[timed.len() / 2])
}

/// The whole benchmark for a Llama-shaped model, through `ModelBackend`.
pub fn bench_llama(be: &mut ModelBackend<Cuda>, cfg: &LlamaConfig, o: &GpuBenchOpts, log: &mut dyn FnMut(&str)) -> Result<GpuBenchReport> {
    let dev = be.device().clone();
    let mut rep = GpuBenchReport { device: dev.name(), ..Default::default() };
    if o.ceilings {
        rep.copy_gb_s = dev.bench_copy(1 << 31, 20)?;
        log(&format!("copy bandwidth {:.0} GB/s", rep.copy_gb_s));
        rep.gemm_tflops = dev.bench_gemm(8192, 20)?;
        log(&format!("bf16 GEMM 8192^3 {:.0} TFLOP/s", rep.gemm_tflops));
    }
    let (layer_params, head_params) = llama_params(cfg);
    rep.weight_bytes = 2.0 * (layer_params + head_params);
    let kv_row_bytes = (cfg.layers * 2 * cfg.kv_heads * cfg.head_dim * 2) as f64;
    for &n in &o.streams {
        let modes: Vec<bool> = if o.graphs && o.compare_eager { vec![false, true] } else { vec![o.graphs] };
        for g in modes {
            let (tok_s, _) = decode_run(be, n, o.prompt, o.warmup, o.rounds, g)?;
            // Average context over the timed rounds.
            let ctx = (o.prompt + o.warmup) as f64 + o.rounds as f64 / 2.0;
            let bytes = rep.weight_bytes + n as f64 * ctx * kv_row_bytes;
            let bound = if rep.copy_gb_s > 0.0 { n as f64 * rep.copy_gb_s * 1e9 / bytes } else { 0.0 };
            let run = DecodeRun { streams: n, graphs: g, tok_s, ms_per_round: 1e3 * n as f64 / tok_s, hbm_bound_tok_s: bound };
            log(&format!("decode {n} streams (graphs {g}): {tok_s:.0} tok/s, {:.3} ms/round, bound {bound:.0} tok/s", run.ms_per_round));
            rep.decode.push(run);
        }
    }
    if o.prefill > 0 {
        let secs = prefill_run(be, o.prefill)?;
        let t = o.prefill as f64;
        let attn = cfg.layers as f64 * 2.0 * t * t * (cfg.heads * cfg.head_dim) as f64;
        let flops = 2.0 * layer_params * t + 2.0 * head_params + attn;
        rep.prefill_tokens = o.prefill;
        rep.prefill_tok_s = t / secs;
        rep.prefill_tflops = flops / secs / 1e12;
        log(&format!("prefill {} tokens: {:.2} ms, {:.0} tok/s, {:.0} TFLOP/s", o.prefill, secs * 1e3, rep.prefill_tok_s, rep.prefill_tflops));
    }
    let (replays, captures) = dev.graph_stats();
    let (ahead, launched) = dev.ahead_hits();
    log(&format!("graphs: {replays} replays, {captures} captures; rounds prepared ahead {ahead}, of which launched ahead {launched}"));
    Ok(rep)
}

/// What a round costs with a prompt chunk beside decode rows (the stall's
/// arithmetic): `streams` streams decoding at `ctx` tokens each, and a
/// prompt chunk (mid-prompt: no logits) of each of `chunks` rows starting at `start` in a stream
/// of its own (its first `start` rows run first, untimed). Returns (rows,
/// median milliseconds) per chunk size over `rounds` rounds (0 rows: the
/// decode rows alone), and with `profile` the GPU time per kernel of the
/// last size's rounds. The first round of each size (its recording, where
/// it is keyed) is not counted.
pub fn mixed_run(
    be: &mut ModelBackend<Cuda>,
    streams: usize,
    ctx: usize,
    start: usize,
    chunks: &[usize],
    rounds: usize,
    mut profile: Option<&mut String>,
) -> Result<Vec<(usize, f64)>> {
    ensure!(streams > 0 && ctx > 0 && rounds > 0, "mixed_run: streams, ctx and rounds must be positive");
    let dev = be.device().clone();
    let mut last = prompts(be, streams, ctx)?;
    let vocab = be.capabilities().vocab_size;
    let mut rng = Rng(0x51ab);
    let newcomer = FIRST_ID + streams as u64;
    let mut out = Vec::new();
    for (ci, &c) in chunks.iter().enumerate() {
        let profiling = profile.is_some() && ci + 1 == chunks.len();
        let mut times = Vec::new();
        for r in 0..rounds + 1 {
            let toks: Vec<u32> = (0..start + c).map(|_| rng.below(vocab)).collect();
            be.open(newcomer)?;
            if start > 0 {
                be.prefill_step(newcomer, Chunk { start: 0, tokens: &toks[..start], want_logits: false })?;
            }
            dev.sync()?;
            // Only the measured rounds, not the newcomer's prefill before each.
            if profiling && r >= 1 {
                dev.profile_start();
            }
            let rows: Vec<DecodeRow> = last.iter().enumerate().map(|(i, &t)| DecodeRow { stream: FIRST_ID + i as u64, tokens: vec![t] }).collect();
            // A chunk mid-prompt, as most of a pass's are: no logits.
            let chunk = (c > 0).then(|| (newcomer, Chunk { start, tokens: &toks[start..], want_logits: false }));
            let t = Instant::now();
            match be.round(Step::new(&rows, chunk, Pick::Argmax))?.picked {
                Picked::Tokens(t) => last = t,
                other => bail!("an argmax round returned {other:?}"),
            }
            dev.sync()?;
            if r > 0 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            if profiling {
                dev.profile_pause();
            }
            be.forget(newcomer);
        }
        times.sort_by(f64::total_cmp);
        out.push((c, times[times.len() / 2]));
        if profiling {
            if let Some(p) = profile.as_deref_mut() {
                *p = dev.profile_report()?;
            }
        }
    }
    for i in 0..streams {
        be.forget(FIRST_ID + i as u64);
    }
    Ok(out)
}
