//! The hybrid families' ops (cuda/recurrent.rs) against the CPU device;
//! MiniMax-M3's block-sparse attention against the CPU device; a
//! mixture's forward of thousands of row lists in the upload arena.

use super::bf16_copies::check_bf16_copy;
use super::*;

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
