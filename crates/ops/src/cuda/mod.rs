//! The CUDA device: bf16 weights, f32 activations (each with a bf16 copy for
//! the products), bf16 paged KV, kernels compiled by NVRTC for the device's
//! arch, cuBLAS bf16 GEMMs with f32 accumulation, fusion by op sequence and
//! CUDA graphs for decode rounds (`exec.rs`).
//!
//! The libraries load at run time, so this builds where no CUDA is
//! installed; [`Cuda::new`] reports a missing driver or library as an error.
//!
//! The `Device` ops return nothing, so a failure inside one (a launch error,
//! a shape the kernels do not cover) is kept and returned by the next call
//! that returns a `Result` (`download`, [`Cuda::sync`]); once one is kept,
//! later ops do nothing (`Cuda::op`).
//!
//! By concern: `rt` (driver, NVRTC, buffers), `kernels` (the CUDA C in
//! `kernels/`), `launch` (typed launches), `arena` (index uploads), `exec`
//! (recording forwards, graphs, forwards done ahead), `fuse` (which op
//! runs fuse), `lower` (ops into commands), `tensor` (tensors, weights, the
//! KV pool), `base` (the primitives as recorded), `gemm` (cuBLAS), `gemv`
//! (few-row products), `attention`, `sampling`, `recurrent` (the hybrid
//! families), `profile`, `tuning`.

mod arena;
mod attention;
mod base;
mod branch;
mod exec;
mod fuse;
mod gemm;
mod gemv;
mod kernels;
mod launch;
mod lower;
mod profile;
mod recurrent;
mod rt;
mod sampling;
mod tensor;
mod tuning;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{anyhow, bail, ensure, Result};
use braid_formats::TensorView;
use cudarc::driver::{result as drv, sys, CudaContext};

use crate::{Act, AttnSeq, Device, DeviceCaps, Forward, KvDtype, KvPoolSpec, Map, MoeOps, Penalty, Rope, RowPick, RowPicked};
use rt::{cu, DevBuf};

pub use exec::MAX_GRAPHS;
pub use rt::{check_libraries, kernel_cache_dir};
pub use tensor::{CudaKv, CudaTensor, CudaWeight};
pub use tuning::Tuning;

/// What the ops change as they run, by concern. One mutex: only the lane
/// thread uses the device, the lock is there for `Sync`.
struct State {
    /// The first error; once set, ops do nothing.
    error: Option<String>,
    exec: exec::Exec,
    arena: arena::Arena,
    attn: attention::Attn,
    sampling: sampling::Scratch,
    prof: profile::Profile,
    /// Where one GEMM over packed q, k and v weights writes (f32, up to
    /// [`tensor::PACK_ROWS`] rows of the widest list), before `rope_kv`
    /// splits it. Every one made stays: graphs hold their addresses.
    pack_out: Vec<DevBuf>,
    /// Lists of weights packed ([`Cuda::packed_weights`]).
    packed: usize,
}

struct Inner {
    _ctx: Arc<CudaContext>,
    ctx: usize,
    stream: usize,
    cublas: usize,
    _cublas_ws: DevBuf,
    /// Streams for branches (`branch.rs`); none with `tuning.branches` off.
    sides: branch::Sides,
    arch: String,
    cc: (i32, i32),
    sms: usize,
    name: String,
    fns: kernels::Fns,
    arena: DevBuf,
    graphs_enabled: AtomicBool,
    /// The knobs the device opened with, in their ranges.
    tuning: Tuning,
    /// Launch kernels with programmatic dependent launch: `tuning.pdl` on
    /// a GPU that has it (Hopper on).
    pdl: bool,
    /// Kernels (name prefixes) not launched at all ([`Tuning::skip_from_env`]).
    #[cfg(feature = "cuda-tuning")]
    skip: Vec<String>,
    st: Mutex<State>,
    /// The hybrid families' kernels (loaded on first use) and scratch.
    hybrid: recurrent::Hybrid,
}

// Raw handles are used from one thread at a time (the lane thread); the
// state behind them is guarded by the mutex.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        if rt::make_current(self.ctx).is_ok() {
            unsafe {
                let _ = sys::cuStreamSynchronize(self.stream as sys::CUstream);
                if let Ok(mut st) = self.st.lock() {
                    st.exec.destroy_all();
                    st.sampling.free_ids_back();
                }
                drop(std::mem::replace(&mut self.sides, branch::Sides::none()));
                gemm::destroy(self.cublas);
                let _ = drv::stream::destroy(self.stream as sys::CUstream);
            }
        }
    }
}

/// The CUDA device (one GPU). Cloning shares the device.
#[derive(Clone)]
pub struct Cuda {
    inner: Arc<Inner>,
}

impl Cuda {
    /// Open GPU `ordinal`: load the libraries, compile (or load the cached)
    /// kernels for its arch, set up cuBLAS. The tuning is the default one
    /// ([`Tuning::initial`]).
    pub fn new(ordinal: usize) -> Result<Cuda> {
        Self::with_tuning(ordinal, Tuning::initial())
    }

    /// [`Cuda::new`] with other tuning knobs (dev tools and benchmarks).
    pub fn with_tuning(ordinal: usize, tuning: Tuning) -> Result<Cuda> {
        rt::check_libraries()?;
        rt::guarded("opening the CUDA device", || Self::open(ordinal, tuning.limited()))
    }

    fn open(ordinal: usize, tuning: Tuning) -> Result<Cuda> {
        cu(drv::init(), "cuInit (is an NVIDIA GPU and driver present?)")?;
        let count = drv::device::get_count().map_err(|e| anyhow!("cuDeviceGetCount: {e:?}"))?;
        ensure!((ordinal as i32) < count, "CUDA device {ordinal} requested, but {count} GPU(s) are visible");
        let ctx = CudaContext::new(ordinal).map_err(|e| anyhow!("creating a CUDA context on device {ordinal}: {e:?}"))?;
        let raw_ctx = ctx.cu_ctx() as usize;
        rt::make_current(raw_ctx)?;
        let cc = ctx.compute_capability().map_err(|e| anyhow!("compute capability: {e:?}"))?;
        let name = ctx.name().unwrap_or_else(|_| "GPU".into());
        let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).unwrap_or(100) as usize;
        let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking).map_err(|e| anyhow!("cuStreamCreate: {e:?}"))? as usize;
        let arch = rt::arch_name(cc);
        let m = rt::compile_and_load(&kernels::base_source(&tuning), &arch)?;
        let mut prof = profile::Profile::default();
        let fns = kernels::Fns::load(&m, &mut prof.names)?;
        let (cublas, cublas_ws) = gemm::create(raw_ctx, stream)?;
        // Branches only speed rounds up: without their streams, rounds run
        // one command after another.
        let sides = if tuning.branches {
            branch::Sides::new(raw_ctx).unwrap_or_else(|e| {
                tracing::warn!("no side streams for branches ({e:#}): a round's commands run one after another");
                branch::Sides::none()
            })
        } else {
            branch::Sides::none()
        };
        let arena = DevBuf::new(raw_ctx, arena::ARENA_WORDS * 4)?;
        Ok(Cuda {
            inner: Arc::new(Inner {
                _ctx: ctx,
                ctx: raw_ctx,
                stream,
                cublas,
                _cublas_ws: cublas_ws,
                sides,
                arch,
                cc,
                sms,
                name,
                fns,
                arena,
                graphs_enabled: AtomicBool::new(tuning.graphs),
                pdl: cc.0 >= 9 && tuning.pdl,
                tuning,
                #[cfg(feature = "cuda-tuning")]
                skip: Tuning::skip_from_env(),
                st: Mutex::new(State {
                    error: None,
                    exec: exec::Exec::default(),
                    arena: arena::Arena::default(),
                    attn: attention::Attn::new(raw_ctx),
                    sampling: sampling::Scratch::new(raw_ctx),
                    prof,
                    pack_out: Vec::new(),
                    packed: 0,
                }),
                hybrid: recurrent::Hybrid::default(),
            }),
        })
    }

    /// Parse `cuda`, `cuda:N`.
    pub fn parse_ordinal(spec: &str) -> Option<usize> {
        match spec {
            "cuda" | "gpu" => Some(0),
            s => s.strip_prefix("cuda:").and_then(|n| n.parse().ok()),
        }
    }

    pub fn arch(&self) -> &str {
        &self.inner.arch
    }

    pub fn multiprocessors(&self) -> usize {
        self.inner.sms
    }

    /// The knobs the device opened with (in their ranges).
    pub fn tuning(&self) -> &Tuning {
        &self.inner.tuning
    }

    fn st(&self) -> MutexGuard<'_, State> {
        self.inner.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ctx(&self) -> usize {
        self.inner.ctx
    }

    fn stream(&self) -> usize {
        self.inner.stream
    }

    /// Keep the first error: later ops do nothing, the next call that
    /// returns a `Result` returns it.
    fn keep_error(&self, e: anyhow::Error) {
        self.st().error.get_or_insert(format!("{e:#}"));
    }

    fn record(&self, r: Result<()>) {
        if let Err(e) = r {
            self.keep_error(e);
        }
    }

    /// The first error kept, if any.
    fn check_error(&self) -> Result<()> {
        match &self.st().error {
            Some(e) => bail!("CUDA device error: {e}"),
            None => Ok(()),
        }
    }

    /// Wait for the device and return the first error so far.
    pub fn sync(&self) -> Result<()> {
        rt::make_current(self.ctx())?;
        let r = unsafe { sys::cuStreamSynchronize(self.stream() as sys::CUstream).result() };
        let mut st = self.st();
        if let Err(e) = r {
            st.error.get_or_insert(format!("CUDA error: {e:?}"));
        }
        match &st.error {
            Some(e) => bail!("CUDA device error: {e}"),
            None => Ok(()),
        }
    }

    /// Whether ops should run at all (no error kept), making the context current.
    fn ready(&self) -> bool {
        if self.st().error.is_some() {
            return false;
        }
        if let Err(e) = rt::make_current(self.ctx()) {
            self.record(Err(e));
            return false;
        }
        true
    }

    /// Every op's preamble: nothing once an error is kept, else run `f`
    /// and keep its error (see the module docs).
    fn op(&self, f: impl FnOnce() -> Result<()>) {
        let _ = self.try_op(f);
    }

    /// [`Cuda::op`] that also returns the error it kept (the ops that
    /// return a `Result`).
    fn try_op(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
        if !self.ready() {
            return Ok(());
        }
        let r = f();
        if let Err(e) = &r {
            self.st().error.get_or_insert(format!("{e:#}"));
        }
        r
    }

    #[cfg(feature = "cuda-tuning")]
    /// Kernel `f` is one `BRAID_CUDA_SKIP` names (a diagnostic build only).
    fn skipped(&self, f: usize) -> bool {
        !self.inner.skip.is_empty() && self.st().prof.names.get(&f).is_some_and(|n| self.inner.skip.iter().any(|s| n.starts_with(s.as_str())))
    }
}

/// Whether libnvrtc can be loaded.
pub fn nvrtc_present() -> bool {
    std::panic::catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false)
}

/// Compile every kernel for `arch` (e.g. `sm_90a`) without a GPU: needs
/// only libnvrtc. Checks the CUDA sources where no device is present.
pub fn compile_check(arch: &str, head_dims: &[usize], groups: &[usize]) -> Result<()> {
    ensure!(nvrtc_present(), "libnvrtc is not on the library path");
    let t = Tuning::initial().limited();
    rt::guarded("NVRTC", || {
        rt::compile(&kernels::base_source(&t), arch)?;
        rt::compile(&kernels::recurrent_source(&t), arch).map_err(|e| anyhow!("hybrid kernels: {e}"))?;
        for &hd in head_dims {
            // Past head dim 256 at most 8 query heads a KV head (`attention_cmds`).
            for &g in groups.iter().filter(|&&g| hd <= 256 || g <= 8) {
                rt::compile(&kernels::attention_source(&t, hd, g), arch).map_err(|e| anyhow!("attention HD={hd} G={g}: {e}"))?;
            }
        }
        Ok(())
    })
}

/// Each op as the concern that owns it implements it; the ops that return
/// nothing go through `Cuda::op`.
impl Device for Cuda {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Kv = CudaKv;

    fn name(&self) -> String {
        format!("cuda ({}, {})", self.inner.name, self.inner.arch)
    }

    fn memory_free(&self) -> Option<usize> {
        self.memory().ok().map(|(free, _)| free)
    }

    fn lost(&self) -> Option<String> {
        self.st().error.clone()
    }

    fn caps(&self) -> DeviceCaps {
        // cuBLAS chooses kernels (and reduction orders) by shape: not batch-invariant.
        let graphs = self.inner.tuning.graphs;
        DeviceCaps {
            batch_invariant: false,
            argmax: true,
            top_k: sampling::TOPK_MAX,
            draw: self.inner.tuning.draw,
            ahead: self.inner.tuning.ahead && graphs,
            replays: graphs,
        }
    }

    fn tensor(&self, rows: usize, cols: usize) -> CudaTensor {
        self.tensor_or_empty(rows, cols)
    }

    fn resize(&self, t: &mut CudaTensor, rows: usize, cols: usize) {
        let r = rt::make_current(self.ctx()).and_then(|_| self.grow(t, rows, cols));
        self.record(r);
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        self.upload_f32(data, rows, cols)
    }

    fn download(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        self.download_f32(t)
    }

    fn weight(&self, view: &TensorView) -> Result<CudaWeight> {
        self.load_weight(view)
    }

    fn weight_shape(&self, w: &CudaWeight) -> (usize, usize) {
        (w.rows, w.cols)
    }

    fn vector(&self, view: &TensorView, offset: f32) -> Result<CudaTensor> {
        self.load_vector(view, offset)
    }

    fn kv_pool(&self, spec: &KvPoolSpec, dtype: KvDtype) -> Result<CudaKv> {
        ensure!(dtype == KvDtype::F16, "{dtype:?} KV is not implemented on {} (its pool stores bf16)", self.name());
        self.new_kv_pool(spec)
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32], scale: f32, out: &mut CudaTensor) {
        self.op(|| self.try_embed(table, ids, scale, out))
    }

    fn matmul(&self, x: &CudaTensor, ws: &[&CudaWeight], outs: &mut [&mut CudaTensor]) {
        self.op(|| self.try_matmul(x, ws, outs))
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize], out: &mut CudaTensor) {
        self.op(|| self.try_gather_rows(x, rows, out))
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaTensor, eps: f32, out: &mut CudaTensor) {
        self.op(|| self.try_rms_norm(x, w, eps, out))
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) {
        self.op(|| self.try_add(x, y))
    }

    fn map(&self, x: &mut CudaTensor, f: Map) {
        self.op(|| self.try_map(x, f))
    }

    fn gated(&self, act: Act, gate: &CudaTensor, up: &CudaTensor, out: &mut CudaTensor) {
        self.op(|| self.try_gated(act, gate, up, out))
    }

    fn rope(&self, x: &mut CudaTensor, positions: &[u32], head_dim: usize, rope: &Rope) {
        self.op(|| self.try_rope(x, positions, head_dim, rope))
    }

    fn kv_write(&self, kv: &mut CudaKv, layer: usize, k: &CudaTensor, v: &CudaTensor, slots: &[u32]) {
        self.op(|| self.try_kv_write(kv, layer, k, v, slots))
    }

    fn kv_copy_blocks(&self, kv: &mut CudaKv, group: usize, src: &[u32], dst: &[u32]) {
        self.op(|| self.try_kv_copy_blocks(kv, group, src, dst))
    }

    fn attention(&self, q: &CudaTensor, kv: &CudaKv, layer: usize, seqs: &[AttnSeq<'_>], scale: f32, softcap: Option<f32>, out: &mut CudaTensor) {
        self.op(|| self.try_attention(q, kv, layer, seqs, scale, softcap, out))
    }

    fn copy_rows(&self, t: &mut CudaTensor, src: &[u32], dst: &[u32]) {
        self.op(|| self.try_copy_rows(t, src, dst))
    }

    fn zero_rows(&self, t: &mut CudaTensor, rows: &[u32]) {
        self.op(|| self.try_zero_rows(t, rows))
    }

    fn pick(&self, x: &CudaTensor, pick: RowPick<'_>, penalties: &[Penalty], launch_ahead: bool) -> Result<RowPicked> {
        self.penalize(x, penalties)?;
        Ok(match pick {
            RowPick::Argmax => RowPicked::Argmax(self.argmax_then(x, None, launch_ahead)?),
            RowPick::ArgmaxAllowed(bits) => RowPicked::Argmax(self.argmax_then(x, Some(bits), launch_ahead)?),
            RowPick::TopK(k) => RowPicked::TopK(self.top_k(x, k, None)?),
            RowPick::TopKAllowed(k, bits) => RowPicked::TopK(self.top_k(x, k, Some(bits))?),
            RowPick::Draw(draws, bits) => RowPicked::Drawn(self.draw(x, draws, bits)?),
        })
    }

    fn forward(&self, fw: Forward<'_>, run: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.run_forward(fw, run)
    }

    fn forward_ahead(&self, fw: Forward<'_>, run: &mut dyn FnMut() -> Result<()>) {
        Cuda::forward_ahead(self, fw, run)
    }

    fn prepare(&self, run: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.prepare_forward(run)
    }
}

impl MoeOps for Cuda {
    fn scatter_add_rows(&self, out: &mut CudaTensor, y: &CudaTensor, rows: &[u32], weights: &[f32]) -> Result<()> {
        self.try_scatter_add_rows(out, y, rows, weights)
    }
}
