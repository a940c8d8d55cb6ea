//! The gated delta rule (Gated DeltaNet), run as its recurrence one token
//! at a time per sequence and value head: `S = e^g·S`,
//! `S += k ⊗ β(v − Sᵀk)`, `o = Sᵀq`, with q and k L2-normalised. Stepwise
//! (no chunked matrix form), so a row's result is the same whatever chunk
//! it arrived in.

use anyhow::Result;

use super::ssm::softplus;
use super::{pool, CpuTensor, SendPtr};
use crate::{checks, DeltaShape, StateSeq};

#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    qkv: &CpuTensor,
    a: &CpuTensor,
    b: &CpuTensor,
    dt_bias: &CpuTensor,
    decay: &CpuTensor,
    sh: &DeltaShape,
    state: &mut CpuTensor,
    state_offset: usize,
    seqs: &[StateSeq],
    out: &mut CpuTensor,
) -> Result<()> {
    let ab = [("a", (a.rows, a.cols)), ("b", (b.rows, b.cols))];
    let lens = [("dt_bias", dt_bias.data.len()), ("decay", decay.data.len())];
    checks::gated_delta_rule(sh, (qkv.rows, qkv.cols), ab, lens, state.cols, state_offset)?;
    checks::state_seqs(seqs, qkv.rows, state.rows)?;
    let (nk, nv, dk, dv) = (sh.key_heads, sh.value_heads, sh.key_dim, sh.value_dim);
    let width = nv * dv;
    let per_head = dk * dv;
    out.resize(qkv.rows, width);

    let optr = SendPtr(out.data.as_mut_ptr());
    let sptr = SendPtr(state.data.as_mut_ptr());
    let scols = state.cols;
    let per_key = nv / nk;
    let n_tasks = seqs.len() * nv;
    let workers = pool::threads().min(n_tasks).max(1);
    let body = |w: usize| {
        let (mut q, mut k, mut kv) = (vec![0f32; dk], vec![0f32; dk], vec![0f32; dv]);
        for task in n_tasks * w / workers..n_tasks * (w + 1) / workers {
            let (s, h) = (&seqs[task / nv], task % nv);
            let kh = h / per_key;
            // Safety: one task per (sequence, value head) owns this state
            // block and these output columns.
            let st = unsafe { sptr.slice(s.slot as usize * scols + state_offset + h * per_head, per_head) };
            for t in s.start..s.start + s.len {
                let row = qkv.row(t);
                l2_normalised(&row[kh * dk..(kh + 1) * dk], sh.l2_eps, sh.scale, &mut q);
                l2_normalised(&row[(nk + kh) * dk..(nk + kh + 1) * dk], sh.l2_eps, 1.0, &mut k);
                let v = &row[2 * nk * dk + h * dv..2 * nk * dk + (h + 1) * dv];
                let g = (decay.data[h] * softplus(a.data[t * nv + h] + dt_bias.data[h])).exp();
                let beta = 1.0 / (1.0 + (-b.data[t * nv + h]).exp());
                // Decay S, and read what it holds for k: kv[j] = Σ_i S[i][j] k[i].
                kv.fill(0.0);
                for (si, &ki) in st.chunks_exact_mut(dv).zip(&k) {
                    for (sv, kj) in si.iter_mut().zip(kv.iter_mut()) {
                        *sv *= g;
                        *kj += *sv * ki;
                    }
                }
                // kv becomes the correction β(v − kv), written along k; o[j] = Σ_i S[i][j] q[i].
                for (kj, &vj) in kv.iter_mut().zip(v) {
                    *kj = beta * (vj - *kj);
                }
                let o = unsafe { optr.slice(t * width + h * dv, dv) };
                o.fill(0.0);
                for ((si, &ki), &qi) in st.chunks_exact_mut(dv).zip(&k).zip(&q) {
                    for ((sv, &dj), oj) in si.iter_mut().zip(&kv).zip(o.iter_mut()) {
                        *sv += ki * dj;
                        *oj += *sv * qi;
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

/// `x / √(Σx² + eps) · scale` into `out`.
fn l2_normalised(x: &[f32], eps: f32, scale: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = scale / (ss + eps).sqrt();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v * inv;
    }
}
