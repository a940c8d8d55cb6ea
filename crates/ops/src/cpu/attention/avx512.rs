//! The attention task on AVX-512 (head dimensions a multiple of eight,
//! from sixteen): [`task_in`](super::task_in)'s walk and
//! arithmetic, bit for bit (every score the eight-lane dot and `reduce8`,
//! every accumulator lane the same chain of FMAs, every sum in key order),
//! on 512-bit vectors.
//!
//! A score vector holds eight lanes of two keys, so one FMA advances two
//! keys' dots, and a transposing tree reduces sixteen keys' lanes at once
//! (the horizontal sums were a third of the AVX2 kernel's score work).
//!
//! A decode round is bound by reading the KV pool. Tasks of few rows
//! (decode) therefore read the pool's rows in place, converting f16 in
//! registers (each element loaded once for all heads of its group, not
//! converted, stored to scratch and loaded again), and fetch the next
//! tile's rows while a tile runs, a few lines per key, so the loads keep
//! coming without a burst that would stall the tile for free fill buffers.
//! Tasks of many rows convert each tile once into scratch, as the other
//! kernels do.

// Kernels index accumulators by head and key pair.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use half::f16;

use super::{key_range, vmath, window_lo, Ctx, State, Task, GB, KB, PART};
use crate::KvDtype;

/// Tasks of at most this many rows read the pool in place.
const DIRECT_ROWS: usize = 2;

/// A row element as the kernels read it: f16 (converted in registers) or
/// f32.
trait Elem: Copy {
    /// Eight elements at `a` and eight at `b`, as f32: lanes 0..8 and 8..16.
    unsafe fn pair8(a: *const Self, b: *const Self) -> __m512;
    /// Sixteen elements as f32.
    unsafe fn load16(a: *const Self) -> __m512;
    /// Eight elements as f32 (a head dimension's last eight, where it is
    /// not a multiple of sixteen).
    unsafe fn load8(a: *const Self) -> __m256;
}

impl Elem for f16 {
    #[inline(always)]
    unsafe fn pair8(a: *const f16, b: *const f16) -> __m512 {
        let lo = _mm256_castsi128_si256(_mm_loadu_si128(a as *const __m128i));
        _mm512_cvt_roundph_ps::<_MM_FROUND_CUR_DIRECTION>(_mm256_inserti128_si256::<1>(lo, _mm_loadu_si128(b as *const __m128i)))
    }
    #[inline(always)]
    unsafe fn load16(a: *const f16) -> __m512 {
        // Not `_mm512_cvtph_ps`: its {sae} form cannot take the load as an
        // operand, and the register form costs a shuffle uop on port 5,
        // beside the FMAs.
        _mm512_cvt_roundph_ps::<_MM_FROUND_CUR_DIRECTION>(_mm256_loadu_si256(a as *const __m256i))
    }
    #[inline(always)]
    unsafe fn load8(a: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(a as *const __m128i))
    }
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn pair8(a: *const f32, b: *const f32) -> __m512 {
        _mm512_insertf32x8::<1>(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b))
    }
    #[inline(always)]
    unsafe fn load16(a: *const f32) -> __m512 {
        _mm512_loadu_ps(a)
    }
    #[inline(always)]
    unsafe fn load8(a: *const f32) -> __m256 {
        _mm256_loadu_ps(a)
    }
}

/// A tile's rows: per key its K and V row, at the task's first KV head (a
/// later head's are `hd` elements on per head). Keys that the task does
/// not read point at the tile's first key it does, so that passes over
/// whole pairs and sixteens read only rows of the pool; their scores are
/// masked.
struct Rows<R> {
    k: [*const R; KB],
    v: [*const R; KB],
}

/// Run one task. The caller checked AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C,
/// and that the head dimension is a multiple of 8, at least 16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn task(c: &Ctx<'_>, t: &Task, buf: &mut [f32]) {
    if c.kv.dtype == KvDtype::F16 {
        task_e::<f16>(c, t, buf, &c.kv.k[c.layer], &c.kv.v[c.layer])
    } else {
        task_e::<f32>(c, t, buf, &c.kv.k32[c.layer], &c.kv.v32[c.layer])
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn task_e<E: Elem>(c: &Ctx<'_>, t: &Task, buf: &mut [f32], kc: &[E], vc: &[E]) {
    let hd = c.hd;
    let s = &c.seqs[t.seq];
    let shape = c.kv.spec.layers[c.layer];
    let kv_w = shape.kv_heads * hd;
    let bt = c.kv.spec.block_tokens;
    let direct = t.rows <= DIRECT_ROWS;
    // Queries per KV head; state index `k * nq + qi` for the task's k-th
    // KV head (the layout of the partials buffer too).
    let nq = t.rows * c.group;
    let mut st = State::new(buf, nq * t.heads, hd);
    let (first_pos, j_start, last_pos) = key_range(t, s);
    // Keys of the tile at t0 that the task reads, and their rows (walking
    // the block table, no division per key).
    let span = |t0: usize| (t0.max(j_start) - t0, (t0 + KB).min(last_pos + 1) - t0);
    let rows_at = |t0: usize| {
        let (a, b) = span(t0);
        let mut r = Rows { k: [kc.as_ptr(); KB], v: [vc.as_ptr(); KB] };
        let (mut blk, mut o) = ((t0 + a) / bt, (t0 + a) % bt);
        for j in a..b {
            let off = (s.blocks[blk] as usize * bt + o) * kv_w + t.kv_head * hd;
            (r.k[j], r.v[j]) = (kc.as_ptr().add(off), vc.as_ptr().add(off));
            o += 1;
            if o == bt {
                (blk, o) = (blk + 1, 0);
            }
        }
        for j in (0..a).chain(b..KB) {
            (r.k[j], r.v[j]) = (r.k[a], r.v[a]);
        }
        r
    };
    let mut t0 = j_start / KB * KB;
    let mut part = t0 / PART;
    let mut cur = if direct { Some(rows_at(t0)) } else { None };
    while t0 <= last_pos {
        if t0 / PART != part {
            st.fold_all();
            st.reset();
            part = t0 / PART;
        }
        if let Some(rows) = &cur {
            let next = if t0 + KB <= last_pos { Some(rows_at(t0 + KB)) } else { None };
            for k in 0..t.heads {
                let tk = Task { kv_head: t.kv_head + k, heads: 1, ..*t };
                let tile = Tile { c, t: &tk, t0, first_pos };
                let (mk, lk, ak) = (&mut st.m[k * nq..(k + 1) * nq], &mut st.l[k * nq..(k + 1) * nq], &mut st.acc[k * nq * hd..(k + 1) * nq * hd]);
                tile.run(rows, k * hd, next.as_ref(), mk, lk, ak);
            }
            if let Some(n) = next {
                cur = Some(n);
            }
        } else {
            let rows = rows_at(t0);
            let (a, b) = span(t0);
            let mut conv = Rows { k: [st.kf.as_ptr(); KB], v: [st.vf.as_ptr(); KB] };
            for j in 0..KB {
                let r = j.clamp(a, b - 1) * hd;
                (conv.k[j], conv.v[j]) = (st.kf.as_ptr().add(r), st.vf.as_ptr().add(r));
            }
            for k in 0..t.heads {
                for j in a..b {
                    let r = j * hd;
                    let mut d = 0;
                    while d + 16 <= hd {
                        _mm512_storeu_ps(st.kf.as_mut_ptr().add(r + d), E::load16(rows.k[j].add(k * hd + d)));
                        _mm512_storeu_ps(st.vf.as_mut_ptr().add(r + d), E::load16(rows.v[j].add(k * hd + d)));
                        d += 16;
                    }
                    if d < hd {
                        _mm256_storeu_ps(st.kf.as_mut_ptr().add(r + d), E::load8(rows.k[j].add(k * hd + d)));
                        _mm256_storeu_ps(st.vf.as_mut_ptr().add(r + d), E::load8(rows.v[j].add(k * hd + d)));
                    }
                }
                let tk = Task { kv_head: t.kv_head + k, heads: 1, ..*t };
                let tile = Tile { c, t: &tk, t0, first_pos };
                let (mk, lk, ak) = (&mut st.m[k * nq..(k + 1) * nq], &mut st.l[k * nq..(k + 1) * nq], &mut st.acc[k * nq * hd..(k + 1) * nq * hd]);
                tile.run(&conv, 0, None, mk, lk, ak);
            }
        }
        t0 += KB;
    }
    st.finish(c, t);
}

/// One tile of a task: its rows against the keys at `t0 .. t0 + KB`.
struct Tile<'a, 'b> {
    c: &'a Ctx<'b>,
    t: &'a Task,
    t0: usize,
    first_pos: usize,
}

impl Tile<'_, '_> {
    /// The tile's rows at `rows` + `hoff` elements; `next`: the next tile's,
    /// to prefetch.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn run<R: Elem>(&self, rows: &Rows<R>, hoff: usize, next: Option<&Rows<R>>, m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
        let (c, t, t0) = (self.c, self.t, self.t0);
        // One query head a KV head over the same keys (an image's patches
        // in SigLIP): up to GB rows at a time, as a group's heads go, so
        // they share each key's and value's load. Row i + g then sits
        // where head g of row i would: `i + g` in the state, `q.cols` on
        // in `q`.
        let rows_as_heads = c.group == 1 && t.fan;
        let mut i = 0;
        while i < t.rows {
            let pos = if t.fan { self.first_pos } else { self.first_pos + i };
            let (a, b) = (t0.max(window_lo(&c.seqs[t.seq], pos)) - t0, (t0 + KB).min(pos + 1).saturating_sub(t0));
            let (width, qs) = if rows_as_heads { ((t.rows - i).min(GB), c.q.cols) } else { (c.group, c.hd) };
            if a < b {
                let mut g0 = 0;
                while g0 < width {
                    // The next tile's rows once, spread over the first step's keys.
                    let next = if i == 0 && g0 == 0 { next } else { None };
                    let st = Step { c, t, i, g0, qs, a, b, rows, hoff, next };
                    match width - g0 {
                        1 => step::<R, 1>(&st, m, l, acc),
                        2 => step::<R, 2>(&st, m, l, acc),
                        3 => step::<R, 3>(&st, m, l, acc),
                        _ => step::<R, GB>(&st, m, l, acc),
                    }
                    g0 += GB;
                }
            }
            i += if rows_as_heads { width } else { 1 };
        }
    }
}

struct Step<'a, 'b, R> {
    c: &'a Ctx<'b>,
    t: &'a Task,
    i: usize,
    g0: usize,
    /// From one of the step's queries to the next in `q`: a head (`hd`),
    /// or a row where the rows go as heads.
    qs: usize,
    a: usize,
    b: usize,
    rows: &'a Rows<R>,
    hoff: usize,
    next: Option<&'a Rows<R>>,
}

/// One row's query heads `g0 .. g0 + G` against keys `a..b` of a tile, as
/// `super::step` computes it.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn step<R: Elem, const G: usize>(st: &Step<'_, '_, R>, m: &mut [f32], l: &mut [f32], acc: &mut [f32]) {
    let (c, t, hd, a, b) = (st.c, st.t, st.c.hd, st.a, st.b);
    let s = &c.seqs[t.seq];
    let r = s.q_start + t.row0 + st.i;
    let h0 = t.kv_head * c.group + st.g0;
    let q = c.q.data.as_ptr().add(r * c.q.cols + h0 * hd);
    let mut sc = [[0f32; KB]; G];
    if G <= 3 {
        for j in (a / 16 * 16..b).step_by(16) {
            scores16::<R, G>(q, hd, st.qs, &st.rows.k, st.hoff, j, &mut sc);
        }
    } else {
        for j in (a / 8 * 8..b).step_by(8) {
            scores8x4(q, hd, st.qs, &st.rows.k, st.hoff, j, &mut sc);
        }
    }
    // Lanes of keys a..b (a tile is at most 64 keys).
    const { assert!(KB <= 64 && KB.is_multiple_of(16)) };
    let keys = (if b == 64 { !0u64 } else { (1u64 << b) - 1 }) & !((1u64 << a) - 1);
    // Each head's correction `exp(m - new_m)`, all in one vector `exp`
    // (lane for lane the scalar one) after the loop.
    let mut shift = [0f32; 16];
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let scale = _mm512_set1_ps(c.scale);
    const NS: usize = KB / 16;
    for g in 0..G {
        let qi = st.i * c.group + st.g0 + g;
        let p = sc[g].as_mut_ptr();
        let mut x = [_mm512_setzero_ps(); NS];
        for v in 0..NS {
            x[v] = _mm512_mul_ps(_mm512_loadu_ps(p.add(16 * v)), scale);
        }
        if let Some(cap) = c.softcap {
            for v in 0..NS {
                _mm512_storeu_ps(p.add(16 * v), x[v]);
            }
            for x in &mut sc[g][a..b] {
                *x = cap * (*x / cap).tanh();
            }
            for v in 0..NS {
                x[v] = _mm512_loadu_ps(p.add(16 * v));
            }
        }
        let mut mx = ninf;
        for v in 0..NS {
            x[v] = _mm512_mask_mov_ps(ninf, (keys >> (16 * v)) as u16, x[v]);
            mx = _mm512_max_ps(mx, x[v]);
        }
        let bm = _mm512_reduce_max_ps(mx);
        let new_m = m[qi].max(bm);
        shift[g] = m[qi] - new_m;
        let nm = _mm512_set1_ps(new_m);
        for v in 0..NS {
            _mm512_storeu_ps(p.add(16 * v), vmath::avx512::exp16(_mm512_sub_ps(x[v], nm)));
        }
        m[qi] = new_m;
    }
    let mut corr16 = [0f32; 16];
    _mm512_storeu_ps(corr16.as_mut_ptr(), vmath::avx512::exp16(_mm512_loadu_ps(shift.as_ptr())));
    let corr: [f32; G] = std::array::from_fn(|g| corr16[g]);
    let q0 = st.i * c.group + st.g0;
    let accp = acc.as_mut_ptr().add(q0 * hd);
    let mut sum = [0f32; G];
    let mut d = 0;
    while d < hd {
        // The sums and the prefetches ride along the first pass.
        let (next, sum) = if d == 0 { (st.next, Some(&mut sum)) } else { (None, None) };
        let pass = Pv { acc: accp, d, hd, c: &corr, p: &sc, v: &st.rows.v, hoff: st.hoff, a, b };
        // Sixteen lanes a vector, up to four at once; a head dimension
        // that is not a multiple of sixteen ends in eight (hd >= 16: the
        // first pass, which carries the sums, is a whole one).
        let n = ((hd - d) / 16).min(4);
        match n {
            0 => pv8::<R, G>(&pass),
            1 => pv::<R, G, 1>(&pass, next, sum),
            2 => pv::<R, G, 2>(&pass, next, sum),
            3 => pv::<R, G, 3>(&pass, next, sum),
            _ => pv::<R, G, 4>(&pass, next, sum),
        }
        d += if n == 0 { 8 } else { 16 * n };
    }
    for g in 0..G {
        let qi = st.i * c.group + st.g0 + g;
        l[qi] = l[qi] * corr[g] + sum[g];
    }
}

/// `reduce8` of each key in eight pair accumulators (lanes 0..8 key 2i,
/// 8..16 key 2i + 1 of `x[i]`), as one vector of the sixteen keys in order.
/// Each level adds the same lanes as `reduce8` does, several keys per
/// instruction: t + t+4, then t + t+2, then 0 + 1.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn reduce16(x: &[__m512; 8]) -> __m512 {
    // t + t+4: quarter q of s_k holds key 4k + q's four sums a0..a3.
    let (s0, s1) = (l1(x[0], x[1]), l1(x[2], x[3]));
    let (s2, s3) = (l1(x[4], x[5]), l1(x[6], x[7]));
    // b0 = a0 + a2, b1 = a1 + a3: quarter q of w0 holds keys q and 4 + q
    // (b0, b1 each), of w1 keys 8 + q and 12 + q.
    let (w0, w1) = (l2(s0, s1), l2(s2, s3));
    // b0 + b1: quarter q holds keys q, 4 + q, 8 + q, 12 + q.
    let z = _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(w0, w1), _mm512_shuffle_ps::<0b11_01_11_01>(w0, w1));
    _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn l1(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn l2(a: __m512, b: __m512) -> __m512 {
    let (a, b) = (_mm512_castps_pd(a), _mm512_castps_pd(b));
    _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)))
}

/// `s[g][j..j + 16]` for `g < G <= 3`: eight key pairs per head (query
/// `g` at `q + g * qs`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn scores16<R: Elem, const G: usize>(q: *const f32, hd: usize, qs: usize, kr: &[*const R; KB], hoff: usize, j: usize, s: &mut [[f32; KB]; G]) {
    let mut acc = [[_mm512_setzero_ps(); 8]; G];
    for d in (0..hd).step_by(8) {
        let mut qv = [_mm512_setzero_ps(); G];
        for g in 0..G {
            qv[g] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q.add(g * qs + d)));
        }
        for p in 0..8 {
            let kv = R::pair8(kr[j + 2 * p].add(hoff + d), kr[j + 2 * p + 1].add(hoff + d));
            for g in 0..G {
                acc[g][p] = _mm512_fmadd_ps(qv[g], kv, acc[g][p]);
            }
        }
    }
    for g in 0..G {
        _mm512_storeu_ps(s[g].as_mut_ptr().add(j), reduce16(&acc[g]));
    }
}

/// `s[g][j..j + 8]` for four heads: four key pairs per head.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn scores8x4<R: Elem, const G: usize>(q: *const f32, hd: usize, qs: usize, kr: &[*const R; KB], hoff: usize, j: usize, s: &mut [[f32; KB]; G]) {
    let mut acc = [[_mm512_setzero_ps(); 4]; 4];
    for d in (0..hd).step_by(8) {
        let mut qv = [_mm512_setzero_ps(); 4];
        for g in 0..4 {
            qv[g] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q.add(g * qs + d)));
        }
        for p in 0..4 {
            let kv = R::pair8(kr[j + 2 * p].add(hoff + d), kr[j + 2 * p + 1].add(hoff + d));
            for g in 0..4 {
                acc[g][p] = _mm512_fmadd_ps(qv[g], kv, acc[g][p]);
            }
        }
    }
    for h in 0..2 {
        let (a, b) = (&acc[2 * h], &acc[2 * h + 1]);
        let v = reduce16(&[a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]);
        _mm256_storeu_ps(s[2 * h].as_mut_ptr().add(j), _mm512_castps512_ps256(v));
        _mm256_storeu_ps(s[2 * h + 1].as_mut_ptr().add(j), _mm512_extractf32x8_ps::<1>(v));
    }
}

/// A values' pass: for `g < G`, `acc_g[d .. d + 16 NV] *= c[g]`, then
/// `+= p[g][j] * v_j` for `j in a..b` in order.
struct Pv<'a, R, const G: usize> {
    acc: *mut f32,
    d: usize,
    hd: usize,
    c: &'a [f32; G],
    p: &'a [[f32; KB]; G],
    v: &'a [*const R; KB],
    hoff: usize,
    a: usize,
    b: usize,
}

/// Run a values' pass; with `next`, also prefetch the next tile's rows of
/// this head (key j's as key j is taken), and with `sum`, add each head's
/// weights in key order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn pv<R: Elem, const G: usize, const NV: usize>(pv: &Pv<'_, R, G>, next: Option<&Rows<R>>, mut sum: Option<&mut [f32; G]>) {
    let (acc, d, hd, hoff) = (pv.acc, pv.d, pv.hd, pv.hoff);
    let lines = (hd * std::mem::size_of::<R>()).div_ceil(64);
    // Prefetch addresses are never dereferenced: wrapping arithmetic.
    let fetch = |j: usize| {
        if let Some(n) = next {
            let (k, v) = (n.k[j].wrapping_add(hoff) as *const i8, n.v[j].wrapping_add(hoff) as *const i8);
            for x in 0..lines {
                _mm_prefetch::<_MM_HINT_T0>(k.wrapping_add(64 * x));
                _mm_prefetch::<_MM_HINT_T0>(v.wrapping_add(64 * x));
            }
        }
    };
    let mut x = [[_mm512_setzero_ps(); NV]; G];
    for g in 0..G {
        let cv = _mm512_set1_ps(pv.c[g]);
        for n in 0..NV {
            x[g][n] = _mm512_mul_ps(_mm512_loadu_ps(acc.add(g * hd + d + 16 * n)), cv);
        }
    }
    for j in pv.a..pv.b {
        fetch(j);
        let mut v = [_mm512_setzero_ps(); NV];
        for n in 0..NV {
            v[n] = R::load16(pv.v[j].add(hoff + d + 16 * n));
        }
        for g in 0..G {
            let pb = _mm512_set1_ps(pv.p[g][j]);
            for n in 0..NV {
                x[g][n] = _mm512_fmadd_ps(pb, v[n], x[g][n]);
            }
        }
        if let Some(s) = sum.as_deref_mut() {
            for g in 0..G {
                s[g] += pv.p[g][j];
            }
        }
    }
    for g in 0..G {
        for n in 0..NV {
            _mm512_storeu_ps(acc.add(g * hd + d + 16 * n), x[g][n]);
        }
    }
    for j in (0..pv.a).chain(pv.b..KB) {
        fetch(j);
    }
}

/// [`pv`] over the last eight lanes of a head (`pv.d + 8 == hd`): the
/// same chain of FMAs a lane, on 256-bit vectors.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn pv8<R: Elem, const G: usize>(pv: &Pv<'_, R, G>) {
    let (acc, d, hd, hoff) = (pv.acc, pv.d, pv.hd, pv.hoff);
    let mut x = [_mm256_setzero_ps(); G];
    for g in 0..G {
        x[g] = _mm256_mul_ps(_mm256_loadu_ps(acc.add(g * hd + d)), _mm256_set1_ps(pv.c[g]));
    }
    for j in pv.a..pv.b {
        let v = R::load8(pv.v[j].add(hoff + d));
        for g in 0..G {
            x[g] = _mm256_fmadd_ps(_mm256_set1_ps(pv.p[g][j]), v, x[g]);
        }
    }
    for g in 0..G {
        _mm256_storeu_ps(acc.add(g * hd + d), x[g]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce16_is_reduce8_of_each_key() {
        if !vmath::has_avx512() {
            return;
        }
        let x: Vec<f32> = (0..128).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1.37e-3).collect();
        let mut got = [0f32; 16];
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
        unsafe fn run(x: &[f32], got: &mut [f32; 16]) {
            let mut v = [_mm512_setzero_ps(); 8];
            for i in 0..8 {
                v[i] = _mm512_loadu_ps(x.as_ptr().add(16 * i));
            }
            _mm512_storeu_ps(got.as_mut_ptr(), reduce16(&v));
        }
        // SAFETY: AVX-512 checked above.
        unsafe { run(&x, &mut got) };
        for k in 0..16 {
            let want = super::super::reduce8(x[8 * k..8 * k + 8].try_into().unwrap());
            assert_eq!(got[k].to_bits(), want.to_bits(), "key {k}: {got:?}");
        }
    }
}
