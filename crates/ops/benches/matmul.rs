//! Matmul throughput: `cargo bench -p braid-ops --bench matmul`.
//!
//! Prints GB/s of weight streaming for 4096x4096 matvecs (m = 1, the
//! decode case) and GFLOP/s for m = 512 (prefill), on 1 and 2 threads; then
//! the matmul time of one decode step / one 512-token prefill for the
//! shapes of SmolLM2-135M (Q4_1 + Q8_0 head) and Gemma 3 270M (Q4_K_M).
//! `BENCH_QUICK=1` shortens it; `BENCH_ONLY=pool|matvec|few|shared|head|float|prefill|model`
//! runs one section; `BRAID_CPU_ISA=scalar` runs the scalar kernels.

use std::time::Instant;

use braid_formats::DType;
use braid_ops::cpu::pool;
use braid_ops::cpu::quant::{f32_to_f16, matmul, Isa, QMatRef};

#[path = "../tests/common/rng.rs"]
mod rng;
use rng::Rng;

/// Random blocks with sane f16 scales (the values don't matter for speed,
/// but NaN/inf scales could take slow paths).
fn weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let bytes = dtype.bytes_for(rows * cols).expect("whole blocks");
    let mut w: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
    let fields: &[usize] = match dtype {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q2K => &[80, 82],
        DType::Q3K => &[108],
        DType::Q6K => &[208],
        _ => &[],
    };
    if dtype.is_quantized() {
        for blk in w.chunks_exact_mut(dtype.type_size()) {
            for &o in fields {
                blk[o..o + 2].copy_from_slice(&f32_to_f16(rng.f() * 0.05).to_le_bytes());
            }
        }
    } else if dtype == DType::F16 {
        for h in w.chunks_exact_mut(2) {
            h.copy_from_slice(&f32_to_f16(rng.f()).to_le_bytes());
        }
    }
    w
}

/// Seconds per call: the best of `reps` timings of `iters` calls each.
fn time(iters: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / iters as f64);
    }
    best
}

/// (type, rows, cols, how many per forward).
type Shape = (DType, usize, usize, usize);

struct Mat {
    dtype: DType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl Mat {
    fn new(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Mat {
        Mat { dtype, rows, cols, data: weight(rng, dtype, rows, cols) }
    }
    fn q(&self) -> QMatRef<'_> {
        QMatRef { dtype: self.dtype, rows: self.rows, cols: self.cols, data: &self.data }
    }
}

fn main() {
    let quick = std::env::var("BENCH_QUICK").is_ok();
    let only = std::env::var("BENCH_ONLY").ok();
    let want = |s: &str| only.as_deref().is_none_or(|o| o == s);
    let n = 4096;
    let mut rng = Rng(0x5eed);
    println!("kernels: {:?}; machine threads: {}", Isa::best(), pool::threads());
    let max_threads = pool::threads().max(1);
    let thread_counts: Vec<usize> = if max_threads >= 2 { vec![1, 2] } else { vec![1] };

    if want("pool") {
        println!("\npool: one parallel_for of 8 empty tasks (dispatch + join)");
        for &t in &thread_counts {
            pool::set_threads(t);
            let s = time(20000, 5, || {
                pool::parallel_for(8, &|i| {
                    std::hint::black_box(i);
                })
            });
            println!("{t} threads: {:.2} us/call", s * 1e6);
        }
    }

    if want("matvec") {
        println!("\n4096x4096 matvec (m=1): weight streaming");
        println!("{:<6} {:>8} {:>10} {:>9}", "type", "threads", "us/call", "GB/s");
        for dtype in [DType::Q4_1, DType::Q4K, DType::Q8_0, DType::Q5_0, DType::Q6K, DType::F16] {
            let w = Mat::new(&mut rng, dtype, n, n);
            let x: Vec<f32> = (0..n).map(|_| rng.f()).collect();
            let mut out = vec![0.0; n];
            for &t in &thread_counts {
                pool::set_threads(t);
                let s = time(if quick { 20 } else { 100 }, 5, || matmul(w.q(), &x, 1, &mut out));
                println!("{:<6} {:>8} {:>10.1} {:>9.2}", dtype.name(), t, s * 1e6, w.data.len() as f64 / s / 1e9);
            }
        }
    }

    // Multi-stream decode: a few activation rows share each weight read.
    if want("few") {
        println!("\n4096x4096 x m rows (m streams decoding together), 2 threads");
        println!("{:<6} {:>4} {:>10} {:>9}", "type", "m", "us/call", "GB/s");
        pool::set_threads(max_threads);
        for dtype in [DType::Q4_1, DType::Q5_0, DType::Q4K, DType::Q6K, DType::Q8_0] {
            let w = Mat::new(&mut rng, dtype, n, n);
            for m in [1, 2, 4, 6, 8, 10, 12, 16] {
                let x: Vec<f32> = (0..n * m).map(|_| rng.f()).collect();
                let mut out = vec![0.0; n * m];
                let s = time(if quick { 10 } else { 50 }, 5, || matmul(w.q(), &x, m, &mut out));
                println!("{:<6} {:>4} {:>10.1} {:>9.2}", dtype.name(), m, s * 1e6, w.data.len() as f64 / s / 1e9);
            }
        }
    }

    // A shared round: a few streams' decode rows plus a few prompt rows,
    // through one layer's matmuls of SmolLM2-135M (Q4_1 q, k, v, o, gate,
    // up, down), then the same shapes in Q8_0.
    if want("shared") {
        let layer = [(576, 576, 2), (192, 576, 2), (1536, 576, 2), (576, 1536, 1)];
        println!("\nSmolLM2-135M layer matmuls x m rows (a shared round)");
        println!("{:<6} {:>8} {:>4} {:>10} {:>10}", "type", "threads", "m", "us/layer", "us/row");
        for dtype in [DType::Q4_1, DType::Q8_0] {
            let mats: Vec<(Mat, usize)> = layer.iter().map(|&(r, c, k)| (Mat::new(&mut rng, dtype, r, c), k)).collect();
            for &t in &thread_counts {
                pool::set_threads(t);
                for m in [1, 4, 6, 7, 8, 9, 10, 12, 13, 16, 22] {
                    let mut total = 0.0;
                    for (w, k) in &mats {
                        let x: Vec<f32> = (0..m * w.cols).map(|_| rng.f()).collect();
                        let mut out = vec![0.0; m * w.rows];
                        total += *k as f64 * time(if quick { 20 } else { 200 }, 5, || matmul(w.q(), &x, m, &mut out));
                    }
                    println!("{:<6} {:>8} {:>4} {:>10.1} {:>10.2}", dtype.name(), t, m, total * 1e6, total * 1e6 / m as f64);
                }
            }
        }
    }

    // A matrix far larger than the caches: memory bandwidth, against a plain
    // read of the same bytes split the same way.
    if want("head") {
        println!("\nGemma 3 lm head, 262144x640 Q8_0 (178 MB), m=1; 'read' = summing the bytes");
        println!("{:<8} {:>8} {:>10} {:>9}", "what", "threads", "ms/call", "GB/s");
    }
    if want("head") {
        let w = Mat::new(&mut rng, DType::Q8_0, 262144, 640);
        let x: Vec<f32> = (0..640).map(|_| rng.f()).collect();
        let mut out = vec![0.0; 262144];
        for &t in &thread_counts {
            pool::set_threads(t);
            let s = time(if quick { 3 } else { 10 }, 3, || matmul(w.q(), &x, 1, &mut out));
            let gbs = w.data.len() as f64 / s / 1e9;
            println!("{:<8} {:>8} {:>10.2} {:>9.2}", "matvec", t, s * 1e3, gbs);
            let words: &[u64] = unsafe { std::slice::from_raw_parts(w.data.as_ptr() as *const u64, w.data.len() / 8) };
            let sums: Vec<std::sync::atomic::AtomicU64> = (0..64).map(|_| std::sync::atomic::AtomicU64::new(0)).collect();
            let s = time(if quick { 3 } else { 10 }, 3, || {
                let tasks = t * 4;
                pool::parallel_for(tasks, &|i| {
                    let part = &words[words.len() * i / tasks..words.len() * (i + 1) / tasks];
                    let v = part.iter().fold(0u64, |a, &b| a.wrapping_add(b));
                    sums[i].fetch_add(v, std::sync::atomic::Ordering::Relaxed);
                });
            });
            let gbs = w.data.len() as f64 / s / 1e9;
            println!("{:<8} {:>8} {:>10.2} {:>9.2}", "read", t, s * 1e3, gbs);
        }
    }

    // Float weights (SigLIP's MLP up projection: 4096 patches x 1152 ->
    // 4304), then the same weights against decode-sized m.
    if want("float") {
        let (m, rows, cols) = (4096, 4304, 1152);
        println!("\n[{m} x {cols}] x [{rows} x {cols}]^T float weights");
        println!("{:<6} {:>8} {:>10} {:>9}", "type", "threads", "ms/call", "GFLOP/s");
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
        let mut out = vec![0.0; m * rows];
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let w = Mat::new(&mut rng, dtype, rows, cols);
            for &t in &thread_counts {
                pool::set_threads(t);
                let s = time(1, if quick { 1 } else { 3 }, || matmul(w.q(), &x, m, &mut out));
                let flops = 2.0 * (m * rows * cols) as f64;
                println!("{:<6} {:>8} {:>10.1} {:>9.1}", dtype.name(), t, s * 1e3, flops / s / 1e9);
            }
        }
        println!("\n[m x {cols}] x [{rows} x {cols}]^T, {max_threads} threads");
        println!("{:<6} {:>4} {:>10} {:>9}", "type", "m", "us/call", "GFLOP/s");
        pool::set_threads(max_threads);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let w = Mat::new(&mut rng, dtype, rows, cols);
            for m in [1, 2, 4, 8, 16, 32, 64] {
                let s = time(if quick { 10 } else { 50 }, 5, || matmul(w.q(), &x[..m * cols], m, &mut out[..m * rows]));
                let flops = 2.0 * (m * rows * cols) as f64;
                println!("{:<6} {:>4} {:>10.1} {:>9.1}", dtype.name(), m, s * 1e6, flops / s / 1e9);
            }
        }
    }

    let m = 512;
    if want("prefill") {
        println!("\n4096x4096 x {m} rows (prefill)");
        println!("{:<6} {:>8} {:>10} {:>9}", "type", "threads", "ms/call", "GFLOP/s");
        for dtype in [DType::Q4_1, DType::Q4K, DType::Q8_0, DType::Q5_0, DType::Q6K] {
            let w = Mat::new(&mut rng, dtype, n, n);
            let x: Vec<f32> = (0..m * n).map(|_| rng.f()).collect();
            let mut out = vec![0.0; m * n];
            for &t in &thread_counts {
                pool::set_threads(t);
                let s = time(1, if quick { 1 } else { 3 }, || matmul(w.q(), &x, m, &mut out));
                let flops = 2.0 * (n * n * m) as f64;
                println!("{:<6} {:>8} {:>10.1} {:>9.1}", dtype.name(), t, s * 1e3, flops / s / 1e9);
            }
        }
    }

    // (name, [(dtype, rows, cols, count)]): one forward's matmuls.
    let models: [(&str, Vec<Shape>); 2] = [
        (
            "SmolLM2-135M Q4_1",
            vec![
                (DType::Q4_1, 576, 576, 2 * 30),
                (DType::Q4_1, 192, 576, 2 * 30),
                (DType::Q4_1, 1536, 576, 2 * 30),
                (DType::Q4_1, 576, 1536, 30),
                (DType::Q8_0, 49152, 576, 1),
            ],
        ),
        (
            "Gemma3-270M Q4_K_M",
            vec![
                (DType::Q5_0, 1024, 640, 18),
                (DType::Q5_0, 256, 640, 18),
                (DType::Q8_0, 256, 640, 18),
                (DType::Q4K, 640, 1024, 18),
                (DType::Q5_0, 2048, 640, 2 * 18),
                (DType::Q6K, 640, 2048, 18),
                (DType::Q8_0, 262144, 640, 1),
            ],
        ),
    ];
    if !want("model") {
        return;
    }
    println!("\nmatmuls of one forward (layers' shapes; the lm head for one row)");
    println!("{:<20} {:>8} {:>14} {:>18}", "model", "threads", "decode tok/s", "prefill-512 tok/s");
    for (name, shapes) in &models {
        let mats: Vec<(Mat, usize)> = shapes.iter().map(|&(d, r, c, k)| (Mat::new(&mut rng, d, r, c), k)).collect();
        for &t in &thread_counts {
            pool::set_threads(t);
            let mut decode = 0.0;
            let mut prefill = 0.0;
            for (i, (w, k)) in mats.iter().enumerate() {
                let head = i == mats.len() - 1;
                let x: Vec<f32> = (0..m * w.cols).map(|_| rng.f()).collect();
                let mut out = vec![0.0; m * w.rows];
                let s1 = time(if quick { 5 } else { 30 }, 3, || matmul(w.q(), &x[..w.cols], 1, &mut out[..w.rows]));
                decode += s1 * *k as f64;
                // Prefill computes the head for the last row only.
                let mp = if head { 1 } else { m };
                let sp = if head { s1 } else { time(1, if quick { 1 } else { 2 }, || matmul(w.q(), &x, mp, &mut out)) };
                prefill += sp * *k as f64;
            }
            println!("{:<20} {:>8} {:>14.1} {:>18.1}", name, t, 1.0 / decode, m as f64 / prefill);
        }
    }
    pool::set_threads(0);
}
