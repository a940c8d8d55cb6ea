//! Elementwise ops and grouped norms of the hybrid families.

use anyhow::{ensure, Result};

use super::{par_rows, CpuTensor, SendPtr};

pub fn silu(x: &mut CpuTensor) {
    x.data.iter_mut().for_each(|v| *v = silu1(*v));
}

pub fn relu2(x: &mut CpuTensor) {
    x.data.iter_mut().for_each(|v| {
        let r = v.max(0.0);
        *v = r * r;
    });
}

/// `out = gate * up`.
pub fn mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    out.iter_mut().zip(gate.iter().zip(up)).for_each(|(o, (g, u))| *o = u * g);
}

/// `out = sigmoid(gate) * up`.
pub fn sigmoid_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    out.iter_mut().zip(gate.iter().zip(up)).for_each(|(o, (g, u))| *o = u * sigmoid(*g));
}

pub fn group_rms_norm(x: &CpuTensor, w: &CpuTensor, group: usize, eps: f32, out: &mut CpuTensor) -> Result<()> {
    ensure!(w.cols == x.cols, "group_rms_norm: weight of {} for rows of {}", w.cols, x.cols);
    ensure!(group > 0 && x.cols.is_multiple_of(group), "group_rms_norm: groups of {group} do not divide rows of {}", x.cols);
    out.resize(x.rows, x.cols);
    let optr = SendPtr(out.data.as_mut_ptr());
    let cols = x.cols;
    par_rows(x.rows, &|range| {
        for r in range {
            let dst = unsafe { optr.slice(r * cols, cols) };
            for ((d, s), w) in dst.chunks_exact_mut(group).zip(x.row(r).chunks_exact(group)).zip(w.data.chunks_exact(group)) {
                let ss: f32 = s.iter().map(|v| v * v).sum::<f32>() / group as f32;
                let inv = 1.0 / (ss + eps).sqrt();
                for ((d, s), w) in d.iter_mut().zip(s).zip(w) {
                    *d = s * inv * w;
                }
            }
        }
    });
    Ok(())
}

pub fn swiglu_clamped(gate: &CpuTensor, up: &CpuTensor, limit: f32, alpha: f32, out: &mut CpuTensor) {
    for ((o, g), u) in out.data.iter_mut().zip(&gate.data).zip(&up.data) {
        let g = g.min(limit);
        let u = u.clamp(-limit, limit);
        *o = (u + 1.0) * g * sigmoid(alpha * g);
    }
}

pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub(crate) fn silu1(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}
