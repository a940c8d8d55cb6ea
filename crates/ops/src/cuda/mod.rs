//! The CUDA device: bf16 weights, f32 activations (each with a bf16 copy for
//! the GEMMs), bf16 paged KV, kernels compiled by NVRTC for the device's
//! arch, cuBLAS bf16 GEMMs with f32 accumulation, and CUDA graphs for
//! decode rounds ([`Cuda::graph`]).
//!
//! The libraries load at run time, so this builds where no CUDA is
//! installed; [`Cuda::new`] reports a missing driver or library as an error.
//!
//! The `Device` ops return nothing, so a failure inside one (a launch error,
//! a shape the kernels do not cover) is kept and returned by the next call
//! that returns a `Result` (`download`, [`Cuda::sync`]); once one is kept,
//! later ops do nothing.

mod hybrid;
mod kernels;
mod rt;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{anyhow, bail, ensure, Result};
use braid_formats::{DType, TensorView};
use cudarc::cublas::sys as cb;
use cudarc::driver::{result as drv, sys, CudaContext};

use crate::{AttnSeq, Device, GateAct, KvPoolSpec, Rope};
use rt::{cu, Arg, DevBuf};

pub use rt::{check_libraries, kernel_cache_dir};

/// Activations: f32 `[rows, cols]`, and a bf16 copy that is valid when
/// `bf_ok` (written by the ops whose output usually feeds a GEMM).
pub struct CudaTensor {
    pub rows: usize,
    pub cols: usize,
    cap: usize,
    f: DevBuf,
    b: DevBuf,
    bf_ok: AtomicBool,
}

impl CudaTensor {
    fn fptr(&self) -> u64 {
        self.f.ptr
    }
    fn bptr(&self) -> u64 {
        self.b.ptr
    }
    fn len(&self) -> usize {
        self.rows * self.cols
    }
    fn set_bf(&self, ok: bool) {
        self.bf_ok.store(ok, Ordering::Relaxed);
    }
}

/// A bf16 weight `[rows = out, cols = in]`.
pub struct CudaWeight {
    pub rows: usize,
    pub cols: usize,
    buf: DevBuf,
    /// The RMSNorm weight (its f32 buffer) folded into the columns, if
    /// any (`Cuda::fold_norm`): the weight then only serves that norm's
    /// fused ops.
    folded: AtomicU64,
}

/// Paged KV in bf16: per layer, `blocks × block_tokens` slots of
/// `kv_heads × head_dim` values, for K and for V.
pub struct CudaKv {
    pub spec: KvPoolSpec,
    k: Vec<DevBuf>,
    v: Vec<DevBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Launch as called.
    Eager,
    /// Graph pass 1: do the host work and the uploads, launch nothing, and
    /// hash every launch (the graph's signature).
    UploadOnly,
    /// Graph pass 2, under stream capture: launch, upload nothing (pass 1
    /// already put the same data at the same places).
    LaunchOnly,
}

#[derive(Clone, Copy)]
struct AttnFns {
    decode: usize,
    /// The decode kernel whose key splits merge inside a thread-block
    /// cluster (Hopper on): no combine launch.
    decode_cl: Option<usize>,
    combine: usize,
    prefill: Option<usize>,
}

struct Graph {
    exec: usize,
    gen: u64,
}

/// Graph pass 1 of the forward expected next, done while the device still
/// ran the last one (`Device::replay_ahead`): its uploads are queued, only
/// its token ids are missing.
struct Ahead {
    /// The caller's key: everything the forward reads but its token ids.
    key: u64,
    sig: u64,
    gen: u64,
    tokens: usize,
    /// Where its embeds read the token ids.
    token_dst: Vec<u64>,
    /// Launched already (`Cuda::argmax_launch_ahead`) with these tokens.
    running: Option<Vec<u32>>,
}

/// Pinned host memory the greedy token ids come back to (an asynchronous
/// copy, which a launch may follow), and the event after that copy.
struct IdsBack {
    host: usize,
    bytes: usize,
    event: usize,
}

/// Host time of graph replays, while the GPU waits for the launch.
#[derive(Default)]
struct PassHost {
    /// Pass 1: the forward's host work and its uploads.
    pass_ns: u64,
    passes: u64,
    launch_ns: u64,
    launches: u64,
    /// Passes 1 done ahead, while the GPU ran the round before.
    ahead_ns: u64,
    aheads: u64,
}

struct State {
    mode: Mode,
    sig: u64,
    /// Next free u32 of the upload arena, and this pass's recent uploads
    /// (identical arrays, such as every layer's positions, share one copy).
    arena_off: usize,
    recent: Vec<(Vec<u32>, usize)>,
    /// This pass's token uploads: the ids' host address and count, and
    /// where they went.
    token_uploads: Vec<(usize, usize, u64)>,
    ahead: Option<Ahead>,
    /// In a pass ahead, uploads gather in `mirror` (the arena's host
    /// image) and go in one copy at its end: between two rounds one copy
    /// rather than one per array.
    staging: bool,
    mirror: Vec<u32>,
    ids_back: Option<IdsBack>,
    pass_host: PassHost,
    /// The first error; once set, ops do nothing.
    error: Option<String>,
    /// An error inside a graph pass: the pass is abandoned, not the device.
    pass_error: Option<String>,
    graphs: HashMap<u64, Graph>,
    attn: HashMap<(usize, usize), AttnFns>,
    part: DevBuf,
    /// `argmax_rows`'s keys (`argmax_cap` rows; zero between calls), its
    /// finish count, then the token ids.
    argmax_buf: DevBuf,
    argmax_cap: usize,
    /// `top_k`'s chunk candidates and each row's k best.
    topk_part: DevBuf,
    topk_out: DevBuf,
    pub graph_hits: u64,
    /// Replays whose pass 1 was done ahead.
    pub ahead_hits: u64,
    /// Of those, rounds launched before they were asked for.
    pub launched_ahead: u64,
    pub graph_captures: u64,
    pub graph_fallbacks: u64,
    /// A forward read values back inside a graph pass (MoE routing): such
    /// forwards run eagerly from then on.
    host_reads: bool,
    /// Kernel names by function handle, and the profile being recorded:
    /// (name, start event, end event) per launch.
    names: HashMap<usize, String>,
    profiling: bool,
    prof: Vec<(String, usize, usize)>,
    /// Inside a fused op whose products may take folded weights.
    folded_ok: bool,
}

struct Fns {
    to_bf16: usize,
    embed: usize,
    rms_norm_block: usize,
    rms_norm_warp: usize,
    add_rms_norm: usize,
    add: usize,
    scale: usize,
    softcap: usize,
    silu_mul: usize,
    gelu_mul: usize,
    rope: usize,
    kv_write: usize,
    gather_rows: usize,
    argmax_rows: usize,
    fill_random_bf16: usize,
    fill_f32: usize,
    gemv: GvFns,
    gemv_gated: GvFns,
    act_mul_bf: usize,
    act_mul_bf8: usize,
    rope_kv: usize,
    rope_kv_rows: usize,
    topk_chunks: usize,
    scale_cols: usize,
    topk_merge: usize,
    gemv_rope: GvFns,
}

/// One GEMV kernel's builds: 4 or 8 loads in flight per lane (`deep`),
/// for any row count or (`lean`) for 1–2 rows.
#[derive(Clone, Copy)]
struct GvFns {
    plain: usize,
    deep: usize,
    plain_lean: usize,
    deep_lean: usize,
}

impl GvFns {
    fn load(m: &rt::Module, name: &str, names: &mut Vec<(usize, String)>) -> Result<Self> {
        let mut get = |n: String| -> Result<usize> {
            let f = m.func(&n)?;
            names.push((f, n));
            Ok(f)
        };
        Ok(Self {
            plain: get(name.to_string())?,
            deep: get(format!("{name}8"))?,
            plain_lean: get(format!("{name}_lean"))?,
            deep_lean: get(format!("{name}8_lean"))?,
        })
    }
}

/// Blocks per SM the lean (1–2-row) GEMV kernels are built for
/// (`BRAID_CUDA_GEMV_MINB`; 0: the lean kernels are not used).
pub(crate) fn gemv_min_blocks() -> usize {
    env_usize("BRAID_CUDA_GEMV_MINB", 3).min(8)
}

struct Inner {
    _ctx: Arc<CudaContext>,
    ctx: usize,
    stream: usize,
    cublas: usize,
    _cublas_ws: DevBuf,
    arch: String,
    cc: (i32, i32),
    sms: usize,
    name: String,
    fns: Fns,
    arena: DevBuf,
    arena_words: usize,
    graphs_enabled: AtomicBool,
    gemv_max_rows: usize,
    /// Most key splits of the decode attention (`BRAID_CUDA_ATTN_SPLITS`,
    /// default 16).
    attn_max_splits: usize,
    /// From how many 16-byte chunks per lane a GEMV keeps 8 loads in
    /// flight instead of 4 (`BRAID_CUDA_GEMV_DEEP`, default 8: on the H200
    /// 1 stream 888 -> 940 tok/s, 4 streams 2553 -> 2767).
    gemv_deep_from: usize,
    /// GEMV blocks wanted per SM before a block takes more weight rows
    /// (`BRAID_CUDA_GEMV_BLOCKS`, default 1: fewer, longer blocks measured
    /// faster on the H200, 800 against 780 tok/s for 1 stream).
    gemv_blocks_per_sm: usize,
    /// 1–2-row products take the lean GEMV builds (`gemv_min_blocks` > 0).
    gemv_lean: bool,
    /// Launch kernels with programmatic dependent launch (Hopper on;
    /// `BRAID_CUDA_PDL=0` turns it off).
    pdl: bool,
    /// Few-row products fold in the RMSNorm of their input and the
    /// residual add of their output (`BRAID_CUDA_NORM_FOLD=0`: separate
    /// norm and add launches).
    norm_fold: bool,
    /// Most rows whose norm a GEMV computes itself (each block reads every
    /// row's f32 values once); more take the norm kernel (unit weight),
    /// then the GEMV (`BRAID_CUDA_NORM_FOLD_ROWS`, default 2: on the H200
    /// 3 streams 2401-2406 tok/s with it against 2496-2527 without, 4
    /// streams 2668-2682 against 2812-2845; 1 and 2 streams alike).
    norm_fold_rows: usize,
    /// Few-row q/k/v products apply RoPE and write the KV pool in their
    /// store (`BRAID_CUDA_ROPE_FOLD=0`: a separate rope_kv launch).
    rope_fold: bool,
    /// Decode rounds do the next round's pass 1 while the GPU runs
    /// (`Device::replay_ahead`; `BRAID_CUDA_AHEAD=0` turns it off).
    ahead: bool,
    /// Greedy rounds launch the round prepared ahead before returning
    /// (`Device::argmax_rows_launch_ahead`; `BRAID_CUDA_LAUNCH_AHEAD=0`
    /// turns it off).
    launch_ahead: bool,
    /// Kernels (name prefixes) not launched at all (`BRAID_CUDA_SKIP`,
    /// comma-separated): a diagnostic that times a round without them.
    /// Results are wrong while it is set.
    skip: Vec<String>,
    st: Mutex<State>,
    /// The hybrid families' kernels (loaded on first use) and scratch.
    hybrid: hybrid::Hybrid,
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
                    for (_, g) in st.graphs.drain() {
                        let _ = drv::graph::exec_destroy(g.exec as sys::CUgraphExec);
                    }
                    if let Some(k) = st.ids_back.take() {
                        let _ = drv::free_host(k.host as *mut std::ffi::c_void);
                        let _ = drv::event::destroy(k.event as sys::CUevent);
                    }
                }
                let _ = cb::cublasDestroy_v2(self.cublas as cb::cublasHandle_t);
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

const ARENA_WORDS: usize = 4 << 20;
/// Query rows per block of the prefill attention kernel (PF_BQ).
const PREFILL_ROWS: usize = 64;
/// Up to this many rows (decode), the norms and RoPE run wider blocks: with
/// one block per row they are latency-bound.
const FEW_ROWS: usize = 8;

/// A numeric setting from the environment, or `default`.
fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// An on/off setting from the environment: on unless set to `0`.
fn env_flag(name: &str) -> bool {
    std::env::var(name).map(|v| v != "0").unwrap_or(true)
}

const CUBLAS_WS: usize = 32 << 20;
/// Up to this many rows (at most 8), GEMMs run as the GEMV kernels
/// (decode); `BRAID_CUDA_GEMV_ROWS` overrides it (0: always cuBLAS). At 8
/// rows the GEMV measured slower than cuBLAS on the H200 (docs/CUDA.md).
const GEMV_MAX_ROWS: usize = 4;
/// What a GEMM writes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GemmOut {
    F32,
    Bf16,
    /// f32, added to what `y` holds.
    AddF32,
}

fn act_code(act: GateAct) -> i32 {
    match act {
        GateAct::Silu => 0,
        GateAct::GeluTanh => 1,
    }
}

/// Most candidates `top_k` finds per row, and the keys one block sorts.
const TOPK_MAX: usize = 64;
const TOPK_N: usize = 4096;

impl Cuda {
    /// Open GPU `ordinal`: load the libraries, compile (or load the cached)
    /// kernels for its arch, set up cuBLAS.
    pub fn new(ordinal: usize) -> Result<Cuda> {
        rt::check_libraries()?;
        rt::guarded("opening the CUDA device", || Self::open(ordinal))
    }

    fn open(ordinal: usize) -> Result<Cuda> {
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
        let m = rt::compile_and_load(&kernels::with_prelude(kernels::BASE), &arch)?;
        let mut gv_names = Vec::new();
        let fns = Fns {
            to_bf16: m.func("to_bf16")?,
            embed: m.func("embed")?,
            rms_norm_block: m.func("rms_norm_block")?,
            rms_norm_warp: m.func("rms_norm_warp")?,
            add_rms_norm: m.func("add_rms_norm")?,
            add: m.func("add")?,
            scale: m.func("scale")?,
            softcap: m.func("softcap")?,
            silu_mul: m.func("silu_mul")?,
            gelu_mul: m.func("gelu_mul")?,
            rope: m.func("rope")?,
            kv_write: m.func("kv_write")?,
            gather_rows: m.func("gather_rows")?,
            argmax_rows: m.func("argmax_rows")?,
            fill_random_bf16: m.func("fill_random_bf16")?,
            fill_f32: m.func("fill_f32")?,
            gemv: GvFns::load(&m, "gemv", &mut gv_names)?,
            gemv_gated: GvFns::load(&m, "gemv_gated", &mut gv_names)?,
            act_mul_bf: m.func("act_mul_bf")?,
            act_mul_bf8: m.func("act_mul_bf8")?,
            rope_kv: m.func("rope_kv")?,
            rope_kv_rows: m.func("rope_kv_rows")?,
            topk_chunks: m.func("topk_chunks")?,
            scale_cols: m.func("scale_cols")?,
            topk_merge: m.func("topk_merge")?,
            gemv_rope: GvFns::load(&m, "gemv_rope", &mut gv_names)?,
        };
        let names: HashMap<usize, String> = [
            (fns.to_bf16, "to_bf16"),
            (fns.embed, "embed"),
            (fns.rms_norm_block, "rms_norm_block"),
            (fns.rms_norm_warp, "rms_norm_warp"),
            (fns.add_rms_norm, "add_rms_norm"),
            (fns.add, "add"),
            (fns.scale, "scale"),
            (fns.softcap, "softcap"),
            (fns.silu_mul, "silu_mul"),
            (fns.gelu_mul, "gelu_mul"),
            (fns.rope, "rope"),
            (fns.kv_write, "kv_write"),
            (fns.gather_rows, "gather_rows"),
            (fns.argmax_rows, "argmax_rows"),
            (fns.act_mul_bf, "act_mul_bf"),
            (fns.act_mul_bf8, "act_mul_bf8"),
            (fns.rope_kv, "rope_kv"),
            (fns.rope_kv_rows, "rope_kv_rows"),
            (fns.topk_chunks, "topk_chunks"),
            (fns.scale_cols, "scale_cols"),
            (fns.topk_merge, "topk_merge"),
        ]
        .into_iter()
        .map(|(f, n)| (f, n.to_string()))
        .chain(gv_names)
        .collect();
        let mut handle: cb::cublasHandle_t = std::ptr::null_mut();
        unsafe { cb::cublasCreate_v2(&mut handle) }.result().map_err(|e| anyhow!("cublasCreate: {e:?}"))?;
        let ws = DevBuf::new(raw_ctx, CUBLAS_WS)?;
        unsafe {
            cb::cublasSetStream_v2(handle, stream as cb::cudaStream_t).result().map_err(|e| anyhow!("cublasSetStream: {e:?}"))?;
            cb::cublasSetWorkspace_v2(handle, ws.ptr as *mut _, CUBLAS_WS).result().map_err(|e| anyhow!("cublasSetWorkspace: {e:?}"))?;
        }
        let arena = DevBuf::new(raw_ctx, ARENA_WORDS * 4)?;
        let graphs = env_flag("BRAID_CUDA_GRAPHS");
        Ok(Cuda {
            inner: Arc::new(Inner {
                _ctx: ctx,
                ctx: raw_ctx,
                stream,
                cublas: handle as usize,
                _cublas_ws: ws,
                arch,
                cc,
                sms,
                name,
                fns,
                arena,
                arena_words: ARENA_WORDS,
                graphs_enabled: AtomicBool::new(graphs),
                attn_max_splits: env_usize("BRAID_CUDA_ATTN_SPLITS", 16).clamp(1, 64),
                gemv_deep_from: env_usize("BRAID_CUDA_GEMV_DEEP", 8),
                gemv_blocks_per_sm: env_usize("BRAID_CUDA_GEMV_BLOCKS", 1).clamp(1, 64),
                gemv_lean: gemv_min_blocks() > 0,
                pdl: cc.0 >= 9 && env_flag("BRAID_CUDA_PDL"),
                rope_fold: env_flag("BRAID_CUDA_ROPE_FOLD"),
                ahead: env_flag("BRAID_CUDA_AHEAD"),
                launch_ahead: env_flag("BRAID_CUDA_LAUNCH_AHEAD"),
                norm_fold: env_flag("BRAID_CUDA_NORM_FOLD"),
                norm_fold_rows: env_usize("BRAID_CUDA_NORM_FOLD_ROWS", 2),
                skip: std::env::var("BRAID_CUDA_SKIP").map(|v| v.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect()).unwrap_or_default(),
                gemv_max_rows: env_usize("BRAID_CUDA_GEMV_ROWS", GEMV_MAX_ROWS).min(8),
                st: Mutex::new(State {
                    mode: Mode::Eager,
                    sig: 0,
                    arena_off: 0,
                    recent: Vec::new(),
                    token_uploads: Vec::new(),
                    ahead: None,
                    staging: false,
                    mirror: Vec::new(),
                    ids_back: None,
                    pass_host: PassHost::default(),
                    error: None,
                    pass_error: None,
                    graphs: HashMap::new(),
                    attn: HashMap::new(),
                    part: DevBuf::empty(raw_ctx),
                    topk_out: DevBuf::empty(raw_ctx),
                    argmax_buf: DevBuf::empty(raw_ctx),
                    argmax_cap: 0,
                    topk_part: DevBuf::empty(raw_ctx),
                    graph_hits: 0,
                    ahead_hits: 0,
                    launched_ahead: 0,
                    graph_captures: 0,
                    graph_fallbacks: 0,
                    host_reads: false,
                    names,
                    profiling: false,
                    prof: Vec::new(),
                    folded_ok: false,
                }),
                hybrid: hybrid::Hybrid::default(),
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

    /// Turn CUDA graphs for [`Cuda::graph`] on or off (on unless
    /// `BRAID_CUDA_GRAPHS=0`).
    pub fn set_graphs(&self, on: bool) {
        self.inner.graphs_enabled.store(on, Ordering::Relaxed);
    }

    /// Mean host microseconds of a graph pass 1 (the forward's host work
    /// and uploads, while the GPU waits for the launch), of a graph launch
    /// and of a pass 1 done ahead (while the GPU runs the round before);
    /// then resets.
    pub fn pass_host_us(&self) -> (f64, f64, f64) {
        let p = std::mem::take(&mut self.st().pass_host);
        let mean = |ns: u64, n: u64| ns as f64 / (n.max(1) as f64 * 1e3);
        (mean(p.pass_ns, p.passes), mean(p.launch_ns, p.launches), mean(p.ahead_ns, p.aheads))
    }

    /// (replays, captures, eager fallbacks) of [`Cuda::graph`] so far.
    pub fn graph_stats(&self) -> (u64, u64, u64) {
        let st = self.st();
        (st.graph_hits, st.graph_captures, st.graph_fallbacks)
    }

    /// Replays of [`Cuda::graph_keyed`] whose pass 1 was done ahead, and
    /// of those the rounds [`Cuda::argmax_launch_ahead`] had launched.
    pub fn ahead_hits(&self) -> (u64, u64) {
        let st = self.st();
        (st.ahead_hits, st.launched_ahead)
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

    /// Keep the first error (inside a graph pass: abandon the pass instead).
    fn fail(&self, st: &mut State, msg: String) {
        if st.mode != Mode::Eager {
            st.pass_error.get_or_insert(msg);
        } else {
            st.error.get_or_insert(msg);
        }
    }

    fn record(&self, r: Result<()>) {
        if let Err(e) = r {
            let mut st = self.st();
            self.fail(&mut st, format!("{e:#}"));
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

    /// Copy `dst.len()` values at `src` to the host once the work queued
    /// before has run: the copy queues on the stream, so the host wakes
    /// once (a synchronous copy after a stream sync costs a second round
    /// trip while the GPU idles).
    fn read_back<T: Copy>(&self, dst: &mut [T], src: u64, what: &str) -> Result<()> {
        if !dst.is_empty() {
            let r = unsafe { cu(drv::memcpy_dtoh_async(dst, src, self.stream() as sys::CUstream), what) };
            self.record(r);
        }
        self.sync()
    }

    /// Whether ops should run at all (no error kept), making the context current.
    fn ready(&self) -> bool {
        let st = self.st();
        if st.error.is_some() || st.pass_error.is_some() {
            return false;
        }
        drop(st);
        if let Err(e) = rt::make_current(self.ctx()) {
            self.record(Err(e));
            return false;
        }
        true
    }

    fn launch(&self, f: usize, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, args: &[Arg]) -> Result<()> {
        self.launch_cluster(f, grid, block, smem, args, 1)
    }

    /// `launch` with thread-block clusters of `cluster` blocks along x.
    fn launch_cluster(&self, f: usize, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, args: &[Arg], cluster: u32) -> Result<()> {
        let mode = {
            let mut st = self.st();
            if !self.inner.skip.is_empty() && st.names.get(&f).is_some_and(|n| self.inner.skip.iter().any(|s| n.starts_with(s.as_str()))) {
                return Ok(());
            }
            if st.mode == Mode::UploadOnly {
                let mut h = rt::fnv(st.sig, f as u64);
                h = rt::fnv(h, (grid.0 as u64) << 40 | (grid.1 as u64) << 20 | grid.2 as u64);
                h = rt::fnv(h, (block.0 as u64) << 40 | (block.1 as u64) << 20 | block.2 as u64 | (smem as u64) << 60);
                h = rt::fnv(h, cluster as u64);
                for a in args {
                    h = rt::fnv(h, a.bits());
                }
                st.sig = h;
            }
            st.mode
        };
        if mode == Mode::UploadOnly || grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let prof = self.prof_begin(mode);
        // SAFETY: every kernel of braid's modules waits (PDL_WAIT) first.
        let r = unsafe { rt::launch(f, grid, block, smem, self.stream(), args, self.inner.pdl, cluster) };
        if let Some(ev) = prof {
            let name = self.st().names.get(&f).cloned().unwrap_or_else(|| format!("kernel {f:x}"));
            self.prof_end(ev, name);
        }
        r
    }

    /// Start timing one launch (eager mode, profiling on): its start event.
    fn prof_begin(&self, mode: Mode) -> Option<usize> {
        if mode != Mode::Eager || !self.st().profiling {
            return None;
        }
        let ev = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ok()?;
        unsafe { drv::event::record(ev, self.stream() as sys::CUstream).ok()? };
        Some(ev as usize)
    }

    fn prof_end(&self, start: usize, name: String) {
        if let Ok(ev) = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT) {
            if unsafe { drv::event::record(ev, self.stream() as sys::CUstream) }.is_ok() {
                self.st().prof.push((name, start, ev as usize));
            }
        }
    }

    /// Time every kernel and GEMM launched eagerly from now on (CUDA
    /// events around each), until [`Cuda::profile_report`].
    pub fn profile_start(&self) {
        self.st().profiling = true;
    }

    /// Stop profiling; a table of GPU time per kernel (total ms, launches,
    /// µs each), largest first, and the total.
    pub fn profile_report(&self) -> Result<String> {
        self.sync()?;
        let events = {
            let mut st = self.st();
            st.profiling = false;
            std::mem::take(&mut st.prof)
        };
        let mut by: HashMap<String, (f64, usize)> = HashMap::new();
        let mut total = 0f64;
        for (name, a, b) in events {
            let ms = unsafe { drv::event::elapsed(a as sys::CUevent, b as sys::CUevent) }.unwrap_or(0.0) as f64;
            unsafe {
                let _ = drv::event::destroy(a as sys::CUevent);
                let _ = drv::event::destroy(b as sys::CUevent);
            }
            let e = by.entry(name).or_default();
            e.0 += ms;
            e.1 += 1;
            total += ms;
        }
        let mut rows: Vec<_> = by.into_iter().collect();
        rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        let mut s = String::from("| kernel | ms | launches | µs each |\n| --- | --- | --- | --- |\n");
        for (n, (ms, c)) in rows {
            s += &format!("| {n} | {ms:.3} | {c} | {:.1} |\n", 1e3 * ms / c as f64);
        }
        s += &format!("| total | {total:.3} | | |\n");
        Ok(s)
    }

    /// Whether device-side work (copies, GEMMs) should be issued now; in
    /// pass 1 it is only hashed.
    fn issue(&self, sig: &[u64]) -> bool {
        let mut st = self.st();
        if st.mode == Mode::UploadOnly {
            for &x in sig {
                st.sig = rt::fnv(st.sig, x);
            }
            return false;
        }
        true
    }

    /// Put a small index array on the device (in the upload arena) and return
    /// its address. Identical arrays within a pass share one copy.
    fn put_u32(&self, data: &[u32]) -> Result<u64> {
        self.put_u32_as(data, true)
    }

    /// [`Cuda::put_u32`] of a forward's token ids: never shared, since a
    /// pass done ahead gets its real ids written over these.
    fn put_tokens(&self, ids: &[u32]) -> Result<u64> {
        let ptr = self.put_u32_as(ids, false)?;
        let mut st = self.st();
        if st.mode == Mode::UploadOnly {
            st.token_uploads.push((ids.as_ptr() as usize, ids.len(), ptr));
        }
        Ok(ptr)
    }

    fn put_u32_as(&self, data: &[u32], share: bool) -> Result<u64> {
        let mut st = self.st();
        if st.mode == Mode::Eager {
            // The arena may now hold other data than a pass done ahead put there.
            st.ahead = None;
        }
        if let Some((_, off)) = st.recent.iter().find(|(d, _)| share && d.as_slice() == data) {
            return Ok(self.inner.arena.ptr + 4 * *off as u64);
        }
        // Room to grow (block tables lengthen as sequences do), so the
        // offsets of later uploads, which graphs bake in, rarely move.
        let n = data.len().max(64).next_power_of_two();
        ensure!(n <= self.inner.arena_words, "upload of {} indices exceeds the {}-word arena", data.len(), self.inner.arena_words);
        if st.arena_off + n > self.inner.arena_words {
            if st.mode != Mode::Eager {
                bail!("upload arena full inside a graph pass");
            }
            // Eager: reuse from the start; earlier readers were queued on the
            // same stream, so they run before the overwrite.
            st.arena_off = 0;
            st.recent.clear();
        }
        let off = st.arena_off;
        st.arena_off += n;
        if share {
            if st.recent.len() >= 8 {
                st.recent.remove(0);
            }
            st.recent.push((data.to_vec(), off));
        }
        let ptr = self.inner.arena.ptr + 4 * off as u64;
        if st.staging {
            // A pass ahead: gathered here, sent in one copy at its end.
            if st.mirror.len() < self.inner.arena_words {
                st.mirror.resize(self.inner.arena_words, 0);
            }
            st.mirror[off..off + data.len()].copy_from_slice(data);
        } else if st.mode != Mode::LaunchOnly && !data.is_empty() {
            unsafe { cu(drv::memcpy_htod_async(ptr, data, self.stream() as sys::CUstream), "upload")? };
        }
        Ok(ptr)
    }

    fn new_tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        let n = rows * cols;
        Ok(CudaTensor { rows, cols, cap: n, f: DevBuf::new(self.ctx(), n * 4)?, b: DevBuf::new(self.ctx(), n * 2)?, bf_ok: AtomicBool::new(false) })
    }

    fn grow(&self, t: &mut CudaTensor, rows: usize, cols: usize) -> Result<()> {
        let n = rows * cols;
        t.rows = rows;
        t.cols = cols;
        t.set_bf(false);
        if n > t.cap {
            if self.st().mode == Mode::LaunchOnly {
                bail!("a tensor grew inside graph capture");
            }
            // Grow with slack so a slowly growing batch does not realloc each time.
            let cap = n.max(t.cap + t.cap / 4);
            t.f = DevBuf::new(self.ctx(), cap * 4)?;
            t.b = DevBuf::new(self.ctx(), cap * 2)?;
            t.cap = cap;
        }
        Ok(())
    }

    fn elementwise_grid(n: usize) -> (u32, u32, u32) {
        (n.div_ceil(256).clamp(1, 65535) as u32, 1, 1)
    }

    /// Make `t`'s bf16 copy current.
    fn ensure_bf16(&self, t: &CudaTensor) -> Result<()> {
        if t.bf_ok.load(Ordering::Relaxed) {
            return Ok(());
        }
        let n = t.len();
        self.launch(self.inner.fns.to_bf16, Self::elementwise_grid(n), (256, 1, 1), 0, &[Arg::P(t.fptr()), Arg::P(t.bptr()), Arg::U64(n as u64)])?;
        t.set_bf(true);
        Ok(())
    }

    /// `y[n, m] = x[n, k] · w[m, k]ᵀ` with bf16 operands and f32 accumulation;
    /// `y` is f32 or bf16, or f32 that the product is added to.
    #[allow(clippy::too_many_arguments)]
    fn gemm(&self, w: u64, x: u64, y: u64, m: usize, n: usize, k: usize, out: GemmOut) -> Result<()> {
        if !self.issue(&[0x6e6d6d, w, x, y, m as u64, n as u64, k as u64, out as u64]) {
            return Ok(());
        }
        let (alpha, beta) = (1f32, if out == GemmOut::AddF32 { 1f32 } else { 0f32 });
        let yt = if out == GemmOut::Bf16 { cb::cudaDataType::CUDA_R_16BF } else { cb::cudaDataType::CUDA_R_32F };
        let mode = self.st().mode;
        let prof = self.prof_begin(mode);
        let r = unsafe {
            cb::cublasGemmEx(
                self.inner.cublas as cb::cublasHandle_t,
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                cb::cudaDataType::CUDA_R_16BF,
                k as i32,
                x as *const _,
                cb::cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                yt,
                m as i32,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
            .result()
            .map_err(|e| anyhow!("cublasGemmEx {m}x{n}x{k}: {e:?}"))
        };
        if let Some(ev) = prof {
            self.prof_end(ev, format!("gemm out {m} rows {n} in {k}"));
        }
        r
    }

    /// Most rows a GEMM runs as the GEMV kernels (0: never).
    pub fn gemv_max_rows(&self) -> usize {
        self.inner.gemv_max_rows
    }

    /// Whether an `[n, k]` input takes the GEMV kernels (16-byte chunks of k).
    fn gemv_fits(&self, n: usize, k: usize) -> bool {
        (1..=self.inner.gemv_max_rows).contains(&n) && k > 0 && k.is_multiple_of(8)
    }

    /// Weight rows per GEMV block (a power of two up to `max_r`): the most
    /// that still gives every SM `gemv_blocks_per_sm` blocks; a block's 8 warps split the
    /// rest of the work along k.
    fn gemv_rows(&self, m: usize, max_r: usize) -> usize {
        let mut r = max_r;
        while r > 1 && m.div_ceil(r) < self.inner.gemv_blocks_per_sm * self.inner.sms {
            r /= 2;
        }
        r
    }

    /// The GEMV kernel for rows of `k8` chunks split over `slices` warps:
    /// 8 loads in flight per lane for long slices (see `gemv_deep_from`).
    /// The lean build for 1–2 rows (see `gemv_min_blocks`).
    fn gemv_kernel(&self, n: usize, k8: usize, slices: usize, f: &GvFns) -> usize {
        let deep = k8.div_ceil(slices.max(1) * 32) >= self.inner.gemv_deep_from;
        match (deep, n <= 2 && self.inner.gemv_lean) {
            (true, true) => f.deep_lean,
            (true, false) => f.deep,
            (false, true) => f.plain_lean,
            (false, false) => f.plain,
        }
    }

    /// `y = x · wᵀ` (f32) for up to three `(weight, out rows, y)` sharing
    /// `x` (bf16 copy current, at most 8 rows), in one launch.
    fn gemv_launch(&self, x: &CudaTensor, ws: &[(u64, usize, u64)]) -> Result<()> {
        self.gemv_launch_ex(x, ws, None)
    }

    /// `gemv_launch`, or with `resid_bf` (one weight) the residual add
    /// `y += x · wᵀ`, the sum's bf16 copy into `resid_bf`.
    fn gemv_launch_ex(&self, x: &CudaTensor, ws: &[(u64, usize, u64)], resid_bf: Option<u64>) -> Result<()> {
        ensure!(!ws.is_empty() && ws.len() <= 3, "gemv: {} weights in one launch", ws.len());
        ensure!(resid_bf.is_none() || ws.len() == 1, "gemv: a residual add takes one weight");
        let total: usize = ws.iter().map(|w| w.1).sum();
        let r = self.gemv_rows(total, 8);
        let get = |i: usize| ws.get(i).copied().unwrap_or((0, 0, 0));
        let (a, b, c) = (get(0), get(1), get(2));
        let nb = [a.1.div_ceil(r), b.1.div_ceil(r), c.1.div_ceil(r)];
        let blocks = nb.iter().sum::<usize>();
        let f = self.gemv_kernel(x.rows, x.cols / 8, 8 / r, &self.inner.fns.gemv);
        self.launch(
            f,
            (blocks as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::P(x.bptr()),
                Arg::I(x.rows as i32),
                Arg::I((x.cols / 8) as i32),
                Arg::I(r as i32),
                Arg::P(a.0),
                Arg::P(b.0),
                Arg::P(c.0),
                Arg::P(a.2),
                Arg::P(b.2),
                Arg::P(c.2),
                Arg::P(resid_bf.unwrap_or(0)),
                Arg::P(0),
                Arg::P(0),
                Arg::I(a.1 as i32),
                Arg::I(b.1 as i32),
                Arg::I(c.1 as i32),
                Arg::I(nb[0] as i32),
                Arg::I(nb[1] as i32),
                // No norm in the plain GEMV (the gated and q/k/v ones take it).
                Arg::P(0),
                Arg::F(0.0),
                Arg::I(resid_bf.is_some() as i32),
            ],
        )
    }

    /// `out = act(x · gateᵀ) * (x · upᵀ)` (f32 and bf16) as one GEMV
    /// launch, an RMSNorm of x (f32 rows, eps) folded in if given.
    fn gemv_gated_launch(
        &self,
        x: &CudaTensor,
        w_gate: &CudaWeight,
        w_up: &CudaWeight,
        act: GateAct,
        out: &CudaTensor,
        norm: Option<(u64, f32)>,
    ) -> Result<()> {
        let (n, m, k) = (x.rows, w_gate.rows, x.cols);
        let r = self.gemv_rows(m, 4);
        let f = self.gemv_kernel(n, k / 8, 8 / (2 * r), &self.inner.fns.gemv_gated);
        let (xf, eps) = norm.unwrap_or((0, 0.0));
        self.launch(
            f,
            (m.div_ceil(r) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::P(x.bptr()),
                Arg::I(n as i32),
                Arg::I((k / 8) as i32),
                Arg::I(r as i32),
                Arg::P(w_gate.buf.ptr),
                Arg::P(w_up.buf.ptr),
                Arg::I(m as i32),
                Arg::I(act_code(act)),
                Arg::P(out.fptr()),
                Arg::P(out.bptr()),
                Arg::P(xf),
                Arg::F(eps),
            ],
        )
    }

    /// Fold RMSNorm weight `g` into the columns of `ws` (once; a weight
    /// folded with another norm is an error), so a GEMV that reads the
    /// norm's input scales only its sums. Only eagerly (a graph pass would
    /// record the scaling): `Ok(false)` then, and the caller takes the
    /// plain ops.
    fn fold_norm(&self, g: &CudaTensor, ws: &[&CudaWeight]) -> Result<bool> {
        for w in ws {
            ensure!(w.cols == g.len(), "fold_norm: a norm of {} over a weight of {} columns", g.len(), w.cols);
            let f = w.folded.load(Ordering::Relaxed);
            ensure!(f == 0 || f == g.fptr(), "a weight folded with one norm is used with another");
        }
        if ws.iter().all(|w| w.folded.load(Ordering::Relaxed) == g.fptr()) {
            return Ok(true);
        }
        if self.st().mode != Mode::Eager {
            return Ok(false);
        }
        for w in ws.iter().filter(|w| w.folded.load(Ordering::Relaxed) == 0) {
            let n = w.rows * w.cols;
            self.launch(
                self.inner.fns.scale_cols,
                Self::elementwise_grid(n),
                (256, 1, 1),
                0,
                &[Arg::P(w.buf.ptr), Arg::P(g.fptr()), Arg::U64(n as u64), Arg::I(w.cols as i32)],
            )?;
            w.folded.store(g.fptr(), Ordering::Relaxed);
        }
        Ok(true)
    }

    /// Whether the weights of `ws` carry a folded norm (the plain products
    /// must not take them).
    fn any_folded(ws: &[&CudaWeight]) -> bool {
        ws.iter().any(|w| w.folded.load(Ordering::Relaxed) != 0)
    }

    /// RMSNorm of `x` with weight `w` (groups of its width), or of whole
    /// rows with a unit weight (`None`: the weight was folded into the
    /// product that reads the norm).
    fn rms_norm_with(&self, x: &CudaTensor, w: Option<&CudaTensor>, eps: f32, out: &mut CudaTensor) -> Result<()> {
        let (g, wp) = w.map_or((x.cols, 0), |w| (w.cols, w.fptr()));
        ensure!(g > 0 && x.cols.is_multiple_of(g), "rms_norm: weight of {g} does not divide rows of {}", x.cols);
        self.grow(out, x.rows, x.cols)?;
        let groups = x.len() / g;
        if groups == 0 {
            return Ok(());
        }
        if g <= 256 {
            self.launch(
                self.inner.fns.rms_norm_warp,
                (groups.div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                0,
                &[Arg::P(x.fptr()), Arg::P(wp), Arg::P(out.fptr()), Arg::P(out.bptr()), Arg::I(groups as i32), Arg::I(g as i32), Arg::F(eps)],
            )?;
        } else {
            // Few rows (decode): wider blocks, fewer serial steps per thread.
            self.launch(
                self.inner.fns.rms_norm_block,
                (groups as u32, 1, 1),
                (if groups <= FEW_ROWS { 1024 } else { 256 }, 1, 1),
                0,
                &[Arg::P(x.fptr()), Arg::P(wp), Arg::P(out.fptr()), Arg::P(out.bptr()), Arg::I(g as i32), Arg::F(eps)],
            )?;
        }
        out.set_bf(true);
        Ok(())
    }

    /// For an op that reads `rms_norm(x, w)` through the weights `ws`:
    /// `Some(true)` when `w` is folded into them (folding it now if this
    /// is the first eager call), `Some(false)` when they stay plain, with
    /// the norm folds off or x's rows not whole norm groups.
    fn norm_folded(&self, x: &CudaTensor, w: &CudaTensor, ws: &[&CudaWeight]) -> Result<bool> {
        if !(self.inner.norm_fold && w.len() == x.cols) {
            ensure!(!Self::any_folded(ws), "a weight folded with a norm is used without the fold");
            return Ok(false);
        }
        self.fold_norm(w, ws)
    }

    /// The input of a product that reads `rms_norm(x, w)`: `x` itself when
    /// the GEMV folds the norm in (`Some` of x's f32 rows and eps), else
    /// `normed` made here (with a unit weight when `w` is folded into the
    /// product's weights).
    fn normed_input(&self, x: &CudaTensor, w: &CudaTensor, eps: f32, folded: bool, gemv: bool, normed: &mut CudaTensor) -> Result<Option<(u64, f32)>> {
        if folded && gemv && x.rows <= self.inner.norm_fold_rows {
            self.ensure_bf16(x)?;
            return Ok(Some((x.fptr(), eps)));
        }
        self.rms_norm_with(x, if folded { None } else { Some(w) }, eps, normed)?;
        Ok(None)
    }

    /// Run `f`, which may use weights that carry a folded norm (the fused
    /// ops' own products).
    fn with_folded<T>(&self, f: impl FnOnce() -> T) -> T {
        self.st().folded_ok = true;
        let r = f();
        self.st().folded_ok = false;
        r
    }

    /// The shapes a gated product takes: x's width is both weights', and
    /// gate and up have as many rows.
    fn check_gated(op: &str, x: &CudaTensor, w_gate: &CudaWeight, w_up: &CudaWeight) -> Result<()> {
        ensure!(
            x.cols == w_gate.cols && x.cols == w_up.cols && w_gate.rows == w_up.rows,
            "{op}: x has {} columns, gate is {}x{}, up {}x{}",
            x.cols,
            w_gate.rows,
            w_gate.cols,
            w_up.rows,
            w_up.cols
        );
        Ok(())
    }

    /// Plain products must not take weights that carry a folded norm.
    fn check_unfolded(&self, ws: &[&CudaWeight]) -> Result<()> {
        ensure!(!Self::any_folded(ws) || self.st().folded_ok, "a weight folded with a norm is used by a plain product");
        Ok(())
    }

    fn attn_fns(&self, hd: usize, g: usize) -> Result<AttnFns> {
        if let Some(a) = self.st().attn.get(&(hd, g)) {
            return Ok(*a);
        }
        let m = rt::compile_and_load(&kernels::attention_source(hd, g), &self.inner.arch)?;
        let f = AttnFns {
            decode: m.func("attn_decode")?,
            decode_cl: if self.inner.cc.0 >= 9 && env_flag("BRAID_CUDA_ATTN_CLUSTER") { Some(m.func("attn_decode_cl")?) } else { None },
            combine: m.func("attn_combine")?,
            prefill: if self.inner.cc.0 >= 8 { Some(m.func("attn_prefill")?) } else { None },
        };
        let mut st = self.st();
        st.names.insert(f.decode, format!("attn_decode hd{hd} g{g}"));
        if let Some(c) = f.decode_cl {
            st.names.insert(c, format!("attn_decode_cl hd{hd} g{g}"));
        }
        st.names.insert(f.combine, format!("attn_combine hd{hd}"));
        if let Some(p) = f.prefill {
            st.names.insert(p, format!("attn_prefill hd{hd} g{g}"));
        }
        st.attn.insert((hd, g), f);
        Ok(f)
    }

    /// Run `f` (one model forward) as a CUDA graph: pass 1 runs it doing
    /// only the host work and the uploads, and hashes every launch; a graph
    /// recorded with that signature is replayed, or else pass 2 records one
    /// under stream capture and launches it. Anything that cannot be
    /// recorded (memory allocated, a failure) runs `f` eagerly instead.
    pub fn graph(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if !self.inner.graphs_enabled.load(Ordering::Relaxed) || !self.ready() || self.st().host_reads {
            return f();
        }
        let gen0 = rt::ALLOC_GEN.load(Ordering::Relaxed);
        let t0 = std::time::Instant::now();
        self.begin_pass(Mode::UploadOnly);
        let r = f();
        let (sig, perr) = self.end_pass();
        {
            let mut st = self.st();
            st.pass_host.pass_ns += t0.elapsed().as_nanos() as u64;
            st.pass_host.passes += 1;
        }
        let moved = rt::ALLOC_GEN.load(Ordering::Relaxed) != gen0;
        if perr.is_some() || moved {
            // (An error of the pass itself, such as a read-back that got
            // no data, is not the forward's: run it for real.)
            self.st().graph_fallbacks += 1;
            return f();
        }
        r?;
        let gen = rt::ALLOC_GEN.load(Ordering::Relaxed);
        let exec = {
            let mut st = self.st();
            st.graphs.retain(|_, g| {
                let keep = g.gen == gen;
                if !keep {
                    unsafe {
                        let _ = drv::graph::exec_destroy(g.exec as sys::CUgraphExec);
                    }
                }
                keep
            });
            st.graphs.get(&sig).map(|g| g.exec)
        };
        if let Some(exec) = exec {
            self.st().graph_hits += 1;
            return self.launch_graph(exec);
        }
        // Pass 2: record.
        let stream = self.stream() as sys::CUstream;
        unsafe { cu(drv::stream::begin_capture(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")? };
        self.begin_pass(Mode::LaunchOnly);
        let r = f();
        let (_, perr) = self.end_pass();
        let graph = unsafe { drv::stream::end_capture(stream) };
        let ok = r.is_ok() && perr.is_none() && rt::ALLOC_GEN.load(Ordering::Relaxed) == gen;
        let graph = match graph {
            Ok(g) if ok && !g.is_null() => g,
            other => {
                if let Ok(g) = other {
                    if !g.is_null() {
                        unsafe {
                            let _ = drv::graph::destroy(g);
                        }
                    }
                }
                self.st().graph_fallbacks += 1;
                r?;
                return f();
            }
        };
        let exec = unsafe { drv::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        unsafe {
            let _ = drv::graph::destroy(graph);
        }
        let exec = match exec {
            Ok(e) => e as usize,
            Err(e) => {
                self.st().graph_fallbacks += 1;
                eprintln!("braid: CUDA graph instantiation failed ({e:?}); running eagerly");
                return f();
            }
        };
        {
            let mut st = self.st();
            if st.graphs.len() >= 256 {
                for (_, g) in st.graphs.drain() {
                    unsafe {
                        let _ = drv::graph::exec_destroy(g.exec as sys::CUgraphExec);
                    }
                }
            }
            st.graphs.insert(sig, Graph { exec, gen });
            st.graph_captures += 1;
        }
        self.launch_graph(exec)
    }

    /// Pass 1 of `f`, the forward expected next, done now while the GPU
    /// still runs the last one: `key` hashes everything `f` reads but its
    /// token ids, and `tokens` stand in for those. The uploads queue behind
    /// the work in flight; [`Cuda::graph_keyed`] of the same key then only
    /// writes its token ids and launches. Kept only when every upload of
    /// ids in the pass is of `tokens` itself (a model that embeds ids made
    /// from them, such as Gemma 4's per-layer tables, gets no pass ahead).
    pub fn graph_ahead(&self, key: u64, tokens: &[u32], f: &mut dyn FnMut() -> Result<()>) {
        if !self.replays_ahead() || !self.ready() || self.st().host_reads || tokens.is_empty() {
            return;
        }
        let gen = rt::ALLOC_GEN.load(Ordering::Relaxed);
        let t0 = std::time::Instant::now();
        self.begin_pass(Mode::UploadOnly);
        self.st().staging = true;
        let r = f();
        self.st().staging = false;
        let (sig, perr) = self.end_pass();
        let mut st = self.st();
        let ups = std::mem::take(&mut st.token_uploads);
        let whole = !ups.is_empty() && ups.iter().all(|&(p, n, _)| p == tokens.as_ptr() as usize && n == tokens.len());
        if r.is_ok() && perr.is_none() && whole && rt::ALLOC_GEN.load(Ordering::Relaxed) == gen {
            let end = st.arena_off;
            if end > 0 {
                if let Err(e) = unsafe { cu(drv::memcpy_htod_async(self.inner.arena.ptr, &st.mirror[..end], self.stream() as sys::CUstream), "upload") } {
                    self.fail(&mut st, format!("{e:#}"));
                    return;
                }
            }
            st.ahead = Some(Ahead { key, sig, gen, tokens: tokens.len(), token_dst: ups.iter().map(|u| u.2).collect(), running: None });
        }
        st.pass_host.ahead_ns += t0.elapsed().as_nanos() as u64;
        st.pass_host.aheads += 1;
    }

    /// [`Cuda::graph`] of the forward `f` that `key` describes (as in
    /// [`Cuda::graph_ahead`]) with token ids `tokens`: when its pass 1 was
    /// done ahead and its graph is recorded, the ids are written where its
    /// embeds read them and the graph launches, with no pass 1 now.
    pub fn graph_keyed(&self, key: u64, tokens: &[u32], f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let ahead = self.st().ahead.take();
        if let Some(a) = ahead {
            let gen = rt::ALLOC_GEN.load(Ordering::Relaxed);
            if let Some(run) = &a.running {
                if a.key == key && run.as_slice() == tokens && a.gen == gen {
                    // Launched already: this very round is running.
                    let mut st = self.st();
                    st.graph_hits += 1;
                    st.ahead_hits += 1;
                    st.launched_ahead += 1;
                    return Ok(());
                }
                // It ran for nothing (its writes are past every stream's
                // length); this one replays as usual.
                return self.graph(f);
            }
            let exec = if a.key == key && a.tokens == tokens.len() && self.ready() { self.ahead_exec(&self.st(), &a) } else { None };
            if let Some(exec) = exec {
                for &dst in &a.token_dst {
                    unsafe { cu(drv::memcpy_htod_async(dst, tokens, self.stream() as sys::CUstream), "token upload")? };
                }
                {
                    let mut st = self.st();
                    st.graph_hits += 1;
                    st.ahead_hits += 1;
                }
                return self.launch_graph(exec);
            }
        }
        self.graph(f)
    }

    fn begin_pass(&self, mode: Mode) {
        let mut st = self.st();
        st.mode = mode;
        st.sig = 0xcbf29ce484222325;
        st.arena_off = 0;
        st.recent.clear();
        st.token_uploads.clear();
        st.pass_error = None;
        // Any pass rewrites the arena a pass done ahead filled.
        st.ahead = None;
    }

    fn end_pass(&self) -> (u64, Option<String>) {
        let mut st = self.st();
        st.mode = Mode::Eager;
        st.recent.clear();
        (st.sig, st.pass_error.take())
    }

    fn launch_graph(&self, exec: usize) -> Result<()> {
        let t = std::time::Instant::now();
        let r = unsafe { cu(drv::graph::launch(exec as sys::CUgraphExec, self.stream() as sys::CUstream), "cuGraphLaunch") };
        let mut st = self.st();
        st.pass_host.launch_ns += t.elapsed().as_nanos() as u64;
        st.pass_host.launches += 1;
        r
    }

    // ---- extras used by tests, random models and benchmarks ----

    /// A weight of uniform random values in `[-amp, amp)` made on the device.
    pub fn random_weight(&self, rows: usize, cols: usize, seed: u64, amp: f32) -> Result<CudaWeight> {
        rt::make_current(self.ctx())?;
        let n = rows * cols;
        let buf = DevBuf::new(self.ctx(), n * 2)?;
        self.launch(
            self.inner.fns.fill_random_bf16,
            (1024, 1, 1),
            (256, 1, 1),
            0,
            &[Arg::P(buf.ptr), Arg::U64(n as u64), Arg::U64(seed), Arg::F(amp), Arg::F(0.0)],
        )?;
        Ok(CudaWeight { rows, cols, buf, folded: AtomicU64::new(0) })
    }

    /// A one-row tensor filled with `v`.
    pub fn const_vector(&self, n: usize, v: f32) -> Result<CudaTensor> {
        rt::make_current(self.ctx())?;
        let t = self.new_tensor(1, n)?;
        self.launch(self.inner.fns.fill_f32, Self::elementwise_grid(n), (256, 1, 1), 0, &[Arg::P(t.fptr()), Arg::U64(n as u64), Arg::F(v)])?;
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
        Ok(CudaWeight { rows, cols, buf, folded: AtomicU64::new(0) })
    }

    /// Greedy tokens: the index of each row's largest value (the first, on ties).
    pub fn argmax(&self, t: &CudaTensor) -> Result<Vec<u32>> {
        self.argmax_then(t, false)
    }

    /// [`Cuda::argmax`], then the round prepared by [`Cuda::graph_ahead`]
    /// launched at once with these tokens, written where its embeds read
    /// them on the device, so that it runs while the caller handles them:
    /// [`Cuda::graph_keyed`] of that round with these tokens then finds it
    /// running. When some other forward comes instead, that round has run
    /// for nothing, so only callers whose forwards leave nothing but
    /// attention KV past each stream's length may use it (see
    /// `Device::argmax_rows_launch_ahead`).
    pub fn argmax_launch_ahead(&self, t: &CudaTensor) -> Result<Vec<u32>> {
        self.argmax_then(t, self.inner.launch_ahead)
    }

    /// The recorded graph of the round prepared ahead for `rows` tokens,
    /// and where it reads them, when it can launch now.
    fn ahead_ready(&self, rows: usize) -> Option<(usize, Vec<u64>)> {
        let st = self.st();
        let a = st.ahead.as_ref().filter(|a| a.tokens == rows && a.running.is_none())?;
        Some((self.ahead_exec(&st, a)?, a.token_dst.clone()))
    }

    /// The recorded graph of pass `a` done ahead, if nothing it relied on
    /// has moved since: no allocation, graphs on, no forward that reads
    /// values back.
    fn ahead_exec(&self, st: &State, a: &Ahead) -> Option<usize> {
        let gen = rt::ALLOC_GEN.load(Ordering::Relaxed);
        if a.gen != gen || st.host_reads || !self.inner.graphs_enabled.load(Ordering::Relaxed) {
            return None;
        }
        st.graphs.get(&a.sig).filter(|g| g.gen == gen).map(|g| g.exec)
    }

    /// Pinned host room for `bytes` (grown as needed) and the event after
    /// the copy into it. (Each use waits for its copy, so none is in
    /// flight when it grows.)
    fn ids_back(&self, bytes: usize) -> Result<(usize, usize)> {
        let mut st = self.st();
        if st.ids_back.as_ref().is_none_or(|k| k.bytes < bytes) {
            if let Some(k) = st.ids_back.take() {
                unsafe {
                    let _ = drv::free_host(k.host as *mut std::ffi::c_void);
                    let _ = drv::event::destroy(k.event as sys::CUevent);
                }
            }
            let bytes = bytes.max(8192);
            let host = unsafe { drv::malloc_host(bytes, 0) }.map_err(|e| anyhow!("pinned host memory: {e:?}"))? as usize;
            let event = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| anyhow!("cuEventCreate: {e:?}"))? as usize;
            st.ids_back = Some(IdsBack { host, bytes, event });
        }
        let k = st.ids_back.as_ref().expect("just made");
        Ok((k.host, k.event))
    }

    fn argmax_then(&self, t: &CudaTensor, launch_ahead: bool) -> Result<Vec<u32>> {
        if !self.ready() {
            self.sync()?;
        }
        let rows = t.rows;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let stream = self.stream() as sys::CUstream;
        let (keys, done, ids) = {
            let mut st = self.st();
            if st.argmax_cap < rows {
                let cap = rows.max(1024);
                let bytes = cap * 12 + 16;
                st.argmax_buf = DevBuf::new(self.ctx(), bytes)?;
                st.argmax_cap = cap;
                // Zero once; each call leaves it zeroed again.
                unsafe { cu(drv::memset_d8_async(st.argmax_buf.ptr, 0, bytes, stream), "argmax clear")? };
            }
            let (p, cap) = (st.argmax_buf.ptr, st.argmax_cap as u64);
            (p, p + cap * 8, p + cap * 8 + 16)
        };
        let go = if launch_ahead { self.ahead_ready(rows) } else { None };
        let dst = go.as_ref().map_or(0, |g| g.1[0]);
        // Enough blocks per row to spread a long row over the GPU.
        let split = (t.cols / 1024).clamp(1, (4 * self.inner.sms).div_ceil(rows).max(1)) as u32;
        self.launch(
            self.inner.fns.argmax_rows,
            (rows as u32, split, 1),
            (256, 1, 1),
            0,
            &[Arg::P(t.fptr()), Arg::I(t.cols as i32), Arg::P(keys), Arg::P(done), Arg::P(ids), Arg::P(dst)],
        )?;
        if let Some((_, more)) = &go {
            for &d in &more[1..] {
                unsafe { cu(drv::memcpy_dtod_async(d, ids, rows * 4, stream), "token ids")? };
            }
        }
        // The ids come back through pinned memory: the copy is queued,
        // the next round may launch behind it, and only then the host waits.
        let (host, event) = self.ids_back(rows * 4)?;
        unsafe {
            cu(sys::cuMemcpyDtoHAsync_v2(host as *mut std::ffi::c_void, ids, rows * 4, stream).result(), "argmax download")?;
            cu(drv::event::record(event as sys::CUevent, stream), "cuEventRecord")?;
        }
        if let Some((exec, _)) = go {
            self.launch_graph(exec)?;
        }
        unsafe { cu(drv::event::synchronize(event as sys::CUevent), "argmax download")? };
        if let Some(e) = &self.st().error {
            bail!("CUDA device error: {e}");
        }
        let out = unsafe { std::slice::from_raw_parts(host as *const u32, rows) }.to_vec();
        if go.is_some() {
            if let Some(a) = self.st().ahead.as_mut() {
                a.running = Some(out.clone());
            }
        }
        Ok(out)
    }

    /// Each row's `k` (at most `TOPK_MAX`) largest values and their
    /// columns, as `Device::top_k_rows` describes: each chunk of a row
    /// sorted in shared memory (bitonic, 2048 or 4096 keys), its best k
    /// kept, then those sorted per row; k keys a row come back.
    pub fn top_k(&self, t: &CudaTensor, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        if !self.ready() {
            self.sync()?;
        }
        let (rows, cols) = (t.rows, t.cols);
        let k = k.min(cols);
        ensure!(k <= TOPK_MAX, "top_k: k = {k} past the {TOPK_MAX} this device finds");
        // Chunks small enough that their kept keys fit one sort.
        let per = TOPK_N / k.max(1).next_power_of_two();
        let n = cols.div_ceil(per).next_power_of_two().max(k.next_power_of_two()).max(2);
        if rows == 0 || k == 0 || n > TOPK_N {
            return Ok(crate::top_k_host(&self.download(t)?, cols, k));
        }
        let chunks = cols.div_ceil(n);
        let m = chunks * k;
        let (part, out) = {
            let mut guard = self.st();
            let st = &mut *guard;
            for (buf, bytes) in [(&mut st.topk_part, rows * m * 8), (&mut st.topk_out, rows * k * 8)] {
                if buf.bytes < bytes {
                    *buf = DevBuf::new(self.ctx(), bytes.max(1 << 16))?;
                }
            }
            (st.topk_part.ptr, st.topk_out.ptr)
        };
        let threads = (n / 2).clamp(32, 1024) as u32;
        self.launch(
            self.inner.fns.topk_chunks,
            (chunks as u32, rows as u32, 1),
            (threads, 1, 1),
            0,
            &[Arg::P(t.fptr()), Arg::I(cols as i32), Arg::I(n as i32), Arg::I(k as i32), Arg::P(part)],
        )?;
        let n2 = m.next_power_of_two().max(2);
        let threads = (n2 / 2).clamp(32, 1024) as u32;
        self.launch(
            self.inner.fns.topk_merge,
            (rows as u32, 1, 1),
            (threads, 1, 1),
            0,
            &[Arg::P(part), Arg::I(m as i32), Arg::I(n2 as i32), Arg::I(k as i32), Arg::P(out)],
        )?;
        let mut keys = vec![0u64; rows * k];
        self.read_back(&mut keys, out, "top_k download")?;
        Ok(keys
            .chunks(k)
            .map(|row| {
                row.iter()
                    .map(|&key| {
                        let ord = (key >> 32) as u32;
                        let bits = if ord & 0x8000_0000 != 0 { ord & 0x7fff_ffff } else { !ord };
                        (0xffff_ffff - (key & 0xffff_ffff) as u32, f32::from_bits(bits))
                    })
                    .collect()
            })
            .collect())
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

    /// Bytes of device memory (free, total).
    pub fn memory(&self) -> Result<(usize, usize)> {
        rt::make_current(self.ctx())?;
        drv::mem_get_info().map_err(|e| anyhow!("cuMemGetInfo: {e:?}"))
    }

    /// Compiled-kernel check: build the attention kernels for a shape now
    /// (so a compile error shows here, not inside a forward).
    pub fn prepare_attention(&self, head_dim: usize, group: usize) -> Result<()> {
        rt::make_current(self.ctx())?;
        self.attn_fns(head_dim, group).map(|_| ())
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_impl(
        &self,
        q: &CudaTensor,
        kv: &CudaKv,
        layer: usize,
        seqs: &[AttnSeq<'_>],
        scale: f32,
        softcap: Option<f32>,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let shape = *kv.spec.layers.get(layer).ok_or_else(|| anyhow!("attention: layer {layer} not in the KV pool"))?;
        let (hd, kvh) = (shape.head_dim, shape.kv_heads);
        ensure!(hd % 16 == 0 && hd <= 256, "attention: head dim {hd} is not supported on CUDA (a multiple of 16, at most 256)");
        ensure!(q.cols.is_multiple_of(hd), "attention: q is {} wide, not a multiple of head dim {hd}", q.cols);
        let heads = q.cols / hd;
        ensure!(heads.is_multiple_of(kvh) && heads / kvh <= 16, "attention: {heads} query heads over {kvh} KV heads is not supported");
        let g = heads / kvh;
        self.grow(out, q.rows, q.cols)?;
        let bt = kv.spec.block_tokens;
        let max_q = seqs.iter().map(|s| s.q_len).max().unwrap_or(0);
        if max_q == 0 {
            return Ok(());
        }
        let fns = self.attn_fns(hd, g)?;
        let (f_dec, f_comb, f_pre) = (fns.decode, fns.combine, fns.prefill);
        let prefill = f_pre.is_some() && max_q > 4;
        if prefill && seqs.iter().any(|s| s.q_len > 0 && s.q_len <= 4) {
            // A decode round sharing its forward with a prompt chunk: the
            // decode rows keep the split-KV kernel (one prefill block
            // walking a long context alone would stall them).
            let (short, long): (Vec<AttnSeq<'_>>, Vec<AttnSeq<'_>>) = seqs.iter().partition(|s| s.q_len <= 4);
            self.attention_impl(q, kv, layer, &short, scale, softcap, out)?;
            return self.attention_impl(q, kv, layer, &long, scale, softcap, out);
        }
        // Metadata: per sequence [q_start, q_len, kv_len, window, table offset],
        // then the work list (rows or 64-row tiles), then the block tables.
        let mut meta: Vec<u32> = Vec::with_capacity(seqs.len() * 8);
        let mut bt_off = 0usize;
        for s in seqs {
            ensure!(s.kv_len >= s.q_len && s.q_start + s.q_len <= q.rows, "attention: sequence rows {}+{} of {} (kv {})", s.q_start, s.q_len, q.rows, s.kv_len);
            ensure!(s.blocks.len() * bt >= s.kv_len, "attention: {} blocks hold fewer than {} positions", s.blocks.len(), s.kv_len);
            meta.extend([s.q_start as u32, s.q_len as u32, s.kv_len as u32, s.window.unwrap_or(0) as u32, bt_off as u32]);
            bt_off += s.kv_len.div_ceil(bt);
        }
        let off_list = meta.len();
        let mut work = 0usize;
        for (si, s) in seqs.iter().enumerate() {
            if prefill {
                for t in (0..s.q_len).step_by(PREFILL_ROWS) {
                    meta.extend([si as u32, t as u32]);
                    work += 1;
                }
            } else {
                for i in 0..s.q_len {
                    meta.extend([si as u32, i as u32]);
                    work += 1;
                }
            }
        }
        let off_bt = meta.len();
        for s in seqs {
            meta.extend_from_slice(&s.blocks[..s.kv_len.div_ceil(bt)]);
        }
        let mp = self.put_u32(&meta)?;
        let (kc, vc) = (kv.k[layer].ptr, kv.v[layer].ptr);
        let kv_w = (kvh * hd) as i32;
        let cap = softcap.unwrap_or(0.0);
        if prefill {
            let f = f_pre.unwrap_or(f_dec);
            self.launch(
                f,
                (work as u32, heads as u32, 1),
                (128, 1, 1),
                0,
                &[
                    Arg::P(q.fptr()),
                    Arg::I(q.cols as i32),
                    Arg::P(kc),
                    Arg::P(vc),
                    Arg::I(kv_w),
                    Arg::I(bt as i32),
                    Arg::P(mp),
                    Arg::I(off_list as i32),
                    Arg::I(off_bt as i32),
                    Arg::F(scale),
                    Arg::F(cap),
                    Arg::P(out.fptr()),
                    Arg::P(out.bptr()),
                ],
            )?;
        } else {
            // Split the keys so the launch fills the GPU; the split count
            // depends on the batch shape only, so graphs stay valid as
            // sequences grow. (Not splitting short contexts was tried: one
            // block per KV head walking 200 keys took 14.8 µs against 6.4 +
            // 4.2 for the split and its combine.)
            let ctas = work * kvh;
            // A row and KV head's splits as one cluster (at most 8 blocks,
            // the portable cluster size) merge in shared memory.
            let max = if fns.decode_cl.is_some() { self.inner.attn_max_splits.min(8) } else { self.inner.attn_max_splits };
            let nsplit = (4 * self.inner.sms).div_ceil(ctas.max(1)).clamp(1, max);
            let cluster = fns.decode_cl.filter(|_| nsplit > 1);
            let part = if nsplit > 1 && cluster.is_none() {
                let need = work * heads * nsplit * (hd + 2) * 4;
                let mut st = self.st();
                if st.part.bytes < need {
                    if st.mode == Mode::LaunchOnly {
                        bail!("attention scratch grew inside graph capture");
                    }
                    st.part = DevBuf::new(self.ctx(), need.max(4 << 20))?;
                }
                st.part.ptr
            } else {
                0
            };
            self.launch_cluster(
                cluster.unwrap_or(f_dec),
                (nsplit as u32, kvh as u32, work as u32),
                (128, 1, 1),
                0,
                &[
                    Arg::P(q.fptr()),
                    Arg::I(q.cols as i32),
                    Arg::P(kc),
                    Arg::P(vc),
                    Arg::I(kv_w),
                    Arg::I(bt as i32),
                    Arg::P(mp),
                    Arg::I(off_list as i32),
                    Arg::I(off_bt as i32),
                    Arg::I(nsplit as i32),
                    Arg::F(scale),
                    Arg::F(cap),
                    Arg::I(heads as i32),
                    Arg::P(out.fptr()),
                    Arg::P(out.bptr()),
                    Arg::P(part),
                ],
                if cluster.is_some() { nsplit as u32 } else { 1 },
            )?;
            if nsplit > 1 && cluster.is_none() {
                self.launch(
                    f_comb,
                    (work as u32, heads as u32, 1),
                    (hd as u32, 1, 1),
                    0,
                    &[
                        Arg::P(part),
                        Arg::P(mp),
                        Arg::I(off_list as i32),
                        Arg::I(nsplit as i32),
                        Arg::I(heads as i32),
                        Arg::I(q.cols as i32),
                        Arg::P(out.fptr()),
                        Arg::P(out.bptr()),
                    ],
                )?;
            }
        }
        out.set_bf(true);
        Ok(())
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

impl Device for Cuda {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Kv = CudaKv;

    fn batch_invariant(&self) -> bool {
        // cuBLAS chooses kernels (and reduction orders) by shape.
        false
    }

    fn replay(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.graph(f)
    }

    fn replays_ahead(&self) -> bool {
        self.inner.ahead && self.inner.graphs_enabled.load(Ordering::Relaxed)
    }

    fn replay_ahead(&self, key: u64, tokens: &[u32], f: &mut dyn FnMut() -> Result<()>) {
        self.graph_ahead(key, tokens, f)
    }

    fn replay_keyed(&self, key: u64, tokens: &[u32], f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.graph_keyed(key, tokens, f)
    }

    fn argmax_rows(&self, x: &CudaTensor) -> Result<Vec<u32>> {
        self.argmax(x)
    }

    fn argmax_rows_launch_ahead(&self, x: &CudaTensor) -> Result<Vec<u32>> {
        self.argmax_launch_ahead(x)
    }

    fn argmax_on_device(&self) -> bool {
        true
    }

    fn top_k_rows(&self, x: &CudaTensor, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        self.top_k(x, k)
    }

    fn top_k_on_device(&self) -> usize {
        TOPK_MAX
    }

    fn name(&self) -> String {
        format!("cuda ({}, {})", self.inner.name, self.inner.arch)
    }

    fn tensor(&self, rows: usize, cols: usize) -> CudaTensor {
        match rt::make_current(self.ctx()).and_then(|_| self.new_tensor(rows, cols)) {
            Ok(t) => t,
            Err(e) => {
                self.record(Err(e));
                CudaTensor { rows: 0, cols, cap: 0, f: DevBuf::empty(self.ctx()), b: DevBuf::empty(self.ctx()), bf_ok: AtomicBool::new(false) }
            }
        }
    }

    fn resize(&self, t: &mut CudaTensor, rows: usize, cols: usize) {
        let r = rt::make_current(self.ctx()).and_then(|_| self.grow(t, rows, cols));
        self.record(r);
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        ensure!(data.len() == rows * cols, "upload: {} values for a {rows}x{cols} tensor", data.len());
        rt::make_current(self.ctx())?;
        let t = self.new_tensor(rows, cols)?;
        if !data.is_empty() {
            unsafe { cu(drv::memcpy_htod_async(t.fptr(), data, self.stream() as sys::CUstream), "upload")? };
        }
        Ok(t)
    }

    fn download(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        {
            let mut st = self.st();
            if st.mode != Mode::Eager {
                // A forward that reads values back (MoE routing) cannot be
                // a graph: end this pass (the forward then runs eagerly)
                // and run such forwards eagerly from now on.
                st.pass_error.get_or_insert_with(|| "a download inside a graph pass".into());
                st.host_reads = true;
                return Ok(vec![0.0; t.len()]);
            }
        }
        let mut out = vec![0f32; t.len()];
        self.read_back(&mut out, t.fptr(), "download")?;
        Ok(out)
    }

    fn weight(&self, view: &TensorView) -> Result<CudaWeight> {
        let (rows, cols) = match view.shape.as_slice() {
            [r, c] => (*r, *c),
            [c] => (1, *c),
            s => bail!("tensor {}: expected a 2-D weight, found shape {:?}", view.name, s),
        };
        let bits = to_bf16_bits(view, rows * cols)?;
        self.weight_from_bf16_bits(&bits, rows, cols)
    }

    fn weight_shape(&self, w: &CudaWeight) -> (usize, usize) {
        (w.rows, w.cols)
    }

    fn vector(&self, view: &TensorView, offset: f32) -> Result<CudaTensor> {
        let n = view.elements();
        let mut data = vec![0.0f32; n];
        crate::cpu::quant::dequantize(view.dtype, &view.data, &mut data).map_err(|e| anyhow!("tensor {}: {e}", view.name))?;
        if offset != 0.0 {
            data.iter_mut().for_each(|x| *x += offset);
        }
        self.upload(&data, 1, n)
    }

    fn kv_pool(&self, spec: &KvPoolSpec) -> Result<CudaKv> {
        rt::make_current(self.ctx())?;
        let slots = spec.blocks * spec.block_tokens;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for l in &spec.layers {
            let bytes = slots * l.kv_heads * l.head_dim * 2;
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

    fn embed(&self, table: &CudaWeight, ids: &[u32], scale: f32, out: &mut CudaTensor) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            self.grow(out, ids.len(), table.cols)?;
            if ids.is_empty() {
                return Ok(());
            }
            let p = self.put_tokens(ids)?;
            self.launch(
                self.inner.fns.embed,
                (ids.len() as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::P(table.buf.ptr),
                    Arg::P(p),
                    Arg::I(table.cols as i32),
                    Arg::I(table.rows as i32),
                    Arg::F(scale),
                    Arg::P(out.fptr()),
                    Arg::P(out.bptr()),
                ],
            )?;
            out.set_bf(true);
            Ok(())
        })();
        self.record(r);
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaWeight, out: &mut CudaTensor) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            ensure!(x.cols == w.cols, "matmul: x has {} columns, weight takes {}", x.cols, w.cols);
            self.check_unfolded(&[w])?;
            self.grow(out, x.rows, w.rows)?;
            if x.rows == 0 {
                return Ok(());
            }
            self.ensure_bf16(x)?;
            if self.gemv_fits(x.rows, x.cols) {
                self.gemv_launch(x, &[(w.buf.ptr, w.rows, out.fptr())])
            } else {
                self.gemm(w.buf.ptr, x.bptr(), out.fptr(), w.rows, x.rows, w.cols, GemmOut::F32)
            }
        })();
        self.record(r);
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize], out: &mut CudaTensor) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            ensure!(rows.iter().all(|&r| r < x.rows), "gather_rows: row out of range ({} rows)", x.rows);
            self.grow(out, rows.len(), x.cols)?;
            if rows.is_empty() {
                return Ok(());
            }
            let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            let p = self.put_u32(&idx)?;
            self.launch(
                self.inner.fns.gather_rows,
                (rows.len() as u32, 1, 1),
                (256, 1, 1),
                0,
                &[Arg::P(x.fptr()), Arg::P(p), Arg::I(x.cols as i32), Arg::P(out.fptr()), Arg::P(out.bptr())],
            )?;
            out.set_bf(true);
            Ok(())
        })();
        self.record(r);
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaTensor, eps: f32, out: &mut CudaTensor) {
        if !self.ready() {
            return;
        }
        let r = self.rms_norm_with(x, Some(w), eps, out);
        self.record(r);
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            ensure!(x.len() == y.len(), "add: {}x{} += {}x{}", x.rows, x.cols, y.rows, y.cols);
            x.set_bf(false);
            let n = x.len();
            self.launch(self.inner.fns.add, Self::elementwise_grid(n), (256, 1, 1), 0, &[Arg::P(x.fptr()), Arg::P(y.fptr()), Arg::U64(n as u64)])
        })();
        self.record(r);
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor, out: &mut CudaTensor) {
        self.act_mul(self.inner.fns.silu_mul, gate, up, out);
    }

    fn gelu_mul(&self, gate: &CudaTensor, up: &CudaTensor, out: &mut CudaTensor) {
        self.act_mul(self.inner.fns.gelu_mul, gate, up, out);
    }

    fn rope(&self, x: &mut CudaTensor, positions: &[u32], head_dim: usize, rope: &Rope) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            ensure!(positions.len() == x.rows, "rope: {} positions for {} rows", positions.len(), x.rows);
            ensure!(head_dim > 0 && x.cols.is_multiple_of(head_dim), "rope: head dim {head_dim} does not divide {}", x.cols);
            x.set_bf(false);
            if x.rows == 0 {
                return Ok(());
            }
            let dims = rope.dims.min(head_dim);
            let p = self.put_u32(positions)?;
            self.launch(
                self.inner.fns.rope,
                (x.rows as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::P(x.fptr()),
                    Arg::P(p),
                    Arg::I(x.cols as i32),
                    Arg::I(head_dim as i32),
                    Arg::I(dims as i32),
                    Arg::F(rope.theta),
                    Arg::F(rope.scale),
                    Arg::I(rope.neox as i32),
                ],
            )
        })();
        self.record(r);
    }

    fn kv_write(&self, kv: &mut CudaKv, layer: usize, k: &CudaTensor, v: &CudaTensor, slots: &[u32]) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            let s = *kv.spec.layers.get(layer).ok_or_else(|| anyhow!("kv_write: no layer {layer}"))?;
            let w = s.kv_heads * s.head_dim;
            ensure!(k.cols == w && v.cols == w, "kv_write: k is {} wide, the pool holds {w}", k.cols);
            ensure!(slots.len() <= k.rows && slots.len() <= v.rows, "kv_write: {} slots for {} rows", slots.len(), k.rows);
            let total = (kv.spec.blocks * kv.spec.block_tokens) as u32;
            ensure!(slots.iter().all(|&s| s < total), "kv_write: slot past the pool's {total}");
            if slots.is_empty() {
                return Ok(());
            }
            let p = self.put_u32(slots)?;
            self.launch(
                self.inner.fns.kv_write,
                (slots.len() as u32, 1, 1),
                (128, 1, 1),
                0,
                &[Arg::P(k.fptr()), Arg::P(v.fptr()), Arg::P(p), Arg::I(w as i32), Arg::P(kv.k[layer].ptr), Arg::P(kv.v[layer].ptr)],
            )
        })();
        self.record(r);
    }

    /// One kernel over whole rows; per-head norms take the two ops.
    fn add_rms_norm(&self, x: &mut CudaTensor, y: &CudaTensor, w: &CudaTensor, eps: f32, out: &mut CudaTensor) {
        if !self.ready() {
            return;
        }
        if w.cols != x.cols {
            self.add(x, y);
            self.rms_norm(x, w, eps, out);
            return;
        }
        let r = (|| {
            ensure!(x.len() == y.len(), "add_rms_norm: {}x{} += {}x{}", x.rows, x.cols, y.rows, y.cols);
            self.grow(out, x.rows, x.cols)?;
            x.set_bf(false);
            if x.rows == 0 {
                return Ok(());
            }
            // Few rows (decode): wider blocks, fewer serial steps per thread.
            let threads = if x.rows <= FEW_ROWS { 1024 } else { 256 };
            self.launch(
                self.inner.fns.add_rms_norm,
                (x.rows as u32, 1, 1),
                (threads, 1, 1),
                0,
                &[Arg::P(x.fptr()), Arg::P(y.fptr()), Arg::P(w.fptr()), Arg::P(out.fptr()), Arg::P(out.bptr()), Arg::I(x.cols as i32), Arg::F(eps)],
            )?;
            out.set_bf(true);
            Ok(())
        })();
        self.record(r);
    }

    /// Few rows: up to three weights per GEMV launch; more: one GEMM each.
    fn matmul_many(&self, x: &CudaTensor, ws: &[&CudaWeight], outs: &mut [&mut CudaTensor]) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            ensure!(ws.len() == outs.len(), "matmul_many: {} weights for {} outputs", ws.len(), outs.len());
            self.check_unfolded(ws)?;
            for w in ws {
                ensure!(x.cols == w.cols, "matmul: x has {} columns, weight takes {}", x.cols, w.cols);
            }
            for (w, o) in ws.iter().zip(outs.iter_mut()) {
                self.grow(o, x.rows, w.rows)?;
            }
            if x.rows == 0 || ws.is_empty() {
                return Ok(());
            }
            self.ensure_bf16(x)?;
            if self.gemv_fits(x.rows, x.cols) {
                let list: Vec<(u64, usize, u64)> = ws.iter().zip(outs.iter()).map(|(w, o)| (w.buf.ptr, w.rows, o.fptr())).collect();
                for c in list.chunks(3) {
                    self.gemv_launch(x, c)?;
                }
            } else {
                for (w, o) in ws.iter().zip(outs.iter()) {
                    self.gemm(w.buf.ptr, x.bptr(), o.fptr(), w.rows, x.rows, w.cols, GemmOut::F32)?;
                }
            }
            Ok(())
        })();
        self.record(r);
    }

    /// Few rows: one GEMV launch for gate, up and the activation (gate and
    /// up never written). More: the GEMMs write bf16 gate and up, which the
    /// activation reads (half the bytes of f32 both ways).
    fn gated_matmul(
        &self,
        x: &CudaTensor,
        w_gate: &CudaWeight,
        w_up: &CudaWeight,
        act: GateAct,
        gate: &mut CudaTensor,
        up: &mut CudaTensor,
        out: &mut CudaTensor,
    ) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            Self::check_gated("gated_matmul", x, w_gate, w_up)?;
            self.check_unfolded(&[w_gate, w_up])?;
            let (n, m, k) = (x.rows, w_gate.rows, x.cols);
            self.grow(out, n, m)?;
            if n == 0 || m == 0 {
                return Ok(());
            }
            self.ensure_bf16(x)?;
            let a = act_code(act);
            if self.gemv_fits(n, k) {
                self.gemv_gated_launch(x, w_gate, w_up, act, out, None)?;
            } else {
                self.grow(gate, n, m)?;
                self.grow(up, n, m)?;
                self.gemm(w_gate.buf.ptr, x.bptr(), gate.bptr(), m, n, k, GemmOut::Bf16)?;
                self.gemm(w_up.buf.ptr, x.bptr(), up.bptr(), m, n, k, GemmOut::Bf16)?;
                // Only their bf16 halves hold values now; `grow` left
                // bf_ok false, so nothing later trusts either half.
                let len = n * m;
                // Eight values a thread where the length allows (the buffers
                // start 256-byte aligned).
                let (f, units) = if len.is_multiple_of(8) { (self.inner.fns.act_mul_bf8, len / 8) } else { (self.inner.fns.act_mul_bf, len) };
                self.launch(
                    f,
                    Self::elementwise_grid(units),
                    (256, 1, 1),
                    0,
                    &[Arg::P(gate.bptr()), Arg::P(up.bptr()), Arg::P(out.fptr()), Arg::P(out.bptr()), Arg::U64(units as u64), Arg::I(a)],
                )?;
            }
            out.set_bf(true);
            Ok(())
        })();
        self.record(r);
    }

    fn rope_kv_write(
        &self,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &CudaTensor,
        kv: &mut CudaKv,
        layer: usize,
        positions: &[u32],
        slots: &[u32],
        head_dim: usize,
        rope: &Rope,
    ) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            let s = *kv.spec.layers.get(layer).ok_or_else(|| anyhow!("rope_kv_write: no layer {layer}"))?;
            let w = s.kv_heads * s.head_dim;
            ensure!(positions.len() == q.rows && q.rows == k.rows, "rope_kv_write: {} positions for {} q rows, {} k rows", positions.len(), q.rows, k.rows);
            ensure!(
                head_dim > 0 && q.cols.is_multiple_of(head_dim) && k.cols.is_multiple_of(head_dim),
                "rope_kv_write: head dim {head_dim} does not divide {} or {}",
                q.cols,
                k.cols
            );
            ensure!(k.cols == w && v.cols == w, "kv_write: k is {} wide, v {}, the pool holds {w}", k.cols, v.cols);
            ensure!(slots.len() <= k.rows && slots.len() <= v.rows, "kv_write: {} slots for {} rows", slots.len(), k.rows);
            let total = (kv.spec.blocks * kv.spec.block_tokens) as u32;
            ensure!(slots.iter().all(|&s| s < total), "kv_write: slot past the pool's {total}");
            q.set_bf(false);
            k.set_bf(false);
            if q.rows == 0 {
                return Ok(());
            }
            let dims = rope.dims.min(head_dim);
            let p = self.put_u32(positions)?;
            let sp = if slots.is_empty() { 0 } else { self.put_u32(slots)? };
            let heads = q.cols / head_dim + w / head_dim;
            let (f, grid, threads) = if q.rows <= FEW_ROWS {
                (self.inner.fns.rope_kv, (q.rows as u32, heads as u32, 1), head_dim.next_power_of_two().clamp(32, 256) as u32)
            } else {
                (self.inner.fns.rope_kv_rows, (q.rows as u32, 1, 1), 256)
            };
            self.launch(
                f,
                grid,
                (threads, 1, 1),
                0,
                &[
                    Arg::P(q.fptr()),
                    Arg::P(k.fptr()),
                    Arg::P(v.fptr()),
                    Arg::P(p),
                    Arg::P(sp),
                    Arg::I(slots.len() as i32),
                    Arg::I(q.cols as i32),
                    Arg::I(w as i32),
                    Arg::I(head_dim as i32),
                    Arg::I(dims as i32),
                    Arg::F(rope.theta),
                    Arg::F(rope.scale),
                    Arg::I(rope.neox as i32),
                    Arg::P(kv.k[layer].ptr),
                    Arg::P(kv.v[layer].ptr),
                ],
            )
        })();
        self.record(r);
    }

    /// Few rows, RoPE over whole heads: one GEMV launch whose store turns
    /// q and k and writes k and v to the pool (`gemv_rope`), the input's
    /// RMSNorm folded in; else the norm, the products, then
    /// `rope_kv_write`.
    fn qkv_rope_kv(
        &self,
        x: &CudaTensor,
        norm: Option<(&CudaTensor, f32)>,
        normed: &mut CudaTensor,
        ws: [&CudaWeight; 3],
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &mut CudaTensor,
        kv: &mut CudaKv,
        layer: usize,
        positions: &[u32],
        slots: &[u32],
        head_dim: usize,
        rope: &Rope,
    ) {
        if !self.ready() {
            return;
        }
        let [wq, wk, wv] = ws;
        let kv_w = kv.spec.layers.get(layer).map(|s| s.kv_heads * s.head_dim);
        let total = (kv.spec.blocks * kv.spec.block_tokens) as u32;
        let gemv = self.inner.rope_fold
            && self.gemv_fits(x.rows, x.cols)
            && head_dim > 0
            && rope.dims >= head_dim
            && (head_dim / 2).is_multiple_of(4)
            && head_dim.is_multiple_of(2)
            && ws.iter().all(|w| w.cols == x.cols)
            && wq.rows.is_multiple_of(head_dim)
            && kv_w == Some(wk.rows)
            && wv.rows == wk.rows
            && positions.len() == x.rows
            && slots.len() <= x.rows
            && slots.iter().all(|&s| s < total);
        let r = (|| {
            let fold = match norm {
                Some((w, eps)) => {
                    let folded = self.norm_folded(x, w, &ws)?;
                    self.normed_input(x, w, eps, folded, gemv, normed)?
                }
                None => None,
            };
            let input: &CudaTensor = if norm.is_some() && fold.is_none() { normed } else { x };
            if !gemv {
                self.with_folded(|| self.matmul_many(input, &ws, &mut [&mut *q, &mut *k, &mut *v]));
                self.rope_kv_write(q, k, v, kv, layer, positions, slots, head_dim, rope);
                return Ok(());
            }
            self.grow(q, x.rows, wq.rows)?;
            self.grow(k, x.rows, wk.rows)?;
            self.grow(v, x.rows, wv.rows)?;
            if x.rows == 0 {
                return Ok(());
            }
            self.ensure_bf16(input)?;
            let p = self.put_u32(positions)?;
            let sp = if slots.is_empty() { 0 } else { self.put_u32(slots)? };
            let (xf, eps) = fold.unwrap_or((0, 0.0));
            // 4 RoPE pairs (8 rows) a block for q and k, 8 rows for v.
            let (nbq, nbk, nbv) = (wq.rows / 8, wk.rows / 8, wv.rows.div_ceil(8));
            let f = self.gemv_kernel(x.rows, x.cols / 8, 1, &self.inner.fns.gemv_rope);
            self.launch(
                f,
                ((nbq + nbk + nbv) as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::P(input.bptr()),
                    Arg::I(x.rows as i32),
                    Arg::I((x.cols / 8) as i32),
                    Arg::P(wq.buf.ptr),
                    Arg::P(wk.buf.ptr),
                    Arg::P(wv.buf.ptr),
                    Arg::P(q.fptr()),
                    Arg::P(k.fptr()),
                    Arg::P(v.fptr()),
                    Arg::I(wq.rows as i32),
                    Arg::I(wk.rows as i32),
                    Arg::I(nbq as i32),
                    Arg::I(nbk as i32),
                    Arg::I(head_dim as i32),
                    Arg::I(rope.neox as i32),
                    Arg::F(rope.theta),
                    Arg::F(rope.scale),
                    Arg::P(p),
                    Arg::P(sp),
                    Arg::I(slots.len() as i32),
                    Arg::P(kv.k[layer].ptr),
                    Arg::P(kv.v[layer].ptr),
                    Arg::P(xf),
                    Arg::F(eps),
                ],
            )
        })();
        self.record(r);
    }

    /// Few rows: the norm (folded into the weights), gate, up and the
    /// activation in one GEMV launch; else the norm, then `gated_matmul`.
    fn norm_gated_matmul(
        &self,
        x: &CudaTensor,
        w_norm: &CudaTensor,
        eps: f32,
        normed: &mut CudaTensor,
        w_gate: &CudaWeight,
        w_up: &CudaWeight,
        act: GateAct,
        gate: &mut CudaTensor,
        up: &mut CudaTensor,
        out: &mut CudaTensor,
    ) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            Self::check_gated("norm_gated_matmul", x, w_gate, w_up)?;
            let folded = self.norm_folded(x, w_norm, &[w_gate, w_up])?;
            match self.normed_input(x, w_norm, eps, folded, self.gemv_fits(x.rows, x.cols), normed)? {
                Some(fold) => {
                    self.grow(out, x.rows, w_gate.rows)?;
                    self.gemv_gated_launch(x, w_gate, w_up, act, out, Some(fold))?;
                    out.set_bf(true);
                }
                None => self.with_folded(|| self.gated_matmul(normed, w_gate, w_up, act, gate, up, out)),
            }
            Ok(())
        })();
        self.record(r);
    }

    /// The product added in the GEMV's store, which also writes the sum's
    /// bf16 copy (few rows), or by cuBLAS (beta = 1); `tmp` is written only
    /// with the folds off.
    fn matmul_add(&self, x: &CudaTensor, w: &CudaWeight, tmp: &mut CudaTensor, acc: &mut CudaTensor) {
        if !self.ready() {
            return;
        }
        if !self.inner.norm_fold {
            self.matmul(x, w, tmp);
            self.add(acc, tmp);
            return;
        }
        let r = (|| {
            ensure!(x.cols == w.cols, "matmul_add: x has {} columns, weight takes {}", x.cols, w.cols);
            ensure!(acc.rows == x.rows && acc.cols == w.rows, "matmul_add: {}x{} += {} rows x {}", acc.rows, acc.cols, x.rows, w.rows);
            self.check_unfolded(&[w])?;
            acc.set_bf(false);
            if x.rows == 0 {
                return Ok(());
            }
            self.ensure_bf16(x)?;
            if self.gemv_fits(x.rows, x.cols) {
                self.gemv_launch_ex(x, &[(w.buf.ptr, w.rows, acc.fptr())], Some(acc.bptr()))?;
                acc.set_bf(true);
                Ok(())
            } else {
                self.gemm(w.buf.ptr, x.bptr(), acc.fptr(), w.rows, x.rows, w.cols, GemmOut::AddF32)
            }
        })();
        self.record(r);
    }

    fn kv_copy_blocks(&self, kv: &mut CudaKv, src: &[u32], dst: &[u32]) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            let bt = kv.spec.block_tokens;
            ensure!(src.iter().chain(dst).all(|&b| (b as usize) < kv.spec.blocks), "kv_copy_blocks: block past the pool's {}", kv.spec.blocks);
            for (l, shape) in kv.spec.layers.iter().enumerate() {
                let n = bt * shape.kv_heads * shape.head_dim * 2;
                for (&s, &d) in src.iter().zip(dst) {
                    for buf in [&kv.k[l], &kv.v[l]] {
                        let (sp, dp) = (buf.ptr + s as u64 * n as u64, buf.ptr + d as u64 * n as u64);
                        if self.issue(&[0x6b76, sp, dp, n as u64]) {
                            unsafe { cu(drv::memcpy_dtod_async(dp, sp, n, self.stream() as sys::CUstream), "kv_copy_blocks")? };
                        }
                    }
                }
            }
            Ok(())
        })();
        self.record(r);
    }

    fn attention(&self, q: &CudaTensor, kv: &CudaKv, layer: usize, seqs: &[AttnSeq<'_>], scale: f32, softcap: Option<f32>, out: &mut CudaTensor) {
        if !self.ready() {
            return;
        }
        let r = self.attention_impl(q, kv, layer, seqs, scale, softcap, out);
        self.record(r);
    }

    fn scale(&self, x: &mut CudaTensor, s: f32) {
        if !self.ready() {
            return;
        }
        x.set_bf(false);
        let n = x.len();
        let r = self.launch(self.inner.fns.scale, Self::elementwise_grid(n), (256, 1, 1), 0, &[Arg::P(x.fptr()), Arg::F(s), Arg::U64(n as u64)]);
        self.record(r);
    }

    fn softcap(&self, x: &mut CudaTensor, cap: f32) {
        if !self.ready() {
            return;
        }
        x.set_bf(false);
        let n = x.len();
        let r = self.launch(self.inner.fns.softcap, Self::elementwise_grid(n), (256, 1, 1), 0, &[Arg::P(x.fptr()), Arg::F(cap), Arg::U64(n as u64)]);
        self.record(r);
    }

    fn copy_rows(&self, t: &mut CudaTensor, src: &[u32], dst: &[u32]) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            ensure!(src.iter().chain(dst).all(|&r| (r as usize) < t.rows), "copy_rows: row past {}", t.rows);
            t.set_bf(false);
            let n = t.cols * 4;
            for (&s, &d) in src.iter().zip(dst) {
                let (sp, dp) = (t.fptr() + (s as usize * n) as u64, t.fptr() + (d as usize * n) as u64);
                if n > 0 && s != d && self.issue(&[0x6372, sp, dp, n as u64]) {
                    unsafe { cu(drv::memcpy_dtod_async(dp, sp, n, self.stream() as sys::CUstream), "copy_rows")? };
                }
            }
            Ok(())
        })();
        self.record(r);
    }

    fn zero_rows(&self, t: &mut CudaTensor, rows: &[u32]) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            ensure!(rows.iter().all(|&r| (r as usize) < t.rows), "zero_rows: row past {}", t.rows);
            t.set_bf(false);
            let n = t.cols * 4;
            for &row in rows {
                let p = t.fptr() + (row as usize * n) as u64;
                if n > 0 && self.issue(&[0x7a72, p, n as u64]) {
                    unsafe { cu(drv::memset_d8_async(p, 0, n, self.stream() as sys::CUstream), "zero_rows")? };
                }
            }
            Ok(())
        })();
        self.record(r);
    }

    // ---- the hybrid families' ops (cuda/hybrid.rs) ----
    fn rope_freqs(&self, x: &mut CudaTensor, positions: &[u32], head_dim: usize, inv_freq: &[f32]) -> Result<()> {
        self.hy_rope_freqs(x, positions, head_dim, inv_freq)
    }
    fn scatter_add_rows(&self, out: &mut CudaTensor, y: &CudaTensor, rows: &[u32], weights: &[f32]) -> Result<()> {
        self.hy_scatter_add_rows(out, y, rows, weights)
    }
    fn silu(&self, x: &mut CudaTensor) -> Result<()> {
        self.hy_silu(x)
    }
    fn relu2(&self, x: &CudaTensor, out: &mut CudaTensor) -> Result<()> {
        self.hy_relu2(x, out)
    }
    fn mul(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        self.hy_mul(x, y)
    }
    fn sigmoid_mul(&self, x: &mut CudaTensor, gate: &CudaTensor) -> Result<()> {
        self.hy_sigmoid_mul(x, gate)
    }
    fn group_rms_norm(&self, x: &CudaTensor, w: &CudaTensor, group: usize, eps: f32, out: &mut CudaTensor) -> Result<()> {
        self.hy_group_rms_norm(x, w, group, eps, out)
    }
    fn swiglu_clamped(&self, gate: &CudaTensor, up: &CudaTensor, limit: f32, alpha: f32, out: &mut CudaTensor) -> Result<()> {
        self.hy_swiglu_clamped(gate, up, limit, alpha, out)
    }
    fn short_conv(
        &self,
        x: &CudaTensor,
        weight: &CudaTensor,
        bias: Option<&CudaTensor>,
        kernel: usize,
        silu: bool,
        state: &mut CudaTensor,
        state_offset: usize,
        seqs: &[crate::StateSeq],
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.hy_short_conv(x, weight, bias, kernel, silu, state, state_offset, seqs, out)
    }
    fn ssm_scan(
        &self,
        xbc: &CudaTensor,
        dt: &CudaTensor,
        dt_bias: &CudaTensor,
        a: &CudaTensor,
        d: &CudaTensor,
        shape: &crate::SsmShape,
        state: &mut CudaTensor,
        state_offset: usize,
        seqs: &[crate::StateSeq],
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.hy_ssm_scan(xbc, dt, dt_bias, a, d, shape, state, state_offset, seqs, out)
    }
    fn linear_attention(
        &self,
        qkv: &CudaTensor,
        slopes: &CudaTensor,
        heads: usize,
        head_dim: usize,
        state: &mut CudaTensor,
        state_offset: usize,
        seqs: &[crate::StateSeq],
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.hy_linear_attention(qkv, slopes, heads, head_dim, state, state_offset, seqs, out)
    }
    fn block_sparse_attention(
        &self,
        q: &CudaTensor,
        iq: &CudaTensor,
        kv: &CudaKv,
        layer: usize,
        index_layer: usize,
        seqs: &[AttnSeq<'_>],
        scale: f32,
        sel: &crate::BlockSparse,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.hy_block_sparse_attention(q, iq, kv, layer, index_layer, seqs, scale, sel, out)
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
    rt::guarded("NVRTC", || {
        rt::compile(&kernels::with_prelude(kernels::BASE), arch)?;
        rt::compile(&kernels::with_prelude(hybrid::SRC), arch).map_err(|e| anyhow!("hybrid kernels: {e}"))?;
        for &hd in head_dims {
            for &g in groups {
                rt::compile(&kernels::attention_source(hd, g), arch).map_err(|e| anyhow!("attention HD={hd} G={g}: {e}"))?;
            }
        }
        Ok(())
    })
}

impl Cuda {
    fn act_mul(&self, f: usize, gate: &CudaTensor, up: &CudaTensor, out: &mut CudaTensor) {
        if !self.ready() {
            return;
        }
        let r = (|| {
            ensure!(gate.len() == up.len(), "activation: gate {}x{}, up {}x{}", gate.rows, gate.cols, up.rows, up.cols);
            self.grow(out, gate.rows, gate.cols)?;
            let n = gate.len();
            self.launch(
                f,
                Self::elementwise_grid(n),
                (256, 1, 1),
                0,
                &[Arg::P(gate.fptr()), Arg::P(up.fptr()), Arg::P(out.fptr()), Arg::P(out.bptr()), Arg::U64(n as u64)],
            )?;
            out.set_bf(true);
            Ok(())
        })();
        self.record(r);
    }
}
