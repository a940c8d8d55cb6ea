//! Attention against f64 (decode and prefill cases, outside any forward,
//! in a keyed forward and an eager one), and the KV pool's groups and
//! block copies.

use super::*;

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
        // SmolLM2's 9 heads over 3, from one key to several tiles a split.
        Case { bt: 16, heads: 9, kv_heads: 3, hd: 64, window: None, softcap: None, seqs: vec![(1, 1), (1, 250), (1, 2000), (1, 4001), (1, 129), (1, 33)] },
        // A block size that is no power of two (the table lookup divides),
        // a window cutting into a split, 8 heads a KV head (2 loads a lane).
        Case { bt: 24, heads: 16, kv_heads: 2, hd: 128, window: Some(333), softcap: None, seqs: vec![(1, 1000), (2, 47), (1, 3)] },
        // Head dim 80 (no power of two) with 16 heads a KV head: half-size tiles.
        Case { bt: 16, heads: 16, kv_heads: 1, hd: 80, window: None, softcap: Some(30.0), seqs: vec![(1, 300), (1, 77), (2, 31)] },
        // With two KV heads a 30-row chunk keeps this kernel too.
        Case { bt: 16, heads: 16, kv_heads: 2, hd: 64, window: None, softcap: None, seqs: vec![(30, 1030), (1, 500)] },
        // Gemma 4's global layers: head dim 512, 8 query heads a KV head;
        // every row takes this kernel, a prompt's too.
        Case { bt: 16, heads: 8, kv_heads: 1, hd: 512, window: None, softcap: None, seqs: vec![(1, 1), (1, 900), (3, 40), (130, 300)] },
        Case { bt: 16, heads: 16, kv_heads: 2, hd: 512, window: Some(64), softcap: Some(30.0), seqs: vec![(1, 500), (70, 200)] },
    ];
    // Also with clusters past the portable 8 blocks (Hopper): more key
    // splits, merged in the cluster as before; with the lanes kernel for
    // launches of up to 32 (row, KV head) pairs (a round's decode rows
    // apart from a short chunk's); and for every launch, with 1 warp a
    // block and no clusters (the splits merged by a launch), and with 4.
    let wide = Cuda::with_tuning(0, Tuning { attn_cluster_max: 16, ..d.tuning().clone() }).unwrap();
    let lanes = lanes_device(&d, 8, 32, true);
    let one = lanes_device(&d, 1, usize::MAX, false);
    let four = lanes_device(&d, 4, usize::MAX, true);
    for dev in [&d, &wide, &lanes, &one, &four] {
        for c in &cases {
            run_attention_case(dev, &mut r, c, 1e-4);
        }
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
    // Also with the lanes kernel for the decode rows: up to three
    // launches side by side (a long chunk's, a short chunk's, the
    // decode rows').
    let lanes = lanes_device(&d, 8, 32, true);
    for dev in [&d, &lanes] {
        for c in &cases {
            run_attention_case(dev, &mut r, c, 1.5e-2);
        }
    }
}

/// A device whose decode launches of up to `pairs` (row, KV head) pairs
/// take the lanes kernel, `warps` warps a block.
fn lanes_device(d: &Cuda, warps: usize, pairs: usize, cluster: bool) -> Cuda {
    Cuda::with_tuning(0, Tuning { attn_decode_warps: warps, attn_decode_lanes_pairs: pairs, attn_cluster: cluster, ..d.tuning().clone() }).unwrap()
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
