//! Running forwards: record, fuse, then run or replay.
//!
//! Inside `Device::forward` every op only records itself: the fusable
//! primitives as [`OpRec`]s, the rest as the device commands they lower to
//! ([`Cmd`]), with the buffers they read and write. At the forward's end
//! [`fuse::plan`] groups the ops it has fused kernels for, the groups lower
//! to commands (`lower.rs`), and the commands run eagerly, or, for a keyed
//! forward (a decode round), as a CUDA graph recorded once per signature
//! (every command's kernel, shape and arguments) and replayed after.
//!
//! A decode round can do all this ahead, while the GPU runs the round
//! before ([`Cuda::forward_ahead`]); a greedy round can then launch it at
//! once with the tokens it picked (`sampling.rs`). An op called outside a
//! forward runs at once. A forward that reads values back (MoE routing)
//! runs what it recorded so far at the read, and is never a graph.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

use anyhow::{bail, Result};
use cudarc::cublas::sys as cb;
use cudarc::driver::{result as drv, sys};

use super::branch::Side;
use super::fuse::{self, OpRec, Tail};
use super::gemm::GemmOut;
use super::rt::{self, cu, Arg};
use super::{Cuda, CudaWeight};
use crate::Forward;

/// One device command, with everything it needs by value.
#[derive(Clone, Debug)]
pub(super) enum Cmd {
    Kernel {
        f: usize,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        cluster: u32,
        /// Programmatic dependent launch where the device uses it.
        pdl: bool,
        args: Vec<Arg>,
    },
    /// `y[n, m] = x[n, k] · w[m, k]ᵀ` (cuBLAS, bf16 operands).
    Gemm {
        w: u64,
        x: u64,
        y: u64,
        m: usize,
        n: usize,
        k: usize,
        out: GemmOut,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    Zero {
        dst: u64,
        bytes: usize,
    },
    /// Branches that run side by side, the first on the device's stream
    /// (`branch.rs`): what follows waits for all of them.
    Branch(Vec<Vec<Cmd>>),
}

impl Cmd {
    /// The command's bits, for a graph's signature.
    fn hash(&self, h: u64) -> u64 {
        let mut h = h;
        let mut mix = |x: u64| h = rt::fnv(h, x);
        match self {
            Cmd::Kernel { f, grid, block, cluster, pdl, args } => {
                mix(1 | (*pdl as u64) << 8);
                mix(*f as u64);
                mix((grid.0 as u64) << 40 | (grid.1 as u64) << 20 | grid.2 as u64);
                mix((block.0 as u64) << 40 | (block.1 as u64) << 20 | block.2 as u64);
                mix(*cluster as u64);
                args.iter().for_each(|a| mix(a.bits()));
            }
            Cmd::Gemm { w, x, y, m, n, k, out } => [2, *w, *x, *y, *m as u64, *n as u64, *k as u64, *out as u64].into_iter().for_each(mix),
            Cmd::Copy { dst, src, bytes } => [3, *dst, *src, *bytes as u64].into_iter().for_each(mix),
            Cmd::Zero { dst, bytes } => [4, *dst, *bytes as u64].into_iter().for_each(mix),
            Cmd::Branch(bs) => {
                mix(5 | (bs.len() as u64) << 8);
                for b in bs {
                    mix(b.len() as u64);
                    b.iter().for_each(|c| mix(c.hash(0)));
                }
            }
        }
        h
    }
}

/// Recorded graphs kept at most: more than the serve warm-up records
/// (~1,190 at a GPU server's 64 slots, chunks up to 256 rows), or it evicts its own
/// first recordings. At 1,024 those were the rounds of 29–32 streams
/// beside a chunk: on the H100, an arrival beside 32 streams then recorded
/// them while serving, rounds of 28–57 ms against a usual 2.1.
pub const MAX_GRAPHS: usize = 2048;

/// A graph's signature: the hash of its commands.
fn signature(cmds: &[Cmd]) -> u64 {
    cmds.iter().fold(0xcbf2_9ce4_8422_2325, |h, c| c.hash(h))
}

/// Log how `cmds`, just recorded, differ from the nearest graph of as
/// many commands recorded before: how many commands differ, and the first.
fn why_new(recorded: &[Vec<Cmd>], cmds: &[Cmd]) {
    let differ = |r: &Vec<Cmd>| r.iter().zip(cmds).filter(|(a, b)| a.hash(0) != b.hash(0)).count();
    let Some((n, near)) = recorded.iter().filter(|r| r.len() == cmds.len()).map(|r| (differ(r), r)).min_by_key(|e| e.0) else { return };
    if let Some(i) = (0..cmds.len()).find(|&i| near[i].hash(0) != cmds[i].hash(0)) {
        tracing::debug!(differing = n, first = i, was = ?near[i], now = ?cmds[i], "a new graph, nearest one recorded");
    }
}

/// The buffers an [`OpRec::Other`] op reads and writes (f32 buffers: the
/// tensors' identities), and those whose bf16 copy it also wrote.
#[derive(Default)]
pub(super) struct Io {
    pub reads: Vec<u64>,
    pub writes: Vec<u64>,
    pub bf: Vec<u64>,
}

/// An `Other` op's commands, and the buffers whose bf16 copy it wrote.
pub(super) struct Lowered {
    pub cmds: Vec<Cmd>,
    pub bf: Vec<u64>,
}

/// A forward being recorded.
#[derive(Default)]
pub(super) struct Recording {
    pub ops: Vec<OpRec>,
    pub others: Vec<Lowered>,
    /// Weights read by embeds (never folded).
    pub tables: HashSet<u64>,
    /// Every weight the products read, by buffer (for the folds).
    pub weights: HashMap<u64, *const CudaWeight>,
    /// A trace (`Device::prepare`): nothing runs, read-backs give zeros.
    pub trace: bool,
    /// Values were read back inside it: the ops before ran then.
    pub read_back: bool,
    /// In a trace, where it read values back (`ops` indices): the ops
    /// before each ran then, in a forward served (`fuse::fold_plan`).
    pub cuts: Vec<usize>,
}

/// A forward prepared ahead (`Cuda::forward_ahead`): its uploads are
/// queued, its commands lowered; only its token ids are missing.
pub(super) struct Ahead {
    /// The caller's key: everything the forward reads but its token ids.
    key: u64,
    sig: u64,
    gen: u64,
    /// The token ids it was prepared with: a launch after an argmax
    /// writes the picked ones over the first rows (decode rows), and the
    /// rest (a prompt chunk's) stay.
    pub ids: Vec<u32>,
    /// Where its embed reads the token ids.
    pub token_dst: Vec<u64>,
    cmds: Vec<Cmd>,
    /// Launched already (with these tokens, `sampling.rs`).
    pub running: Option<Vec<u32>>,
}

/// Recording, graphs and their counts.
#[derive(Default)]
pub(super) struct Exec {
    pub rec: Option<Recording>,
    /// Where commands go instead of running (an `Other` op being recorded,
    /// a forward being lowered).
    pub sink: Option<Vec<Cmd>>,
    /// Each recorded graph by signature, with the tick of its last use.
    graphs: HashMap<u64, (usize, u64)>,
    tick: u64,
    pub ahead: Option<Ahead>,
    /// Some forward read values back: forwards run eagerly from then on.
    pub host_reads: bool,
    /// Commands go into a graph being recorded (no profiling events).
    pub capturing: bool,
    pub replays: u64,
    pub captures: u64,
    pub ahead_hits: u64,
    pub launched_ahead: u64,
    /// With debug logging on: each graph's commands, so a new recording
    /// can say how it differs from the nearest one (a shape recorded
    /// again on the hot path costs a decoding stream a 2–5 ms gap).
    recorded: Vec<Vec<Cmd>>,
}

impl Exec {
    /// Free every recorded graph (the device closes).
    pub fn destroy_all(&mut self) {
        for (_, (g, _)) in self.graphs.drain() {
            unsafe {
                let _ = drv::graph::exec_destroy(g as sys::CUgraphExec);
            }
        }
    }
}

impl Cuda {
    /// Run `cmd`, or collect it where commands go now.
    pub(super) fn emit(&self, cmd: Cmd) -> Result<()> {
        {
            let mut st = self.st();
            if let Some(s) = st.exec.sink.as_mut() {
                s.push(cmd);
                return Ok(());
            }
        }
        self.execute(&cmd)
    }

    fn execute(&self, cmd: &Cmd) -> Result<()> {
        let prof = self.prof_begin();
        let r = self.execute_on(cmd, None);
        if let Some(ev) = prof {
            self.prof_end(ev, self.cmd_name(cmd));
        }
        r
    }

    /// What the profile calls `cmd`: a branch set by each branch's first
    /// command (a mixed round has several sets of two, told apart so).
    fn cmd_name(&self, cmd: &Cmd) -> String {
        match cmd {
            Cmd::Kernel { f, .. } => self.kernel_name(*f),
            Cmd::Gemm { m, n, k, .. } => format!("gemm out {m} rows {n} in {k}"),
            Cmd::Copy { .. } => "copy".into(),
            Cmd::Zero { .. } => "clear".into(),
            Cmd::Branch(bs) => {
                let firsts: Vec<String> = bs.iter().filter_map(|b| b.first()).map(|c| self.cmd_name(c)).collect();
                format!("side by side: {}", firsts.join(" | "))
            }
        }
    }

    /// Run `cmd` on the device's stream, or on `side`'s.
    pub(super) fn execute_on(&self, cmd: &Cmd, side: Option<&Side>) -> Result<()> {
        let stream = side.map_or(self.stream(), |s| s.stream);
        match cmd {
            // SAFETY: every kernel of braid's modules waits (PDL_WAIT)
            // first, and each builder passes its kernel's parameters in order.
            Cmd::Kernel { f, grid, block, cluster, pdl, args } => unsafe { rt::launch(*f, *grid, *block, 0, stream, args, self.inner.pdl && *pdl, *cluster) },
            &Cmd::Gemm { w, x, y, m, n, k, out } => self.gemm_now(side.map_or(self.inner.cublas, |s| s.cublas), w, x, y, m, n, k, out),
            &Cmd::Copy { dst, src, bytes } => unsafe { cu(drv::memcpy_dtod_async(dst, src, bytes, stream as sys::CUstream), "device copy") },
            &Cmd::Zero { dst, bytes } => unsafe { cu(drv::memset_d8_async(dst, 0, bytes, stream as sys::CUstream), "device clear") },
            // Branches nest no deeper: inside one, a branch runs in line.
            Cmd::Branch(bs) if side.is_some() => bs.iter().flatten().try_for_each(|c| self.execute_on(c, side)),
            Cmd::Branch(bs) => self.run_branches(bs),
        }
    }

    /// Whether ops now only record themselves.
    pub(super) fn recording(&self) -> bool {
        self.st().exec.rec.is_some()
    }

    /// A fusable op: recorded, or (outside a forward) lowered and run now.
    pub(super) fn fusable(&self, op: OpRec) -> Result<()> {
        {
            let mut st = self.st();
            if let Some(r) = st.exec.rec.as_mut() {
                r.ops.push(op);
                return Ok(());
            }
        }
        let rec = Recording { ops: vec![op], ..Recording::default() };
        for c in self.lower(&rec, Tail::End)? {
            self.execute(&c)?;
        }
        Ok(())
    }

    /// Any other op: `f` issues its commands (collected while recording,
    /// else run at once) and says what it read and wrote.
    pub(super) fn other(&self, f: impl FnOnce() -> Result<Io>) -> Result<()> {
        if !self.recording() {
            return f().map(|_| ());
        }
        let outer = self.st().exec.sink.replace(Vec::new());
        let r = f();
        let mut st = self.st();
        let cmds = std::mem::replace(&mut st.exec.sink, outer).unwrap_or_default();
        let io = r?;
        let rec = st.exec.rec.as_mut().expect("recording");
        rec.ops.push(OpRec::Other { reads: io.reads, writes: io.writes, cmds: rec.others.len() });
        rec.others.push(Lowered { cmds, bf: io.bf });
        Ok(())
    }

    /// A product reads `w`: remembered for the folds (and embeds' tables apart).
    pub(super) fn note_weight(&self, w: &CudaWeight, table: bool) {
        if let Some(r) = self.st().exec.rec.as_mut() {
            if table {
                r.tables.insert(w.ptr());
            } else {
                r.weights.insert(w.ptr(), w as *const CudaWeight);
            }
        }
    }

    fn begin_recording(&self, trace: bool) {
        rt::defer_frees(true);
        let mut st = self.st();
        st.arena.begin_pass();
        st.exec.rec = Some(Recording { trace, ..Recording::default() });
    }

    fn end_recording(&self) -> Recording {
        rt::defer_frees(false);
        let mut st = self.st();
        st.arena.end_pass();
        st.exec.rec.take().unwrap_or_default()
    }

    /// Inside a forward, before a read-back: run what it recorded so far
    /// (nothing, in a trace, whose read-backs give zeros: `false`).
    pub(super) fn flush(&self) -> Result<bool> {
        let rec = {
            let mut guard = self.st();
            let exec = &mut guard.exec;
            let Some(r) = exec.rec.as_mut() else { return Ok(true) };
            if r.trace {
                r.cuts.push(r.ops.len());
                return Ok(false);
            }
            r.read_back = true;
            let rec = Recording { ops: std::mem::take(&mut r.ops), others: std::mem::take(&mut r.others), ..Recording::default() };
            exec.host_reads = true;
            rec
        };
        for c in self.lower(&rec, Tail::More)? {
            self.execute(&c)?;
        }
        Ok(true)
    }

    /// [`Device::forward`]: the forward launched or prepared ahead if this
    /// is it, else `run` recorded, fused and run (as a graph when keyed).
    pub(super) fn run_forward(&self, fw: Forward<'_>, run: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        rt::make_current(self.ctx())?;
        self.check_error()?;
        if self.take_ahead(&fw)? {
            return Ok(());
        }
        self.begin_recording(false);
        let r = run();
        let rec = self.end_recording();
        let out = r.and_then(|_| self.check_error()).and_then(|_| {
            let cmds = self.lower(&rec, Tail::End)?;
            let graph = fw.key.is_some() && self.graphs_on() && !rec.read_back && !self.st().exec.host_reads;
            let t = std::time::Instant::now();
            let r = self.submit(&cmds, graph.then(|| signature(&cmds)));
            if !graph {
                tracing::trace!(rows = fw.tokens.len(), commands = cmds.len(), host_ms = t.elapsed().as_secs_f64() * 1e3, "eager forward");
            }
            r
        });
        rt::free_deferred();
        out
    }

    /// The forward prepared (or launched) ahead, if `fw` is it: launched
    /// already, it is running; prepared, its ids go where its embed reads
    /// them and it runs. `false` when it is not (a forward launched for
    /// nothing wrote only KV past each stream's length).
    fn take_ahead(&self, fw: &Forward<'_>) -> Result<bool> {
        let Some(a) = self.st().exec.ahead.take() else { return Ok(false) };
        if Some(a.key) != fw.key || a.gen != rt::ALLOC_GEN.load(Ordering::Relaxed) {
            return Ok(false);
        }
        if let Some(tokens) = &a.running {
            let hit = tokens.as_slice() == fw.tokens;
            if hit {
                let mut st = self.st();
                st.exec.ahead_hits += 1;
                st.exec.launched_ahead += 1;
            }
            return Ok(hit);
        }
        if a.ids.len() != fw.tokens.len() {
            return Ok(false);
        }
        for &dst in &a.token_dst {
            unsafe { cu(drv::memcpy_htod_async(dst, fw.tokens, self.stream() as sys::CUstream), "token upload")? };
        }
        self.st().exec.ahead_hits += 1;
        self.submit(&a.cmds, self.graphs_on().then_some(a.sig))?;
        Ok(true)
    }

    /// [`Device::forward_ahead`]: record and lower `run` now, its uploads
    /// sent in one copy behind the work in flight. Kept only when its only
    /// uploads of ids are of `fw.tokens` itself (a model that embeds ids
    /// made from them, such as Gemma 4's per-layer tables, gets none).
    pub(super) fn forward_ahead(&self, fw: Forward<'_>, run: &mut dyn FnMut() -> Result<()>) {
        let Some(key) = fw.key else { return };
        if !self.inner.tuning.ahead || !self.graphs_on() || self.st().exec.host_reads || fw.tokens.is_empty() || self.check_error().is_err() {
            return;
        }
        let gen = rt::ALLOC_GEN.load(Ordering::Relaxed);
        self.arena_staging(true);
        self.begin_recording(false);
        let r = run();
        let rec = self.end_recording();
        let ups = self.arena_staging(false);
        let whole = !ups.is_empty() && ups.iter().all(|&(p, n, _)| p == fw.tokens.as_ptr() as usize && n == fw.tokens.len());
        let kept = r.is_ok() && self.check_error().is_ok() && !rec.read_back && whole && rt::ALLOC_GEN.load(Ordering::Relaxed) == gen;
        if kept {
            match self.lower(&rec, Tail::End).and_then(|cmds| self.arena_send_mirror().map(|_| cmds)) {
                Ok(cmds) => {
                    let a =
                        Ahead { key, sig: signature(&cmds), gen, ids: fw.tokens.to_vec(), token_dst: ups.iter().map(|u| u.2).collect(), cmds, running: None };
                    self.st().exec.ahead = Some(a);
                }
                Err(e) => self.keep_error(e),
            }
        }
        rt::free_deferred();
    }

    /// The prepared ahead forward's graph, recorded now if it is not yet,
    /// and where it reads its ids: for a launch right after an argmax
    /// writes `rows` of them there (`sampling.rs`). None when there is
    /// none with that many rows first or it cannot launch (graphs off,
    /// memory moved).
    pub(super) fn ahead_graph(&self, rows: usize) -> Result<Option<(usize, u64)>> {
        let (sig, cmds, dst) = {
            let st = self.st();
            let Some(a) = st.exec.ahead.as_ref() else { return Ok(None) };
            if a.running.is_some() || a.ids.len() < rows || a.token_dst.len() != 1 || a.gen != rt::ALLOC_GEN.load(Ordering::Relaxed) || !self.graphs_on() {
                return Ok(None);
            }
            (a.sig, a.cmds.clone(), a.token_dst[0])
        };
        Ok(Some((self.graph_for(sig, &cmds)?, dst)))
    }

    /// Run `cmds`: as the graph of signature `sig` (recorded now if new),
    /// or eagerly.
    fn submit(&self, cmds: &[Cmd], sig: Option<u64>) -> Result<()> {
        match sig {
            Some(sig) => {
                let exec = self.graph_for(sig, cmds)?;
                self.launch_graph(exec)
            }
            None => cmds.iter().try_for_each(|c| self.execute(c)),
        }
    }

    /// The graph of signature `sig`, recording `cmds` under stream capture
    /// if there is none yet.
    fn graph_for(&self, sig: u64, cmds: &[Cmd]) -> Result<usize> {
        {
            // One guard: a second `self.st()` inside an `if let` on the
            // first would wait on itself.
            let mut st = self.st();
            st.exec.tick += 1;
            let tick = st.exec.tick;
            if let Some(g) = st.exec.graphs.get_mut(&sig) {
                g.1 = tick;
                let g = g.0;
                st.exec.replays += 1;
                return Ok(g);
            }
        }
        let t = std::time::Instant::now();
        let stream = self.stream() as sys::CUstream;
        unsafe { cu(drv::stream::begin_capture(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")? };
        self.st().exec.capturing = true;
        let r = cmds.iter().try_for_each(|c| self.execute(c));
        self.st().exec.capturing = false;
        let graph = unsafe { drv::stream::end_capture(stream) };
        let graph = match (r, graph) {
            (Ok(()), Ok(g)) if !g.is_null() => g,
            (r, g) => {
                if let Ok(g) = g {
                    if !g.is_null() {
                        unsafe {
                            let _ = drv::graph::destroy(g);
                        }
                    }
                }
                r?;
                bail!("recording a CUDA graph of {} commands failed", cmds.len());
            }
        };
        let exec = unsafe { drv::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        unsafe {
            let _ = drv::graph::destroy(graph);
        }
        let exec = exec.map_err(|e| anyhow::anyhow!("instantiating a CUDA graph: {e:?}"))? as usize;
        let mut st = self.st();
        // Graphs bake pointers in; a bounded cache keeps stale ones few.
        // The least recently used one goes. Freeing all 256 at once also
        // dropped the hot decode graphs, to be recorded again, in one
        // round: the likely cause of the 10 ms gaps the H200's stall probe
        // saw mid-prefill, when every small mixed round was a new graph.
        // (A graph still running is freed when it completes.) Room for the
        // warm-up's: decode rounds of 1–32 streams, each alone and beside
        // every replayed chunk size (`MAX_GRAPHS`).
        if st.exec.graphs.len() >= MAX_GRAPHS {
            if let Some((&old, &(g, _))) = st.exec.graphs.iter().min_by_key(|e| e.1 .1) {
                st.exec.graphs.remove(&old);
                unsafe {
                    let _ = drv::graph::exec_destroy(g as sys::CUgraphExec);
                }
            }
        }
        let tick = st.exec.tick;
        st.exec.graphs.insert(sig, (exec, tick));
        st.exec.captures += 1;
        if tracing::enabled!(tracing::Level::DEBUG) {
            why_new(&st.exec.recorded, cmds);
            // The last few hundred: the comparison runs inside the timed
            // recording, so it stays small beside it.
            if st.exec.recorded.len() >= 256 {
                st.exec.recorded.remove(0);
            }
            st.exec.recorded.push(cmds.to_vec());
        }
        tracing::debug!(commands = cmds.len(), cached = st.exec.graphs.len(), ms = t.elapsed().as_secs_f64() * 1e3, "recorded a CUDA graph");
        Ok(exec)
    }

    pub(super) fn launch_graph(&self, exec: usize) -> Result<()> {
        unsafe { cu(drv::graph::launch(exec as sys::CUgraphExec, self.stream() as sys::CUstream), "cuGraphLaunch") }
    }

    fn graphs_on(&self) -> bool {
        self.inner.graphs_enabled.load(Ordering::Relaxed)
    }

    /// Turn CUDA graphs on or off (`Tuning::graphs` at first).
    pub fn set_graphs(&self, on: bool) {
        self.inner.graphs_enabled.store(on, Ordering::Relaxed);
    }

    /// (replays, captures) of keyed forwards' graphs so far.
    pub fn graph_stats(&self) -> (u64, u64) {
        let st = self.st();
        (st.exec.replays, st.exec.captures)
    }

    /// Forwards that found themselves prepared ahead, and of those the ones
    /// launched before they were asked for.
    pub fn ahead_hits(&self) -> (u64, u64) {
        let st = self.st();
        (st.exec.ahead_hits, st.exec.launched_ahead)
    }

    /// [`Device::prepare`]: trace `run`, then fold each whole-row RMSNorm's
    /// weight into the columns of the products that alone read its output
    /// ([`fuse::fold_plan`]), once, before anything is served.
    pub(super) fn prepare_forward(&self, run: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        rt::make_current(self.ctx())?;
        let t = &self.inner.tuning;
        if !t.norm_fold && !t.pack {
            return Ok(());
        }
        self.begin_recording(true);
        let r = run();
        let rec = self.end_recording();
        rt::free_deferred();
        r?;
        self.check_error()?;
        if t.norm_fold {
            for (w, g) in fuse::fold_plan(&rec.ops, &rec.tables, &rec.cuts) {
                let Some(&wp) = rec.weights.get(&w) else { continue };
                // SAFETY: the weights belong to the model `run` borrows, which
                // outlives this call.
                let weight = unsafe { &*wp };
                self.fold_norm(weight, g)?;
            }
        }
        if t.pack {
            // On the stream after the folds: the copies take folded values.
            self.pack_weights(&rec.ops, &rec.weights)?;
        }
        self.sync()
    }
}

impl Cuda {
    /// cuBLAS now, through `handle` (the device's or a side stream's), on
    /// its stream (or under its capture).
    #[allow(clippy::too_many_arguments)]
    fn gemm_now(&self, handle: usize, w: u64, x: u64, y: u64, m: usize, n: usize, k: usize, out: GemmOut) -> Result<()> {
        let (alpha, beta) = (1f32, if out == GemmOut::AddF32 { 1f32 } else { 0f32 });
        let yt = if out == GemmOut::Bf16 { cb::cudaDataType::CUDA_R_16BF } else { cb::cudaDataType::CUDA_R_32F };
        unsafe {
            cb::cublasGemmEx(
                handle as cb::cublasHandle_t,
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
            .map_err(|e| anyhow::anyhow!("cublasGemmEx {m}x{n}x{k}: {e:?}"))
        }
    }
}
