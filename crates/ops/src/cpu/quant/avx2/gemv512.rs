//! Matvecs of the 32-element types on 512-bit registers (AVX-512 VNNI):
//! sixteen weight rows a tile, two to a register (one per 256-bit half),
//! so a block's sixteen exact integer sums take eight `dpbusd` and one
//! transposing reduction — half the reductions, per row, of the eight-row
//! tile, which a one-row matvec (decode) spends most of its time on.
//! Signed weights (Q8_0, Q8_1) are biased to unsigned bytes (`w ^ 0x80` is
//! `w + 128`) and the block's `128 * sum(a)` is taken off the integer sum
//! after. The sums are exact and the float steps are the eight-row tile's,
//! in its order, so the results are bit for bit the same.

use std::arch::x86_64::*;

use super::{prefetch, B32, Q8A};
use crate::cpu::quant::matmul::Tile;

/// Rows of a full tile.
pub(super) const ROWS: usize = 16;

/// The (low half, high half) weight rows of register `j`, chosen so that
/// [`reduce16`] gives the sums in row order.
const fn rows_of(j: usize) -> (usize, usize) {
    if j < 4 {
        (j, j + 4)
    } else {
        (j + 4, j + 8)
    }
}

/// Lane r of the result: the sum of the 256-bit half of `v[j]` that holds
/// row r (see [`rows_of`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn reduce16(v: &[__m512i; 8]) -> __m512i {
    // Within each 128-bit lane, pairs then quads of registers: after these,
    // lane k of u0 holds [v0, v1, v2, v3]'s sums of their lane k.
    let pair = |a, b| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    let (t0, t1, t2, t3) = (pair(v[0], v[1]), pair(v[2], v[3]), pair(v[4], v[5]), pair(v[6], v[7]));
    let quad = |a, b| _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    let (u0, u1) = (quad(t0, t1), quad(t2, t3));
    // Lanes 0+1 are a register's low half, 2+3 its high half.
    let x = _mm512_shuffle_i32x4::<0b10_00_10_00>(u0, u1);
    let y = _mm512_shuffle_i32x4::<0b11_01_11_01>(u0, u1);
    _mm512_add_epi32(x, y)
}

/// Up to sixteen rows of the file's blocks (`t.w`, `t.w_stride`) x one
/// activation row. Rows past `rw` repeat the last one; they are not stored.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn tile16<K: B32>(t: &Tile, rw: usize) {
    // Each row's offset from `t.w`.
    let mut at = [0i32; ROWS];
    for (r, o) in at.iter_mut().enumerate() {
        *o = (r.min(rw - 1) * t.w_stride) as i32;
    }
    let block = |r: usize, b: usize| t.w.add(at[r] as usize + b * K::BYTES);
    // Each row's block header (d, and Q4_1's / Q5_1's m), gathered in row
    // order: one conversion for all sixteen scales.
    let heads = _mm512_loadu_si512(at.as_ptr() as *const _);
    let mut acc = _mm512_setzero_ps();
    let mut off = _mm512_setzero_ps();
    let bias = _mm512_set1_epi8(-128);
    let ones = _mm256_set1_epi8(1);
    let act = t.a as *const Q8A;
    for b in 0..t.n {
        let ab = &*act.add(b);
        let a = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
        let av = _mm512_broadcast_i64x4(a);
        let mut v = [_mm512_setzero_si512(); 8];
        for j in 0..8 {
            let (lo, hi) = rows_of(j);
            let (pl, ph) = (block(lo, b), block(hi, b));
            // The block two tiles on, as the eight-row tile does.
            prefetch(pl.wrapping_add(2 * ROWS * t.w_stride));
            prefetch(ph.wrapping_add(2 * ROWS * t.w_stride));
            let (ul, uh) = (K::unpack_bw(pl), K::unpack_bw(ph));
            let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ul.q), uh.q);
            let w = if K::SIGNED { _mm512_xor_si512(w, bias) } else { w };
            v[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, av);
        }
        let mut isum = reduce16(&v);
        if K::SIGNED {
            let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, a);
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * _mm_cvtsi128_si32(s)));
        }
        let head = _mm512_i32gather_epi32::<1>(heads, t.w.add(b * K::BYTES) as *const _);
        let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
        let s = _mm512_mul_ps(d, _mm512_set1_ps(ab.d));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc);
        if K::OFFSET {
            let m =
                if K::M_STORED { _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(head))) } else { _mm512_mul_ps(d, _mm512_set1_ps(K::M_OF_D)) };
            off = _mm512_fmadd_ps(m, _mm512_set1_ps(ab.s), off);
        }
    }
    let mask = if rw >= ROWS { u16::MAX } else { (1u16 << rw) - 1 };
    _mm512_mask_storeu_ps(t.out, mask, _mm512_add_ps(acc, off));
}
