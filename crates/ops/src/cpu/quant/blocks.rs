//! Block layouts (GGML's, as stored in GGUF) and the 8-bit activation
//! blocks the matmul kernels quantize into.
//!
//! Weight blocks (byte offsets; `f16` little-endian):
//! * Q4_0 (18 B / 32): d f16, qs[16]; element j<16 = lo nibble of qs[j], j>=16 = hi nibble of qs[j-16]; y = d*(q-8)
//! * Q4_1 (20 B / 32): d, m f16, qs[16] as Q4_0; y = d*q + m
//! * Q5_0 (22 B / 32): d, qh u32 (bit j = 5th bit of element j), qs[16]; y = d*(q-16)
//! * Q5_1 (24 B / 32): d, m, qh, qs[16]; y = d*q + m
//! * Q8_0 (34 B / 32): d, qs i8[32]; y = d*q
//! * Q8_1 (36 B / 32): d, s f16, qs i8[32]; y = d*q
//! * Q2_K (84 B / 256): scales[16] (lo 4 bits scale, hi 4 bits min), qs[64], d, dmin
//! * Q3_K (110 B / 256): hmask[32], qs[64], scales[12] (16 x 6 bits, minus 32), d
//! * Q4_K (144 B / 256): d, dmin, scales[12] (8 scales + 8 mins, 6 bits), qs[128]
//! * Q5_K (176 B / 256): d, dmin, scales[12], qh[32], qs[128]
//! * Q6_K (210 B / 256): ql[128], qh[64], scales i8[16], d
//! * Q8_K (292 B / 256): d f32, qs i8[256], bsums i16[16]

/// Exact f16 -> f32 (subnormals, infinities and NaNs included).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: man * 2^-24, exact in f32.
            let v = (man as f32) * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
    } else if exp == 31 {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

/// f32 -> f16, round to nearest even (used by tests and tools).
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

#[inline]
pub(crate) fn rd_f16(b: &[u8], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// Q4_K / Q5_K: the j-th (0..8) 6-bit scale and min from the 12 packed bytes.
#[inline]
pub(crate) fn k4_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Q3_K: the j-th (0..16) scale, already minus 32.
#[inline]
pub(crate) fn k3_scale(s: &[u8], j: usize) -> i8 {
    let lo = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
    let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    ((lo | (hi << 4)) as i8) - 32
}

/// An activation block for the 32-element weight types: 32 values as
/// `d * qs[i]`, and `s = d * sum(qs)` for the types with an offset.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct Q8A {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
}

/// An activation block for the K-quants: 256 values as `d * qs[i]`, and the
/// sum of each 16 `qs` (the K-quants' mins and offsets act on 16/32-element
/// groups, so they cost a few multiplies per block instead of 256).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct Q8KA {
    pub d: f32,
    pub qs: [i8; 256],
    pub bsums: [i16; 16],
}

impl Default for Q8KA {
    fn default() -> Self {
        Q8KA { d: 0.0, qs: [0; 256], bsums: [0; 16] }
    }
}
