//! Eight weight rows at a time for the K-quants (Q4_K, Q5_K, Q6_K): the
//! tiles and their packing (see the parent module).

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::*;

//
// As for the 32-element types, one f32 lane per output row: over the
// super-blocks b in order `acc = fma(iacc_b, d_b * d_a, acc)` and
// `off = fma(msum_b, dm_b * d_a, off)`, then `acc - off`, where
// `iacc_b = sum(scale * q * a)` and `msum_b = sum(min_g * bsum_g)` are exact
// integers (Q6_K's offset of 32 rides on the mins: `min_g = 32 * scale_g`,
// `dm = d`). Matvec tiles form them per row from the file's blocks; prefill
// tiles from rows packed by `pack_rows8k`.

/// Eight rows' unpacked super-block: 64 vectors (vector k: row r's values
/// 4k..4k+4 in lane r), 16 vectors of i32 scales (per 16 values, lane r),
/// 8 vectors of i16 min pairs (vector p, lane r: the mins of groups 2p and
/// 2p+1), then d and dm as f32.
const R8K_BYTES: usize = 64 * 32 + 16 * 32 + 8 * 32 + 2 * 32;

/// Pack `rows` rows of `nb` super-blocks of a K-quant (T = 4, 5 or 6) into
/// groups of eight rows (the last padded with zero rows).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_rows8k<const T: u8>(src: *const u8, stride: usize, rows: usize, nb: usize, dst: *mut u8) {
    let bytes = match T {
        4 => 144,
        5 => 176,
        _ => 210,
    };
    let zero: XK = std::mem::zeroed();
    for g in 0..rows.div_ceil(8) {
        let n = (rows - 8 * g).min(8);
        for b in 0..nb {
            // One row at a time into the one-row layout, then transposed.
            let mut xk = [zero; 8];
            for (r, x) in xk.iter_mut().enumerate().take(n) {
                let p = src.add((8 * g + r) * stride + b * bytes);
                for l in (0..bytes).step_by(64) {
                    prefetch(p.wrapping_add(8 * stride + l));
                }
                pack_k::<T>(p, 0, 1, 1, x as *mut XK as *mut u8);
            }
            let o = dst.add((g * nb + b) * R8K_BYTES);
            for s in 0..8 {
                let mut v = [_mm256_setzero_si256(); 8];
                for r in 0..8 {
                    v[r] = _mm256_loadu_si256(xk[r].q.as_ptr().add(32 * s) as *const __m256i);
                }
                transpose8(&mut v);
                for k in 0..8 {
                    _mm256_storeu_si256(o.add(32 * (8 * s + k)) as *mut __m256i, v[k]);
                }
            }
            let sc = o.add(2048) as *mut i32;
            let mins = o.add(2560) as *mut i16;
            let dd = o.add(2816) as *mut f32;
            for r in 0..8 {
                for gi in 0..16 {
                    *sc.add(8 * gi + r) = xk[r].scv[gi / 2][8 * (gi % 2)] as i32;
                }
                for p in 0..8 {
                    *mins.add(16 * p + 2 * r) = xk[r].mins[2 * p];
                    *mins.add(16 * p + 2 * r + 1) = xk[r].mins[2 * p + 1];
                }
                *dd.add(r) = xk[r].d;
                *dd.add(8 + r) = xk[r].dm;
            }
        }
    }
}

/// Up to eight packed K-quant rows x `RA` activation rows; `G16`: scales
/// per 16 values (Q6_K), else per 32.
#[inline(always)]
unsafe fn tile_r8k_packed_body<D: DotAcc, const G16: bool, const RA: usize>(t: &Tile, rw: usize) {
    let mut acc = [_mm256_setzero_ps(); RA];
    let mut off = [_mm256_setzero_ps(); RA];
    let (groups, chunks) = if G16 { (16, 4) } else { (8, 8) };
    for b in 0..t.n {
        let p = t.w.add(b * R8K_BYTES);
        let mut ab = [std::ptr::null::<Q8KA>(); RA];
        for (c, a) in ab.iter_mut().enumerate() {
            *a = (t.a.add(c * t.a_stride) as *const Q8KA).add(b);
        }
        let mut iacc = [_mm256_setzero_si256(); RA];
        for gi in 0..groups {
            let mut isum = [_mm256_setzero_si256(); RA];
            for k in chunks * gi..chunks * (gi + 1) {
                let w = _mm256_loadu_si256(p.add(32 * k) as *const __m256i);
                for c in 0..RA {
                    let a4 = ((*ab[c]).qs.as_ptr().add(4 * k) as *const i32).read_unaligned();
                    isum[c] = D::dot_acc(isum[c], w, _mm256_set1_epi32(a4));
                }
            }
            // Per-32 scales sit in every other slot (both 16-halves share one).
            let slot = if G16 { gi } else { 2 * gi };
            let sv = _mm256_loadu_si256(p.add(2048 + 32 * slot) as *const __m256i);
            for c in 0..RA {
                iacc[c] = _mm256_add_epi32(iacc[c], _mm256_mullo_epi32(isum[c], sv));
            }
        }
        let mut msum = [_mm256_setzero_si256(); RA];
        for q in 0..8 {
            let mv = _mm256_loadu_si256(p.add(2560 + 32 * q) as *const __m256i);
            for c in 0..RA {
                let bs = ((*ab[c]).bsums.as_ptr().add(2 * q) as *const i32).read_unaligned();
                msum[c] = _mm256_add_epi32(msum[c], _mm256_madd_epi16(mv, _mm256_set1_epi32(bs)));
            }
        }
        let d = _mm256_loadu_ps(p.add(2816) as *const f32);
        let dm = _mm256_loadu_ps(p.add(2848) as *const f32);
        for c in 0..RA {
            let da = _mm256_set1_ps((*ab[c]).d);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[c]), _mm256_mul_ps(d, da), acc[c]);
            off[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum[c]), _mm256_mul_ps(dm, da), off[c]);
        }
    }
    for c in 0..RA {
        store_lanes(t.out.add(c * t.out_stride), _mm256_sub_ps(acc[c], off[c]), rw);
    }
}

/// One row's super-block from the file: its integer sums against `RA`
/// activation blocks (eight partial lanes each), its mins, d and dm.
#[inline(always)]
unsafe fn row_k<const T: u8, const RA: usize>(p: *const u8, ab: &[*const Q8KA; RA], iv: &mut [__m256i; RA], mins: &mut [i16; 16]) -> (f32, f32) {
    if T == 6 {
        let sc = p.add(192) as *const i8;
        for h in 0..2 {
            let q = q6k_half(p, h);
            for g in 0..4 {
                let gi = 8 * h + 2 * g;
                let scv = _mm256_setr_m128i(_mm_set1_epi16(*sc.add(gi) as i16), _mm_set1_epi16(*sc.add(gi + 1) as i16));
                for c in 0..RA {
                    let a = _mm256_loadu_si256((*ab[c]).qs.as_ptr().add(128 * h + 32 * g) as *const __m256i);
                    iv[c] = _mm256_add_epi32(iv[c], _mm256_madd_epi16(_mm256_maddubs_epi16(q[g], a), scv));
                }
            }
        }
        for g in 0..16 {
            mins[g] = 32 * *sc.add(g) as i16;
        }
        let d = h2f(p.add(208));
        (d, d)
    } else {
        let s = std::slice::from_raw_parts(p.add(4), 12);
        for j in 0..4 {
            let (lo, hi) = k45_groups::<T>(p, j);
            let (s0, m0) = k4_scale_min(s, 2 * j);
            let (s1, m1) = k4_scale_min(s, 2 * j + 1);
            let (sv0, sv1) = (_mm256_set1_epi16(s0 as i16), _mm256_set1_epi16(s1 as i16));
            for c in 0..RA {
                let a0 = _mm256_loadu_si256((*ab[c]).qs.as_ptr().add(64 * j) as *const __m256i);
                let a1 = _mm256_loadu_si256((*ab[c]).qs.as_ptr().add(64 * j + 32) as *const __m256i);
                let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), sv0);
                let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), sv1);
                iv[c] = _mm256_add_epi32(iv[c], _mm256_add_epi32(p0, p1));
            }
            mins[4 * j] = m0 as i16;
            mins[4 * j + 1] = m0 as i16;
            mins[4 * j + 2] = m1 as i16;
            mins[4 * j + 3] = m1 as i16;
        }
        (h2f(p), h2f(p.add(2)))
    }
}

/// Up to eight rows of a K-quant (T = 4, 5 or 6) from the file's blocks x
/// `RA` activation rows.
#[inline(always)]
unsafe fn tile_r8k_raw_body<const T: u8, const RA: usize>(t: &Tile, rw: usize) {
    let bytes = match T {
        4 => 144,
        5 => 176,
        _ => 210,
    };
    let mut acc = [_mm256_setzero_ps(); RA];
    let mut off = [_mm256_setzero_ps(); RA];
    let mut wr = [t.w; 8];
    for (r, p) in wr.iter_mut().enumerate() {
        *p = t.w.add(r.min(rw - 1) * t.w_stride);
    }
    for b in 0..t.n {
        let mut ab = [std::ptr::null::<Q8KA>(); RA];
        for (c, a) in ab.iter_mut().enumerate() {
            *a = (t.a.add(c * t.a_stride) as *const Q8KA).add(b);
        }
        let mut iv = [[_mm256_setzero_si256(); 8]; RA];
        let mut ms = [[0i32; 8]; RA];
        let mut d = [0f32; 8];
        let mut dm = [0f32; 8];
        for r in 0..8 {
            let p = wr[r].add(b * bytes);
            let next = p.wrapping_add(16 * t.w_stride);
            for l in (0..bytes).step_by(64) {
                prefetch(next.wrapping_add(l));
            }
            let mut v = [_mm256_setzero_si256(); RA];
            let mut mins = [0i16; 16];
            (d[r], dm[r]) = row_k::<T, RA>(p, &ab, &mut v, &mut mins);
            let mv = _mm256_loadu_si256(mins.as_ptr() as *const __m256i);
            for c in 0..RA {
                iv[c][r] = v[c];
                let bs = _mm256_loadu_si256((*ab[c]).bsums.as_ptr() as *const __m256i);
                ms[c][r] = hsum_i32(_mm256_madd_epi16(mv, bs));
            }
        }
        let dv = _mm256_loadu_ps(d.as_ptr());
        let dmv = _mm256_loadu_ps(dm.as_ptr());
        for c in 0..RA {
            let da = _mm256_set1_ps((*ab[c]).d);
            let iacc = reduce8(&iv[c]);
            let msum = _mm256_loadu_si256(ms[c].as_ptr() as *const __m256i);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc), _mm256_mul_ps(dv, da), acc[c]);
            off[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmv, da), off[c]);
        }
    }
    for c in 0..RA {
        store_lanes(t.out.add(c * t.out_stride), _mm256_sub_ps(acc[c], off[c]), rw);
    }
}

/// Packed tiles of up to eight weight rows x each activation row count of
/// `[$ra]` (AVX-512's 32 registers hold wider ones).
macro_rules! r8k_tiles {
    ($packed:ident, $dot:ty, $feat:literal, [$($ra:literal)*]) => {
        #[target_feature(enable = $feat)]
        unsafe fn $packed<const G16: bool>(t: &Tile, rw: usize, ra: usize) {
            match ra {
                $($ra => tile_r8k_packed_body::<$dot, G16, $ra>(t, rw),)*
                _ => unreachable!("packed K-quant tile of {ra} activation rows"),
            }
        }
    };
}

r8k_tiles!(r8k_packed, MaddDot, "avx2,fma,f16c", [1 2 3]);
r8k_tiles!(r8k_packed_vnni, VnniDot, "avx2,fma,f16c,avxvnni", [1 2 3]);
r8k_tiles!(r8k_packed_vnni512, Vnni512Dot, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", [1 2 3 4 5 6]);

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn r8k_raw<const T: u8>(t: &Tile, rw: usize, ra: usize) {
    match ra {
        1 => tile_r8k_raw_body::<T, 1>(t, rw),
        2 => tile_r8k_raw_body::<T, 2>(t, rw),
        _ => tile_r8k_raw_body::<T, 3>(t, rw),
    }
}

/// As `r8k_raw`, with AVX-512's 32 registers: up to eight activation rows
/// (a shared round's few) per unpacked weight block.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn r8k_raw512<const T: u8>(t: &Tile, rw: usize, ra: usize) {
    match ra {
        1 => tile_r8k_raw_body::<T, 1>(t, rw),
        2 => tile_r8k_raw_body::<T, 2>(t, rw),
        3 => tile_r8k_raw_body::<T, 3>(t, rw),
        4 => tile_r8k_raw_body::<T, 4>(t, rw),
        5 => tile_r8k_raw_body::<T, 5>(t, rw),
        6 => tile_r8k_raw_body::<T, 6>(t, rw),
        7 => tile_r8k_raw_body::<T, 7>(t, rw),
        _ => tile_r8k_raw_body::<T, 8>(t, rw),
    }
}

/// The eight-row kernel of a K-quant (T = 4, 5 or 6).
pub(super) fn r8k_kernel<const T: u8>(vnni: Vnni) -> Kernel {
    let packed: TileFn = match (T == 6, vnni) {
        (true, Vnni::Vex) => r8k_packed_vnni::<true>,
        (false, Vnni::Vex) => r8k_packed_vnni::<false>,
        (true, Vnni::Evex) => r8k_packed_vnni512::<true>,
        (false, Vnni::Evex) => r8k_packed_vnni512::<false>,
        (true, Vnni::None) => r8k_packed::<true>,
        (false, Vnni::None) => r8k_packed::<false>,
    };
    let ra_packed = if vnni == Vnni::Evex { 6 } else { 3 };
    // With AVX-VNNI (VEX) packing pays from 10 rows (the bench's `few`,
    // 4096² on 2 threads: Q4_K at 12 rows 2,520 -> 2,218 µs, Q6_K 2,996 ->
    // 2,614; at 6 rows both lost a third). Elsewhere not measured: 16.
    let min_rows = if vnni == Vnni::Vex { 10 } else { PACK_MIN_ACT_ROWS };
    let pack = Pack { pack: pack_rows8k::<T>, block_bytes: R8K_BYTES / 8, tile: packed, rw: 8, ra: ra_packed, partial: true, sub_bytes: SUB_BYTES, min_rows };
    let (raw, ra): (TileFn, usize) = if vnni == Vnni::Evex { (r8k_raw512::<T>, 8) } else { (r8k_raw::<T>, 3) };
    Kernel { tile: raw, rw: 8, ra, rw_gemv: 8, pack: Some(pack), partial: true }
}
