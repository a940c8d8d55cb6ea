//! Products of more rows than the GEMV kernels take: up to
//! `Tuning::skinny_max_rows` rows (32 at most) the skinny GEMM
//! (`kernels/skinny.cu`, tensor cores, the weights streamed once), beyond
//! it (prefill) cuBLAS bf16 GEMMs with f32 accumulation.

use anyhow::{anyhow, ensure, Result};
use cudarc::cublas::sys as cb;

use super::exec::Cmd;
use super::fuse::TRef;
use super::rt::DevBuf;
use super::Cuda;

/// cuBLAS's workspace, set once on its handle (so it allocates none of its
/// own, inside graph capture or out).
const CUBLAS_WS: usize = 32 << 20;

/// The most rows of x the skinny GEMM takes (4 tiles of 8; see skinny.cu).
pub(super) const SKINNY_MAX_ROWS: usize = 32;

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
        if self.skinny_fits(n, k) {
            return self.skinny_cmd(x, n, k, &[(w, m, y)], out);
        }
        self.emit(Cmd::Gemm { w, x, y, m, n, k, out })
    }

    /// Whether `n` rows of `k` values take the skinny GEMM (its MMAs need
    /// Ampere or later; k in steps of 32; at most `SKINNY_MAX_ROWS`).
    pub(super) fn skinny_fits(&self, n: usize, k: usize) -> bool {
        self.inner.cc.0 >= 8 && (1..=self.inner.tuning.skinny_max_rows.min(SKINNY_MAX_ROWS)).contains(&n) && k > 0 && k.is_multiple_of(32)
    }

    /// Tiles of 16 weight rows a skinny block takes (8, 4, 2 or 1, at least
    /// `min`): the most that still gives every SM a block of the `tiles`
    /// (times the grid's rows); fewer tiles a block split k over more warps.
    fn skinny_tiles(&self, tiles: usize, min: usize) -> usize {
        let mut r = 8;
        while r > min && tiles.div_ceil(r) < self.inner.sms {
            r /= 2;
        }
        r
    }

    /// Whether a skinny launch of `blocks` blocks takes programmatic
    /// dependent launch (see `Tuning::skinny_pdl_per_sm`).
    fn skinny_pdl(&self, blocks: usize) -> bool {
        blocks <= self.inner.tuning.skinny_pdl_per_sm * self.inner.sms
    }

    /// `y = x · wᵀ` for up to three `(weight, its rows, y)` sharing the
    /// input (`x`: `n` bf16 rows of `k`), as one skinny launch.
    pub(super) fn skinny_cmd(&self, x: u64, n: usize, k: usize, ws: &[(u64, usize, u64)], out: GemmOut) -> Result<()> {
        ensure!(!ws.is_empty() && ws.len() <= 3, "skinny gemm: {} weights in one launch", ws.len());
        let tiles: usize = ws.iter().map(|w| w.1.div_ceil(16)).sum();
        let r = self.skinny_tiles(tiles, 1);
        let get = |i: usize| ws.get(i).copied().unwrap_or((0, 0, 0));
        let (a, b, c) = (get(0), get(1), get(2));
        let nb = [a.1.div_ceil(16 * r), b.1.div_ceil(16 * r), c.1.div_ceil(16 * r)];
        let mode = match out {
            GemmOut::F32 => 0,
            GemmOut::Bf16 => 1,
            GemmOut::AddF32 => 2,
        };
        let blocks: usize = nb.iter().sum();
        self.launch(self.inner.fns.gemm_skinny)
            .grid((1, blocks as u32, 1))
            .block(256)
            .pdl(self.skinny_pdl(blocks))
            .ptr(x)
            .int(n)
            .int(k / 8)
            .int(r)
            .ptr(a.0)
            .ptr(b.0)
            .ptr(c.0)
            .ptr(a.2)
            .ptr(b.2)
            .ptr(c.2)
            .int(a.1)
            .int(b.1)
            .int(c.1)
            .int(nb[0])
            .int(nb[1])
            .i32(mode)
            .run()
    }

    /// `out = act(x · gateᵀ) * (x · upᵀ)` (f32 and bf16; `x`: `n` bf16 rows
    /// of `k`, the weights `m` rows each) as one skinny launch.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn skinny_gated_cmd(&self, x: u64, n: usize, k: usize, gate: u64, up: u64, m: usize, act: i32, out: TRef) -> Result<()> {
        let r = self.skinny_tiles(2 * m.div_ceil(16), 2);
        let blocks = m.div_ceil(8 * r);
        self.launch(self.inner.fns.gemm_skinny_gated)
            .grid((1, blocks as u32, 1))
            .block(256)
            .pdl(self.skinny_pdl(blocks))
            .ptr(x)
            .int(n)
            .int(k / 8)
            .int(r)
            .ptr(gate)
            .ptr(up)
            .int(m)
            .i32(act)
            .ptr(out.f)
            .ptr(out.b)
            .run()
    }

    /// bf16 GEMM rate in TFLOP/s for `[n, n] · [n, n]` (random operands).
    pub fn bench_gemm(&self, n: usize, iters: usize) -> Result<f64> {
        let a = self.random_weight(n, n, 1, 1.0)?;
        let b = self.random_weight(n, n, 2, 1.0)?;
        let c = DevBuf::new(self.ctx(), n * n * 2)?;
        for _ in 0..3 {
            self.gemm(a.ptr(), b.ptr(), c.ptr, n, n, n, GemmOut::Bf16)?;
        }
        self.sync()?;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            self.gemm(a.ptr(), b.ptr(), c.ptr, n, n, n, GemmOut::Bf16)?;
        }
        self.sync()?;
        Ok(2.0 * (n as f64).powi(3) * iters as f64 / t.elapsed().as_secs_f64() / 1e12)
    }
}
