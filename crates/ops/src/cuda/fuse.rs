//! Fusion by op sequence: models call primitives; the CUDA device records
//! a forward's ops ([`OpRec`]), and [`plan`] groups the runs it has fused
//! kernels for, so every family gets every fusion (llama.cpp's
//! `ggml_cuda_can_fuse`, over a recorded forward).
//!
//! A fused kernel may leave an intermediate unwritten (the RMSNorm's
//! output inside a product that computes the norm itself, a product added
//! straight into the residual stream). That is allowed only when the
//! intermediate is dead: written again later in the same forward before
//! anything reads it, or never read again. What the forward's last op
//! writes is its result (the logits), which the caller reads: live.
//!
//! A norm folds into the products that read it only when its weight was
//! folded into theirs at load ([`fold_plan`], over the forward the device
//! saw in `Device::prepare`); weights never change after.

use std::collections::{HashMap, HashSet};

/// A tensor as recorded: its f32 buffer (its identity while it lives) and
/// shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TRef {
    pub f: u64,
    pub b: u64,
    pub rows: usize,
    pub cols: usize,
}

/// A weight as recorded: its buffer, shape, and the RMSNorm weight folded
/// into its columns at load (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WRef {
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
    pub folded: u64,
}

/// One recorded op: the fusable ones with what a fused kernel needs, the
/// rest as the buffers they read and write (their launches made already).
#[derive(Clone, Debug, PartialEq)]
pub enum OpRec {
    /// `out = rms_norm(x) * w` over groups of `w_len` (a whole row when
    /// `w_len == x.cols`); `w` is the weight's f32 buffer.
    Norm { x: TRef, w: u64, w_len: usize, eps: f32, out: TRef },
    /// `outs[i] = x · ws[i]ᵀ`.
    Mm { x: TRef, ws: Vec<WRef>, outs: Vec<TRef> },
    /// `x += y` (same shape).
    Add { x: TRef, y: TRef },
    /// `out = act(gate) * up`; `act` is the kernel's activation code.
    Gated { act: i32, gate: TRef, up: TRef, out: TRef },
    /// RoPE of `x` in place at `pos` (uploaded), by `theta` over `dims` of
    /// each head (a RoPE from a frequency table is an `Other`).
    Rope { x: TRef, pos: u64, head_dim: usize, dims: usize, theta: f32, scale: f32, neox: bool },
    /// k and v of `rows` rows into the pool at `slots` (uploaded).
    KvWrite { k: TRef, v: TRef, kc: u64, vc: u64, width: usize, slots: u64, nslots: usize },
    /// Anything else, already lowered: the buffers it reads and writes.
    Other { reads: Vec<u64>, writes: Vec<u64>, cmds: usize },
}

impl OpRec {
    /// Buffers the op reads (an in-place op reads what it writes).
    fn reads(&self) -> Vec<u64> {
        match self {
            OpRec::Norm { x, .. } => vec![x.f],
            OpRec::Mm { x, .. } => vec![x.f],
            OpRec::Add { x, y } => vec![x.f, y.f],
            OpRec::Gated { gate, up, .. } => vec![gate.f, up.f],
            OpRec::Rope { x, .. } => vec![x.f],
            OpRec::KvWrite { k, v, .. } => vec![k.f, v.f],
            OpRec::Other { reads, .. } => reads.clone(),
        }
    }

    /// Buffers the op writes whole.
    fn writes(&self) -> Vec<u64> {
        match self {
            OpRec::Norm { out, .. } => vec![out.f],
            OpRec::Mm { outs, .. } => outs.iter().map(|o| o.f).collect(),
            OpRec::Add { x, .. } => vec![x.f],
            OpRec::Gated { out, .. } => vec![out.f],
            OpRec::Rope { x, .. } => vec![x.f],
            OpRec::KvWrite { .. } => Vec::new(),
            OpRec::Other { writes, .. } => writes.clone(),
        }
    }
}

/// What follows the recorded ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tail {
    /// The forward's end: what its last op writes is its result, read by
    /// the caller; nothing else is.
    End,
    /// More ops to come (the ops so far run now, before a read-back):
    /// anything may be read later.
    More,
}

/// Whether `buf`, as it stands after op `after`, is dead: written again
/// before anything reads it, or (at the forward's end) never read again
/// and not the forward's result.
pub fn dead_after(ops: &[OpRec], tail: Tail, after: usize, buf: u64) -> bool {
    for op in &ops[after + 1..] {
        if op.reads().contains(&buf) {
            return false;
        }
        if op.writes().contains(&buf) {
            return true;
        }
    }
    tail == Tail::End && ops.last().is_none_or(|last| !last.writes().contains(&buf))
}

/// A run of ops one fused launch covers (indices into the recorded ops).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Group {
    /// Op `i` alone.
    Single(usize),
    /// `[norm] mm rope(q) rope(k) kv_write`: q, k, v with RoPE and the KV
    /// write in the product's store (few rows), the norm folded in when
    /// `norm` is set.
    Qkv { norm: Option<usize>, mm: usize, rope_q: usize, rope_k: usize, kv: usize },
    /// `rope(q) rope(k) kv_write`: one kernel for the three.
    RopeKv { rope_q: usize, rope_k: usize, kv: usize },
    /// `[norm] mm(gate, up) gated`: the gated product, gate and up never
    /// written.
    GatedMm { norm: Option<usize>, mm: usize, gated: usize },
    /// `mm add`: the product added into the residual stream in its store.
    Resid { mm: usize, add: usize },
    /// `norm mm`: a plain product group reading the folded norm.
    NormMm { norm: usize, mm: usize },
    /// `add norm`: the residual add and the next norm in one kernel.
    AddNorm { add: usize, norm: usize },
}

/// Whether `norm` (a `Norm`) folds into the product `mm` that follows: a
/// whole-row norm read by that product alone, whose weights all carry
/// this norm's weight.
fn folds(ops: &[OpRec], tail: Tail, norm: usize, mm: usize) -> bool {
    let (OpRec::Norm { x, w, w_len, out, .. }, OpRec::Mm { x: mx, ws, outs }) = (&ops[norm], &ops[mm]) else { return false };
    // The fused product reads the norm's input itself (its f32 rows and
    // bf16 copy, in every block): it may not also write it.
    *w_len == x.cols
        && mx.f == out.f
        && !ws.is_empty()
        && ws.iter().all(|wr| wr.folded == *w)
        && outs.iter().all(|o| o.f != x.f)
        && dead_after(ops, tail, mm, out.f)
}

/// A product of `n` weights over the output of op `i` (when `i` is a
/// norm, of that norm's output).
fn mm_of(ops: &[OpRec], i: usize, n: usize) -> Option<(&TRef, &[TRef])> {
    match &ops[i] {
        OpRec::Mm { x, ws, outs } if ws.len() == n => Some((x, outs)),
        _ => None,
    }
}

/// The groups of recorded ops, in order, covering every op once.
pub fn plan(ops: &[OpRec], tail: Tail) -> Vec<Group> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < ops.len() {
        let (g, n) = group_at(ops, tail, i);
        out.push(g);
        i += n;
    }
    out
}

/// The longest group starting at `i`, and how many ops it covers.
fn group_at(ops: &[OpRec], tail: Tail, i: usize) -> (Group, usize) {
    let dead = |after: usize, buf: u64| dead_after(ops, tail, after, buf);
    // A norm heads a group only when it folds into the product after it.
    let (norm, m) = match &ops[i] {
        OpRec::Norm { .. } if i + 1 < ops.len() && folds(ops, tail, i, i + 1) => (Some(i), i + 1),
        _ => (None, i),
    };
    if let Some(g) = qkv_at(ops, norm, m) {
        return g;
    }
    if let Some((mx, outs)) = mm_of(ops, m, 2) {
        if let Some(OpRec::Gated { gate, up, out, .. }) = ops.get(m + 1) {
            // The fused product reads its input (and a folded norm's) in
            // every block while others store: out may be neither.
            let norm_x = norm.and_then(|n| match &ops[n] {
                OpRec::Norm { x, .. } => Some(x.f),
                _ => None,
            });
            let aliased = out.f == mx.f || norm_x == Some(out.f);
            if gate.f == outs[0].f && up.f == outs[1].f && !aliased && dead(m + 1, gate.f) && dead(m + 1, up.f) {
                return (Group::GatedMm { norm, mm: m, gated: m + 1 }, m + 2 - i);
            }
        }
    }
    if let Some(n) = norm {
        return (Group::NormMm { norm: n, mm: m }, 2);
    }
    match (&ops[i], ops.get(i + 1)) {
        // (Not x += x · wᵀ: the GEMV stores the sum's bf16 copy over the
        // input its other blocks still read.)
        (OpRec::Mm { x: mx, ws, outs }, Some(OpRec::Add { x, y }))
            if ws.len() == 1 && y.f == outs[0].f && mx.f != x.f && x.rows == y.rows && x.cols == y.cols && dead(i + 1, y.f) =>
        {
            return (Group::Resid { mm: i, add: i + 1 }, 2);
        }
        // An add and the norm after it, unless that norm folds into the
        // product after it (which saves as much).
        (OpRec::Add { x, y }, Some(OpRec::Norm { x: nx, w_len, .. }))
            if nx.f == x.f && *w_len == x.cols && x.rows == y.rows && x.cols == y.cols && !(i + 2 < ops.len() && folds(ops, tail, i + 1, i + 2)) =>
        {
            return (Group::AddNorm { add: i, norm: i + 1 }, 2);
        }
        (OpRec::Rope { .. }, _) => {
            if let Some(g) = rope_kv_at(ops, i) {
                return (g, 3);
            }
        }
        _ => {}
    }
    (Group::Single(i), 1)
}

/// `[norm] mm(q, k, v) rope(q) rope(k) kv_write(k, v)` at `m`.
fn qkv_at(ops: &[OpRec], norm: Option<usize>, m: usize) -> Option<(Group, usize)> {
    let (_, outs) = mm_of(ops, m, 3)?;
    let rk = rope_kv_at(ops, m + 1)?;
    let Group::RopeKv { rope_q, rope_k, kv } = rk else { return None };
    let (OpRec::Rope { x: q, head_dim, dims, .. }, OpRec::Rope { x: k, .. }, OpRec::KvWrite { v, .. }) = (&ops[rope_q], &ops[rope_k], &ops[kv]) else {
        return None;
    };
    let start = norm.unwrap_or(m);
    // The product's store turns whole heads only.
    if q.f == outs[0].f && k.f == outs[1].f && v.f == outs[2].f && dims >= head_dim {
        return Some((Group::Qkv { norm, mm: m, rope_q, rope_k, kv }, kv + 1 - start));
    }
    None
}

/// `rope(q) rope(k) kv_write(k, v)` at `i`, both turned alike.
fn rope_kv_at(ops: &[OpRec], i: usize) -> Option<Group> {
    let (
        Some(OpRec::Rope { x: q, pos: pq, head_dim: hq, dims: dq, theta: tq, scale: sq, neox: nq }),
        Some(OpRec::Rope { x: k, pos: pk, head_dim: hk, dims: dk, theta: tk, scale: sk, neox: nk }),
        Some(OpRec::KvWrite { k: kk, .. }),
    ) = (ops.get(i), ops.get(i + 1), ops.get(i + 2))
    else {
        return None;
    };
    let alike = pq == pk && hq == hk && dq == dk && tq.to_bits() == tk.to_bits() && sq.to_bits() == sk.to_bits() && nq == nk;
    (alike && kk.f == k.f && q.rows == k.rows).then_some(Group::RopeKv { rope_q: i, rope_k: i + 1, kv: i + 2 })
}

/// Which weights to fold which norm into, from one recorded forward: a
/// whole-row norm whose output only the product right after it reads
/// (dead after it), where each of that product's weights is read nowhere
/// else but after the same norm. Returns weight buffer → norm weight.
///
/// `cuts`: where the forward read values back (the ops before index `c`
/// ran at that read, `Tail::More`, as [`plan`] then sees them): a norm
/// and its product count only where they are planned together, so a pair
/// right before a read-back (Gemma 4's MoE router) or split by one is not
/// folded, whatever follows the read.
pub fn fold_plan(ops: &[OpRec], embed_tables: &HashSet<u64>, cuts: &[usize]) -> HashMap<u64, u64> {
    // Every norm each weight is read after (0: read without one).
    let mut after: HashMap<u64, HashSet<u64>> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        let OpRec::Mm { x, ws, outs } = op else { continue };
        // The ops planned with this one: up to the next read-back.
        let end = cuts.iter().copied().filter(|&c| c > i).min().unwrap_or(ops.len()).min(ops.len());
        let tail = if end == ops.len() { Tail::End } else { Tail::More };
        let seg = &ops[..end];
        let norm = match i.checked_sub(1).map(|p| &ops[p]) {
            Some(OpRec::Norm { x: nx, w, w_len, out, .. })
                if out.f == x.f && *w_len == nx.cols && !cuts.contains(&i) && outs.iter().all(|o| o.f != nx.f) && dead_after(seg, tail, i, out.f) =>
            {
                *w
            }
            _ => 0,
        };
        for w in ws {
            after.entry(w.ptr).or_default().insert(norm);
        }
    }
    after
        .into_iter()
        .filter_map(|(w, norms)| {
            let only = (norms.len() == 1).then(|| *norms.iter().next().expect("one"))?;
            (only != 0 && !embed_tables.contains(&w)).then_some((w, only))
        })
        .collect()
}

/// Which weights to move into one buffer each, from one recorded forward:
/// the lists of two or more distinct weights one product reads, of one
/// width (a multiple of 8: each part then starts 16-byte aligned), none of
/// them read by any other product ([`super::Cuda::pack_weights`]).
pub fn pack_plan(ops: &[OpRec]) -> Vec<Vec<WRef>> {
    let mut lists: Vec<Vec<WRef>> = Vec::new();
    for op in ops {
        if let OpRec::Mm { ws, .. } = op {
            if !lists.contains(ws) {
                lists.push(ws.clone());
            }
        }
    }
    let mut uses: HashMap<u64, usize> = HashMap::new();
    for w in lists.iter().flatten() {
        *uses.entry(w.ptr).or_default() += 1;
    }
    lists.retain(|ws| {
        let distinct: HashSet<u64> = ws.iter().map(|w| w.ptr).collect();
        ws.len() >= 2
            && distinct.len() == ws.len()
            && ws.iter().all(|w| uses[&w.ptr] == 1 && w.cols == ws[0].cols && w.rows > 0)
            && ws[0].cols.is_multiple_of(8)
    });
    lists
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(f: u64, rows: usize, cols: usize) -> TRef {
        TRef { f, b: f + 1, rows, cols }
    }

    fn w(ptr: u64, folded: u64) -> WRef {
        WRef { ptr, rows: 64, cols: 64, folded }
    }

    fn rope(x: TRef) -> OpRec {
        OpRec::Rope { x, pos: 900, head_dim: 16, dims: 16, theta: 1e4, scale: 1.0, neox: true }
    }

    /// Buffers of one Llama layer as `llama.rs` uses them.
    const X: u64 = 10;
    const H: u64 = 20;
    const Q: u64 = 30;
    const K: u64 = 40;
    const V: u64 = 50;
    const ATT: u64 = 60;
    const OUT: u64 = 70;
    const GATE: u64 = 80;
    const UP: u64 = 90;
    const ACT: u64 = 100;

    /// One Llama layer's primitive ops (`rows` rows); norm weights 1000 +
    /// 2l (attention) and 1001 + 2l (MLP), weights folded as `fold` says.
    fn llama_layer(l: u64, rows: usize, fold: bool) -> Vec<OpRec> {
        let (an, fnm) = (1000 + 2 * l, 1001 + 2 * l);
        let f = |n: u64| if fold { n } else { 0 };
        let x = t(X, rows, 64);
        vec![
            OpRec::Norm { x, w: an, w_len: 64, eps: 1e-5, out: t(H, rows, 64) },
            OpRec::Mm {
                x: t(H, rows, 64),
                ws: vec![w(l * 10 + 1, f(an)), w(l * 10 + 2, f(an)), w(l * 10 + 3, f(an))],
                outs: vec![t(Q, rows, 64), t(K, rows, 32), t(V, rows, 32)],
            },
            rope(t(Q, rows, 64)),
            rope(t(K, rows, 32)),
            OpRec::KvWrite { k: t(K, rows, 32), v: t(V, rows, 32), kc: 1, vc: 2, width: 32, slots: 901, nslots: rows },
            OpRec::Other { reads: vec![Q], writes: vec![ATT], cmds: 1 },
            OpRec::Mm { x: t(ATT, rows, 64), ws: vec![w(l * 10 + 4, 0)], outs: vec![t(OUT, rows, 64)] },
            OpRec::Add { x, y: t(OUT, rows, 64) },
            OpRec::Norm { x, w: fnm, w_len: 64, eps: 1e-5, out: t(H, rows, 64) },
            OpRec::Mm { x: t(H, rows, 64), ws: vec![w(l * 10 + 5, f(fnm)), w(l * 10 + 6, f(fnm))], outs: vec![t(GATE, rows, 128), t(UP, rows, 128)] },
            OpRec::Gated { act: 0, gate: t(GATE, rows, 128), up: t(UP, rows, 128), out: t(ACT, rows, 128) },
            OpRec::Mm { x: t(ACT, rows, 128), ws: vec![w(l * 10 + 7, 0)], outs: vec![t(OUT, rows, 64)] },
            OpRec::Add { x, y: t(OUT, rows, 64) },
        ]
    }

    /// The head: gather, norm, product (tied to the embedding table 7).
    fn head(rows: usize) -> Vec<OpRec> {
        vec![
            OpRec::Other { reads: vec![X], writes: vec![110], cmds: 1 },
            OpRec::Norm { x: t(110, rows, 64), w: 2000, w_len: 64, eps: 1e-5, out: t(H, rows, 64) },
            OpRec::Mm { x: t(H, rows, 64), ws: vec![w(7, 0)], outs: vec![t(120, rows, 500)] },
        ]
    }

    /// `g` with every op index moved by `d`.
    fn shift(g: &Group, d: usize) -> Group {
        match *g {
            Group::Single(i) => Group::Single(i + d),
            Group::Qkv { norm, mm, rope_q, rope_k, kv } => {
                Group::Qkv { norm: norm.map(|n| n + d), mm: mm + d, rope_q: rope_q + d, rope_k: rope_k + d, kv: kv + d }
            }
            Group::RopeKv { rope_q, rope_k, kv } => Group::RopeKv { rope_q: rope_q + d, rope_k: rope_k + d, kv: kv + d },
            Group::GatedMm { norm, mm, gated } => Group::GatedMm { norm: norm.map(|n| n + d), mm: mm + d, gated: gated + d },
            Group::Resid { mm, add } => Group::Resid { mm: mm + d, add: add + d },
            Group::NormMm { norm, mm } => Group::NormMm { norm: norm + d, mm: mm + d },
            Group::AddNorm { add, norm } => Group::AddNorm { add: add + d, norm: norm + d },
        }
    }

    fn llama(layers: u64, rows: usize, fold: bool) -> Vec<OpRec> {
        let mut ops = vec![OpRec::Other { reads: vec![], writes: vec![X], cmds: 1 }];
        for l in 0..layers {
            ops.extend(llama_layer(l, rows, fold));
        }
        ops.extend(head(rows));
        ops
    }

    #[test]
    fn a_folded_llama_layer_is_five_launches() {
        let ops = llama(2, 1, true);
        let g = plan(&ops, Tail::End);
        // Layer 0 starts at op 1: qkv (5 ops), attention, o + residual, gated MLP, down + residual.
        assert_eq!(g[1], Group::Qkv { norm: Some(1), mm: 2, rope_q: 3, rope_k: 4, kv: 5 });
        assert_eq!(g[2], Group::Single(6));
        assert_eq!(g[3], Group::Resid { mm: 7, add: 8 });
        assert_eq!(g[4], Group::GatedMm { norm: Some(9), mm: 10, gated: 11 });
        assert_eq!(g[5], Group::Resid { mm: 12, add: 13 });
        // The last layer fuses alike: what it leaves unwritten nothing reads.
        assert_eq!(g[6..11], g[1..6].iter().map(|g| shift(g, 13)).collect::<Vec<_>>()[..]);
        // 1 embed + 2 layers of 5 + the head (gather, then its norm and
        // product: the head is the embedding table, never folded).
        assert_eq!(g.len(), 1 + 2 * 5 + 3, "{g:?}");
        assert_eq!(g.iter().filter(|g| matches!(g, Group::Single(_))).count(), 1 + 2 + 3);
    }

    #[test]
    fn unfolded_norms_stay_their_own_launch() {
        let ops = llama(1, 1, false);
        let g = plan(&ops, Tail::End);
        assert_eq!(g[1], Group::Single(1));
        assert_eq!(g[2], Group::Qkv { norm: None, mm: 2, rope_q: 3, rope_k: 4, kv: 5 });
        assert_eq!(g[4], Group::Resid { mm: 7, add: 8 });
        assert_eq!(g[5], Group::Single(9));
        assert_eq!(g[6], Group::GatedMm { norm: None, mm: 10, gated: 11 });
        // Without the product before it, an add fuses with the norm after it.
        let ops = vec![ops[8].clone(), ops[9].clone(), ops[10].clone(), ops[11].clone()];
        assert_eq!(plan(&ops, Tail::End)[0], Group::AddNorm { add: 0, norm: 1 });
    }

    #[test]
    fn the_fold_plan_takes_each_norm_into_the_products_that_alone_read_it() {
        let ops = llama(2, 1, false);
        let tables: HashSet<u64> = [7].into_iter().collect();
        let p = fold_plan(&ops, &tables, &[]);
        for l in 0..2u64 {
            for j in 1..=3 {
                assert_eq!(p.get(&(l * 10 + j)), Some(&(1000 + 2 * l)), "q/k/v of layer {l}");
            }
            for j in 5..=6 {
                assert_eq!(p.get(&(l * 10 + j)), Some(&(1001 + 2 * l)), "gate/up of layer {l}");
            }
            // o and down read no norm.
            assert!(!p.contains_key(&(l * 10 + 4)) && !p.contains_key(&(l * 10 + 7)));
        }
        // The head reads a norm whose output is live (written last), and is
        // the embedding table: never folded.
        assert!(!p.contains_key(&7));
    }

    #[test]
    fn a_weight_read_after_two_norms_or_none_is_not_folded() {
        let x = t(X, 1, 64);
        let n = |w: u64| OpRec::Norm { x, w, w_len: 64, eps: 1e-6, out: t(H, 1, 64) };
        let mm = |p: u64| OpRec::Mm { x: t(H, 1, 64), ws: vec![w(p, 0)], outs: vec![t(OUT, 1, 64)] };
        let kill = OpRec::Other { reads: vec![], writes: vec![H], cmds: 1 };
        let ops = vec![n(1), mm(5), kill.clone(), n(2), mm(5), kill.clone(), n(1), mm(6), kill.clone(), mm(6), kill];
        let p = fold_plan(&ops, &HashSet::new(), &[]);
        assert!(p.is_empty(), "{p:?}");
    }

    #[test]
    fn intermediates_read_later_are_not_elided() {
        // The product's output is read again after the add: no residual fusion.
        let x = t(X, 1, 64);
        let ops = vec![
            OpRec::Mm { x: t(ATT, 1, 64), ws: vec![w(1, 0)], outs: vec![t(OUT, 1, 64)] },
            OpRec::Add { x, y: t(OUT, 1, 64) },
            OpRec::Other { reads: vec![OUT], writes: vec![ACT], cmds: 1 },
        ];
        assert_eq!(plan(&ops, Tail::End), vec![Group::Single(0), Group::Single(1), Group::Single(2)]);
        // Gate and up read after the activation: no gated fusion.
        let ops = vec![
            OpRec::Mm { x: t(H, 1, 64), ws: vec![w(1, 0), w(2, 0)], outs: vec![t(GATE, 1, 8), t(UP, 1, 8)] },
            OpRec::Gated { act: 0, gate: t(GATE, 1, 8), up: t(UP, 1, 8), out: t(ACT, 1, 8) },
            OpRec::Other { reads: vec![UP], writes: vec![], cmds: 1 },
        ];
        assert_eq!(plan(&ops, Tail::End)[0], Group::Single(0));
        assert!(!dead_after(&ops, Tail::End, 1, UP));
        assert!(dead_after(&ops, Tail::End, 1, GATE), "never read again");
        assert!(!dead_after(&ops[..2], Tail::End, 1, ACT), "the result is live");
    }

    #[test]
    fn per_head_qk_norms_keep_the_rope_and_kv_write_fused() {
        // Qwen3 / Gemma 3: q and k normed per head between the product and RoPE.
        let h = t(H, 1, 64);
        let ops = vec![
            OpRec::Mm { x: h, ws: vec![w(1, 0), w(2, 0), w(3, 0)], outs: vec![t(200, 1, 64), t(201, 1, 32), t(V, 1, 32)] },
            OpRec::Norm { x: t(200, 1, 64), w: 5, w_len: 16, eps: 1e-6, out: t(Q, 1, 64) },
            OpRec::Norm { x: t(201, 1, 32), w: 6, w_len: 16, eps: 1e-6, out: t(K, 1, 32) },
            rope(t(Q, 1, 64)),
            rope(t(K, 1, 32)),
            OpRec::KvWrite { k: t(K, 1, 32), v: t(V, 1, 32), kc: 1, vc: 2, width: 32, slots: 901, nslots: 1 },
        ];
        assert_eq!(plan(&ops, Tail::End), vec![Group::Single(0), Group::Single(1), Group::Single(2), Group::RopeKv { rope_q: 3, rope_k: 4, kv: 5 }]);
    }

    #[test]
    fn partial_rotary_keeps_rope_and_kv_write_fused_but_not_in_the_product() {
        // Turning part of each head: the product's store cannot, rope_kv can.
        let mut r = rope(t(Q, 1, 64));
        if let OpRec::Rope { dims, .. } = &mut r {
            *dims = 8;
        }
        let mut rk = rope(t(K, 1, 32));
        if let OpRec::Rope { dims, .. } = &mut rk {
            *dims = 8;
        }
        let ops = vec![
            OpRec::Mm { x: t(H, 1, 64), ws: vec![w(1, 0), w(2, 0), w(3, 0)], outs: vec![t(Q, 1, 64), t(K, 1, 32), t(V, 1, 32)] },
            r,
            rk,
            OpRec::KvWrite { k: t(K, 1, 32), v: t(V, 1, 32), kc: 1, vc: 2, width: 32, slots: 901, nslots: 1 },
        ];
        assert_eq!(plan(&ops, Tail::End), vec![Group::Single(0), Group::RopeKv { rope_q: 1, rope_k: 2, kv: 3 }]);
    }

    #[test]
    fn before_a_read_back_everything_is_live() {
        // The ops before a flush: a later op may read anything they wrote.
        let ops = llama(1, 1, true);
        let g = plan(&ops[..9], Tail::More);
        assert_eq!(g[1], Group::Single(1), "the norm's output may be read after the flush: not folded");
        assert!(g.contains(&Group::Single(7)) && g.contains(&Group::Single(8)), "o's output may be read after the flush: {g:?}");
    }

    /// `ops` with each weight's `folded` set as `folds` says (what the
    /// device's folds at load make the recorded weights say).
    fn with_folds(ops: &[OpRec], folds: &HashMap<u64, u64>) -> Vec<OpRec> {
        ops.iter()
            .cloned()
            .map(|mut op| {
                if let OpRec::Mm { ws, .. } = &mut op {
                    for w in ws {
                        w.folded = folds.get(&w.ptr).copied().unwrap_or(0);
                    }
                }
                op
            })
            .collect()
    }

    /// The plans of a served forward that reads back at `cuts`: each
    /// stretch before a read planned as `Tail::More`, the last as `End`;
    /// group indices made global.
    fn served_plan(ops: &[OpRec], cuts: &[usize]) -> Vec<Group> {
        let mut out = Vec::new();
        let mut start = 0;
        for end in cuts.iter().copied().chain(std::iter::once(ops.len())) {
            let tail = if end == ops.len() { Tail::End } else { Tail::More };
            out.extend(plan(&ops[start..end], tail).iter().map(|g| shift(g, start)));
            start = end;
        }
        out
    }

    /// Every product reading a folded weight is planned with its norm
    /// (what `lower.rs` needs, or it refuses the weight).
    fn folds_honoured(ops: &[OpRec], groups: &[Group]) -> Result<(), String> {
        let with_norm: HashSet<usize> = groups
            .iter()
            .filter_map(|g| match *g {
                Group::Qkv { norm: Some(_), mm, .. } | Group::GatedMm { norm: Some(_), mm, .. } | Group::NormMm { mm, .. } => Some(mm),
                _ => None,
            })
            .collect();
        for (i, op) in ops.iter().enumerate() {
            if let OpRec::Mm { ws, .. } = op {
                if ws.iter().any(|w| w.folded != 0) && !with_norm.contains(&i) {
                    return Err(format!("op {i}: a folded weight planned without its norm ({groups:?})"));
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_norm_read_right_before_a_read_back_is_not_folded() {
        // Gemma 4's MoE: the router reads a norm of its own, and the routing
        // is read back right after (`Moe::forward`'s download), so a served
        // forward plans the ops so far as `Tail::More`: the router's input
        // looks live there, and a router folded at load would be refused.
        let x = t(X, 1, 64);
        let mut ops = vec![OpRec::Other { reads: vec![], writes: vec![X], cmds: 1 }];
        for l in 0..2u64 {
            ops.extend(llama_layer(l, 1, false));
            ops.push(OpRec::Norm { x, w: 3000 + l, w_len: 64, eps: 1e-6, out: t(200, 1, 64) });
            ops.push(OpRec::Mm { x: t(200, 1, 64), ws: vec![w(500 + l, 0)], outs: vec![t(210, 1, 8)] });
            ops.push(OpRec::Norm { x, w: 3100 + l, w_len: 64, eps: 1e-6, out: t(220, 1, 64) });
            // The read-back, then the experts over the other norm's rows.
            ops.push(OpRec::Other { reads: vec![220], writes: vec![230], cmds: 1 });
            ops.push(OpRec::Mm { x: t(230, 1, 64), ws: vec![w(600 + l, 0), w(610 + l, 0)], outs: vec![t(GATE, 1, 128), t(UP, 1, 128)] });
            ops.push(OpRec::Gated { act: 1, gate: t(GATE, 1, 128), up: t(UP, 1, 128), out: t(ACT, 1, 128) });
            ops.push(OpRec::Mm { x: t(ACT, 1, 128), ws: vec![w(620 + l, 0)], outs: vec![t(OUT, 1, 64)] });
            ops.push(OpRec::Add { x, y: t(OUT, 1, 64) });
        }
        ops.extend(head(1));
        // The cuts: right after each layer's second norm.
        let cuts: Vec<usize> = ops.iter().enumerate().filter(|(_, op)| matches!(op, OpRec::Norm { w, .. } if *w >= 3100)).map(|(i, _)| i + 1).collect();
        assert_eq!(cuts.len(), 2);
        let tables: HashSet<u64> = [7].into_iter().collect();
        // Blind to the read-backs, the plan folds the routers, which the
        // served forward then refuses.
        let blind = fold_plan(&ops, &tables, &[]);
        assert!(blind.contains_key(&500) && blind.contains_key(&501));
        assert!(folds_honoured(&with_folds(&ops, &blind), &served_plan(&with_folds(&ops, &blind), &cuts)).is_err());
        // (So do the dense MLP's gate and up: their norm's output is
        // written again only after the read-back.)
        assert!(blind.contains_key(&5) && blind.contains_key(&15));
        // Seeing them, it folds what the served plans fold: q, k and v
        // (their norm's output is written again by the MLP's norm before
        // the read-back), not the routers nor the dense MLP.
        let p = fold_plan(&ops, &tables, &cuts);
        assert!(!p.contains_key(&500) && !p.contains_key(&501), "{p:?}");
        for l in 0..2u64 {
            assert_eq!(p.get(&(l * 10 + 1)), Some(&(1000 + 2 * l)), "q of layer {l}");
            assert!(!p.contains_key(&(l * 10 + 5)), "gate of layer {l}");
        }
        let folded = with_folds(&ops, &p);
        folds_honoured(&folded, &served_plan(&folded, &cuts)).unwrap();
        // A read-back between a norm and its product: not folded either.
        let ops = vec![
            OpRec::Norm { x, w: 1000, w_len: 64, eps: 1e-6, out: t(H, 1, 64) },
            OpRec::Mm { x: t(H, 1, 64), ws: vec![w(1, 0)], outs: vec![t(OUT, 1, 64)] },
            OpRec::Other { reads: vec![], writes: vec![H], cmds: 1 },
        ];
        assert!(fold_plan(&ops, &HashSet::new(), &[]).contains_key(&1));
        assert!(fold_plan(&ops, &HashSet::new(), &[1]).is_empty());
    }

    #[test]
    fn the_fold_plan_is_honoured_by_every_plan_of_the_forward() {
        // A Llama forward: whatever the fold plan folds, every plan of the
        // same forward (served whole) takes each folded weight with its norm.
        for rows in [1, 3, 40] {
            let ops = llama(3, rows, false);
            let p = fold_plan(&ops, &[7].into_iter().collect(), &[]);
            assert_eq!(p.len(), 3 * 5, "q, k, v, gate, up of each layer: {p:?}");
            let folded = with_folds(&ops, &p);
            folds_honoured(&folded, &plan(&folded, Tail::End)).unwrap();
        }
    }

    #[test]
    fn fused_products_never_overwrite_what_they_read() {
        // x += x · wᵀ: the residual GEMV would store the sum's bf16 copy
        // over the input its other blocks read.
        let x = t(X, 1, 64);
        let ops = vec![OpRec::Mm { x, ws: vec![w(1, 0)], outs: vec![t(OUT, 1, 64)] }, OpRec::Add { x, y: t(OUT, 1, 64) }];
        assert_eq!(plan(&ops, Tail::End), vec![Group::Single(0), Group::Single(1)]);
        // The gated product's output over its input.
        let h = t(H, 1, 64);
        let ops = vec![
            OpRec::Mm { x: h, ws: vec![w(1, 0), w(2, 0)], outs: vec![t(GATE, 1, 64), t(UP, 1, 64)] },
            OpRec::Gated { act: 0, gate: t(GATE, 1, 64), up: t(UP, 1, 64), out: h },
        ];
        assert_eq!(plan(&ops, Tail::End), vec![Group::Single(0), Group::Single(1)]);
        // A folded norm's product writing the norm's input (the GEMV reads
        // its f32 rows for the norm in every block): neither planned nor folded.
        let ops = vec![
            OpRec::Norm { x, w: 1000, w_len: 64, eps: 1e-6, out: h },
            OpRec::Mm { x: h, ws: vec![w(1, 1000)], outs: vec![x] },
            OpRec::Other { reads: vec![X], writes: vec![H], cmds: 1 },
        ];
        assert_eq!(plan(&ops, Tail::End)[0], Group::Single(0));
        let mut unfolded = ops.clone();
        if let OpRec::Mm { ws, .. } = &mut unfolded[1] {
            ws[0].folded = 0;
        }
        assert!(fold_plan(&unfolded, &HashSet::new(), &[]).is_empty());
        // Nor the gated product's output over the folded norm's input.
        let ops = vec![
            OpRec::Norm { x, w: 1000, w_len: 64, eps: 1e-6, out: h },
            OpRec::Mm { x: h, ws: vec![w(1, 1000), w(2, 1000)], outs: vec![t(GATE, 1, 64), t(UP, 1, 64)] },
            OpRec::Gated { act: 0, gate: t(GATE, 1, 64), up: t(UP, 1, 64), out: x },
        ];
        assert_eq!(plan(&ops, Tail::End)[0], Group::NormMm { norm: 0, mm: 1 });
    }

    /// A Llama layer packs q/k/v and gate/up, never a single weight; a
    /// weight another product reads too, or a list of mixed widths, stays.
    #[test]
    fn products_of_several_weights_pack_unless_shared() {
        let mut ops = llama_layer(0, 4, false);
        ops.extend(llama_layer(1, 4, false));
        ops.extend(head(4));
        let ptrs = |plan: Vec<Vec<WRef>>| plan.iter().map(|ws| ws.iter().map(|w| w.ptr).collect::<Vec<_>>()).collect::<Vec<_>>();
        assert_eq!(ptrs(pack_plan(&ops)), vec![vec![1, 2, 3], vec![5, 6], vec![11, 12, 13], vec![15, 16]]);
        // The same forward recorded twice: each list once.
        let twice: Vec<OpRec> = ops.iter().chain(ops.iter()).cloned().collect();
        assert_eq!(pack_plan(&twice).len(), 4);
        // Layer 1's up read alone elsewhere: its gate/up stays apart.
        ops.push(OpRec::Mm { x: t(H, 4, 64), ws: vec![w(16, 0)], outs: vec![t(OUT, 4, 64)] });
        assert_eq!(ptrs(pack_plan(&ops)), vec![vec![1, 2, 3], vec![5, 6], vec![11, 12, 13]]);
        // Widths that differ, or one that is not a multiple of 8.
        let mm = |ws: Vec<WRef>| OpRec::Mm { x: t(H, 4, 64), outs: ws.iter().map(|_| t(OUT, 4, 64)).collect(), ws };
        let odd = |ptr: u64, cols: usize| WRef { ptr, rows: 64, cols, folded: 0 };
        assert!(pack_plan(&[mm(vec![odd(40, 64), odd(41, 72)]), mm(vec![odd(50, 60), odd(51, 60)])]).is_empty());
        // A weight twice in one list.
        assert!(pack_plan(&[mm(vec![w(60, 0), w(60, 0)])]).is_empty());
    }
}
