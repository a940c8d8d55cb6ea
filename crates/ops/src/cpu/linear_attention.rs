//! Linear ("lightning") attention with a per-head decay (MiniMax-Text-01),
//! run as its recurrence one token at a time: `S = e^(-slope)·S + kᵀv`,
//! `o = q·S`. Stepwise, so results do not depend on chunking.

use anyhow::Result;

use super::{pool, CpuTensor, SendPtr};
use crate::{checks, StateSeq};

#[allow(clippy::too_many_arguments)]
pub fn linear_attention(
    qkv: &CpuTensor,
    slopes: &CpuTensor,
    heads: usize,
    hd: usize,
    state: &mut CpuTensor,
    state_offset: usize,
    seqs: &[StateSeq],
    out: &mut CpuTensor,
) -> Result<()> {
    checks::linear_attention(qkv.cols, slopes.data.len(), heads, hd, state.cols, state_offset)?;
    let per_head = hd * hd;
    checks::state_seqs(seqs, qkv.rows, state.rows)?;
    let width = heads * hd;
    out.resize(qkv.rows, width);

    let optr = SendPtr(out.data.as_mut_ptr());
    let sptr = SendPtr(state.data.as_mut_ptr());
    let scols = state.cols;
    let n_tasks = seqs.len() * heads;
    let workers = pool::threads().min(n_tasks).max(1);
    let body = |w: usize| {
        for task in n_tasks * w / workers..n_tasks * (w + 1) / workers {
            let (s, h) = (&seqs[task / heads], task % heads);
            let decay = (-slopes.data[h]).exp();
            // Safety: one task per (sequence, head) owns this state block and
            // these output columns.
            let st = unsafe { sptr.slice(s.slot as usize * scols + state_offset + h * per_head, per_head) };
            for t in s.start..s.start + s.len {
                let r = &qkv.row(t)[h * 3 * hd..(h + 1) * 3 * hd];
                let (q, k, v) = (&r[..hd], &r[hd..2 * hd], &r[2 * hd..]);
                // S[i][j] += k[i] v[j] after the decay; o[j] = Σ_i q[i] S[i][j].
                let o = unsafe { optr.slice(t * width + h * hd, hd) };
                o.fill(0.0);
                for i in 0..hd {
                    let si = &mut st[i * hd..(i + 1) * hd];
                    let (ki, qi) = (k[i], q[i]);
                    for ((sv, &vj), oj) in si.iter_mut().zip(v).zip(o.iter_mut()) {
                        *sv = decay * *sv + ki * vj;
                        *oj += qi * *sv;
                    }
                }
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
