//! The GPU benchmark behind `braid bench --device cuda`: the device's two
//! ceilings (copy bandwidth, bf16 GEMM rate), then decode rounds at several
//! stream counts and one long prefill of a model, with the ratios to those
//! ceilings. Decode rounds run the way a lane runs them (one batched forward
//! per round, every stream its own length, paged KV), sampling greedily on
//! the device, as CUDA graphs unless turned off.

use std::time::Instant;

use anyhow::{ensure, Result};
use braid_ops::cuda::Cuda;
use braid_ops::{AttnSeq, Device, KvPoolSpec};

use crate::llama::LlamaConfig;
use crate::{Batch, Memory, Model, Scratch};

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

/// Decode `rounds` rounds of `streams` streams that each hold `prompt`
/// tokens first; returns tokens/s.
pub fn decode_run(dev: &Cuda, model: &dyn Model<Cuda>, streams: usize, prompt: usize, warmup: usize, rounds: usize, graphs: bool) -> Result<f64> {
    decode_inner(dev, model, streams, prompt, warmup, rounds, graphs, None, None)
}

/// GPU time per kernel of `rounds` eager decode rounds of `streams` streams.
pub fn decode_profile(dev: &Cuda, model: &dyn Model<Cuda>, streams: usize, prompt: usize, rounds: usize) -> Result<String> {
    let mut rep = String::new();
    decode_inner(dev, model, streams, prompt, 2, rounds, false, None, Some(&mut rep))?;
    Ok(rep)
}

/// The greedy tokens of each decode round (for checks: graphs against eager).
pub fn decode_tokens(dev: &Cuda, model: &dyn Model<Cuda>, streams: usize, prompt: usize, rounds: usize, graphs: bool) -> Result<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    decode_inner(dev, model, streams, prompt, 0, rounds, graphs, Some(&mut out), None)?;
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn decode_inner(
    dev: &Cuda,
    model: &dyn Model<Cuda>,
    streams: usize,
    prompt: usize,
    warmup: usize,
    rounds: usize,
    graphs: bool,
    mut record: Option<&mut Vec<Vec<u32>>>,
    profile: Option<&mut String>,
) -> Result<f64> {
    ensure!(streams > 0 && prompt > 0, "decode_run: streams and prompt must be positive");
    let bt = 16;
    let per = (prompt + warmup + rounds + 1).div_ceil(bt);
    let spec = KvPoolSpec { blocks: streams * per, block_tokens: bt, layers: model.kv_layers() };
    let mut mem = Memory { kv: dev.kv_pool(&spec)?, state: dev.tensor(streams, model.state_size()) };
    let mut s = Scratch::new(dev);
    let tables: Vec<Vec<u32>> = (0..streams).map(|i| ((i * per) as u32..((i + 1) * per) as u32).collect()).collect();
    let slot = |t: &[u32], p: usize| t[p / bt] * bt as u32 + (p % bt) as u32;
    let vocab = model.vocab();
    let mut rng = Rng(0x9e3779b97f4a7c15 ^ streams as u64);
    let mut last = vec![0u32; streams];
    let mut lens = vec![0usize; streams];
    // Prompts, one stream at a time (the prefill path).
    for i in 0..streams {
        let toks: Vec<u32> = (0..prompt).map(|_| rng.below(vocab)).collect();
        let pos: Vec<u32> = (0..prompt as u32).collect();
        let slots: Vec<u32> = (0..prompt).map(|p| slot(&tables[i], p)).collect();
        let seqs = vec![AttnSeq { q_start: 0, q_len: prompt, kv_len: prompt, blocks: &tables[i], window: None }];
        let batch = Batch { tokens: &toks, positions: &pos, slots: &slots, seqs, logit_rows: &[prompt - 1], state_slots: &[i as u32] };
        model.forward(dev, &batch, &mut mem, &mut s)?;
        last[i] = dev.argmax(&s.logits)?[0];
        lens[i] = prompt;
    }
    dev.set_graphs(graphs);
    let rows: Vec<usize> = (0..streams).collect();
    let state_slots: Vec<u32> = (0..streams as u32).collect();
    let mut t0 = Instant::now();
    // With graphs, host time before the round's launch (batch, graph pass
    // 1, uploads), when the GPU has nothing queued (eager launches overlap
    // the GPU's work instead).
    let mut host = 0f64;
    // The round's host arrays when each stream holds `lens` rows.
    let arrays =
        |lens: &[usize]| -> (Vec<u32>, Vec<u32>) { (lens.iter().map(|&l| l as u32).collect(), (0..streams).map(|i| slot(&tables[i], lens[i])).collect()) };
    let seqs = |lens: &[usize]| -> Vec<AttnSeq> {
        (0..streams).map(|i| AttnSeq { q_start: i, q_len: 1, kv_len: lens[i] + 1, blocks: &tables[i], window: None }).collect()
    };
    for r in 0..warmup + rounds {
        if r == warmup {
            dev.sync()?;
            if profile.is_some() {
                dev.profile_start();
            }
            t0 = Instant::now();
            host = 0.0;
            dev.pass_host_us();
        }
        let th = Instant::now();
        let (pos, slots) = arrays(&lens);
        let batch = Batch { tokens: &last, positions: &pos, slots: &slots, seqs: seqs(&lens), logit_rows: &rows, state_slots: &state_slots };
        dev.graph_keyed(batch.key(), &last, &mut || model.forward(dev, &batch, &mut mem, &mut s))?;
        host += th.elapsed().as_secs_f64();
        // As `ModelBackend` does: the next round's host work while this
        // one runs, this round's tokens standing in for its.
        let lens_next: Vec<usize> = lens.iter().map(|l| l + 1).collect();
        let (pos, slots) = arrays(&lens_next);
        let batch = Batch { tokens: &last, positions: &pos, slots: &slots, seqs: seqs(&lens_next), logit_rows: &rows, state_slots: &state_slots };
        dev.graph_ahead(batch.key(), &last, &mut || model.forward(dev, &batch, &mut mem, &mut s));
        // As `ModelBackend` does for attention-only models: that next
        // round launches at once, fed these tokens on the device.
        let next = dev.argmax_launch_ahead(&s.logits)?;
        if let Some(r) = record.as_deref_mut() {
            r.push(next.clone());
        }
        last.copy_from_slice(&next);
        lens.iter_mut().for_each(|l| *l += 1);
    }
    let t = t0.elapsed().as_secs_f64();
    if graphs && record.is_none() && profile.is_none() {
        let (pass, launch, ahead) = dev.pass_host_us();
        // The round's graph alone, launched back to back (the same tokens
        // again; the next position is free in every stream's blocks): the
        // GPU's share of a round, the rest is the GPU waiting.
        let (pos, slots) = arrays(&lens);
        let batch = Batch { tokens: &last, positions: &pos, slots: &slots, seqs: seqs(&lens), logit_rows: &rows, state_slots: &state_slots };
        dev.graph(&mut || model.forward(dev, &batch, &mut mem, &mut s))?;
        dev.sync()?;
        let tg = Instant::now();
        for _ in 0..16 {
            dev.graph(&mut || model.forward(dev, &batch, &mut mem, &mut s))?;
        }
        dev.sync()?;
        eprintln!(
            "  {streams} streams: host work before each launch {:.1} µs of {:.1} µs a round (graph pass 1 {pass:.1}, launch {launch:.1}; pass 1 ahead {ahead:.1} while the GPU runs); the graph alone {:.1} µs",
            1e6 * host / rounds as f64,
            1e6 * t / rounds as f64,
            1e6 * tg.elapsed().as_secs_f64() / 16.0
        );
    }
    dev.set_graphs(true);
    if let Some(p) = profile {
        *p = dev.profile_report()?;
    }
    Ok((streams * rounds) as f64 / t)
}

/// One prefill forward of `tokens` tokens (logits for the last row only);
/// returns the median seconds of three after one warm-up.
pub fn prefill_run(dev: &Cuda, model: &dyn Model<Cuda>, tokens: usize) -> Result<f64> {
    prefill_inner(dev, model, tokens, None)
}

/// GPU time per kernel of one prefill forward of `tokens` tokens.
pub fn prefill_profile(dev: &Cuda, model: &dyn Model<Cuda>, tokens: usize) -> Result<String> {
    let mut rep = String::new();
    prefill_inner(dev, model, tokens, Some(&mut rep))?;
    Ok(rep)
}

fn prefill_inner(dev: &Cuda, model: &dyn Model<Cuda>, tokens: usize, profile: Option<&mut String>) -> Result<f64> {
    let bt = 16;
    let blocks = tokens.div_ceil(bt);
    let spec = KvPoolSpec { blocks, block_tokens: bt, layers: model.kv_layers() };
    let mut mem = Memory { kv: dev.kv_pool(&spec)?, state: dev.tensor(1, model.state_size()) };
    let mut s = Scratch::new(dev);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut rng = Rng(7);
    let toks: Vec<u32> = (0..tokens).map(|_| rng.below(model.vocab())).collect();
    let pos: Vec<u32> = (0..tokens as u32).collect();
    let slots: Vec<u32> = (0..tokens as u32).collect();
    let mut times = Vec::new();
    for i in 0..4 {
        let seqs = vec![AttnSeq { q_start: 0, q_len: tokens, kv_len: tokens, blocks: &table, window: None }];
        let batch = Batch { tokens: &toks, positions: &pos, slots: &slots, seqs, logit_rows: &[tokens - 1], state_slots: &[0] };
        dev.sync()?;
        if i == 3 && profile.is_some() {
            dev.profile_start();
        }
        let t = Instant::now();
        model.forward(dev, &batch, &mut mem, &mut s)?;
        dev.sync()?;
        times.push(t.elapsed().as_secs_f64());
    }
    if let Some(p) = profile {
        *p = dev.profile_report()?;
    }
    let mut timed = times[1..].to_vec();
    timed.sort_by(f64::total_cmp);
    Ok(timed[timed.len() / 2])
}

/// The whole benchmark for a Llama-shaped model.
pub fn bench_llama(dev: &Cuda, cfg: &LlamaConfig, model: &dyn Model<Cuda>, o: &GpuBenchOpts, log: &mut dyn FnMut(&str)) -> Result<GpuBenchReport> {
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
            let tok_s = decode_run(dev, model, n, o.prompt, o.warmup, o.rounds, g)?;
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
        let secs = prefill_run(dev, model, o.prefill)?;
        let t = o.prefill as f64;
        let attn = cfg.layers as f64 * 2.0 * t * t * (cfg.heads * cfg.head_dim) as f64;
        let flops = 2.0 * layer_params * t + 2.0 * head_params + attn;
        rep.prefill_tokens = o.prefill;
        rep.prefill_tok_s = t / secs;
        rep.prefill_tflops = flops / secs / 1e12;
        log(&format!("prefill {} tokens: {:.2} ms, {:.0} tok/s, {:.0} TFLOP/s", o.prefill, secs * 1e3, rep.prefill_tok_s, rep.prefill_tflops));
    }
    let (h, c, f) = dev.graph_stats();
    log(&format!("graphs: {h} replays, {c} captures, {f} eager fallbacks"));
    Ok(rep)
}

/// The few-row products of one Llama-3.2-1B layer and its head, each timed
/// alone (back-to-back launches over copies of the weight that together
/// overflow L2), then one layer's four in sequence: where the decode
/// round's GEMV time goes. Rows of x: `rows`.
pub fn gemv_micro(dev: &Cuda, rows: usize) -> Result<String> {
    use braid_ops::GateAct;
    let copies = |bytes: usize| (256usize << 20).div_ceil(bytes).max(2);
    let x_of = |k: usize| dev.upload(&vec![0.5f32; rows * k], rows, k);
    // 24 calls per CUDA graph (as a decode round runs), the graph replayed.
    let time = |f: &mut dyn FnMut(usize)| -> Result<f64> {
        let per = 24;
        let mut run = || {
            dev.graph(&mut || {
                for i in 0..per {
                    f(i);
                }
                Ok(())
            })
        };
        run()?;
        run()?;
        dev.sync()?;
        let t = Instant::now();
        let n = 20;
        for _ in 0..n {
            run()?;
        }
        dev.sync()?;
        Ok(t.elapsed().as_secs_f64() * 1e6 / (n * per) as f64)
    };
    let mut rep = String::from("| product | bytes | µs | GB/s |\n| --- | ---: | ---: | ---: |\n");
    let mut line =
        |name: &str, bytes: usize, us: f64| rep.push_str(&format!("| {name} | {:.1} MB | {us:.1} | {:.0} |\n", bytes as f64 / 1e6, bytes as f64 / us / 1e3));
    let mut seed = 100;
    let mut weights = |m: usize, k: usize| -> Result<Vec<<Cuda as Device>::Weight>> {
        (0..copies(m * k * 2))
            .map(|_| {
                seed += 1;
                dev.random_weight(m, k, seed, 0.02)
            })
            .collect()
    };
    let (h, f, v) = (2048, 8192, 128256);
    let (wo, wq, wd) = (weights(h, h)?, weights(h + 1024, h)?, weights(h, f)?);
    let (wg, wu, head) = (weights(f, h)?, weights(f, h)?, weights(v, h)?);
    let (xh, xf) = (x_of(h)?, x_of(f)?);
    let mut out = dev.tensor(0, 0);
    let (mut g, mut u, mut act) = (dev.tensor(0, 0), dev.tensor(0, 0), dev.tensor(0, 0));
    let us = time(&mut |i| dev.matmul(&xh, &wo[i % wo.len()], &mut out))?;
    line("o 2048x2048", h * h * 2, us);
    let us = time(&mut |i| dev.matmul(&xh, &wq[i % wq.len()], &mut out))?;
    line("qkv 3072x2048", 3 * h * h, us);
    let us = time(&mut |i| dev.matmul(&xf, &wd[i % wd.len()], &mut out))?;
    line("down 2048x8192", h * f * 2, us);
    let us = time(&mut |i| dev.gated_matmul(&xh, &wg[i % wg.len()], &wu[i % wu.len()], GateAct::Silu, &mut g, &mut u, &mut act))?;
    line("gate·up 2x8192x2048", 2 * h * f * 2, us);
    let us = time(&mut |i| dev.matmul(&xh, &head[i % head.len()], &mut out))?;
    line("head 128256x2048", v * h * 2, us);
    let us = time(&mut |i| {
        dev.matmul(&xh, &wq[i % wq.len()], &mut out);
        dev.matmul(&xh, &wo[i % wo.len()], &mut out);
        dev.gated_matmul(&xh, &wg[i % wg.len()], &wu[i % wu.len()], GateAct::Silu, &mut g, &mut u, &mut act);
        dev.matmul(&xf, &wd[i % wd.len()], &mut out);
    })?;
    line("layer: qkv, o, gate·up, down", (3 * h * h) + h * h * 2 + 4 * h * f + 2 * h * f, us);
    dev.sync()?;
    Ok(rep)
}
