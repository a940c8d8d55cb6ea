//! Float weights (f32, f16, bf16) in 2 x 4 tiles of f32 FMAs.

// Tiles index accumulators by row and column.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::super::matmul::Tile;
use super::{h2f, hsum, prefetch};

pub(super) trait FloatW {
    const BYTES: usize;
    /// # Safety: AVX2+FMA+F16C available; 8 elements at `p` + i readable.
    unsafe fn load8(p: *const u8, i: usize) -> __m256;
    /// # Safety: element i readable.
    unsafe fn load1(p: *const u8, i: usize) -> f32;
}

pub(super) struct F32W;
pub(super) struct F16W;
pub(super) struct Bf16W;

impl FloatW for F32W {
    const BYTES: usize = 4;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8, i: usize) -> __m256 {
        _mm256_loadu_ps((p as *const f32).add(i))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load1(p: *const u8, i: usize) -> f32 {
        (p as *const f32).add(i).read_unaligned()
    }
}

impl FloatW for F16W {
    const BYTES: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8, i: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i) as *const __m128i))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load1(p: *const u8, i: usize) -> f32 {
        h2f(p.add(2 * i))
    }
}

impl FloatW for Bf16W {
    const BYTES: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8, i: usize) -> __m256 {
        let h = _mm_loadu_si128(p.add(2 * i) as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load1(p: *const u8, i: usize) -> f32 {
        let h = (p.add(2 * i) as *const u16).read_unaligned();
        f32::from_bits((h as u32) << 16)
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile_f<K: FloatW, const RW: usize, const RA: usize>(t: &Tile) {
    let mut acc = [[_mm256_setzero_ps(); RA]; RW];
    let n8 = t.n / 8 * 8;
    for i in (0..n8).step_by(8) {
        let mut wv = [_mm256_setzero_ps(); RW];
        for (r, v) in wv.iter_mut().enumerate() {
            *v = K::load8(t.w.add(r * t.w_stride), i);
            if RA == 1 && i % (64 / K::BYTES) == 0 {
                prefetch(t.w.wrapping_add((RW + r) * t.w_stride + i * K::BYTES));
            }
        }
        for c in 0..RA {
            let xv = _mm256_loadu_ps((t.a.add(c * t.a_stride) as *const f32).add(i));
            for r in 0..RW {
                acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
            }
        }
    }
    for c in 0..RA {
        let x = t.a.add(c * t.a_stride) as *const f32;
        for r in 0..RW {
            let w = t.w.add(r * t.w_stride);
            let mut s = hsum(acc[r][c]);
            for i in n8..t.n {
                s += K::load1(w, i) * *x.add(i);
            }
            *t.out.add(c * t.out_stride + r) = s;
        }
    }
}
