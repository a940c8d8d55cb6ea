//! The CUDA device against host references, op by op, on fresh random
//! inputs; and the device's fusion by op sequence: ops recorded inside a
//! `Device::forward` (fused, their norms folded after `Device::prepare`)
//! against the same ops called outside any forward (each run at once,
//! unfused), keyed forwards (CUDA graphs) against eager ones, forwards that
//! read values back mid-way, and forwards prepared and launched ahead.
//! Each test skips (passes with a notice) where no GPU or CUDA driver is
//! present, as in CI.

#![cfg(feature = "cuda")]
#![allow(clippy::too_many_arguments, clippy::type_complexity)]

use braid_ops::cpu::Cpu;
use braid_ops::cuda::{Cuda, CudaKv, Tuning};
use braid_ops::{
    Act, AttnSeq, BlockSparse, DeltaShape, Device, DrawRow, Forward, KvDtype, KvPoolSpec, KvShape, Map, MoeOps, Penalty, RecurrentOps, Rope, RowPick,
    RowPicked, SparseAttentionOps, SsmShape, StateSeq,
};
use half::bf16;

type T = <Cuda as Device>::Tensor;
type W = <Cuda as Device>::Weight;

#[path = "../common/gpu.rs"]
mod gpu;
use gpu::gpu;

#[path = "../common/rng.rs"]
mod rng;
use rng::XorShift as Rng;

// The tests by topic, past the single-op tests in this file (each module
// says what it holds); the helpers here are shared by all of them.
mod attention;
mod bf16_copies;
mod forwards;
mod fusion;
mod hybrid;

/// The device with no skinny GEMM: products past the GEMV's rows take
/// cuBLAS (the default takes the skinny GEMM up to 32 rows).
fn gpu_cublas() -> Cuda {
    Cuda::with_tuning(0, Tuning { skinny_max_rows: 0, ..Tuning::default() }).unwrap()
}

fn seed() -> u64 {
    // Fresh inputs each run, printed so a failure can be replayed.
    let s = std::env::var("BRAID_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1) | 1);
    eprintln!("seed {s}");
    s
}

fn rbf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// ‖a − b‖ / ‖b‖, with NaN anywhere counting as a failure.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "comparing tensors of different sizes");
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        if !x.is_finite() || !y.is_finite() {
            return f64::INFINITY;
        }
        num += ((x - y) as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn report(op: &str, e: f64, tol: f64) {
    eprintln!("op {op}: rel err {e:.2e}");
    assert!(e < tol, "op {op}: rel err {e} over {tol}");
}

fn poisoned(d: &Cuda, rows: usize, cols: usize) -> T {
    d.upload(&vec![f32::NAN; rows * cols], rows, cols).unwrap()
}

/// Run `ops` inside a forward (`key` None: eagerly, fused).
fn in_forward(d: &Cuda, key: Option<u64>, ops: &mut dyn FnMut()) -> anyhow::Result<()> {
    d.forward(Forward { key, tokens: &[] }, &mut || {
        ops();
        Ok(())
    })
}

/// Let the device see `ops` as the forward it will serve (it folds norms).
fn prepare(d: &Cuda, ops: &mut dyn FnMut()) {
    d.prepare(&mut || {
        ops();
        Ok(())
    })
    .unwrap()
}

/// `x · wᵀ` in f64 over the bf16-rounded operands.
fn mm_ref(x: &[f32], w: &[f32], rows: usize, k: usize, m: usize) -> Vec<f64> {
    let xb: Vec<f32> = x.iter().map(|&v| rbf(v)).collect();
    mm_exact_x(&xb, w, rows, k, m)
}

/// `mm_ref` with x taken as it is (only w rounded to bf16).
fn mm_exact_x(x: &[f32], w: &[f32], rows: usize, k: usize, m: usize) -> Vec<f64> {
    let wb: Vec<f64> = w.iter().map(|&v| rbf(v) as f64).collect();
    let mut y = vec![0f64; rows * m];
    for i in 0..rows {
        for j in 0..m {
            y[i * m + j] = (0..k).map(|c| x[i * k + c] as f64 * wb[j * k + c]).sum();
        }
    }
    y
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

fn silu(a: f64) -> f64 {
    a / (1.0 + (-a).exp())
}

/// Products of one weight and of several over one input, on few rows (the
/// GEMV kernels: several rows per block, partial blocks, long rows through
/// the 1–2-row builds), a few dozen to a few hundred (the skinny GEMM: weight
/// rows not a multiple of its 16-row tiles, x rows not a multiple of its
/// 8-row tiles or of a block's 32, k split over warps unevenly) and many
/// (cuBLAS; also k not in steps of 32), against f64; inside a forward the
/// same.
#[test]
fn matmul_bf16_against_f64() {
    let Some(d) = gpu() else { return };
    matmuls(&d);
    matmuls(&gpu_cublas());
}

fn matmuls(d: &Cuda) {
    let mut r = Rng(seed());
    let shapes = [
        (1, 256, 384),
        (7, 512, 96),
        (5, 512, 100),
        (16, 576, 1100),
        (33, 1024, 513),
        (64, 1024, 512),
        (100, 640, 300),
        (72, 2048, 520),
        (121, 512, 130),
        (256, 512, 129),
        (9, 8192, 40),
        (10, 520, 64),
        (300, 320, 200),
        (1, 8704, 1100),
        (2, 8192, 1100),
        (3, 512, 4100),
    ];
    for &(rows, k, m) in &shapes {
        let x = r.vec(rows * k, 1.0);
        let w = r.vec(m * k, 0.1);
        let xt = d.upload(&x, rows, k).unwrap();
        let wt = d.weight_from_f32(&w, m, k).unwrap();
        let want = f32s(&mm_ref(&x, &w, rows, k, m));
        let mut out = poisoned(d, 1, 1);
        d.matmul(&xt, &[&wt], &mut [&mut out]);
        let e = rel(&d.download(&out).unwrap(), &want);
        eprintln!("matmul {rows}x{k} · {m}x{k}ᵀ: rel err {e:.2e}");
        assert!(e < 1e-4, "matmul {rows}x{k}x{m}: rel err {e}");
        let mut inside = poisoned(d, 1, 1);
        in_forward(d, None, &mut || d.matmul(&xt, &[&wt], &mut [&mut inside])).unwrap();
        assert!(rel(&d.download(&inside).unwrap(), &want) < 1e-4, "matmul {rows}x{k}x{m} inside a forward");
    }
    // Several weights over one input: q, k, v-like widths (one GEMV launch
    // of three), and four (two launches).
    let k = 512;
    let ms = [4100usize, 64, 72, 200];
    let ws: Vec<Vec<f32>> = ms.iter().map(|&m| r.vec(m * k, 0.1)).collect();
    let gw: Vec<W> = ws.iter().zip(&ms).map(|(w, &m)| d.weight_from_f32(w, m, k).unwrap()).collect();
    for rows in [1usize, 3, 4, 5, 8, 40, 100, 300] {
        let x = r.vec(rows * k, 1.0);
        let gx = d.upload(&x, rows, k).unwrap();
        for n in [3usize, 4] {
            let mut outs: Vec<T> = (0..n).map(|_| poisoned(d, 1, 1)).collect();
            {
                let mut refs: Vec<&mut T> = outs.iter_mut().collect();
                let wr: Vec<&W> = gw[..n].iter().collect();
                d.matmul(&gx, &wr, &mut refs);
            }
            for (i, out) in outs.iter().enumerate() {
                let want = f32s(&mm_ref(&x, &ws[i], rows, k, ms[i]));
                let e = rel(&d.download(out).unwrap(), &want);
                eprintln!("matmul of {n} weights, {rows} rows, weight {i} ({}x{k}): rel err {e:.2e}", ms[i]);
                assert!(e < 1e-4, "matmul of {n} weights, {rows} rows, weight {i}: rel err {e}");
            }
        }
    }
}

#[test]
fn pointwise_ops_match_cpu() {
    let Some(d) = gpu() else { return };
    let cpu = Cpu::new(Some(1));
    let mut r = Rng(seed());
    let (rows, cols) = (5, 1536);
    let x = r.vec(rows * cols, 2.0);
    let y = r.vec(rows * cols, 2.0);
    let (gx, gy) = (d.upload(&x, rows, cols).unwrap(), d.upload(&y, rows, cols).unwrap());
    let (cx, cy) = (cpu.upload(&x, rows, cols).unwrap(), cpu.upload(&y, rows, cols).unwrap());
    // Row norms (block kernel) and per-head norms (warp kernel).
    for g in [cols, 128, 64] {
        let w = r.vec(g, 1.0);
        let (gw, cw) = (d.upload(&w, 1, g).unwrap(), cpu.upload(&w, 1, g).unwrap());
        let (mut go, mut co) = (poisoned(&d, 1, 1), cpu.tensor(0, 0));
        d.rms_norm(&gx, &gw, 1e-6, &mut go);
        cpu.rms_norm(&cx, &cw, 1e-6, &mut co);
        report(&format!("rms_norm over {g}"), rel(&d.download(&go).unwrap(), &co.data), 1e-5);
    }
    for act in [Act::Silu, Act::GeluTanh, Act::Identity, Act::Sigmoid, Act::SwiGluClamped { limit: 2.0, alpha: 1.702 }] {
        let (mut go, mut co) = (poisoned(&d, 1, 1), cpu.tensor(0, 0));
        d.gated(act, &gx, &gy, &mut go);
        cpu.gated(act, &cx, &cy, &mut co);
        report(&format!("gated {act:?}"), rel(&d.download(&go).unwrap(), &co.data), 1e-5);
    }
    // add, a bias (one row added to every row), scale, softcap in place.
    let b = r.vec(cols, 1.0);
    let (gb, cb) = (d.upload(&b, 1, cols).unwrap(), cpu.upload(&b, 1, cols).unwrap());
    let (mut ga, mut ca) = (d.upload(&x, rows, cols).unwrap(), cpu.upload(&x, rows, cols).unwrap());
    d.add(&mut ga, &gy);
    cpu.add(&mut ca, &cy);
    d.add(&mut ga, &gb);
    cpu.add(&mut ca, &cb);
    d.map(&mut ga, Map::Scale(0.7));
    cpu.map(&mut ca, Map::Scale(0.7));
    d.map(&mut ga, Map::Softcap(3.0));
    cpu.map(&mut ca, Map::Softcap(3.0));
    report("add / bias / scale / softcap", rel(&d.download(&ga).unwrap(), &ca.data), 1e-5);
    // add then a whole-row norm (one kernel inside a forward) and over heads
    // (two), against the CPU.
    for g in [cols, 64] {
        let w = r.vec(g, 1.0);
        let (gw, cw) = (d.upload(&w, 1, g).unwrap(), cpu.upload(&w, 1, g).unwrap());
        let (mut gx2, mut cx2) = (d.upload(&x, rows, cols).unwrap(), cpu.upload(&x, rows, cols).unwrap());
        let (mut go, mut co) = (poisoned(&d, 1, 1), cpu.tensor(0, 0));
        in_forward(&d, None, &mut || {
            d.add(&mut gx2, &gy);
            d.rms_norm(&gx2, &gw, 1e-5, &mut go);
        })
        .unwrap();
        cpu.add(&mut cx2, &cy);
        cpu.rms_norm(&cx2, &cw, 1e-5, &mut co);
        report(&format!("add + rms_norm over {g} in a forward: residual"), rel(&d.download(&gx2).unwrap(), &cx2.data), 1e-6);
        report(&format!("add + rms_norm over {g} in a forward: output"), rel(&d.download(&go).unwrap(), &co.data), 1e-5);
    }
    // RoPE, both pairings, partial rotary, linear position scaling.
    for (neox, dims, scale) in [(true, 64, 1.0), (false, 64, 1.0), (true, 32, 1.0), (true, 64, 4.0)] {
        let rope = Rope { scale, ..Rope::new(10000.0, dims, neox) };
        let pos: Vec<u32> = (0..rows as u32).map(|i| i * 977 + 3).collect();
        let (mut gq, mut cq) = (d.upload(&x, rows, cols).unwrap(), cpu.upload(&x, rows, cols).unwrap());
        d.rope(&mut gq, &pos, 64, &rope);
        cpu.rope(&mut cq, &pos, 64, &rope);
        report(&format!("rope neox={neox} dims={dims} scale={scale}"), rel(&d.download(&gq).unwrap(), &cq.data), 1e-5);
    }
    // Gather, copy and zero rows.
    let (mut go, mut co) = (poisoned(&d, 1, 1), cpu.tensor(0, 0));
    d.gather_rows(&gx, &[4, 0, 2], &mut go);
    cpu.gather_rows(&cx, &[4, 0, 2], &mut co);
    assert_eq!(d.download(&go).unwrap(), co.data, "gather_rows");
    let (mut gs, mut cs) = (d.upload(&x, rows, cols).unwrap(), cpu.upload(&x, rows, cols).unwrap());
    d.copy_rows(&mut gs, &[1, 3], &[4, 0]);
    cpu.copy_rows(&mut cs, &[1, 3], &[4, 0]);
    d.zero_rows(&mut gs, &[2]);
    cpu.zero_rows(&mut cs, &[2]);
    assert_eq!(d.download(&gs).unwrap(), cs.data, "copy_rows / zero_rows");
}

/// Inputs the ops refuse are errors the device keeps (each op returns
/// nothing): the next call that returns a `Result` says so, and no later
/// op runs (each case on a device of its own).
#[test]
fn bad_inputs_are_kept_errors() {
    if gpu().is_none() {
        return;
    }
    let cases: [(&str, Box<dyn Fn(&Cuda)>); 5] = [
        (
            "gated of different shapes",
            Box::new(|d: &Cuda| {
                let (a, b) = (d.upload(&[1.0; 8], 1, 8).unwrap(), d.upload(&[1.0; 16], 2, 8).unwrap());
                d.gated(Act::Identity, &a, &b, &mut poisoned(d, 1, 1));
            }),
        ),
        (
            "more frequencies than a head holds",
            Box::new(|d: &Cuda| {
                let mut x = d.upload(&[1.0; 128], 1, 128).unwrap();
                d.rope(&mut x, &[3], 64, &Rope::table(vec![0.5; 33]));
            }),
        ),
        (
            "a product of the wrong width",
            Box::new(|d: &Cuda| {
                let x = d.upload(&[1.0; 64], 1, 64).unwrap();
                let w = d.weight_from_f32(&[1.0; 8 * 32], 8, 32).unwrap();
                d.matmul(&x, &[&w], &mut [&mut poisoned(d, 1, 1)]);
            }),
        ),
        (
            "a KV slot past the pool",
            Box::new(|d: &Cuda| {
                let spec = KvPoolSpec::new(2, 16, vec![KvShape { kv_heads: 1, head_dim: 64 }]);
                let mut pool = d.kv_pool(&spec, KvDtype::F16).unwrap();
                let k = d.upload(&[1.0; 64], 1, 64).unwrap();
                d.kv_write(&mut pool, 0, &k, &k, &[32]);
            }),
        ),
        (
            "an add of different shapes",
            Box::new(|d: &Cuda| {
                let mut a = d.upload(&[1.0; 16], 2, 8).unwrap();
                let b = d.upload(&[1.0; 24], 3, 8).unwrap();
                d.add(&mut a, &b);
            }),
        ),
    ];
    for (what, case) in cases {
        let d = gpu().unwrap();
        case(&d);
        assert!(d.sync().is_err(), "{what}: no error kept");
        assert!(d.download(&d.upload(&[1.0], 1, 1).unwrap()).is_err(), "{what}: later calls should fail too");
    }
    // A KV pool the device does not store.
    let d = gpu().unwrap();
    let spec = KvPoolSpec::new(1, 16, vec![KvShape { kv_heads: 1, head_dim: 64 }]);
    assert!(d.kv_pool(&spec, KvDtype::F32).is_err(), "an f32 KV pool");
}

#[test]
fn embedding_and_argmax() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let (vocab, cols) = (1000, 96);
    let table = r.vec(vocab * cols, 1.0);
    let w = d.weight_from_f32(&table, vocab, cols).unwrap();
    let ids = [5u32, 999, 0, 417];
    let mut out = poisoned(&d, 1, 1);
    d.embed(&w, &ids, 0.5, &mut out);
    let got = d.download(&out).unwrap();
    for (i, &id) in ids.iter().enumerate() {
        for c in 0..cols {
            assert_eq!(got[i * cols + c], rbf(table[id as usize * cols + c]) * 0.5, "embed row {i} col {c}");
        }
    }
    // Several calls over different rows: each call must leave its keys
    // cleared for the next (the kernel's last block does), and more rows
    // than a block has threads; NaN never wins, ties go to the first.
    for (rows, cols) in [(3, 50000), (300, 2000), (2, 50000), (1, 7)] {
        let mut logits = r.vec(rows * cols, 5.0);
        for row in 0..rows {
            logits[row * cols] = f32::NAN;
            logits[row * cols + cols / 2] = 6.0;
            logits[row * cols + cols - 1] = 6.0;
        }
        let t = d.upload(&logits, rows, cols).unwrap();
        let want: Vec<u32> = logits.chunks(cols).map(braid_ops::argmax_host).collect();
        assert_eq!(d.argmax(&t).unwrap(), want, "argmax of {rows}x{cols}");
        match d.pick(&t, RowPick::Argmax, &[], false).unwrap() {
            RowPicked::Argmax(got) => assert_eq!(got, want, "pick(Argmax) of {rows}x{cols}"),
            other => panic!("pick(Argmax) answered {other:?}"),
        }
        // No forward prepared ahead: launching ahead is a plain argmax.
        match d.pick(&t, RowPick::Argmax, &[], true).unwrap() {
            RowPicked::Argmax(got) => assert_eq!(got, want, "pick(Argmax, launch ahead) of {rows}x{cols}"),
            other => panic!("pick(Argmax) answered {other:?}"),
        }
        // Within masks (a guided stream's): a sparse one that forbids the
        // row's maxima, a free row (all ones), one allowing only -inf and
        // NaN columns, one allowing nothing.
        let words = cols.div_ceil(32);
        let mut bits = vec![u32::MAX; rows * words];
        for row in 0..rows {
            let m = &mut bits[row * words..(row + 1) * words];
            match row % 4 {
                0 => m.iter_mut().enumerate().for_each(|(w, b)| *b = 0x1111_0101u32.rotate_left(w as u32)),
                1 => {}
                2 => {
                    m.fill(0);
                    logits[row * cols + cols / 3] = f32::NEG_INFINITY;
                    for c in [0, cols / 3] {
                        m[c / 32] |= 1 << (c % 32);
                    }
                }
                _ => m.fill(0),
            }
        }
        let t = d.upload(&logits, rows, cols).unwrap();
        let want: Vec<u32> = (0..rows).map(|r| braid_ops::argmax_allowed_host(&logits[r * cols..(r + 1) * cols], &bits[r * words..(r + 1) * words])).collect();
        for ahead in [false, true] {
            match d.pick(&t, RowPick::ArgmaxAllowed(&bits), &[], ahead).unwrap() {
                RowPicked::Argmax(got) => assert_eq!(got, want, "pick(ArgmaxAllowed, ahead {ahead}) of {rows}x{cols}"),
                other => panic!("pick(ArgmaxAllowed) answered {other:?}"),
            }
        }
    }
}

/// Top-k candidates found on the device equal the host's: values, columns
/// and order (ties to the lower column, NaN as -inf), for vocabularies up to
/// 262,144 and k up to 64.
#[test]
fn top_k_rows_equal_the_hosts() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    assert_eq!(d.caps().top_k, 64);
    for (rows, cols) in [(1usize, 3usize), (4, 1000), (3, 128256), (1, 262144)] {
        let mut x = r.vec(rows * cols, 8.0);
        // Ties, NaN and -inf among the largest.
        for row in 0..rows {
            let b = row * cols;
            x[b + cols / 2] = 9.0;
            x[b + cols - 1] = 9.0;
            x[b] = f32::NAN;
            if cols > 2 {
                x[b + 1] = f32::NEG_INFINITY;
            }
        }
        let g = d.upload(&x, rows, cols).unwrap();
        for k in [1usize, 5, 64] {
            let k = k.min(cols);
            let want = braid_ops::top_k_host(&x, cols, k);
            match d.pick(&g, RowPick::TopK(k), &[], false).unwrap() {
                RowPicked::TopK(got) => assert_eq!(got, want, "top-{k} of {rows} rows of {cols}"),
                other => panic!("pick(TopK) answered {other:?}"),
            }
        }
        // Within masks (a guided stream's): sparse (fewer allowed than k
        // in the small rows), a free row, one allowing nothing.
        let words = cols.div_ceil(32);
        let mut bits = vec![u32::MAX; rows * words];
        for row in 0..rows {
            let m = &mut bits[row * words..(row + 1) * words];
            match row % 3 {
                0 => m.iter_mut().enumerate().for_each(|(w, b)| *b = 0x0100_0011u32.rotate_left(w as u32 * 7)),
                1 => {}
                _ => m.fill(0),
            }
        }
        for k in [1usize, 5, 64] {
            let k = k.min(cols);
            let want = braid_ops::top_k_allowed_host(x.clone(), cols, k, &bits).unwrap();
            match d.pick(&g, RowPick::TopKAllowed(k, &bits), &[], false).unwrap() {
                RowPicked::TopK(got) => assert_eq!(got, want, "masked top-{k} of {rows} rows of {cols}"),
                other => panic!("pick(TopKAllowed) answered {other:?}"),
            }
        }
    }
}

/// Tokens drawn where the logits are (`RowPick::Draw`) are those
/// `draw_host` draws from the same rows and numbers, but for draws within
/// rounding of a boundary (the device sums in another order and takes a
/// faster exp): greedy rows, top-p, top-k past what `TopK` finds, min-p,
/// plain temperature, masks, NaN, -inf and ties, rows up to 262,144 wide.
/// The same call twice gives the same tokens.
#[test]
fn draws_equal_the_hosts_but_at_rounding() {
    let Some(d) = gpu() else { return };
    assert!(d.caps().draw);
    let mut r = Rng(seed());
    let kinds = [
        DrawRow { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, u: 0.0 },
        DrawRow { temperature: 0.8, top_k: 0, top_p: 0.9, min_p: 0.0, u: 0.0 },
        DrawRow { temperature: 1.2, top_k: 50, top_p: 0.8, min_p: 0.0, u: 0.0 },
        DrawRow { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.05, u: 0.0 },
        DrawRow { temperature: 0.7, top_k: 0, top_p: 1.0, min_p: 0.0, u: 0.0 },
        DrawRow { temperature: 1.5, top_k: 1000, top_p: 0.95, min_p: 0.0, u: 0.0 },
        DrawRow { temperature: 1.0, top_k: 0, top_p: 0.5, min_p: 0.1, u: 0.0 },
    ];
    let (mut drawn, mut differ) = (0usize, 0usize);
    for (rows, cols, amp) in [(7usize, 3usize, 2.0f32), (7, 1000, 4.0), (14, 49152, 6.0), (7, 151936, 8.0), (3, 262144, 10.0)] {
        let mut x = r.vec(rows * cols, amp);
        for row in 0..rows {
            let b = row * cols;
            x[b + cols / 2] = amp + 1.0; // a tie for the largest
            x[b + cols - 1] = amp + 1.0;
            x[b] = f32::NAN;
            if cols > 2 {
                x[b + 1] = f32::NEG_INFINITY;
            }
        }
        let g = d.upload(&x, rows, cols).unwrap();
        let words = cols.div_ceil(32);
        let mut bits = vec![u32::MAX; rows * words];
        for row in (2..rows).step_by(3) {
            bits[row * words..(row + 1) * words].iter_mut().enumerate().for_each(|(w, b)| *b = 0x0f0f_00ffu32.rotate_left(w as u32 * 5));
        }
        for round in 0..24 {
            let draws: Vec<DrawRow> = (0..rows).map(|i| DrawRow { u: r.f().abs().fract().min(0.999_999), ..kinds[(i + round) % kinds.len()] }).collect();
            for allowed in [None, Some(bits.as_slice())] {
                let want: Vec<u32> =
                    (0..rows).map(|i| braid_ops::draw_host(&x[i * cols..(i + 1) * cols], &draws[i], allowed.map(|b| &b[i * words..(i + 1) * words]))).collect();
                let got = match d.pick(&g, RowPick::Draw(&draws, allowed), &[], false).unwrap() {
                    RowPicked::Drawn(t) => t,
                    other => panic!("pick(Draw) answered {other:?}"),
                };
                let again = d.pick(&g, RowPick::Draw(&draws, allowed), &[], false).unwrap();
                assert_eq!(again, RowPicked::Drawn(got.clone()), "the same draw twice");
                for i in 0..rows {
                    if draws[i].temperature == 0.0 {
                        assert_eq!(got[i], want[i], "greedy row {i} of {rows}x{cols}");
                    } else {
                        drawn += 1;
                        differ += usize::from(got[i] != want[i]);
                    }
                    if let Some(b) = allowed {
                        let t = got[i] as usize;
                        assert!(b[i * words + t / 32] >> (t % 32) & 1 == 1 || b[i * words..(i + 1) * words].iter().all(|&w| w == 0), "token {t} not allowed");
                    }
                }
            }
        }
    }
    // Broken rows: all NaN, NaN and -inf within a mask, nothing allowed.
    let (cols, words) = (40usize, 2usize);
    let mut x = vec![f32::NAN; 3 * cols];
    x[cols..2 * cols].iter_mut().step_by(2).for_each(|v| *v = f32::NEG_INFINITY);
    let bits = [u32::MAX, u32::MAX, 0b0110, 0, 0, 0];
    let draws = [DrawRow { temperature: 1.0, top_k: 0, top_p: 0.9, min_p: 0.0, u: 0.5 }; 3];
    let g = d.upload(&x, 3, cols).unwrap();
    let want: Vec<u32> = (0..3).map(|i| braid_ops::draw_host(&x[i * cols..(i + 1) * cols], &draws[i], Some(&bits[i * words..(i + 1) * words]))).collect();
    assert_eq!(d.pick(&g, RowPick::Draw(&draws, Some(&bits)), &[], false).unwrap(), RowPicked::Drawn(want), "broken rows");
    eprintln!("draws: {differ} of {drawn} differ from the host's");
    assert!(differ * 100 <= drawn, "{differ} of {drawn} draws differ from the host's");
}

/// Penalties applied where the logits are give the values, the argmax and
/// the top k that `Penalty::apply` on the host's copy gives, bit for bit
/// (a sampler's penalties then pick on the device as on the host): the
/// repetition penalty on positive, negative, zero, NaN and infinite values,
/// a subtraction alone, both, and an entry that changes nothing.
#[test]
fn penalties_before_a_pick_equal_the_hosts() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let (rows, cols) = (3usize, 50_000usize);
    let mut x = r.vec(rows * cols, 8.0);
    let specials = [0.0f32, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 7.9, -7.9];
    let mut penalties = Vec::new();
    for row in 0..rows as u32 {
        for i in 0..300u32 {
            let col = (i * 163 + row * 7) % cols as u32;
            if let Some(&v) = specials.get(i as usize) {
                x[row as usize * cols + col as usize] = v;
            }
            let (repeat, sub) = match i % 4 {
                0 => (1.3, 0.0),
                1 => (1.0, 0.4 + i as f32 * 0.1),
                2 => (0.8, 1.5),
                _ => (1.0, 0.0),
            };
            penalties.push(Penalty { row, col, repeat, sub });
        }
    }
    let mut want = x.clone();
    for p in &penalties {
        let v = &mut want[p.row as usize * cols + p.col as usize];
        *v = p.apply(*v);
    }
    for pick in [RowPick::Argmax, RowPick::TopK(40)] {
        let g = d.upload(&x, rows, cols).unwrap();
        let got = d.pick(&g, pick, &penalties, false).unwrap();
        let host = match pick {
            RowPick::TopK(k) => RowPicked::TopK(braid_ops::top_k_host(&want, cols, k)),
            _ => RowPicked::Argmax(want.chunks(cols).map(|row| braid_ops::top_k_host(row, cols, 1)[0][0].0).collect()),
        };
        assert_eq!(got, host, "{pick:?} after penalties");
        let left = d.download(&g).unwrap();
        // (A NaN stays a NaN; the GPU's arithmetic does not keep its payload.)
        let same = |(a, b): (&f32, &f32)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        let differ: Vec<usize> = (0..x.len()).filter(|&i| !same((&left[i], &want[i]))).collect();
        assert!(
            differ.is_empty(),
            "the penalised values differ from the host's at {} places, e.g. {:?}",
            differ.len(),
            differ.iter().take(3).map(|&i| (i, x[i], left[i], want[i])).collect::<Vec<_>>()
        );
    }
    // A penalty outside the rows is refused, not written.
    let g = d.upload(&x, rows, cols).unwrap();
    let bad = [Penalty { row: rows as u32, col: 0, repeat: 2.0, sub: 0.0 }];
    assert!(d.pick(&g, RowPick::Argmax, &bad, false).is_err());
}
