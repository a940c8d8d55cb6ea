//! The ops of the hybrid families on the GPU: LFM2's short conv, Mamba2's
//! selective scan and gated group norm, MiniMax's lightning (linear) and
//! block-sparse attention, Qwen3-Next's gated delta rule, the pointwise ops around them, Gemma 4's RoPE
//! from a frequency table, and the MoE scatter. CUDA C in its own NVRTC
//! module (`kernels/recurrent.cu`), compiled (or taken from the on-disk
//! cache) on first use, and the launches.
//!
//! Every op reads and writes device memory only (index arrays go up through
//! the upload arena), so they run inside decode rounds and CUDA graphs. The
//! recurrences (conv state, SSM and linear-attention scans) step token by
//! token in the same order whatever the chunking, so, as on the CPU, a row's
//! result does not depend on how its prompt was cut.
//!
//! Each `try_*` is the `Device` op of that name, and the `RecurrentOps` and
//! `SparseAttentionOps` methods are implemented here: each checks its inputs
//! (an error there is returned, not kept), then runs through
//! [`Cuda::try_op`].

use std::collections::HashSet;
use std::sync::Mutex;

use anyhow::{anyhow, ensure, Result};

use super::exec::Io;
use super::kernels;
use super::rt::{self, DevBuf};
use super::{Cuda, CudaKv, CudaTensor};
use crate::{checks, AttnSeq, BlockSparse, DeltaShape, RecurrentOps, SparseAttentionOps, SsmShape, StateSeq};

/// SSM state size per lane × 32 lanes (`SSM_NPL` in the source).
const MAX_SSM_STATE: usize = 256;
/// Linear-attention head dim: 32 values per lane × 8 lanes (`LA_MPL`).
const MAX_LINEAR_HEAD_DIM: usize = 256;
/// Gated delta rule key dim: 32 values per lane × 8 lanes (`DN_MPL`).
const MAX_DELTA_KEY_DIM: usize = 256;
/// Block-sparse attention: head dim (8 values per lane), indexer dim (the
/// query in shared memory), kept blocks (`BSA_MAXD`, `BSA_MAXK`).
const MAX_SPARSE_HEAD_DIM: usize = 256;
const MAX_INDEX_DIM: usize = 512;
const MAX_TOPK: usize = 256;
/// Grid y / z limit.
const MAX_GRID_YZ: usize = 65535;

macro_rules! hybrid_kernels {
    ($($f:ident),* $(,)?) => {
        /// Function handles of the module's kernels (`hy_<name>`).
        #[derive(Clone, Copy)]
        struct Fns {
            $($f: usize,)*
        }

        impl Fns {
            fn load(m: &rt::Module) -> Result<Fns> {
                Ok(Fns { $($f: m.func(concat!("hy_", stringify!($f)))?,)* })
            }

            fn names(&self) -> Vec<(usize, &'static str)> {
                vec![$((self.$f, concat!("hy_", stringify!($f))),)*]
            }
        }
    };
}

hybrid_kernels!(rope_freqs, scatter_add, silu, relu2, group_rms_norm, conv, conv_state, ssm_scan, linear_attention, gated_delta_rule, bsa_select, bsa_attend,);

/// The module, loaded on first use, and the block-sparse scratch.
#[derive(Default)]
pub(super) struct Hybrid {
    fns: Mutex<Option<Fns>>,
    /// Block scores and kept blocks of a block-sparse attention call.
    scratch: Mutex<Option<DevBuf>>,
}

fn check_seqs(op: &str, seqs: &[StateSeq], rows: usize, slots: usize) -> Result<()> {
    ensure!(seqs.len() <= MAX_GRID_YZ, "{op}: {} sequences in one call (at most {MAX_GRID_YZ})", seqs.len());
    checks::state_seqs(seqs, rows, slots).map_err(|e| anyhow!("{op}: {e}"))
}

/// `[start, len, slot]` per sequence.
fn seq_meta(seqs: &[StateSeq]) -> Vec<u32> {
    seqs.iter().flat_map(|s| [s.start as u32, s.len as u32, s.slot]).collect()
}

impl Cuda {
    /// The hybrid module's kernels, compiled on first use.
    fn hy_fns(&self) -> Result<Fns> {
        let mut g = self.inner.hybrid.fns.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = *g {
            return Ok(f);
        }
        let m = rt::compile_and_load(&kernels::recurrent_source(&self.inner.tuning), &self.inner.arch)?;
        let f = Fns::load(&m)?;
        {
            let mut st = self.st();
            for (h, n) in f.names() {
                st.prof.names.insert(h, n.to_string());
            }
        }
        *g = Some(f);
        Ok(f)
    }

    /// Compile (or load) the hybrid kernels now, so a compile error shows
    /// here rather than inside a forward.
    pub fn prepare_hybrid(&self) -> Result<()> {
        rt::make_current(self.ctx())?;
        self.hy_fns().map(|_| ())
    }

    /// Run the device side of an op whose inputs were checked and whose
    /// outputs are sized, which reads and writes what `io` says: an error
    /// here (a launch, an upload, a compile) is also kept, as for the
    /// other ops ([`Cuda::try_op`]).
    fn hy_run(&self, io: Io, f: impl FnOnce(Fns) -> Result<()>) -> Result<()> {
        self.try_op(|| self.other(|| self.hy_fns().and_then(f).map(|_| io)))
    }

    /// The block-sparse scratch, at least `bytes` long.
    fn hy_scratch(&self, bytes: usize) -> Result<u64> {
        let mut g = self.inner.hybrid.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if g.as_ref().is_none_or(|b| b.bytes < bytes) {
            *g = None;
            *g = Some(DevBuf::new(self.ctx(), bytes.max(1 << 20))?);
        }
        Ok(g.as_ref().map_or(0, |b| b.ptr))
    }

    pub(super) fn try_rope_freqs(&self, x: &mut CudaTensor, positions: &[u32], head_dim: usize, inv_freq: &[f32]) -> Result<()> {
        let half = inv_freq.len();
        ensure!(positions.len() == x.rows, "rope_freqs: {} positions for {} rows", positions.len(), x.rows);
        ensure!(head_dim > 0 && x.cols.is_multiple_of(head_dim), "rope_freqs: rows of {} are not whole heads of {head_dim}", x.cols);
        ensure!(2 * half <= head_dim, "rope_freqs: {half} frequencies do not fit a head of {head_dim}");
        let io = Io { reads: vec![x.fptr()], writes: vec![x.fptr()], bf: Vec::new() };
        self.hy_run(io, |f| {
            if x.rows == 0 || half == 0 {
                return Ok(());
            }
            let p = self.put_u32(positions)?;
            let fr = self.put_f32(inv_freq)?;
            self.launch(f.rope_freqs).blocks(x.rows).block(256).ptr(x.fptr()).ptr(p).ptr(fr).int(x.cols).int(head_dim).int(half).run()
        })
    }

    pub(super) fn try_scatter_add_rows(&self, out: &mut CudaTensor, y: &CudaTensor, rows: &[u32], weights: &[f32]) -> Result<()> {
        ensure!(y.cols == out.cols, "scatter_add_rows: rows of {} added to rows of {}", y.cols, out.cols);
        ensure!(rows.len() == y.rows && weights.len() == y.rows, "scatter_add_rows: {} rows, {} targets, {} weights", y.rows, rows.len(), weights.len());
        if let Some(&bad) = rows.iter().find(|&&r| r as usize >= out.rows) {
            anyhow::bail!("scatter_add_rows: target row {bad} is past the output's {} rows", out.rows);
        }
        let io = Io { reads: vec![out.fptr(), y.fptr()], writes: vec![out.fptr()], bf: Vec::new() };
        self.hy_run(io, |f| {
            if rows.is_empty() || out.cols == 0 {
                return Ok(());
            }
            // Distinct targets: a block row per added row. A target named
            // twice: one pass in order, so each sum keeps the op's order.
            let distinct = rows.iter().collect::<HashSet<_>>().len() == rows.len();
            let ys = if distinct { rows.len().min(MAX_GRID_YZ) } else { 1 };
            let rp = self.put_u32(rows)?;
            let wp = self.put_f32(weights)?;
            self.launch(f.scatter_add)
                .grid((out.cols.div_ceil(256) as u32, ys as u32, 1))
                .block(256)
                .ptr(out.fptr())
                .ptr(y.fptr())
                .ptr(rp)
                .ptr(wp)
                .int(rows.len())
                .int(out.cols)
                .run()
        })
    }

    pub(super) fn try_silu(&self, x: &mut CudaTensor) -> Result<()> {
        let io = Io { reads: vec![x.fptr()], writes: vec![x.fptr()], bf: vec![x.fptr()] };
        self.hy_run(io, |f| {
            let n = x.len();
            // Here and below: no values, no launch (nor a graph signature
            // entry).
            if n > 0 {
                self.launch(f.silu).elementwise(n).ptr(x.fptr()).ptr(x.bptr()).u64(n as u64).run()?;
            }
            Ok(())
        })
    }

    /// `x = relu(x)²` in place (the kernel reads each value before it
    /// writes it).
    pub(super) fn try_relu2(&self, x: &mut CudaTensor) -> Result<()> {
        let io = Io { reads: vec![x.fptr()], writes: vec![x.fptr()], bf: vec![x.fptr()] };
        self.hy_run(io, |f| {
            let n = x.len();
            if n > 0 {
                self.launch(f.relu2).elementwise(n).ptr(x.fptr()).ptr(x.fptr()).ptr(x.bptr()).u64(n as u64).run()?;
            }
            Ok(())
        })
    }
}

impl RecurrentOps for Cuda {
    fn group_rms_norm(&self, x: &CudaTensor, w: &CudaTensor, group: usize, eps: f32, out: &mut CudaTensor) -> Result<()> {
        ensure!(w.len() == x.cols, "group_rms_norm: weight of {} for rows of {}", w.len(), x.cols);
        ensure!(group > 0 && x.cols.is_multiple_of(group), "group_rms_norm: groups of {group} do not divide rows of {}", x.cols);
        self.grow(out, x.rows, x.cols)?;
        let io = Io { reads: vec![x.fptr()], writes: vec![out.fptr()], bf: vec![out.fptr()] };
        self.hy_run(io, |f| {
            let groups = x.len() / group;
            if groups == 0 {
                return Ok(());
            }
            self.launch(f.group_rms_norm)
                .blocks(groups.div_ceil(8))
                .block(256)
                .ptr(x.fptr())
                .ptr(w.fptr())
                .ptr(out.fptr())
                .ptr(out.bptr())
                .int(groups)
                .int(group)
                .int(x.cols)
                .f32(eps)
                .run()
        })
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
        seqs: &[StateSeq],
        out: &mut CudaTensor,
    ) -> Result<()> {
        let c = x.cols;
        checks::short_conv(c, kernel, weight.len(), bias.map(|b| b.len()), state.cols, state_offset)?;
        let tail = kernel - 1;
        check_seqs("short_conv", seqs, x.rows, state.rows)?;
        self.grow(out, x.rows, c)?;
        let io = Io { reads: vec![x.fptr(), state.fptr()], writes: vec![out.fptr(), state.fptr()], bf: Vec::new() };
        self.hy_run(io, |f| {
            if seqs.iter().all(|s| s.len == 0) || c == 0 {
                return Ok(());
            }
            let mut meta = seq_meta(seqs);
            let mut row_seq = vec![u32::MAX; x.rows];
            for (i, s) in seqs.iter().enumerate() {
                row_seq[s.start..s.start + s.len].fill(i as u32);
            }
            meta.extend_from_slice(&row_seq);
            let mp = self.put_u32(&meta)?;
            let (cb, scols, soff) = (c.div_ceil(128) as u32, state.cols as i32, state_offset as i32);
            self.launch(f.conv)
                .grid((cb, x.rows.min(MAX_GRID_YZ) as u32, 1))
                .block(128)
                .ptr(x.fptr())
                .ptr(weight.fptr())
                .ptr(bias.map_or(0, |b| b.fptr()))
                .ptr(state.fptr())
                .ptr(out.fptr())
                .ptr(mp)
                .int(seqs.len())
                .int(x.rows)
                .int(c)
                .int(kernel)
                .i32(scols)
                .i32(soff)
                .flag(silu)
                .run()?;
            if tail > 0 {
                self.launch(f.conv_state)
                    .grid((cb, seqs.len() as u32, 1))
                    .block(128)
                    .ptr(x.fptr())
                    .ptr(state.fptr())
                    .ptr(mp)
                    .int(c)
                    .int(kernel)
                    .i32(scols)
                    .i32(soff)
                    .run()?;
            }
            Ok(())
        })
    }

    fn ssm_scan(
        &self,
        xbc: &CudaTensor,
        dt: &CudaTensor,
        dt_bias: &CudaTensor,
        a: &CudaTensor,
        d: &CudaTensor,
        sh: &SsmShape,
        state: &mut CudaTensor,
        state_offset: usize,
        seqs: &[StateSeq],
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (nh, hd, n, g) = (sh.heads, sh.head_dim, sh.state_dim, sh.groups);
        let lens = [("dt_bias", dt_bias.len()), ("a", a.len()), ("d", d.len())];
        checks::ssm_scan(sh, (xbc.rows, xbc.cols), (dt.rows, dt.cols), lens, state.cols, state_offset)?;
        ensure!(nh <= MAX_GRID_YZ, "ssm_scan: {nh} heads (at most {MAX_GRID_YZ} on CUDA)");
        ensure!(n <= MAX_SSM_STATE, "ssm_scan: state size {n} (at most {MAX_SSM_STATE} on CUDA)");
        let inner = nh * hd;
        check_seqs("ssm_scan", seqs, xbc.rows, state.rows)?;
        self.grow(out, xbc.rows, inner)?;
        let io = Io { reads: vec![xbc.fptr(), dt.fptr(), state.fptr()], writes: vec![out.fptr(), state.fptr()], bf: Vec::new() };
        self.hy_run(io, |f| {
            if seqs.is_empty() || inner == 0 || n == 0 {
                return Ok(());
            }
            let mp = self.put_u32(&seq_meta(seqs))?;
            self.launch(f.ssm_scan)
                .grid((hd.div_ceil(16) as u32, nh as u32, seqs.len() as u32))
                .block(128)
                .ptr(xbc.fptr())
                .ptr(dt.fptr())
                .ptr(dt_bias.fptr())
                .ptr(a.fptr())
                .ptr(d.fptr())
                .ptr(state.fptr())
                .ptr(out.fptr())
                .ptr(mp)
                .int(nh)
                .int(hd)
                .int(n)
                .int(g)
                .int(state.cols)
                .int(state_offset)
                .f32(sh.dt_min)
                .f32(sh.dt_max)
                .run()
        })
    }

    fn linear_attention(
        &self,
        qkv: &CudaTensor,
        slopes: &CudaTensor,
        heads: usize,
        hd: usize,
        state: &mut CudaTensor,
        state_offset: usize,
        seqs: &[StateSeq],
        out: &mut CudaTensor,
    ) -> Result<()> {
        checks::linear_attention(qkv.cols, slopes.len(), heads, hd, state.cols, state_offset)?;
        ensure!(hd <= MAX_LINEAR_HEAD_DIM, "linear_attention: head dim {hd} (at most {MAX_LINEAR_HEAD_DIM} on CUDA)");
        ensure!(heads <= MAX_GRID_YZ, "linear_attention: {heads} heads (at most {MAX_GRID_YZ} on CUDA)");
        check_seqs("linear_attention", seqs, qkv.rows, state.rows)?;
        self.grow(out, qkv.rows, heads * hd)?;
        let io = Io { reads: vec![qkv.fptr(), state.fptr()], writes: vec![out.fptr(), state.fptr()], bf: Vec::new() };
        self.hy_run(io, |f| {
            if seqs.is_empty() || heads * hd == 0 {
                return Ok(());
            }
            let mp = self.put_u32(&seq_meta(seqs))?;
            self.launch(f.linear_attention)
                .grid((hd.div_ceil(16) as u32, heads as u32, seqs.len() as u32))
                .block(128)
                .ptr(qkv.fptr())
                .ptr(slopes.fptr())
                .ptr(state.fptr())
                .ptr(out.fptr())
                .ptr(mp)
                .int(heads)
                .int(hd)
                .int(state.cols)
                .int(state_offset)
                .run()
        })
    }

    fn gated_delta_rule(
        &self,
        qkv: &CudaTensor,
        a: &CudaTensor,
        b: &CudaTensor,
        dt_bias: &CudaTensor,
        decay: &CudaTensor,
        sh: &DeltaShape,
        state: &mut CudaTensor,
        state_offset: usize,
        seqs: &[StateSeq],
        out: &mut CudaTensor,
    ) -> Result<()> {
        let ab = [("a", (a.rows, a.cols)), ("b", (b.rows, b.cols))];
        let lens = [("dt_bias", dt_bias.len()), ("decay", decay.len())];
        checks::gated_delta_rule(sh, (qkv.rows, qkv.cols), ab, lens, state.cols, state_offset)?;
        let (nk, nv, dk, dv) = (sh.key_heads, sh.value_heads, sh.key_dim, sh.value_dim);
        ensure!(dk <= MAX_DELTA_KEY_DIM, "gated_delta_rule: key dim {dk} (at most {MAX_DELTA_KEY_DIM} on CUDA)");
        ensure!(nv <= MAX_GRID_YZ, "gated_delta_rule: {nv} value heads (at most {MAX_GRID_YZ} on CUDA)");
        check_seqs("gated_delta_rule", seqs, qkv.rows, state.rows)?;
        self.grow(out, qkv.rows, nv * dv)?;
        let io = Io { reads: vec![qkv.fptr(), a.fptr(), b.fptr(), state.fptr()], writes: vec![out.fptr(), state.fptr()], bf: Vec::new() };
        self.hy_run(io, |f| {
            if seqs.is_empty() || nv * dv == 0 || dk == 0 {
                return Ok(());
            }
            let mp = self.put_u32(&seq_meta(seqs))?;
            self.launch(f.gated_delta_rule)
                .grid((dv.div_ceil(16) as u32, nv as u32, seqs.len() as u32))
                .block(128)
                .ptr(qkv.fptr())
                .ptr(a.fptr())
                .ptr(b.fptr())
                .ptr(dt_bias.fptr())
                .ptr(decay.fptr())
                .ptr(state.fptr())
                .ptr(out.fptr())
                .ptr(mp)
                .int(nk)
                .int(nv)
                .int(dk)
                .int(dv)
                .f32(sh.l2_eps)
                .f32(sh.scale)
                .int(state.cols)
                .int(state_offset)
                .run()
        })
    }
}

impl SparseAttentionOps for Cuda {
    fn block_sparse_attention(
        &self,
        q: &CudaTensor,
        iq: &CudaTensor,
        kv: &CudaKv,
        layer: usize,
        index_layer: usize,
        seqs: &[AttnSeq<'_>],
        scale: f32,
        sel: &BlockSparse,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let (shape, heads, rows) = sel.check_call((q.rows, q.cols), (iq.rows, iq.cols), &kv.spec, layer, index_layer, seqs)?;
        let (hd, idim, ih) = (shape.head_dim, sel.index_dim, sel.index_heads);
        ensure!(
            hd <= MAX_SPARSE_HEAD_DIM && idim <= MAX_INDEX_DIM,
            "block_sparse_attention: head dims {hd} / {idim} (at most {MAX_SPARSE_HEAD_DIM} / {MAX_INDEX_DIM} on CUDA)"
        );
        ensure!(heads <= MAX_GRID_YZ, "block_sparse_attention: {heads} heads (at most {MAX_GRID_YZ} on CUDA)");
        ensure!(sel.topk <= MAX_TOPK, "block_sparse_attention: {} blocks kept (at most {MAX_TOPK} on CUDA)", sel.topk);
        let bt = kv.spec.block_tokens;
        self.grow(out, q.rows, q.cols)?;
        let io = Io { reads: vec![q.fptr(), iq.fptr()], writes: vec![out.fptr()], bf: vec![out.fptr()] };
        self.hy_run(io, |f| {
            if rows == 0 {
                return Ok(());
            }
            // Metadata: per sequence [q_start, q_len, kv_len, table offset],
            // per query row [sequence, i], then the block tables.
            let mut meta: Vec<u32> = Vec::with_capacity(4 * seqs.len() + 2 * rows);
            let mut bt_off = 0usize;
            for s in seqs {
                meta.extend([s.q_start as u32, s.q_len as u32, s.kv_len as u32, bt_off as u32]);
                bt_off += s.kv_len.div_ceil(bt);
            }
            let off_rows = meta.len();
            for (si, s) in seqs.iter().enumerate() {
                for i in 0..s.q_len {
                    meta.extend([si as u32, i as u32]);
                }
            }
            let off_bt = meta.len();
            for s in seqs {
                meta.extend_from_slice(&s.blocks[..s.kv_len.div_ceil(bt)]);
            }
            let mp = self.put_u32(&meta)?;
            let nbmax = seqs.iter().filter(|s| s.q_len > 0).map(|s| (s.kv_len - 1) / sel.block + 1).max().unwrap_or(1);
            let score_words = rows * ih * nbmax;
            let scratch = self.hy_scratch(4 * (score_words + rows * ih * sel.topk))?;
            let (scores, chosen) = (scratch, scratch + 4 * score_words as u64);
            self.launch(f.bsa_select)
                .grid((rows as u32, ih as u32, 1))
                .block(256)
                .ptr(iq.fptr())
                .int(iq.cols)
                .ptr(kv.k[index_layer].ptr)
                .ptr(mp)
                .int(off_rows)
                .int(off_bt)
                .int(bt)
                .int(idim)
                .int(sel.block)
                .int(sel.local)
                .int(sel.topk)
                .int(nbmax)
                .ptr(scores)
                .ptr(chosen)
                .run()?;
            self.launch(f.bsa_attend)
                .grid((rows as u32, heads as u32, 1))
                .block(128)
                .ptr(q.fptr())
                .int(q.cols)
                .ptr(kv.k[layer].ptr)
                .ptr(kv.v[layer].ptr)
                .ptr(mp)
                .int(off_rows)
                .int(off_bt)
                .int(bt)
                .int(hd)
                .int(shape.kv_heads * hd)
                .int(heads / shape.kv_heads)
                .int(heads / ih)
                .int(ih)
                .int(sel.block)
                .int(sel.topk)
                .ptr(chosen)
                .f32(scale)
                .ptr(out.fptr())
                .ptr(out.bptr())
                .run()
        })
    }
}
