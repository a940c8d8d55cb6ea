//! The CPU's products give each row exactly what a product alone gives:
//! several weights over one input, and any number of rows.

use braid_formats::{Bytes, DType};

use super::quant::f32_to_f16;
use super::{Cpu, CpuTensor, CpuWeight};
use crate::Device;

#[path = "../../tests/common/rng.rs"]
mod rng;
use rng::Rng;

/// Random blocks with small f16 scales.
fn weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> CpuWeight {
    let data: Vec<u8> = if dtype == DType::F16 {
        (0..rows * cols).flat_map(|_| f32_to_f16(rng.f()).to_le_bytes()).collect()
    } else {
        let mut w: Vec<u8> = (0..dtype.bytes_for(rows * cols).unwrap()).map(|_| rng.next() as u8).collect();
        let fields: &[usize] = match dtype {
            DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
            DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
            DType::Q6K => &[208],
            _ => &[],
        };
        for blk in w.chunks_exact_mut(dtype.type_size()) {
            for &o in fields {
                blk[o..o + 2].copy_from_slice(&f32_to_f16(rng.f() * 0.05).to_le_bytes());
            }
        }
        w
    };
    CpuWeight { dtype, rows, cols, data: Bytes::from_vec(data) }
}

fn tensor(rng: &mut Rng, rows: usize, cols: usize) -> CpuTensor {
    CpuTensor { data: (0..rows * cols).map(|_| rng.f() * 2.0).collect(), rows, cols }
}

const TYPES: [DType; 6] = [DType::Q4_1, DType::Q5_0, DType::Q8_0, DType::Q4K, DType::Q6K, DType::F16];

#[test]
fn several_products_equal_separate_ones() {
    let dev = Cpu::new(Some(2));
    let mut rng = Rng(11);
    let cols = 512;
    for m in [1, 3, 20, 45] {
        for (i, &dt) in TYPES.iter().enumerate() {
            // Three weights of mixed types and heights over one input.
            let dts = [dt, TYPES[(i + 1) % TYPES.len()], TYPES[(i + 3) % TYPES.len()]];
            let ws: Vec<CpuWeight> = dts.iter().zip([70, 9, 33]).map(|(&d, r)| weight(&mut rng, d, r, cols)).collect();
            let x = tensor(&mut rng, m, cols);
            let mut fused = [dev.tensor(0, 0), dev.tensor(0, 0), dev.tensor(0, 0)];
            {
                let [a, b, c] = &mut fused;
                dev.matmul(&x, &[&ws[0], &ws[1], &ws[2]], &mut [a, b, c]);
            }
            for (w, f) in ws.iter().zip(&fused) {
                let mut one = dev.tensor(0, 0);
                dev.matmul(&x, &[w], &mut [&mut one]);
                assert_eq!((f.rows, f.cols), (m, w.rows));
                assert_eq!(f.data, one.data, "{:?} m={m}", w.dtype);
            }
        }
    }
}

/// Every m (matvec, few-row tiles, packed prefill tiles, partial tiles)
/// gives each row exactly its one-row result: the chunk invariance the
/// CPU backend declares rests on it.
#[test]
fn each_row_equals_its_matvec_for_every_m() {
    let dev = Cpu::new(Some(2));
    let mut rng = Rng(14);
    let cols = 512;
    for &dt in TYPES.iter().chain(&[DType::Q4_0, DType::Q5_1, DType::Q5K]) {
        let w = weight(&mut rng, dt, 75, cols);
        let x = tensor(&mut rng, 20, cols);
        let mut one = Vec::new();
        for r in 0..x.rows {
            let mut o = dev.tensor(0, 0);
            dev.matmul(&CpuTensor { data: x.row(r).to_vec(), rows: 1, cols }, &[&w], &mut [&mut o]);
            one.push(o.data);
        }
        for m in 2..=x.rows {
            let mut o = dev.tensor(0, 0);
            dev.matmul(&CpuTensor { data: x.data[..m * cols].to_vec(), rows: m, cols }, &[&w], &mut [&mut o]);
            for (r, want) in one.iter().enumerate().take(m) {
                assert_eq!(o.row(r), &want[..], "{dt} m={m} row {r}");
            }
        }
    }
}
