//! CPU paged attention alone: `cargo bench -p braid-ops --bench attention`.
//!
//! SmolLM2-135M's shape (30 layers, 9 query heads, 3 KV heads, head dim 64,
//! f16 KV in blocks of 16), each layer's pool of its own as the model's, so
//! a round streams as much KV as the model's does. Prints the median time
//! of a round's 30 attention calls: decode rows of 1 and 6 streams at
//! several contexts, and prompt chunks (512 rows at 512, 16 rows at 1500).
//! `BENCH_ONLY=decode|prefill|tower` runs one section (tower: the Gemma 3
//! vision tower's attention, head dim 72); `BENCH_REPS=n` sets the
//! timed rounds (default 21); `BENCH_LAYERS=n` reads only n layers' pools;
//! `BENCH_STREAMS=6,1` and `BENCH_CTX=100,1500,3000` pick the decode cases;
//! `BENCH_THREADS=n` sets the pool's threads.

use std::time::Instant;

use braid_ops::cpu::{Cpu, CpuKv, CpuTensor};
use braid_ops::{AttnSeq, Device, KvDtype, KvPoolSpec, KvShape};
use half::f16;

#[path = "../tests/common/rng.rs"]
mod rng;
use rng::Rng;

const LAYERS: usize = 30;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HD: usize = 64;
const BT: usize = 16;

struct Pool {
    dev: Cpu,
    kv: CpuKv,
    /// Per stream: its block table (contiguous blocks, as streams
    /// prefilled one after another get).
    tables: Vec<Vec<u32>>,
    /// Layers whose pools a round reads (`BENCH_LAYERS`; 1 keeps a small
    /// context in cache, to see the kernel's own speed).
    distinct: usize,
}

fn pool(streams: usize, ctx: usize) -> Pool {
    let dev = Cpu::new(std::env::var("BENCH_THREADS").ok().map(|v| v.parse().expect("BENCH_THREADS is a number")));
    let per = ctx.div_ceil(BT);
    let spec = KvPoolSpec::new(streams * per, BT, vec![KvShape { kv_heads: KV_HEADS, head_dim: HD }; LAYERS]);
    let mut kv = dev.kv_pool(&spec, KvDtype::F16).unwrap();
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for l in 0..LAYERS {
        for x in kv.k[l].iter_mut().chain(kv.v[l].iter_mut()) {
            *x = f16::from_f32(rng.f());
        }
    }
    let tables = (0..streams).map(|s| (0..per as u32).map(|b| s as u32 * per as u32 + b).collect()).collect();
    let distinct = std::env::var("BENCH_LAYERS").map_or(LAYERS, |v| v.parse().expect("BENCH_LAYERS is a number"));
    Pool { dev, kv, tables, distinct }
}

/// Median ms of `reps` rounds of `f`.
fn median_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut ts: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    ts[reps / 2]
}

/// A round: every layer's attention for `seqs`' rows.
fn round(p: &Pool, seqs: &[AttnSeq<'_>], q: &CpuTensor, out: &mut CpuTensor) {
    for l in 0..LAYERS {
        p.dev.attention(q, &p.kv, l % p.distinct, seqs, 0.125, None, out);
    }
}

fn queries(rows: usize) -> CpuTensor {
    let mut rng = Rng(77);
    CpuTensor { data: (0..rows * HEADS * HD).map(|_| rng.f()).collect(), rows, cols: HEADS * HD }
}

fn main() {
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let reps: usize = std::env::var("BENCH_REPS").map_or(21, |v| v.parse().expect("BENCH_REPS is a number"));
    if only.is_empty() || only == "decode" {
        let list = |name: &str, default: &str| -> Vec<usize> {
            std::env::var(name).unwrap_or_else(|_| default.into()).split(',').map(|x| x.parse().expect("a list of numbers")).collect()
        };
        let ctxs = list("BENCH_CTX", "100,1500,3000");
        for streams in list("BENCH_STREAMS", "6,1") {
            let p = pool(streams, *ctxs.iter().max().unwrap());
            for &ctx in &ctxs {
                let seqs: Vec<AttnSeq<'_>> =
                    (0..streams).map(|s| AttnSeq { q_start: s, q_len: 1, kv_len: ctx, blocks: &p.tables[s][..ctx.div_ceil(BT)], window: None }).collect();
                let q = queries(streams);
                let mut out = p.dev.tensor(0, 0);
                let ms = median_ms(reps, || round(&p, &seqs, &q, &mut out));
                let bytes = (streams * ctx * LAYERS * KV_HEADS * HD * 2 * 2) as f64;
                println!("decode {streams} streams at ctx {ctx}: {ms:.3} ms a round ({:.1} GB/s of KV)", bytes / ms / 1e6);
            }
        }
    }
    if only.is_empty() || only == "tower" {
        // The Gemma 3 vision tower's attention (SigLIP so400m: 16 heads of
        // 72, every patch a query over all 4,096 patches' keys), one
        // layer's step of 64 patches, as `siglip.rs` runs it.
        let (heads, hd, patches, rows) = (16, 72, 4096, 64);
        let dev = Cpu::new(std::env::var("BENCH_THREADS").ok().map(|v| v.parse().expect("BENCH_THREADS is a number")));
        let spec = KvPoolSpec::new(patches / BT, BT, vec![KvShape { kv_heads: heads, head_dim: hd }]);
        let mut kv = dev.kv_pool(&spec, KvDtype::F16).unwrap();
        let mut rng = Rng(0x5eed);
        for x in kv.k[0].iter_mut().chain(kv.v[0].iter_mut()) {
            *x = f16::from_f32(rng.f());
        }
        let blocks: Vec<u32> = (0..(patches / BT) as u32).collect();
        let seqs: Vec<AttnSeq<'_>> = (0..rows).map(|i| AttnSeq { q_start: i, q_len: 1, kv_len: patches, blocks: &blocks, window: None }).collect();
        let q = CpuTensor { data: (0..rows * heads * hd).map(|_| rng.f()).collect(), rows, cols: heads * hd };
        let mut out = dev.tensor(0, 0);
        let ms = median_ms(reps.div_ceil(3), || dev.attention(&q, &kv, 0, &seqs, 0.118, None, &mut out));
        let flop = (4 * rows * patches * heads * hd) as f64;
        println!("tower step of {rows} patches over {patches}: {ms:.3} ms ({:.1} GFLOP/s)", flop / ms / 1e6);
    }
    if only.is_empty() || only == "prefill" {
        let p = pool(1, 1536);
        for (rows, ctx) in [(512usize, 512usize), (16, 1500)] {
            let seqs = [AttnSeq { q_start: 0, q_len: rows, kv_len: ctx, blocks: &p.tables[0][..ctx.div_ceil(BT)], window: None }];
            let q = queries(rows);
            let mut out = p.dev.tensor(0, 0);
            let ms = median_ms(reps.div_ceil(3), || round(&p, &seqs, &q, &mut out));
            println!("prefill chunk of {rows} rows at ctx {ctx}: {ms:.3} ms a round");
        }
    }
}
