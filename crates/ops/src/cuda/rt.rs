//! The thin layer over the CUDA driver, NVRTC and cuBLAS that the device
//! uses: library checks, device buffers, module compilation with an on-disk
//! cache, raw launches.
//!
//! cudarc loads the libraries at run time and panics when one is missing,
//! so [`check_libraries`] looks first and every entry point that may load a
//! symbol runs under `catch_unwind`.

use std::cell::{Cell, RefCell};
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{result as drv, sys};

/// Bumped whenever device memory is allocated or freed: a forward prepared
/// ahead bakes pointers in, so one prepared under another generation is stale.
pub static ALLOC_GEN: AtomicU64 = AtomicU64::new(0);

/// Turn a panic from a missing library or symbol into an error.
pub fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            bail!("{what}: CUDA library problem: {msg}")
        }
    }
}

/// The libraries the CUDA device needs, with a clear error when one is not
/// on the library path.
pub fn check_libraries() -> Result<()> {
    type Check = (&'static str, fn() -> bool);
    let checks: [Check; 3] = [
        ("libcuda (the NVIDIA driver)", || unsafe { cudarc::driver::sys::is_culib_present() }),
        ("libnvrtc (CUDA run-time compiler)", || unsafe { cudarc::nvrtc::sys::is_culib_present() }),
        ("libcublas", || unsafe { cudarc::cublas::sys::is_culib_present() }),
    ];
    let mut missing = Vec::new();
    for (name, present) in checks {
        let ok = std::panic::catch_unwind(present).unwrap_or(false);
        if !ok {
            missing.push(name);
        }
    }
    if !missing.is_empty() {
        bail!("CUDA device unavailable: cannot load {} (install the NVIDIA driver and CUDA 12/13 libraries, or set LD_LIBRARY_PATH)", missing.join(", "));
    }
    Ok(())
}

pub fn cu(r: Result<(), drv::DriverError>, what: &str) -> Result<()> {
    r.map_err(|e| anyhow!("{what}: {e:?}"))
}

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
    /// While a forward is recorded, freeing waits: its commands, run after,
    /// may still name the memory (`exec.rs`).
    static DEFER: Cell<bool> = const { Cell::new(false) };
    static DEFERRED: RefCell<Vec<(usize, u64)>> = const { RefCell::new(Vec::new()) };
}

/// Hold frees of this thread's buffers (`on`) until [`free_deferred`].
pub fn defer_frees(on: bool) {
    DEFER.with(|d| d.set(on));
}

/// Free what was held while frees were deferred.
pub fn free_deferred() {
    for (ctx, ptr) in DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut())) {
        if make_current(ctx).is_ok() {
            unsafe {
                let _ = drv::free_sync(ptr);
            }
        }
    }
}

/// Make `ctx` current on this thread (the lane thread may not be the one
/// that created the device).
pub fn make_current(ctx: usize) -> Result<()> {
    if CURRENT.with(|c| c.get()) != ctx {
        unsafe { cu(sys::cuCtxSetCurrent(ctx as sys::CUcontext).result(), "cuCtxSetCurrent")? };
        CURRENT.with(|c| c.set(ctx));
    }
    Ok(())
}

/// A device allocation, freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    ctx: usize,
}

impl DevBuf {
    pub fn new(ctx: usize, bytes: usize) -> Result<DevBuf> {
        if bytes == 0 {
            return Ok(DevBuf { ptr: 0, bytes: 0, ctx });
        }
        make_current(ctx)?;
        let ptr = unsafe { drv::malloc_sync(bytes) }.map_err(|e| anyhow!("cuMemAlloc of {bytes} bytes: {e:?}"))?;
        ALLOC_GEN.fetch_add(1, Ordering::Relaxed);
        Ok(DevBuf { ptr, bytes, ctx })
    }
    pub fn empty(ctx: usize) -> DevBuf {
        DevBuf { ptr: 0, bytes: 0, ctx }
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        ALLOC_GEN.fetch_add(1, Ordering::Relaxed);
        if DEFER.with(|d| d.get()) {
            DEFERRED.with(|d| d.borrow_mut().push((self.ctx, self.ptr)));
        } else if make_current(self.ctx).is_ok() {
            unsafe {
                let _ = drv::free_sync(self.ptr);
            }
        }
    }
}

/// One kernel argument, kept by value so its address can be handed to
/// cuLaunchKernel (and its bits hashed for graph reuse).
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    P(u64),
    I(i32),
    F(f32),
    U64(u64),
}

impl Arg {
    pub fn bits(&self) -> u64 {
        match *self {
            Arg::P(p) | Arg::U64(p) => p,
            Arg::I(i) => i as u32 as u64 | 1 << 40,
            Arg::F(f) => f.to_bits() as u64 | 2 << 40,
        }
    }
}

/// Launches `f`; with `pdl`, allowed to start while the kernel before it
/// in the stream finishes (programmatic dependent launch, Hopper on: the
/// kernel's `griddepcontrol.wait` then orders it, see `kernels.rs`).
///
/// # Safety
/// `f` must be a kernel whose parameters match `args` in order and size;
/// with `pdl`, one that waits (`PDL_WAIT`) before touching memory that
/// earlier work writes or reads.
/// `cluster`: blocks per thread-block cluster along x (1: no clusters).
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch(f: usize, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, stream: usize, args: &[Arg], pdl: bool, cluster: u32) -> Result<()> {
    let mut vals: [Arg; 24] = [Arg::I(0); 24];
    assert!(args.len() <= vals.len());
    vals[..args.len()].copy_from_slice(args);
    let mut ptrs: [*mut c_void; 24] = [std::ptr::null_mut(); 24];
    for (p, v) in ptrs.iter_mut().zip(vals.iter_mut()).take(args.len()) {
        *p = match v {
            Arg::P(x) | Arg::U64(x) => x as *mut u64 as *mut c_void,
            Arg::I(x) => x as *mut i32 as *mut c_void,
            Arg::F(x) => x as *mut f32 as *mut c_void,
        };
    }
    if !pdl && cluster <= 1 {
        return drv::launch_kernel(f as sys::CUfunction, grid, block, smem, stream as sys::CUstream, &mut ptrs[..args.len()])
            .map_err(|e| anyhow!("kernel launch: {e:?}"));
    }
    let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
    let mut n = 0;
    if pdl {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n].value.programmaticStreamSerializationAllowed = 1;
        n += 1;
    }
    if cluster > 1 {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attrs[n].value.clusterDim.x = cluster;
        attrs[n].value.clusterDim.y = 1;
        attrs[n].value.clusterDim.z = 1;
        n += 1;
    }
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: smem,
        hStream: stream as sys::CUstream,
        attrs: attrs.as_mut_ptr(),
        numAttrs: n as u32,
    };
    sys::cuLaunchKernelEx(&config, f as sys::CUfunction, ptrs.as_mut_ptr(), std::ptr::null_mut())
        .result()
        .map_err(|e| anyhow!("kernel launch (programmatic dependent {pdl}, cluster {cluster}): {e:?}"))
}

/// FNV-1a, for cache keys and graph signatures.
pub fn fnv(h: u64, x: u64) -> u64 {
    let mut h = h;
    for b in x.to_le_bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

pub fn fnv_str(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// Where compiled modules are kept between runs.
pub fn kernel_cache_dir() -> PathBuf {
    braid_formats::cache::cache_dir().join("cuda-kernels")
}

/// Lets kernel `f` launch in clusters past the portable 8 blocks (Hopper
/// takes 16).
pub fn allow_large_clusters(f: usize) -> Result<()> {
    let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED;
    unsafe { sys::cuFuncSetAttribute(f as sys::CUfunction, attr, 1) }.result().map_err(|e| anyhow!("non-portable cluster sizes: {e:?}"))
}

/// A loaded module and the functions asked of it.
pub struct Module {
    pub module: usize,
}

impl Module {
    pub fn func(&self, name: &str) -> Result<usize> {
        let f = unsafe { drv::module::get_function(self.module as sys::CUmodule, CString::new(name)?) }.map_err(|e| anyhow!("kernel {name}: {e:?}"))?;
        Ok(f as usize)
    }
}

fn nvrtc_version() -> (i32, i32) {
    let (mut a, mut b) = (0, 0);
    unsafe {
        let _ = cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b);
    }
    (a, b)
}

/// The NVRTC target for a compute capability: Hopper gets its `a` variant
/// (wgmma and the rest of the arch-specific set).
pub fn arch_name(cc: (i32, i32)) -> String {
    if cc == (9, 0) {
        "sm_90a".into()
    } else {
        format!("sm_{}{}", cc.0, cc.1)
    }
}

/// Compile `src` for `arch` (or take it from the on-disk cache) and load it.
pub fn compile_and_load(src: &str, arch: &str) -> Result<Module> {
    let (va, vb) = nvrtc_version();
    let key = fnv(fnv(fnv_str(src), fnv_str(arch)), (va as u64) << 32 | vb as u64);
    let dir = kernel_cache_dir();
    let path = dir.join(format!("braid-{key:016x}-{arch}.cubin"));
    let cubin = match std::fs::read(&path) {
        Ok(b) if !b.is_empty() => b,
        _ => {
            let b = compile(src, arch)?;
            // The cache is an optimisation: a read-only cache dir is not an error.
            if std::fs::create_dir_all(&dir).is_ok() {
                let tmp = path.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &b).is_ok() {
                    let _ = std::fs::rename(&tmp, &path);
                }
            }
            b
        }
    };
    let module = unsafe { drv::module::load_data(cubin.as_ptr() as *const c_void) }.map_err(|e| anyhow!("loading the compiled kernels ({arch}): {e:?}"))?;
    Ok(Module { module: module as usize })
}

pub fn compile(src: &str, arch: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result as nv, sys as nvs};
    let csrc = CString::new(src)?;
    let prog = nv::create_program(&csrc, Some(c"braid.cu")).map_err(|e| anyhow!("nvrtcCreateProgram: {e:?}"))?;
    let mut opts = vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string(), "-default-device".to_string()];
    // BRAID_NVRTC_VERBOSE=1: ptxas reports each kernel's registers, spills and shared memory.
    let verbose = std::env::var("BRAID_NVRTC_VERBOSE").is_ok_and(|v| v != "0");
    if verbose {
        opts.push("--ptxas-options=-v".to_string());
    }
    let res = unsafe { nv::compile_program(prog, &opts) };
    let log = unsafe { nv::get_program_log(prog) }.map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>()).unwrap_or_default();
    if verbose {
        eprintln!("{}", log.trim_end_matches('\0'));
    }
    if let Err(e) = res {
        unsafe {
            let _ = nv::destroy_program(prog);
        }
        bail!("NVRTC could not compile the kernels for {arch}: {e:?}\n{}", log.trim_end_matches('\0'));
    }
    let mut size = 0usize;
    let mut out;
    unsafe {
        nvs::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| anyhow!("nvrtcGetCUBINSize: {e:?}"))?;
        out = vec![0u8; size];
        nvs::nvrtcGetCUBIN(prog, out.as_mut_ptr() as *mut _).result().map_err(|e| anyhow!("nvrtcGetCUBIN: {e:?}"))?;
        let _ = nv::destroy_program(prog);
    }
    Ok(out)
}
