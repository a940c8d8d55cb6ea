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
    Act, AttnSeq, BlockSparse, DeltaShape, Device, Forward, KvDtype, KvPoolSpec, KvShape, Map, MoeOps, Penalty, RecurrentOps, Rope, RowPick, RowPicked,
    SparseAttentionOps, SsmShape, StateSeq,
};
use half::bf16;

type T = <Cuda as Device>::Tensor;
type W = <Cuda as Device>::Weight;

#[path = "common/gpu.rs"]
mod gpu;
use gpu::gpu;

#[path = "common/rng.rs"]
mod rng;
use rng::XorShift as Rng;

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

struct Case {
    /// Tokens a KV block.
    bt: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    /// (q_len, kv_len) per sequence.
    seqs: Vec<(usize, usize)>,
}

/// Host reference in f64 over the bf16-rounded K/V the pool holds.
fn attention_ref(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], c: &Case, scale: f32) -> Vec<f32> {
    let qc = c.heads * c.hd;
    let kvw = c.kv_heads * c.hd;
    let g = c.heads / c.kv_heads;
    let mut out = vec![0f32; q.len()];
    let mut row0 = 0;
    for (si, &(ql, kl)) in c.seqs.iter().enumerate() {
        for i in 0..ql {
            let pos = kl - ql + i;
            let lo = c.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            for h in 0..c.heads {
                let kvh = h / g;
                let qv = &q[(row0 + i) * qc + h * c.hd..(row0 + i) * qc + (h + 1) * c.hd];
                let mut scores = Vec::new();
                for j in lo..=pos {
                    let kr = &k[si][j * kvw + kvh * c.hd..j * kvw + (kvh + 1) * c.hd];
                    let mut s: f64 = qv.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64;
                    if let Some(cap) = c.softcap {
                        s = cap as f64 * (s / cap as f64).tanh();
                    }
                    scores.push(s);
                }
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let l: f64 = p.iter().sum();
                for dd in 0..c.hd {
                    let mut acc = 0f64;
                    for (jj, j) in (lo..=pos).enumerate() {
                        acc += p[jj] * v[si][j * kvw + kvh * c.hd + dd] as f64;
                    }
                    out[(row0 + i) * qc + h * c.hd + dd] = (acc / l) as f32;
                }
            }
        }
        row0 += ql;
    }
    out
}

/// One attention case against f64, outside any forward, then inside a
/// keyed forward (a graph) and an eager one: the same bits.
fn run_attention_case(d: &Cuda, r: &mut Rng, c: &Case, tol: f64) {
    let bt = c.bt;
    let kvw = c.kv_heads * c.hd;
    let total_blocks: usize = c.seqs.iter().map(|s| s.1.div_ceil(bt)).sum::<usize>() + 3;
    let spec = KvPoolSpec::new(total_blocks, bt, vec![KvShape { kv_heads: 1, head_dim: 16 }, KvShape { kv_heads: c.kv_heads, head_dim: c.hd }]);
    let mut pool = d.kv_pool(&spec, KvDtype::F16).unwrap();
    // Blocks handed out in a shuffled order so tables are not contiguous.
    let mut free: Vec<u32> = (0..total_blocks as u32).collect();
    for i in (1..free.len()).rev() {
        let j = r.below(i + 1);
        free.swap(i, j);
    }
    let mut tables = Vec::new();
    let (mut kh, mut vh) = (Vec::new(), Vec::new());
    for &(_, kl) in &c.seqs {
        let blocks: Vec<u32> = (0..kl.div_ceil(bt)).map(|_| free.pop().unwrap()).collect();
        let k = r.vec(kl * kvw, 1.0);
        let v = r.vec(kl * kvw, 1.0);
        let slots: Vec<u32> = (0..kl).map(|p| blocks[p / bt] * bt as u32 + (p % bt) as u32).collect();
        let (gk, gv) = (d.upload(&k, kl, kvw).unwrap(), d.upload(&v, kl, kvw).unwrap());
        d.kv_write(&mut pool, 1, &gk, &gv, &slots);
        kh.push(k.iter().map(|&x| rbf(x)).collect::<Vec<f32>>());
        vh.push(v.iter().map(|&x| rbf(x)).collect::<Vec<f32>>());
        tables.push(blocks);
    }
    let rows: usize = c.seqs.iter().map(|s| s.0).sum();
    let qc = c.heads * c.hd;
    let q = r.vec(rows * qc, 1.0);
    let gq = d.upload(&q, rows, qc).unwrap();
    let mut seqs = Vec::new();
    let mut start = 0;
    for (i, &(ql, kl)) in c.seqs.iter().enumerate() {
        seqs.push(AttnSeq { q_start: start, q_len: ql, kv_len: kl, blocks: &tables[i], window: c.window });
        start += ql;
    }
    let scale = 1.0 / (c.hd as f32).sqrt();
    let mut out = poisoned(d, rows, qc);
    d.attention(&gq, &pool, 1, &seqs, scale, c.softcap, &mut out);
    let got = d.download(&out).unwrap();
    let want = attention_ref(&q, &kh, &vh, c, scale);
    let e = rel(&got, &want);
    eprintln!("attention heads {}/{} hd {} window {:?} softcap {:?} seqs {:?}: rel err {e:.2e}", c.heads, c.kv_heads, c.hd, c.window, c.softcap, c.seqs);
    assert!(e < tol, "attention rel err {e} over {tol}");
    for key in [Some(0xa77e_u64 ^ rows as u64), None] {
        let mut inside = poisoned(d, rows, qc);
        in_forward(d, key, &mut || d.attention(&gq, &pool, 1, &seqs, scale, c.softcap, &mut inside)).unwrap();
        assert!(same_bits(&d.download(&inside).unwrap(), &got), "attention inside a forward (key {key:?}) differs from outside");
    }
}

#[test]
fn decode_attention_against_f64() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    // Few rows a sequence (below `Tuning::attn_prefill_from`): the
    // split-KV decode kernel (with and without splits).
    let cases = [
        Case { bt: 16, heads: 32, kv_heads: 8, hd: 64, window: None, softcap: None, seqs: vec![(1, 1), (1, 37), (1, 300), (1, 1029)] },
        Case { bt: 16, heads: 8, kv_heads: 8, hd: 128, window: None, softcap: None, seqs: vec![(1, 5000)] },
        Case { bt: 16, heads: 4, kv_heads: 1, hd: 256, window: Some(100), softcap: Some(50.0), seqs: vec![(3, 40), (1, 700)] },
        Case { bt: 16, heads: 16, kv_heads: 2, hd: 64, window: None, softcap: None, seqs: (0..70).map(|i| (1 + i % 4, 4 + i * 13)).collect() },
        // With two KV heads a 30-row chunk keeps this kernel too.
        Case { bt: 16, heads: 16, kv_heads: 2, hd: 64, window: None, softcap: None, seqs: vec![(30, 1030), (1, 500)] },
        // Gemma 4's global layers: head dim 512, 8 query heads a KV head;
        // every row takes this kernel, a prompt's too.
        Case { bt: 16, heads: 8, kv_heads: 1, hd: 512, window: None, softcap: None, seqs: vec![(1, 1), (1, 900), (3, 40), (130, 300)] },
        Case { bt: 16, heads: 16, kv_heads: 2, hd: 512, window: Some(64), softcap: Some(30.0), seqs: vec![(1, 500), (70, 200)] },
    ];
    for c in &cases {
        run_attention_case(&d, &mut r, c, 1e-4);
    }
}

#[test]
fn prefill_attention_against_f64() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    // More rows: the tensor-core kernel (q and P rounded to bf16), its keys
    // split when few tiles walk many keys; the short sequences beside a
    // chunk keep the split-KV kernel.
    let cases = [
        Case { bt: 16, heads: 32, kv_heads: 8, hd: 64, window: None, softcap: None, seqs: vec![(200, 200)] },
        // One or two tiles at a long context: key splits, merged.
        Case { bt: 16, heads: 32, kv_heads: 8, hd: 64, window: None, softcap: None, seqs: vec![(1, 1500), (40, 2000)] },
        Case { bt: 16, heads: 8, kv_heads: 2, hd: 128, window: None, softcap: None, seqs: vec![(100, 3000)] },
        Case { bt: 16, heads: 4, kv_heads: 1, hd: 256, window: Some(700), softcap: Some(30.0), seqs: vec![(70, 2500)] },
        Case { bt: 16, heads: 8, kv_heads: 4, hd: 64, window: None, softcap: None, seqs: vec![(77, 500), (1, 20), (64, 64), (5, 9)] },
        Case { bt: 16, heads: 4, kv_heads: 2, hd: 128, window: None, softcap: None, seqs: vec![(130, 1000)] },
        Case { bt: 16, heads: 4, kv_heads: 1, hd: 256, window: Some(48), softcap: Some(30.0), seqs: vec![(150, 170)] },
        // A block size that is no power of two (the block-table lookup
        // divides), and a window cutting into a split chunk's keys.
        Case { bt: 24, heads: 32, kv_heads: 8, hd: 64, window: None, softcap: None, seqs: vec![(3, 900), (64, 1064)] },
        Case { bt: 16, heads: 8, kv_heads: 2, hd: 64, window: Some(700), softcap: None, seqs: vec![(50, 2500)] },
        // Packed rows (a query row and one of its KV head's heads) that
        // are no power of two a row (SmolLM2's 9 heads over 3), and one
        // head a KV head (packing changes nothing), beside other chunks.
        Case { bt: 16, heads: 9, kv_heads: 3, hd: 64, window: None, softcap: None, seqs: vec![(24, 1000), (37, 37), (100, 400)] },
        Case { bt: 16, heads: 4, kv_heads: 4, hd: 128, window: Some(90), softcap: None, seqs: vec![(70, 600), (19, 19)] },
        Case { bt: 16, heads: 12, kv_heads: 2, hd: 64, window: Some(33), softcap: None, seqs: vec![(45, 1200)] },
    ];
    for c in &cases {
        run_attention_case(&d, &mut r, c, 1.5e-2);
    }
}

/// A pool of two groups (layers 0 and 2 of 4 blocks, layer 1 of 2): a
/// copy in group 1 moves its layer's block and no other's, and a spec
/// naming a group without a block count is refused.
#[test]
fn kv_groups_hold_their_blocks_and_copy_apart() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let shape = KvShape { kv_heads: 1, head_dim: 64 };
    let spec = KvPoolSpec { block_tokens: 16, layers: vec![shape; 3], layer_groups: vec![0, 1, 0], group_blocks: vec![4, 2] };
    let mut pool = d.kv_pool(&spec, KvDtype::F16).unwrap();
    let (k, v) = (r.vec(16 * 64, 1.0), r.vec(16 * 64, 1.0));
    let (gk, gv) = (d.upload(&k, 16, 64).unwrap(), d.upload(&v, 16, 64).unwrap());
    let slots: Vec<u32> = (0..16).collect();
    for l in 0..3 {
        d.kv_write(&mut pool, l, &gk, &gv, &slots);
    }
    d.kv_copy_blocks(&mut pool, 1, &[0], &[1]);
    let q = d.upload(&r.vec(64, 1.0), 1, 64).unwrap();
    let attend = |pool: &CudaKv, l: usize, block: u32| {
        let mut out = poisoned(&d, 1, 64);
        d.attention(&q, pool, l, &[AttnSeq { q_start: 0, q_len: 1, kv_len: 16, blocks: &[block], window: None }], 0.125, None, &mut out);
        d.download(&out).unwrap()
    };
    assert_eq!(attend(&pool, 1, 1), attend(&pool, 1, 0), "group 1's layer copied");
    assert!(attend(&pool, 1, 1).iter().all(|x| x.is_finite()));
    // Group 0's layers kept block 1 as made (zeros): attention over it is zero.
    assert!(attend(&pool, 0, 1).iter().all(|&x| x == 0.0), "group 0 untouched by a copy in group 1");
    let bad = KvPoolSpec { layer_groups: vec![0, 2, 0], ..spec };
    assert!(d.kv_pool(&bad, KvDtype::F16).is_err(), "a layer in a group with no block count");
}

#[test]
fn kv_copy_blocks_copies_every_layer() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let spec = KvPoolSpec::new(4, 16, vec![KvShape { kv_heads: 2, head_dim: 64 }; 2]);
    let mut pool = d.kv_pool(&spec, KvDtype::F16).unwrap();
    let w = 128;
    let q = r.vec(8 * 64, 1.0);
    let gq = d.upload(&q, 1, 8 * 64).unwrap();
    for inside in [false, true] {
        let k = r.vec(16 * w, 1.0);
        let v = r.vec(16 * w, 1.0);
        let (gk, gv) = (d.upload(&k, 16, w).unwrap(), d.upload(&v, 16, w).unwrap());
        let slots: Vec<u32> = (16..32).collect();
        let mut ops = || {
            for l in 0..2 {
                d.kv_write(&mut pool, l, &gk, &gv, &slots);
            }
            d.kv_copy_blocks(&mut pool, 0, &[1], &[3]);
        };
        if inside {
            in_forward(&d, None, &mut ops).unwrap();
        } else {
            ops();
        }
        // Attend from block 3 and from block 1: identical outputs.
        for l in 0..2 {
            let mut a = poisoned(&d, 1, 512);
            let mut b = poisoned(&d, 1, 512);
            d.attention(&gq, &pool, l, &[AttnSeq { q_start: 0, q_len: 1, kv_len: 16, blocks: &[1], window: None }], 0.125, None, &mut a);
            d.attention(&gq, &pool, l, &[AttnSeq { q_start: 0, q_len: 1, kv_len: 16, blocks: &[3], window: None }], 0.125, None, &mut b);
            let (a, b) = (d.download(&a).unwrap(), d.download(&b).unwrap());
            assert!(a.iter().all(|v| v.is_finite()), "layer {l}: attention over the written block");
            assert_eq!(a, b, "layer {l} (copied inside a forward: {inside})");
        }
    }
}

// ---- fusion by op sequence: every group fused (and folded) against the
// same ops unfused ----

/// How a sequence of ops runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Each op called outside any forward: run at once, unfused.
    Plain,
    /// Inside a forward (no key): recorded, fused, run eagerly; no norm
    /// folded (the device never saw it in `prepare`).
    Fused,
    /// As `Fused`, after `prepare` saw the ops: norms folded into the
    /// products that alone read them.
    Folded,
    /// As `Folded`, as a keyed forward twice: recorded as a CUDA graph,
    /// then replayed (the replay's results kept).
    Graph,
}

const MODES: [Mode; 4] = [Mode::Plain, Mode::Fused, Mode::Folded, Mode::Graph];

/// Run `ops` as `mode` says; graph counts (replays, captures) added.
fn run_as(d: &Cuda, mode: Mode, key: u64, ops: &mut dyn FnMut()) -> (u64, u64) {
    let before = d.graph_stats();
    match mode {
        Mode::Plain => ops(),
        Mode::Fused => in_forward(d, None, ops).unwrap(),
        Mode::Folded => {
            prepare(d, ops);
            in_forward(d, None, ops).unwrap();
        }
        Mode::Graph => {
            prepare(d, ops);
            for _ in 0..2 {
                in_forward(d, Some(key), ops).unwrap();
            }
        }
    }
    d.sync().unwrap();
    let after = d.graph_stats();
    (after.0 - before.0, after.1 - before.1)
}

const GK: usize = 512;
const GHEADS: usize = 8;
const GKVH: usize = 2;
const GHD: usize = 64;
const GQ: usize = GHEADS * GHD;
const GKV: usize = GKVH * GHD;
/// The MLP's width: not a multiple of the GEMV's rows per block.
const GFF: usize = 1032;
/// Rows of the weight whose product checks a sum's bf16 copy.
const GX: usize = 48;
const GMAX: usize = 40;
const EPS: f32 = 1e-5;
/// The KV table the groups write (three blocks of 16, scattered).
const GTABLE: [u32; 3] = [6, 2, 5];

fn gspec(layers: usize) -> KvPoolSpec {
    KvPoolSpec::new(16, 16, vec![KvShape { kv_heads: GKVH, head_dim: GHD }; layers])
}

fn gslots(n: usize) -> Vec<u32> {
    (0..n).map(|i| GTABLE[i / 16] * 16 + (i % 16) as u32).collect()
}

/// Host values of the fusion-group tests: inputs for up to `GMAX` rows, and
/// one attention layer's and MLP's weights.
struct GHost {
    x: Vec<f32>,
    a: Vec<f32>,
    y: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    wg: Vec<f32>,
    wu: Vec<f32>,
    wd: Vec<f32>,
    wx: Vec<f32>,
    g_attn: Vec<f32>,
    g_ffn: Vec<f32>,
    qn: Vec<f32>,
    kn: Vec<f32>,
    probe: Vec<f32>,
}

impl GHost {
    fn new(r: &mut Rng) -> GHost {
        GHost {
            x: r.vec(GMAX * GK, 2.0),
            a: r.vec(GMAX * GQ, 1.0),
            y: r.vec(GMAX * GK, 1.0),
            wq: r.vec(GQ * GK, 0.05),
            wk: r.vec(GKV * GK, 0.05),
            wv: r.vec(GKV * GK, 0.05),
            wo: r.vec(GK * GQ, 0.05),
            wg: r.vec(GFF * GK, 0.05),
            wu: r.vec(GFF * GK, 0.05),
            wd: r.vec(GK * GFF, 0.05),
            wx: r.vec(GX * GK, 0.05),
            // Norm weights away from zero, as trained ones are.
            g_attn: r.vec(GK, 0.5).iter().map(|v| 1.0 + v).collect(),
            g_ffn: r.vec(GK, 0.5).iter().map(|v| 1.0 + v).collect(),
            qn: r.vec(GHD, 0.5).iter().map(|v| 1.0 + v).collect(),
            kn: r.vec(GHD, 0.5).iter().map(|v| 1.0 + v).collect(),
            probe: r.vec(3 * 16 * GQ, 1.0),
        }
    }
}

/// The device's copies of a `GHost`'s weights (each mode its own: `prepare`
/// folds norms into them).
struct GW {
    wq: W,
    wk: W,
    wv: W,
    wo: W,
    wg: W,
    wu: W,
    wd: W,
    wx: W,
    g_attn: T,
    g_ffn: T,
    qn: T,
    kn: T,
}

impl GW {
    fn new(d: &Cuda, h: &GHost) -> GW {
        let w = |v: &[f32], rows: usize| d.weight_from_f32(v, rows, v.len() / rows).unwrap();
        let t = |v: &[f32]| d.upload(v, 1, v.len()).unwrap();
        GW {
            wq: w(&h.wq, GQ),
            wk: w(&h.wk, GKV),
            wv: w(&h.wv, GKV),
            wo: w(&h.wo, GK),
            wg: w(&h.wg, GFF),
            wu: w(&h.wu, GFF),
            wd: w(&h.wd, GK),
            wx: w(&h.wx, GX),
            g_attn: t(&h.g_attn),
            g_ffn: t(&h.g_ffn),
            qn: t(&h.qn),
            kn: t(&h.kn),
        }
    }
}

/// A run's tensors: the inputs' sources (each forward copies them in
/// first, so a replay starts from the same values) and every output,
/// poisoned.
struct GT {
    x0: T,
    a0: T,
    y0: T,
    x: T,
    a: T,
    h: T,
    q: T,
    k: T,
    v: T,
    q_raw: T,
    k_raw: T,
    out: T,
    gate: T,
    up: T,
    act: T,
    y: T,
    pool: CudaKv,
}

impl GT {
    fn new(d: &Cuda, h: &GHost, rows: usize, layers: usize) -> GT {
        let p = || poisoned(d, 1, 1);
        GT {
            x0: d.upload(&h.x[..rows * GK], rows, GK).unwrap(),
            a0: d.upload(&h.a[..rows * GQ], rows, GQ).unwrap(),
            y0: d.upload(&h.y[..rows * GK], rows, GK).unwrap(),
            x: p(),
            a: p(),
            h: p(),
            q: p(),
            k: p(),
            v: p(),
            q_raw: p(),
            k_raw: p(),
            out: p(),
            gate: p(),
            up: p(),
            act: p(),
            y: p(),
            pool: d.kv_pool(&gspec(layers), KvDtype::F16).unwrap(),
        }
    }
}

/// Attention of `n` probe rows over the first `n` positions of `GTABLE` in
/// KV layer `layer` (row i sees positions 0..=i): what the pool holds there.
fn probe_kv(d: &Cuda, h: &GHost, pool: &CudaKv, layer: usize, n: usize) -> Vec<f32> {
    let q = d.upload(&h.probe[..n * GQ], n, GQ).unwrap();
    let mut out = poisoned(d, 1, 1);
    let seq = AttnSeq { q_start: 0, q_len: n, kv_len: n, blocks: &GTABLE, window: None };
    d.attention(&q, pool, layer, &[seq], 0.125, None, &mut out);
    d.download(&out).unwrap()
}

/// The fusion groups `fuse::plan` forms, as the primitive ops a model calls.
#[derive(Clone, Copy, Debug)]
enum Group {
    /// norm, q/k/v, RoPE of q and k, KV write: one GEMV for few rows
    /// (whole-head RoPE), else the products and `rope_kv`; `fewer`: fewer
    /// KV slots than rows.
    Qkv { neox: bool, dims: usize, fewer: bool },
    /// norm, gate and up, the activation: the gated GEMV (Silu, GeluTanh)
    /// or the products alone (other activations).
    Gated(Act),
    /// norm and a product of four weights (two GEMV launches).
    Products,
    /// a product added into the residual stream, then a product of the sum
    /// (which reads the sum's bf16 copy the fused store wrote).
    Resid,
    /// add then a whole-row norm (one kernel), the norm's output the result
    /// or read by a product (which takes the norm folded, after `prepare`).
    AddNorm { product: bool },
    /// norm, q/k/v, per-head q and k norms, RoPE + KV write in one kernel.
    QkNorm,
}

impl Group {
    fn slots(&self, rows: usize) -> usize {
        match self {
            Group::Qkv { fewer: true, .. } => (rows - 1).max(1),
            Group::Qkv { .. } | Group::QkNorm => rows,
            _ => 0,
        }
    }

    /// Whether `prepare` folds a norm into this group's products.
    fn folds(&self) -> bool {
        !matches!(self, Group::Resid | Group::AddNorm { product: false })
    }

    fn ops(&self, d: &Cuda, w: &GW, t: &mut GT, rows: usize, pos: &[u32], slots: &[u32]) {
        let all: Vec<usize> = (0..rows).collect();
        d.gather_rows(&t.x0, &all, &mut t.x);
        match *self {
            Group::Qkv { neox, dims, .. } => {
                let rope = Rope::new(10000.0, dims, neox);
                d.rms_norm(&t.x, &w.g_attn, EPS, &mut t.h);
                d.matmul(&t.h, &[&w.wq, &w.wk, &w.wv], &mut [&mut t.q, &mut t.k, &mut t.v]);
                d.rope(&mut t.q, pos, GHD, &rope);
                d.rope(&mut t.k, pos, GHD, &rope);
                d.kv_write(&mut t.pool, 0, &t.k, &t.v, slots);
            }
            Group::Gated(act) => {
                d.rms_norm(&t.x, &w.g_ffn, EPS, &mut t.h);
                d.matmul(&t.h, &[&w.wg, &w.wu], &mut [&mut t.gate, &mut t.up]);
                d.gated(act, &t.gate, &t.up, &mut t.act);
            }
            Group::Products => {
                d.rms_norm(&t.x, &w.g_attn, EPS, &mut t.h);
                d.matmul(&t.h, &[&w.wq, &w.wk, &w.wv, &w.wg], &mut [&mut t.q, &mut t.k, &mut t.v, &mut t.gate]);
            }
            Group::Resid => {
                d.gather_rows(&t.a0, &all, &mut t.a);
                d.matmul(&t.a, &[&w.wo], &mut [&mut t.out]);
                d.add(&mut t.x, &t.out);
                d.matmul(&t.x, &[&w.wx], &mut [&mut t.y]);
            }
            Group::AddNorm { product } => {
                d.gather_rows(&t.y0, &all, &mut t.out);
                d.add(&mut t.x, &t.out);
                d.rms_norm(&t.x, &w.g_ffn, EPS, &mut t.h);
                if product {
                    d.matmul(&t.h, &[&w.wx], &mut [&mut t.y]);
                }
            }
            Group::QkNorm => {
                let rope = Rope::new(10000.0, GHD, true);
                d.rms_norm(&t.x, &w.g_attn, EPS, &mut t.h);
                d.matmul(&t.h, &[&w.wq, &w.wk, &w.wv], &mut [&mut t.q_raw, &mut t.k_raw, &mut t.v]);
                d.rms_norm(&t.q_raw, &w.qn, EPS, &mut t.q);
                d.rms_norm(&t.k_raw, &w.kn, EPS, &mut t.k);
                d.rope(&mut t.q, pos, GHD, &rope);
                d.rope(&mut t.k, pos, GHD, &rope);
                d.kv_write(&mut t.pool, 0, &t.k, &t.v, slots);
            }
        }
    }

    /// What the group's ops leave that anything may read: its outputs (not
    /// the intermediates a fused kernel leaves unwritten) and the KV.
    fn results(&self, d: &Cuda, h: &GHost, t: &GT, nslots: usize) -> Vec<(&'static str, Vec<f32>)> {
        let get = |t: &T| d.download(t).unwrap();
        match self {
            Group::Qkv { .. } | Group::QkNorm => vec![("q", get(&t.q)), ("k", get(&t.k)), ("v", get(&t.v)), ("kv", probe_kv(d, h, &t.pool, 0, nslots))],
            Group::Gated(_) => vec![("act", get(&t.act))],
            Group::Products => vec![("q", get(&t.q)), ("k", get(&t.k)), ("v", get(&t.v)), ("gate", get(&t.gate))],
            Group::Resid => vec![("x", get(&t.x)), ("y", get(&t.y))],
            Group::AddNorm { product: false } => vec![("x", get(&t.x)), ("h", get(&t.h))],
            Group::AddNorm { product: true } => vec![("x", get(&t.x)), ("y", get(&t.y))],
        }
    }
}

/// One group at `rows` rows, run as `mode` on weights and tensors of its own.
fn run_group(d: &Cuda, h: &GHost, g: Group, mode: Mode, rows: usize, key: u64) -> (Vec<(&'static str, Vec<f32>)>, (u64, u64)) {
    let w = GW::new(d, h);
    let mut t = GT::new(d, h, rows, 1);
    let pos: Vec<u32> = (0..rows as u32).map(|i| 3 * i + 2).collect();
    let nslots = g.slots(rows);
    let slots = gslots(nslots);
    let stats = run_as(d, mode, key, &mut || g.ops(d, &w, &mut t, rows, &pos, &slots));
    (g.results(d, h, &t, nslots), stats)
}

/// For every fusion group at 1, 2 (the norm computed in the GEMV), 3, 4
/// (the norm kernel, then the GEMV), 6, 17 and 32 (the skinny GEMM) and 40
/// rows (cuBLAS): the ops inside a
/// forward, fused, equal them unfused (f32 rounding apart; bf16 gate and up
/// where the gated product takes cuBLAS), and with their norms folded at
/// `prepare` within bf16 rounding; the KV written the same; a keyed forward
/// (captured, then replayed as a CUDA graph) gives the eager folded bits.
#[test]
fn every_fusion_group_equals_the_unfused_ops() {
    let Some(d) = gpu() else { return };
    fusion_groups(&d, &[1, 2, 3, 4, 6, 17, 32, GMAX]);
    // Past the GEMV's rows, cuBLAS as well as the skinny GEMM.
    fusion_groups(&gpu_cublas(), &[6]);
}

fn fusion_groups(d: &Cuda, row_counts: &[usize]) {
    let mut r = Rng(seed());
    let h = GHost::new(&mut r);
    let groups = [
        Group::Qkv { neox: true, dims: GHD, fewer: false },
        Group::Qkv { neox: false, dims: GHD, fewer: true },
        Group::Qkv { neox: true, dims: GHD / 2, fewer: false },
        Group::Gated(Act::Silu),
        Group::Gated(Act::GeluTanh),
        Group::Gated(Act::Identity),
        Group::Products,
        Group::Resid,
        Group::AddNorm { product: false },
        Group::AddNorm { product: true },
        Group::QkNorm,
    ];
    let mut key = 0x9e37_79b9_u64;
    for g in groups {
        for &rows in row_counts {
            let gemv = rows <= d.gemv_max_rows();
            let cublas = !gemv && rows > d.tuning().skinny_max_rows;
            let mut runs = Vec::new();
            for mode in MODES {
                key += 1;
                let (res, stats) = run_group(d, &h, g, mode, rows, key);
                if mode == Mode::Graph {
                    assert!(stats.0 >= 1 && stats.0 + stats.1 == 2, "{g:?} {rows} rows: graph replays/captures {stats:?}");
                }
                runs.push(res);
            }
            let (plain, fused, folded, graph) = (&runs[0], &runs[1], &runs[2], &runs[3]);
            for i in 0..plain.len() {
                let name = plain[i].0;
                let kv = name == "kv";
                // Fused: the same values up to f32 rounding, but bf16 gate and
                // up between cuBLAS and the activation.
                let fused_tol = if kv {
                    2e-3
                } else if matches!(g, Group::Gated(Act::Silu | Act::GeluTanh)) && !gemv && cublas {
                    5e-3
                } else {
                    1e-5
                };
                // Folded: the norm's weight rounded into bf16 weights, and x
                // rounded before (in the GEMV) or after the 1/rms scale.
                let folded_tol = if !g.folds() {
                    fused_tol
                } else if kv {
                    2e-2
                } else {
                    1e-2
                };
                let ef = rel(&fused[i].1, &plain[i].1);
                let eo = rel(&folded[i].1, &plain[i].1);
                eprintln!("{g:?} {rows} rows, {name}: fused {ef:.1e}, folded {eo:.1e}");
                assert!(ef < fused_tol, "{g:?} {rows} rows, {name}: fused vs unfused rel err {ef} over {fused_tol}");
                assert!(eo < folded_tol, "{g:?} {rows} rows, {name}: folded vs unfused rel err {eo} over {folded_tol}");
                assert!(same_bits(&graph[i].1, &folded[i].1), "{g:?} {rows} rows, {name}: the graph's replay differs from the eager forward");
            }
        }
    }
}

/// Attention of probe rows over `seqs` in KV layer `layer`: what the pool
/// holds where the sequences read.
fn probe_seqs(d: &Cuda, h: &GHost, pool: &CudaKv, layer: usize, seqs: &[AttnSeq<'_>], rows: usize) -> Vec<f32> {
    let q = d.upload(&h.probe[..rows * GQ], rows, GQ).unwrap();
    let mut out = poisoned(d, 1, 1);
    d.attention(&q, pool, layer, seqs, 0.125, None, &mut out);
    d.download(&out).unwrap()
}

/// Two Llama layers (norm, q/k/v + RoPE + KV, attention over a context
/// already in the pool, the output product into the residual, norm, gated
/// MLP, down product into the residual), then a head (norm, product):
/// every group beside the others, the bf16 copies passed from one to the
/// next. At 1–4 decode rows (one sequence each), prefills of two sequences
/// (6 to 40 rows) and a mixed round (`GMIXED`): fused and folded forwards
/// and a replayed graph against the ops unfused; the KV of both layers too.
#[test]
fn llama_layers_fused_equal_the_unfused_ops() {
    let Some(d) = gpu() else { return };
    llama_layers(&d, &[1, 2, 3, 4, 6, 17, 32, GMIXED, GMAX], seed());
    // Past the GEMV's rows, cuBLAS as well as the skinny GEMM.
    llama_layers(&gpu_cublas(), &[6], seed());
}

/// Branches (cuBLAS products of one input, and a chunk's attention beside
/// the decode rows', on streams of their own) change no bit of a mixed
/// round's results, eager or replayed.
#[test]
fn branches_change_no_bits() {
    let Some(d) = gpu() else { return };
    let s = seed();
    let one = Cuda::with_tuning(0, Tuning { branches: false, ..d.tuning().clone() }).unwrap();
    let (side, alone) = (llama_layers(&d, &[GMIXED], s), llama_layers(&one, &[GMIXED], s));
    for ((name, a), (_, b)) in side.iter().zip(&alone) {
        assert!(same_bits(a, b), "{GMIXED} rows, {name}: branches changed the results");
    }
}

/// Rows of a mixed round in `llama_layers`: three decode rows and a
/// 34-row chunk (past the skinny GEMM's rows, and the chunk past the
/// decode attention's with two KV heads).
const GMIXED: usize = 37;

/// `llama_layers_fused_equal_the_unfused_ops` at `row_counts`, inputs from
/// `seed`: the eager folded results of the last row count.
fn llama_layers(d: &Cuda, row_counts: &[usize], seed: u64) -> Vec<(&'static str, Vec<f32>)> {
    let mut r = Rng(seed);
    let mut last = Vec::new();
    let hosts = [GHost::new(&mut r), GHost::new(&mut r)];
    let ctx_kv: Vec<Vec<f32>> = (0..4).map(|_| r.vec(64 * GKV, 1.0)).collect();
    let mut key = 0x51ab_u64;
    for &rows in row_counts {
        // (q_len, context before) per sequence; sequence i owns blocks 4i..4i+4.
        let seqs_spec: Vec<(usize, usize)> = match rows {
            ..=4 => (0..rows).map(|i| (1, [5, 21, 33, 2][i])).collect(),
            GMIXED => vec![(1, 5), (1, 21), (1, 33), (rows - 3, 3)],
            _ => vec![(rows * 5 / 8, 3), (rows - rows * 5 / 8, 20)],
        };
        let tables: Vec<Vec<u32>> = (0..seqs_spec.len() as u32).map(|s| (4 * s..4 * s + 4).collect()).collect();
        let slot = |s: usize, p: usize| tables[s][p / 16] * 16 + (p % 16) as u32;
        let (mut pos, mut slots, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        for (s, &(ql, ctx)) in seqs_spec.iter().enumerate() {
            for j in 0..ql {
                pos.push((ctx + j) as u32);
                slots.push(slot(s, ctx + j));
            }
            seqs.push(AttnSeq { q_start: start, q_len: ql, kv_len: ctx + ql, blocks: &tables[s], window: None });
            start += ql;
        }
        let mut runs = Vec::new();
        for mode in MODES {
            key += 1;
            let ws = [GW::new(d, &hosts[0]), GW::new(d, &hosts[1])];
            let g_head = d.upload(&hosts[1].g_attn, 1, GK).unwrap();
            let mut t = GT::new(d, &hosts[0], rows, 2);
            // The context, in every mode alike (outside any forward).
            for l in 0..2 {
                for (s, &(_, ctx)) in seqs_spec.iter().enumerate() {
                    let kv = d.upload(&ctx_kv[s][..ctx * GKV], ctx, GKV).unwrap();
                    let cs: Vec<u32> = (0..ctx).map(|p| slot(s, p)).collect();
                    d.kv_write(&mut t.pool, l, &kv, &kv, &cs);
                }
            }
            let rope = Rope::new(10000.0, GHD, true);
            let all: Vec<usize> = (0..rows).collect();
            let stats = run_as(d, mode, key, &mut || {
                d.gather_rows(&t.x0, &all, &mut t.x);
                for (l, w) in ws.iter().enumerate() {
                    d.rms_norm(&t.x, &w.g_attn, EPS, &mut t.h);
                    d.matmul(&t.h, &[&w.wq, &w.wk, &w.wv], &mut [&mut t.q, &mut t.k, &mut t.v]);
                    d.rope(&mut t.q, &pos, GHD, &rope);
                    d.rope(&mut t.k, &pos, GHD, &rope);
                    d.kv_write(&mut t.pool, l, &t.k, &t.v, &slots);
                    d.attention(&t.q, &t.pool, l, &seqs, 0.125, None, &mut t.a);
                    d.matmul(&t.a, &[&w.wo], &mut [&mut t.out]);
                    d.add(&mut t.x, &t.out);
                    d.rms_norm(&t.x, &w.g_ffn, EPS, &mut t.h);
                    d.matmul(&t.h, &[&w.wg, &w.wu], &mut [&mut t.gate, &mut t.up]);
                    d.gated(Act::Silu, &t.gate, &t.up, &mut t.act);
                    d.matmul(&t.act, &[&w.wd], &mut [&mut t.out]);
                    d.add(&mut t.x, &t.out);
                }
                d.rms_norm(&t.x, &g_head, EPS, &mut t.h);
                d.matmul(&t.h, &[&ws[1].wx], &mut [&mut t.y]);
            });
            if mode == Mode::Graph {
                assert!(stats.0 >= 1, "{rows} rows: no graph replayed ({stats:?})");
            }
            runs.push(vec![
                ("x", d.download(&t.x).unwrap()),
                ("head", d.download(&t.y).unwrap()),
                ("kv layer 0", probe_seqs(d, &hosts[1], &t.pool, 0, &seqs, rows)),
                ("kv layer 1", probe_seqs(d, &hosts[1], &t.pool, 1, &seqs, rows)),
            ]);
        }
        let (plain, fused, folded, graph) = (&runs[0], &runs[1], &runs[2], &runs[3]);
        // Few rows: f32 rounding, and a bf16 KV value rounding the other
        // way; the prefill also hands bf16 gate and up to the activation.
        let (fused_tol, folded_tol) = if rows <= d.gemv_max_rows() { (2e-3, 3e-2) } else { (2e-2, 3e-2) };
        for i in 0..plain.len() {
            let name = plain[i].0;
            let (ef, eo) = (rel(&fused[i].1, &plain[i].1), rel(&folded[i].1, &plain[i].1));
            eprintln!("two Llama layers, {rows} rows, {name}: fused {ef:.1e}, folded {eo:.1e}");
            assert!(ef < fused_tol, "two Llama layers, {rows} rows, {name}: fused vs unfused rel err {ef} over {fused_tol}");
            assert!(eo < folded_tol, "two Llama layers, {rows} rows, {name}: folded vs unfused rel err {eo} over {folded_tol}");
            assert!(same_bits(&graph[i].1, &folded[i].1), "two Llama layers, {rows} rows, {name}: the graph's replay differs from the eager forward");
        }
        last = runs.swap_remove(2);
    }
    last
}

/// An RMSNorm folded into the products that read it, against f64 over the
/// operands the device uses: the norm's weight goes into the weights'
/// columns once at `prepare` (as bf16), and the GEMV (1–2 rows) scales each
/// row's sums by 1/rms of x; more rows take the norm (unit weight), then
/// the GEMV (3–4) or the GEMM. Then a residual add in the store of the
/// product that makes it (and its bf16 copy, which the next product reads),
/// and q, k, v with the norm folded and RoPE in the store against the plain
/// ops on weights folded on the host.
#[test]
fn norm_and_residual_folds_against_f64() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let (k, eps, mg) = (2048, 1e-5f32, 1030);
    let g = r.vec(k, 1.5);
    let gg = d.upload(&g, 1, k).unwrap();
    let (wg, wu) = (r.vec(mg * k, 0.05), r.vec(mg * k, 0.05));
    let (gwg, gwu) = (d.weight_from_f32(&wg, mg, k).unwrap(), d.weight_from_f32(&wu, mg, k).unwrap());
    // The folded weights, as the device makes them.
    let fold = |w: &[f32]| -> Vec<f32> { w.iter().enumerate().map(|(i, &v)| rbf(rbf(v) * g[i % k])).collect() };
    let (fg, fu) = (fold(&wg), fold(&wu));
    let fold_rows = d.tuning().norm_fold_rows;
    for rows in [1usize, 2, 3, 4, 5, 8, 40, 300] {
        let gemv = rows <= d.gemv_max_rows();
        // Past the skinny GEMM's rows, cuBLAS hands the activation bf16 gate and up.
        let cublas = !gemv && rows > d.tuning().skinny_max_rows;
        // Rows whose norm the GEMV computes itself.
        let in_gemv = gemv && rows <= fold_rows;
        let x = r.vec(rows * k, 2.0);
        let gx = d.upload(&x, rows, k).unwrap();
        let inv: Vec<f32> = x.chunks(k).map(|row| 1.0 / (row.iter().map(|&v| v * v).sum::<f32>() / k as f32 + eps).sqrt()).collect();
        // What the product reads, and what scales its sums.
        let (xin, post): (Vec<f32>, Vec<f64>) = if in_gemv {
            (x.iter().map(|&v| rbf(v)).collect(), inv.iter().map(|&s| s as f64).collect())
        } else {
            (x.iter().enumerate().map(|(i, &v)| rbf(v * inv[i / k])).collect(), vec![1.0; rows])
        };
        let scaled = |y: Vec<f64>| -> Vec<f64> { y.iter().enumerate().map(|(i, &v)| v * post[i / mg]).collect() };
        let (gs, us) = (scaled(mm_exact_x(&xin, &fg, rows, k, mg)), scaled(mm_exact_x(&xin, &fu, rows, k, mg)));
        let (mut normed, mut gate, mut up, mut out) = (poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1));
        let mut ops = || {
            d.rms_norm(&gx, &gg, eps, &mut normed);
            d.matmul(&normed, &[&gwg, &gwu], &mut [&mut gate, &mut up]);
            d.gated(Act::Silu, &gate, &up, &mut out);
        };
        // (Folding twice with the same norm folds once.)
        prepare(&d, &mut ops);
        in_forward(&d, None, &mut ops).unwrap();
        let round = |v: f64| if cublas { rbf(v as f32) as f64 } else { v };
        let want: Vec<f32> = gs.iter().zip(&us).map(|(&a, &b)| (silu(round(a)) * round(b)) as f32).collect();
        let e = rel(&d.download(&out).unwrap(), &want);
        eprintln!("norm + gated product folded, {rows} rows ({mg}x{k}): rel err {e:.2e}");
        // (The norm kernel's 1/rms and the host's can round x / rms to
        // neighbouring bf16 values.)
        let tol = if in_gemv {
            1e-4
        } else if gemv {
            1e-3
        } else {
            5e-3
        };
        assert!(e < tol, "norm + gated product folded, {rows} rows: rel err {e}");
    }
    // acc += x · wᵀ in the product's store: long rows, odd widths, and past
    // the GEMV's rows (the skinny GEMM adding in its store, and cuBLAS with
    // beta = 1); the sum's bf16 copy feeds the next product.
    for (rows, k, m) in [(1usize, 32768usize, 64usize), (3, 1536, 700), (4, 8192, 256), (9, 1536, 700), (40, 2048, 300), (300, 512, 300)] {
        let (x, w, acc) = (r.vec(rows * k, 1.0), r.vec(m * k, 0.05), r.vec(rows * m, 1.0));
        let (gx, gw) = (d.upload(&x, rows, k).unwrap(), d.weight_from_f32(&w, m, k).unwrap());
        let mut gacc = d.upload(&acc, rows, m).unwrap();
        let w2 = r.vec(32 * m, 0.05);
        let gw2 = d.weight_from_f32(&w2, 32, m).unwrap();
        let (mut tmp, mut out2) = (poisoned(&d, 1, 1), poisoned(&d, 1, 1));
        in_forward(&d, None, &mut || {
            d.matmul(&gx, &[&gw], &mut [&mut tmp]);
            d.add(&mut gacc, &tmp);
            d.matmul(&gacc, &[&gw2], &mut [&mut out2]);
        })
        .unwrap();
        let want: Vec<f32> = mm_ref(&x, &w, rows, k, m).iter().zip(&acc).map(|(&p, &a)| (p + a as f64) as f32).collect();
        let e = rel(&d.download(&gacc).unwrap(), &want);
        eprintln!("product into the residual, {rows} rows ({m}x{k}): rel err {e:.2e}");
        assert!(e < 1e-4, "product into the residual, {rows} rows ({m}x{k}): rel err {e}");
        let want2 = f32s(&mm_ref(&want, &w2, rows, m, 32));
        let e = rel(&d.download(&out2).unwrap(), &want2);
        assert!(e < 1e-3, "product of the residual sum, {rows} rows: rel err {e}");
    }
    // q, k, v with the norm folded and RoPE in the store, against the plain
    // ops on the host-folded weights and the unit-weight norm.
    let (heads, kvh, hd) = (8, 2, 64);
    let ws: Vec<Vec<f32>> = [heads * hd, kvh * hd, kvh * hd].iter().map(|&m| r.vec(m * k, 0.05)).collect();
    let gws: Vec<W> = ws.iter().map(|w| d.weight_from_f32(w, w.len() / k, k).unwrap()).collect();
    let pws: Vec<W> = ws.iter().map(|w| d.weight_from_f32(&fold(w), w.len() / k, k).unwrap()).collect();
    let ones = d.upload(&vec![1.0; k], 1, k).unwrap();
    let spec = KvPoolSpec::new(4, 16, vec![KvShape { kv_heads: kvh, head_dim: hd }]);
    let rope = Rope::new(10000.0, hd, true);
    let probe_q = r.vec(heads * hd, 1.0);
    for rows in [1usize, 2, 3, 6] {
        let x = d.upload(&r.vec(rows * k, 2.0), rows, k).unwrap();
        let pos: Vec<u32> = (0..rows as u32).map(|i| 3 * i + 2).collect();
        let slots: Vec<u32> = (0..rows as u32).map(|i| 16 + i).collect();
        let mut outs = Vec::new();
        for fused in [true, false] {
            let mut pool = d.kv_pool(&spec, KvDtype::F16).unwrap();
            let (mut h, mut q, mut kk, mut v) = (poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1));
            let (norm, wts) = if fused { (&gg, &gws) } else { (&ones, &pws) };
            let mut ops = || {
                d.rms_norm(&x, norm, eps, &mut h);
                d.matmul(&h, &[&wts[0], &wts[1], &wts[2]], &mut [&mut q, &mut kk, &mut v]);
                d.rope(&mut q, &pos, hd, &rope);
                d.rope(&mut kk, &pos, hd, &rope);
                d.kv_write(&mut pool, 0, &kk, &v, &slots);
            };
            if fused {
                prepare(&d, &mut ops);
                in_forward(&d, None, &mut ops).unwrap();
            } else {
                ops();
            }
            let probe = d.upload(&probe_q, 1, heads * hd).unwrap();
            let mut att = poisoned(&d, 1, 1);
            let seq = AttnSeq { q_start: 0, q_len: 1, kv_len: 16 + rows, blocks: &[3, 1], window: None };
            d.attention(&probe, &pool, 0, &[seq], 0.125, None, &mut att);
            outs.push([d.download(&q).unwrap(), d.download(&kk).unwrap(), d.download(&v).unwrap(), d.download(&att).unwrap()]);
        }
        // bf16(x) scaled after the sums against bf16(x / rms): rounding
        // apart; the KV written too (attention over it).
        for (i, name) in ["q", "k", "v", "attention over the KV"].iter().enumerate() {
            let e = rel(&outs[0][i], &outs[1][i]);
            let tol = if i == 3 { 1e-2 } else { 4e-3 };
            eprintln!("q/k/v with the norm folded, {rows} rows: {name} rel err {e:.2e}");
            assert!(e < tol, "q/k/v with the norm folded, {rows} rows: {name} rel err {e}");
        }
    }
}

/// After `prepare` folded a norm's weight into the products that read it,
/// those weights serve only that norm: read any other way they give an
/// error, never a wrong answer: outside a forward; inside one without the
/// norm, after another norm, with an op between, with the norm's output
/// read again later; as a gated product, a residual product and q/k/v
/// without it; at few rows and many. Each case on a device of its own (an
/// error kept stops later ops); the same weights with their norm work.
#[test]
fn folded_weights_are_refused_without_their_norm() {
    if gpu().is_none() {
        return;
    }
    let mut r = Rng(seed());
    let h = GHost::new(&mut r);
    type Case = fn(&Cuda, &GW, &mut GT, usize);
    let cases: [(&str, bool, Case); 9] = [
        ("outside a forward", false, |d, w, t, _| d.matmul(&t.x0, &[&w.wq], &mut [&mut t.q])),
        ("without the norm", true, |d, w, t, _| d.matmul(&t.x0, &[&w.wq], &mut [&mut t.q])),
        ("after another norm", true, |d, w, t, _| {
            d.rms_norm(&t.x0, &w.g_ffn, EPS, &mut t.h);
            d.matmul(&t.h, &[&w.wq], &mut [&mut t.q]);
        }),
        ("with an op between", true, |d, w, t, _| {
            d.rms_norm(&t.x0, &w.g_attn, EPS, &mut t.h);
            d.map(&mut t.h, Map::Scale(1.0));
            d.matmul(&t.h, &[&w.wq], &mut [&mut t.q]);
        }),
        ("with the norm's output read again", true, |d, w, t, _| {
            d.rms_norm(&t.x0, &w.g_attn, EPS, &mut t.h);
            d.matmul(&t.h, &[&w.wq], &mut [&mut t.q]);
            d.add(&mut t.q, &t.h);
        }),
        ("as a gated product without the norm", true, |d, w, t, _| {
            d.matmul(&t.x0, &[&w.wg, &w.wu], &mut [&mut t.gate, &mut t.up]);
            d.gated(Act::Silu, &t.gate, &t.up, &mut t.act);
        }),
        ("as a residual product", true, |d, w, t, rows| {
            let all: Vec<usize> = (0..rows).collect();
            d.gather_rows(&t.x0, &all, &mut t.x);
            d.matmul(&t.x0, &[&w.wq], &mut [&mut t.out]);
            d.add(&mut t.x, &t.out);
        }),
        ("as q/k/v with RoPE and the KV write, without the norm", true, |d, w, t, rows| {
            let pos: Vec<u32> = (0..rows as u32).collect();
            let rope = Rope::new(10000.0, GHD, true);
            d.matmul(&t.x0, &[&w.wq, &w.wk, &w.wv], &mut [&mut t.q, &mut t.k, &mut t.v]);
            d.rope(&mut t.q, &pos, GHD, &rope);
            d.rope(&mut t.k, &pos, GHD, &rope);
            d.kv_write(&mut t.pool, 0, &t.k, &t.v, &gslots(rows));
        }),
        ("outside a forward, as a gated product", false, |d, w, t, _| {
            d.rms_norm(&t.x0, &w.g_ffn, EPS, &mut t.h);
            d.matmul(&t.h, &[&w.wg, &w.wu], &mut [&mut t.gate, &mut t.up]);
        }),
    ];
    for rows in [1usize, 3, GMAX] {
        for (what, inside, case) in cases {
            let d = gpu().unwrap();
            let w = GW::new(&d, &h);
            let mut t = GT::new(&d, &h, rows, 1);
            // The forward the device saw: each norm read by its products alone.
            let pos: Vec<u32> = (0..rows as u32).collect();
            let slots = gslots(rows);
            let rope = Rope::new(10000.0, GHD, true);
            let served = |t: &mut GT| {
                d.rms_norm(&t.x0, &w.g_attn, EPS, &mut t.h);
                d.matmul(&t.h, &[&w.wq, &w.wk, &w.wv], &mut [&mut t.q, &mut t.k, &mut t.v]);
                d.rope(&mut t.q, &pos, GHD, &rope);
                d.rope(&mut t.k, &pos, GHD, &rope);
                d.kv_write(&mut t.pool, 0, &t.k, &t.v, &slots);
                d.rms_norm(&t.x0, &w.g_ffn, EPS, &mut t.h);
                d.matmul(&t.h, &[&w.wg, &w.wu], &mut [&mut t.gate, &mut t.up]);
                d.gated(Act::Silu, &t.gate, &t.up, &mut t.act);
            };
            prepare(&d, &mut || served(&mut t));
            // With their norms, the folded weights work.
            in_forward(&d, None, &mut || served(&mut t)).unwrap();
            assert!(d.download(&t.act).unwrap().iter().all(|v| v.is_finite()), "{rows} rows: the folded forward itself");
            t.q = poisoned(&d, rows, GQ);
            t.act = poisoned(&d, rows, GFF);
            if inside {
                let res = in_forward(&d, None, &mut || case(&d, &w, &mut t, rows));
                let err = res.expect_err(&format!("{what}, {rows} rows: a folded weight was read without its norm, and the forward ran"));
                eprintln!("{what}, {rows} rows: refused: {err:#}");
                // Nothing of it ran: the outputs keep their poison.
                for (name, out) in [("q", &t.q), ("act", &t.act)] {
                    let v = d.download(out).unwrap();
                    assert!(v.iter().all(|x| x.is_nan()), "{what}, {rows} rows: {name} was written by a refused forward");
                }
            } else {
                case(&d, &w, &mut t, rows);
                assert!(d.sync().is_err(), "{what}, {rows} rows: a folded weight was read without its norm, and no error was kept");
            }
        }
    }
}

/// A forward that reads values back mid-way (MoE routing) runs what it
/// recorded so far at the read, and the rest at its end: the values read
/// and its results equal the ops unfused, fused and with norms folded;
/// Gemma 4's router pattern among them (a norm read by the router's product
/// alone, the routing read back right after). Such a forward is never a
/// graph, nor is any forward on the device after it.
#[test]
fn a_forward_that_reads_back_midway_equals_the_plain_ops() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let h = GHost::new(&mut r);
    let n_exp = 8;
    let wr = r.vec(n_exp * GK, 0.05);
    let we = r.vec(GK * GK, 0.05);
    let g_r: Vec<f32> = r.vec(GK, 0.5).iter().map(|v| 1.0 + v).collect();
    let g_m: Vec<f32> = r.vec(GK, 0.5).iter().map(|v| 1.0 + v).collect();
    let rope = Rope::new(10000.0, GHD, true);
    let mut key = 0x7ead_u64;
    for rows in [1usize, 2, 4, GMAX] {
        let pos: Vec<u32> = (0..rows as u32).map(|i| 2 * i + 1).collect();
        let slots = gslots(rows);
        let mut runs = Vec::new();
        for mode in [Mode::Plain, Mode::Fused, Mode::Folded, Mode::Graph] {
            key += 1;
            let w = GW::new(&d, &h);
            let (gwr, gwe) = (d.weight_from_f32(&wr, n_exp, GK).unwrap(), d.weight_from_f32(&we, GK, GK).unwrap());
            let (gg_r, gg_m) = (d.upload(&g_r, 1, GK).unwrap(), d.upload(&g_m, 1, GK).unwrap());
            let mut t = GT::new(&d, &h, rows, 1);
            let (mut rn, mut mn, mut logits, mut xe, mut ye, mut dense) =
                (poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1));
            let mut read: Vec<f32> = Vec::new();
            let all: Vec<usize> = (0..rows).collect();
            let stats = run_as(&d, mode, key, &mut || {
                d.gather_rows(&t.x0, &all, &mut t.x);
                d.rms_norm(&t.x, &w.g_attn, EPS, &mut t.h);
                d.matmul(&t.h, &[&w.wq, &w.wk, &w.wv], &mut [&mut t.q, &mut t.k, &mut t.v]);
                d.rope(&mut t.q, &pos, GHD, &rope);
                d.rope(&mut t.k, &pos, GHD, &rope);
                d.kv_write(&mut t.pool, 0, &t.k, &t.v, &slots);
                d.matmul(&t.q, &[&w.wo], &mut [&mut t.out]);
                d.add(&mut t.x, &t.out);
                // A dense MLP whose norm's output is written again only after the read.
                d.rms_norm(&t.x, &w.g_ffn, EPS, &mut t.h);
                d.matmul(&t.h, &[&w.wg, &w.wu], &mut [&mut t.gate, &mut t.up]);
                d.gated(Act::GeluTanh, &t.gate, &t.up, &mut t.act);
                d.matmul(&t.act, &[&w.wd], &mut [&mut dense]);
                // Gemma 4's router: its own norm, the routing read back at once.
                d.rms_norm(&t.x, &gg_r, EPS, &mut rn);
                d.matmul(&rn, &[&gwr], &mut [&mut logits]);
                d.rms_norm(&t.x, &gg_m, EPS, &mut mn);
                read = d.download(&logits).unwrap();
                // Route every other row, weighted by what was read back (a
                // smooth function of it: the modes' rounding apart, no row
                // flips to another expert).
                let idx: Vec<u32> = (0..rows as u32).step_by(2).collect();
                let wts: Vec<f32> = idx.iter().map(|&i| 0.5 + 0.5 * read[i as usize * n_exp].tanh()).collect();
                let idx_rows: Vec<usize> = idx.iter().map(|&i| i as usize).collect();
                d.gather_rows(&mn, &idx_rows, &mut xe);
                d.matmul(&xe, &[&gwe], &mut [&mut ye]);
                d.scatter_add_rows(&mut dense, &ye, &idx, &wts).unwrap();
                d.add(&mut t.x, &dense);
                d.rms_norm(&t.x, &w.g_attn, EPS, &mut t.h);
                d.matmul(&t.h, &[&w.wx], &mut [&mut t.y]);
            });
            if mode == Mode::Graph {
                assert_eq!(stats.1, 0, "a forward that reads back was recorded as a graph");
            }
            runs.push(vec![
                ("read back", read.clone()),
                ("x", d.download(&t.x).unwrap()),
                ("y", d.download(&t.y).unwrap()),
                ("kv", probe_kv(&d, &h, &t.pool, 0, rows)),
            ]);
        }
        let fused_tol = if rows <= d.gemv_max_rows() { 2e-3 } else { 1e-2 };
        for (i, (name, want)) in runs[0].iter().enumerate() {
            for (m, tol) in [(1, fused_tol), (2, 3e-2), (3, 3e-2)] {
                let e = rel(&runs[m][i].1, want);
                eprintln!("read back mid-forward, {rows} rows, {name}: {:?} vs unfused {e:.1e}", MODES[m]);
                assert!(e < tol, "read back mid-forward, {rows} rows, {name}: {:?} vs unfused rel err {e} over {tol}", MODES[m]);
            }
        }
    }
    // Once a forward read back, keyed forwards run eagerly: no capture.
    let before = d.graph_stats();
    let x = d.upload(&h.x[..GK], 1, GK).unwrap();
    let w = d.weight_from_f32(&h.wx, GX, GK).unwrap();
    let mut y = poisoned(&d, 1, 1);
    for _ in 0..3 {
        in_forward(&d, Some(0xfeed), &mut || d.matmul(&x, &[&w], &mut [&mut y])).unwrap();
    }
    assert_eq!(d.graph_stats(), before, "graphs after a forward read values back");
    assert!(rel(&d.download(&y).unwrap(), &f32s(&mm_ref(&h.x[..GK], &h.wx, 1, GK, GX))) < 1e-4);
}

// ---- a small model's forwards: graphs, and forwards done ahead ----

const MV: usize = 500;
const MH: usize = 256;
const MHEADS: usize = 4;
const MKVH: usize = 2;
const MHD: usize = 64;
const MFF: usize = 512;

/// A one-layer Llama with an embedding table and its own head.
struct Mini {
    emb: W,
    wq: W,
    wk: W,
    wv: W,
    wo: W,
    wg: W,
    wu: W,
    wd: W,
    head: W,
    norms: [T; 3],
}

/// The host values of a `Mini` (each copy on the device made from them).
struct MiniHost(Vec<Vec<f32>>);

impl MiniHost {
    fn new(r: &mut Rng) -> MiniHost {
        let shapes = [(MV, MH), (MHEADS * MHD, MH), (MKVH * MHD, MH), (MKVH * MHD, MH), (MH, MHEADS * MHD), (MFF, MH), (MFF, MH), (MH, MFF), (MV, MH)];
        let mut v: Vec<Vec<f32>> = shapes.iter().map(|&(a, b)| r.vec(a * b, if a == MV { 1.0 } else { 0.08 })).collect();
        for _ in 0..3 {
            v.push(r.vec(MH, 0.5).iter().map(|x| 1.0 + x).collect());
        }
        MiniHost(v)
    }

    fn on(&self, d: &Cuda) -> Mini {
        let v = &self.0;
        let w = |i: usize, rows: usize| d.weight_from_f32(&v[i], rows, v[i].len() / rows).unwrap();
        let n = |i: usize| d.upload(&v[i], 1, MH).unwrap();
        Mini {
            emb: w(0, MV),
            wq: w(1, MHEADS * MHD),
            wk: w(2, MKVH * MHD),
            wv: w(3, MKVH * MHD),
            wo: w(4, MH),
            wg: w(5, MFF),
            wu: w(6, MFF),
            wd: w(7, MH),
            head: w(8, MV),
            norms: [n(9), n(10), n(11)],
        }
    }
}

struct MiniScratch {
    x: T,
    h: T,
    q: T,
    k: T,
    v: T,
    att: T,
    out: T,
    gate: T,
    up: T,
    act: T,
    last: T,
    logits: T,
}

impl MiniScratch {
    fn new(d: &Cuda) -> MiniScratch {
        let t = || d.tensor(0, 0);
        MiniScratch { x: t(), h: t(), q: t(), k: t(), v: t(), att: t(), out: t(), gate: t(), up: t(), act: t(), last: t(), logits: t() }
    }
}

/// Streams of a `Mini` batch: each stream's block table (four blocks, so a
/// round never changes it) and length.
struct Streams {
    tables: Vec<Vec<u32>>,
    lens: Vec<usize>,
}

/// One forward's host arrays over the streams, one token each at its length.
struct MiniBatch {
    pos: Vec<u32>,
    slots: Vec<u32>,
    kv_lens: Vec<usize>,
    rows: Vec<usize>,
}

impl Streams {
    fn batch(&self) -> MiniBatch {
        let n = self.lens.len();
        MiniBatch {
            pos: self.lens.iter().map(|&l| l as u32).collect(),
            slots: (0..n).map(|s| self.tables[s][self.lens[s] / 16] * 16 + (self.lens[s] % 16) as u32).collect(),
            kv_lens: self.lens.iter().map(|&l| l + 1).collect(),
            rows: (0..n).collect(),
        }
    }
}

impl MiniBatch {
    /// What `Forward::key` hashes: everything but the token ids.
    fn key(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&self.pos, &self.slots, &self.kv_lens).hash(&mut h);
        h.finish()
    }
}

fn mini_forward(d: &Cuda, m: &Mini, tokens: &[u32], b: &MiniBatch, tables: &[Vec<u32>], kv: &mut CudaKv, s: &mut MiniScratch) {
    let rope = Rope::new(10000.0, MHD, true);
    let seqs: Vec<AttnSeq> = (0..tokens.len()).map(|i| AttnSeq { q_start: i, q_len: 1, kv_len: b.kv_lens[i], blocks: &tables[i], window: None }).collect();
    d.embed(&m.emb, tokens, 1.0, &mut s.x);
    d.rms_norm(&s.x, &m.norms[0], EPS, &mut s.h);
    d.matmul(&s.h, &[&m.wq, &m.wk, &m.wv], &mut [&mut s.q, &mut s.k, &mut s.v]);
    d.rope(&mut s.q, &b.pos, MHD, &rope);
    d.rope(&mut s.k, &b.pos, MHD, &rope);
    d.kv_write(kv, 0, &s.k, &s.v, &b.slots);
    d.attention(&s.q, kv, 0, &seqs, 0.125, None, &mut s.att);
    d.matmul(&s.att, &[&m.wo], &mut [&mut s.out]);
    d.add(&mut s.x, &s.out);
    d.rms_norm(&s.x, &m.norms[1], EPS, &mut s.h);
    d.matmul(&s.h, &[&m.wg, &m.wu], &mut [&mut s.gate, &mut s.up]);
    d.gated(Act::Silu, &s.gate, &s.up, &mut s.act);
    d.matmul(&s.act, &[&m.wd], &mut [&mut s.out]);
    d.add(&mut s.x, &s.out);
    d.gather_rows(&s.x, &b.rows, &mut s.last);
    d.rms_norm(&s.last, &m.norms[2], EPS, &mut s.h);
    d.matmul(&s.h, &[&m.head], &mut [&mut s.logits]);
}

/// A `Mini` on the device with its pool and scratch, three streams of
/// given context lengths (their KV filled by one-token forwards).
struct MiniRun {
    m: Mini,
    kv: CudaKv,
    s: MiniScratch,
    st: Streams,
}

impl MiniRun {
    fn new(d: &Cuda, host: &MiniHost, prepared: bool, lens: &[usize]) -> MiniRun {
        let m = host.on(d);
        let spec = KvPoolSpec::new(16, 16, vec![KvShape { kv_heads: MKVH, head_dim: MHD }]);
        let mut run = MiniRun { m, kv: d.kv_pool(&spec, KvDtype::F16).unwrap(), s: MiniScratch::new(d), st: Streams { tables: Vec::new(), lens: Vec::new() } };
        run.st.tables = (0..lens.len() as u32).map(|s| (4 * s..4 * s + 4).collect()).collect();
        run.st.lens = vec![0; lens.len()];
        if prepared {
            // As `ModelBackend::new` does: one row at position 0.
            let one = Streams { tables: vec![vec![15]], lens: vec![0] };
            let b = one.batch();
            let (m, kv, s) = (&run.m, &mut run.kv, &mut run.s);
            prepare(d, &mut || mini_forward(d, m, &[0], &b, &one.tables, kv, s));
        }
        // The contexts: token (p * 7 + s) % MV at each position, eagerly.
        for p in 0..*lens.iter().max().unwrap_or(&0) {
            let ids: Vec<usize> = (0..lens.len()).filter(|&s| p < lens[s]).collect();
            let sub = Streams { tables: ids.iter().map(|&s| run.st.tables[s].clone()).collect(), lens: ids.iter().map(|&s| run.st.lens[s]).collect() };
            let b = sub.batch();
            let toks: Vec<u32> = ids.iter().map(|&s| ((p * 7 + s) % MV) as u32).collect();
            run.step_with(d, None, &toks, &sub, &b);
            for &s in &ids {
                run.st.lens[s] += 1;
            }
        }
        run
    }

    fn step_with(&mut self, d: &Cuda, key: Option<u64>, tokens: &[u32], st: &Streams, b: &MiniBatch) {
        let (m, kv, s) = (&self.m, &mut self.kv, &mut self.s);
        d.forward(Forward { key, tokens }, &mut || {
            mini_forward(d, m, tokens, b, &st.tables, kv, s);
            Ok(())
        })
        .unwrap();
    }

    /// One decode round of every stream (one token each), keyed or not;
    /// the logits, and the streams one further.
    fn round(&mut self, d: &Cuda, keyed: bool, tokens: &[u32]) -> Vec<f32> {
        let b = self.st.batch();
        let st = Streams { tables: self.st.tables.clone(), lens: self.st.lens.clone() };
        self.step_with(d, keyed.then(|| b.key()), tokens, &st, &b);
        self.st.lens.iter_mut().for_each(|l| *l += 1);
        d.download(&self.s.logits).unwrap()
    }

    /// The same round outside any forward (unfused; an unprepared model).
    fn round_plain(&mut self, d: &Cuda, tokens: &[u32]) -> Vec<f32> {
        let b = self.st.batch();
        mini_forward(d, &self.m, tokens, &b, &self.st.tables, &mut self.kv, &mut self.s);
        self.st.lens.iter_mut().for_each(|l| *l += 1);
        d.download(&self.s.logits).unwrap()
    }
}

/// A small model's decode rounds as replayed CUDA graphs give the eager
/// rounds' bits, round after round (and within bf16 rounding the same ops
/// outside any forward, unfolded); each round's shape after the first
/// replays its graph.
#[test]
fn graph_replay_equals_eager() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let host = MiniHost::new(&mut r);
    let lens = [5, 25, 40];
    let mut plain = MiniRun::new(&d, &host, false, &lens);
    let mut eager = MiniRun::new(&d, &host, true, &lens);
    let mut graphed = MiniRun::new(&d, &host, true, &lens);
    let before = d.graph_stats();
    for step in 0..10usize {
        let toks: Vec<u32> = (0..3).map(|s| ((step * 31 + s * 7) % MV) as u32).collect();
        let p = plain.round_plain(&d, &toks);
        let e = eager.round(&d, false, &toks);
        let g = graphed.round(&d, true, &toks);
        assert!(same_bits(&g, &e), "round {step}: graph replay differs from eager");
        let err = rel(&e, &p);
        assert!(err < 2e-2, "round {step}: the folded forward vs the ops unfused: rel err {err}");
    }
    let (replays, captures) = (d.graph_stats().0 - before.0, d.graph_stats().1 - before.1);
    eprintln!("graph replays {replays} captures {captures}");
    assert!(replays >= 8, "the graph was not replayed ({replays} replays, {captures} captures)");
}

/// Forwards prepared ahead (`Device::forward_ahead`) and launched by the
/// argmax that picks their tokens (`Device::pick` with `launch_ahead`)
/// give the eager forwards' bits, through rounds that are not the one
/// expected: other tokens than the ones picked, another shape (a stream
/// moved back), an upload or an allocation between, a round not launched,
/// one not prepared. Hits and launches are counted (run the tests on one
/// thread: any thread's allocation retires a forward prepared ahead).
#[test]
fn forwards_prepared_and_launched_ahead_equal_eager() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let host = MiniHost::new(&mut r);
    let lens = [3, 17, 30];
    let mut ahead = MiniRun::new(&d, &host, true, &lens);
    let eager_dev = gpu().unwrap();
    let mut eager = MiniRun::new(&eager_dev, &host, true, &lens);
    // The first argmax on a device makes its key buffer: an allocation,
    // which retires whatever was prepared ahead. Make it now.
    d.pick(&ahead.s.logits, RowPick::Argmax, &[], false).unwrap();
    let mut toks: Vec<u32> = vec![1, 2, 3];
    let (hits0, launched0) = d.ahead_hits();
    let (mut want_hits, mut want_launched) = (0u64, 0u64);
    let mut expect: Option<bool> = None;
    for round in 0..24usize {
        // This round's forward: served from the one prepared ahead or not.
        let logits = ahead.round(&d, true, &toks);
        let want = eager.round(&eager_dev, false, &toks);
        assert!(same_bits(&logits, &want), "round {round}: the round done ahead differs from eager");
        let (h, l) = d.ahead_hits();
        if let Some(launched) = expect.take() {
            want_hits += 1;
            want_launched += launched as u64;
        }
        if (h - hits0, l - launched0) != (want_hits, want_launched) {
            eprintln!("round {round}: ahead hits {} (launched {}), expected {want_hits} ({want_launched})", h - hits0, l - launched0);
        }
        // Prepare the next round (the same streams one further) with this
        // round's tokens standing in, then pick this round's tokens.
        let prepare_next = round % 8 != 6;
        let launch = round % 8 != 4;
        if prepare_next {
            let b = ahead.st.batch();
            let st = Streams { tables: ahead.st.tables.clone(), lens: ahead.st.lens.clone() };
            let (m, kv, s) = (&ahead.m, &mut ahead.kv, &mut ahead.s);
            d.forward_ahead(Forward { key: Some(b.key()), tokens: &toks }, &mut || {
                mini_forward(&d, m, &toks, &b, &st.tables, kv, s);
                Ok(())
            });
        }
        let picked = match d.pick(&ahead.s.logits, RowPick::Argmax, &[], launch).unwrap() {
            RowPicked::Argmax(t) => t,
            other => panic!("pick(Argmax) answered {other:?}"),
        };
        assert_eq!(picked, want.chunks(MV).map(braid_ops::argmax_host).collect::<Vec<_>>(), "round {round}: the device's argmax");
        toks = picked;
        expect = prepare_next.then_some(launch);
        match round % 8 {
            // Other tokens than the ones picked (the launched forward ran for nothing).
            1 => {
                toks[1] = (toks[1] + 1) % MV as u32;
                expect = None;
            }
            // A stream moved back: another shape, another key.
            2 => {
                for run in [&mut ahead, &mut eager] {
                    run.st.lens[0] -= 2;
                }
                expect = None;
            }
            // An upload outside a forward: the arena may hold other data now.
            3 => {
                let x = d.upload(&[1.0; MH], 1, MH).unwrap();
                let mut o = d.tensor(0, 0);
                d.gather_rows(&x, &[0], &mut o);
                expect = None;
            }
            // Memory allocated: pointers the forward baked in may be stale.
            5 => {
                let _t = d.tensor(64, 64);
                expect = None;
            }
            _ => {}
        }
    }
    let (h, l) = d.ahead_hits();
    eprintln!("rounds served ahead: {} (launched {}), expected {want_hits} ({want_launched})", h - hits0, l - launched0);
    assert_eq!((h - hits0, l - launched0), (want_hits, want_launched), "rounds served from the forward done ahead (run on one test thread)");
}

// ---- the bf16 copies the products read ----

/// `t`'s bf16 copy made current inside a forward (a product reads it), then
/// `op` writes `t`, then a product reads `t` again: it must read what `op`
/// wrote (a stale copy fails), against f64 over t's own f32 values rounded
/// to bf16. `host`: the CPU's result, which t's values must match first.
fn check_bf16_copy(d: &Cuda, r: &mut Rng, what: &str, t: &mut T, host: &[f32], op: &mut dyn FnMut(&mut T)) {
    let cols = d.shape(t).1;
    let m = 48;
    let w0 = d.weight_from_f32(&vec![0.5; 8 * cols], 8, cols).unwrap();
    let w = r.vec(m * cols, 0.1);
    let gw = d.weight_from_f32(&w, m, cols).unwrap();
    let (mut junk, mut out) = (poisoned(d, 1, 1), poisoned(d, 1, 1));
    in_forward(d, None, &mut || {
        d.matmul(t, &[&w0], &mut [&mut junk]);
        op(t);
        d.matmul(t, &[&gw], &mut [&mut out]);
    })
    .unwrap();
    let own = d.download(t).unwrap();
    let rows = d.shape(t).0;
    assert_eq!(d.shape(t).1, cols, "{what}: the op changed the width");
    let e = rel(&own, host);
    assert!(e < 1e-3, "{what}: f32 values off the CPU's (rel err {e})");
    let want = f32s(&mm_ref(&own, &w, rows, cols, m));
    let e = rel(&d.download(&out).unwrap(), &want);
    assert!(e < 1e-4, "{what}: the bf16 copy read by a product is stale (rel err {e})");
    eprintln!("op {what}: the next product reads its output");
}

/// Every op that writes a tensor a product may read next leaves that
/// product reading its values (the op's own bf16 copy, or a fresh one),
/// inside a forward where copies are tracked: the elementwise maps, the
/// gated activations (fused and not), biases, RoPE, norms, row copies,
/// gathers, embeddings, attention, and a residual add.
#[test]
fn every_op_leaves_the_bf16_copy_a_product_reads_current() {
    let Some(d) = gpu() else { return };
    let cpu = Cpu::new(Some(1));
    let mut r = Rng(seed());
    for rows in [3usize, 40] {
        let cols = 256;
        let (x, y) = (r.vec(rows * cols, 2.0), r.vec(rows * cols, 2.0));
        let (gx, gy) = (d.upload(&x, rows, cols).unwrap(), d.upload(&y, rows, cols).unwrap());
        let (cx, cy) = (cpu.upload(&x, rows, cols).unwrap(), cpu.upload(&y, rows, cols).unwrap());
        let bias = r.vec(cols, 1.0);
        let (gb, cb) = (d.upload(&bias, 1, cols).unwrap(), cpu.upload(&bias, 1, cols).unwrap());
        // In place.
        let maps = [Map::Scale(0.3), Map::Softcap(1.5), Map::Silu, Map::Relu2];
        for f in maps {
            let (mut g, mut c) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
            cpu.map(&mut c, f);
            check_bf16_copy(&d, &mut r, &format!("map {f:?}, {rows} rows"), &mut g, &c.data, &mut |t| d.map(t, f));
        }
        let (mut g, mut c) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
        cpu.add(&mut c, &cb);
        check_bf16_copy(&d, &mut r, &format!("a bias, {rows} rows"), &mut g, &c.data, &mut |t| d.add(t, &gb));
        let (mut g, mut c) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
        cpu.add(&mut c, &cy);
        check_bf16_copy(&d, &mut r, &format!("add, {rows} rows"), &mut g, &c.data, &mut |t| d.add(t, &gy));
        let pos: Vec<u32> = (0..rows as u32).map(|i| 5 * i + 1).collect();
        for rope in [Rope::new(10000.0, 64, true), Rope::table((0..16).map(|i| 0.5f32.powi(i)).collect())] {
            let (mut g, mut c) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
            cpu.rope(&mut c, &pos, 64, &rope);
            check_bf16_copy(&d, &mut r, &format!("rope (table: {}), {rows} rows", rope.freqs.is_some()), &mut g, &c.data, &mut |t| d.rope(t, &pos, 64, &rope));
        }
        let (mut g, mut c) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
        cpu.copy_rows(&mut c, &[0, 2], &[1, 0]);
        cpu.zero_rows(&mut c, &[2]);
        check_bf16_copy(&d, &mut r, &format!("copy_rows / zero_rows, {rows} rows"), &mut g, &c.data, &mut |t| {
            d.copy_rows(t, &[0, 2], &[1, 0]);
            d.zero_rows(t, &[2]);
        });
        // Into an output (whose copy a product made current before).
        for act in [Act::Silu, Act::GeluTanh, Act::Identity, Act::Sigmoid, Act::SwiGluClamped { limit: 2.0, alpha: 1.702 }] {
            let mut c = cpu.tensor(0, 0);
            cpu.gated(act, &cx, &cy, &mut c);
            let mut g = d.upload(&y, rows, cols).unwrap();
            check_bf16_copy(&d, &mut r, &format!("gated {act:?}, {rows} rows"), &mut g, &c.data, &mut |t| d.gated(act, &gx, &gy, t));
        }
        for group in [cols, 64] {
            let w = r.vec(group, 1.0);
            let (gw, cw) = (d.upload(&w, 1, group).unwrap(), cpu.upload(&w, 1, group).unwrap());
            let mut c = cpu.tensor(0, 0);
            cpu.rms_norm(&cx, &cw, 1e-5, &mut c);
            let mut g = d.upload(&y, rows, cols).unwrap();
            check_bf16_copy(&d, &mut r, &format!("rms_norm over {group}, {rows} rows"), &mut g, &c.data, &mut |t| d.rms_norm(&gx, &gw, 1e-5, t));
        }
        let idx: Vec<usize> = (0..rows).rev().collect();
        let mut c = cpu.tensor(0, 0);
        cpu.gather_rows(&cx, &idx, &mut c);
        let mut g = d.upload(&y, rows, cols).unwrap();
        check_bf16_copy(&d, &mut r, &format!("gather_rows, {rows} rows"), &mut g, &c.data, &mut |t| d.gather_rows(&gx, &idx, t));
        let table = r.vec(100 * cols, 1.0);
        let (gt, ct) = (d.weight_from_f32(&table, 100, cols).unwrap(), cpu.upload(&table.iter().map(|&v| rbf(v)).collect::<Vec<_>>(), 100, cols).unwrap());
        let ids: Vec<u32> = (0..rows as u32).map(|i| (i * 37) % 100).collect();
        let want: Vec<f32> = ids.iter().flat_map(|&i| ct.row(i as usize).iter().map(|v| v * 0.5).collect::<Vec<_>>()).collect();
        let mut g = d.upload(&y, rows, cols).unwrap();
        check_bf16_copy(&d, &mut r, &format!("embed, {rows} rows"), &mut g, &want, &mut |t| d.embed(&gt, &ids, 0.5, t));
        // Attention's output, against the CPU over the same bf16 KV values.
        let spec = KvPoolSpec::new(4, 16, vec![KvShape { kv_heads: 1, head_dim: 64 }]);
        let (mut gp, mut cp) = (d.kv_pool(&spec, KvDtype::F16).unwrap(), cpu.kv_pool(&spec, KvDtype::F32).unwrap());
        let kv: Vec<f32> = r.vec(40 * 64, 1.0).into_iter().map(rbf).collect();
        let kslots: Vec<u32> = (0..40).collect();
        d.kv_write(&mut gp, 0, &d.upload(&kv, 40, 64).unwrap(), &d.upload(&kv, 40, 64).unwrap(), &kslots);
        cpu.kv_write(&mut cp, 0, &cpu.upload(&kv, 40, 64).unwrap(), &cpu.upload(&kv, 40, 64).unwrap(), &kslots);
        let seqs: Vec<AttnSeq> = (0..rows).map(|i| AttnSeq { q_start: i, q_len: 1, kv_len: 1 + i % 40, blocks: &[0, 1, 2], window: None }).collect();
        let mut c = cpu.tensor(0, 0);
        cpu.attention(&cx, &cp, 0, &seqs, 0.125, None, &mut c);
        let mut g = d.upload(&y, rows, cols).unwrap();
        check_bf16_copy(&d, &mut r, &format!("attention, {rows} rows"), &mut g, &c.data, &mut |t| d.attention(&gx, &gp, 0, &seqs, 0.125, None, t));
    }
}

// ---- the hybrid families' ops (cuda/recurrent.rs) against the CPU device ----

#[test]
fn hybrid_pointwise_ops_match_cpu() {
    let Some(d) = gpu() else { return };
    let cpu = Cpu::new(Some(1));
    let mut r = Rng(seed());
    // 5 rows of 1536 (partial GEMV blocks), then 40 rows (cuBLAS) for the copies.
    for rows in [5usize, 40] {
        let cols = 1536;
        let x = r.vec(rows * cols, 3.0);
        let (gx, cx) = (d.upload(&x, rows, cols).unwrap(), cpu.upload(&x, rows, cols).unwrap());
        // Groups small (a warp loops once), odd-sized and whole rows.
        for group in [64usize, 96, 512, cols] {
            let w = r.vec(cols, 1.0);
            let (gw, cw) = (d.upload(&w, 1, cols).unwrap(), cpu.upload(&w, 1, cols).unwrap());
            let mut co = cpu.tensor(0, 0);
            cpu.group_rms_norm(&cx, &cw, group, 1e-5, &mut co).unwrap();
            let mut go = poisoned(&d, 1, 1);
            d.group_rms_norm(&gx, &gw, group, 1e-5, &mut go).unwrap();
            report(&format!("group_rms_norm groups of {group} {rows}x{cols}"), rel(&d.download(&go).unwrap(), &co.data), 1e-5);
            let mut go = d.upload(&x, rows, cols).unwrap();
            check_bf16_copy(&d, &mut r, &format!("group_rms_norm groups of {group}, {rows} rows"), &mut go, &co.data, &mut |t| {
                d.group_rms_norm(&gx, &gw, group, 1e-5, t).unwrap()
            });
        }
        let w = d.upload(&r.vec(cols, 1.0), 1, cols).unwrap();
        let mut o = poisoned(&d, 1, 1);
        assert!(d.group_rms_norm(&gx, &w, 100, 1e-5, &mut o).is_err(), "groups that do not divide the row");
    }

    // RoPE from a table: a rotated part, then zero frequencies (Gemma 4's
    // proportional RoPE), on 3 heads of 64; large positions too.
    let (rows, hd, heads) = (7usize, 64usize, 3usize);
    let x = r.vec(rows * heads * hd, 1.0);
    let mut inv: Vec<f32> = (0..8).map(|i| 1e6f32.powf(-(2.0 * i as f32) / 64.0)).collect();
    inv.resize(hd / 2, 0.0);
    let pos: Vec<u32> = (0..rows as u32).map(|i| i * 4099 + 1).collect();
    for table in [&inv[..], &inv[..8]] {
        let rope = Rope::table(table.to_vec());
        let (mut g, mut c) = (d.upload(&x, rows, heads * hd).unwrap(), cpu.upload(&x, rows, heads * hd).unwrap());
        d.rope(&mut g, &pos, hd, &rope);
        cpu.rope(&mut c, &pos, hd, &rope);
        let got = d.download(&g).unwrap();
        report(&format!("rope from a table of {} frequencies, head {hd}", table.len()), rel(&got, &c.data), 1e-5);
        // Pairs of zero frequency pass exactly.
        for (i, (a, b)) in got.iter().zip(&x).enumerate() {
            let dim = i % hd % (hd / 2);
            if table.len() == hd / 2 && dim >= 8 {
                assert_eq!(a, b, "rope from a table: a zero-frequency pair moved");
            }
        }
    }

    // scatter_add_rows: distinct targets (rows in parallel) and repeated ones (in order).
    let cols = 700;
    for rows in [vec![5u32, 0, 9, 3], vec![2, 2, 7, 2, 0, 7]] {
        let n = rows.len();
        let base = r.vec(10 * cols, 1.0);
        let y = r.vec(n * cols, 1.0);
        let wts = r.vec(n, 1.0);
        let (mut go, mut co) = (d.upload(&base, 10, cols).unwrap(), cpu.upload(&base, 10, cols).unwrap());
        let (gy, cy) = (d.upload(&y, n, cols).unwrap(), cpu.upload(&y, n, cols).unwrap());
        cpu.scatter_add_rows(&mut co, &cy, &rows, &wts).unwrap();
        check_bf16_copy(&d, &mut r, &format!("scatter_add_rows targets {rows:?}"), &mut go, &co.data, &mut |t| {
            d.scatter_add_rows(t, &gy, &rows, &wts).unwrap()
        });
        let got = d.download(&go).unwrap();
        report(&format!("scatter_add_rows targets {rows:?}"), rel(&got, &co.data), 1e-6);
        // Rows not named are untouched.
        for t in 0..10 {
            if !rows.contains(&(t as u32)) {
                assert_eq!(&got[t * cols..(t + 1) * cols], &base[t * cols..(t + 1) * cols], "scatter_add_rows wrote row {t}");
            }
        }
    }
    let mut go = d.upload(&vec![0.0; 2 * cols], 2, cols).unwrap();
    let gy = d.upload(&vec![1.0; cols], 1, cols).unwrap();
    assert!(d.scatter_add_rows(&mut go, &gy, &[2], &[1.0]).is_err(), "target past the output");
    d.sync().unwrap();
}

/// Sequences of the given lengths one after another in a batch, state rows
/// in a scrambled order.
fn state_seqs(lens: &[usize], slots: &[u32]) -> Vec<StateSeq> {
    let mut start = 0;
    lens.iter()
        .zip(slots)
        .map(|(&len, &slot)| {
            let s = StateSeq { start, len, slot };
            start += len;
            s
        })
        .collect()
}

/// An op over (input, state, sequences, output) on either device.
type CT = <Cpu as Device>::Tensor;
type GpuStateOp<'a> = dyn Fn(&T, &mut T, &[StateSeq], &mut T) + 'a;
type CpuStateOp<'a> = dyn Fn(&CT, &mut CT, &[StateSeq], &mut CT) + 'a;

/// Runs a recurrent op on both devices over several sequences at once
/// (random starting state, the op's part of each state row at an offset),
/// and compares outputs and updated state; inside a forward the GPU gives
/// the same bits; then, on the GPU, one sequence fed in chunks must give the
/// same bits as fed whole (the scan steps token by token either way), state
/// included.
fn check_state_op(d: &Cuda, cpu: &Cpu, r: &mut Rng, what: &str, in_cols: usize, state_cols: usize, gop: &GpuStateOp<'_>, cop: &CpuStateOp<'_>, tol: f64) {
    let lens = [1usize, 37, 4, 0, 9];
    let slots = [3u32, 0, 5, 1, 2];
    let rows: usize = lens.iter().sum();
    let x = r.vec(rows * in_cols, 1.0);
    let st0 = r.vec(6 * state_cols, 0.5);
    let seqs = state_seqs(&lens, &slots);
    let (gx, cx) = (d.upload(&x, rows, in_cols).unwrap(), cpu.upload(&x, rows, in_cols).unwrap());
    let (mut gs, mut cs) = (d.upload(&st0, 6, state_cols).unwrap(), cpu.upload(&st0, 6, state_cols).unwrap());
    let (mut go, mut co) = (poisoned(d, rows, 1), cpu.tensor(0, 0));
    gop(&gx, &mut gs, &seqs, &mut go);
    cop(&cx, &mut cs, &seqs, &mut co);
    let got = d.download(&go).unwrap();
    assert_eq!(d.shape(&go), (co.rows, co.cols), "{what}: output shape");
    report(&format!("{what}: output of {} sequences, {rows} rows", lens.len()), rel(&got, &co.data), tol);
    let gst = d.download(&gs).unwrap();
    report(&format!("{what}: state"), rel(&gst, &cs.data), tol);
    // Row 4 is no sequence's: untouched.
    assert_eq!(&gst[4 * state_cols..5 * state_cols], &st0[4 * state_cols..5 * state_cols], "{what}: an unused state row changed");
    // Inside a forward: the same bits.
    let mut fs = d.upload(&st0, 6, state_cols).unwrap();
    let mut fo = poisoned(d, rows, 1);
    in_forward(d, None, &mut || gop(&gx, &mut fs, &seqs, &mut fo)).unwrap();
    assert!(same_bits(&d.download(&fo).unwrap(), &got), "{what}: inside a forward, the output differs");
    assert!(same_bits(&d.download(&fs).unwrap(), &gst), "{what}: inside a forward, the state differs");

    // Chunked == whole on the GPU, bit for bit (the 37-row sequence).
    let x1 = &x[in_cols..38 * in_cols];
    let mut whole_state = d.upload(&st0, 6, state_cols).unwrap();
    let mut whole = poisoned(d, 1, 1);
    gop(&d.upload(x1, 37, in_cols).unwrap(), &mut whole_state, &[StateSeq { start: 0, len: 37, slot: 2 }], &mut whole);
    let whole = d.download(&whole).unwrap();
    for cuts in [vec![1usize, 2, 3, 10, 20, 36], vec![16, 27]] {
        let mut st = d.upload(&st0, 6, state_cols).unwrap();
        let mut out = Vec::new();
        let mut a = 0;
        for &b in cuts.iter().chain(std::iter::once(&37)) {
            let part = d.upload(&x1[a * in_cols..b * in_cols], b - a, in_cols).unwrap();
            let mut o = poisoned(d, 1, 1);
            gop(&part, &mut st, &[StateSeq { start: 0, len: b - a, slot: 2 }], &mut o);
            out.extend(d.download(&o).unwrap());
            a = b;
        }
        assert!(same_bits(&out, &whole), "{what}: chunks {cuts:?} differ from the whole pass");
        assert_eq!(d.download(&st).unwrap(), d.download(&whole_state).unwrap(), "{what}: state after chunks {cuts:?}");
    }
    eprintln!("op {what}: chunked == whole, bit-identical");
}

#[test]
fn hybrid_recurrent_ops_match_cpu() {
    let Some(d) = gpu() else { return };
    let cpu = Cpu::new(Some(2));
    let mut r = Rng(seed());

    // Short conv: LFM2 (3 taps, no bias, no SiLU) and Mamba2 (4 taps, bias,
    // SiLU), channels not a multiple of the block.
    for (c, k, bias, silu) in [(300usize, 3usize, false, false), (200, 4, true, true), (70, 1, true, false)] {
        let w = r.vec(c * k, 0.5);
        let b = r.vec(c, 0.5);
        let (gw, cw) = (d.upload(&w, 1, c * k).unwrap(), cpu.upload(&w, 1, c * k).unwrap());
        let (gb, cb) = (d.upload(&b, 1, c).unwrap(), cpu.upload(&b, 1, c).unwrap());
        let off = 7;
        let cols = off + c * (k - 1) + 5;
        let gop = |x: &T, st: &mut T, s: &[StateSeq], o: &mut T| d.short_conv(x, &gw, bias.then_some(&gb), k, silu, st, off, s, o).unwrap();
        let cop = |x: &CT, st: &mut CT, s: &[StateSeq], o: &mut CT| cpu.short_conv(x, &cw, bias.then_some(&cb), k, silu, st, off, s, o).unwrap();
        check_state_op(&d, &cpu, &mut r, &format!("short_conv C={c} K={k} bias={bias} silu={silu}"), c, cols, &gop, &cop, 1e-5);
    }

    // Mamba2 scan: Nemotron-H-like heads (64 dims, state 128, 2 groups), and
    // odd small shapes (partial warps and lanes).
    for sh in [
        SsmShape { heads: 8, head_dim: 64, state_dim: 128, groups: 2, dt_min: 0.0, dt_max: f32::INFINITY },
        SsmShape { heads: 4, head_dim: 3, state_dim: 5, groups: 2, dt_min: 0.01, dt_max: 0.5 },
        SsmShape { heads: 6, head_dim: 16, state_dim: 16, groups: 1, dt_min: 1e-3, dt_max: 0.1 },
    ] {
        let inner = sh.heads * sh.head_dim;
        let xw = inner + 2 * sh.groups * sh.state_dim;
        let dt_bias = r.vec(sh.heads, 1.0);
        let a: Vec<f32> = r.vec(sh.heads, 1.0).iter().map(|v| -v.abs() - 0.1).collect();
        let dd = r.vec(sh.heads, 1.0);
        let (gbias, cbias) = (d.upload(&dt_bias, 1, sh.heads).unwrap(), cpu.upload(&dt_bias, 1, sh.heads).unwrap());
        let (ga, ca) = (d.upload(&a, 1, sh.heads).unwrap(), cpu.upload(&a, 1, sh.heads).unwrap());
        let (gd, cd) = (d.upload(&dd, 1, sh.heads).unwrap(), cpu.upload(&dd, 1, sh.heads).unwrap());
        let off = 3;
        let cols = off + inner * sh.state_dim + 2;
        // The op's input is xbc and dt side by side (one tensor, split here).
        let xin = xw + sh.heads;
        let split = |v: &[f32]| {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for row in v.chunks(xin) {
                a.extend_from_slice(&row[..xw]);
                // dt spread over [-4, 4): some fall under dt_min / over dt_max after the softplus.
                b.extend(row[xw..].iter().map(|t| t * 4.0));
            }
            (a, b)
        };
        let gop = |x: &T, st: &mut T, s: &[StateSeq], o: &mut T| {
            // (Inside a forward this download is a read-back: what the
            // forward recorded so far runs first.)
            let (a, b) = split(&d.download(x).unwrap());
            let rows = a.len() / xw;
            let (xbc, dt) = (d.upload(&a, rows, xw).unwrap(), d.upload(&b, rows, sh.heads).unwrap());
            d.ssm_scan(&xbc, &dt, &gbias, &ga, &gd, &sh, st, off, s, o).unwrap()
        };
        let cop = |x: &CT, st: &mut CT, s: &[StateSeq], o: &mut CT| {
            let (a, b) = split(&x.data);
            let (xbc, dt) = (cpu.upload(&a, x.rows, xw).unwrap(), cpu.upload(&b, x.rows, sh.heads).unwrap());
            cpu.ssm_scan(&xbc, &dt, &cbias, &ca, &cd, &sh, st, off, s, o).unwrap()
        };
        let what = format!("ssm_scan heads {} dim {} state {} groups {}", sh.heads, sh.head_dim, sh.state_dim, sh.groups);
        check_state_op(&d, &cpu, &mut r, &what, xin, cols, &gop, &cop, 1e-5);
    }

    // Lightning attention: MiniMax's head dims.
    for (heads, hd) in [(4usize, 64usize), (2, 128), (3, 16), (2, 20)] {
        let slopes: Vec<f32> = (0..heads).map(|h| 0.05 + 0.3 * h as f32).collect();
        let (gsl, csl) = (d.upload(&slopes, 1, heads).unwrap(), cpu.upload(&slopes, 1, heads).unwrap());
        let off = 11;
        let cols = off + heads * hd * hd + 3;
        let gop = |x: &T, st: &mut T, s: &[StateSeq], o: &mut T| d.linear_attention(x, &gsl, heads, hd, st, off, s, o).unwrap();
        let cop = |x: &CT, st: &mut CT, s: &[StateSeq], o: &mut CT| cpu.linear_attention(x, &csl, heads, hd, st, off, s, o).unwrap();
        check_state_op(&d, &cpu, &mut r, &format!("linear_attention heads {heads} dim {hd}"), heads * 3 * hd, cols, &gop, &cop, 1e-5);
    }

    // The gated delta rule: Qwen3-Next's heads (128 of 128, 2 value heads a
    // key head), one value head a key head, key dims wider than the values,
    // and dims that are no multiple of 8 or 16.
    for (nk, nv, dk, dv) in [(2usize, 4usize, 128usize, 128usize), (3, 3, 16, 16), (1, 2, 64, 32), (2, 2, 20, 12)] {
        let sh = DeltaShape { key_heads: nk, value_heads: nv, key_dim: dk, value_dim: dv, l2_eps: 1e-6, scale: 1.0 / (dk as f32).sqrt() };
        let dt_bias = r.vec(nv, 1.0);
        let decay: Vec<f32> = r.vec(nv, 1.0).iter().map(|x| -x.exp()).collect();
        let (gbias, cbias) = (d.upload(&dt_bias, 1, nv).unwrap(), cpu.upload(&dt_bias, 1, nv).unwrap());
        let (gdec, cdec) = (d.upload(&decay, 1, nv).unwrap(), cpu.upload(&decay, 1, nv).unwrap());
        let off = 5;
        let cols = off + nv * dk * dv + 2;
        // The op's inputs are qkv, a and b side by side (one tensor, split here).
        let qw = sh.qkv_width();
        let xin = qw + 2 * nv;
        let split = |v: &[f32]| {
            let (mut x, mut a, mut b) = (Vec::new(), Vec::new(), Vec::new());
            for row in v.chunks(xin) {
                x.extend_from_slice(&row[..qw]);
                // a spread over [-8, 8): the softplus's both ends.
                a.extend(row[qw..qw + nv].iter().map(|t| t * 8.0));
                b.extend(row[qw + nv..].iter().map(|t| t * 4.0));
            }
            (x, a, b)
        };
        let gop = |x: &T, st: &mut T, s: &[StateSeq], o: &mut T| {
            let (x, a, b) = split(&d.download(x).unwrap());
            let rows = a.len() / nv;
            let (gx, ga, gb) = (d.upload(&x, rows, qw).unwrap(), d.upload(&a, rows, nv).unwrap(), d.upload(&b, rows, nv).unwrap());
            d.gated_delta_rule(&gx, &ga, &gb, &gbias, &gdec, &sh, st, off, s, o).unwrap()
        };
        let cop = |x: &CT, st: &mut CT, s: &[StateSeq], o: &mut CT| {
            let (xv, a, b) = split(&x.data);
            let (cx, ca, cb) = (cpu.upload(&xv, x.rows, qw).unwrap(), cpu.upload(&a, x.rows, nv).unwrap(), cpu.upload(&b, x.rows, nv).unwrap());
            cpu.gated_delta_rule(&cx, &ca, &cb, &cbias, &cdec, &sh, st, off, s, o).unwrap()
        };
        check_state_op(&d, &cpu, &mut r, &format!("gated_delta_rule {nv} value heads of {dv} over {nk} key heads of {dk}"), xin, cols, &gop, &cop, 1e-5);
    }

    // Bad input is an error, not a launch: two sequences on one state row.
    let x = d.upload(&r.vec(6 * 8, 1.0), 6, 8).unwrap();
    let w = d.upload(&r.vec(8 * 4, 1.0), 1, 8 * 4).unwrap();
    let mut st = d.upload(&[0.0; 2 * 24], 2, 24).unwrap();
    let mut o = poisoned(&d, 1, 1);
    let same = [StateSeq { start: 0, len: 3, slot: 1 }, StateSeq { start: 3, len: 3, slot: 1 }];
    assert!(d.short_conv(&x, &w, None, 4, false, &mut st, 0, &same, &mut o).is_err(), "two sequences sharing a state row");
    let past = [StateSeq { start: 4, len: 3, slot: 0 }];
    assert!(d.short_conv(&x, &w, None, 4, false, &mut st, 0, &past, &mut o).is_err(), "a sequence past the batch");
    d.sync().unwrap();
}

/// MiniMax-M3's block-sparse attention against the CPU device over the same
/// keys and values (the CPU pool holds the bf16-rounded values in f32, so
/// both choose blocks from the same keys): decode rows and prefill chunks,
/// several sequences with scattered block tables, few and many kept blocks.
#[test]
fn block_sparse_attention_matches_cpu() {
    let Some(d) = gpu() else { return };
    let cpu = Cpu::new(Some(2));
    let mut r = Rng(seed());
    let (heads, kvh, hd, ih, idim) = (8usize, 2usize, 64usize, 2usize, 32usize);
    let bt = 16;
    // (q_len, kv_len) per sequence.
    let seqs_spec = [(1usize, 300usize), (5, 40), (37, 37), (1, 1), (3, 130)];
    let blocks: usize = seqs_spec.iter().map(|s| s.1.div_ceil(bt)).sum::<usize>() + 4;
    let spec = KvPoolSpec::new(blocks, bt, vec![KvShape { kv_heads: kvh, head_dim: hd }, KvShape { kv_heads: 1, head_dim: idim }]);
    let mut gpool = d.kv_pool(&spec, KvDtype::F16).unwrap();
    let mut cpool = cpu.kv_pool(&spec, KvDtype::F32).unwrap();
    let mut free: Vec<u32> = (0..blocks as u32).collect();
    for i in (1..free.len()).rev() {
        let j = r.below(i + 1);
        free.swap(i, j);
    }
    let mut tables = Vec::new();
    for &(_, kl) in &seqs_spec {
        let tb: Vec<u32> = (0..kl.div_ceil(bt)).map(|_| free.pop().unwrap()).collect();
        let slots: Vec<u32> = (0..kl).map(|p| tb[p / bt] * bt as u32 + (p % bt) as u32).collect();
        let round = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(rbf).collect() };
        let (k, v, ik) = (round(r.vec(kl * kvh * hd, 1.0)), round(r.vec(kl * kvh * hd, 1.0)), round(r.vec(kl * idim, 1.0)));
        let (gk, gv, gik) = (d.upload(&k, kl, kvh * hd).unwrap(), d.upload(&v, kl, kvh * hd).unwrap(), d.upload(&ik, kl, idim).unwrap());
        let (ck, cv, cik) = (cpu.upload(&k, kl, kvh * hd).unwrap(), cpu.upload(&v, kl, kvh * hd).unwrap(), cpu.upload(&ik, kl, idim).unwrap());
        d.kv_write(&mut gpool, 0, &gk, &gv, &slots);
        d.kv_write(&mut gpool, 1, &gik, &gik, &slots);
        cpu.kv_write(&mut cpool, 0, &ck, &cv, &slots);
        cpu.kv_write(&mut cpool, 1, &cik, &cik, &slots);
        tables.push(tb);
    }
    let rows: usize = seqs_spec.iter().map(|s| s.0).sum();
    let mut seqs = Vec::new();
    let mut start = 0;
    for (i, &(ql, kl)) in seqs_spec.iter().enumerate() {
        seqs.push(AttnSeq { q_start: start, q_len: ql, kv_len: kl, blocks: &tables[i], window: None });
        start += ql;
    }
    let q = r.vec(rows * heads * hd, 1.0);
    let iq = r.vec(rows * ih * idim, 1.0);
    let (gq, cq) = (d.upload(&q, rows, heads * hd).unwrap(), cpu.upload(&q, rows, heads * hd).unwrap());
    let (giq, ciq) = (d.upload(&iq, rows, ih * idim).unwrap(), cpu.upload(&iq, rows, ih * idim).unwrap());
    let scale = 1.0 / (hd as f32).sqrt();
    for sel in [
        BlockSparse { block: 8, local: 1, topk: 2, index_heads: ih, index_dim: idim },
        BlockSparse { block: 16, local: 2, topk: 5, index_heads: ih, index_dim: idim },
        BlockSparse { block: 40, local: 3, topk: 3, index_heads: ih, index_dim: idim },
        BlockSparse { block: 8, local: 1, topk: 100, index_heads: ih, index_dim: idim },
    ] {
        let mut co = cpu.tensor(0, 0);
        cpu.block_sparse_attention(&cq, &ciq, &cpool, 0, 1, &seqs, scale, &sel, &mut co).unwrap();
        let what = format!("block_sparse_attention block {} local {} topk {}", sel.block, sel.local, sel.topk);
        let mut go = poisoned(&d, rows, heads * hd);
        d.block_sparse_attention(&gq, &giq, &gpool, 0, 1, &seqs, scale, &sel, &mut go).unwrap();
        report(&what, rel(&d.download(&go).unwrap(), &co.data), 1e-4);
        check_bf16_copy(&d, &mut r, &what, &mut go, &co.data, &mut |t| d.block_sparse_attention(&gq, &giq, &gpool, 0, 1, &seqs, scale, &sel, t).unwrap());
    }
    // Every block kept is dense causal attention (the GPU's own kernels).
    let all = BlockSparse { block: 16, local: 1, topk: 64, index_heads: ih, index_dim: idim };
    let (mut a, mut b) = (poisoned(&d, 1, 1), poisoned(&d, 1, 1));
    d.block_sparse_attention(&gq, &giq, &gpool, 0, 1, &seqs, scale, &all, &mut a).unwrap();
    d.attention(&gq, &gpool, 0, &seqs, scale, None, &mut b);
    // (The dense prefill kernel rounds q and P to bf16.)
    report("block_sparse_attention, every block kept, vs attention", rel(&d.download(&a).unwrap(), &d.download(&b).unwrap()), 1.5e-2);
    let bad = BlockSparse { block: 16, local: 1, topk: 2, index_heads: 3, index_dim: idim };
    assert!(d.block_sparse_attention(&gq, &giq, &gpool, 0, 1, &seqs, scale, &bad, &mut a).is_err(), "indexer heads that do not divide the heads");
    d.sync().unwrap();
}

/// A mixture's forward: thousands of small row lists uploaded inside one
/// forward (a gather, a scatter's targets and weights per expert run). At
/// 64 KiB a slot, 256 uploads filled the arena and real-shape MoE models
/// (64–128 experts) failed in their first prefill.
#[test]
fn a_forward_of_thousands_of_row_lists_fits_the_upload_arena() {
    let Some(d) = gpu() else { return };
    let cpu = Cpu::new(Some(1));
    let mut r = Rng(seed());
    let (rows, cols) = (40, 64);
    let x = r.vec(rows * cols, 1.0);
    let (gx, cx) = (d.upload(&x, rows, cols).unwrap(), cpu.upload(&x, rows, cols).unwrap());
    let (mut gout, mut cout) = (d.upload(&vec![0.0; rows * cols], rows, cols).unwrap(), cpu.upload(&vec![0.0; rows * cols], rows, cols).unwrap());
    let lists: Vec<(Vec<usize>, Vec<f32>)> = (0..1500)
        .map(|i| {
            let ids: Vec<usize> = (0..rows).filter(|&j| (j * 7 + i) % 5 == 0).collect();
            let w = ids.iter().map(|&j| ((i + j) % 9) as f32 * 0.01).collect();
            (ids, w)
        })
        .collect();
    let (mut gt, mut ct) = (d.tensor(0, 0), cpu.tensor(0, 0));
    let mut err = None;
    in_forward(&d, None, &mut || {
        for (ids, w) in &lists {
            let u: Vec<u32> = ids.iter().map(|&j| j as u32).collect();
            d.gather_rows(&gx, ids, &mut gt);
            if let Err(e) = d.scatter_add_rows(&mut gout, &gt, &u, w) {
                err.get_or_insert(e);
            }
        }
    })
    .unwrap();
    assert!(err.is_none(), "{:#}", err.unwrap());
    for (ids, w) in &lists {
        let u: Vec<u32> = ids.iter().map(|&j| j as u32).collect();
        cpu.gather_rows(&cx, ids, &mut ct);
        cpu.scatter_add_rows(&mut cout, &ct, &u, w).unwrap();
    }
    report("1500 gathers and weighted scatters in one forward", rel(&d.download(&gout).unwrap(), &cout.data), 1e-5);
}
