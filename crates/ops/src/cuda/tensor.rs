//! Device memory: activations (f32 with a bf16 copy), bf16 weights, the
//! paged KV pool; their uploads, downloads and growth, and the weights
//! made on the device for tests and benchmarks.
//!
//! The `Device` methods that allocate or copy (`tensor`, `upload`,
//! `download`, `weight`, `vector`, `kv_pool`) are implemented here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, ensure, Result};
use braid_formats::{DType, TensorView};
use cudarc::driver::{result as drv, sys};

use super::fuse::{self, OpRec, TRef, WRef};
use super::rt::{self, cu, DevBuf};
use super::Cuda;
use crate::KvPoolSpec;

/// Activations: f32 `[rows, cols]`, and room for a bf16 copy, which the
/// ops whose output usually feeds a product write beside it (lowering
/// keeps track of which copies are current: `lower.rs`).
pub struct CudaTensor {
    pub rows: usize,
    pub cols: usize,
    cap: usize,
    f: DevBuf,
    b: DevBuf,
}

impl CudaTensor {
    pub(super) fn fptr(&self) -> u64 {
        self.f.ptr
    }
    pub(super) fn bptr(&self) -> u64 {
        self.b.ptr
    }
    pub(super) fn len(&self) -> usize {
        self.rows * self.cols
    }
    /// The tensor as a recorded op names it.
    pub(super) fn tref(&self) -> TRef {
        TRef { f: self.f.ptr, b: self.b.ptr, rows: self.rows, cols: self.cols }
    }
}

/// Most rows of the product that one GEMM over packed q, k and v weights
/// computes ([`Cuda::pack_weights`]): past them, a GEMM each is large
/// enough alone.
pub(super) const PACK_ROWS: usize = 256;

/// Whether `ws` lie one after another in memory, in order, as one
/// `[sum of rows, cols]` weight ([`Cuda::pack_weights`]).
pub(super) fn adjacent(ws: &[WRef]) -> bool {
    ws.windows(2).all(|p| p[0].cols == p[1].cols && p[0].ptr + (p[0].rows * p[0].cols * 2) as u64 == p[1].ptr)
}

/// A bf16 weight `[rows = out, cols = in]`.
pub struct CudaWeight {
    pub rows: usize,
    pub cols: usize,
    /// Where its values start: `mem`'s start, or, once packed beside the
    /// weights one product reads with it ([`Cuda::pack_weights`]), its
    /// place in their shared buffer.
    ptr: AtomicU64,
    mem: Mutex<Arc<DevBuf>>,
    /// The RMSNorm weight (its f32 buffer) folded into the columns at
    /// load, if any (`Device::prepare`): the weight then serves only the
    /// products that read that norm.
    pub(super) folded: AtomicU64,
}

impl CudaWeight {
    pub(super) fn new(rows: usize, cols: usize, buf: DevBuf) -> CudaWeight {
        CudaWeight { rows, cols, ptr: AtomicU64::new(buf.ptr), mem: Mutex::new(Arc::new(buf)), folded: AtomicU64::new(0) }
    }

    pub(super) fn ptr(&self) -> u64 {
        self.ptr.load(Ordering::Relaxed)
    }

    fn bytes(&self) -> usize {
        self.rows * self.cols * 2
    }

    /// The weight as a recorded op names it.
    pub(super) fn wref(&self) -> WRef {
        WRef { ptr: self.ptr(), rows: self.rows, cols: self.cols, folded: self.folded.load(Ordering::Relaxed) }
    }
}

/// Paged KV in bf16: per layer, its group's `blocks × block_tokens` slots of
/// `kv_heads × head_dim` values, for K and for V.
pub struct CudaKv {
    pub spec: KvPoolSpec,
    pub(super) k: Vec<DevBuf>,
    pub(super) v: Vec<DevBuf>,
}

impl Cuda {
    pub(super) fn new_tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        let n = rows * cols;
        Ok(CudaTensor { rows, cols, cap: n, f: DevBuf::new(self.ctx(), n * 4)?, b: DevBuf::new(self.ctx(), n * 2)? })
    }

    pub(super) fn grow(&self, t: &mut CudaTensor, rows: usize, cols: usize) -> Result<()> {
        let n = rows * cols;
        t.rows = rows;
        t.cols = cols;
        if n > t.cap {
            // Grow with slack so a slowly growing batch does not realloc each time.
            let cap = n.max(t.cap + t.cap / 4);
            t.f = DevBuf::new(self.ctx(), cap * 4)?;
            t.b = DevBuf::new(self.ctx(), cap * 2)?;
            t.cap = cap;
        }
        Ok(())
    }

    /// Copy `dst.len()` values at `src` to the host once the work queued
    /// before has run: the copy queues on the stream, so the host wakes
    /// once (a synchronous copy after a stream sync costs a second round
    /// trip while the GPU idles).
    pub(super) fn read_back<T: Copy>(&self, dst: &mut [T], src: u64, what: &str) -> Result<()> {
        if !dst.is_empty() {
            let r = unsafe { cu(drv::memcpy_dtoh_async(dst, src, self.stream() as sys::CUstream), what) };
            self.record(r);
        }
        self.sync()
    }

    pub(super) fn tensor_or_empty(&self, rows: usize, cols: usize) -> CudaTensor {
        match rt::make_current(self.ctx()).and_then(|_| self.new_tensor(rows, cols)) {
            Ok(t) => t,
            Err(e) => {
                self.record(Err(e));
                CudaTensor { rows: 0, cols, cap: 0, f: DevBuf::empty(self.ctx()), b: DevBuf::empty(self.ctx()) }
            }
        }
    }

    pub(super) fn upload_f32(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        ensure!(data.len() == rows * cols, "upload: {} values for a {rows}x{cols} tensor", data.len());
        rt::make_current(self.ctx())?;
        let t = self.new_tensor(rows, cols)?;
        if !data.is_empty() {
            unsafe { cu(drv::memcpy_htod_async(t.fptr(), data, self.stream() as sys::CUstream), "upload")? };
        }
        Ok(t)
    }

    pub(super) fn download_f32(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        // Inside a forward (MoE routing): what it recorded runs first; a
        // trace reads zeros.
        if !self.flush()? {
            return Ok(vec![0.0; t.len()]);
        }
        let mut out = vec![0f32; t.len()];
        self.read_back(&mut out, t.fptr(), "download")?;
        Ok(out)
    }

    pub(super) fn load_weight(&self, view: &TensorView) -> Result<CudaWeight> {
        let (rows, cols) = match view.shape.as_slice() {
            [r, c] => (*r, *c),
            [c] => (1, *c),
            s => bail!("tensor {}: expected a 2-D weight, found shape {:?}", view.name, s),
        };
        let bits = to_bf16_bits(view, rows * cols)?;
        self.weight_from_bf16_bits(&bits, rows, cols)
    }

    pub(super) fn load_vector(&self, view: &TensorView, offset: f32) -> Result<CudaTensor> {
        let n = view.elements();
        let mut data = vec![0.0f32; n];
        crate::cpu::quant::dequantize(view.dtype, &view.data, &mut data).map_err(|e| anyhow!("tensor {}: {e}", view.name))?;
        if offset != 0.0 {
            data.iter_mut().for_each(|x| *x += offset);
        }
        self.upload_f32(&data, 1, n)
    }

    pub(super) fn new_kv_pool(&self, spec: &KvPoolSpec) -> Result<CudaKv> {
        spec.check()?;
        rt::make_current(self.ctx())?;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (i, l) in spec.layers.iter().enumerate() {
            // A layer holds its group's blocks.
            let bytes = spec.layer_blocks(i) * spec.block_tokens * l.kv_heads * l.head_dim * 2;
            for dst in [&mut k, &mut v] {
                let b = DevBuf::new(self.ctx(), bytes)?;
                if bytes > 0 {
                    unsafe { cu(drv::memset_d8_async(b.ptr, 0, bytes, self.stream() as sys::CUstream), "KV clear")? };
                }
                dst.push(b);
            }
        }
        Ok(CudaKv { spec: spec.clone(), k, v })
    }

    /// The weights each multi-weight product of a recorded forward reads
    /// (q, k and v; gate and up), moved into one buffer in that order:
    /// past the skinny GEMM's rows, one cuBLAS GEMM then computes them
    /// all (`lower.rs`), where a GEMM each left a mixed round's products
    /// too small to fill the GPU. The old buffers are freed. Which lists:
    /// [`fuse::pack_plan`].
    pub(super) fn pack_weights(&self, ops: &[OpRec], weights: &HashMap<u64, *const CudaWeight>) -> Result<()> {
        let (mut packed, mut widest) = (0, 0);
        for list in fuse::pack_plan(ops) {
            // SAFETY: the weights belong to the model the recorded forward
            // borrowed, which outlives `Device::prepare`.
            let ws: Option<Vec<&CudaWeight>> = list.iter().map(|w| weights.get(&w.ptr).map(|&w| unsafe { &*w })).collect();
            let Some(ws) = ws else { continue };
            widest = widest.max(ws.iter().map(|w| w.rows).sum::<usize>() * usize::from(ws.len() == 3));
            packed += 1;
            if adjacent(&list) {
                // Allocated side by side already (a fresh device's
                // consecutive allocations often are).
                continue;
            }
            let mem = Arc::new(DevBuf::new(self.ctx(), ws.iter().map(|w| w.bytes()).sum())?);
            let mut off = 0;
            for w in &ws {
                unsafe { cu(drv::memcpy_dtod_async(mem.ptr + off as u64, w.ptr(), w.bytes(), self.stream() as sys::CUstream), "weight pack")? };
                off += w.bytes();
            }
            // The old buffers go once their copies land: a list at a time,
            // so at most one list's weights are held twice.
            self.sync()?;
            let mut off = 0;
            for w in &ws {
                w.ptr.store(mem.ptr + off as u64, Ordering::Relaxed);
                *w.mem.lock().unwrap_or_else(|e| e.into_inner()) = mem.clone();
                off += w.bytes();
            }
        }
        let have = self.st().pack_out.last().map_or(0, |b| b.bytes);
        if widest * PACK_ROWS * 4 > have {
            let buf = DevBuf::new(self.ctx(), widest * PACK_ROWS * 4)?;
            self.st().pack_out.push(buf);
        }
        self.st().packed += packed;
        Ok(())
    }

    /// How many lists of weights `Device::prepare` has found side by side
    /// so far, moved there or allocated so ([`Cuda::pack_weights`]).
    pub fn packed_weights(&self) -> usize {
        self.st().packed
    }

    /// A weight of uniform random values in `[-amp, amp)` made on the device.
    pub fn random_weight(&self, rows: usize, cols: usize, seed: u64, amp: f32) -> Result<CudaWeight> {
        rt::make_current(self.ctx())?;
        let n = rows * cols;
        let buf = DevBuf::new(self.ctx(), n * 2)?;
        self.launch(self.inner.fns.fill_random_bf16).grid((1024, 1, 1)).block(256).ptr(buf.ptr).u64(n as u64).u64(seed).f32(amp).f32(0.0).run()?;
        Ok(CudaWeight::new(rows, cols, buf))
    }

    /// A one-row tensor filled with `v`.
    pub fn const_vector(&self, n: usize, v: f32) -> Result<CudaTensor> {
        rt::make_current(self.ctx())?;
        let t = self.new_tensor(1, n)?;
        self.launch(self.inner.fns.fill_f32).elementwise(n).ptr(t.fptr()).u64(n as u64).f32(v).run()?;
        Ok(t)
    }

    /// A weight from host f32 values (rounded to bf16).
    pub fn weight_from_f32(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaWeight> {
        ensure!(data.len() == rows * cols, "weight_from_f32: {} values for {rows}x{cols}", data.len());
        let bits: Vec<u16> = data.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
        self.weight_from_bf16_bits(&bits, rows, cols)
    }

    fn weight_from_bf16_bits(&self, bits: &[u16], rows: usize, cols: usize) -> Result<CudaWeight> {
        rt::make_current(self.ctx())?;
        let buf = DevBuf::new(self.ctx(), bits.len() * 2)?;
        if !bits.is_empty() {
            unsafe { cu(drv::memcpy_htod_async(buf.ptr, bits, self.stream() as sys::CUstream), "weight upload")? };
        }
        Ok(CudaWeight::new(rows, cols, buf))
    }

    /// Device-to-device copy bandwidth in GB/s (bytes read + written).
    pub fn bench_copy(&self, bytes: usize, iters: usize) -> Result<f64> {
        rt::make_current(self.ctx())?;
        let a = DevBuf::new(self.ctx(), bytes)?;
        let b = DevBuf::new(self.ctx(), bytes)?;
        let s = self.stream() as sys::CUstream;
        unsafe {
            cu(drv::memset_d8_async(a.ptr, 1, bytes, s), "memset")?;
            for _ in 0..3 {
                cu(drv::memcpy_dtod_async(b.ptr, a.ptr, bytes, s), "copy")?;
            }
        }
        self.sync()?;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            unsafe { cu(drv::memcpy_dtod_async(b.ptr, a.ptr, bytes, s), "copy")? };
        }
        self.sync()?;
        Ok(2.0 * bytes as f64 * iters as f64 / t.elapsed().as_secs_f64() / 1e9)
    }

    /// Bytes of device memory (free, total).
    pub fn memory(&self) -> Result<(usize, usize)> {
        rt::make_current(self.ctx())?;
        drv::mem_get_info().map_err(|e| anyhow!("cuMemGetInfo: {e:?}"))
    }
}

fn to_bf16_bits(view: &TensorView, n: usize) -> Result<Vec<u16>> {
    match view.dtype {
        DType::BF16 => {
            ensure!(view.data.len() == n * 2, "tensor {}: {} bytes for {n} bf16 values", view.name, view.data.len());
            Ok(view.data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
        }
        _ => {
            let mut f = vec![0f32; n];
            crate::cpu::quant::dequantize(view.dtype, &view.data, &mut f).map_err(|e| anyhow!("tensor {}: {e}", view.name))?;
            Ok(f.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect())
        }
    }
}
