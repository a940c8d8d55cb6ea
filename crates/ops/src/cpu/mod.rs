//! The CPU device: f32 activations, weights kept as the file's blocks,
//! f16 paged KV. Work is split over the persistent pool in [`pool`].

pub mod attention;
pub mod conv;
pub mod delta_rule;
pub mod kv;
pub mod linear_attention;
pub mod pointwise;
pub mod pool;
pub mod quant;
pub mod rope_freqs;
pub mod scatter_add_rows;
pub mod sparse_attention;
pub mod ssm;
pub mod vmath;

#[cfg(test)]
mod fused_tests;

use anyhow::{bail, ensure, Result};
use braid_formats::{Bytes, DType, TensorView};
use half::f16;

use crate::{Act, AttnSeq, DeltaShape, Device, DeviceCaps, KvDtype, KvPoolSpec, Map, MoeOps, RecurrentOps, Rope, SsmShape, StateSeq};

/// Row-major f32 activations.
#[derive(Clone, Debug, Default)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuTensor {
    /// Make this `rows x cols`, new values zero (the kernels' outputs and
    /// `Device::resize`).
    pub fn resize(&mut self, rows: usize, cols: usize) {
        self.data.resize(rows * cols, 0.0);
        (self.rows, self.cols) = (rows, cols);
    }
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.data[i * self.cols..(i + 1) * self.cols]
    }
}

/// A weight matrix `[rows = out, cols = in]` in its stored type.
#[derive(Clone, Debug)]
pub struct CpuWeight {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: Bytes,
}

impl CpuWeight {
    fn qref(&self) -> quant::QMatRef<'_> {
        quant::QMatRef { dtype: self.dtype, rows: self.rows, cols: self.cols, data: &self.data }
    }
    fn row_bytes(&self) -> usize {
        self.dtype.bytes_for(self.cols).unwrap_or(0)
    }
}

/// Paged KV: per layer, its group's `blocks × block_tokens` slots of
/// `kv_heads × head_dim` values, for K and for V; in f16 (`k`, `v`) or,
/// for a pool made as [`KvDtype::F32`], in f32 (`k32`, `v32`, the f16
/// vectors then empty).
pub struct CpuKv {
    pub spec: KvPoolSpec,
    pub dtype: KvDtype,
    pub k: Vec<Vec<f16>>,
    pub v: Vec<Vec<f16>>,
    pub k32: Vec<Vec<f32>>,
    pub v32: Vec<Vec<f32>>,
}

impl CpuKv {
    pub fn row_width(&self, layer: usize) -> usize {
        let s = self.spec.layers[layer];
        s.kv_heads * s.head_dim
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Cpu {
    pub fn new(threads: Option<usize>) -> Cpu {
        if let Some(n) = threads {
            pool::set_threads(n);
        }
        Cpu
    }
}

/// Split `n` rows over the pool, each task taking a contiguous range.
fn par_rows(n: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    let tasks = pool::threads().min(n).max(1);
    if tasks == 1 {
        f(0..n);
        return;
    }
    pool::parallel_for(tasks, &|t| {
        let a = n * t / tasks;
        let b = n * (t + 1) / tasks;
        if a < b {
            f(a..b)
        }
    });
}

/// A raw pointer that may cross into pool tasks; each task writes disjoint rows.
struct SendPtr<T = f32>(*mut T);
// Not derived: a derive would ask `T: Copy`, and a pointer copies whatever it points to.
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    /// # Safety
    /// The range must be inside the allocation and written by one task only.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

impl Device for Cpu {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Kv = CpuKv;

    fn name(&self) -> String {
        // The kernels too: which ones run changes the speed several-fold
        // (a CPU with both VNNI kinds ran float products 2-3x slower on
        // the VEX one), and benchmarks from different machines get compared.
        format!("cpu ({} threads, {} kernels)", pool::threads(), quant::Isa::best().name())
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps { batch_invariant: true, ..DeviceCaps::default() }
    }

    fn tensor(&self, rows: usize, cols: usize) -> CpuTensor {
        CpuTensor { data: vec![0.0; rows * cols], rows, cols }
    }

    fn resize(&self, t: &mut CpuTensor, rows: usize, cols: usize) {
        t.resize(rows, cols);
    }

    fn shape(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CpuTensor> {
        ensure!(data.len() == rows * cols, "upload: {} values for a {rows}x{cols} tensor", data.len());
        Ok(CpuTensor { data: data.to_vec(), rows, cols })
    }

    fn download(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn weight(&self, view: &TensorView) -> Result<CpuWeight> {
        let (rows, cols) = match view.shape.as_slice() {
            [r, c] => (*r, *c),
            [c] => (1, *c),
            s => bail!("tensor {}: expected a 2-D weight, found shape {:?}", view.name, s),
        };
        let need = view
            .dtype
            .bytes_for(cols)
            .and_then(|b| b.checked_mul(rows))
            .ok_or_else(|| anyhow::anyhow!("tensor {}: {} columns is not a whole number of {} blocks", view.name, cols, view.dtype))?;
        ensure!(view.data.len() == need, "tensor {}: {} bytes, expected {need} for {:?} {}", view.name, view.data.len(), view.shape, view.dtype);
        Ok(CpuWeight { dtype: view.dtype, rows, cols, data: view.data.clone() })
    }

    fn weight_shape(&self, w: &CpuWeight) -> (usize, usize) {
        (w.rows, w.cols)
    }

    fn vector(&self, view: &TensorView, offset: f32) -> Result<CpuTensor> {
        let n = view.elements();
        let mut data = vec![0.0f32; n];
        quant::dequantize(view.dtype, &view.data, &mut data).map_err(|e| anyhow::anyhow!("tensor {}: {e}", view.name))?;
        if offset != 0.0 {
            data.iter_mut().for_each(|x| *x += offset);
        }
        Ok(CpuTensor { data, rows: 1, cols: n })
    }

    fn kv_pool(&self, spec: &KvPoolSpec, dtype: KvDtype) -> Result<CpuKv> {
        kv::kv_pool(spec, dtype)
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32], scale: f32, out: &mut CpuTensor) {
        self.resize(out, ids.len(), table.cols);
        let rb = table.row_bytes();
        for (i, &id) in ids.iter().enumerate() {
            let id = (id as usize).min(table.rows - 1);
            let src = &table.data[id * rb..(id + 1) * rb];
            let dst = out.row_mut(i);
            // The weight was validated at load, so the sizes agree.
            quant::dequantize(table.dtype, src, dst).expect("embedding row");
            if scale != 1.0 {
                dst.iter_mut().for_each(|x| *x *= scale);
            }
        }
    }

    fn matmul(&self, x: &CpuTensor, ws: &[&CpuWeight], outs: &mut [&mut CpuTensor]) {
        assert_eq!(ws.len(), outs.len(), "matmul: {} weights for {} outputs", ws.len(), outs.len());
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            assert_eq!(x.cols, w.cols, "matmul: x has {} columns, weight takes {}", x.cols, w.cols);
            self.resize(out, x.rows, w.rows);
        }
        if let ([w], [out]) = (ws, &mut *outs) {
            return quant::matmul(w.qref(), &x.data, x.rows, &mut out.data);
        }
        // Several products of one input in one pass over the pool.
        let refs: Vec<quant::QMatRef<'_>> = ws.iter().map(|w| w.qref()).collect();
        let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o.data[..]).collect();
        quant::matmul_many(&refs, &x.data, x.rows, &mut slices);
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize], out: &mut CpuTensor) {
        self.resize(out, rows.len(), x.cols);
        for (i, &r) in rows.iter().enumerate() {
            out.row_mut(i).copy_from_slice(x.row(r));
        }
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, eps: f32, out: &mut CpuTensor) {
        let g = w.cols;
        assert!(g > 0 && x.cols.is_multiple_of(g), "rms_norm: weight of {g} does not divide rows of {}", x.cols);
        self.resize(out, x.rows, x.cols);
        let groups = x.data.len() / g;
        let optr = SendPtr(out.data.as_mut_ptr());
        par_rows(groups, &|range| {
            for gi in range {
                let dst = unsafe { optr.slice(gi * g, g) };
                norm_group(&x.data[gi * g..(gi + 1) * g], &w.data, eps, dst);
            }
        });
    }

    fn add(&self, x: &mut CpuTensor, y: &CpuTensor) {
        if y.rows == 1 && x.rows != 1 {
            // A bias: one row added to every row.
            assert_eq!(x.cols, y.cols, "add: rows of {} plus a row of {}", x.cols, y.cols);
            x.data.chunks_exact_mut(x.cols.max(1)).for_each(|r| r.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b));
            return;
        }
        assert_eq!(x.data.len(), y.data.len(), "add: {}x{} += {}x{}", x.rows, x.cols, y.rows, y.cols);
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
    }

    fn map(&self, x: &mut CpuTensor, f: Map) {
        match f {
            Map::Scale(s) => x.data.iter_mut().for_each(|v| *v *= s),
            Map::Softcap(cap) => x.data.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh()),
            Map::Silu => pointwise::silu(x),
            Map::Relu2 => pointwise::relu2(x),
        }
    }

    fn gated(&self, act: Act, gate: &CpuTensor, up: &CpuTensor, out: &mut CpuTensor) {
        assert!(gate.rows == up.rows && gate.cols == up.cols, "gated: gate {}x{}, up {}x{}", gate.rows, gate.cols, up.rows, up.cols);
        self.resize(out, gate.rows, gate.cols);
        let f: fn(&[f32], &[f32], &mut [f32]) = match act {
            Act::Silu => vmath::silu_mul,
            Act::GeluTanh => vmath::gelu_mul,
            Act::Identity => pointwise::mul,
            Act::Sigmoid => pointwise::sigmoid_mul,
            Act::SwiGluClamped { limit, alpha } => return pointwise::swiglu_clamped(gate, up, limit, alpha, out),
        };
        let optr = SendPtr(out.data.as_mut_ptr());
        par_rows(gate.rows, &|range| {
            let (a, n) = (range.start * gate.cols, range.len() * gate.cols);
            // SAFETY: each task writes its own rows.
            let dst = unsafe { optr.slice(a, n) };
            f(&gate.data[a..a + n], &up.data[a..a + n], dst);
        });
    }

    fn rope(&self, x: &mut CpuTensor, positions: &[u32], head_dim: usize, rope: &Rope) {
        if let Some(freqs) = &rope.freqs {
            return rope_freqs::rope_freqs(x, positions, head_dim, freqs);
        }
        assert_eq!(positions.len(), x.rows);
        let dims = rope.dims.min(head_dim);
        let half = dims / 2;
        let cols = x.cols;
        let neox = rope.neox;
        let xptr = SendPtr(x.data.as_mut_ptr());
        rope_table(positions, rope, dims, &|table| {
            par_rows(positions.len(), &|range| {
                for r in range {
                    // SAFETY: each task rotates its own rows.
                    let row = unsafe { xptr.slice(r * cols, cols) };
                    let cs = &table[r * half..(r + 1) * half];
                    for head in row.chunks_exact_mut(head_dim) {
                        for (i, &(s, c)) in cs.iter().enumerate() {
                            let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
                            let (x0, x1) = (head[a], head[b]);
                            head[a] = x0 * c - x1 * s;
                            head[b] = x0 * s + x1 * c;
                        }
                    }
                }
            });
        });
    }

    fn kv_write(&self, kv: &mut CpuKv, layer: usize, k: &CpuTensor, v: &CpuTensor, slots: &[u32]) {
        kv::kv_write(kv, layer, k, v, slots)
    }

    fn kv_copy_blocks(&self, kv: &mut CpuKv, group: usize, src: &[u32], dst: &[u32]) {
        kv::kv_copy_blocks(kv, group, src, dst)
    }

    fn attention(&self, q: &CpuTensor, kv: &CpuKv, layer: usize, seqs: &[AttnSeq<'_>], scale: f32, softcap: Option<f32>, out: &mut CpuTensor) {
        self.resize(out, q.rows, q.cols);
        attention::paged_attention(q, kv, layer, seqs, scale, softcap, out)
    }

    fn copy_rows(&self, t: &mut CpuTensor, src: &[u32], dst: &[u32]) {
        let c = t.cols;
        for (&s, &d) in src.iter().zip(dst) {
            t.data.copy_within(s as usize * c..(s as usize + 1) * c, d as usize * c);
        }
    }

    fn zero_rows(&self, t: &mut CpuTensor, rows: &[u32]) {
        for &r in rows {
            t.row_mut(r as usize).fill(0.0);
        }
    }
}

// The families' ops: the kernels live in their own files.
impl RecurrentOps for Cpu {
    fn group_rms_norm(&self, x: &CpuTensor, w: &CpuTensor, group: usize, eps: f32, out: &mut CpuTensor) -> Result<()> {
        pointwise::group_rms_norm(x, w, group, eps, out)
    }

    fn short_conv(
        &self,
        x: &CpuTensor,
        weight: &CpuTensor,
        bias: Option<&CpuTensor>,
        kernel: usize,
        silu: bool,
        state: &mut CpuTensor,
        state_offset: usize,
        seqs: &[StateSeq],
        out: &mut CpuTensor,
    ) -> Result<()> {
        conv::short_conv(x, weight, bias, kernel, silu, state, state_offset, seqs, out)
    }

    fn ssm_scan(
        &self,
        xbc: &CpuTensor,
        dt: &CpuTensor,
        dt_bias: &CpuTensor,
        a: &CpuTensor,
        d: &CpuTensor,
        shape: &SsmShape,
        state: &mut CpuTensor,
        state_offset: usize,
        seqs: &[StateSeq],
        out: &mut CpuTensor,
    ) -> Result<()> {
        ssm::ssm_scan(xbc, dt, dt_bias, a, d, shape, state, state_offset, seqs, out)
    }

    fn linear_attention(
        &self,
        qkv: &CpuTensor,
        slopes: &CpuTensor,
        heads: usize,
        head_dim: usize,
        state: &mut CpuTensor,
        state_offset: usize,
        seqs: &[StateSeq],
        out: &mut CpuTensor,
    ) -> Result<()> {
        linear_attention::linear_attention(qkv, slopes, heads, head_dim, state, state_offset, seqs, out)
    }

    fn gated_delta_rule(
        &self,
        qkv: &CpuTensor,
        a: &CpuTensor,
        b: &CpuTensor,
        dt_bias: &CpuTensor,
        decay: &CpuTensor,
        shape: &DeltaShape,
        state: &mut CpuTensor,
        state_offset: usize,
        seqs: &[StateSeq],
        out: &mut CpuTensor,
    ) -> Result<()> {
        delta_rule::gated_delta_rule(qkv, a, b, dt_bias, decay, shape, state, state_offset, seqs, out)
    }
}

impl MoeOps for Cpu {
    fn scatter_add_rows(&self, out: &mut CpuTensor, y: &CpuTensor, rows: &[u32], weights: &[f32]) -> Result<()> {
        scatter_add_rows::scatter_add_rows(out, y, rows, weights)
    }
}

/// RMSNorm of one group of values times `w`.
#[inline]
fn norm_group(src: &[f32], w: &[f32], eps: f32, dst: &mut [f32]) {
    let ss: f32 = src.iter().map(|v| v * v).sum::<f32>() / src.len() as f32;
    let inv = 1.0 / (ss + eps).sqrt();
    for ((d, s), wv) in dst.iter_mut().zip(src).zip(w) {
        *d = s * inv * wv;
    }
}

/// The last few RoPE tables this thread built: (theta, dims, scale bits,
/// pairs, positions) and per position the `(sin, cos)` of each pair.
type RopeKey = (u32, usize, u32, usize, Vec<u32>);
type SinCos = (f32, f32);
type RopeCache = Vec<(RopeKey, Vec<SinCos>)>;

thread_local! {
    static ROPE_TABLES: std::cell::RefCell<RopeCache> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Run `f` on the `(sin, cos)` of every (position, pair) of `rope`. q and
/// k of every layer rotate by the same positions, so the table is built
/// once per batch (per RoPE kind) rather than per head and per call; the
/// values are the ones a direct computation gives.
fn rope_table(positions: &[u32], rope: &Rope, dims: usize, f: &dyn Fn(&[SinCos])) {
    let half = dims / 2;
    let key: RopeKey = (rope.theta.to_bits(), dims, rope.scale.to_bits(), half, positions.to_vec());
    let build = || {
        let inv_freq: Vec<f32> = (0..half).map(|i| rope.theta.powf(-((2 * i) as f32) / dims as f32)).collect();
        let mut t = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            let pos = p as f32 / rope.scale;
            t.extend(inv_freq.iter().map(|f| (pos * f).sin_cos()));
        }
        t
    };
    ROPE_TABLES.with(|cell| {
        let Ok(mut cache) = cell.try_borrow_mut() else { return f(&build()) };
        let i = match cache.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                // Two kinds (Gemma's local and global) stay cached.
                if cache.len() >= 2 {
                    cache.remove(0);
                }
                cache.push((key, build()));
                cache.len() - 1
            }
        };
        f(&cache[i].1)
    });
}
