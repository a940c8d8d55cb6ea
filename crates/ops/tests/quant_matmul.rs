//! Quantized matmul: SIMD kernels against the scalar ones, and both against
//! a dequantize-then-f32 reference within the activation quantization's
//! error bound.

use braid_formats::DType;
use braid_ops::cpu::quant::{dequantize, f32_to_f16, matmul, matmul_isa, matmul_rows, Isa, QMatRef};

#[path = "common/rng.rs"]
mod rng;
use rng::Rng;

const ALL: [DType; 15] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q8_1,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Q8K,
];

/// Offsets of the f16 scale fields of each block type.
fn scale_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q8_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q2K => &[80, 82],
        DType::Q3K => &[108],
        DType::Q6K => &[208],
        _ => &[],
    }
}

/// A random `rows x cols` weight: random bytes (every packed bit pattern)
/// with sane scales.
fn random_weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols;
    match dtype {
        DType::F32 => (0..n).flat_map(|_| rng.f().to_le_bytes()).collect(),
        DType::F16 => (0..n).flat_map(|_| f32_to_f16(rng.f()).to_le_bytes()).collect(),
        DType::BF16 => (0..n).flat_map(|_| ((rng.f().to_bits() >> 16) as u16).to_le_bytes()).collect(),
        _ => {
            let bytes = dtype.bytes_for(n).unwrap();
            let mut w: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
            for blk in w.chunks_exact_mut(dtype.type_size()) {
                for &o in scale_fields(dtype) {
                    blk[o..o + 2].copy_from_slice(&f32_to_f16(rng.f() * 0.05).to_le_bytes());
                }
                if dtype == DType::Q8K {
                    blk[0..4].copy_from_slice(&(rng.f() * 0.01).to_le_bytes());
                }
            }
            w
        }
    }
}

/// Activations with some spread between blocks, and one zero block.
fn random_x(rng: &mut Rng, m: usize, cols: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..m * cols).map(|i| rng.f() * (1.0 + (i % 7) as f32)).collect();
    let z = cols.min(32);
    x[..z].fill(0.0);
    x
}

struct Case {
    dtype: DType,
    rows: usize,
    cols: usize,
    m: usize,
    w: Vec<u8>,
    x: Vec<f32>,
}

fn case(rng: &mut Rng, dtype: DType, rows: usize, blocks: usize, m: usize) -> Case {
    let bs = if dtype.is_quantized() { dtype.block_size() } else { 37 };
    let cols = bs * blocks;
    Case { dtype, rows, cols, m, w: random_weight(rng, dtype, rows, cols), x: random_x(rng, m, cols) }
}

impl Case {
    fn w(&self) -> QMatRef<'_> {
        QMatRef { dtype: self.dtype, rows: self.rows, cols: self.cols, data: &self.w }
    }
    fn run(&self, isa: Isa) -> Vec<f32> {
        let mut out = vec![f32::NAN; self.m * self.rows];
        matmul_isa(isa, self.w(), &self.x, self.m, &mut out);
        out
    }
    /// (reference in f64 from dequantized weights and exact activations,
    /// sum of |w*x| per output, activation quantization error bound).
    fn reference(&self) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let mut wd = vec![0.0f32; self.rows * self.cols];
        dequantize(self.dtype, &self.w, &mut wd).unwrap();
        // Activation block: 32 for the 32-element types, 256 for K-quants.
        let ab = if self.dtype.is_quantized() { self.dtype.block_size() } else { 0 };
        let (mut r, mut a, mut e) = (vec![], vec![], vec![]);
        for c in 0..self.m {
            let x = &self.x[c * self.cols..(c + 1) * self.cols];
            for row in 0..self.rows {
                let w = &wd[row * self.cols..(row + 1) * self.cols];
                let (mut s, mut abs, mut err) = (0.0f64, 0.0f64, 0.0f64);
                for k in 0..self.cols {
                    s += w[k] as f64 * x[k] as f64;
                    abs += (w[k] as f64 * x[k] as f64).abs();
                }
                if ab > 0 {
                    // Rounding to the nearest of steps amax/127 moves each
                    // value by at most amax/254.
                    for (wb, xb) in w.chunks(ab).zip(x.chunks(ab)) {
                        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
                        let wsum: f64 = wb.iter().map(|v| v.abs() as f64).sum();
                        err += wsum * amax / 254.0;
                    }
                }
                r.push(s);
                a.push(abs);
                e.push(err);
            }
        }
        (r, a, e)
    }
}

fn shapes() -> Vec<(usize, usize, usize)> {
    // (rows, blocks per row, m): one row, odd rows and m, tails of every
    // tile shape, an m large enough for the prefill split, and a matvec
    // with full and partial sixteen-row tiles.
    vec![(1, 1, 1), (3, 2, 1), (7, 3, 5), (9, 1, 4), (33, 2, 9), (64, 4, 3), (21, 2, 70), (130, 1, 2), (45, 3, 1)]
}

/// A fresh case for every type and every shape of `shapes()`, in order,
/// from a generator seeded with `seed`; `f` gets the type, rows and m.
fn every_case(seed: u64, mut f: impl FnMut(DType, usize, usize, &Case)) {
    let mut rng = Rng(seed);
    for dtype in ALL {
        for (rows, blocks, m) in shapes() {
            f(dtype, rows, m, &case(&mut rng, dtype, rows, blocks, m));
        }
    }
}

#[test]
fn simd_matches_scalar_for_every_type_and_shape() {
    let isas: Vec<Isa> = [Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni].into_iter().filter(|i| i.available()).collect();
    if isas.is_empty() {
        eprintln!("no AVX2 on this CPU: SIMD kernels not tested");
        return;
    }
    every_case(0x9e37_79b9_7f4a_7c15, |dtype, rows, m, c| {
        let scalar = c.run(Isa::Scalar);
        let (_, abs, _) = c.reference();
        for &isa in &isas {
            let simd = c.run(isa);
            for i in 0..simd.len() {
                // Identical activation blocks and exact integer block
                // sums: only the float summation order differs.
                let tol = 2e-6 * abs[i] + 1e-6;
                assert!(
                    (simd[i] - scalar[i]).abs() as f64 <= tol,
                    "{isa:?} {dtype} {rows}x{} m={m} out {i}: simd {} scalar {} (tol {tol:e})",
                    c.cols,
                    simd[i],
                    scalar[i]
                );
            }
        }
    });
}

#[test]
fn matmul_matches_dequantized_reference_within_activation_error() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for isa in [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni] {
        if !isa.available() {
            continue;
        }
        for dtype in ALL {
            for (rows, blocks, m) in [(5, 3, 3), (40, 2, 17)] {
                let c = case(&mut rng, dtype, rows, blocks, m);
                let got = c.run(isa);
                let (want, abs, err) = c.reference();
                let mut max_rel = 0.0f64;
                for i in 0..got.len() {
                    // Quantization bound plus f32 accumulation slack.
                    let tol = err[i] * 1.001 + 1e-5 * abs[i] + 1e-6;
                    let d = (got[i] as f64 - want[i]).abs();
                    assert!(d <= tol, "{isa:?} {dtype} out {i}: {} vs {} (tol {tol:e})", got[i], want[i]);
                    max_rel = max_rel.max(d / (abs[i] + 1e-9));
                }
                // Without 8-bit activations the result is plain f32 math.
                if !dtype.is_quantized() {
                    assert!(max_rel < 1e-5, "{dtype}: rel error {max_rel:e}");
                }
            }
        }
    }
}

#[test]
fn quantization_error_is_small_on_realistic_data() {
    // Uniform activations: 8-bit activations cost well under 1% (RMS).
    let mut rng = Rng(42);
    for dtype in [DType::Q4_1, DType::Q8_0, DType::Q4K, DType::Q6K, DType::Q5_0] {
        let (rows, cols, m) = (16, 512, 3);
        let w = random_weight(&mut rng, dtype, rows, cols);
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
        let mut got = vec![0.0; m * rows];
        matmul(QMatRef { dtype, rows, cols, data: &w }, &x, m, &mut got);
        let mut wd = vec![0.0; rows * cols];
        dequantize(dtype, &w, &mut wd).unwrap();
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for c in 0..m {
            for r in 0..rows {
                let want: f64 = (0..cols).map(|k| wd[r * cols + k] as f64 * x[c * cols + k] as f64).sum();
                num += (got[c * rows + r] as f64 - want).powi(2);
                den += want * want;
            }
        }
        let rel = (num / den).sqrt();
        assert!(rel < 5e-3, "{dtype}: relative RMS error {rel:e}");
    }
}

#[test]
fn thread_counts_and_row_subsets_give_identical_results() {
    let mut rng = Rng(7);
    for dtype in [DType::Q4_1, DType::Q4K, DType::Q6K, DType::Q8_0, DType::F16] {
        let c = case(&mut rng, dtype, 301, 3, 37);
        let mut one = vec![0.0; c.m * c.rows];
        let mut two = vec![0.0; c.m * c.rows];
        braid_ops::cpu::pool::set_threads(1);
        matmul(c.w(), &c.x, c.m, &mut one);
        braid_ops::cpu::pool::set_threads(2);
        matmul(c.w(), &c.x, c.m, &mut two);
        braid_ops::cpu::pool::set_threads(0);
        assert_eq!(one, two, "{dtype}: results depend on the thread count");

        let ids = [300u32, 0, 17, 17, 150];
        let mut sub = vec![0.0; c.m * ids.len()];
        matmul_rows(c.w(), &ids, &c.x, c.m, &mut sub);
        for row in 0..c.m {
            for (j, &id) in ids.iter().enumerate() {
                assert_eq!(sub[row * ids.len() + j], one[row * c.rows + id as usize], "{dtype}");
            }
        }
    }
}

#[test]
#[should_panic(expected = "needs")]
fn short_weight_data_panics_with_a_message() {
    let w = vec![0u8; 19];
    let x = vec![0.0; 32];
    let mut out = vec![0.0; 1];
    matmul(QMatRef { dtype: DType::Q4_1, rows: 1, cols: 32, data: &w }, &x, 1, &mut out);
}

#[test]
fn each_output_row_is_independent_of_the_batch() {
    // Decode (one row, matvec path) and prefill (many rows: repacked
    // weights, other tile shapes) must agree bit for bit, so a stream's
    // results do not depend on how its prompt was chunked.
    let mut rng = Rng(99);
    for dtype in ALL {
        let c = case(&mut rng, dtype, 70, 3, 45);
        let all = c.run(Isa::best());
        for row in [0, 1, 17, 44] {
            let x = &c.x[row * c.cols..(row + 1) * c.cols];
            let mut one = vec![0.0; c.rows];
            matmul(c.w(), x, 1, &mut one);
            assert_eq!(one, all[row * c.rows..(row + 1) * c.rows], "{dtype} row {row}");
        }
    }
}

/// Float weights against many activation rows take packed tiles (on
/// AVX-512, 8 weight rows x 6 activation rows, sweeps of up to 256 rows):
/// shapes that end mid-tile, mid-group and mid-sweep in every direction,
/// with tails of 1..7 elements, on one thread so that one task holds every
/// activation row. They must match the scalar kernels within float
/// rounding and a lone row's result bit for bit.
#[test]
fn float_weights_with_many_rows_match_scalar_on_odd_shapes() {
    let mut rng = Rng(0xf10a7);
    braid_ops::cpu::pool::set_threads(1);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (rows, cols, m) in [(13, 9, 17), (45, 1003, 67), (300, 37, 23), (8, 64, 16), (1, 5, 40), (263, 200, 31)] {
            let c = Case { dtype, rows, cols, m, w: random_weight(&mut rng, dtype, rows, cols), x: random_x(&mut rng, m, cols) };
            let scalar = c.run(Isa::Scalar);
            let best = c.run(Isa::best());
            let (_, abs, _) = c.reference();
            for i in 0..best.len() {
                let tol = 2e-6 * abs[i] + 1e-6;
                let d = (best[i] - scalar[i]).abs() as f64;
                assert!(d <= tol, "{dtype} {rows}x{cols} m={m} out {i}: {} vs scalar {} (tol {tol:e})", best[i], scalar[i]);
            }
            for row in [0, m / 2, m - 1] {
                let mut one = vec![0.0; rows];
                matmul(c.w(), &c.x[row * cols..(row + 1) * cols], 1, &mut one);
                assert_eq!(one, best[row * rows..(row + 1) * rows], "{dtype} {rows}x{cols} m={m} row {row}");
            }
        }
    }
    braid_ops::cpu::pool::set_threads(0);
}

/// A VNNI `dpbusd` forms the same exact integer sums as AVX2's
/// `maddubs` + `madd`, so the VNNI kernels (either kind) give the AVX2
/// kernels' results bit for bit, prefill shapes included.
#[test]
fn vnni_kernels_equal_avx2_bit_for_bit() {
    let vnni: Vec<Isa> = [Isa::AvxVnni, Isa::Avx512Vnni].into_iter().filter(|i| i.available()).collect();
    if !Isa::Avx2.available() || vnni.is_empty() {
        eprintln!("no VNNI on this CPU: VNNI kernels not tested");
        return;
    }
    every_case(0x0bad_cafe_f00d_1234, |dtype, rows, m, c| {
        let want = c.run(Isa::Avx2);
        for &isa in &vnni {
            let got = c.run(isa);
            let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{isa:?} {dtype} {rows}x{} m={m}: differs from AVX2", c.cols);
        }
    });
}

/// A shared round's few activation rows (a handful of streams' decode rows
/// plus a prompt's rows) run as wide tiles, up to 16 rows at once (8 for
/// the K-quants) on AVX-512, packed from 16: every ragged count must give
/// each row the lone row's result bit for bit, and the AVX2 kernels'
/// results too, with weight rows ending mid-group (37) and whole 16-row
/// matvec tiles (64), on one thread (one task holds every row) and on two.
#[test]
fn few_rows_give_each_row_its_lone_result_bit_for_bit() {
    let mut rng = Rng(0x5a1ad);
    let quantized = [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q8_1, DType::Q4K, DType::Q5K, DType::Q6K];
    for threads in [1, 2] {
        braid_ops::cpu::pool::set_threads(threads);
        for dtype in quantized {
            for rows in [37, 64] {
                for m in [2, 3, 5, 6, 7, 8, 9, 10, 12, 13, 15, 16, 17, 22] {
                    let c = case(&mut rng, dtype, rows, 3, m);
                    let all = c.run(Isa::best());
                    for row in 0..m {
                        let x = &c.x[row * c.cols..(row + 1) * c.cols];
                        let mut one = vec![0.0; rows];
                        matmul(c.w(), x, 1, &mut one);
                        let got = &all[row * rows..(row + 1) * rows];
                        let same = one.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{dtype} {rows} rows, m={m}, {threads} threads: row {row} differs from its lone result");
                    }
                    if Isa::Avx2.available() {
                        let avx2 = c.run(Isa::Avx2);
                        let same = avx2.iter().zip(&all).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{dtype} {rows} rows, m={m}, {threads} threads: differs from AVX2");
                    }
                }
            }
        }
    }
    braid_ops::cpu::pool::set_threads(0);
}

/// Where AVX-512 VNNI runs, the matmuls take it, also beside AVX-VNNI: only
/// its kernels pack float weights and long prompts into 512-bit tiles (an
/// image's tower on a 2-core AMD EPYC with both: 77 s under AVX-VNNI's).
#[test]
fn the_widest_kernels_this_cpu_runs_are_chosen() {
    let capped = std::env::var_os("BRAID_CPU_ISA").is_some();
    let widest = [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2, Isa::Scalar].into_iter().find(|i| i.available()).unwrap();
    if !capped {
        assert_eq!(Isa::best(), widest);
    }
    // And the device's name says which ran (`braid bench` prints it).
    let name = braid_ops::Device::name(&braid_ops::cpu::Cpu::new(None));
    assert!(name.contains(Isa::best().name()), "{name}");
}
