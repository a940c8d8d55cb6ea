//! Causal attention over paged f16 KV, batched over sequences of any length.
//!
//! One task per (sequence, query row, query head); each keeps a running
//! max and sum (online softmax) so no score buffer is needed. The order of
//! the key loop depends only on the query's position, never on how the
//! batch was formed, so results are identical whatever the chunking.

use half::f16;

use super::{pool, CpuKv, CpuTensor, SendPtr};
use crate::AttnSeq;

const MAX_HEAD_DIM: usize = 512;

pub fn paged_attention(q: &CpuTensor, kv: &CpuKv, layer: usize, seqs: &[AttnSeq<'_>], scale: f32, softcap: Option<f32>, out: &mut CpuTensor) {
    let shape = kv.spec.layers[layer];
    let hd = shape.head_dim;
    assert!(hd <= MAX_HEAD_DIM, "head dim {hd} over {MAX_HEAD_DIM}");
    let heads = q.cols / hd;
    let group = heads / shape.kv_heads;
    let kv_w = shape.kv_heads * hd;
    let bt = kv.spec.block_tokens;
    let (kc, vc) = (&kv.k[layer], &kv.v[layer]);

    // Task t covers one (row, head); rows are numbered across sequences.
    let rows: usize = seqs.iter().map(|s| s.q_len).sum();
    let mut row_seq = Vec::with_capacity(rows);
    for (si, s) in seqs.iter().enumerate() {
        row_seq.extend((0..s.q_len).map(|i| (si, i)));
    }
    let optr = SendPtr(out.data.as_mut_ptr());
    let n_tasks = rows * heads;
    let workers = pool::threads().min(n_tasks).max(1);
    let body = |w: usize| {
        let (a, b) = (n_tasks * w / workers, n_tasks * (w + 1) / workers);
        let mut kf = [0f32; MAX_HEAD_DIM];
        let mut acc = [0f32; MAX_HEAD_DIM];
        for t in a..b {
            let (r, h) = (t / heads, t % heads);
            let (si, i) = row_seq[r];
            let s = &seqs[si];
            let qrow = s.q_start + i;
            let pos = s.kv_len - s.q_len + i;
            let lo = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let qv = &q.data[qrow * q.cols + h * hd..qrow * q.cols + (h + 1) * hd];
            let kvh = h / group;
            let acc = &mut acc[..hd];
            acc.fill(0.0);
            let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
            for j in lo..=pos {
                let slot = s.blocks[j / bt] as usize * bt + j % bt;
                let off = slot * kv_w + kvh * hd;
                let kf = &mut kf[..hd];
                for (d, x) in kf.iter_mut().zip(&kc[off..off + hd]) {
                    *d = x.to_f32();
                }
                let mut score = dot(qv, kf) * scale;
                if let Some(cap) = softcap {
                    score = cap * (score / cap).tanh();
                }
                let new_m = m.max(score);
                let corr = (m - new_m).exp();
                let p = (score - new_m).exp();
                l = l * corr + p;
                let vrow = &vc[off..off + hd];
                for (a, v) in acc.iter_mut().zip(vrow) {
                    *a = *a * corr + p * f16::to_f32(*v);
                }
                m = new_m;
            }
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
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums let the compiler vectorise without reassociating.
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
