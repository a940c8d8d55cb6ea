//! Block-sparse causal attention (MiniMax-M3's sparse layers) over paged KV.
//!
//! First, per query row and indexer head, an indexer picks key blocks: the
//! local ones, and the best others by the largest indexer score among
//! their visible keys. Then each query head attends (online softmax, keys in
//! position order) to the keys of its indexer head's blocks. Both depend only
//! on the query's position and the keys before it, never on the batch.

use anyhow::{ensure, Result};
use half::f16;

use super::{pool, Cpu, CpuKv, CpuTensor, SendPtr};
use crate::{AttnSeq, BlockSparse, KvDtype, SparseAttentionOps};

/// One KV layer's keys or values, as the pool stores them.
#[derive(Clone, Copy)]
enum Rows<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl Rows<'_> {
    fn k(kv: &CpuKv, layer: usize) -> Rows<'_> {
        match kv.dtype {
            KvDtype::F16 => Rows::F16(&kv.k[layer]),
            KvDtype::F32 => Rows::F32(&kv.k32[layer]),
        }
    }
    fn v(kv: &CpuKv, layer: usize) -> Rows<'_> {
        match kv.dtype {
            KvDtype::F16 => Rows::F16(&kv.v[layer]),
            KvDtype::F32 => Rows::F32(&kv.v32[layer]),
        }
    }
    /// `dst.len()` values from `off`, as f32.
    fn load(&self, off: usize, dst: &mut [f32]) {
        let n = dst.len();
        match self {
            Rows::F16(r) => {
                for (d, x) in dst.iter_mut().zip(&r[off..off + n]) {
                    *d = x.to_f32();
                }
            }
            Rows::F32(r) => dst.copy_from_slice(&r[off..off + n]),
        }
    }
}

const MAX_HEAD_DIM: usize = 512;

impl SparseAttentionOps for Cpu {
    fn block_sparse_attention(
        &self,
        q: &CpuTensor,
        iq: &CpuTensor,
        kv: &CpuKv,
        layer: usize,
        index_layer: usize,
        seqs: &[AttnSeq<'_>],
        scale: f32,
        sel: &BlockSparse,
        out: &mut CpuTensor,
    ) -> Result<()> {
        let (shape, heads, rows) = sel.check_call((q.rows, q.cols), (iq.rows, iq.cols), &kv.spec, layer, index_layer, seqs)?;
        let (hd, idim, ih) = (shape.head_dim, sel.index_dim, sel.index_heads);
        ensure!(hd <= MAX_HEAD_DIM && idim <= MAX_HEAD_DIM, "block_sparse_attention: head dims {hd} / {idim} over {MAX_HEAD_DIM}");
        let bt = kv.spec.block_tokens;
        out.resize(q.rows, q.cols);

        let mut row_seq = Vec::with_capacity(rows);
        for (si, s) in seqs.iter().enumerate() {
            row_seq.extend((0..s.q_len).map(|i| (si, i)));
        }
        let slot = |s: &AttnSeq<'_>, j: usize| s.blocks[j / bt] as usize * bt + j % bt;

        // Phase 1: the kept blocks of every (row, indexer head), ascending;
        // `usize::MAX` pads when fewer blocks exist than `topk`.
        let k_keep = sel.topk;
        let mut chosen = vec![usize::MAX; rows * ih * k_keep];
        let cptr = SendPtr(chosen.as_mut_ptr());
        let ik = Rows::k(kv, index_layer);
        let n_sel = rows * ih;
        let workers = pool::threads().min(n_sel).max(1);
        let select = |w: usize| {
            let mut scores: Vec<(f32, usize)> = Vec::new();
            let mut kf = [0f32; MAX_HEAD_DIM];
            for t in n_sel * w / workers..n_sel * (w + 1) / workers {
                let (r, h) = (t / ih, t % ih);
                let (si, i) = row_seq[r];
                let s = &seqs[si];
                let pos = s.kv_len - s.q_len + i;
                let qrow = s.q_start + i;
                let qv = &iq.data[qrow * iq.cols + h * idim..qrow * iq.cols + (h + 1) * idim];
                let qb = pos / sel.block;
                // Safety: one task per (row, indexer head) owns its `topk` entries.
                let dst = unsafe { cptr.slice(t * k_keep, k_keep) };
                let mut n = 0;
                for l in 0..sel.local {
                    let b = qb.saturating_sub(l);
                    if n < k_keep && !dst[..n].contains(&b) {
                        dst[n] = b;
                        n += 1;
                    }
                }
                let locals = n;
                scores.clear();
                for b in 0..=qb {
                    if dst[..locals].contains(&b) {
                        continue;
                    }
                    let mut best = f32::NEG_INFINITY;
                    for j in b * sel.block..((b + 1) * sel.block).min(pos + 1) {
                        let off = slot(s, j) * idim;
                        let kf = &mut kf[..idim];
                        ik.load(off, kf);
                        best = best.max(dot(qv, kf));
                    }
                    scores.push((best, b));
                }
                // Best first; equal scores keep the earlier block.
                scores.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
                for &(_, b) in scores.iter().take(k_keep - n) {
                    dst[n] = b;
                    n += 1;
                }
                dst[..n].sort_unstable();
            }
        };
        if workers == 1 {
            select(0);
        } else {
            pool::parallel_for(workers, &select);
        }

        // Phase 2: attention over the kept blocks.
        let (kc, vc) = (Rows::k(kv, layer), Rows::v(kv, layer));
        let kv_w = shape.kv_heads * hd;
        let group = heads / shape.kv_heads;
        let per_index = heads / ih;
        let optr = SendPtr(out.data.as_mut_ptr());
        let n_tasks = rows * heads;
        let workers = pool::threads().min(n_tasks).max(1);
        let chosen = &chosen;
        let body = |w: usize| {
            let mut kf = [0f32; MAX_HEAD_DIM];
            let mut vf = [0f32; MAX_HEAD_DIM];
            let mut acc = [0f32; MAX_HEAD_DIM];
            for t in n_tasks * w / workers..n_tasks * (w + 1) / workers {
                let (r, h) = (t / heads, t % heads);
                let (si, i) = row_seq[r];
                let s = &seqs[si];
                let qrow = s.q_start + i;
                let pos = s.kv_len - s.q_len + i;
                let qv = &q.data[qrow * q.cols + h * hd..qrow * q.cols + (h + 1) * hd];
                let kvh = h / group;
                let blocks = &chosen[(r * ih + h / per_index) * k_keep..(r * ih + h / per_index + 1) * k_keep];
                let acc = &mut acc[..hd];
                acc.fill(0.0);
                let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                for &b in blocks.iter().take_while(|&&b| b != usize::MAX) {
                    for j in b * sel.block..((b + 1) * sel.block).min(pos + 1) {
                        let off = slot(s, j) * kv_w + kvh * hd;
                        let kf = &mut kf[..hd];
                        kc.load(off, kf);
                        let score = dot(qv, kf) * scale;
                        let new_m = m.max(score);
                        let corr = (m - new_m).exp();
                        let p = (score - new_m).exp();
                        l = l * corr + p;
                        let vf = &mut vf[..hd];
                        vc.load(off, vf);
                        for (a, v) in acc.iter_mut().zip(vf.iter()) {
                            *a = *a * corr + p * v;
                        }
                        m = new_m;
                    }
                }
                // Safety: one task per (row, head) owns these output values.
                let dst = unsafe { optr.slice(qrow * q.cols + h * hd, hd) };
                let inv = 1.0 / l;
                for (d, a) in dst.iter_mut().zip(acc.iter()) {
                    *d = a * inv;
                }
            }
        };
        if workers == 1 {
            body(0);
        } else {
            pool::parallel_for(workers, &body);
        }
        Ok(())
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            s[k] += x[k] * y[k];
        }
    }
    let mut t: f32 = s.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        t += x * y;
    }
    t
}
