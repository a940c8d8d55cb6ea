//! cuBLAS: bf16 GEMMs with f32 accumulation, for products of more rows
//! than the GEMV kernels take (prefill).

use anyhow::{anyhow, Result};
use cudarc::cublas::sys as cb;

use super::exec::Cmd;
use super::rt::DevBuf;
use super::Cuda;

/// cuBLAS's workspace, set once on its handle (so it allocates none of its
/// own, inside graph capture or out).
const CUBLAS_WS: usize = 32 << 20;

/// What a GEMM writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GemmOut {
    F32,
    Bf16,
    /// f32, added to what `y` holds.
    AddF32,
}

/// A cuBLAS handle on `stream` and its workspace.
pub(super) fn create(ctx: usize, stream: usize) -> Result<(usize, DevBuf)> {
    let mut handle: cb::cublasHandle_t = std::ptr::null_mut();
    unsafe { cb::cublasCreate_v2(&mut handle) }.result().map_err(|e| anyhow!("cublasCreate: {e:?}"))?;
    let ws = DevBuf::new(ctx, CUBLAS_WS)?;
    unsafe {
        cb::cublasSetStream_v2(handle, stream as cb::cudaStream_t).result().map_err(|e| anyhow!("cublasSetStream: {e:?}"))?;
        cb::cublasSetWorkspace_v2(handle, ws.ptr as *mut _, CUBLAS_WS).result().map_err(|e| anyhow!("cublasSetWorkspace: {e:?}"))?;
    }
    Ok((handle as usize, ws))
}

/// # Safety
/// `handle` came from [`create`] and is not used again.
pub(super) unsafe fn destroy(handle: usize) {
    let _ = cb::cublasDestroy_v2(handle as cb::cublasHandle_t);
}

impl Cuda {
    /// `y[n, m] = x[n, k] · w[m, k]ᵀ` with bf16 operands and f32 accumulation;
    /// `y` is f32 or bf16, or f32 that the product is added to.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(&self, w: u64, x: u64, y: u64, m: usize, n: usize, k: usize, out: GemmOut) -> Result<()> {
        self.emit(Cmd::Gemm { w, x, y, m, n, k, out })
    }

    /// bf16 GEMM rate in TFLOP/s for `[n, n] · [n, n]` (random operands).
    pub fn bench_gemm(&self, n: usize, iters: usize) -> Result<f64> {
        let a = self.random_weight(n, n, 1, 1.0)?;
        let b = self.random_weight(n, n, 2, 1.0)?;
        let c = DevBuf::new(self.ctx(), n * n * 2)?;
        for _ in 0..3 {
            self.gemm(a.buf.ptr, b.buf.ptr, c.ptr, n, n, n, GemmOut::Bf16)?;
        }
        self.sync()?;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            self.gemm(a.buf.ptr, b.buf.ptr, c.ptr, n, n, n, GemmOut::Bf16)?;
        }
        self.sync()?;
        Ok(2.0 * (n as f64).powi(3) * iters as f64 / t.elapsed().as_secs_f64() / 1e12)
    }
}
