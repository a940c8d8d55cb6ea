//! Quantizing activation rows to 8-bit blocks, once per matmul.
//!
//! Symmetric: `d = max|x| / 127`, `q = round_ties_even(x / d)`. The scalar
//! and AVX2 versions compute the same products and roundings, so they give
//! identical blocks (the tests rely on it).

use super::blocks::{Q8A, Q8KA};
use super::Isa;

#[inline]
fn scale_of(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (d, id)
}

/// One row: `x.len() == out.len() * 32`.
pub(crate) fn quantize_q8a(isa: Isa, x: &[f32], out: &mut [Q8A]) {
    debug_assert_eq!(x.len(), out.len() * 32);
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: Avx2 is only chosen when the CPU has it; sizes checked above.
        unsafe { quantize_q8a_avx2(x, out) };
        return;
    }
    let _ = isa;
    for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (d, id) = scale_of(amax);
        let mut sum = 0i32;
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
            sum += *q as i32;
        }
        o.d = d;
        o.s = d * sum as f32;
    }
}

/// One row: `x.len() == out.len() * 256`.
pub(crate) fn quantize_q8k(isa: Isa, x: &[f32], out: &mut [Q8KA]) {
    debug_assert_eq!(x.len(), out.len() * 256);
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: as above.
        unsafe { quantize_q8k_avx2(x, out) };
        return;
    }
    let _ = isa;
    for (xb, o) in x.chunks_exact(256).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (d, id) = scale_of(amax);
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
        }
        for (g, s) in o.bsums.iter_mut().enumerate() {
            *s = o.qs[g * 16..g * 16 + 16].iter().map(|&q| q as i16).sum();
        }
        o.d = d;
    }
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Max |x| of 8*k floats, and their quantized bytes written by `store`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn amax_avx2(p: *const f32, n: usize) -> f32 {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let mut m = _mm256_setzero_ps();
    for i in (0..n).step_by(8) {
        m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(p.add(i)), abs_mask));
    }
    let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_max_ss(h, _mm_movehdup_ps(h));
    _mm_cvtss_f32(h)
}

/// 32 floats at `p` times `id`, rounded to nearest even, as 32 i8 (in order).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quant32_avx2(p: *const f32, id: f32) -> __m256i {
    let vid = _mm256_set1_ps(id);
    const RND: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let q0 = _mm256_cvtps_epi32(_mm256_round_ps::<RND>(_mm256_mul_ps(_mm256_loadu_ps(p), vid)));
    let q1 = _mm256_cvtps_epi32(_mm256_round_ps::<RND>(_mm256_mul_ps(_mm256_loadu_ps(p.add(8)), vid)));
    let q2 = _mm256_cvtps_epi32(_mm256_round_ps::<RND>(_mm256_mul_ps(_mm256_loadu_ps(p.add(16)), vid)));
    let q3 = _mm256_cvtps_epi32(_mm256_round_ps::<RND>(_mm256_mul_ps(_mm256_loadu_ps(p.add(24)), vid)));
    // packs work per 128-bit lane; the permute puts the 8 groups of 4 back in order.
    let a = _mm256_packs_epi32(q0, q1);
    let b = _mm256_packs_epi32(q2, q3);
    let c = _mm256_packs_epi16(a, b);
    _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Sum of 32 i8 as i32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sum_i8(v: __m256i) -> i32 {
    let w = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
    let s = _mm_add_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8a_avx2(x: &[f32], out: &mut [Q8A]) {
    for (i, o) in out.iter_mut().enumerate() {
        let p = x.as_ptr().add(i * 32);
        let (d, id) = scale_of(amax_avx2(p, 32));
        let q = quant32_avx2(p, id);
        _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, q);
        o.d = d;
        o.s = d * sum_i8(q) as f32;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8k_avx2(x: &[f32], out: &mut [Q8KA]) {
    for (i, o) in out.iter_mut().enumerate() {
        let p = x.as_ptr().add(i * 256);
        let (d, id) = scale_of(amax_avx2(p, 256));
        for j in 0..8 {
            let q = quant32_avx2(p.add(32 * j), id);
            _mm256_storeu_si256(o.qs.as_mut_ptr().add(32 * j) as *mut __m256i, q);
            // Sums of each 16: widen to i16 and add pairs down to one per half.
            let w = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
            let w = _mm256_madd_epi16(w, _mm256_set1_epi16(1));
            let lo = _mm256_castsi256_si128(w);
            let hi = _mm256_extracti128_si256(w, 1);
            let lo = _mm_hadd_epi32(lo, lo);
            let hi = _mm_hadd_epi32(hi, hi);
            let lo = _mm_hadd_epi32(lo, lo);
            let hi = _mm_hadd_epi32(hi, hi);
            o.bsums[2 * j] = _mm_cvtsi128_si32(lo) as i16;
            o.bsums[2 * j + 1] = _mm_cvtsi128_si32(hi) as i16;
        }
        o.d = d;
    }
}
