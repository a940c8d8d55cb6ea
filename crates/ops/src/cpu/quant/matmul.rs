//! The matmul driver: quantize the activations once, split the output over
//! the pool, and run register tiles of `rw` weight rows x `ra` activation
//! rows over each task's block of the output.
//!
//! Decode (small m) and prefill (large m) share the loop: a task owns a
//! range of weight rows (and, for large m, a range of activation rows); it
//! walks its activation rows a tile at a time, and for each, sweeps its
//! weight rows. A task's weight rows are sized to stay in L2, so each
//! weight block is fetched from memory once per call however large m is,
//! and reused from cache by every activation tile.

use std::cell::RefCell;

use super::act::{quantize_q8a, quantize_q8k};
use super::blocks::{Q8A, Q8KA};
use super::scalar::{dot, ActRow};
use super::{Isa, QMatRef};
use crate::cpu::pool;
use braid_formats::DType;

/// One register tile's operands: `out[c * out_stride + r]` for `r < rw`,
/// `c < ra` is the dot of weight row `w + r * w_stride` with activation
/// row `a + c * a_stride` (byte strides), over `n` blocks (elements for
/// float weights).
pub(crate) struct Tile {
    pub dtype: DType,
    pub w: *const u8,
    pub w_stride: usize,
    pub a: *const u8,
    pub a_stride: usize,
    pub n: usize,
    pub out: *mut f32,
    pub out_stride: usize,
}

/// Computes a `rw x ra` tile. # Safety: the tile's pointers cover it, and
/// the kernel's ISA is available.
pub(crate) type TileFn = unsafe fn(&Tile, usize, usize);

/// A type's tile function and the tile shapes it was built for: `rw x ra`
/// for full tiles, `rw_gemv x 1` for single activation rows; any leftover
/// rows run as `1 x ra` / `1 x 1`.
#[derive(Clone, Copy)]
pub(crate) struct Kernel {
    pub tile: TileFn,
    pub rw: usize,
    pub ra: usize,
    pub rw_gemv: usize,
    /// For many activation rows: unpack weights to a faster layout first.
    pub pack: Option<Pack>,
    /// `tile` takes any `rw`, `ra` up to its full shape (else leftover
    /// rows and columns run one at a time).
    pub partial: bool,
}

/// `pack(src, src_stride, rows, blocks, dst)` writes `rows` weight rows
/// as `blocks` blocks of `block_bytes` each, rows back to back, in the
/// layout `tile` (shapes `rw x ra`, `rw x 1`, `1 x ra`, `1 x 1`) reads.
#[derive(Clone, Copy)]
pub(crate) struct Pack {
    pub pack: unsafe fn(*const u8, usize, usize, usize, *mut u8),
    pub block_bytes: usize,
    pub tile: TileFn,
    pub rw: usize,
    pub ra: usize,
    /// As [`Kernel::partial`]; such layouts keep rows in groups of `rw`.
    pub partial: bool,
    /// Bytes of packed rows a task sweeps per activation tile (rounded to
    /// whole groups of `rw`): what stays in cache beside the tile's rows.
    pub sub_bytes: usize,
    /// Activation rows from which a task packs its weights (its share of
    /// a shared round's rows included): where that measured faster.
    pub min_rows: usize,
}

/// How activations are fed to a weight type.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ActKind {
    F32,
    Q8,
    Q8K,
}

fn act_kind(dtype: DType) -> ActKind {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => ActKind::F32,
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::Q8_1 => ActKind::Q8,
        DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K | DType::Q8K => ActKind::Q8K,
    }
}

unsafe fn scalar_tile(t: &Tile, rw: usize, ra: usize) {
    let row_bytes = t.dtype.bytes_for(t.n * t.dtype.block_size()).unwrap_or(0);
    for c in 0..ra {
        let ap = t.a.add(c * t.a_stride);
        let act = match act_kind(t.dtype) {
            ActKind::F32 => ActRow::F32(std::slice::from_raw_parts(ap as *const f32, t.n)),
            ActKind::Q8 => ActRow::Q8(std::slice::from_raw_parts(ap as *const Q8A, t.n)),
            ActKind::Q8K => ActRow::Q8K(std::slice::from_raw_parts(ap as *const Q8KA, t.n)),
        };
        for r in 0..rw {
            let w = std::slice::from_raw_parts(t.w.add(r * t.w_stride), row_bytes);
            *t.out.add(c * t.out_stride + r) = dot(t.dtype, w, act);
        }
    }
}

fn kernel(isa: Isa, dtype: DType) -> Kernel {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        use super::avx2::Vnni;
        let vnni = match isa {
            Isa::AvxVnni => Vnni::Vex,
            Isa::Avx512Vnni => Vnni::Evex,
            _ => Vnni::None,
        };
        if let Some(k) = super::avx2::kernel(dtype, vnni) {
            return k;
        }
    }
    let _ = isa;
    Kernel { tile: scalar_tile, rw: 1, ra: 1, rw_gemv: 1, pack: None, partial: false }
}

thread_local! {
    /// Per thread (workers included): unpacked weight rows (u64 for alignment).
    static PACKED: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    static SCRATCH_Q8: RefCell<Vec<Q8A>> = const { RefCell::new(Vec::new()) };
    static SCRATCH_Q8K: RefCell<Vec<Q8KA>> = const { RefCell::new(Vec::new()) };
}

#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    // A method, so closures capture the whole (Sync) wrapper, not the field.
    fn get(&self) -> *mut T {
        self.0
    }
}

/// Quantize `m` rows of `x` into `dst` (`m * per_row` blocks), over the
/// pool when there are enough rows to be worth it.
fn quantize_rows<B: Send>(x: &[f32], m: usize, cols: usize, dst: &mut [B], f: &(dyn Fn(&[f32], &mut [B]) + Sync)) {
    let per_row = dst.len() / m.max(1);
    let ptr = SendPtr(dst.as_mut_ptr());
    let body = |i: usize| {
        // SAFETY: each task writes only row i's blocks.
        let out = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(i * per_row), per_row) };
        f(&x[i * cols..(i + 1) * cols], out);
    };
    if m >= 8 && m * cols >= 1 << 15 {
        pool::parallel_for(m, &body);
    } else {
        (0..m).for_each(body);
    }
}

/// `out[m][rows] = x[m][cols] · Wᵀ` with the best kernels this CPU has.
///
/// # Panics
/// When the shapes disagree (`x.len() != m * cols`, `out.len() != m *
/// rows`, or `w.data` is not `rows` rows of `cols`): a caller's bug, as
/// weights are validated ([`QMatRef::validate`]) when loaded.
pub fn matmul(w: QMatRef<'_>, x: &[f32], m: usize, out: &mut [f32]) {
    matmul_isa(Isa::best(), w, x, m, out)
}

/// [`matmul`] with the given kernels (the scalar ones when `isa` is not
/// available here). For tests and benchmarks.
pub fn matmul_isa(isa: Isa, w: QMatRef<'_>, x: &[f32], m: usize, out: &mut [f32]) {
    run(isa, w, None, x, m, out)
}

/// `out[m][ids.len()] = x[m][cols] · W[ids]ᵀ`: the matmul restricted to the
/// weight rows `ids` (e.g. logits for a few candidate tokens).
///
/// # Panics
/// As [`matmul`], and when an id is not below `w.rows`.
pub fn matmul_rows(w: QMatRef<'_>, ids: &[u32], x: &[f32], m: usize, out: &mut [f32]) {
    run(Isa::best(), w, Some(ids), x, m, out)
}

/// `outs[i][m][ws[i].rows] = x[m][cols] · ws[i]ᵀ` for weights that share
/// the input (q, k and v): the activations are quantized once per kind and
/// every matmul's tasks run in one pool job. Results equal [`matmul`]'s.
///
/// # Panics
/// As [`matmul`], and when `ws` and `outs` differ in length.
pub fn matmul_many(ws: &[QMatRef<'_>], x: &[f32], m: usize, outs: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), outs.len(), "matmul_many: {} weights, {} outputs", ws.len(), outs.len());
    for (w, out) in ws.iter().zip(outs.iter()) {
        // Also makes every weight as wide as x's rows (when m > 0).
        check(w, None, x, m, out);
    }
    if m == 0 || ws.is_empty() {
        return;
    }
    let isa = Isa::best();
    let ptrs: Vec<SendPtr<f32>> = outs.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
    with_acts(isa, x, m, ws[0].cols, ws, &|acts| {
        let plans: Vec<Plan<'_>> = ws.iter().zip(&ptrs).map(|(w, p)| acts.plan(isa, *w, None, p.get())).collect();
        run_plans(&plans);
    });
}

/// Shape checks shared by the entry points.
fn check(w: &QMatRef<'_>, ids: Option<&[u32]>, x: &[f32], m: usize, out: &[f32]) {
    if let Err(e) = w.validate() {
        panic!("matmul: {e}");
    }
    let n_out = ids.map_or(w.rows, |ids| ids.len());
    assert_eq!(x.len(), m * w.cols, "matmul: x holds {} values, not {m} rows of {}", x.len(), w.cols);
    assert_eq!(out.len(), m * n_out, "matmul: out holds {} values, not {m} x {n_out}", out.len());
    if let Some(ids) = ids {
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= w.rows) {
            panic!("matmul_rows: row {bad} is past the weight's {} rows", w.rows);
        }
    }
}

fn run(isa: Isa, w: QMatRef<'_>, ids: Option<&[u32]>, x: &[f32], m: usize, out: &mut [f32]) {
    check(&w, ids, x, m, out);
    let n_out = ids.map_or(w.rows, |ids| ids.len());
    if m == 0 || n_out == 0 {
        return;
    }
    let optr = out.as_mut_ptr();
    with_acts(isa, x, m, w.cols, &[w], &|acts| run_plans(&[acts.plan(isa, w, ids, optr)]));
}

/// Activation rows in each form the weights at hand consume.
struct Acts {
    x: *const f32,
    q8: *const Q8A,
    q8k: *const Q8KA,
    m: usize,
    cols: usize,
}

impl Acts {
    /// The plan of one matmul over these activations, writing `out`
    /// (`m * n_out` values).
    fn plan<'a>(&self, isa: Isa, w: QMatRef<'a>, ids: Option<&'a [u32]>, out: *mut f32) -> Plan<'a> {
        let isa = if isa.available() { isa } else { Isa::Scalar };
        let k = kernel(isa, w.dtype);
        let cols = self.cols;
        let (a, a_stride, n) = match act_kind(w.dtype) {
            ActKind::F32 => (self.x as *const u8, cols * 4, cols),
            ActKind::Q8 => (self.q8 as *const u8, cols / 32 * std::mem::size_of::<Q8A>(), cols / 32),
            ActKind::Q8K => (self.q8k as *const u8, cols / 256 * std::mem::size_of::<Q8KA>(), cols / 256),
        };
        Plan::new(k, w, ids, a, a_stride, n, self.m, out)
    }
}

/// Quantize `x` once into each activation form `ws` need (the two 8-bit
/// forms live in separate per-thread buffers), then run `f`.
fn with_acts(isa: Isa, x: &[f32], m: usize, cols: usize, ws: &[QMatRef<'_>], f: &dyn Fn(&Acts)) {
    let isa = if isa.available() { isa } else { Isa::Scalar };
    let need = |kind: ActKind| ws.iter().any(|w| act_kind(w.dtype) == kind && w.cols > 0);
    let nb8 = if need(ActKind::Q8) { m * (cols / 32) } else { 0 };
    let nbk = if need(ActKind::Q8K) { m * (cols / 256) } else { 0 };
    with_scratch(&SCRATCH_Q8, nb8, |q8| {
        if nb8 > 0 {
            quantize_rows(x, m, cols, q8, &|xr, o| quantize_q8a(isa, xr, o));
        }
        with_scratch(&SCRATCH_Q8K, nbk, |q8k| {
            if nbk > 0 {
                quantize_rows(x, m, cols, q8k, &|xr, o| quantize_q8k(isa, xr, o));
            }
            f(&Acts { x: x.as_ptr(), q8: q8.as_ptr(), q8k: q8k.as_ptr(), m, cols });
        });
    });
}

/// Run every task of `plans` in one pool job.
fn run_plans(plans: &[Plan<'_>]) {
    let mut starts = Vec::with_capacity(plans.len());
    let mut total = 0;
    for p in plans {
        starts.push(total);
        total += p.tasks();
    }
    let task = |t: usize| {
        let i = starts.partition_point(|&s| s <= t) - 1;
        plans[i].run(t - starts[i]);
    };
    match total {
        0 => {}
        1 => task(0),
        n => pool::parallel_for(n, &task),
    }
}

/// Run `f` on `n` blocks of this thread's scratch (grown, never shrunk, so
/// steady-state calls do not allocate). A nested call, which cannot borrow
/// it, gets a fresh buffer.
fn with_scratch<B: Default + Clone>(key: &'static std::thread::LocalKey<RefCell<Vec<B>>>, n: usize, f: impl FnOnce(&mut [B])) {
    let mut f = Some(f);
    key.with(|cell| {
        if let Ok(mut buf) = cell.try_borrow_mut() {
            if buf.len() < n {
                buf.resize(n, B::default());
            }
            (f.take().expect("called once"))(&mut buf[..n]);
        }
    });
    if let Some(f) = f {
        f(&mut vec![B::default(); n]);
    }
}

/// Run `f` on at least `bytes` bytes of this thread's pack buffer.
fn with_pack_scratch(bytes: usize, f: impl FnOnce(*mut u8)) {
    let words = bytes.div_ceil(8);
    with_scratch(&PACKED, words, |buf: &mut [u64]| f(buf.as_mut_ptr() as *mut u8));
}

/// The fewest activation rows a task gets when they are split: enough to
/// reuse each unpacked weight block many times.
const ACT_CHUNK_MIN: usize = 32;
/// Bytes of weights a task sweeps per activation tile (packed: what its
/// kernel's packs ask for, [`SUB_BYTES`] for most).
pub(crate) const SUB_BYTES: usize = 64 << 10;
/// Activation rows from which repacking a task's weights pays off, where
/// a kernel was measured no lower ([`Pack::min_rows`]).
pub(crate) const PACK_MIN_ACT_ROWS: usize = 16;
/// Below this many multiply-adds a call runs on the calling thread alone:
/// waking the pool would cost more than it saves.
const MIN_PARALLEL_MACS: usize = 1 << 16;

/// The next tile's extent with `left` rows or columns to go: the full
/// shape while it fits, then all that is left where the tile takes any
/// (`partial`), else one at a time.
fn tile_step(left: usize, full: usize, partial: bool) -> usize {
    if left >= full {
        full
    } else if partial {
        left
    } else {
        1
    }
}

/// One matmul split into tasks: task t owns weight rows (output columns)
/// `r0..r1` and activation rows `c0..c1` (see [`Plan::block`]).
struct Plan<'a> {
    k: Kernel,
    w: QMatRef<'a>,
    ids: Option<&'a [u32]>,
    a: SendPtr<u8>,
    a_stride: usize,
    /// Blocks per row (elements for float weights).
    n: usize,
    m: usize,
    out: SendPtr<f32>,
    n_out: usize,
    /// Bytes of one weight row.
    rb: usize,
    n_rc: usize,
    n_ac: usize,
    rc_len: usize,
    ac_len: usize,
}

impl<'a> Plan<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(k: Kernel, w: QMatRef<'a>, ids: Option<&'a [u32]>, a: *const u8, a_stride: usize, n: usize, m: usize, out: *mut f32) -> Plan<'a> {
        let rb = w.dtype.bytes_for(w.cols).unwrap_or(0);
        let n_out = ids.map_or(w.rows, |ids| ids.len());
        let threads = pool::threads();
        let macs = n_out * w.cols * m;
        let par = threads > 1 && macs >= MIN_PARALLEL_MACS;

        let align = k.rw.max(k.rw_gemv);
        // Aim for a few tasks per thread so uneven progress balances. Split the
        // weight rows first (each task then unpacks / streams only its own
        // rows); split the activation rows too only when there are too few
        // weight rows to go around.
        let want_tasks = if par { threads * 4 } else { 1 };
        let n_rc = want_tasks.min(n_out.div_ceil(16)).max(1);
        let n_ac = if par { want_tasks.div_ceil(n_rc).min(m.div_ceil(ACT_CHUNK_MIN)).max(1) } else { 1 };
        let ac_len = m.div_ceil(n_ac).next_multiple_of(k.ra);
        let n_ac = m.div_ceil(ac_len).max(1);
        let rc_len = n_out.div_ceil(n_rc).next_multiple_of(align);
        let n_rc = n_out.div_ceil(rc_len).max(1);
        Plan { k, w, ids, a: SendPtr(a as *mut u8), a_stride, n, m, out: SendPtr(out), n_out, rb, n_rc, n_ac, rc_len, ac_len }
    }

    fn tasks(&self) -> usize {
        if self.m == 0 || self.n_out == 0 {
            0
        } else {
            self.n_rc * self.n_ac
        }
    }

    /// Task t's weight rows r0..r1 and activation rows c0..c1.
    fn block(&self, t: usize) -> (usize, usize, usize, usize) {
        let (rc, ac) = (t % self.n_rc, t / self.n_rc);
        let (r0, r1) = (rc * self.rc_len, ((rc + 1) * self.rc_len).min(self.n_out));
        let (c0, c1) = (ac * self.ac_len, ((ac + 1) * self.ac_len).min(self.m));
        (r0, r1, c0, c1)
    }

    /// Runs the tiles of weight rows s0..s1 (output columns) against
    /// activation rows c0..c1; `wrow(r)` is weight row r's first byte.
    #[allow(clippy::too_many_arguments)]
    fn tiles(
        &self,
        kt: TileFn,
        partial: bool,
        rw_full: usize,
        ra_full: usize,
        rw_gemv: usize,
        w_stride: usize,
        s0: usize,
        s1: usize,
        c0: usize,
        c1: usize,
        wrow: &dyn Fn(usize) -> *const u8,
    ) {
        if self.w.cols == 0 {
            for c in c0..c1 {
                for r in s0..s1 {
                    // SAFETY: (r, c) is inside out and owned by this task.
                    unsafe { *self.out.get().add(c * self.n_out + r) = 0.0 };
                }
            }
            return;
        }
        let mut c = c0;
        while c < c1 {
            let ra = tile_step(c1 - c, ra_full, partial);
            let full_rw = if self.ids.is_some() {
                1
            } else if ra == 1 {
                rw_gemv
            } else {
                rw_full
            };
            let mut r = s0;
            while r < s1 {
                let rw = tile_step(s1 - r, full_rw, partial);
                let tile = Tile {
                    dtype: self.w.dtype,
                    w: wrow(r),
                    w_stride,
                    // SAFETY (both): c < m; tasks write disjoint (r, c) outputs.
                    a: unsafe { (self.a.get() as *const u8).add(c * self.a_stride) },
                    a_stride: self.a_stride,
                    n: self.n,
                    out: unsafe { self.out.get().add(c * self.n_out + r) },
                    out_stride: self.n_out,
                };
                // SAFETY: the kernel matches the ISA chosen; pointers as above.
                unsafe { kt(&tile, rw, ra) };
                r += rw;
            }
            c += ra;
        }
    }

    fn run(&self, t: usize) {
        let (k, rb) = (&self.k, self.rb);
        let (r0, r1, c0, c1) = self.block(t);
        let data = self.w.data.as_ptr();
        let ids = self.ids;
        // SAFETY: ids were checked to be rows of w.
        let orig = |r: usize| unsafe { data.add(ids.map_or(r, |ids| ids[r] as usize) * rb) };
        let pack = match k.pack {
            Some(p) if ids.is_none() && c1 - c0 >= p.min_rows => p,
            _ => {
                // Many activation tiles: sweep the weights in L2-sized row
                // blocks so each is reused from cache by every tile.
                let sub = if c1 - c0 > k.ra { (SUB_BYTES / rb.max(1)).max(8) / 8 * 8 } else { r1 - r0 };
                let mut s0 = r0;
                while s0 < r1 {
                    let s1 = (s0 + sub).min(r1);
                    self.tiles(k.tile, k.partial, k.rw, k.ra, k.rw_gemv, rb, s0, s1, c0, c1, &orig);
                    s0 = s1;
                }
                return;
            }
        };
        // Prefill: unpack a block of weight rows once into the kernel's
        // plain layout, then run every activation tile over it.
        let pb = self.n * pack.block_bytes;
        let group = pack.rw.max(8);
        let sub = (pack.sub_bytes / pb.max(1)).clamp(group, 256) / group * group;
        with_pack_scratch(sub * pb, |buf| {
            let mut s0 = r0;
            while s0 < r1 {
                let s1 = (s0 + sub).min(r1);
                // SAFETY: rows s0..s1 exist; buf holds sub * pb bytes.
                unsafe { (pack.pack)(orig(s0), rb, s1 - s0, self.n, buf) };
                let packed = |r: usize| buf.wrapping_add((r - s0) * pb) as *const u8;
                self.tiles(pack.tile, pack.partial, pack.rw, pack.ra, pack.rw, pb, s0, s1, c0, c1, &packed);
                s0 = s1;
            }
        });
    }
}
