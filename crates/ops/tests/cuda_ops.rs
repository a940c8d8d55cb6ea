//! The CUDA device against host references, op by op, on fresh random
//! inputs. Each test skips (passes with a notice) where no GPU or CUDA
//! driver is present, as in CI.

#![cfg(feature = "cuda")]

use braid_ops::cpu::Cpu;
use braid_ops::cuda::Cuda;
use braid_ops::{AttnSeq, Device, GateAct, KvPoolSpec, KvShape, Rope};
use half::bf16;

fn gpu() -> Option<Cuda> {
    match Cuda::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIP: no CUDA device: {e:#}");
            None
        }
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * amp).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
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
    assert_eq!(a.len(), b.len());
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

fn poisoned(d: &Cuda, rows: usize, cols: usize) -> <Cuda as Device>::Tensor {
    d.upload(&vec![f32::NAN; rows * cols], rows, cols).unwrap()
}

#[test]
fn matmul_bf16_against_f64() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    // The last two: long rows through the 1–2-row GEMV build, one with a tail of chunks.
    for &(rows, k, m) in &[(1, 256, 384), (7, 512, 96), (64, 1024, 512), (300, 320, 200), (1, 8704, 1100), (2, 8192, 1100)] {
        let x = r.vec(rows * k, 1.0);
        let w = r.vec(m * k, 0.1);
        let xt = d.upload(&x, rows, k).unwrap();
        let wt = d.weight_from_f32(&w, m, k).unwrap();
        let mut out = poisoned(&d, 1, 1);
        d.matmul(&xt, &wt, &mut out);
        let got = d.download(&out).unwrap();
        let mut want = vec![0f32; rows * m];
        for i in 0..rows {
            for j in 0..m {
                let s: f64 = (0..k).map(|c| rbf(x[i * k + c]) as f64 * rbf(w[j * k + c]) as f64).sum();
                want[i * m + j] = s as f32;
            }
        }
        let e = rel(&got, &want);
        eprintln!("matmul {rows}x{k} · {m}x{k}ᵀ: rel err {e:.2e}");
        assert!(e < 1e-4, "matmul {rows}x{k}x{m}: rel err {e}");
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
        let e = rel(&d.download(&go).unwrap(), &co.data);
        assert!(e < 1e-5, "rms_norm over {g}: {e}");
    }
    let (mut go, mut co) = (poisoned(&d, 1, 1), cpu.tensor(0, 0));
    d.silu_mul(&gx, &gy, &mut go);
    cpu.silu_mul(&cx, &cy, &mut co);
    assert!(rel(&d.download(&go).unwrap(), &co.data) < 1e-5, "silu_mul");
    d.gelu_mul(&gx, &gy, &mut go);
    cpu.gelu_mul(&cx, &cy, &mut co);
    assert!(rel(&d.download(&go).unwrap(), &co.data) < 1e-5, "gelu_mul");
    // add, scale, softcap in place.
    let (mut ga, mut ca) = (d.upload(&x, rows, cols).unwrap(), cpu.upload(&x, rows, cols).unwrap());
    d.add(&mut ga, &gy);
    cpu.add(&mut ca, &cy);
    d.scale(&mut ga, 0.7);
    cpu.scale(&mut ca, 0.7);
    d.softcap(&mut ga, 3.0);
    cpu.softcap(&mut ca, 3.0);
    assert!(rel(&d.download(&ga).unwrap(), &ca.data) < 1e-5, "add/scale/softcap");
    // Fused add + norm equals add then norm.
    let w = r.vec(cols, 1.0);
    let (gw, cw) = (d.upload(&w, 1, cols).unwrap(), cpu.upload(&w, 1, cols).unwrap());
    let (mut gx2, mut cx2) = (d.upload(&x, rows, cols).unwrap(), cpu.upload(&x, rows, cols).unwrap());
    let (mut go, mut co) = (poisoned(&d, 1, 1), cpu.tensor(0, 0));
    d.add_rms_norm(&mut gx2, &gy, &gw, 1e-5, &mut go);
    cpu.add(&mut cx2, &cy);
    cpu.rms_norm(&cx2, &cw, 1e-5, &mut co);
    assert!(rel(&d.download(&gx2).unwrap(), &cx2.data) < 1e-6, "add_rms_norm residual");
    assert!(rel(&d.download(&go).unwrap(), &co.data) < 1e-5, "add_rms_norm output");
    // RoPE, both pairings, partial rotary.
    for (neox, dims) in [(true, 64), (false, 64), (true, 32)] {
        let rope = Rope { theta: 10000.0, dims, neox, scale: 1.0 };
        let pos: Vec<u32> = (0..rows as u32).map(|i| i * 977 + 3).collect();
        let (mut gq, mut cq) = (d.upload(&x, rows, cols).unwrap(), cpu.upload(&x, rows, cols).unwrap());
        d.rope(&mut gq, &pos, 64, &rope);
        cpu.rope(&mut cq, &pos, 64, &rope);
        let e = rel(&d.download(&gq).unwrap(), &cq.data);
        assert!(e < 1e-5, "rope neox={neox} dims={dims}: {e}");
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
    // Twice over different rows: each call must leave its keys cleared
    // for the next (the kernel's last block does), and more rows than a
    // block has threads.
    for (rows, cols) in [(3, 50000), (300, 2000), (2, 50000)] {
        let logits = r.vec(rows * cols, 5.0);
        let t = d.upload(&logits, rows, cols).unwrap();
        let am = d.argmax(&t).unwrap();
        assert_eq!(am.len(), rows);
        for (i, &a) in am.iter().enumerate() {
            let row = &logits[i * cols..(i + 1) * cols];
            let want = row.iter().enumerate().fold(0, |b, (j, v)| if *v > row[b] { j } else { b });
            assert_eq!(a as usize, want, "argmax of {rows}x{cols}, row {i}");
        }
    }
}

/// `x · wᵀ` in f64 over the bf16-rounded operands.
fn mm_ref(x: &[f32], w: &[f32], rows: usize, k: usize, m: usize) -> Vec<f64> {
    let xb: Vec<f32> = x.iter().map(|&v| rbf(v)).collect();
    mm_exact_x(&xb, w, rows, k, m)
}

/// q, k and v with RoPE and the KV write in the GEMV's store (few rows;
/// more take the plain ops) against the products then `rope_kv_write`:
/// q, k, v and attention over the written pool.
#[test]
fn qkv_rope_kv_equals_the_plain_ops() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let (k, heads, kvh, hd) = (512, 8, 2, 64);
    let (wq, wk, wv) = (r.vec(heads * hd * k, 0.05), r.vec(kvh * hd * k, 0.05), r.vec(kvh * hd * k, 0.05));
    let gq = d.weight_from_f32(&wq, heads * hd, k).unwrap();
    let gk = d.weight_from_f32(&wk, kvh * hd, k).unwrap();
    let gv = d.weight_from_f32(&wv, kvh * hd, k).unwrap();
    let spec = KvPoolSpec { blocks: 8, block_tokens: 16, layers: vec![KvShape { kv_heads: kvh, head_dim: hd }] };
    let table = [6u32, 2, 5];
    for (rows, nslots, neox) in [(1usize, 1usize, true), (3, 3, false), (4, 3, true), (6, 6, true)] {
        let rope = Rope { theta: 10000.0, dims: hd, neox, scale: 1.0 };
        let x = d.upload(&r.vec(rows * k, 1.0), rows, k).unwrap();
        let pos: Vec<u32> = (0..rows as u32).map(|i| i * 5 + 7).collect();
        let slots: Vec<u32> = (0..nslots).map(|i| table[i / 16] * 16 + (i % 16) as u32).collect();
        let probe = r.vec(heads * hd, 1.0);
        let mut outs = Vec::new();
        for fused in [false, true] {
            let mut pool = d.kv_pool(&spec).unwrap();
            let (mut q, mut kk, mut v) = (poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1));
            if fused {
                d.qkv_rope_kv(&x, None, &mut poisoned(&d, 1, 1), [&gq, &gk, &gv], &mut q, &mut kk, &mut v, &mut pool, 0, &pos, &slots, hd, &rope);
            } else {
                d.matmul_many(&x, &[&gq, &gk, &gv], &mut [&mut q, &mut kk, &mut v]);
                d.rope_kv_write(&mut q, &mut kk, &v, &mut pool, 0, &pos, &slots, hd, &rope);
            }
            let probe = d.upload(&probe, 1, heads * hd).unwrap();
            let mut att = poisoned(&d, 1, 1);
            let seq = AttnSeq { q_start: 0, q_len: 1, kv_len: nslots, blocks: &table, window: None };
            d.attention(&probe, &pool, 0, &[seq], 0.125, None, &mut att);
            outs.push([d.download(&q).unwrap(), d.download(&kk).unwrap(), d.download(&v).unwrap(), d.download(&att).unwrap()]);
        }
        // Not bit for bit: the plain GEMV may split k differently.
        let (a, b) = (&outs[0], &outs[1]);
        let (eq, ek, ev, ea) = (rel(&b[0], &a[0]), rel(&b[1], &a[1]), rel(&b[2], &a[2]), rel(&b[3], &a[3]));
        eprintln!("qkv_rope_kv {rows} rows, {nslots} slots, neox {neox}: q {eq:.1e} k {ek:.1e} v {ev:.1e} attention {ea:.1e}");
        assert!(eq < 1e-5 && ek < 1e-5 && ev < 1e-5 && ea < 1e-3, "qkv_rope_kv {rows} rows: q {eq} k {ek} v {ev} attention {ea}");
    }
}

/// Top-k candidates found on the device equal the host's: values, columns
/// and order (ties to the lower column, NaN as -inf), for vocabularies up to
/// 262,144 and k up to 64.
#[test]
fn top_k_rows_equal_the_hosts() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
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
            let got = d.top_k_rows(&g, k).unwrap();
            let want = braid_ops::top_k_host(&x, cols, k);
            assert_eq!(got, want, "top-{k} of {rows} rows of {cols}");
        }
    }
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

fn silu(a: f64) -> f64 {
    a / (1.0 + (-a).exp())
}

/// An RMSNorm folded into the products that read it: the norm's weight
/// goes into the weights' columns once (as bf16), and the GEMV (rows 1-2)
/// scales each row's sums by 1/rms of x; more rows take the norm (unit
/// weight), then the GEMV (3-4) or the GEMM. Against f64 over the same bf16 operands. Then a
/// residual add folded into the product that makes it (and its bf16 copy,
/// which the next product reads), and a folded weight refused by a plain
/// product.
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
    for rows in [1usize, 2, 3, 4, 5, 8, 40] {
        let gemv = rows <= d.gemv_max_rows();
        // Rows whose norm the GEMV computes itself (BRAID_CUDA_NORM_FOLD_ROWS's default).
        let in_gemv = gemv && rows <= 2;
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
        d.norm_gated_matmul(&gx, &gg, eps, &mut normed, &gwg, &gwu, GateAct::Silu, &mut gate, &mut up, &mut out);
        // Past the GEMV's rows the GEMMs hand the activation bf16 gate and up.
        let round = |v: f64| if gemv { v } else { rbf(v as f32) as f64 };
        let want: Vec<f32> = gs.iter().zip(&us).map(|(&a, &b)| (silu(round(a)) * round(b)) as f32).collect();
        let e = rel(&d.download(&out).unwrap(), &want);
        eprintln!("norm_gated_matmul {rows} rows ({mg}x{k}): rel err {e:.2e}");
        // (The norm kernel's 1/rms and the host's can round x / rms to
        // neighbouring bf16 values.)
        let tol = if in_gemv {
            1e-4
        } else if gemv {
            1e-3
        } else {
            5e-3
        };
        assert!(e < tol, "norm_gated_matmul {rows} rows: rel err {e}");
    }
    // acc += x · wᵀ: long rows, odd widths, and past the GEMV's rows
    // (cuBLAS with beta = 1).
    for (rows, k, m) in [(1usize, 32768usize, 64usize), (3, 1536, 700), (4, 8192, 256), (9, 1536, 700)] {
        let (x, w, acc) = (r.vec(rows * k, 1.0), r.vec(m * k, 0.05), r.vec(rows * m, 1.0));
        let (gx, gw) = (d.upload(&x, rows, k).unwrap(), d.weight_from_f32(&w, m, k).unwrap());
        let mut gacc = d.upload(&acc, rows, m).unwrap();
        let mut tmp = poisoned(&d, 1, 1);
        d.matmul_add(&gx, &gw, &mut tmp, &mut gacc);
        let want: Vec<f32> = mm_ref(&x, &w, rows, k, m).iter().zip(&acc).map(|(&p, &a)| (p + a as f64) as f32).collect();
        let e = rel(&d.download(&gacc).unwrap(), &want);
        eprintln!("matmul_add {rows} rows ({m}x{k}): rel err {e:.2e}");
        assert!(e < 1e-4, "matmul_add {rows} rows ({m}x{k}): rel err {e}");
        // The sum's bf16 copy feeds the next product.
        let w2 = r.vec(32 * m, 0.05);
        let mut out2 = poisoned(&d, 1, 1);
        d.matmul(&gacc, &d.weight_from_f32(&w2, 32, m).unwrap(), &mut out2);
        let want2: Vec<f32> = mm_ref(&want, &w2, rows, m, 32).iter().map(|&v| v as f32).collect();
        let e = rel(&d.download(&out2).unwrap(), &want2);
        assert!(e < 1e-3, "product of the matmul_add sum, {rows} rows: rel err {e}");
    }
    // q, k, v with the norm folded and RoPE in the store, against the
    // plain ops on the host-folded weights and the unit-weight norm.
    let (heads, kvh, hd) = (8, 2, 64);
    let ws: Vec<Vec<f32>> = [heads * hd, kvh * hd, kvh * hd].iter().map(|&m| r.vec(m * k, 0.05)).collect();
    let gws: Vec<_> = ws.iter().map(|w| d.weight_from_f32(w, w.len() / k, k).unwrap()).collect();
    let pws: Vec<_> = ws.iter().map(|w| d.weight_from_f32(&fold(w), w.len() / k, k).unwrap()).collect();
    let ones = d.upload(&vec![1.0; k], 1, k).unwrap();
    let spec = KvPoolSpec { blocks: 4, block_tokens: 16, layers: vec![KvShape { kv_heads: kvh, head_dim: hd }] };
    let rope = Rope { theta: 10000.0, dims: hd, neox: true, scale: 1.0 };
    for rows in [1usize, 3, 6] {
        let x = d.upload(&r.vec(rows * k, 2.0), rows, k).unwrap();
        let pos: Vec<u32> = (0..rows as u32).map(|i| 3 * i + 2).collect();
        let slots: Vec<u32> = (0..rows as u32).map(|i| 16 + i).collect();
        let mut outs = Vec::new();
        for fused in [true, false] {
            let mut pool = d.kv_pool(&spec).unwrap();
            let (mut h, mut q, mut kk, mut v) = (poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1));
            if fused {
                d.qkv_rope_kv(&x, Some((&gg, eps)), &mut h, [&gws[0], &gws[1], &gws[2]], &mut q, &mut kk, &mut v, &mut pool, 0, &pos, &slots, hd, &rope);
            } else {
                d.rms_norm(&x, &ones, eps, &mut h);
                d.matmul_many(&h, &[&pws[0], &pws[1], &pws[2]], &mut [&mut q, &mut kk, &mut v]);
                d.rope_kv_write(&mut q, &mut kk, &v, &mut pool, 0, &pos, &slots, hd, &rope);
            }
            outs.push([d.download(&q).unwrap(), d.download(&kk).unwrap(), d.download(&v).unwrap()]);
        }
        // bf16(x) scaled after the sums against bf16(x / rms): rounding apart.
        for (name, a, b) in [("q", &outs[0][0], &outs[1][0]), ("k", &outs[0][1], &outs[1][1]), ("v", &outs[0][2], &outs[1][2])] {
            let e = rel(a, b);
            eprintln!("qkv_rope_kv with the norm folded, {rows} rows: {name} rel err {e:.2e}");
            assert!(e < 4e-3, "qkv_rope_kv with the norm folded, {rows} rows: {name} rel err {e}");
        }
    }
    // A folded weight in a plain product is an error (on a device of its own:
    // an error stops every later op).
    let d2 = gpu().unwrap();
    let w = d2.weight_from_f32(&wg, mg, k).unwrap();
    let gg2 = d2.upload(&g, 1, k).unwrap();
    let x = d2.upload(&r.vec(k, 1.0), 1, k).unwrap();
    let (mut n, mut a, mut b, mut o) = (poisoned(&d2, 1, 1), poisoned(&d2, 1, 1), poisoned(&d2, 1, 1), poisoned(&d2, 1, 1));
    d2.norm_gated_matmul(&x, &gg2, eps, &mut n, &w, &w, GateAct::Silu, &mut a, &mut b, &mut o);
    d2.sync().unwrap();
    d2.matmul(&x, &w, &mut o);
    assert!(d2.sync().is_err(), "a plain product took a folded weight");
}

/// The fused ops: q/k/v in one call and the gated MLP input, on few rows
/// (GEMV kernels, several rows per block and partial blocks) and many
/// (cuBLAS), against f64; rope + KV write and add + norm against the plain
/// ops they replace.
#[test]
fn fused_ops_against_references() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let k = 512;
    let ms = [4100usize, 64, 72];
    let ws: Vec<Vec<f32>> = ms.iter().map(|&m| r.vec(m * k, 0.1)).collect();
    let gw: Vec<_> = ws.iter().zip(&ms).map(|(w, &m)| d.weight_from_f32(w, m, k).unwrap()).collect();
    let mg = 1530;
    let (wg, wu) = (r.vec(mg * k, 0.1), r.vec(mg * k, 0.1));
    let (gwg, gwu) = (d.weight_from_f32(&wg, mg, k).unwrap(), d.weight_from_f32(&wu, mg, k).unwrap());
    for rows in [1usize, 3, 4, 5, 8, 40] {
        let gemv = rows <= d.gemv_max_rows();
        let x = r.vec(rows * k, 1.0);
        let gx = d.upload(&x, rows, k).unwrap();
        let (mut a, mut b, mut c) = (poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1));
        d.matmul_many(&gx, &[&gw[0], &gw[1], &gw[2]], &mut [&mut a, &mut b, &mut c]);
        for (i, out) in [&a, &b, &c].into_iter().enumerate() {
            let want: Vec<f32> = mm_ref(&x, &ws[i], rows, k, ms[i]).iter().map(|&v| v as f32).collect();
            let e = rel(&d.download(out).unwrap(), &want);
            eprintln!("matmul_many {rows} rows, weight {i} ({}x{k}): rel err {e:.2e}", ms[i]);
            assert!(e < 1e-4, "matmul_many {rows} rows, weight {i}: rel err {e}");
        }
        // One plain matmul on the same rows agrees with the fused call.
        let mut single = poisoned(&d, 1, 1);
        d.matmul(&gx, &gw[2], &mut single);
        // (Not bit for bit: one launch splits k by the total rows it covers.)
        let e = rel(&d.download(&single).unwrap(), &d.download(&c).unwrap());
        assert!(e < 1e-5, "matmul vs matmul_many, {rows} rows: {e}");
        let (g, u) = (mm_ref(&x, &wg, rows, k, mg), mm_ref(&x, &wu, rows, k, mg));
        for act in [GateAct::Silu, GateAct::GeluTanh] {
            let (mut gate, mut up, mut out) = (poisoned(&d, 1, 1), poisoned(&d, 1, 1), poisoned(&d, 1, 1));
            d.gated_matmul(&gx, &gwg, &gwu, act, &mut gate, &mut up, &mut out);
            // Past the GEMV's rows the GEMMs hand the activation bf16 gate and up.
            let round = |v: f64| if gemv { v } else { rbf(v as f32) as f64 };
            let want: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(&a, &b)| {
                    let (a, b) = (round(a), round(b));
                    let f = match act {
                        GateAct::Silu => a / (1.0 + (-a).exp()),
                        GateAct::GeluTanh => 0.5 * a * (1.0 + (0.7978846 * (a + 0.044715 * a * a * a)).tanh()),
                    };
                    (f * b) as f32
                })
                .collect();
            let e = rel(&d.download(&out).unwrap(), &want);
            eprintln!("gated_matmul {act:?} {rows} rows ({mg}x{k}): rel err {e:.2e}");
            assert!(e < if gemv { 1e-4 } else { 3e-3 }, "gated_matmul {act:?} {rows} rows: rel err {e}");
        }
    }
    // RoPE on q and k plus the KV write, against the three plain ops.
    let (heads, kvh, hd) = (8, 2, 64);
    let spec = KvPoolSpec { blocks: 8, block_tokens: 16, layers: vec![KvShape { kv_heads: kvh, head_dim: hd }] };
    let table = [6u32, 2, 5];
    for (rows, nslots, dims, neox) in [(3usize, 3usize, 64usize, true), (37, 37, 32, false), (5, 4, 64, true)] {
        let rope = Rope { theta: 10000.0, dims, neox, scale: 1.0 };
        let (q, k2, v) = (r.vec(rows * heads * hd, 1.0), r.vec(rows * kvh * hd, 1.0), r.vec(rows * kvh * hd, 1.0));
        let pos: Vec<u32> = (0..rows as u32).map(|i| i * 3 + 1).collect();
        let slots: Vec<u32> = (0..nslots).map(|i| table[i / 16] * 16 + (i % 16) as u32).collect();
        let mut outs = Vec::new();
        for fused in [false, true] {
            let mut pool = d.kv_pool(&spec).unwrap();
            let mut gq = d.upload(&q, rows, heads * hd).unwrap();
            let mut gk = d.upload(&k2, rows, kvh * hd).unwrap();
            let gv = d.upload(&v, rows, kvh * hd).unwrap();
            if fused {
                d.rope_kv_write(&mut gq, &mut gk, &gv, &mut pool, 0, &pos, &slots, hd, &rope);
            } else {
                d.rope(&mut gq, &pos, hd, &rope);
                d.rope(&mut gk, &pos, hd, &rope);
                d.kv_write(&mut pool, 0, &gk, &gv, &slots);
            }
            let probe = d.upload(&q[..heads * hd], 1, heads * hd).unwrap();
            let mut att = poisoned(&d, 1, 1);
            let seq = AttnSeq { q_start: 0, q_len: 1, kv_len: nslots, blocks: &table, window: None };
            d.attention(&probe, &pool, 0, &[seq], 0.125, None, &mut att);
            outs.push((d.download(&gq).unwrap(), d.download(&gk).unwrap(), d.download(&att).unwrap()));
        }
        let (a, b) = (&outs[0], &outs[1]);
        let (eq, ek, ea) = (rel(&b.0, &a.0), rel(&b.1, &a.1), rel(&b.2, &a.2));
        eprintln!("rope_kv_write {rows} rows, {nslots} slots, dims {dims}, neox {neox}: q {eq:.1e} k {ek:.1e} attention {ea:.1e}");
        assert!(eq < 1e-6 && ek < 1e-6 && ea < 1e-3, "rope_kv_write: q {eq} k {ek} attention {ea}");
    }
    // Residual + norm over heads (not whole rows) takes the plain ops.
    let cpu = Cpu::new(Some(1));
    let (rows, cols) = (4, 256);
    let (x, y, w) = (r.vec(rows * cols, 1.0), r.vec(rows * cols, 1.0), r.vec(64, 1.0));
    let (mut gx, gy, gw) = (d.upload(&x, rows, cols).unwrap(), d.upload(&y, rows, cols).unwrap(), d.upload(&w, 1, 64).unwrap());
    let (mut cx, cy, cw) = (cpu.upload(&x, rows, cols).unwrap(), cpu.upload(&y, rows, cols).unwrap(), cpu.upload(&w, 1, 64).unwrap());
    let (mut go, mut co) = (poisoned(&d, 1, 1), cpu.tensor(0, 0));
    d.add_rms_norm(&mut gx, &gy, &gw, 1e-6, &mut go);
    cpu.add_rms_norm(&mut cx, &cy, &cw, 1e-6, &mut co);
    assert!(rel(&d.download(&gx).unwrap(), &cx.data) < 1e-6, "add_rms_norm per head: residual");
    assert!(rel(&d.download(&go).unwrap(), &co.data) < 1e-5, "add_rms_norm per head: output");
}

struct Case {
    heads: usize,
    kv_heads: usize,
    hd: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    /// (q_len, kv_len) per sequence.
    seqs: Vec<(usize, usize)>,
}

/// Host reference in f64 over the bf16-rounded K/V the pool holds.
#[allow(clippy::too_many_arguments)]
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

fn run_attention_case(d: &Cuda, r: &mut Rng, c: &Case, tol: f64) {
    let bt = 16;
    let kvw = c.kv_heads * c.hd;
    let total_blocks: usize = c.seqs.iter().map(|s| s.1.div_ceil(bt)).sum::<usize>() + 3;
    let spec = KvPoolSpec {
        blocks: total_blocks,
        block_tokens: bt,
        layers: vec![KvShape { kv_heads: 1, head_dim: 16 }, KvShape { kv_heads: c.kv_heads, head_dim: c.hd }],
    };
    let mut pool = d.kv_pool(&spec).unwrap();
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
}

#[test]
fn decode_attention_against_f64() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    // q_len <= 4: the split-KV decode kernel (with and without splits).
    let cases = [
        Case { heads: 32, kv_heads: 8, hd: 64, window: None, softcap: None, seqs: vec![(1, 1), (1, 37), (1, 300), (1, 1029)] },
        Case { heads: 8, kv_heads: 8, hd: 128, window: None, softcap: None, seqs: vec![(1, 5000)] },
        Case { heads: 4, kv_heads: 1, hd: 256, window: Some(100), softcap: Some(50.0), seqs: vec![(3, 40), (1, 700)] },
        Case { heads: 16, kv_heads: 2, hd: 64, window: None, softcap: None, seqs: (0..70).map(|i| (1 + i % 4, 4 + i * 13)).collect() },
    ];
    for c in &cases {
        run_attention_case(&d, &mut r, c, 1e-4);
    }
}

#[test]
fn prefill_attention_against_f64() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    // q_len > 4: the tensor-core kernel (q and P rounded to bf16).
    let cases = [
        Case { heads: 32, kv_heads: 8, hd: 64, window: None, softcap: None, seqs: vec![(200, 200)] },
        Case { heads: 8, kv_heads: 4, hd: 64, window: None, softcap: None, seqs: vec![(77, 500), (1, 20), (64, 64), (5, 9)] },
        Case { heads: 4, kv_heads: 2, hd: 128, window: None, softcap: None, seqs: vec![(130, 1000)] },
        Case { heads: 4, kv_heads: 1, hd: 256, window: Some(48), softcap: Some(30.0), seqs: vec![(150, 170)] },
    ];
    for c in &cases {
        run_attention_case(&d, &mut r, c, 1.5e-2);
    }
}

#[test]
fn kv_copy_blocks_copies_every_layer() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let spec = KvPoolSpec { blocks: 4, block_tokens: 16, layers: vec![KvShape { kv_heads: 2, head_dim: 64 }; 2] };
    let mut pool = d.kv_pool(&spec).unwrap();
    let w = 128;
    let k = r.vec(16 * w, 1.0);
    let v = r.vec(16 * w, 1.0);
    let (gk, gv) = (d.upload(&k, 16, w).unwrap(), d.upload(&v, 16, w).unwrap());
    let slots: Vec<u32> = (16..32).collect();
    for l in 0..2 {
        d.kv_write(&mut pool, l, &gk, &gv, &slots);
    }
    d.kv_copy_blocks(&mut pool, &[1], &[3]);
    // Attend from block 3 and from block 1: identical outputs.
    let q = r.vec(8 * 64, 1.0);
    let gq = d.upload(&q, 1, 8 * 64).unwrap();
    for l in 0..2 {
        let mut a = poisoned(&d, 1, 512);
        let mut b = poisoned(&d, 1, 512);
        d.attention(&gq, &pool, l, &[AttnSeq { q_start: 0, q_len: 1, kv_len: 16, blocks: &[1], window: None }], 0.125, None, &mut a);
        d.attention(&gq, &pool, l, &[AttnSeq { q_start: 0, q_len: 1, kv_len: 16, blocks: &[3], window: None }], 0.125, None, &mut b);
        assert_eq!(d.download(&a).unwrap(), d.download(&b).unwrap(), "layer {l}");
    }
}

/// A small forward (embed, norm, matmul, rope, KV write, attention) run
/// eagerly and as a replayed CUDA graph gives identical bits, step after step.
#[test]
fn graph_replay_equals_eager() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let (vocab, hidden, heads, kvh, hd) = (500, 256, 4, 2, 64);
    let emb = d.weight_from_f32(&r.vec(vocab * hidden, 1.0), vocab, hidden).unwrap();
    let wq = d.weight_from_f32(&r.vec(heads * hd * hidden, 0.1), heads * hd, hidden).unwrap();
    let wk = d.weight_from_f32(&r.vec(kvh * hd * hidden, 0.1), kvh * hd, hidden).unwrap();
    let norm = d.upload(&r.vec(hidden, 1.0), 1, hidden).unwrap();
    let spec = KvPoolSpec { blocks: 64, block_tokens: 16, layers: vec![KvShape { kv_heads: kvh, head_dim: hd }] };
    let rope = Rope { theta: 10000.0, dims: hd, neox: true, scale: 1.0 };
    let run = |graph: bool| -> Vec<Vec<f32>> {
        let mut pool = d.kv_pool(&spec).unwrap();
        let (mut x, mut h, mut q, mut k, mut att) = (d.tensor(0, 0), d.tensor(0, 0), d.tensor(0, 0), d.tensor(0, 0), d.tensor(0, 0));
        let tables: Vec<Vec<u32>> = (0..3).map(|s| (0..8).map(|b| (s * 8 + b) as u32).collect()).collect();
        let mut outs = Vec::new();
        for step in 0..6usize {
            let toks: Vec<u32> = (0..3).map(|s| ((step * 31 + s * 7) % vocab) as u32).collect();
            let lens: Vec<usize> = (0..3).map(|s| 5 + s * 20 + step).collect();
            let pos: Vec<u32> = lens.iter().map(|&l| (l - 1) as u32).collect();
            let slots: Vec<u32> = (0..3).map(|s| tables[s][(lens[s] - 1) / 16] * 16 + ((lens[s] - 1) % 16) as u32).collect();
            let seqs: Vec<AttnSeq> = (0..3).map(|s| AttnSeq { q_start: s, q_len: 1, kv_len: lens[s], blocks: &tables[s], window: None }).collect();
            let mut f = || -> anyhow::Result<()> {
                d.embed(&emb, &toks, 1.0, &mut x);
                d.rms_norm(&x, &norm, 1e-6, &mut h);
                d.matmul(&h, &wq, &mut q);
                d.matmul(&h, &wk, &mut k);
                d.rope(&mut q, &pos, hd, &rope);
                d.rope(&mut k, &pos, hd, &rope);
                d.kv_write(&mut pool, 0, &k, &k, &slots);
                d.attention(&q, &pool, 0, &seqs, 0.125, None, &mut att);
                Ok(())
            };
            if graph {
                d.graph(&mut f).unwrap();
            } else {
                f().unwrap();
            }
            outs.push(d.download(&att).unwrap());
        }
        outs
    };
    let eager = run(false);
    let (h0, c0, _) = d.graph_stats();
    let graphed = run(true);
    let (h1, c1, fb) = d.graph_stats();
    eprintln!("graph replays {} captures {} fallbacks {fb}", h1 - h0, c1 - c0);
    assert!(h1 - h0 >= 3, "the graph was not replayed");
    assert_eq!(eager, graphed, "graph replay differs from eager");
}

// ---- the hybrid families' ops (cuda/hybrid.rs) against the CPU device ----

use braid_ops::{BlockSparse, KvDtype, SsmShape, StateSeq};

/// `t` (an op's output that claims a current bf16 copy) through a GEMV and a
/// cuBLAS GEMM, which read that copy, against f64 over its own f32 values
/// rounded to bf16 (the host's values, a hair off the device's, can round
/// the other way): a stale copy fails. `host`: the CPU's result, which the
/// f32 values must match first.
fn check_bf16_copy(d: &Cuda, r: &mut Rng, what: &str, t: &<Cuda as Device>::Tensor, host: &[f32]) {
    let (rows, cols) = d.shape(t);
    let m = 48;
    let w = r.vec(m * cols, 0.1);
    let gw = d.weight_from_f32(&w, m, cols).unwrap();
    let own = d.download(t).unwrap();
    let e = rel(&own, host);
    assert!(e < 1e-3, "{what}: f32 values off the CPU's (rel err {e})");
    let want: Vec<f32> = mm_ref(&own, &w, rows, cols, m).iter().map(|&v| v as f32).collect();
    let mut out = poisoned(d, 1, 1);
    d.matmul(t, &gw, &mut out);
    let e = rel(&d.download(&out).unwrap(), &want);
    assert!(e < 1e-4, "{what}: the bf16 copy read by a matmul is off (rel err {e})");
}

/// Make `t`'s bf16 copy current (a matmul reads it), so an in-place op
/// that forgets to mark it stale leaves a stale copy behind.
fn make_bf16_current(d: &Cuda, t: &<Cuda as Device>::Tensor) {
    let cols = d.shape(t).1;
    let w = d.weight_from_f32(&vec![0.5; 8 * cols], 8, cols).unwrap();
    let mut out = poisoned(d, 1, 1);
    d.matmul(t, &w, &mut out);
}

fn report(op: &str, e: f64, tol: f64) {
    eprintln!("op {op}: rel err {e:.2e}");
    assert!(e < tol, "op {op}: rel err {e} over {tol}");
}

#[test]
fn hybrid_pointwise_ops_match_cpu() {
    let Some(d) = gpu() else { return };
    let cpu = Cpu::new(Some(1));
    let mut r = Rng(seed());
    // 5 rows of 1536 (partial GEMV blocks), then 40 rows (cuBLAS) for the copies.
    for rows in [5usize, 40] {
        let cols = 1536;
        let (x, y) = (r.vec(rows * cols, 3.0), r.vec(rows * cols, 3.0));
        let (gx, gy) = (d.upload(&x, rows, cols).unwrap(), d.upload(&y, rows, cols).unwrap());
        let (cx, cy) = (cpu.upload(&x, rows, cols).unwrap(), cpu.upload(&y, rows, cols).unwrap());

        let (mut a, mut ca) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
        d.silu(&mut a).unwrap();
        cpu.silu(&mut ca).unwrap();
        report(&format!("silu {rows}x{cols}"), rel(&d.download(&a).unwrap(), &ca.data), 1e-6);
        check_bf16_copy(&d, &mut r, "silu", &a, &ca.data);

        let (mut o, mut co) = (poisoned(&d, 1, 1), cpu.tensor(0, 0));
        d.relu2(&gx, &mut o).unwrap();
        cpu.relu2(&cx, &mut co).unwrap();
        report(&format!("relu2 {rows}x{cols}"), rel(&d.download(&o).unwrap(), &co.data), 1e-6);
        check_bf16_copy(&d, &mut r, "relu2", &o, &co.data);

        let (mut a, mut ca) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
        d.mul(&mut a, &gy).unwrap();
        cpu.mul(&mut ca, &cy).unwrap();
        report(&format!("mul {rows}x{cols}"), rel(&d.download(&a).unwrap(), &ca.data), 1e-6);
        check_bf16_copy(&d, &mut r, "mul", &a, &ca.data);

        let (mut a, mut ca) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
        d.sigmoid_mul(&mut a, &gy).unwrap();
        cpu.sigmoid_mul(&mut ca, &cy).unwrap();
        report(&format!("sigmoid_mul {rows}x{cols}"), rel(&d.download(&a).unwrap(), &ca.data), 1e-6);
        check_bf16_copy(&d, &mut r, "sigmoid_mul", &a, &ca.data);

        for limit in [2.0f32, f32::INFINITY] {
            let (mut o, mut co) = (poisoned(&d, 1, 1), cpu.tensor(0, 0));
            d.swiglu_clamped(&gx, &gy, limit, 1.702, &mut o).unwrap();
            cpu.swiglu_clamped(&cx, &cy, limit, 1.702, &mut co).unwrap();
            report(&format!("swiglu_clamped limit {limit} {rows}x{cols}"), rel(&d.download(&o).unwrap(), &co.data), 1e-6);
            check_bf16_copy(&d, &mut r, "swiglu_clamped", &o, &co.data);
        }

        // Groups small (a warp loops once), odd-sized and whole rows.
        for group in [64usize, 96, 512, cols] {
            let w = r.vec(cols, 1.0);
            let (gw, cw) = (d.upload(&w, 1, cols).unwrap(), cpu.upload(&w, 1, cols).unwrap());
            let (mut o, mut co) = (poisoned(&d, 1, 1), cpu.tensor(0, 0));
            d.group_rms_norm(&gx, &gw, group, 1e-5, &mut o).unwrap();
            cpu.group_rms_norm(&cx, &cw, group, 1e-5, &mut co).unwrap();
            report(&format!("group_rms_norm groups of {group} {rows}x{cols}"), rel(&d.download(&o).unwrap(), &co.data), 1e-5);
            check_bf16_copy(&d, &mut r, "group_rms_norm", &o, &co.data);
        }
        let w = d.upload(&r.vec(cols, 1.0), 1, cols).unwrap();
        let mut o = poisoned(&d, 1, 1);
        assert!(d.group_rms_norm(&gx, &w, 100, 1e-5, &mut o).is_err(), "groups that do not divide the row");
        assert!(d.mul(&mut d.upload(&x[..cols], 1, cols).unwrap(), &gy).is_err(), "mul of different shapes");
    }

    // RoPE from a table: a rotated part, then zero frequencies (Gemma 4's
    // proportional RoPE), on 3 heads of 64; large positions too.
    let (rows, hd, heads) = (7usize, 64usize, 3usize);
    let x = r.vec(rows * heads * hd, 1.0);
    let mut inv: Vec<f32> = (0..8).map(|i| 1e6f32.powf(-(2.0 * i as f32) / 64.0)).collect();
    inv.resize(hd / 2, 0.0);
    let pos: Vec<u32> = (0..rows as u32).map(|i| i * 4099 + 1).collect();
    for table in [&inv[..], &inv[..8]] {
        let (mut g, mut c) = (d.upload(&x, rows, heads * hd).unwrap(), cpu.upload(&x, rows, heads * hd).unwrap());
        make_bf16_current(&d, &g);
        d.rope_freqs(&mut g, &pos, hd, table).unwrap();
        cpu.rope_freqs(&mut c, &pos, hd, table).unwrap();
        let got = d.download(&g).unwrap();
        report(&format!("rope_freqs {} frequencies, head {hd}", table.len()), rel(&got, &c.data), 1e-5);
        // Pairs of zero frequency pass exactly.
        for (i, (a, b)) in got.iter().zip(&x).enumerate() {
            let dim = i % hd % (hd / 2);
            if table.len() == hd / 2 && dim >= 8 {
                assert_eq!(a, b, "rope_freqs: a zero-frequency pair moved");
            }
        }
        check_bf16_copy(&d, &mut r, "rope_freqs (copy marked stale)", &g, &c.data);
    }
    let mut g = d.upload(&x, rows, heads * hd).unwrap();
    assert!(d.rope_freqs(&mut g, &pos, hd, &[0.5; 33]).is_err(), "more frequencies than a head holds");

    // scatter_add_rows: distinct targets (rows in parallel) and repeated ones (in order).
    let cols = 700;
    for rows in [vec![5u32, 0, 9, 3], vec![2, 2, 7, 2, 0, 7]] {
        let n = rows.len();
        let base = r.vec(10 * cols, 1.0);
        let y = r.vec(n * cols, 1.0);
        let wts = r.vec(n, 1.0);
        let (mut go, mut co) = (d.upload(&base, 10, cols).unwrap(), cpu.upload(&base, 10, cols).unwrap());
        let (gy, cy) = (d.upload(&y, n, cols).unwrap(), cpu.upload(&y, n, cols).unwrap());
        make_bf16_current(&d, &go);
        d.scatter_add_rows(&mut go, &gy, &rows, &wts).unwrap();
        cpu.scatter_add_rows(&mut co, &cy, &rows, &wts).unwrap();
        let got = d.download(&go).unwrap();
        report(&format!("scatter_add_rows targets {rows:?}"), rel(&got, &co.data), 1e-6);
        // Rows not named are untouched.
        for t in 0..10 {
            if !rows.contains(&(t as u32)) {
                assert_eq!(&got[t * cols..(t + 1) * cols], &base[t * cols..(t + 1) * cols], "scatter_add_rows wrote row {t}");
            }
        }
        check_bf16_copy(&d, &mut r, "scatter_add_rows (copy marked stale)", &go, &co.data);
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
type GT = <Cuda as Device>::Tensor;
type CT = <Cpu as Device>::Tensor;
type GpuStateOp<'a> = dyn Fn(&GT, &mut GT, &[StateSeq], &mut GT) + 'a;
type CpuStateOp<'a> = dyn Fn(&CT, &mut CT, &[StateSeq], &mut CT) + 'a;

/// Runs a recurrent op on both devices over several sequences at once
/// (random starting state, the op's part of each state row at an offset),
/// and compares outputs and updated state; then, on the GPU, one sequence
/// fed in chunks must give the same bits as fed whole (the scan steps token
/// by token either way), state included.
#[allow(clippy::too_many_arguments)]
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
        assert!(out.iter().zip(&whole).all(|(p, q)| p.to_bits() == q.to_bits()), "{what}: chunks {cuts:?} differ from the whole pass");
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
        let gop = |x: &GT, st: &mut GT, s: &[StateSeq], o: &mut GT| d.short_conv(x, &gw, bias.then_some(&gb), k, silu, st, off, s, o).unwrap();
        let cop = |x: &CT, st: &mut CT, s: &[StateSeq], o: &mut CT| cpu.short_conv(x, &cw, bias.then_some(&cb), k, silu, st, off, s, o).unwrap();
        check_state_op(&d, &cpu, &mut r, &format!("short_conv C={c} K={k} bias={bias} silu={silu}"), c, cols, &gop, &cop, 1e-5);
    }

    // Mamba2 scan: Nemotron-H-like heads (64 dims, state 128, 2 groups), and
    // an odd small shape (partial warps and lanes).
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
        let split_g = |x: &GT| {
            let v = d.download(x).unwrap();
            let rows = v.len() / xin;
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for row in v.chunks(xin) {
                a.extend_from_slice(&row[..xw]);
                // dt spread over [-4, 4): some fall under dt_min / over dt_max after the softplus.
                b.extend(row[xw..].iter().map(|t| t * 4.0));
            }
            (d.upload(&a, rows, xw).unwrap(), d.upload(&b, rows, sh.heads).unwrap())
        };
        let split_c = |x: &CT| {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for row in x.data.chunks(xin) {
                a.extend_from_slice(&row[..xw]);
                b.extend(row[xw..].iter().map(|t| t * 4.0));
            }
            (cpu.upload(&a, x.rows, xw).unwrap(), cpu.upload(&b, x.rows, sh.heads).unwrap())
        };
        let gop = |x: &GT, st: &mut GT, s: &[StateSeq], o: &mut GT| {
            let (xbc, dt) = split_g(x);
            d.ssm_scan(&xbc, &dt, &gbias, &ga, &gd, &sh, st, off, s, o).unwrap()
        };
        let cop = |x: &CT, st: &mut CT, s: &[StateSeq], o: &mut CT| {
            let (xbc, dt) = split_c(x);
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
        let gop = |x: &GT, st: &mut GT, s: &[StateSeq], o: &mut GT| d.linear_attention(x, &gsl, heads, hd, st, off, s, o).unwrap();
        let cop = |x: &CT, st: &mut CT, s: &[StateSeq], o: &mut CT| cpu.linear_attention(x, &csl, heads, hd, st, off, s, o).unwrap();
        check_state_op(&d, &cpu, &mut r, &format!("linear_attention heads {heads} dim {hd}"), heads * 3 * hd, cols, &gop, &cop, 1e-5);
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
    let spec = KvPoolSpec { blocks, block_tokens: bt, layers: vec![KvShape { kv_heads: kvh, head_dim: hd }, KvShape { kv_heads: 1, head_dim: idim }] };
    let mut gpool = d.kv_pool(&spec).unwrap();
    let mut cpool = cpu.kv_pool_as(&spec, KvDtype::F32).unwrap();
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
        let (mut go, mut co) = (poisoned(&d, 1, 1), cpu.tensor(0, 0));
        d.block_sparse_attention(&gq, &giq, &gpool, 0, 1, &seqs, scale, &sel, &mut go).unwrap();
        cpu.block_sparse_attention(&cq, &ciq, &cpool, 0, 1, &seqs, scale, &sel, &mut co).unwrap();
        let got = d.download(&go).unwrap();
        report(&format!("block_sparse_attention block {} local {} topk {}", sel.block, sel.local, sel.topk), rel(&got, &co.data), 1e-4);
        check_bf16_copy(&d, &mut r, "block_sparse_attention", &go, &co.data);
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
