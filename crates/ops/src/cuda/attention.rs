//! Paged attention over the bf16 KV pool: a split-KV decode kernel (its
//! splits merged by a combine launch, or inside a thread-block cluster on
//! Hopper), and a tensor-core prefill kernel for prompt chunks. One NVRTC
//! module per (head dim, query heads per KV head), compiled on first use.
//!
//! `try_attention` is the `Device` op, run through `Cuda::op`; recorded in a
//! forward, it uploads its metadata now and its launches run with the forward.

use std::collections::HashMap;

use anyhow::{anyhow, ensure, Result};

use super::exec::Io;
use super::rt::{self, DevBuf};
use super::{kernels, Cuda, CudaKv, CudaTensor};
use crate::AttnSeq;

/// Query rows per block of the prefill attention kernel (PF_BQ).
const PREFILL_ROWS: usize = 64;
/// Most key splits of a chunk's cluster (`PF_CL_MAX` in attention.cu,
/// defined from this: the merge's register arrays are this long).
pub(super) const PF_CL_MAX: usize = 8;

#[derive(Clone, Copy)]
pub(super) struct AttnFns {
    decode: usize,
    /// The decode kernel whose key splits merge inside a thread-block
    /// cluster (Hopper on): no combine launch.
    decode_cl: Option<usize>,
    /// The decode kernel reading keys into registers, a few lanes a key,
    /// and its cluster form (where it is on and the shape allows: `lanes_fit`).
    lanes: Option<(usize, Option<usize>)>,
    combine: usize,
    prefill: Option<usize>,
    /// The prefill kernel whose key splits merge inside a cluster (Hopper
    /// on, head dim 128 at most): no combine launch.
    prefill_cl: Option<usize>,
    prefill_combine: usize,
}

/// One attention op's operands but its output.
#[derive(Clone, Copy)]
struct Call<'a, 's> {
    q: &'a CudaTensor,
    kv: &'a CudaKv,
    layer: usize,
    seqs: &'a [AttnSeq<'s>],
    scale: f32,
    softcap: Option<f32>,
}

/// The modules compiled so far, and the split-KV scratch.
pub(super) struct Attn {
    fns: HashMap<(usize, usize), AttnFns>,
    /// Three: a chunk's attention, a short chunk's and the decode rows'
    /// run side by side.
    part: [DevBuf; 3],
}

impl Attn {
    pub fn new(ctx: usize) -> Attn {
        Attn { fns: HashMap::new(), part: [DevBuf::empty(ctx), DevBuf::empty(ctx), DevBuf::empty(ctx)] }
    }
}

impl Cuda {
    /// Compiled-kernel check: build the attention kernels for a shape now
    /// (so a compile error shows here, not inside a forward).
    pub fn prepare_attention(&self, head_dim: usize, group: usize) -> Result<()> {
        rt::make_current(self.ctx())?;
        self.attn_fns(head_dim, group).map(|_| ())
    }

    fn attn_fns(&self, hd: usize, g: usize) -> Result<AttnFns> {
        if let Some(a) = self.st().attn.fns.get(&(hd, g)) {
            return Ok(*a);
        }
        let m = rt::compile_and_load(&kernels::attention_source(&self.inner.tuning, hd, g), &self.inner.arch)?;
        // A decode kernel's cluster form (Hopper on), allowed past 8 blocks where asked.
        let clustered = |name: &str| -> Result<Option<usize>> {
            if self.inner.cc.0 < 9 || !self.inner.tuning.attn_cluster {
                return Ok(None);
            }
            let f = m.func(name)?;
            if self.inner.tuning.attn_cluster_max > 8 {
                rt::allow_large_clusters(f)?;
            }
            Ok(Some(f))
        };
        let f = AttnFns {
            decode: m.func("attn_decode")?,
            decode_cl: clustered("attn_decode_cl")?,
            lanes: if lanes_fit(&self.inner.tuning, hd, g) { Some((m.func("attn_decode_lanes")?, clustered("attn_decode_lanes_cl")?)) } else { None },
            combine: m.func("attn_combine")?,
            // Past head dim 256 every row takes the decode kernel (see attention.cu).
            prefill: if self.inner.cc.0 >= 8 && hd <= 256 { Some(m.func("attn_prefill")?) } else { None },
            prefill_combine: if self.inner.cc.0 >= 8 && hd <= 256 { m.func("attn_prefill_combine")? } else { 0 },
            prefill_cl: if self.inner.cc.0 >= 9 && hd <= 128 && self.inner.tuning.attn_cluster { Some(m.func("attn_prefill_cl")?) } else { None },
        };
        let mut st = self.st();
        st.prof.names.insert(f.decode, format!("attn_decode hd{hd} g{g}"));
        if let Some(c) = f.decode_cl {
            st.prof.names.insert(c, format!("attn_decode_cl hd{hd} g{g}"));
        }
        if let Some((l, cl)) = f.lanes {
            st.prof.names.insert(l, format!("attn_decode_lanes hd{hd} g{g}"));
            if let Some(c) = cl {
                st.prof.names.insert(c, format!("attn_decode_lanes_cl hd{hd} g{g}"));
            }
        }
        st.prof.names.insert(f.combine, format!("attn_combine hd{hd}"));
        if let Some(p) = f.prefill {
            st.prof.names.insert(p, format!("attn_prefill hd{hd} g{g}"));
            st.prof.names.insert(f.prefill_combine, format!("attn_prefill_combine hd{hd}"));
        }
        if let Some(c) = f.prefill_cl {
            st.prof.names.insert(c, format!("attn_prefill_cl hd{hd} g{g}"));
        }
        st.attn.fns.insert((hd, g), f);
        Ok(f)
    }

    /// The split-KV scratch, at least `need` bytes (the launches that use
    /// it run one after another on the stream). Made once at the most any
    /// split launch asks: a split runs fewer than twice
    /// `attn_prefill_blocks_per_sm` (4 by default) blocks an SM (prefill,
    /// of 64 rows each; decode, 16 heads a KV head at most, fewer than 8),
    /// so it never moves. Grown on demand, the first 445-row chunk after
    /// start-up moved it, and every chunk size the warm-up recorded was
    /// recorded again in the next pass (2–7 ms gaps on the H200).
    fn attn_part(&self, scratch: usize, need: usize) -> Result<u64> {
        let most = PREFILL_ROWS * (2 * self.inner.tuning.attn_prefill_blocks_per_sm).max(4) * self.inner.sms * (256 + 2) * 4;
        let mut st = self.st();
        let part = &mut st.attn.part[scratch];
        if part.bytes < need {
            *part = DevBuf::new(self.ctx(), need.max(most))?;
        }
        Ok(part.ptr)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_attention(
        &self,
        q: &CudaTensor,
        kv: &CudaKv,
        layer: usize,
        seqs: &[AttnSeq<'_>],
        scale: f32,
        softcap: Option<f32>,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.other(|| {
            self.attention_cmds(Call { q, kv, layer, seqs, scale, softcap }, out)?;
            Ok(Io { reads: vec![q.fptr()], writes: vec![out.fptr()], bf: vec![out.fptr()] })
        })
    }

    fn attention_cmds(&self, c: Call<'_, '_>, out: &mut CudaTensor) -> Result<()> {
        let Call { q, kv, layer, seqs, .. } = c;
        let shape = *kv.spec.layers.get(layer).ok_or_else(|| anyhow!("attention: layer {layer} not in the KV pool"))?;
        let (hd, kvh) = (shape.head_dim, shape.kv_heads);
        ensure!(hd % 16 == 0 && hd <= 512, "attention: head dim {hd} is not supported on CUDA (a multiple of 16, at most 512)");
        ensure!(q.cols.is_multiple_of(hd), "attention: q is {} wide, not a multiple of head dim {hd}", q.cols);
        let heads = q.cols / hd;
        let most_g = if hd > 256 { 8 } else { 16 };
        ensure!(heads.is_multiple_of(kvh) && heads / kvh <= most_g, "attention: {heads} query heads over {kvh} KV heads of {hd} is not supported");
        let g = heads / kvh;
        self.grow(out, q.rows, q.cols)?;
        let max_q = seqs.iter().map(|s| s.q_len).max().unwrap_or(0);
        if max_q == 0 {
            return Ok(());
        }
        let few = self.few_rows(kvh);
        let fns = self.attn_fns(hd, g)?;
        // The rows by kernel: a prompt chunk past `few` rows (the prefill
        // kernel), a short chunk's (the tiled decode kernel), decode rows.
        // A round sharing its forward with a chunk runs them as launches
        // side by side (they write other rows of `out`; each has its own
        // split scratch): one prefill block walking a long context alone
        // would stall the decode rows, and a short chunk's rows beside
        // them would take their launch past the lanes kernel's pairs.
        let long = |s: &AttnSeq<'_>| fns.prefill.is_some() && s.q_len > few;
        let singles = seqs.iter().filter(|s| s.q_len == 1).count();
        let apart = fns.lanes.is_some() && singles * kvh <= self.inner.tuning.attn_decode_lanes_pairs;
        let mut groups: [Vec<AttnSeq<'_>>; 3] = Default::default();
        for s in seqs.iter().filter(|s| s.q_len > 0) {
            let at = if long(s) {
                0
            } else if apart && s.q_len == 1 {
                2
            } else {
                1
            };
            groups[at].push(*s);
        }
        if groups.iter().filter(|g| !g.is_empty()).count() < 2 {
            return self.attention_launches(c, out, 0);
        }
        let o = &*out;
        let mut launches: Vec<_> = groups
            .iter()
            .enumerate()
            .filter(|(_, g)| !g.is_empty())
            .map(|(scratch, group)| move || self.attention_launches(Call { seqs: group, ..c }, o, scratch))
            .collect();
        let mut parts: Vec<&mut dyn FnMut() -> Result<()>> = launches.iter_mut().map(|l| l as &mut dyn FnMut() -> Result<()>).collect();
        self.branches(&mut parts)
    }

    /// Up to how many query rows a sequence takes the split-KV decode
    /// kernel, a row per work item: a short prompt chunk at a long context,
    /// in the prefill kernel, is a few blocks walking every key. With few
    /// KV heads the decode kernel keeps more rows (up to 128 rows x KV
    /// heads, 32 rows at most): its blocks take a row and KV head, the
    /// prefill kernel's a tile and query head, and each walks its share of
    /// the keys alone.
    fn few_rows(&self, kv_heads: usize) -> usize {
        let t = &self.inner.tuning;
        (t.attn_prefill_from.max(2) - 1).max((128 / kv_heads.max(1)).min(t.attn_decode_max_rows))
    }

    /// The launches of [`Self::attention_cmds`] for `seqs`, all of one
    /// kind (decode rows, or prompt chunks past [`Self::few_rows`]), with
    /// split scratch `scratch` (0-2: launches side by side need their own).
    fn attention_launches(&self, c: Call<'_, '_>, out: &CudaTensor, scratch: usize) -> Result<()> {
        let Call { q, kv, layer, seqs, scale, softcap } = c;
        let shape = kv.spec.layers[layer];
        let (hd, kvh) = (shape.head_dim, shape.kv_heads);
        let heads = q.cols / hd;
        let g = heads / kvh;
        let fns = self.attn_fns(hd, g)?;
        let (f_dec, f_comb, f_pre) = (fns.decode, fns.combine, fns.prefill);
        let bt = kv.spec.block_tokens;
        let max_q = seqs.iter().map(|s| s.q_len).max().unwrap_or(0);
        let prefill = f_pre.is_some() && max_q > self.few_rows(kvh);
        // Metadata: per sequence [q_start, q_len, kv_len, window, table offset],
        // then the work list (rows, or tiles of 64 packed rows: a packed row
        // is a query row and one of its KV head's g query heads), then the
        // block tables.
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
                for t in (0..s.q_len * g).step_by(PREFILL_ROWS) {
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
        // Both kernels open with the query and the paged cache (the grid and
        // block are set apart from the arguments, so the order is free).
        let paged = |f: usize| self.launch(f).ptr(q.fptr()).int(q.cols).ptr(kc).ptr(vc).i32(kv_w).int(bt).ptr(mp).int(off_list).int(off_bt);
        // A split launch's merge: one block of hd threads per (item, head):
        // a decode row and query head, or a packed tile row and KV head.
        let combine = |f: usize, items: usize, heads: usize, nsplit: usize, part: u64| {
            let out_ptrs = (out.fptr(), out.bptr());
            self.launch(f)
                .grid((items as u32, heads as u32, 1))
                .block(hd as u32)
                .ptr(part)
                .ptr(mp)
                .int(off_list)
                .int(nsplit)
                .int(heads)
                .int(q.cols)
                .ptr(out_ptrs.0)
                .ptr(out_ptrs.1)
                .run()
        };
        if prefill {
            let f = f_pre.unwrap_or(f_dec);
            // Split the keys when the tiles alone leave the GPU mostly idle.
            // The count depends on the shape only (a split past the keys
            // walks none), so a recorded chunk's graph serves every position.
            // A tile and KV head's splits as one cluster (at most
            // PF_CL_MAX blocks) merge in shared memory.
            let ctas = work * kvh;
            let max = if fns.prefill_cl.is_some() { self.inner.tuning.attn_prefill_splits.min(PF_CL_MAX) } else { self.inner.tuning.attn_prefill_splits };
            let nsplit = (self.inner.tuning.attn_prefill_blocks_per_sm * self.inner.sms).div_ceil(ctas.max(1)).clamp(1, max.max(1));
            let cluster = fns.prefill_cl.filter(|_| nsplit > 1);
            let part = if nsplit > 1 && cluster.is_none() { self.attn_part(scratch, work * PREFILL_ROWS * kvh * nsplit * (hd + 2) * 4)? } else { 0 };
            let grid = if cluster.is_some() { (nsplit as u32, kvh as u32, work as u32) } else { (work as u32, kvh as u32, nsplit as u32) };
            paged(cluster.unwrap_or(f))
                .grid(grid)
                .block(128)
                .cluster(if cluster.is_some() { nsplit as u32 } else { 1 })
                .f32(scale)
                .f32(cap)
                .ptr(out.fptr())
                .ptr(out.bptr())
                .int(nsplit)
                .ptr(part)
                .run()?;
            if nsplit > 1 && cluster.is_none() {
                combine(fns.prefill_combine, work * PREFILL_ROWS, kvh, nsplit, part)?;
            }
        } else {
            // Split the keys so the launch fills the GPU; the split count
            // depends on the batch shape only, so graphs stay valid as
            // sequences grow. (Not splitting short contexts was tried: one
            // block per KV head walking 200 keys took 14.8 µs against 6.4 +
            // 4.2 for the split and its combine.)
            let ctas = work * kvh;
            // A row and KV head's splits as one cluster (at most
            // `attn_cluster_max` blocks) merge in shared memory.
            let max = if fns.decode_cl.is_some() {
                self.inner.tuning.attn_max_splits.min(self.inner.tuning.attn_cluster_max)
            } else {
                self.inner.tuning.attn_max_splits
            };
            let nsplit = (4 * self.inner.sms).div_ceil(ctas.max(1)).clamp(1, max);
            // Few (row, KV head) pairs: the lanes kernel (tuning.rs says why).
            let (plain, cluster, threads) = match fns.lanes.filter(|_| ctas <= self.inner.tuning.attn_decode_lanes_pairs) {
                Some((f, cl)) => (f, cl, 32 * self.inner.tuning.attn_decode_warps as u32),
                None => (f_dec, fns.decode_cl, 128),
            };
            let cluster = cluster.filter(|_| nsplit > 1);
            let part = if nsplit > 1 && cluster.is_none() { self.attn_part(scratch, work * heads * nsplit * (hd + 2) * 4)? } else { 0 };
            paged(cluster.unwrap_or(plain))
                .grid((nsplit as u32, kvh as u32, work as u32))
                .block(threads)
                .cluster(if cluster.is_some() { nsplit as u32 } else { 1 })
                .int(nsplit)
                .f32(scale)
                .f32(cap)
                .int(heads)
                .ptr(out.fptr())
                .ptr(out.bptr())
                .ptr(part)
                .run()?;
            if nsplit > 1 && cluster.is_none() {
                combine(f_comb, work, heads, nsplit, part)?;
            }
        }
        Ok(())
    }
}

/// Whether `attn_decode_lanes` is on (warps a block, and launches that
/// may take it) and serves a head dim and group (its `#if` in
/// attention.cu): a key's row over a power-of-two count of lanes, the
/// query heads' values in registers, the warps' partials in 48 KB.
fn lanes_fit(t: &super::Tuning, hd: usize, g: usize) -> bool {
    t.attn_decode_warps > 0 && t.attn_decode_lanes_pairs > 0 && hd.is_power_of_two() && (16..=256).contains(&hd) && g <= 8 && g * hd <= 1024
}
