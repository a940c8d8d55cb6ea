//! The CPU ops of the hybrid families against plain reference loops, and
//! the property models rely on: a sequence split into chunks (state carried
//! between calls), or batched beside other sequences, gives bit-identical
//! rows.

use braid_ops::cpu::{Cpu, CpuTensor};
use braid_ops::{Act, AttnSeq, BlockSparse, DeltaShape, Device, KvDtype, KvPoolSpec, KvShape, Map, RecurrentOps, SparseAttentionOps, SsmShape, StateSeq};

#[path = "common/rng.rs"]
mod rng;
use rng::XorShift as Rng;

fn t(data: Vec<f32>, rows: usize, cols: usize) -> CpuTensor {
    assert_eq!(data.len(), rows * cols);
    CpuTensor { data, rows, cols }
}

fn rows_of(x: &CpuTensor, a: usize, b: usize) -> CpuTensor {
    t(x.data[a * x.cols..b * x.cols].to_vec(), b - a, x.cols)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// An op over (input, state, sequences, output).
type StateOp<'a> = dyn Fn(&CpuTensor, &mut CpuTensor, &[StateSeq], &mut CpuTensor) + 'a;

/// Runs `op` over `x` in the chunks given (state carried in row `slot`), and
/// returns the concatenated outputs.
fn chunked(x: &CpuTensor, cuts: &[usize], state: &mut CpuTensor, slot: u32, op: &StateOp<'_>) -> Vec<f32> {
    let mut out = Vec::new();
    let mut a = 0;
    for &b in cuts.iter().chain(std::iter::once(&x.rows)) {
        let part = rows_of(x, a, b);
        let mut o = CpuTensor::default();
        op(&part, state, &[StateSeq { start: 0, len: b - a, slot }], &mut o);
        out.extend_from_slice(&o.data);
        a = b;
    }
    out
}

#[test]
fn short_conv_matches_reference_and_is_chunk_and_batch_invariant() {
    let dev = Cpu::new(Some(2));
    let (c, k, n) = (5, 4, 11);
    let mut r = Rng(7);
    let x = t(r.vec(n * c, 1.0), n, c);
    let w = t(r.vec(c * k, 1.0), 1, c * k);
    let b = t(r.vec(c, 1.0), 1, c);
    let op = |x: &CpuTensor, st: &mut CpuTensor, seqs: &[StateSeq], out: &mut CpuTensor| dev.short_conv(x, &w, Some(&b), k, true, st, 3, seqs, out).unwrap();
    // State rows of 3 + c*(k-1) + 2 values: the op must use only its part.
    let cols = 3 + c * (k - 1) + 2;
    let mut st = t(vec![0.0; 2 * cols], 2, cols);
    let whole = chunked(&x, &[], &mut st, 1, &op);
    for t_ in 0..n {
        for ch in 0..c {
            let mut acc = b.data[ch] as f64;
            for kk in 0..k {
                let src = t_ as isize - (k - 1) as isize + kk as isize;
                if src >= 0 {
                    acc += (w.data[ch * k + kk] * x.data[src as usize * c + ch]) as f64;
                }
            }
            let want = acc / (1.0 + (-acc).exp());
            assert!((whole[t_ * c + ch] as f64 - want).abs() < 1e-5, "row {t_} channel {ch}");
        }
    }
    assert!(st.data[..cols].iter().all(|&v| v == 0.0), "row 0 was not the sequence's");
    assert!(st.data[cols..cols + 3].iter().all(|&v| v == 0.0) && st.data[2 * cols - 2..].iter().all(|&v| v == 0.0), "wrote outside its offset");
    let end_state = st.data.clone();
    for cuts in [vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10], vec![3, 7], vec![2]] {
        let mut st = t(vec![0.0; 2 * cols], 2, cols);
        assert_eq!(chunked(&x, &cuts, &mut st, 1, &op), whole, "cuts {cuts:?}");
        assert_eq!(st.data, end_state);
    }
    // Two sequences in one call: each as if alone.
    let y = t(r.vec(4 * c, 1.0), 4, c);
    let mut both = t(y.data.clone(), 4, c);
    both.data.extend_from_slice(&x.data);
    both.rows += n;
    let mut st2 = t(vec![0.0; 2 * cols], 2, cols);
    let mut o = CpuTensor::default();
    op(&both, &mut st2, &[StateSeq { start: 0, len: 4, slot: 0 }, StateSeq { start: 4, len: n, slot: 1 }], &mut o);
    assert_eq!(&o.data[4 * c..], &whole[..]);
    let mut st3 = t(vec![0.0; 2 * cols], 2, cols);
    assert_eq!(&o.data[..4 * c], &chunked(&y, &[], &mut st3, 0, &op)[..]);
    // Two sequences naming one state row would race: an error.
    assert!(dev
        .short_conv(&both, &w, None, k, false, &mut st2, 0, &[StateSeq { start: 0, len: 4, slot: 0 }, StateSeq { start: 4, len: 2, slot: 0 }], &mut o)
        .is_err());
}

#[test]
fn ssm_scan_matches_reference_and_is_chunk_invariant() {
    let dev = Cpu::new(Some(2));
    let sh = SsmShape { heads: 4, head_dim: 3, state_dim: 5, groups: 2, dt_min: 0.01, dt_max: f32::INFINITY };
    let inner = sh.heads * sh.head_dim;
    let w = inner + 2 * sh.groups * sh.state_dim;
    let n = 9;
    let mut r = Rng(11);
    let xbc = t(r.vec(n * w, 1.0), n, w);
    let mut dtv = r.vec(n * sh.heads, 1.0);
    dtv.iter_mut().for_each(|v| *v *= 6.0); // some dt fall under dt_min after the softplus
    let dt_all = t(dtv, n, sh.heads);
    let dt_bias = t(r.vec(sh.heads, 1.0), 1, sh.heads);
    let a = t(r.vec(sh.heads, 1.0).iter().map(|v| -v.abs() - 0.1).collect(), 1, sh.heads);
    let d = t(r.vec(sh.heads, 1.0), 1, sh.heads);
    let per = sh.heads * sh.head_dim * sh.state_dim;
    let run = |cuts: &[usize]| {
        let mut st = t(vec![0.0; per], 1, per);
        let mut out = Vec::new();
        let mut s = 0;
        for &e in cuts.iter().chain(std::iter::once(&n)) {
            let mut o = CpuTensor::default();
            dev.ssm_scan(
                &rows_of(&xbc, s, e),
                &rows_of(&dt_all, s, e),
                &dt_bias,
                &a,
                &d,
                &sh,
                &mut st,
                0,
                &[StateSeq { start: 0, len: e - s, slot: 0 }],
                &mut o,
            )
            .unwrap();
            out.extend_from_slice(&o.data);
            s = e;
        }
        (out, st.data)
    };
    let (whole, end) = run(&[]);
    // Reference in f64.
    let g_of = |h: usize| h / (sh.heads / sh.groups);
    let mut s_ref = vec![0f64; per];
    let mut clamped = 0;
    for t_ in 0..n {
        let row = &xbc.data[t_ * w..(t_ + 1) * w];
        for h in 0..sh.heads {
            let raw = (dt_all.data[t_ * sh.heads + h] + dt_bias.data[h]) as f64;
            let sp = raw.exp().ln_1p();
            if sp < sh.dt_min as f64 {
                clamped += 1;
            }
            let step = sp.max(sh.dt_min as f64);
            let decay = (step * a.data[h] as f64).exp();
            let g = g_of(h);
            for p in 0..sh.head_dim {
                let xp = row[h * sh.head_dim + p] as f64;
                let mut y = 0.0;
                for nn in 0..sh.state_dim {
                    let bv = row[inner + g * sh.state_dim + nn] as f64;
                    let cv = row[inner + sh.groups * sh.state_dim + g * sh.state_dim + nn] as f64;
                    let i = (h * sh.head_dim + p) * sh.state_dim + nn;
                    s_ref[i] = decay * s_ref[i] + step * xp * bv;
                    y += s_ref[i] * cv;
                }
                y += d.data[h] as f64 * xp;
                assert!((whole[t_ * inner + h * sh.head_dim + p] as f64 - y).abs() < 1e-5, "row {t_} head {h} p {p}");
            }
        }
    }
    assert!(clamped > 0, "the test should exercise the dt clamp");
    for cuts in [vec![1, 2, 3, 4, 5, 6, 7, 8], vec![4], vec![2, 7]] {
        assert_eq!(run(&cuts), (whole.clone(), end.clone()), "cuts {cuts:?}");
    }
}

#[test]
fn linear_attention_matches_reference_and_is_chunk_invariant() {
    let dev = Cpu::new(Some(2));
    let (heads, hd, n) = (3, 4, 10);
    let mut r = Rng(5);
    let qkv = t(r.vec(n * heads * 3 * hd, 1.0), n, heads * 3 * hd);
    let slopes = t(vec![0.1, 0.5, 1.3], 1, heads);
    let per = heads * hd * hd;
    let run = |cuts: &[usize]| {
        let mut st = t(vec![0.0; 2 * per], 2, per);
        let op =
            |x: &CpuTensor, st: &mut CpuTensor, seqs: &[StateSeq], out: &mut CpuTensor| dev.linear_attention(x, &slopes, heads, hd, st, 0, seqs, out).unwrap();
        let o = chunked(&qkv, cuts, &mut st, 1, &op);
        (o, st.data)
    };
    let (whole, end) = run(&[]);
    let mut s = vec![0f64; per];
    for t_ in 0..n {
        for h in 0..heads {
            let base = t_ * heads * 3 * hd + h * 3 * hd;
            let (q, k, v) = (&qkv.data[base..base + hd], &qkv.data[base + hd..base + 2 * hd], &qkv.data[base + 2 * hd..base + 3 * hd]);
            let decay = (-(slopes.data[h] as f64)).exp();
            for i in 0..hd {
                for j in 0..hd {
                    let x = &mut s[h * hd * hd + i * hd + j];
                    *x = decay * *x + k[i] as f64 * v[j] as f64;
                }
            }
            for j in 0..hd {
                let o: f64 = (0..hd).map(|i| q[i] as f64 * s[h * hd * hd + i * hd + j]).sum();
                assert!((whole[t_ * heads * hd + h * hd + j] as f64 - o).abs() < 1e-5);
            }
        }
    }
    assert!(end[..per].iter().all(|&v| v == 0.0), "state row 0 untouched");
    for cuts in [vec![1, 2, 3, 4, 5, 6, 7, 8, 9], vec![5], vec![3, 4]] {
        assert_eq!(run(&cuts), (whole.clone(), end.clone()), "cuts {cuts:?}");
    }
}

/// The gated delta rule against a plain f64 loop of its definition, for two
/// value heads a key head and for one (keys wider than values); chunks and
/// a second sequence beside it change no bit.
#[test]
fn gated_delta_rule_matches_reference_and_is_chunk_and_batch_invariant() {
    let dev = Cpu::new(Some(2));
    for (nk, nv, dk, dv) in [(2usize, 4usize, 8usize, 6usize), (2, 2, 12, 5)] {
        let sh = DeltaShape { key_heads: nk, value_heads: nv, key_dim: dk, value_dim: dv, l2_eps: 1e-6, scale: 1.0 / (dk as f32).sqrt() };
        let n = 11;
        let mut r = Rng(9);
        let qw = sh.qkv_width();
        let qkv = t(r.vec(n * qw, 1.0), n, qw);
        // a over [-8, 8): both ends of the softplus.
        let a = t(r.vec(n * nv, 8.0), n, nv);
        let b = t(r.vec(n * nv, 3.0), n, nv);
        let dt_bias = t(r.vec(nv, 1.0), 1, nv);
        let decay = t(r.vec(nv, 1.0).iter().map(|x| -x.exp()).collect(), 1, nv);
        let per = nv * dk * dv;
        // State rows of 2 + per + 3 values: the op must use only its part.
        let cols = 2 + per + 3;
        let op = |x: &CpuTensor, a: &CpuTensor, b: &CpuTensor, st: &mut CpuTensor, seqs: &[StateSeq], out: &mut CpuTensor| {
            dev.gated_delta_rule(x, a, b, &dt_bias, &decay, &sh, st, 2, seqs, out).unwrap()
        };
        // `cuts` chunks in slot 1.
        let run = |cuts: &[usize]| {
            let mut st = t(vec![0.0; 2 * cols], 2, cols);
            let mut out = Vec::new();
            let mut at = 0;
            for &end in cuts.iter().chain(std::iter::once(&n)) {
                let mut o = CpuTensor::default();
                let part = |x: &CpuTensor| rows_of(x, at, end);
                op(&part(&qkv), &part(&a), &part(&b), &mut st, &[StateSeq { start: 0, len: end - at, slot: 1 }], &mut o);
                out.extend_from_slice(&o.data);
                at = end;
            }
            (out, st.data)
        };
        let (whole, end) = run(&[]);

        let mut s = vec![0f64; per];
        let l2 = |x: &[f32], scale: f64| -> Vec<f64> {
            let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
            x.iter().map(|&v| v as f64 * scale / (ss + 1e-6).sqrt()).collect()
        };
        for t_ in 0..n {
            let row = qkv.row(t_);
            for h in 0..nv {
                let kh = h / (nv / nk);
                let q = l2(&row[kh * dk..(kh + 1) * dk], 1.0 / (dk as f64).sqrt());
                let k = l2(&row[(nk + kh) * dk..(nk + kh + 1) * dk], 1.0);
                let v = &row[2 * nk * dk + h * dv..2 * nk * dk + (h + 1) * dv];
                let x = a.data[t_ * nv + h] as f64 + dt_bias.data[h] as f64;
                let softplus = if x > 20.0 { x } else { x.exp().ln_1p() };
                let g = (decay.data[h] as f64 * softplus).exp();
                let beta = 1.0 / (1.0 + (-(b.data[t_ * nv + h] as f64)).exp());
                let sh_ = &mut s[h * dk * dv..(h + 1) * dk * dv];
                sh_.iter_mut().for_each(|x| *x *= g);
                for j in 0..dv {
                    let kv: f64 = (0..dk).map(|i| sh_[i * dv + j] * k[i]).sum();
                    let delta = beta * (v[j] as f64 - kv);
                    for i in 0..dk {
                        sh_[i * dv + j] += k[i] * delta;
                    }
                }
                for j in 0..dv {
                    let o: f64 = (0..dk).map(|i| sh_[i * dv + j] * q[i]).sum();
                    let got = whole[t_ * nv * dv + h * dv + j] as f64;
                    assert!((got - o).abs() < 1e-5, "{nv}/{nk} heads: row {t_} head {h} col {j}: {got} vs {o}");
                }
            }
        }
        assert!(end[..cols].iter().all(|&v| v == 0.0), "state row 0 untouched");
        assert!(end[cols..cols + 2].iter().chain(&end[cols + 2 + per..]).all(|&v| v == 0.0), "values beside the op's part untouched");
        let s32: Vec<f32> = s.iter().map(|&x| x as f32).collect();
        assert!(max_diff(&end[cols + 2..cols + 2 + per], &s32) < 1e-5, "final state");
        for cuts in [vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10], vec![5], vec![3, 4]] {
            assert_eq!(run(&cuts), (whole.clone(), end.clone()), "cuts {cuts:?}");
        }

        // Beside another sequence (rows 0..4, slot 0), the same rows.
        let other = 4;
        let cat = |x: &CpuTensor, y: &CpuTensor| t([rows_of(y, 0, other).data, x.data.clone()].concat(), other + n, x.cols);
        let mut st = t(vec![0.0; 2 * cols], 2, cols);
        let mut o = CpuTensor::default();
        let seqs = [StateSeq { start: 0, len: other, slot: 0 }, StateSeq { start: other, len: n, slot: 1 }];
        let rev = |x: &CpuTensor| t(x.data.iter().rev().copied().collect(), x.rows, x.cols);
        op(&cat(&qkv, &rev(&qkv)), &cat(&a, &rev(&a)), &cat(&b, &rev(&b)), &mut st, &seqs, &mut o);
        assert_eq!(&o.data[other * nv * dv..], &whole[..], "beside another sequence");
        assert_eq!(&st.data[cols..], &end[cols..], "state beside another sequence");

        // Shapes that do not fit are errors.
        let mut st = t(vec![0.0; cols], 1, cols);
        let mut o = CpuTensor::default();
        let one = [StateSeq { start: 0, len: n, slot: 0 }];
        let bad = DeltaShape { key_heads: 3, ..sh };
        assert!(dev.gated_delta_rule(&qkv, &a, &b, &dt_bias, &decay, &bad, &mut st, 2, &one, &mut o).is_err());
        assert!(dev.gated_delta_rule(&qkv, &a, &b, &dt_bias, &decay, &sh, &mut st, 6, &one, &mut o).is_err(), "state row too short");
        assert!(dev.gated_delta_rule(&qkv, &rows_of(&a, 0, 3), &b, &dt_bias, &decay, &sh, &mut st, 2, &one, &mut o).is_err());
        assert!(dev.gated_delta_rule(&qkv, &a, &b, &decay, &t(vec![0.0; 1], 1, 1), &sh, &mut st, 2, &one, &mut o).is_err());
    }
}

#[test]
fn pointwise_ops() {
    let dev = Cpu::new(Some(1));
    let x = t(vec![1.0, 2.0, 3.0, 4.0, -1.0, 0.5], 1, 6);
    let w = t(vec![1.0, 2.0, 3.0, 1.0, 1.0, 2.0], 1, 6);
    let mut out = CpuTensor::default();
    dev.group_rms_norm(&x, &w, 3, 0.0, &mut out).unwrap();
    let r1 = ((1.0f32 + 4.0 + 9.0) / 3.0).sqrt();
    let r2 = ((16.0f32 + 1.0 + 0.25) / 3.0).sqrt();
    let want = [1.0 / r1, 4.0 / r1, 9.0 / r1, 4.0 / r2, -1.0 / r2, 1.0 / r2];
    assert!(max_diff(&out.data, &want) < 1e-6, "{:?}", out.data);
    assert!(dev.group_rms_norm(&x, &w, 4, 0.0, &mut out).is_err());

    let g = t(vec![3.0, -1.0, 0.5], 1, 3);
    let u = t(vec![5.0, -5.0, 0.25], 1, 3);
    dev.gated(Act::SwiGluClamped { limit: 2.0, alpha: 1.702 }, &g, &u, &mut out);
    let f = |g: f32, u: f32| (u + 1.0) * g / (1.0 + (-1.702 * g).exp());
    assert!(max_diff(&out.data, &[f(2.0, 2.0), f(-1.0, -2.0), f(0.5, 0.25)]) < 1e-6);

    let mut r2 = t(vec![-2.0, 3.0], 1, 2);
    dev.map(&mut r2, Map::Relu2);
    assert_eq!(r2.data, vec![0.0, 9.0]);
    let y = t(vec![1.0, 2.0], 1, 2);
    dev.gated(Act::Sigmoid, &t(vec![0.0, 100.0], 1, 2), &y, &mut out);
    assert_eq!(out.data, vec![0.5, 2.0]);
    let mut prod = CpuTensor::default();
    dev.gated(Act::Identity, &t(vec![4.0, -1.0], 1, 2), &out, &mut prod);
    assert_eq!(prod.data, vec![2.0, -2.0]);
    let mismatched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dev.gated(Act::Identity, &t(vec![1.0], 1, 1), &y, &mut prod)));
    assert!(mismatched.is_err(), "gated must refuse tensors of different shapes");
}

/// Block-sparse attention: with every block kept it is ordinary causal
/// attention; with few kept, it matches a dense reference that masks the
/// blocks a plain scoring loop picks.
#[test]
fn block_sparse_attention_selects_blocks() {
    block_sparse_case(KvDtype::F16);
    block_sparse_case(KvDtype::F32);
}

fn block_sparse_case(dtype: KvDtype) {
    let dev = Cpu::new(Some(2));
    let (heads, kvh, hd, idim, ih, n) = (4, 2, 8, 8, 2, 29);
    let bt = 4;
    let spec = KvPoolSpec::new(8, bt, vec![KvShape { kv_heads: kvh, head_dim: hd }, KvShape { kv_heads: 1, head_dim: idim }]);
    let mut kv = dev.kv_pool(&spec, dtype).unwrap();
    // Blocks out of order, to check the table is followed.
    let blocks: Vec<u32> = vec![5, 2, 7, 0, 1, 3, 6, 4];
    let slots: Vec<u32> = (0..n).map(|p| blocks[p / bt] * bt as u32 + (p % bt) as u32).collect();
    let mut r = Rng(3);
    let k = t(r.vec(n * kvh * hd, 1.0), n, kvh * hd);
    let v = t(r.vec(n * kvh * hd, 1.0), n, kvh * hd);
    let ik = t(r.vec(n * idim, 1.0).iter().map(|x| x * 3.0).collect(), n, idim);
    dev.kv_write(&mut kv, 0, &k, &v, &slots);
    dev.kv_write(&mut kv, 1, &ik, &ik, &slots);
    let q = t(r.vec(n * heads * hd, 1.0), n, heads * hd);
    let iq = t(r.vec(n * ih * idim, 1.0), n, ih * idim);
    let seqs = [AttnSeq { q_start: 0, q_len: n, kv_len: n, blocks: &blocks, window: None }];
    let scale = 0.3;

    let all = BlockSparse { block: 4, local: 1, topk: 100, index_heads: ih, index_dim: idim };
    let mut sparse = CpuTensor::default();
    dev.block_sparse_attention(&q, &iq, &kv, 0, 1, &seqs, scale, &all, &mut sparse).unwrap();
    let mut dense = CpuTensor::default();
    dev.attention(&q, &kv, 0, &seqs, scale, None, &mut dense);
    assert!(max_diff(&sparse.data, &dense.data) < 1e-6);

    // Keys as the pool holds them (f16).
    let h16 = |x: f32| if dtype == KvDtype::F16 { half::f16::from_f32(x).to_f32() } else { x };
    let sel = BlockSparse { block: 3, local: 2, topk: 4, index_heads: ih, index_dim: idim };
    dev.block_sparse_attention(&q, &iq, &kv, 0, 1, &seqs, scale, &sel, &mut sparse).unwrap();
    let mut want = vec![0f32; n * heads * hd];
    for p in 0..n {
        for h in 0..heads {
            let ihh = h / (heads / ih);
            let qb = p / sel.block;
            let mut keep: Vec<usize> = (0..sel.local).map(|l| qb.saturating_sub(l)).collect();
            keep.dedup();
            let mut cand: Vec<(f32, usize)> = (0..=qb)
                .filter(|b| !keep.contains(b))
                .map(|b| {
                    let best = (b * sel.block..((b + 1) * sel.block).min(p + 1))
                        .map(|j| (0..idim).map(|d| iq.data[p * ih * idim + ihh * idim + d] * h16(ik.data[j * idim + d])).sum::<f32>())
                        .fold(f32::NEG_INFINITY, f32::max);
                    (best, b)
                })
                .collect();
            cand.sort_by(|a, b| b.0.total_cmp(&a.0));
            keep.extend(cand.iter().take(sel.topk - keep.len()).map(|c| c.1));
            let keys: Vec<usize> = (0..=p).filter(|j| keep.contains(&(j / sel.block))).collect();
            let kh = h / (heads / kvh);
            let scores: Vec<f32> = keys
                .iter()
                .map(|&j| (0..hd).map(|d| q.data[p * heads * hd + h * hd + d] * h16(k.data[j * kvh * hd + kh * hd + d])).sum::<f32>() * scale)
                .collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = scores.iter().map(|s| (s - m).exp()).sum();
            for d in 0..hd {
                want[p * heads * hd + h * hd + d] = keys.iter().zip(&scores).map(|(&j, s)| (s - m).exp() / z * h16(v.data[j * kvh * hd + kh * hd + d])).sum();
            }
        }
    }
    assert!(max_diff(&sparse.data, &want) < 1e-5, "{}", max_diff(&sparse.data, &want));
    assert!(max_diff(&sparse.data, &dense.data) > 1e-3, "the selection should drop some keys");

    // The last 5 rows as a chunk on top of the rest give the same rows.
    let tail = [AttnSeq { q_start: 0, q_len: 5, kv_len: n, blocks: &blocks, window: None }];
    let mut part = CpuTensor::default();
    dev.block_sparse_attention(&rows_of(&q, n - 5, n), &rows_of(&iq, n - 5, n), &kv, 0, 1, &tail, scale, &sel, &mut part).unwrap();
    assert_eq!(part.data, sparse.data[(n - 5) * heads * hd..]);
}
