//! Causal attention over paged KV (f16 or f32), batched over sequences of
//! any length.
//!
//! A task is one (sequence, KV head, block of up to `QB` query rows): every
//! query head of that KV head's group and every row of the block share each
//! key and value row, which is converted from f16 (or copied) once per
//! task. Keys are
//! visited in tiles of `KB` positions aligned to absolute positions; in each
//! tile a query scores the keys it may see, exponentiates them together
//! (vectorized `exp`), and folds them into its running max, sum and
//! accumulator (online softmax, one rescale per tile). Which keys of a tile
//! a query sees, and every operation on them, depend only on its position,
//! so results do not depend on chunking or batching.
//!
//! Keys fall in partitions of `PART` absolute positions. Each query keeps a
//! partial state per partition and folds it into its total at the
//! partition's end, in order. A decode task (few rows) over a long context
//! is therefore split into one task per partition, run in parallel, and its
//! partials folded afterwards in the same order with the same arithmetic:
//! a 3-KV-head model no longer leaves one of two threads idle for a third
//! of every decode step, and results stay bit-identical either way. Such a
//! task takes every KV head of its partition, so that it reads the pool's
//! rows whole (all heads side by side) rather than a third of each; only
//! when the threads could not share those tasks evenly are the smallest
//! leftover ones split by head.
//!
//! Three kernels run a task: generic, AVX2 and AVX-512 (`avx512.rs`, which
//! also reads a decode task's f16 rows in place and prefetches them). They
//! compute the same operations in the same order, so their results are
//! identical bit for bit.

// Kernels index several same-shaped arrays (queries, accumulators, scores)
// by query and key; iterator chains would only obscure that.
#![allow(clippy::needless_range_loop)]

use std::cell::RefCell;

use half::f16;

use super::{pool, vmath, CpuKv, CpuTensor, SendPtr};
use crate::{AttnSeq, KvDtype};

#[cfg(target_arch = "x86_64")]
mod avx512;

const MAX_HEAD_DIM: usize = 512;
/// Query rows per task.
const QB: usize = 8;
/// Queries per task, roughly (rows × heads of one group).
const MAX_Q: usize = 64;
/// Query rows per task of single-query sequences over the same keys (a
/// vision tower's patches): they share every key tile, so more rows
/// spread its copy (half the tower's attention time at 8 rows).
const FAN_QB: usize = 32;
/// Keys per tile.
const KB: usize = 32;
/// Keys per partition (a multiple of `KB`).
const PART: usize = 512;
/// Tasks of at most this many rows are split by partition.
const SPLIT_ROWS: usize = 2;

#[derive(Clone, Copy)]
struct Task {
    seq: usize,
    kv_head: usize,
    /// KV heads from `kv_head` on (each its own state, one after another).
    heads: usize,
    row0: usize,
    rows: usize,
    /// `Some(p)`: only partition `p`'s keys, leaving the partial state at
    /// `slot` of the partials buffer (no output).
    part: Option<usize>,
    slot: usize,
    /// The rows are the one query of each of `rows` sequences from `seq`
    /// on that see the same keys (consecutive rows of `q`: an image's
    /// patches, each a query over all of them), so they share each key
    /// tile as a block's rows do.
    fan: bool,
}

/// The first key a query at `pos` sees (its sliding window's, or 0).
fn window_lo(s: &AttnSeq<'_>, pos: usize) -> usize {
    s.window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

impl Task {
    /// Its first row's position.
    fn first_pos(&self, s: &AttnSeq<'_>) -> usize {
        s.kv_len - s.q_len + self.row0
    }

    /// First and last key position any row of the task sees: no key before
    /// its first row's window is read (a sliding-window layer's blocks
    /// before it may be let go, their table entries stand-ins).
    fn key_span(&self, s: &AttnSeq<'_>) -> (usize, usize) {
        let first_pos = self.first_pos(s);
        (window_lo(s, first_pos), if self.fan { first_pos } else { first_pos + self.rows - 1 })
    }
}

/// A (sequence, KV head, rows) block split by partition: its tasks' partial
/// states sit at `slot`, `slot + stride`, ... in partition order.
struct SplitGroup {
    task: Task,
    parts: usize,
    slot: usize,
    stride: usize,
}

/// Fold a partial softmax state `(m, l, acc)` into a running total, in
/// place: the one place where partitions meet, whether one task ran them in
/// sequence or split tasks ran them apart.
#[inline]
fn fold(tm: &mut f32, tl: &mut f32, tacc: &mut [f32], m: f32, l: f32, acc: &[f32]) {
    if m == f32::NEG_INFINITY {
        return;
    }
    if *tm == f32::NEG_INFINITY {
        *tm = m;
        *tl = l;
        tacc.copy_from_slice(acc);
        return;
    }
    let nm = tm.max(m);
    let (a, b) = (vmath::exp(*tm - nm), vmath::exp(m - nm));
    *tl = *tl * a + l * b;
    for (t, &x) in tacc.iter_mut().zip(acc) {
        *t = *t * a + x * b;
    }
    *tm = nm;
}

/// The task kernels, best last: each gives the others' results bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kernel {
    Generic,
    Avx2,
    Avx512,
}

/// The best kernel this CPU runs for head dimension `hd`.
fn best_kernel(hd: usize) -> Kernel {
    if cfg!(target_arch = "x86_64") && vmath::has_avx512() && hd.is_multiple_of(8) && hd >= 16 {
        Kernel::Avx512
    } else if cfg!(target_arch = "x86_64") && vmath::has_avx2() && hd.is_multiple_of(8) {
        Kernel::Avx2
    } else {
        Kernel::Generic
    }
}

pub fn paged_attention(q: &CpuTensor, kv: &CpuKv, layer: usize, seqs: &[AttnSeq<'_>], scale: f32, softcap: Option<f32>, out: &mut CpuTensor) {
    let kern = best_kernel(kv.spec.layers[layer].head_dim);
    attend(q, kv, layer, seqs, scale, softcap, out, kern)
}

#[allow(clippy::too_many_arguments)]
fn attend(q: &CpuTensor, kv: &CpuKv, layer: usize, seqs: &[AttnSeq<'_>], scale: f32, softcap: Option<f32>, out: &mut CpuTensor, kern: Kernel) {
    let shape = kv.spec.layers[layer];
    let hd = shape.head_dim;
    assert!(hd <= MAX_HEAD_DIM, "head dim {hd} over {MAX_HEAD_DIM}");
    let heads = q.cols / hd;
    let group = heads / shape.kv_heads;
    let qb = (MAX_Q / group).clamp(1, QB);
    let mut tasks = Vec::new();
    let mut groups = Vec::new();
    let mut slots = 0usize;
    let mut si = 0;
    while si < seqs.len() {
        let s = &seqs[si];
        // Single-query sequences over the same keys, one row after another.
        let fans = |j: usize| {
            let t = &seqs[si + j];
            t.q_len == 1 && t.kv_len == s.kv_len && t.window == s.window && std::ptr::eq(t.blocks, s.blocks) && t.q_start == s.q_start + j
        };
        let fan_qb = (MAX_Q * FAN_QB / QB / group).clamp(1, FAN_QB);
        let fan_rows = if s.q_len == 1 { 1 + (1..fan_qb.min(seqs.len() - si)).take_while(|&j| fans(j)).count() } else { 1 };
        let fan = fan_rows > 1;
        let mut r = 0;
        while r < s.q_len {
            let rows = if fan { fan_rows } else { qb.min(s.q_len - r) };
            let task = Task { seq: si, kv_head: 0, heads: 1, row0: r, rows, part: None, slot: 0, fan };
            let (lo, hi) = task.key_span(s);
            let (p0, p1) = (lo / PART, hi / PART);
            if rows <= SPLIT_ROWS && p1 > p0 {
                // One task per partition, over every KV head: it reads
                // whole rows of the pool (all heads side by side) while
                // they are in cache, not a third of each row per task.
                let kvh = shape.kv_heads;
                let qstride = rows * group * (hd + 2);
                for p in p0..=p1 {
                    tasks.push(Task { heads: kvh, part: Some(p), slot: slots + (p - p0) * kvh * qstride, ..task });
                }
                for kv_head in 0..kvh {
                    groups.push(SplitGroup { task: Task { kv_head, ..task }, parts: p1 - p0 + 1, slot: slots + kv_head * qstride, stride: kvh * qstride });
                }
                slots += (p1 - p0 + 1) * kvh * qstride;
            } else {
                for kv_head in 0..shape.kv_heads {
                    tasks.push(Task { kv_head, ..task });
                }
            }
            r += if fan { s.q_len } else { rows };
        }
        si += fan_rows;
    }
    // Few partition tasks that the threads cannot share evenly (one stream
    // in three partitions: one thread would do two): the smallest leftover
    // ones go by KV head instead, to fill the gap. (Not all: a task over
    // whole rows of the pool reads it faster.)
    let threads = pool::threads();
    let whole = tasks.iter().filter(|t| t.heads > 1).count();
    if whole > 0 && whole < 4 * threads && !whole.is_multiple_of(threads) {
        let span = |t: &Task| {
            let (lo, hi) = t.key_span(&seqs[t.seq]);
            let p = t.part.unwrap_or(0);
            (hi + 1).min((p + 1) * PART) - lo.max(p * PART)
        };
        let mut order: Vec<usize> = (0..tasks.len()).filter(|&i| tasks[i].heads > 1).collect();
        order.sort_by_key(|&i| span(&tasks[i]));
        for &i in &order[..whole % threads] {
            let t = tasks[i];
            tasks[i].heads = 1;
            for k in 1..t.heads {
                tasks.push(Task { kv_head: t.kv_head + k, heads: 1, slot: t.slot + k * t.rows * group * (hd + 2), ..t });
            }
        }
    }
    // Most keys first, so the pool's dynamic hand-out balances the causal
    // triangle and the partitions.
    tasks.sort_by_key(|t| {
        let (lo, hi) = t.key_span(&seqs[t.seq]);
        let keys = match t.part {
            Some(p) => (hi + 1).min((p + 1) * PART) - lo.max(p * PART),
            None => hi + 1 - lo,
        };
        std::cmp::Reverse(keys * t.rows * t.heads)
    });
    let mut partials = vec![0f32; slots];
    let optr = SendPtr(out.data.as_mut_ptr());
    let ctx = Ctx { q, kv, layer, seqs, scale, softcap, hd, group, out: optr, parts: SendPtr(partials.as_mut_ptr()) };
    let (avx2, avx512) = (kern == Kernel::Avx2, kern == Kernel::Avx512);
    let run_one = |t: &Task, buf: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        {
            if avx2 {
                // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
                return unsafe { task_avx2(&ctx, t, buf) };
            }
        }
        task_generic(&ctx, t, buf)
    };
    let run = |i: usize| {
        let nq = tasks[i].rows * group * tasks[i].heads;
        let need = 2 * nq + nq * hd + 2 * KB * hd + nq * (hd + 2);
        with_scratch(need, &mut |buf| {
            #[cfg(target_arch = "x86_64")]
            if avx512 {
                // SAFETY: the CPU has AVX-512 F/BW/VL/DQ, AVX2, FMA and
                // F16C, and hd is a multiple of 8, at least 16 (checked above).
                return unsafe { avx512::task(&ctx, &tasks[i], buf) };
            }
            // A task's KV heads one after another.
            for k in 0..tasks[i].heads {
                let slot = tasks[i].slot + k * tasks[i].rows * group * (hd + 2);
                let t = &Task { kv_head: tasks[i].kv_head + k, heads: 1, slot, ..tasks[i] };
                run_one(t, buf);
            }
        });
    };
    if tasks.len() == 1 {
        run(0);
    } else {
        pool::parallel_for(tasks.len(), &run);
    }
    // Fold each split block's partitions, in order, and write its rows.
    let finish = |gi: usize| {
        let g = &groups[gi];
        let nq = g.task.rows * group;
        let mut acc = vec![0f32; hd];
        for qi in 0..nq {
            let (mut tm, mut tl) = (f32::NEG_INFINITY, 0f32);
            for p in 0..g.parts {
                let base = g.slot + p * g.stride + qi * (hd + 2);
                let st = &partials[base..base + hd + 2];
                fold(&mut tm, &mut tl, &mut acc, st[hd], st[hd + 1], &st[..hd]);
            }
            let (i, gq) = (qi / group, qi % group);
            let r = seqs[g.task.seq].q_start + g.task.row0 + i;
            let h = g.task.kv_head * group + gq;
            // SAFETY: each (row, head) belongs to exactly one block.
            let dst = unsafe { ctx.out.slice(r * q.cols + h * hd, hd) };
            write_normalized(dst, &acc, tl);
        }
    };
    match groups.len() {
        0 => {}
        1 => finish(0),
        n => pool::parallel_for(n, &finish),
    }
}

/// `dst = acc / l`.
fn write_normalized(dst: &mut [f32], acc: &[f32], l: f32) {
    let inv = 1.0 / l;
    for (d, a) in dst.iter_mut().zip(acc) {
        *d = a * inv;
    }
}

struct Ctx<'a> {
    q: &'a CpuTensor,
    kv: &'a CpuKv,
    layer: usize,
    seqs: &'a [AttnSeq<'a>],
    scale: f32,
    softcap: Option<f32>,
    hd: usize,
    group: usize,
    out: SendPtr,
    /// Split tasks' partial states (`nq * (hd + 2)` each: acc, m, l).
    parts: SendPtr,
}

/// Query heads handled together: they share every key and value load.
const GB: usize = 4;

/// Row/vector kernels the task body is written against. Every score is
/// the same eight-lane dot (lanes over the head dimension in order, then a
/// fixed reduction), and every accumulator lane the same chain (scaled by
/// the correction, then one fma per key in order), however queries and
/// keys are blocked.
trait Kern {
    fn load_f16(src: &[f16], dst: &mut [f32]);
    /// `s[g][j] = q_g · k_j` for `g < G`, `j in a..b`; `q` holds G rows of
    /// `hd`, `k` rows of `hd`.
    fn scores<const G: usize>(q: &[f32], k: &[f32], hd: usize, a: usize, b: usize, s: &mut [[f32; KB]; G]);
    /// `p[i] = exp(p[i] - m)` for every i.
    fn exp_sub(p: &mut [f32; KB], m: f32);
    /// For `g < G`: `acc_g *= c[g]`, then `acc_g += p[g][j] * v_j` for
    /// `j in a..b` in order; `acc` holds G rows of `hd`, `v` rows of `hd`.
    fn pv<const G: usize>(acc: &mut [f32], c: &[f32; G], p: &[[f32; KB]; G], v: &[f32], hd: usize, a: usize, b: usize);
}

/// The fixed reduction of eight lanes both kernels use.
#[inline(always)]
fn reduce8(s: &[f32; 8]) -> f32 {
    ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]))
}

struct Generic;
impl Kern for Generic {
    #[inline(always)]
    fn load_f16(src: &[f16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
    #[inline(always)]
    fn scores<const G: usize>(q: &[f32], k: &[f32], hd: usize, a: usize, b: usize, s: &mut [[f32; KB]; G]) {
        let full = hd - hd % 8;
        for j in a..b {
            let kr = &k[j * hd..(j + 1) * hd];
            for g in 0..G {
                let qr = &q[g * hd..(g + 1) * hd];
                let mut l = [0f32; 8];
                for (x, y) in qr[..full].chunks_exact(8).zip(kr[..full].chunks_exact(8)) {
                    for t in 0..8 {
                        l[t] = x[t].mul_add(y[t], l[t]);
                    }
                }
                let mut t = reduce8(&l);
                for d in full..hd {
                    t += qr[d] * kr[d];
                }
                s[g][j] = t;
            }
        }
    }
    #[inline(always)]
    fn exp_sub(p: &mut [f32; KB], m: f32) {
        for x in p.iter_mut() {
            *x = vmath::exp(*x - m);
        }
    }
    #[inline(always)]
    fn pv<const G: usize>(acc: &mut [f32], c: &[f32; G], p: &[[f32; KB]; G], v: &[f32], hd: usize, a: usize, b: usize) {
        for g in 0..G {
            for d in 0..hd {
                let mut x = acc[g * hd + d] * c[g];
                for j in a..b {
                    x = p[g][j].mul_add(v[j * hd + d], x);
                }
                acc[g * hd + d] = x;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Kern for Avx2 {
    #[inline(always)]
    fn load_f16(src: &[f16], dst: &mut [f32]) {
        use std::arch::x86_64::*;
        // SAFETY: only reached from `task_avx2` (AVX2/F16C enabled); lengths
        // are equal multiples of 8.
        unsafe {
            for i in (0..dst.len()).step_by(8) {
                let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
    }
    #[inline(always)]
    fn scores<const G: usize>(q: &[f32], k: &[f32], hd: usize, a: usize, b: usize, s: &mut [[f32; KB]; G]) {
        use std::arch::x86_64::*;
        // SAFETY: as above; hd is a multiple of 8, q holds G rows and k
        // rows up to b.
        unsafe {
            // `reduce8`'s order in registers: lanes (0+4, 1+5, 2+6, 3+7),
            // then (0+4)+(2+6) and (1+5)+(3+7), then their sum.
            let hsum = |v: __m256| {
                let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let y = _mm_add_ps(x, _mm_movehl_ps(x, x));
                _mm_cvtss_f32(_mm_add_ss(y, _mm_shuffle_ps(y, y, 1)))
            };
            let (qp, kp) = (q.as_ptr(), k.as_ptr());
            let mut j = a;
            // Two keys at a time against the G queries.
            while j + 2 <= b {
                let mut acc = [[_mm256_setzero_ps(); 2]; G];
                let (k0, k1) = (kp.add(j * hd), kp.add((j + 1) * hd));
                for d in (0..hd).step_by(8) {
                    let (x0, x1) = (_mm256_loadu_ps(k0.add(d)), _mm256_loadu_ps(k1.add(d)));
                    for g in 0..G {
                        let qv = _mm256_loadu_ps(qp.add(g * hd + d));
                        acc[g][0] = _mm256_fmadd_ps(qv, x0, acc[g][0]);
                        acc[g][1] = _mm256_fmadd_ps(qv, x1, acc[g][1]);
                    }
                }
                for g in 0..G {
                    s[g][j] = hsum(acc[g][0]);
                    s[g][j + 1] = hsum(acc[g][1]);
                }
                j += 2;
            }
            if j < b {
                let mut acc = [_mm256_setzero_ps(); G];
                let k0 = kp.add(j * hd);
                for d in (0..hd).step_by(8) {
                    let x0 = _mm256_loadu_ps(k0.add(d));
                    for g in 0..G {
                        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(g * hd + d)), x0, acc[g]);
                    }
                }
                for g in 0..G {
                    s[g][j] = hsum(acc[g]);
                }
            }
        }
    }
    #[inline(always)]
    fn exp_sub(p: &mut [f32; KB], m: f32) {
        use std::arch::x86_64::*;
        // SAFETY: as above; KB is a multiple of 8.
        unsafe {
            let mv = _mm256_set1_ps(m);
            for i in (0..KB).step_by(8) {
                let x = _mm256_sub_ps(_mm256_loadu_ps(p.as_ptr().add(i)), mv);
                _mm256_storeu_ps(p.as_mut_ptr().add(i), vmath::avx2::exp8(x));
            }
        }
    }
    #[inline(always)]
    fn pv<const G: usize>(acc: &mut [f32], c: &[f32; G], p: &[[f32; KB]; G], v: &[f32], hd: usize, a: usize, b: usize) {
        use std::arch::x86_64::*;
        // SAFETY: as above; acc holds G rows of hd, v rows up to b.
        unsafe {
            let (ap, vp) = (acc.as_mut_ptr(), v.as_ptr());
            let mut d = 0;
            // Two vectors of the head dimension x G queries per pass.
            while d < hd {
                let two = d + 16 <= hd;
                let mut x = [[_mm256_setzero_ps(); 2]; G];
                for g in 0..G {
                    let cv = _mm256_set1_ps(c[g]);
                    x[g][0] = _mm256_mul_ps(_mm256_loadu_ps(ap.add(g * hd + d)), cv);
                    if two {
                        x[g][1] = _mm256_mul_ps(_mm256_loadu_ps(ap.add(g * hd + d + 8)), cv);
                    }
                }
                for j in a..b {
                    let vr = vp.add(j * hd + d);
                    let v0 = _mm256_loadu_ps(vr);
                    let v1 = if two { _mm256_loadu_ps(vr.add(8)) } else { v0 };
                    for g in 0..G {
                        let pb = _mm256_set1_ps(p[g][j]);
                        x[g][0] = _mm256_fmadd_ps(pb, v0, x[g][0]);
                        if two {
                            x[g][1] = _mm256_fmadd_ps(pb, v1, x[g][1]);
                        }
                    }
                }
                for g in 0..G {
                    _mm256_storeu_ps(ap.add(g * hd + d), x[g][0]);
                    if two {
                        _mm256_storeu_ps(ap.add(g * hd + d + 8), x[g][1]);
                    }
                }
                d += if two { 16 } else { 8 };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2(c: &Ctx<'_>, t: &Task, buf: &mut [f32]) {
    task_in::<Avx2>(c, t, buf)
}

fn task_generic(c: &Ctx<'_>, t: &Task, buf: &mut [f32]) {
    task_in::<Generic>(c, t, buf)
}

thread_local! {
    /// Per thread (pool workers included): the task's running state and
    /// converted key/value tiles, grown and kept.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Run `f` on `n` floats of this thread's scratch (a fresh buffer when a
/// nested call already holds it).
fn with_scratch(n: usize, f: &mut dyn FnMut(&mut [f32])) {
    let mut done = false;
    SCRATCH.with(|cell| {
        if let Ok(mut buf) = cell.try_borrow_mut() {
            if buf.len() < n {
                buf.resize(n, 0.0);
            }
            f(&mut buf[..n]);
            done = true;
        }
    });
    if !done {
        f(&mut vec![0.0; n]);
    }
}

/// A task's softmax state in its scratch: per query (`nq`, the task's KV
/// heads one after another) the partition's running max, sum and
/// accumulator, and the total over partitions (acc, m, l side by side,
/// `hd + 2` a query); then a tile of keys and values converted to f32.
struct State<'b> {
    m: &'b mut [f32],
    l: &'b mut [f32],
    acc: &'b mut [f32],
    total: &'b mut [f32],
    kf: &'b mut [f32],
    vf: &'b mut [f32],
    hd: usize,
}

impl<'b> State<'b> {
    fn new(buf: &'b mut [f32], nq: usize, hd: usize) -> State<'b> {
        let (m, rest) = buf.split_at_mut(nq);
        let (l, rest) = rest.split_at_mut(nq);
        let (acc, rest) = rest.split_at_mut(nq * hd);
        let (total, rest) = rest.split_at_mut(nq * (hd + 2));
        let (kf, vf) = rest.split_at_mut(KB * hd);
        for qi in 0..nq {
            total[qi * (hd + 2) + hd] = f32::NEG_INFINITY;
            total[qi * (hd + 2) + hd + 1] = 0.0;
        }
        let mut st = State { m, l, acc, total, kf, vf, hd };
        st.reset();
        st
    }

    /// A partition starts.
    fn reset(&mut self) {
        self.m.fill(f32::NEG_INFINITY);
        self.l.fill(0.0);
        self.acc.fill(0.0);
    }

    /// A partition ends: fold it into the totals.
    fn fold_all(&mut self) {
        let hd = self.hd;
        for qi in 0..self.m.len() {
            let (tacc, tml) = self.total[qi * (hd + 2)..(qi + 1) * (hd + 2)].split_at_mut(hd);
            let (tm, tl) = tml.split_at_mut(1);
            fold(&mut tm[0], &mut tl[0], tacc, self.m[qi], self.l[qi], &self.acc[qi * hd..(qi + 1) * hd]);
        }
    }

    /// Finish task `t`: a split task leaves its partition's state at its
    /// slot for the fold; a whole one writes its rows' outputs.
    fn finish(&mut self, c: &Ctx<'_>, t: &Task) {
        let hd = self.hd;
        if t.part.is_some() {
            for qi in 0..self.m.len() {
                // SAFETY: each split task owns its slot range.
                let dst = unsafe { c.parts.slice(t.slot + qi * (hd + 2), hd + 2) };
                dst[..hd].copy_from_slice(&self.acc[qi * hd..(qi + 1) * hd]);
                dst[hd] = self.m[qi];
                dst[hd + 1] = self.l[qi];
            }
            return;
        }
        self.fold_all();
        let s = &c.seqs[t.seq];
        let nq = t.rows * c.group;
        for k in 0..t.heads {
            for i in 0..t.rows {
                let r = s.q_start + t.row0 + i;
                for g in 0..c.group {
                    let qi = k * nq + i * c.group + g;
                    let h = (t.kv_head + k) * c.group + g;
                    // SAFETY: each (row, head) belongs to exactly one task.
                    let dst = unsafe { c.out.slice(r * c.q.cols + h * hd, hd) };
                    let st = &self.total[qi * (hd + 2)..(qi + 1) * (hd + 2)];
                    write_normalized(dst, &st[..hd], st[hd + 1]);
                }
            }
        }
    }
}

/// The keys task `t` reads: its first row's position, and the first and
/// last key (its window's and its partition's, where it has them).
fn key_range(t: &Task, s: &AttnSeq<'_>) -> (usize, usize, usize) {
    let (mut j_start, mut last_pos) = t.key_span(s);
    if let Some(p) = t.part {
        j_start = j_start.max(p * PART);
        last_pos = last_pos.min((p + 1) * PART - 1);
    }
    (t.first_pos(s), j_start, last_pos)
}

#[inline(always)]
fn task_in<K: Kern>(c: &Ctx<'_>, t: &Task, buf: &mut [f32]) {
    let hd = c.hd;
    let s = &c.seqs[t.seq];
    let shape = c.kv.spec.layers[c.layer];
    let kv_w = shape.kv_heads * hd;
    let bt = c.kv.spec.block_tokens;
    // The pool's rows as it holds them: f16 (converted once per task and
    // tile) or f32 (copied).
    let (kc, vc): (&[f16], &[f16]) = if c.kv.dtype == KvDtype::F16 { (&c.kv.k[c.layer], &c.kv.v[c.layer]) } else { (&[], &[]) };
    let (k32, v32): (&[f32], &[f32]) = if c.kv.dtype == KvDtype::F32 { (&c.kv.k32[c.layer], &c.kv.v32[c.layer]) } else { (&[], &[]) };
    let mut st = State::new(buf, t.rows * c.group, hd);
    let (first_pos, j_start, last_pos) = key_range(t, s);
    let mut t0 = j_start / KB * KB;
    let mut part = t0 / PART;
    while t0 <= last_pos {
        if t0 / PART != part {
            st.fold_all();
            st.reset();
            part = t0 / PART;
        }
        // Keys of this tile that some query of the task sees.
        let (j0, j1) = (t0.max(j_start), (t0 + KB).min(last_pos + 1));
        for j in j0..j1 {
            let slot = s.blocks[j / bt] as usize * bt + j % bt;
            let off = slot * kv_w + t.kv_head * hd;
            let r = (j - t0) * hd;
            if kc.is_empty() {
                st.kf[r..r + hd].copy_from_slice(&k32[off..off + hd]);
                st.vf[r..r + hd].copy_from_slice(&v32[off..off + hd]);
            } else {
                K::load_f16(&kc[off..off + hd], &mut st.kf[r..r + hd]);
                K::load_f16(&vc[off..off + hd], &mut st.vf[r..r + hd]);
            }
        }
        for i in 0..t.rows {
            let pos = if t.fan { first_pos } else { first_pos + i };
            let (a, b) = (t0.max(window_lo(s, pos)) - t0, (t0 + KB).min(pos + 1).saturating_sub(t0));
            if a >= b {
                continue;
            }
            let mut g0 = 0;
            while g0 < c.group {
                let sp = Step { c, t, i, g0, a, b, kf: st.kf, vf: st.vf };
                let (m, l, acc) = (&mut *st.m, &mut *st.l, &mut *st.acc);
                match c.group - g0 {
                    1 => step::<K, 1>(&sp, m, l, acc),
                    2 => step::<K, 2>(&sp, m, l, acc),
                    3 => step::<K, 3>(&sp, m, l, acc),
                    _ => step::<K, GB>(&sp, m, l, acc),
                }
                g0 += GB;
            }
        }
        t0 += KB;
    }
    st.finish(c, t);
}

/// One row's query heads `g0 .. g0 + G` against keys `a..b` of a tile.
struct Step<'a, 'b> {
    c: &'a Ctx<'b>,
    t: &'a Task,
    i: usize,
    g0: usize,
    a: usize,
    b: usize,
    kf: &'a [f32],
    vf: &'a [f32],
}

#[inline(always)]
fn step<K: Kern, const G: usize>(st: &Step<'_, '_>, m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
    let (c, t, hd, a, b) = (st.c, st.t, st.c.hd, st.a, st.b);
    let s = &c.seqs[t.seq];
    let r = s.q_start + t.row0 + st.i;
    let h0 = t.kv_head * c.group + st.g0;
    let q = &c.q.data[r * c.q.cols + h0 * hd..r * c.q.cols + (h0 + G) * hd];
    let mut sc = [[0f32; KB]; G];
    K::scores::<G>(q, st.kf, hd, a, b, &mut sc);
    let mut corr = [0f32; G];
    for g in 0..G {
        let qi = st.i * c.group + st.g0 + g;
        let mut bm = f32::NEG_INFINITY;
        for x in &mut sc[g][a..b] {
            let mut score = *x * c.scale;
            if let Some(cap) = c.softcap {
                score = cap * (score / cap).tanh();
            }
            *x = score;
            bm = bm.max(score);
        }
        let new_m = m[qi].max(bm);
        corr[g] = vmath::exp(m[qi] - new_m);
        K::exp_sub(&mut sc[g], new_m);
        let mut sum = 0f32;
        for p in &sc[g][a..b] {
            sum += p;
        }
        l[qi] = l[qi] * corr[g] + sum;
        m[qi] = new_m;
    }
    let q0 = st.i * c.group + st.g0;
    K::pv::<G>(&mut acc[q0 * hd..(q0 + G) * hd], &corr, &sc, st.vf, hd, a, b);
}

#[cfg(test)]
mod tests {
    use crate::cpu::{Cpu, CpuTensor};
    use crate::{AttnSeq, Device, KvPoolSpec, KvShape};

    fn val(i: usize, salt: usize) -> f32 {
        let x = (i.wrapping_mul(2_654_435_761).wrapping_add(salt * 97) % 1000) as f32 / 500.0 - 1.0;
        x * 1.5
    }

    /// (hd, kv heads, q heads, positions, window)
    const CASES: [(usize, usize, usize, usize, Option<usize>); 4] =
        [(16, 2, 6, 75, None), (256, 1, 4, 70, Some(20)), (64, 3, 9, 40, Some(33)), (12, 1, 2, 37, None)];

    struct Setup {
        dev: Cpu,
        kv: crate::cpu::CpuKv,
        q: CpuTensor,
        blocks: Vec<u32>,
        hd: usize,
        heads: usize,
        n: usize,
        window: Option<usize>,
    }

    fn setup(case: (usize, usize, usize, usize, Option<usize>)) -> Setup {
        setup_in(case, crate::KvDtype::F16)
    }

    fn setup_in(case: (usize, usize, usize, usize, Option<usize>), dtype: crate::KvDtype) -> Setup {
        let (hd, kvh, heads, n, window) = case;
        let dev = Cpu::new(Some(2));
        let bt = 4;
        let nb = n.div_ceil(bt);
        let spec = KvPoolSpec::new(nb + 3, bt, vec![KvShape { kv_heads: kvh, head_dim: hd }]);
        // Blocks out of order, as a paged pool hands them out.
        let blocks: Vec<u32> = (0..nb as u32).map(|b| (b * 5 + 2) % (nb as u32 + 3)).collect();
        let mut kv = dev.kv_pool(&spec, dtype).unwrap();
        let k = dev.upload(&(0..n * kvh * hd).map(|i| val(i, 1)).collect::<Vec<_>>(), n, kvh * hd).unwrap();
        let v = dev.upload(&(0..n * kvh * hd).map(|i| val(i, 2)).collect::<Vec<_>>(), n, kvh * hd).unwrap();
        let slots: Vec<u32> = (0..n).map(|p| blocks[p / bt] * bt as u32 + (p % bt) as u32).collect();
        dev.kv_write(&mut kv, 0, &k, &v, &slots);
        let q = dev.upload(&(0..n * heads * hd).map(|i| val(i, 3)).collect::<Vec<_>>(), n, heads * hd).unwrap();
        Setup { dev, kv, q, blocks, hd, heads, n, window }
    }

    fn rows(t: &CpuTensor, a: usize, b: usize) -> CpuTensor {
        CpuTensor { data: t.data[a * t.cols..b * t.cols].to_vec(), rows: b - a, cols: t.cols }
    }

    /// Attention of rows a..b (positions a..b, keys up to b).
    fn run(s: &Setup, a: usize, b: usize) -> Vec<f32> {
        let seqs = [AttnSeq { q_start: 0, q_len: b - a, kv_len: b, blocks: &s.blocks, window: s.window }];
        let mut out = s.dev.tensor(0, 0);
        s.dev.attention(&rows(&s.q, a, b), &s.kv, 0, &seqs, 0.3, None, &mut out);
        out.data
    }

    /// Row `p`, head `h` of the attention by a direct softmax in f64, over
    /// the keys and values as the f16 pool holds them.
    fn direct(s: &Setup, p: usize, h: usize) -> Vec<f64> {
        let (hd, heads) = (s.hd, s.heads);
        let kvh = s.kv.spec.layers[0].kv_heads;
        let kh = h / (heads / kvh);
        let kf = |p: usize, d: usize| half::f16::from_f32(val(p * kvh * hd + kh * hd + d, 1)).to_f64();
        let vf = |p: usize, d: usize| half::f16::from_f32(val(p * kvh * hd + kh * hd + d, 2)).to_f64();
        let lo = s.window.map_or(0, |w| (p + 1).saturating_sub(w));
        let qv = |d: usize| s.q.data[p * heads * hd + h * hd + d] as f64;
        let sc: Vec<f64> = (lo..=p).map(|j| (0..hd).map(|d| qv(d) * kf(j, d)).sum::<f64>() * 0.3).collect();
        let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
        let z: f64 = e.iter().sum();
        (0..hd).map(|d| (lo..=p).zip(&e).map(|(j, w)| w * vf(j, d)).sum::<f64>() / z).collect()
    }

    /// Every kernel this CPU runs gives the generic kernel's results bit for
    /// bit: prompt blocks, decode rows split by partition (tasks over every
    /// KV head, and by head), single queries over the same keys; with and
    /// without a softcap; f16 and f32 pools.
    #[test]
    fn every_kernel_gives_the_same_bits() {
        use super::{attend, best_kernel, Kernel};
        // Head dims of eight past a multiple of sixteen too (SigLIP's 72:
        // AVX-512 with a last pass of eight lanes), and one query head a
        // KV head (SigLIP's: the patches' rows go as heads).
        let odd = [(72, 2, 4, 300, None), (40, 1, 3, 90, Some(30)), (24, 2, 2, 60, None), (72, 3, 3, 200, None), (64, 2, 2, 150, Some(40))];
        for case in CASES.into_iter().chain([(64, 3, 9, 1300, None), (32, 2, 4, 1200, Some(700)), (128, 2, 8, 600, None)]).chain(odd) {
            let kernels: Vec<Kernel> = [Kernel::Generic, Kernel::Avx2, Kernel::Avx512].into_iter().filter(|&k| k <= best_kernel(case.0)).collect();
            for dtype in [crate::KvDtype::F16, crate::KvDtype::F32] {
                let s = setup_in(case, dtype);
                let n = s.n;
                let whole = |a: usize, b: usize| vec![AttnSeq { q_start: 0, q_len: b - a, kv_len: b, blocks: &s.blocks, window: s.window }];
                // 21 single queries over all keys (five blocks of four and
                // one), and two decode rows beside them.
                let fan: Vec<AttnSeq<'_>> = (0..23)
                    .map(|i| AttnSeq { q_start: i, q_len: 1, kv_len: if i < 21 { n } else { n - 2 + i % 2 }, blocks: &s.blocks, window: s.window })
                    .collect();
                // (A long context's prompt block late in it, not the whole
                // prompt: the generic kernel is slow.)
                let c0 = if n > 100 { n - 40 } else { 0 };
                for (what, seqs, a) in
                    [("prompt", whole(c0, n), c0), ("last row", whole(n - 1, n), n - 1), ("last two", whole(n - 2, n), n - 2), ("fan", fan, 0)]
                {
                    let rows: usize = seqs.iter().map(|t| t.q_len).sum();
                    let q = super::tests::rows(&s.q, a, a + rows);
                    for softcap in [None, Some(3.0)] {
                        let outs: Vec<Vec<u32>> = kernels
                            .iter()
                            .map(|&k| {
                                let mut out = CpuTensor { data: vec![0.0; q.rows * q.cols], rows: q.rows, cols: q.cols };
                                attend(&q, &s.kv, 0, &seqs, 0.3, softcap, &mut out, k);
                                out.data.iter().map(|x| x.to_bits()).collect()
                            })
                            .collect();
                        for (k, o) in kernels.iter().zip(&outs).skip(1) {
                            assert!(*o == outs[0], "{case:?} {dtype:?} {what} softcap {softcap:?}: {k:?} differs from {:?}", kernels[0]);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn matches_a_direct_softmax() {
        for case in CASES.into_iter().chain([(72, 2, 4, 70, None)]) {
            let s = setup(case);
            let got = run(&s, 0, s.n);
            let (hd, heads) = (s.hd, s.heads);
            for p in 0..s.n {
                for h in 0..heads {
                    for (d, want) in direct(&s, p, h).into_iter().enumerate() {
                        let g = got[p * heads * hd + h * hd + d] as f64;
                        assert!((g - want).abs() < 2e-5, "{case:?} pos {p} head {h} dim {d}: {g} vs {want}");
                    }
                }
            }
        }
    }

    /// Long contexts: decode rows (split by key partition, run apart, then
    /// folded) equal the same rows computed inside a whole pass (one task
    /// folding its partitions in turn), bit for bit, and a direct softmax.
    #[test]
    fn long_rows_split_by_partition_are_bit_identical() {
        for case in [(64, 3, 9, 1300, None), (32, 2, 4, 1200, Some(700)), (16, 1, 2, 1030, None)] {
            let s = setup(case);
            let whole = run(&s, 0, s.n);
            let (hd, heads, w) = (s.hd, s.heads, s.heads * s.hd);
            for (a, b) in [(s.n - 1, s.n), (s.n - 3, s.n - 1), (1023, 1024), (1024, 1025), (511, 512), (512, 513), (600, 601)] {
                assert_eq!(run(&s, a, b), whole[a * w..b * w], "{case:?} rows {a}..{b}");
            }
            for p in [511, 512, 1000, s.n - 1] {
                for h in [0, heads - 1] {
                    for (d, want) in direct(&s, p, h).into_iter().enumerate() {
                        let g = whole[p * w + h * hd + d] as f64;
                        assert!((g - want).abs() < 2e-5, "{case:?} pos {p} head {h} dim {d}: {g} vs {want}");
                    }
                }
            }
        }
    }

    #[test]
    fn rows_are_bit_identical_under_any_chunking_and_batching() {
        for case in CASES {
            let s = setup(case);
            let whole = run(&s, 0, s.n);
            let w = s.heads * s.hd;
            for cuts in [vec![1, 2, 3], vec![31, 33], vec![17], vec![5, 40, 41]] {
                let mut a = 0;
                for &c in cuts.iter().chain(std::iter::once(&s.n)) {
                    let c = c.min(s.n);
                    if c <= a {
                        continue;
                    }
                    let part = run(&s, a, c);
                    assert_eq!(part, whole[a * w..c * w], "{case:?} rows {a}..{c}");
                    a = c;
                }
            }
            // Two sequences in one call: a decode row and a prefill chunk.
            let (p, c0, c1) = (s.n - 1, 3, 29.min(s.n - 1));
            let q = CpuTensor { data: [rows(&s.q, p, p + 1).data, rows(&s.q, c0, c1).data].concat(), rows: 1 + c1 - c0, cols: w };
            let seqs = [
                AttnSeq { q_start: 0, q_len: 1, kv_len: p + 1, blocks: &s.blocks, window: s.window },
                AttnSeq { q_start: 1, q_len: c1 - c0, kv_len: c1, blocks: &s.blocks, window: s.window },
            ];
            let mut out = s.dev.tensor(0, 0);
            s.dev.attention(&q, &s.kv, 0, &seqs, 0.3, None, &mut out);
            assert_eq!(out.data[..w], whole[p * w..(p + 1) * w], "{case:?} batched decode row");
            assert_eq!(out.data[w..], whole[c0 * w..c1 * w], "{case:?} batched chunk");
        }
    }

    /// Queries of their own over the same keys (an image's patches, each
    /// seeing all of them), which share key tiles in one task: each row
    /// equals that query alone, bit for bit, also in f32 pools and past a
    /// partition; a run broken by another key set still does.
    #[test]
    fn single_queries_over_the_same_keys_equal_each_alone() {
        for (case, dtype) in
            [((16, 2, 6, 75, None), crate::KvDtype::F16), ((64, 3, 9, 1300, None), crate::KvDtype::F16), ((32, 1, 2, 700, Some(90)), crate::KvDtype::F32)]
        {
            let mut s = setup(case);
            if dtype == crate::KvDtype::F32 {
                let spec = s.kv.spec.clone();
                let mut kv = s.dev.kv_pool(&spec, dtype).unwrap();
                let (n, w) = (s.n, spec.layers[0].kv_heads * s.hd);
                let k = s.dev.upload(&(0..n * w).map(|i| val(i, 1)).collect::<Vec<_>>(), n, w).unwrap();
                let v = s.dev.upload(&(0..n * w).map(|i| val(i, 2)).collect::<Vec<_>>(), n, w).unwrap();
                let bt = spec.block_tokens;
                let slots: Vec<u32> = (0..n).map(|p| s.blocks[p / bt] * bt as u32 + (p % bt) as u32).collect();
                s.dev.kv_write(&mut kv, 0, &k, &v, &slots);
                s.kv = kv;
            }
            let (n, w) = (s.n, s.heads * s.hd);
            let short = &s.blocks[..(n / 2).div_ceil(4)];
            // 20 queries: 11 over every key, one over half of them, 8 more over every key.
            let kv_of = |i: usize| if i == 11 { n / 2 } else { n };
            let seqs: Vec<AttnSeq<'_>> = (0..20)
                .map(|i| AttnSeq { q_start: i, q_len: 1, kv_len: kv_of(i), blocks: if i == 11 { short } else { &s.blocks }, window: s.window })
                .collect();
            let q = rows(&s.q, 0, 20);
            let mut out = s.dev.tensor(0, 0);
            s.dev.attention(&q, &s.kv, 0, &seqs, 0.3, None, &mut out);
            for i in 0..20 {
                let one = [AttnSeq { q_start: 0, ..seqs[i] }];
                let mut alone = s.dev.tensor(0, 0);
                s.dev.attention(&rows(&s.q, i, i + 1), &s.kv, 0, &one, 0.3, None, &mut alone);
                assert_eq!(out.data[i * w..(i + 1) * w], alone.data[..], "{case:?} {dtype:?} query {i}");
            }
        }
    }
}
