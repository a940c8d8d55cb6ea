//! Portable dot products of one weight row with one activation row. The
//! fallback where AVX2 is missing, and the reference for the SIMD kernels:
//! the integer sums per block are exact, so SIMD may differ only in the
//! order of the float additions.

use super::blocks::{k3_scale, k4_scale_min, rd_f16, Q8A, Q8KA};
use super::dequant::q6k_value;
use braid_formats::DType;

/// One activation row in the form a weight type consumes.
#[derive(Clone, Copy)]
pub(crate) enum ActRow<'a> {
    F32(&'a [f32]),
    Q8(&'a [Q8A]),
    Q8K(&'a [Q8KA]),
}

/// `w` is one weight row of `dtype` whose length matches `a`.
pub(crate) fn dot(dtype: DType, w: &[u8], a: ActRow<'_>) -> f32 {
    match (dtype, a) {
        (DType::F32, ActRow::F32(x)) => w.chunks_exact(4).zip(x).map(|(b, &v)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * v).sum(),
        (DType::F16, ActRow::F32(x)) => w.chunks_exact(2).zip(x).map(|(b, &v)| rd_f16(b, 0) * v).sum(),
        (DType::BF16, ActRow::F32(x)) => w.chunks_exact(2).zip(x).map(|(b, &v)| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16) * v).sum(),
        (_, ActRow::Q8(a)) => {
            let ts = dtype.type_size();
            w.chunks_exact(ts).zip(a).map(|(b, ab)| dot32(dtype, b, ab)).sum()
        }
        (_, ActRow::Q8K(a)) => {
            let ts = dtype.type_size();
            w.chunks_exact(ts).zip(a).map(|(b, ab)| dot256(dtype, b, ab)).sum()
        }
        _ => unreachable!("activation kind does not match {dtype}"),
    }
}

/// Dot of one 32-element weight block with one activation block.
fn dot32(dtype: DType, b: &[u8], a: &Q8A) -> f32 {
    // Unsigned 4/5-bit values with a separate offset: sum(q*a) exactly,
    // then the offset via a.s = d_a * sum(a).
    let nib = |qs: &[u8], j: usize| -> i32 {
        if j < 16 {
            (qs[j] & 15) as i32
        } else {
            (qs[j - 16] >> 4) as i32
        }
    };
    let qa = |j: usize| a.qs[j] as i32;
    match dtype {
        DType::Q4_0 => {
            let isum: i32 = (0..32).map(|j| (nib(&b[2..], j) - 8) * qa(j)).sum();
            rd_f16(b, 0) * a.d * isum as f32
        }
        DType::Q4_1 => {
            let isum: i32 = (0..32).map(|j| nib(&b[4..], j) * qa(j)).sum();
            rd_f16(b, 0) * a.d * isum as f32 + rd_f16(b, 2) * a.s
        }
        DType::Q5_0 => {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let isum: i32 = (0..32).map(|j| (nib(&b[6..], j) + (((qh >> j) & 1) << 4) as i32 - 16) * qa(j)).sum();
            rd_f16(b, 0) * a.d * isum as f32
        }
        DType::Q5_1 => {
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let isum: i32 = (0..32).map(|j| (nib(&b[8..], j) + (((qh >> j) & 1) << 4) as i32) * qa(j)).sum();
            rd_f16(b, 0) * a.d * isum as f32 + rd_f16(b, 2) * a.s
        }
        DType::Q8_0 => {
            let isum: i32 = (0..32).map(|j| (b[2 + j] as i8) as i32 * qa(j)).sum();
            rd_f16(b, 0) * a.d * isum as f32
        }
        DType::Q8_1 => {
            let isum: i32 = (0..32).map(|j| (b[4 + j] as i8) as i32 * qa(j)).sum();
            rd_f16(b, 0) * a.d * isum as f32
        }
        _ => unreachable!("{dtype} is not a 32-element block type"),
    }
}

/// Dot of one 256-element K-quant block with one Q8_K-style block.
fn dot256(dtype: DType, b: &[u8], a: &Q8KA) -> f32 {
    let qa = |e: usize| a.qs[e] as i32;
    // Sum over 16-element groups g of weight(g) * sum(q*a in g).
    let groups16 = |q: &dyn Fn(usize) -> i32, sc: &dyn Fn(usize) -> i32| -> i32 {
        (0..16).map(|g| sc(g) * (g * 16..g * 16 + 16).map(|e| q(e) * qa(e)).sum::<i32>()).sum()
    };
    match dtype {
        DType::Q2K => {
            let (sc, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (rd_f16(b, 80), rd_f16(b, 82));
            let q = |e: usize| ((qs[(e / 128) * 32 + e % 32] >> (2 * ((e / 32) % 4))) & 3) as i32;
            let isum = groups16(&q, &|g| (sc[g] & 15) as i32);
            let msum: i32 = (0..16).map(|g| (sc[g] >> 4) as i32 * a.bsums[g] as i32).sum();
            d * a.d * isum as f32 - dmin * a.d * msum as f32
        }
        DType::Q3K => {
            let (hm, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = rd_f16(b, 108);
            let q = |e: usize| {
                let lo = ((qs[(e / 128) * 32 + e % 32] >> (2 * ((e / 32) % 4))) & 3) as i32;
                lo - if (hm[e % 32] >> (e / 32)) & 1 == 0 { 4 } else { 0 }
            };
            let isum = groups16(&q, &|g| k3_scale(sc, g) as i32);
            d * a.d * isum as f32
        }
        DType::Q4K | DType::Q5K => {
            let (d, dmin) = (rd_f16(b, 0), rd_f16(b, 2));
            let sc = &b[4..16];
            let q = |e: usize| -> i32 {
                let (chunk, nib, l) = (e / 64, (e / 32) % 2, e % 32);
                if dtype == DType::Q4K {
                    ((b[16 + chunk * 32 + l] >> (4 * nib)) & 15) as i32
                } else {
                    let lo = (b[48 + chunk * 32 + l] >> (4 * nib)) & 15;
                    (lo | (((b[16 + l] >> (e / 32)) & 1) << 4)) as i32
                }
            };
            let mut isum = 0i32;
            let mut msum = 0i32;
            for j in 0..8 {
                let (s, m) = k4_scale_min(sc, j);
                let part: i32 = (j * 32..j * 32 + 32).map(|e| q(e) * qa(e)).sum();
                isum += s as i32 * part;
                msum += m as i32 * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32);
            }
            d * a.d * isum as f32 - dmin * a.d * msum as f32
        }
        DType::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = rd_f16(b, 208);
            let q = |e: usize| q6k_value(ql, qh, e);
            let isum = groups16(&q, &|g| (sc[g] as i8) as i32);
            d * a.d * isum as f32
        }
        DType::Q8K => {
            let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let isum: i32 = (0..256).map(|e| (b[4 + e] as i8) as i32 * qa(e)).sum();
            d * a.d * isum as f32
        }
        _ => unreachable!("{dtype} is not a K-quant"),
    }
}
