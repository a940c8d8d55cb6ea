//! Fusion by op sequence: every group fused (and folded) against the
//! same ops unfused.

use super::*;

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
pub(super) const EPS: f32 = 1e-5;
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

    /// Whether the group has a product of several weights (which
    /// `prepare` packs into one buffer).
    fn packs(&self) -> bool {
        !matches!(self, Group::Resid | Group::AddNorm { .. })
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
/// With `Tuning::pack`, after `prepare` a product's weights share one
/// buffer, so past the skinny GEMM's rows q, k and v, and gate and up, are
/// one GEMM each.
#[test]
fn every_fusion_group_equals_the_unfused_ops() {
    let Some(d) = gpu() else { return };
    fusion_groups(&d, &[1, 2, 3, 4, 6, 17, 32, GMAX]);
    // Past the GEMV's rows, cuBLAS as well as the skinny GEMM.
    fusion_groups(&gpu_cublas(), &[6]);
    // Each product's weights packed at `prepare`: one cuBLAS GEMM for q,
    // k and v, one for gate and up.
    fusion_groups(&Cuda::with_tuning(0, Tuning { pack: true, ..Tuning::default() }).unwrap(), &[6, GMAX]);
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
                let packed = d.packed_weights();
                let (res, stats) = run_group(d, &h, g, mode, rows, key);
                // `prepare` puts the weights of each product of several side
                // by side (once per mode: each has weights of its own).
                let want = usize::from(matches!(mode, Mode::Folded | Mode::Graph) && g.packs() && d.tuning().pack);
                assert_eq!(d.packed_weights() - packed, want, "{g:?} {rows} rows, {mode:?}: lists of weights packed");
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
