//! Dev experiment (not part of braid): how fast cuBLAS and cuBLASLt's
//! algorithms run the products of a mixed round (a few decode rows beside
//! a prompt chunk: 33-256 rows of x) at a model's weight shapes.
//!
//! `gemm_sweep [--rows 38,70,134] [--shapes 3072x2048,2048x2048,16384x2048,2048x8192] [--top 12]
//! [--grouped 2048,512,512x2048;8192,8192x2048]`
//!
//! Each product `y[n, m] = x[n, k] · w[m, k]ᵀ` (bf16, f32 accumulation, f32
//! out, as braid calls it) rotates over enough weight copies that they
//! come from HBM, not L2, as in a served round. Prints µs a product and
//! the weights' read rate for cublasGemmEx (braid's call) and for each of
//! cuBLASLt's heuristic algorithms, also forced to split k. With
//! `--grouped`, instead: weights sharing x (q, k, v; gate, up) as a launch
//! each, against one cublasGemmGroupedBatchedEx (and cublasGemmBatchedEx
//! where their widths are equal).

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("built without the cuda feature");
}

#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    sweep::run()
}

#[cfg(feature = "cuda")]
mod sweep {
    use anyhow::{anyhow, Result};
    use cudarc::cublas::sys as cb;
    use cudarc::cublaslt::sys as lt;
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
    use std::ffi::c_void;
    use std::sync::Arc;
    use std::time::Instant;

    const WS: usize = 32 << 20;

    struct Bufs {
        ws: Vec<CudaSlice<u16>>,
        x: CudaSlice<u16>,
        y: CudaSlice<f32>,
    }

    fn ptr<T>(s: &CudaSlice<T>, st: &Arc<CudaStream>) -> u64 {
        let (p, _g) = s.device_ptr(st);
        p
    }

    /// Microseconds a call of `f` takes, the weights rotating (median of 5
    /// batches of 20).
    fn time(st: &Arc<CudaStream>, copies: usize, mut f: impl FnMut(usize) -> Result<()>) -> Result<f64> {
        for i in 0..copies {
            f(i)?;
        }
        st.synchronize()?;
        let mut v = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            for i in 0..20 {
                f(i % copies)?;
            }
            st.synchronize()?;
            v.push(t.elapsed().as_secs_f64() * 1e6 / 20.0);
        }
        v.sort_by(f64::total_cmp);
        Ok(v[2])
    }

    pub fn run() -> Result<()> {
        let mut rows = vec![38usize, 70, 134];
        let mut shapes = vec![(3072usize, 2048usize), (2048, 2048), (16384, 2048), (2048, 8192)];
        let mut top = 12usize;
        let mut grouped: Vec<(Vec<usize>, usize)> = Vec::new();
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            let v = args.next().ok_or_else(|| anyhow!("{a} needs a value"))?;
            match a.as_str() {
                "--rows" => rows = v.split(',').map(|s| s.parse()).collect::<Result<_, _>>()?,
                "--shapes" => {
                    shapes = v
                        .split(',')
                        .map(|s| {
                            let (m, k) = s.split_once('x').ok_or_else(|| anyhow!("shape {s}: MxK"))?;
                            Ok((m.parse()?, k.parse()?))
                        })
                        .collect::<Result<_>>()?
                }
                "--top" => top = v.parse()?,
                "--grouped" => {
                    grouped = v
                        .split(';')
                        .map(|g| {
                            let (ms, k) = g.split_once('x').ok_or_else(|| anyhow!("group {g}: M,M,...xK"))?;
                            Ok((ms.split(',').map(|m| m.parse()).collect::<Result<Vec<usize>, _>>()?, k.parse()?))
                        })
                        .collect::<Result<_>>()?
                }
                _ => return Err(anyhow!("unknown {a}")),
            }
        }
        let ctx = CudaContext::new(0)?;
        let st = ctx.default_stream();
        let cs = st.cu_stream() as cb::cudaStream_t;
        let mut blas: cb::cublasHandle_t = std::ptr::null_mut();
        let work: CudaSlice<u8> = st.alloc_zeros(WS)?;
        unsafe {
            cb::cublasCreate_v2(&mut blas).result()?;
            cb::cublasSetStream_v2(blas, cs).result()?;
            cb::cublasSetWorkspace_v2(blas, ptr(&work, &st) as *mut c_void, WS).result()?;
        }
        if !grouped.is_empty() {
            return grouped_sweep(blas, &st, &grouped, &rows);
        }
        let lth = cudarc::cublaslt::result::create_handle()?;
        println!("| m x k | rows | what | us | weights GB/s |\n| --- | ---: | --- | ---: | ---: |");
        for &(m, k) in &shapes {
            let bytes = m * k * 2;
            let copies = (256 << 20) / bytes + 1;
            let host: Vec<u16> = (0..m * k).map(|i| 0x3c00 ^ ((i as u16).wrapping_mul(40503) & 0x00ff)).collect();
            let ws = (0..copies).map(|_| st.clone_htod(&host)).collect::<Result<Vec<_>, _>>()?;
            let most = *rows.iter().max().unwrap_or(&1);
            let xh: Vec<u16> = (0..most * k).map(|i| 0x3c00 ^ ((i as u16).wrapping_mul(2654) & 0x00ff)).collect();
            let b = Bufs { ws, x: st.clone_htod(&xh)?, y: st.alloc_zeros(most * m)? };
            for &n in &rows {
                let rate = |us: f64| bytes as f64 / us / 1e3;
                let wp: Vec<u64> = b.ws.iter().map(|w| ptr(w, &st)).collect();
                let (xp, yp) = (ptr(&b.x, &st), ptr(&b.y, &st));
                let us = time(&st, copies, |i| gemm_ex(blas, wp[i], xp, yp, m, n, k))?;
                println!("| {m}x{k} | {n} | cublasGemmEx | {us:.1} | {:.0} |", rate(us));
                let mut found = lt_sweep(lth, &st, &wp, xp, yp, ptr(&work, &st), m, n, k, top, copies)?;
                found.sort_by(|a, b| a.1.total_cmp(&b.1));
                for (what, us) in found.iter().take(top) {
                    println!("| {m}x{k} | {n} | {what} | {us:.1} | {:.0} |", rate(*us));
                }
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn lt_sweep(
        h: lt::cublasLtHandle_t,
        st: &Arc<CudaStream>,
        wp: &[u64],
        xp: u64,
        yp: u64,
        work: u64,
        m: usize,
        n: usize,
        k: usize,
        top: usize,
        copies: usize,
    ) -> Result<Vec<(String, f64)>> {
        use cudarc::cublaslt::result as r;
        let desc = r::create_matmul_desc(lt::cublasComputeType_t::CUBLAS_COMPUTE_32F, lt::cudaDataType::CUDA_R_32F)?;
        let t = cb::cublasOperation_t::CUBLAS_OP_T;
        unsafe {
            r::set_matmul_desc_attribute(
                desc,
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &t as *const _ as *const c_void,
                std::mem::size_of_val(&t),
            )?;
        }
        let a = r::create_matrix_layout(lt::cudaDataType::CUDA_R_16BF, k as u64, m as u64, k as i64)?;
        let bl = r::create_matrix_layout(lt::cudaDataType::CUDA_R_16BF, k as u64, n as u64, k as i64)?;
        let c = r::create_matrix_layout(lt::cudaDataType::CUDA_R_32F, m as u64, n as u64, m as i64)?;
        let pref = r::create_matmul_pref()?;
        let wsz = WS as u64;
        unsafe {
            r::set_matmul_pref_attribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &wsz as *const _ as *const c_void,
                8,
            )?;
        }
        let mut res: Vec<lt::cublasLtMatmulHeuristicResult_t> = vec![unsafe { std::mem::zeroed() }; 32];
        let mut got = 0i32;
        unsafe {
            lt::cublasLtMatmulAlgoGetHeuristic(h, desc, a, bl, c, c, pref, 32, res.as_mut_ptr(), &mut got).result()?;
        }
        res.truncate(got.max(0) as usize);
        let cfg = |algo: &lt::cublasLtMatmulAlgo_t, attr: lt::cublasLtMatmulAlgoConfigAttributes_t| -> u32 {
            let mut v = 0u32;
            let mut w = 0usize;
            unsafe {
                let _ = lt::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, &mut v as *mut u32 as *mut c_void, 4, &mut w);
            }
            v
        };
        use lt::cublasLtMatmulAlgoConfigAttributes_t as A;
        let name = |algo: &lt::cublasLtMatmulAlgo_t| {
            format!(
                "lt id {} tile {} splitk {} red {} stages {}",
                cfg(algo, A::CUBLASLT_ALGO_CONFIG_ID),
                cfg(algo, A::CUBLASLT_ALGO_CONFIG_TILE_ID),
                cfg(algo, A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                cfg(algo, A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                cfg(algo, A::CUBLASLT_ALGO_CONFIG_STAGES_ID)
            )
        };
        let (alpha, beta) = (1f32, 0f32);
        let run = |algo: &lt::cublasLtMatmulAlgo_t, i: usize| unsafe {
            lt::cublasLtMatmul(
                h,
                desc,
                &alpha as *const f32 as *const c_void,
                wp[i] as *const c_void,
                a,
                xp as *const c_void,
                bl,
                &beta as *const f32 as *const c_void,
                yp as *const c_void,
                c,
                yp as *mut c_void,
                c,
                algo,
                work as *mut c_void,
                WS,
                st.cu_stream() as lt::cudaStream_t,
            )
            .result()
            .map_err(|e| anyhow!("{e:?}"))
        };
        let mut out = Vec::new();
        for (j, hr) in res.iter().enumerate() {
            let us = time(st, copies, |i| run(&hr.algo, i))?;
            out.push((format!("#{j} {}", name(&hr.algo)), us));
            if j >= top {
                continue;
            }
            // The same algorithm forced to split k (where cuBLASLt takes it).
            for split in [2u32, 4, 8, 16] {
                let mut algo = hr.algo;
                let mut check: lt::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
                let ok = unsafe {
                    lt::cublasLtMatmulAlgoConfigSetAttribute(&mut algo, A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split as *const u32 as *const c_void, 4)
                        .result()
                        .is_ok()
                        && lt::cublasLtMatmulAlgoCheck(h, desc, a, bl, c, c, &algo, &mut check).result().is_ok()
                        && check.workspaceSize <= WS
                };
                if ok {
                    if let Ok(us) = time(st, copies, |i| run(&algo, i)) {
                        out.push((format!("#{j} {} (forced)", name(&algo)), us));
                    }
                }
            }
        }
        Ok(out)
    }

    /// `y[n, m] = x[n, k] · w[m, k]ᵀ` as braid calls cuBLAS (bf16 operands,
    /// f32 accumulation and out).
    fn gemm_ex(blas: cb::cublasHandle_t, w: u64, x: u64, y: u64, m: usize, n: usize, k: usize) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        unsafe {
            cb::cublasGemmEx(
                blas,
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                cb::cudaDataType::CUDA_R_16BF,
                k as i32,
                x as *const c_void,
                cb::cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                cb::cudaDataType::CUDA_R_32F,
                m as i32,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
            .result()
            .map_err(|e| anyhow!("{e:?}"))
        }
    }

    /// Each group's weights as a launch each, as one grouped launch, and
    /// (equal widths) as one batched launch.
    fn grouped_sweep(blas: cb::cublasHandle_t, st: &Arc<CudaStream>, groups: &[(Vec<usize>, usize)], rows: &[usize]) -> Result<()> {
        println!("| weights x k | rows | what | us | weights GB/s |\n| --- | ---: | --- | ---: | ---: |");
        let (alpha, beta) = (1f32, 0f32);
        for (ms, k) in groups {
            let k = *k;
            let bytes: usize = ms.iter().map(|m| m * k * 2).sum();
            let copies = (256 << 20) / bytes + 1;
            let most = *rows.iter().max().unwrap_or(&1);
            let ws: Vec<Vec<CudaSlice<u16>>> =
                (0..copies).map(|_| ms.iter().map(|&m| st.clone_htod(&vec![0x3c00u16; m * k])).collect::<Result<Vec<_>, _>>()).collect::<Result<_, _>>()?;
            let x: CudaSlice<u16> = st.clone_htod(&vec![0x3c00u16; most * k])?;
            let ys: Vec<CudaSlice<f32>> = ms.iter().map(|&m| st.alloc_zeros(most * m)).collect::<Result<_, _>>()?;
            let xp = ptr(&x, st);
            let yp: Vec<u64> = ys.iter().map(|y| ptr(y, st)).collect();
            // Per copy, the device arrays of A, B and C pointers.
            let arrays: Vec<(CudaSlice<u64>, CudaSlice<u64>, CudaSlice<u64>)> = ws
                .iter()
                .map(|c| {
                    let a: Vec<u64> = c.iter().map(|w| ptr(w, st)).collect();
                    Ok((st.clone_htod(&a)?, st.clone_htod(&vec![xp; ms.len()])?, st.clone_htod(&yp)?))
                })
                .collect::<Result<_>>()?;
            let name = format!("{}x{k}", ms.iter().map(|m| m.to_string()).collect::<Vec<_>>().join(","));
            let rate = |us: f64| bytes as f64 / us / 1e3;
            for &n in rows {
                let each = time(st, copies, |i| {
                    for (j, &m) in ms.iter().enumerate() {
                        gemm_ex(blas, ptr(&ws[i][j], st), xp, yp[j], m, n, k)?;
                    }
                    Ok(())
                })?;
                println!("| {name} | {n} | a launch each | {each:.1} | {:.0} |", rate(each));
                let g = ms.len();
                let ta = vec![cb::cublasOperation_t::CUBLAS_OP_T; g];
                let tb = vec![cb::cublasOperation_t::CUBLAS_OP_N; g];
                let mi: Vec<i32> = ms.iter().map(|&m| m as i32).collect();
                let (ni, ki) = (vec![n as i32; g], vec![k as i32; g]);
                let (al, be) = (vec![alpha; g], vec![beta; g]);
                let ones = vec![1i32; g];
                let one = time(st, copies, |i| unsafe {
                    cb::cublasGemmGroupedBatchedEx(
                        blas,
                        ta.as_ptr(),
                        tb.as_ptr(),
                        mi.as_ptr(),
                        ni.as_ptr(),
                        ki.as_ptr(),
                        al.as_ptr() as *const c_void,
                        ptr(&arrays[i].0, st) as *const *const c_void,
                        cb::cudaDataType::CUDA_R_16BF,
                        ki.as_ptr(),
                        ptr(&arrays[i].1, st) as *const *const c_void,
                        cb::cudaDataType::CUDA_R_16BF,
                        ki.as_ptr(),
                        be.as_ptr() as *const c_void,
                        ptr(&arrays[i].2, st) as *const *mut c_void,
                        cb::cudaDataType::CUDA_R_32F,
                        mi.as_ptr(),
                        g as i32,
                        ones.as_ptr(),
                        cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    )
                    .result()
                    .map_err(|e| anyhow!("{e:?}"))
                });
                match one {
                    Ok(us) => println!("| {name} | {n} | grouped, one call | {us:.1} | {:.0} |", rate(us)),
                    Err(e) => println!("| {name} | {n} | grouped, one call | {e} | |"),
                }
                if ms.iter().all(|&m| m == ms[0]) {
                    let m = ms[0];
                    let us = time(st, copies, |i| unsafe {
                        cb::cublasGemmBatchedEx(
                            blas,
                            cb::cublasOperation_t::CUBLAS_OP_T,
                            cb::cublasOperation_t::CUBLAS_OP_N,
                            m as i32,
                            n as i32,
                            k as i32,
                            &alpha as *const f32 as *const c_void,
                            ptr(&arrays[i].0, st) as *const *const c_void,
                            cb::cudaDataType::CUDA_R_16BF,
                            k as i32,
                            ptr(&arrays[i].1, st) as *const *const c_void,
                            cb::cudaDataType::CUDA_R_16BF,
                            k as i32,
                            &beta as *const f32 as *const c_void,
                            ptr(&arrays[i].2, st) as *const *mut c_void,
                            cb::cudaDataType::CUDA_R_32F,
                            m as i32,
                            g as i32,
                            cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                            cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
                        )
                        .result()
                        .map_err(|e| anyhow!("{e:?}"))
                    })?;
                    println!("| {name} | {n} | batched, one call | {us:.1} | {:.0} |", rate(us));
                }
            }
        }
        Ok(())
    }
}
