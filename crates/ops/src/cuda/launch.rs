//! Typed kernel launches:
//! `self.launch(f).blocks(rows).block(256).ptr(x.fptr()).int(cols).f32(eps).run()`.
//!
//! The arguments go in the kernel's parameter order, each with its C type
//! (`ptr`: a device pointer, `int`: an `int` from a count, `i32`, `flag`: a
//! `bool` as `int`, `f32`, `u64`: a `long`). A launch becomes a
//! [`Cmd::Kernel`]: run at once, or recorded with a forward (`exec.rs`).

use anyhow::Result;

use super::exec::Cmd;
use super::rt::Arg;
use super::Cuda;

/// Most arguments a kernel takes (`rt::launch` keeps them on its stack).
const MAX_ARGS: usize = 24;

/// A launch being built; nothing happens until [`Launch::run`].
#[must_use = "a launch does nothing until `run`"]
pub(super) struct Launch<'a> {
    cuda: &'a Cuda,
    f: usize,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    cluster: u32,
    /// Launched with programmatic dependent launch where the device uses it.
    pdl: bool,
    args: [Arg; MAX_ARGS],
    n: usize,
}

impl Cuda {
    /// A launch of kernel `f` (one block of one thread, no cluster, until
    /// told otherwise).
    pub(super) fn launch(&self, f: usize) -> Launch<'_> {
        Launch { cuda: self, f, grid: (1, 1, 1), block: (1, 1, 1), cluster: 1, pdl: true, args: [Arg::I(0); MAX_ARGS], n: 0 }
    }

    /// The grid of a grid-stride loop over `n` values, 256 threads a block.
    pub(super) fn elementwise_grid(n: usize) -> (u32, u32, u32) {
        (n.div_ceil(256).clamp(1, 65535) as u32, 1, 1)
    }
}

impl Launch<'_> {
    pub fn grid(mut self, grid: (u32, u32, u32)) -> Self {
        self.grid = grid;
        self
    }

    /// A one-dimensional grid of `n` blocks.
    pub fn blocks(self, n: usize) -> Self {
        self.grid((n as u32, 1, 1))
    }

    /// Threads per block (one-dimensional blocks only).
    pub fn block(mut self, threads: u32) -> Self {
        self.block = (threads, 1, 1);
        self
    }

    /// A grid-stride loop over `n` values ([`Cuda::elementwise_grid`],
    /// 256 threads a block).
    pub fn elementwise(self, n: usize) -> Self {
        self.grid(Cuda::elementwise_grid(n)).block(256)
    }

    /// Thread-block clusters of `blocks` blocks along x (1: none).
    pub fn cluster(mut self, blocks: u32) -> Self {
        self.cluster = blocks;
        self
    }

    /// Off: the kernel starts only once the one before it has finished,
    /// even where the device launches with programmatic dependent launch
    /// (its blocks do not wait on the SMs while the one before still needs
    /// them).
    pub fn pdl(mut self, on: bool) -> Self {
        self.pdl = on;
        self
    }

    fn arg(mut self, a: Arg) -> Self {
        assert!(self.n < MAX_ARGS, "a kernel launch with more than {MAX_ARGS} arguments");
        self.args[self.n] = a;
        self.n += 1;
        self
    }

    /// A device pointer (0: null).
    pub fn ptr(self, p: u64) -> Self {
        self.arg(Arg::P(p))
    }

    /// A count or index as the kernel's `int`.
    pub fn int(self, v: usize) -> Self {
        self.arg(Arg::I(v as i32))
    }

    pub fn i32(self, v: i32) -> Self {
        self.arg(Arg::I(v))
    }

    /// A switch as the kernel's `int` (0 or 1).
    pub fn flag(self, on: bool) -> Self {
        self.arg(Arg::I(on as i32))
    }

    pub fn f32(self, v: f32) -> Self {
        self.arg(Arg::F(v))
    }

    /// A 64-bit value (`long`, `unsigned long long`).
    pub fn u64(self, v: u64) -> Self {
        self.arg(Arg::U64(v))
    }

    /// Launch now, or collect the launch where commands go (a forward
    /// being recorded or lowered: `exec.rs`). An empty grid launches nothing.
    pub fn run(self) -> Result<()> {
        let Launch { cuda, f, grid, block, cluster, pdl, args, n } = self;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        #[cfg(feature = "cuda-tuning")]
        if cuda.skipped(f) {
            return Ok(());
        }
        cuda.emit(Cmd::Kernel { f, grid, block, cluster, pdl, args: args[..n].to_vec() })
    }
}
