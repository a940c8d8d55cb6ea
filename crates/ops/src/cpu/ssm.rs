//! Mamba2's selective scan, one token at a time per sequence.
//!
//! The recurrence runs step by step (no chunked matrix form), so a row's
//! result is the same whatever chunk it arrived in: prefill and decode agree
//! bit for bit.

use anyhow::Result;

use super::{pool, CpuTensor, SendPtr};
use crate::{checks, SsmShape, StateSeq};

#[allow(clippy::too_many_arguments)]
pub fn ssm_scan(
    xbc: &CpuTensor,
    dt: &CpuTensor,
    dt_bias: &CpuTensor,
    a: &CpuTensor,
    d: &CpuTensor,
    sh: &SsmShape,
    state: &mut CpuTensor,
    state_offset: usize,
    seqs: &[StateSeq],
    out: &mut CpuTensor,
) -> Result<()> {
    let (nh, hd, n, g) = (sh.heads, sh.head_dim, sh.state_dim, sh.groups);
    let lens = [("dt_bias", dt_bias.data.len()), ("a", a.data.len()), ("d", d.data.len())];
    checks::ssm_scan(sh, (xbc.rows, xbc.cols), (dt.rows, dt.cols), lens, state.cols, state_offset)?;
    checks::state_seqs(seqs, xbc.rows, state.rows)?;
    let inner = nh * hd;
    let per_head = hd * n;
    out.resize(xbc.rows, inner);

    let optr = SendPtr(out.data.as_mut_ptr());
    let sptr = SendPtr(state.data.as_mut_ptr());
    let scols = state.cols;
    let heads_per_group = nh / g;
    let n_tasks = seqs.len() * nh;
    let workers = pool::threads().min(n_tasks).max(1);
    let body = |w: usize| {
        for task in n_tasks * w / workers..n_tasks * (w + 1) / workers {
            let (s, h) = (&seqs[task / nh], task % nh);
            let gi = h / heads_per_group;
            // Safety: one task per (sequence, head), so the state block and
            // the output columns written here are this task's alone.
            let st = unsafe { sptr.slice(s.slot as usize * scols + state_offset + h * per_head, per_head) };
            let (a, dh) = (a.data[h], d.data[h]);
            for t in s.start..s.start + s.len {
                let row = xbc.row(t);
                let x = &row[h * hd..(h + 1) * hd];
                let b = &row[inner + gi * n..inner + (gi + 1) * n];
                let c = &row[inner + g * n + gi * n..inner + g * n + (gi + 1) * n];
                let step = softplus(dt.data[t * nh + h] + dt_bias.data[h]).clamp(sh.dt_min, sh.dt_max);
                let decay = (step * a).exp();
                let y = unsafe { optr.slice(t * inner + h * hd, hd) };
                for (p, (yp, &xp)) in y.iter_mut().zip(x).enumerate() {
                    let sp = &mut st[p * n..(p + 1) * n];
                    let dx = step * xp;
                    let mut acc = 0f32;
                    for ((sv, &bv), &cv) in sp.iter_mut().zip(b).zip(c) {
                        *sv = decay * *sv + dx * bv;
                        acc += *sv * cv;
                    }
                    *yp = acc + dh * xp;
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

/// `ln(1 + eˣ)`, linear past 20 as in PyTorch.
pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}
