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
    for &(rows, k, m) in &[(1, 256, 384), (7, 512, 96), (64, 1024, 512), (300, 320, 200)] {
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
    let logits = r.vec(3 * 50000, 5.0);
    let t = d.upload(&logits, 3, 50000).unwrap();
    let am = d.argmax(&t).unwrap();
    for (i, &a) in am.iter().enumerate() {
        let row = &logits[i * 50000..(i + 1) * 50000];
        let want = row.iter().enumerate().fold(0, |b, (j, v)| if *v > row[b] { j } else { b });
        assert_eq!(a as usize, want, "argmax row {i}");
    }
}

/// `x · wᵀ` in f64 over the bf16-rounded operands.
fn mm_ref(x: &[f32], w: &[f32], rows: usize, k: usize, m: usize) -> Vec<f64> {
    let xb: Vec<f64> = x.iter().map(|&v| rbf(v) as f64).collect();
    let wb: Vec<f64> = w.iter().map(|&v| rbf(v) as f64).collect();
    let mut y = vec![0f64; rows * m];
    for i in 0..rows {
        for j in 0..m {
            y[i * m + j] = (0..k).map(|c| xb[i * k + c] * wb[j * k + c]).sum();
        }
    }
    y
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
