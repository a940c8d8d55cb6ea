//! Float weights (f32, f16, bf16) against many activation rows, on AVX-512.
//!
//! A task's weight rows are converted to f32 once and packed in groups of
//! eight, so that each 512-bit vector holds eight elements of two rows; a
//! tile of 8 weight rows x 6 activation rows then loads 4 weight vectors
//! and 6 activation vectors (eight elements, repeated in both halves) per
//! 24 FMAs, where the 2 x 4 tiles of `float` load 6 per 8.
//!
//! Every output is summed exactly as `float::tile_f` sums it (lane j takes
//! elements j, j + 8, ... by FMA; then `hsum`; then the tail, multiplied
//! and added), so these tiles give the decode tiles' results bit for bit
//! and a row's output does not depend on the batch it came in.

// Tiles index accumulators by activation row and row pair.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::super::matmul::{Pack, Tile, PACK_MIN_ACT_ROWS};
use super::float::FloatW;
use super::hsum;

/// Weight rows per packed group and tile.
const RW: usize = 8;
/// Activation rows per tile: 24 accumulators, 4 weight vectors and an
/// activation vector fit AVX-512's 32 registers.
const RA: usize = 6;
/// Bytes of packed weights a task sweeps per activation tile: with the
/// tile's activation rows they stay in a 1 MiB L2.
const SWEEP_BYTES: usize = 512 << 10;

/// The packed kernel for weights read as `K`.
pub(super) fn pack<K: FloatW>() -> Pack {
    Pack { pack: pack_rows::<K>, block_bytes: 4, tile, rw: RW, ra: RA, partial: true, sub_bytes: SWEEP_BYTES, min_rows: PACK_MIN_ACT_ROWS }
}

/// Pack `rows` rows of `n` elements as f32 in groups of `RW` rows (the last
/// padded with zero rows), `RW * n` values a group: for each eight elements
/// 8q..8q + 8, rows 0..8's values back to back; then each row's tail
/// (elements `n / 8 * 8..n`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_rows<K: FloatW>(src: *const u8, stride: usize, rows: usize, n: usize, dst: *mut u8) {
    let dst = dst as *mut f32;
    let (n8, tail) = (n / 8 * 8, n % 8);
    for g in 0..rows.div_ceil(RW) {
        let out = dst.add(g * RW * n);
        for r in 0..RW {
            let row = g * RW + r;
            if row >= rows {
                for q in 0..n8 / 8 {
                    _mm256_storeu_ps(out.add(q * 8 * RW + 8 * r), _mm256_setzero_ps());
                }
                std::ptr::write_bytes(out.add(RW * n8 + r * tail), 0, tail);
                continue;
            }
            let p = src.add(row * stride);
            for q in 0..n8 / 8 {
                _mm256_storeu_ps(out.add(q * 8 * RW + 8 * r), K::load8(p, 8 * q));
            }
            for i in 0..tail {
                *out.add(RW * n8 + r * tail + i) = K::load1(p, n8 + i);
            }
        }
    }
}

/// `rw` (up to `RW`) rows of the packed group at `t.w` x `A` activation
/// rows.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn tile_body<const A: usize>(t: &Tile, rw: usize) {
    let w = t.w as *const f32;
    let n8 = t.n / 8 * 8;
    let a: [*const f32; A] = std::array::from_fn(|c| t.a.add(c * t.a_stride) as *const f32);
    // acc[c][p]: rows 2p (low half) and 2p + 1 (high half) x activation row c.
    let mut acc = [[_mm512_setzero_ps(); RW / 2]; A];
    for q in 0..n8 / 8 {
        let wq = w.add(q * 8 * RW);
        let wv: [__m512; RW / 2] = std::array::from_fn(|p| _mm512_loadu_ps(wq.add(16 * p)));
        for c in 0..A {
            let x8 = _mm256_loadu_ps(a[c].add(8 * q));
            // (The f64x4 forms are AVX-512 F; the f32x8 ones need DQ.)
            let x8d = _mm256_castps_pd(x8);
            let x = _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(x8d), x8d));
            for p in 0..RW / 2 {
                acc[c][p] = _mm512_fmadd_ps(wv[p], x, acc[c][p]);
            }
        }
    }
    let tail = t.n - n8;
    let wt = w.add(RW * n8);
    for c in 0..A {
        // Constant indices only, so the accumulators stay in registers.
        let mut s = [0f32; RW];
        for p in 0..RW / 2 {
            s[2 * p] = hsum(_mm512_castps512_ps256(acc[c][p]));
            s[2 * p + 1] = hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[c][p]))));
        }
        for r in 0..rw {
            for i in 0..tail {
                s[r] += *wt.add(r * tail + i) * *a[c].add(n8 + i);
            }
            *t.out.add(c * t.out_stride + r) = s[r];
        }
    }
}

/// Any `rw <= RW`, `ra <= RA`. # Safety: as [`super::super::matmul::TileFn`].
unsafe fn tile(t: &Tile, rw: usize, ra: usize) {
    match ra {
        1 => tile_body::<1>(t, rw),
        2 => tile_body::<2>(t, rw),
        3 => tile_body::<3>(t, rw),
        4 => tile_body::<4>(t, rw),
        5 => tile_body::<5>(t, rw),
        6 => tile_body::<6>(t, rw),
        _ => unreachable!("float512 tile of {ra} activation rows"),
    }
}
