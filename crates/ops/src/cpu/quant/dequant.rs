//! Scalar dequantization of whole blocks. Used for embedding rows, norm
//! vectors and as the reference the kernels are tested against; matmuls
//! never dequantize.

use super::blocks::{f16_to_f32, k3_scale, k4_scale_min, rd_f16};
use braid_formats::DType;

/// `src` holds exactly the blocks of `dst` (checked by the caller).
pub(crate) fn dequantize_blocks(dtype: DType, src: &[u8], dst: &mut [f32]) {
    let bs = dtype.block_size();
    let ts = dtype.type_size();
    match dtype {
        DType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        DType::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16_to_f32(u16::from_le_bytes([s[0], s[1]]));
            }
        }
        DType::BF16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16);
            }
        }
        _ => {
            for (y, b) in dst.chunks_exact_mut(bs).zip(src.chunks_exact(ts)) {
                block(dtype, b, y);
            }
        }
    }
}

/// One quantized block `b` into `y` (`block_size` values).
fn block(dtype: DType, b: &[u8], y: &mut [f32]) {
    match dtype {
        DType::Q4_0 => {
            let d = rd_f16(b, 0);
            for j in 0..16 {
                let q = b[2 + j];
                y[j] = d * ((q & 15) as i32 - 8) as f32;
                y[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
            }
        }
        DType::Q4_1 => {
            let (d, m) = (rd_f16(b, 0), rd_f16(b, 2));
            for j in 0..16 {
                let q = b[4 + j];
                y[j] = d * (q & 15) as f32 + m;
                y[j + 16] = d * (q >> 4) as f32 + m;
            }
        }
        DType::Q5_0 => {
            let d = rd_f16(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..16 {
                let q = b[6 + j];
                let lo = (q & 15) as u32 | (((qh >> j) & 1) << 4);
                let hi = (q >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
                y[j] = d * (lo as i32 - 16) as f32;
                y[j + 16] = d * (hi as i32 - 16) as f32;
            }
        }
        DType::Q5_1 => {
            let (d, m) = (rd_f16(b, 0), rd_f16(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            for j in 0..16 {
                let q = b[8 + j];
                let lo = (q & 15) as u32 | (((qh >> j) & 1) << 4);
                let hi = (q >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
                y[j] = d * lo as f32 + m;
                y[j + 16] = d * hi as f32 + m;
            }
        }
        DType::Q8_0 => {
            let d = rd_f16(b, 0);
            for j in 0..32 {
                y[j] = d * (b[2 + j] as i8) as f32;
            }
        }
        DType::Q8_1 => {
            let d = rd_f16(b, 0);
            for j in 0..32 {
                y[j] = d * (b[4 + j] as i8) as f32;
            }
        }
        DType::Q2K => {
            let (sc, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (rd_f16(b, 80), rd_f16(b, 82));
            for (e, v) in y.iter_mut().enumerate() {
                let (half, shift, l) = (e / 128, (e / 32) % 4, e % 32);
                let q = (qs[half * 32 + l] >> (2 * shift)) & 3;
                let s = sc[e / 16];
                *v = d * (s & 15) as f32 * q as f32 - dmin * (s >> 4) as f32;
            }
        }
        DType::Q3K => {
            let (hm, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = rd_f16(b, 108);
            for (e, v) in y.iter_mut().enumerate() {
                let (half, shift, l) = (e / 128, (e / 32) % 4, e % 32);
                let lo = ((qs[half * 32 + l] >> (2 * shift)) & 3) as i32;
                // The high bit set means no offset; clear means -4.
                let hbit = (hm[l] >> (e / 32)) & 1;
                let q = lo - if hbit == 0 { 4 } else { 0 };
                *v = d * k3_scale(sc, e / 16) as f32 * q as f32;
            }
        }
        DType::Q4K => {
            let (d, dmin) = (rd_f16(b, 0), rd_f16(b, 2));
            let (sc, qs) = (&b[4..16], &b[16..144]);
            for (e, v) in y.iter_mut().enumerate() {
                let (chunk, nib, l) = (e / 64, (e / 32) % 2, e % 32);
                let q = (qs[chunk * 32 + l] >> (4 * nib)) & 15;
                let (s, m) = k4_scale_min(sc, e / 32);
                *v = d * s as f32 * q as f32 - dmin * m as f32;
            }
        }
        DType::Q5K => {
            let (d, dmin) = (rd_f16(b, 0), rd_f16(b, 2));
            let (sc, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
            for (e, v) in y.iter_mut().enumerate() {
                let (chunk, nib, l) = (e / 64, (e / 32) % 2, e % 32);
                let q = ((qs[chunk * 32 + l] >> (4 * nib)) & 15) | (((qh[l] >> (e / 32)) & 1) << 4);
                let (s, m) = k4_scale_min(sc, e / 32);
                *v = d * s as f32 * q as f32 - dmin * m as f32;
            }
        }
        DType::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = rd_f16(b, 208);
            for (e, v) in y.iter_mut().enumerate() {
                let q = q6k_value(ql, qh, e);
                *v = d * (sc[e / 16] as i8) as f32 * q as f32;
            }
        }
        DType::Q8K => {
            let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            for j in 0..256 {
                y[j] = d * (b[4 + j] as i8) as f32;
            }
        }
        DType::F32 | DType::F16 | DType::BF16 => unreachable!("float types are not blocks"),
    }
}

/// Q6_K element `e` of a block, offset removed (-32..31).
#[inline]
pub(crate) fn q6k_value(ql: &[u8], qh: &[u8], e: usize) -> i32 {
    let (half, r) = (e / 128, e % 128);
    // Low 4 bits: elements 0..64 of a half are the low nibbles of its 64 ql
    // bytes, 64..128 the high nibbles.
    let lo = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 15;
    // High 2 bits: byte r%32 of the half's 32 qh bytes, 2 bits per 32-group.
    let hi = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 3;
    (lo | (hi << 4)) as i32 - 32
}
