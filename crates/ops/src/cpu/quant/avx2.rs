//! AVX2 + FMA + F16C tiles.
//!
//! Integer dot products: weights unpacked to unsigned bytes (or signed
//! bytes and their absolute values, for Q8_0), multiplied with the signed
//! activation bytes by `maddubs` (u8 x i8 -> pairs summed to i16; the
//! operand ranges here never saturate it), widened to i32 by `madd`, and
//! scaled into f32 accumulators once per block. Each tile unpacks a
//! weight block once and uses it for all of its activation rows.
//!
//! The quantized types (Q4_0 .. Q8_1 and Q4_K, Q5_K, Q6_K) run eight
//! weight rows at a time with one f32 lane per row (see `pack_rows8`,
//! `pack_rows8k`): prefill packs the rows transposed, so each `dpbusd`
//! serves eight rows against one broadcast group of four activation bytes
//! and there are no horizontal sums at all; matvecs read the file's blocks
//! and reduce exact integer block sums. Float weights use 2 x 4 tiles.

// Tiles index several same-shaped arrays (accumulators, unpacked rows) by
// row and column; iterator chains would only obscure that.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::blocks::{k4_scale_min, Q8A, Q8KA};
use super::matmul::{Kernel, Pack, Tile, TileFn, PACK_MIN_ACT_ROWS, SUB_BYTES};
use braid_formats::DType;
use float::{tile_f, Bf16W, F16W, F32W};

mod float;
mod float512;
mod gemv512;
mod kquant;

use kquant::r8k_kernel;

/// Dispatch `rw x ra` to the instances built for this kernel; any other
/// shape runs as 1x1 tiles.
macro_rules! tiles {
    ($name:ident, $f:ident $(:: < $($g:ty),* >)?, $RW:literal, $RA:literal, $RWG:literal) => {
        unsafe fn $name(t: &Tile, rw: usize, ra: usize) {
            if rw == $RW && ra == $RA {
                $f::<$($($g,)*)? $RW, $RA>(t)
            } else if rw == 1 && ra == $RA {
                $f::<$($($g,)*)? 1, $RA>(t)
            } else if rw == $RWG && ra == 1 {
                $f::<$($($g,)*)? $RWG, 1>(t)
            } else {
                for c in 0..ra {
                    for r in 0..rw {
                        let one = Tile {
                            dtype: t.dtype,
                            w: t.w.add(r * t.w_stride),
                            w_stride: t.w_stride,
                            a: t.a.add(c * t.a_stride),
                            a_stride: t.a_stride,
                            n: t.n,
                            out: t.out.add(c * t.out_stride + r),
                            out_stride: t.out_stride,
                        };
                        $f::<$($($g,)*)? 1, 1>(&one)
                    }
                }
            }
        }
    };
}

tiles!(t_f32, tile_f::<F32W>, 2, 4, 4);
tiles!(t_f16, tile_f::<F16W>, 2, 4, 4);
tiles!(t_bf16, tile_f::<Bf16W>, 2, 4, 4);

/// Which `vpdpbusd` the integer tiles use, if any: AVX-VNNI's (VEX), or
/// AVX512-VNNI's on 256-bit registers (EVEX; AMD Zen 4 has this one and not
/// the other). Both compute the same sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Vnni {
    None,
    Vex,
    Evex,
}

/// The AVX2 kernel for `dtype` (with `vnni`'s dots), if there is one (else
/// the scalar one runs).
pub(crate) fn kernel(dtype: DType, vnni: Vnni) -> Option<Kernel> {
    match dtype {
        DType::Q4_0 => Some(r8_kernel::<Q40>(vnni)),
        DType::Q4_1 => Some(r8_kernel::<Q41>(vnni)),
        DType::Q5_0 => Some(r8_kernel::<Q50>(vnni)),
        DType::Q5_1 => Some(r8_kernel::<Q51>(vnni)),
        DType::Q8_0 => Some(r8_kernel::<Q80>(vnni)),
        DType::Q8_1 => Some(r8_kernel::<Q81>(vnni)),
        DType::Q4K => Some(r8k_kernel::<4>(vnni)),
        DType::Q5K => Some(r8k_kernel::<5>(vnni)),
        DType::Q6K => Some(r8k_kernel::<6>(vnni)),
        DType::F32 => float_kernel(t_f32, float512::pack::<F32W>, vnni),
        DType::F16 => float_kernel(t_f16, float512::pack::<F16W>, vnni),
        DType::BF16 => float_kernel(t_bf16, float512::pack::<Bf16W>, vnni),
        DType::Q2K | DType::Q3K | DType::Q8K => None,
    }
}

/// Float weights: 2 x 4 dot tiles, and where AVX-512 is at hand (it is
/// with EVEX VNNI) the packed tiles of `float512` for many activation rows.
fn float_kernel(tile: TileFn, pack: fn() -> Pack, vnni: Vnni) -> Option<Kernel> {
    let pack = (vnni == Vnni::Evex).then(pack);
    Some(Kernel { tile, rw: 2, ra: 4, rw_gemv: 4, pack, partial: false })
}

// ---- helpers ----

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The f16 at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn h2f(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Sum of `q[i] * a[i]` (u8 x i8) in 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_u8(q: __m256i, a: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), _mm256_set1_epi16(1))
}

/// 32 bytes of `0x10` where bit j of `bits` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bits_to_0x10(bits: u32) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    // Byte j takes the source byte holding bit j (j / 8); within a 128-bit
    // lane the broadcast makes every source byte available.
    let spread = _mm256_shuffle_epi8(
        v,
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        ),
    );
    let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// 16 packed bytes at `p` to 32 nibbles: low nibbles first, then high.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let raw = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// Q6_K's values (0..63) of half `h` of the super-block at `p`: four
/// vectors of 32, groups `4h .. 4h + 4` of 32 values in order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_half(p: *const u8, h: usize) -> [__m256i; 4] {
    let (m4, m2) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x03));
    let l0 = _mm256_loadu_si256(p.add(64 * h) as *const __m256i);
    let l1 = _mm256_loadu_si256(p.add(64 * h + 32) as *const __m256i);
    let hb = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
    let hi = |v: __m256i| _mm256_slli_epi16(_mm256_and_si256(v, m2), 4);
    [
        _mm256_or_si256(_mm256_and_si256(l0, m4), hi(hb)),
        _mm256_or_si256(_mm256_and_si256(l1, m4), hi(_mm256_srli_epi16(hb, 2))),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), hi(_mm256_srli_epi16(hb, 4))),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), hi(_mm256_srli_epi16(hb, 6))),
    ]
}

/// Q4_K's (`T` 4) or Q5_K's (5) values of groups `2j` and `2j + 1` of the
/// super-block at `p`: 32 values each, unsigned.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k45_groups<const T: u8>(p: *const u8, j: usize) -> (__m256i, __m256i) {
    let m4 = _mm256_set1_epi8(0x0f);
    let qs = p.add(if T == 4 { 16 } else { 48 });
    let raw = _mm256_loadu_si256(qs.add(32 * j) as *const __m256i);
    let lo = _mm256_and_si256(raw, m4);
    let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    if T != 5 {
        return (lo, hi);
    }
    let qh = _mm256_loadu_si256(p.add(16) as *const __m256i);
    let x10 = _mm256_set1_epi8(0x10);
    let bit = |b: __m256i| _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b), b), x10);
    let b0 = _mm256_set1_epi8(1 << (2 * j));
    let b1 = _mm256_set1_epi8((2 << (2 * j)) as u8 as i8);
    (_mm256_or_si256(lo, bit(b0)), _mm256_or_si256(hi, bit(b1)))
}

/// Matvecs stream weights from memory; the hardware prefetcher follows
/// the few rows of a tile, but starts late on each new tile. Fetching the
/// bytes two tiles on (same offset) keeps DRAM busy. Into L2, not L1: on
/// the AMD EPYC these machines have, T0 prefetches (one per row and block)
/// left Gemma 3's Q8_0 head matvec at 8 GB/s on one core, T1 at 19 GB/s
/// (`cargo bench -p braid-ops --bench matmul`, head). Prefetch never
/// faults, so running past the matrix is harmless.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T1>(p as *const i8);
}

// ---- 32-element block types ----

/// An unpacked 32-element weight block: `q` (unsigned values, or signed
/// for Q8 with `abs` their magnitudes), the scale and the offset factor
/// (value = d*q + m, where m multiplies the activation block's `s`).
#[derive(Clone, Copy)]
struct W32 {
    q: __m256i,
    abs: __m256i,
    d: f32,
    m: f32,
}

trait B32 {
    const BYTES: usize;
    /// q is signed (use the sign trick) rather than unsigned.
    const SIGNED: bool;
    /// Has an offset term.
    const OFFSET: bool;
    /// The offset factor is stored (f16, after d, as Q4_1 and Q5_1 keep
    /// it); else it is `M_OF_D * d`.
    const M_STORED: bool = false;
    const M_OF_D: f32 = 0.0;
    /// # Safety: AVX2+FMA+F16C available; `p` points at a whole block.
    unsafe fn unpack(p: *const u8) -> W32;
    /// As `unpack`, where AVX-512 BW's byte masks are at hand (the 512-bit
    /// matvec tile). # Safety: as `unpack`, and AVX-512 BW + VL available.
    #[inline(always)]
    unsafe fn unpack_bw(p: *const u8) -> W32 {
        Self::unpack(p)
    }
}

struct Q40;
struct Q41;
struct Q50;
struct Q51;
struct Q80;
struct Q81;

impl B32 for Q40 {
    const BYTES: usize = 18;
    const SIGNED: bool = false;
    const OFFSET: bool = true;
    const M_OF_D: f32 = -8.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W32 {
        let q = nibbles32(p.add(2));
        let d = h2f(p);
        W32 { q, abs: q, d, m: Self::M_OF_D * d }
    }
}

impl B32 for Q41 {
    const BYTES: usize = 20;
    const SIGNED: bool = false;
    const OFFSET: bool = true;
    const M_STORED: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W32 {
        let q = nibbles32(p.add(4));
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
        let d = _mm_cvtss_f32(dm);
        let m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
        W32 { q, abs: q, d, m }
    }
}

impl B32 for Q50 {
    const BYTES: usize = 22;
    const SIGNED: bool = false;
    const OFFSET: bool = true;
    const M_OF_D: f32 = -16.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W32 {
        let qh = (p.add(2) as *const u32).read_unaligned();
        let q = _mm256_or_si256(nibbles32(p.add(6)), bits_to_0x10(qh));
        let d = h2f(p);
        W32 { q, abs: q, d, m: Self::M_OF_D * d }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn unpack_bw(p: *const u8) -> W32 {
        let qh = (p.add(2) as *const u32).read_unaligned();
        let q = _mm256_or_si256(nibbles32(p.add(6)), _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10)));
        let d = h2f(p);
        W32 { q, abs: q, d, m: Self::M_OF_D * d }
    }
}

impl B32 for Q51 {
    const BYTES: usize = 24;
    const SIGNED: bool = false;
    const OFFSET: bool = true;
    const M_STORED: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W32 {
        let qh = (p.add(4) as *const u32).read_unaligned();
        let q = _mm256_or_si256(nibbles32(p.add(8)), bits_to_0x10(qh));
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
        let d = _mm_cvtss_f32(dm);
        let m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
        W32 { q, abs: q, d, m }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn unpack_bw(p: *const u8) -> W32 {
        let qh = (p.add(4) as *const u32).read_unaligned();
        let q = _mm256_or_si256(nibbles32(p.add(8)), _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10)));
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
        let d = _mm_cvtss_f32(dm);
        let m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
        W32 { q, abs: q, d, m }
    }
}

impl B32 for Q80 {
    const BYTES: usize = 34;
    const SIGNED: bool = true;
    const OFFSET: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W32 {
        let q = _mm256_loadu_si256(p.add(2) as *const __m256i);
        W32 { q, abs: _mm256_sign_epi8(q, q), d: h2f(p), m: 0.0 }
    }
}

impl B32 for Q81 {
    const BYTES: usize = 36;
    const SIGNED: bool = true;
    const OFFSET: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W32 {
        let q = _mm256_loadu_si256(p.add(4) as *const __m256i);
        W32 { q, abs: _mm256_sign_epi8(q, q), d: h2f(p), m: 0.0 }
    }
}

/// How a tile multiplies 32 unsigned bytes by 32 signed ones into 8 i32
/// sums of 4: `maddubs` + `madd`, or one `dpbusd` (AVX-VNNI, or AVX512-VNNI
/// on a 256-bit register).
trait Dot {
    /// # Safety: the CPU has the instructions used.
    unsafe fn dot(q: __m256i, a: __m256i) -> __m256i;
}
struct MaddDot;
struct VnniDot;
struct Vnni512Dot;
impl Dot for MaddDot {
    #[inline(always)]
    unsafe fn dot(q: __m256i, a: __m256i) -> __m256i {
        dot_u8(q, a)
    }
}
impl Dot for VnniDot {
    #[inline(always)]
    unsafe fn dot(q: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, a)
    }
}
impl Dot for Vnni512Dot {
    #[inline(always)]
    unsafe fn dot(q: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, a)
    }
}

// ---- K-quants ----

/// One row's K-quant super-block unpacked (the step before `pack_rows8k`
/// transposes eight of them): the 256 values as bytes
/// (unsigned), a ready `madd` scale vector per 32 values (i16 lanes; for
/// Q6_K the two 16-groups' scales in the two halves), and the offset as
/// weights of the activation's 16-sums times `dm`:
/// value . a = d * sum(scv * q * a) - dm * sum(mins * bsums).
#[derive(Clone, Copy)]
#[repr(C)]
struct XK {
    q: [u8; 256],
    scv: [[i16; 16]; 8],
    mins: [i16; 16],
    d: f32,
    dm: f32,
}

/// Unpack rows of Q4_K (T = 4), Q5_K (5) or Q6_K (6) super-blocks into
/// [`XK`]s. The values, scales and mins are the integers the matvec tiles
/// (`row_k`) use, so results are bit-identical.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_k<const T: u8>(src: *const u8, stride: usize, rows: usize, nb: usize, dst: *mut u8) {
    let bytes = match T {
        4 => 144,
        5 => 176,
        _ => 210,
    };
    for r in 0..rows {
        for b in 0..nb {
            let p = src.add(r * stride + b * bytes);
            let o = &mut *(dst.add((r * nb + b) * std::mem::size_of::<XK>()) as *mut XK);
            let qo = o.q.as_mut_ptr();
            if T == 6 {
                for h in 0..2 {
                    for (g, v) in q6k_half(p, h).iter().enumerate() {
                        _mm256_storeu_si256(qo.add(128 * h + 32 * g) as *mut __m256i, *v);
                    }
                }
                let sc = p.add(192) as *const i8;
                for g in 0..16 {
                    let s = *sc.add(g) as i16;
                    o.scv[g / 2][8 * (g % 2)..8 * (g % 2) + 8].fill(s);
                    o.mins[g] = 32 * s;
                }
                o.d = h2f(p.add(208));
                o.dm = o.d;
            } else {
                for j in 0..4 {
                    let (lo, hi) = k45_groups::<T>(p, j);
                    _mm256_storeu_si256(qo.add(64 * j) as *mut __m256i, lo);
                    _mm256_storeu_si256(qo.add(64 * j + 32) as *mut __m256i, hi);
                }
                let s = std::slice::from_raw_parts(p.add(4), 12);
                for j in 0..8 {
                    let (sc, m) = k4_scale_min(s, j);
                    _mm256_storeu_si256(o.scv[j].as_mut_ptr() as *mut __m256i, _mm256_set1_epi16(sc as i16));
                    o.mins[2 * j] = m as i16;
                    o.mins[2 * j + 1] = m as i16;
                }
                o.d = h2f(p);
                o.dm = h2f(p.add(2));
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

// ---- eight weight rows at a time, for the unsigned 32-element types ----
//
// Each output is `acc + off`, where over the blocks b in order
// `acc = fma(isum_b, d_b * d_a, acc)` and `off = fma(m_b, s_a, off)`: one f32
// lane per output row, so a vector holds eight rows' outputs and no
// horizontal sums are needed. The integer block sums `isum_b` are exact
// however they are formed, so the matvec tiles (reading the file's blocks)
// and the prefill tiles (reading rows packed by `pack_rows8`) give
// bit-identical results.

/// Eight rows' unpacked block: vector k holds, in 32-bit lane r, row r's
/// values 4k..4k+4 (bytes); then the rows' d and m as f32.
const R8_BYTES: usize = 8 * 32 + 2 * 32;

/// How tiles form 32 u8 x i8 products summed in fours, added to `acc`.
trait DotAcc {
    /// The four products are summed in i32 (VNNI's `dpbusd`), not in i16
    /// as `maddubs` does, so u8 values up to 255 cannot saturate.
    const WIDE: bool = false;
    /// # Safety: the CPU has the instructions used.
    unsafe fn dot_acc(acc: __m256i, q: __m256i, a: __m256i) -> __m256i;
}
impl DotAcc for MaddDot {
    #[inline(always)]
    unsafe fn dot_acc(acc: __m256i, q: __m256i, a: __m256i) -> __m256i {
        _mm256_add_epi32(acc, dot_u8(q, a))
    }
}
impl DotAcc for VnniDot {
    const WIDE: bool = true;
    #[inline(always)]
    unsafe fn dot_acc(acc: __m256i, q: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(acc, q, a)
    }
}
impl DotAcc for Vnni512Dot {
    const WIDE: bool = true;
    #[inline(always)]
    unsafe fn dot_acc(acc: __m256i, q: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, q, a)
    }
}

/// Transpose eight vectors of eight 32-bit lanes.
#[inline(always)]
unsafe fn transpose8(v: &mut [__m256i; 8]) {
    let t0 = _mm256_unpacklo_epi32(v[0], v[1]);
    let t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    let t2 = _mm256_unpacklo_epi32(v[2], v[3]);
    let t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    let t4 = _mm256_unpacklo_epi32(v[4], v[5]);
    let t5 = _mm256_unpackhi_epi32(v[4], v[5]);
    let t6 = _mm256_unpacklo_epi32(v[6], v[7]);
    let t7 = _mm256_unpackhi_epi32(v[6], v[7]);
    let u0 = _mm256_unpacklo_epi64(t0, t2);
    let u1 = _mm256_unpackhi_epi64(t0, t2);
    let u2 = _mm256_unpacklo_epi64(t1, t3);
    let u3 = _mm256_unpackhi_epi64(t1, t3);
    let u4 = _mm256_unpacklo_epi64(t4, t6);
    let u5 = _mm256_unpackhi_epi64(t4, t6);
    let u6 = _mm256_unpacklo_epi64(t5, t7);
    let u7 = _mm256_unpackhi_epi64(t5, t7);
    v[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
    v[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
    v[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
    v[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
    v[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
    v[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    v[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
    v[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

/// Lane r of the result is the sum of the eight lanes of `v[r]`.
#[inline(always)]
unsafe fn reduce8(v: &[__m256i; 8]) -> __m256i {
    let t0 = _mm256_hadd_epi32(v[0], v[1]);
    let t1 = _mm256_hadd_epi32(v[2], v[3]);
    let t2 = _mm256_hadd_epi32(v[4], v[5]);
    let t3 = _mm256_hadd_epi32(v[6], v[7]);
    let u0 = _mm256_hadd_epi32(t0, t1); // rows 0-3: low-half sums | high-half sums
    let u1 = _mm256_hadd_epi32(t2, t3); // rows 4-7
    let lo = _mm256_permute2x128_si256(u0, u1, 0x20);
    let hi = _mm256_permute2x128_si256(u0, u1, 0x31);
    _mm256_add_epi32(lo, hi)
}

/// Store the first `n` lanes of `v` at `p`.
#[inline(always)]
unsafe fn store_lanes(p: *mut f32, v: __m256, n: usize) {
    if n == 8 {
        _mm256_storeu_ps(p, v);
    } else {
        let mut tmp = [0f32; 8];
        _mm256_storeu_ps(tmp.as_mut_ptr(), v);
        std::ptr::copy_nonoverlapping(tmp.as_ptr(), p, n);
    }
}

/// Pack `rows` rows of `nb` blocks into groups of eight rows (the last
/// group padded with zero rows), `R8_BYTES` per group and block.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_rows8<K: B32>(src: *const u8, stride: usize, rows: usize, nb: usize, dst: *mut u8) {
    for g in 0..rows.div_ceil(8) {
        let n = (rows - 8 * g).min(8);
        for b in 0..nb {
            let mut q = [_mm256_setzero_si256(); 8];
            let mut d = [0f32; 8];
            let mut m = [0f32; 8];
            for r in 0..n {
                let p = src.add((8 * g + r) * stride + b * K::BYTES);
                prefetch(p.wrapping_add(8 * stride));
                let u = K::unpack(p);
                q[r] = u.q;
                d[r] = u.d;
                m[r] = u.m;
            }
            transpose8(&mut q);
            let o = dst.add((g * nb + b) * R8_BYTES);
            for (k, v) in q.iter().enumerate() {
                _mm256_storeu_si256(o.add(32 * k) as *mut __m256i, *v);
            }
            std::ptr::copy_nonoverlapping(d.as_ptr(), o.add(256) as *mut f32, 8);
            std::ptr::copy_nonoverlapping(m.as_ptr(), o.add(288) as *mut f32, 8);
        }
    }
}

/// Up to eight packed rows (`t.w` at their group) x `RA` activation rows.
/// `SIGNED` (Q8_0, Q8_1): the packed values are signed; each product is
/// taken as |w| times the activation with w's sign, and there is no offset.
#[inline(always)]
unsafe fn tile_r8_packed_body<D: DotAcc, const SIGNED: bool, const RA: usize>(t: &Tile, rw: usize) {
    let mut acc = [_mm256_setzero_ps(); RA];
    let mut off = [_mm256_setzero_ps(); RA];
    for b in 0..t.n {
        let p = t.w.add(b * R8_BYTES);
        let mut ab = [std::ptr::null::<Q8A>(); RA];
        for (c, a) in ab.iter_mut().enumerate() {
            *a = (t.a.add(c * t.a_stride) as *const Q8A).add(b);
        }
        let mut isum = [_mm256_setzero_si256(); RA];
        for k in 0..8 {
            let w = _mm256_loadu_si256(p.add(32 * k) as *const __m256i);
            let wa = if SIGNED { _mm256_sign_epi8(w, w) } else { w };
            for c in 0..RA {
                let a4 = _mm256_set1_epi32(((*ab[c]).qs.as_ptr().add(4 * k) as *const i32).read_unaligned());
                let a4 = if SIGNED { _mm256_sign_epi8(a4, w) } else { a4 };
                isum[c] = D::dot_acc(isum[c], wa, a4);
            }
        }
        let d = _mm256_loadu_ps(p.add(256) as *const f32);
        let m = _mm256_loadu_ps(p.add(288) as *const f32);
        for c in 0..RA {
            let s = _mm256_mul_ps(d, _mm256_set1_ps((*ab[c]).d));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), s, acc[c]);
            if !SIGNED {
                off[c] = _mm256_fmadd_ps(m, _mm256_set1_ps((*ab[c]).s), off[c]);
            }
        }
    }
    for c in 0..RA {
        store_lanes(t.out.add(c * t.out_stride), _mm256_add_ps(acc[c], off[c]), rw);
    }
}

/// Up to eight rows of the file's blocks (`t.w`, `t.w_stride`) x `RA`
/// activation rows.
#[inline(always)]
unsafe fn tile_r8_raw_body<D: Dot + DotAcc, K: B32, const RA: usize>(t: &Tile, rw: usize) {
    let mut acc = [_mm256_setzero_ps(); RA];
    let mut off = [_mm256_setzero_ps(); RA];
    // Rows past `rw` repeat the last one; their lanes are not stored.
    let mut wr = [t.w; 8];
    for (r, p) in wr.iter_mut().enumerate() {
        *p = t.w.add(r.min(rw - 1) * t.w_stride);
    }
    for b in 0..t.n {
        let mut q = [_mm256_setzero_si256(); 8];
        let mut qa = [_mm256_setzero_si256(); 8];
        let mut d = [0f32; 8];
        let mut m = [0f32; 8];
        for r in 0..8 {
            let p = wr[r].add(b * K::BYTES);
            // The block two row groups on: the hardware prefetcher follows
            // eight strided rows poorly, with one activation row or several.
            prefetch(p.wrapping_add(16 * t.w_stride));
            let u = K::unpack(p);
            q[r] = u.q;
            qa[r] = u.abs;
            d[r] = u.d;
            m[r] = u.m;
        }
        let dv = _mm256_loadu_ps(d.as_ptr());
        let mv = _mm256_loadu_ps(m.as_ptr());
        // Signed weights with i32 dots: biased to unsigned (`w ^ 0x80` is
        // `w + 128`) and `128 * sum(a)` taken off after, as `gemv512` does,
        // so each dot takes its broadcast activation bytes as they are. The
        // sums are exact either way.
        let biased = K::SIGNED && D::WIDE && RA > 1;
        if RA > 1 {
            // Several activation rows: transpose once (as `pack_rows8`
            // does), then each row costs eight broadcast dots, no sums.
            transpose8(&mut q);
            if biased {
                for v in q.iter_mut() {
                    *v = _mm256_xor_si256(*v, _mm256_set1_epi8(-128));
                }
            }
        }
        for c in 0..RA {
            let ab = &*(t.a.add(c * t.a_stride) as *const Q8A).add(b);
            let isum = if RA > 1 {
                let mut isum = _mm256_setzero_si256();
                for k in 0..8 {
                    let a4 = _mm256_set1_epi32((ab.qs.as_ptr().add(4 * k) as *const i32).read_unaligned());
                    isum = if K::SIGNED && !biased {
                        D::dot_acc(isum, _mm256_sign_epi8(q[k], q[k]), _mm256_sign_epi8(a4, q[k]))
                    } else {
                        D::dot_acc(isum, q[k], a4)
                    };
                }
                if biased {
                    let av = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                    let asum = hsum_i32(D::dot_acc(_mm256_setzero_si256(), _mm256_set1_epi8(1), av));
                    isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(128 * asum));
                }
                isum
            } else {
                let av = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                let mut v = [_mm256_setzero_si256(); 8];
                for r in 0..8 {
                    v[r] = if K::SIGNED { D::dot(qa[r], _mm256_sign_epi8(av, q[r])) } else { D::dot(q[r], av) };
                }
                reduce8(&v)
            };
            let s = _mm256_mul_ps(dv, _mm256_set1_ps(ab.d));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, acc[c]);
            if K::OFFSET {
                off[c] = _mm256_fmadd_ps(mv, _mm256_set1_ps(ab.s), off[c]);
            }
        }
    }
    for c in 0..RA {
        store_lanes(t.out.add(c * t.out_stride), _mm256_add_ps(acc[c], off[c]), rw);
    }
}

/// `$packed` and `$raw`: tiles of up to eight weight rows x any activation
/// rows up to the largest of `[$pa]` / `[$ra]` (each count gets its own
/// instance, so its accumulators stay in registers).
macro_rules! r8_tiles {
    ($packed:ident, $raw:ident, $dot:ty, $feat:literal, [$($pa:literal)*], [$($ra:literal)*]) => {
        #[target_feature(enable = $feat)]
        unsafe fn $packed<const SIGNED: bool>(t: &Tile, rw: usize, ra: usize) {
            match ra {
                $($pa => tile_r8_packed_body::<$dot, SIGNED, $pa>(t, rw),)*
                _ => unreachable!("packed tile of {ra} activation rows"),
            }
        }
        #[target_feature(enable = $feat)]
        unsafe fn $raw<K: B32>(t: &Tile, rw: usize, ra: usize) {
            match ra {
                $($ra => tile_r8_raw_body::<$dot, K, $ra>(t, rw),)*
                _ => unreachable!("raw tile of {ra} activation rows"),
            }
        }
    };
}

// AVX2's 16 vector registers hold a 4-row tile's accumulators. AVX-512's 32
// take wider tiles: a shared round's 5-15 activation rows (a few streams'
// decode rows and a prompt's rows) then run as one tile, unpacking each
// weight block once for all of them instead of once per 4 rows, and the
// packed tiles of prefill reuse each loaded weight vector for 8 rows.
r8_tiles!(r8_packed, r8_raw, MaddDot, "avx2,fma,f16c", [1 2 3 4], [1 2 3 4]);
r8_tiles!(r8_packed_vnni, r8_raw_vnni, VnniDot, "avx2,fma,f16c,avxvnni", [1 2 3 4], [1 2 3 4]);
r8_tiles!(
    r8_packed_vnni512,
    r8_raw_vnni512,
    Vnni512Dot,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    [1 2 3 4 5 6 7 8],
    [1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16]
);

/// The eight-row kernel of a 32-element type.
fn r8_kernel<K: B32>(vnni: Vnni) -> Kernel {
    let (raw, packed): (TileFn, TileFn) = match (vnni, K::SIGNED) {
        (Vnni::Vex, true) => (r8_raw_vnni::<K>, r8_packed_vnni::<true>),
        (Vnni::Vex, false) => (r8_raw_vnni::<K>, r8_packed_vnni::<false>),
        (Vnni::Evex, true) => (raw_vnni512::<K>, r8_packed_vnni512::<true>),
        (Vnni::Evex, false) => (raw_vnni512::<K>, r8_packed_vnni512::<false>),
        (Vnni::None, true) => (r8_raw::<K>, r8_packed::<true>),
        (Vnni::None, false) => (r8_raw::<K>, r8_packed::<false>),
    };
    // The widest tiles each instance has (see `r8_tiles!`).
    let (ra, ra_packed) = if vnni == Vnni::Evex { (16, 8) } else { (4, 4) };
    // With AVX-VNNI (VEX; on an Intel Xeon with both kinds), a raw tile of
    // a 4- or 5-bit type unpacks every block for each activation tile, so
    // packing pays from 6 rows (the bench's `few`, 4096² on 2 threads: Q4_1
    // at 8 rows 1,367 -> 1,157 µs, at 12 2,087 -> 1,442; Q5_0 at 12 2,468 ->
    // 1,483); Q8_0's raw tile reads its bytes as they are and packing pays
    // from 10 (at 6 rows it lost: 1,138 -> 1,202 µs). The EVEX tiles (up to
    // 16 raw rows) and the plain AVX2 ones were not measured so: 16.
    let min_rows = match (vnni, K::SIGNED) {
        (Vnni::Vex, false) => 6,
        (Vnni::Vex, true) => 10,
        _ => PACK_MIN_ACT_ROWS,
    };
    let pack = Pack { pack: pack_rows8::<K>, block_bytes: R8_BYTES / 8, tile: packed, rw: 8, ra: ra_packed, partial: true, sub_bytes: SUB_BYTES, min_rows };
    let rw_gemv = if matches!(vnni, Vnni::Evex) { gemv512::ROWS } else { 8 };
    Kernel { tile: raw, rw: 8, ra, rw_gemv, pack: Some(pack), partial: true }
}

/// With AVX-512 VNNI: matvec tiles of more than eight rows on 512-bit
/// registers, the rest as the eight-row tile.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn raw_vnni512<K: B32>(t: &Tile, rw: usize, ra: usize) {
    if ra == 1 && rw > 8 {
        gemv512::tile16::<K>(t, rw)
    } else {
        r8_raw_vnni512::<K>(t, rw, ra)
    }
}
