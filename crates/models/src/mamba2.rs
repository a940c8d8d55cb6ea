//! The Mamba2 mixer Nemotron-H and Granite 4 share:
//! `z, xBC, dt = in_proj(h)`; `xBC = silu(conv(xBC))` (a causal depthwise
//! filter over time); the selective scan over heads, with B and C shared by
//! groups of heads; `y ⊙ silu(z)` normalised per channel group; `out_proj`.
//! Its state: the conv's last `kernel - 1` inputs and the scan's matrix per
//! head.

use anyhow::{ensure, Result};
use braid_ops::{Act, Device, RecurrentOps, SsmShape, StateSeq};

use crate::moe::slice_rows;
use crate::recurrent::{extras, StateLayout};
use crate::source::Source;
use crate::Scratch;

/// A Mamba2 layer's sizes.
#[derive(Clone, Debug)]
pub struct Mamba2Shape {
    pub hidden: usize,
    pub ssm: SsmShape,
    pub conv_kernel: usize,
    /// The gated norm's epsilon.
    pub eps: f32,
}

impl Mamba2Shape {
    /// Heads × head dim: the width of x, z and y.
    pub fn inner(&self) -> usize {
        self.ssm.heads * self.ssm.head_dim
    }

    /// x, B and C: what the conv filters.
    pub fn conv_dim(&self) -> usize {
        self.inner() + 2 * self.ssm.groups * self.ssm.state_dim
    }
}

pub struct Mamba2<D: Device> {
    in_z: D::Weight,
    in_xbc: D::Weight,
    in_dt: D::Weight,
    conv: D::Tensor,
    conv_bias: Option<D::Tensor>,
    dt_bias: D::Tensor,
    /// `-exp(A_log)`.
    a: D::Tensor,
    d: D::Tensor,
    norm: D::Tensor,
    out: D::Weight,
    conv_at: usize,
    ssm_at: usize,
}

impl<D: Device> Mamba2<D> {
    /// Block `l`'s mixer by GGUF names (`blk.{l}.ssm_*`); `a_log_hf` is the
    /// HF name of its `A_log` (a GGUF holds `A = -exp(A_log)` itself). Takes
    /// its state from `state`.
    pub fn load(dev: &D, src: &Source, l: usize, shape: &Mamba2Shape, a_log_hf: &str, state: &mut StateLayout) -> Result<Mamba2<D>> {
        let w = |n: &str| dev.weight(&src.tensor(n)?);
        let v = |n: &str| dev.vector(&src.tensor(n)?, 0.0);
        let p = |n: &str| format!("blk.{l}.{n}");
        let (inner, conv_dim, nh) = (shape.inner(), shape.conv_dim(), shape.ssm.heads);
        let in_proj = src.tensor(&p("ssm_in.weight"))?;
        ensure!(
            in_proj.shape == [inner + conv_dim + nh, shape.hidden],
            "{}: {:?}, expected [{}, {}]",
            in_proj.name,
            in_proj.shape,
            inner + conv_dim + nh,
            shape.hidden
        );
        let conv = src.tensor(&p("ssm_conv1d.weight"))?;
        ensure!(conv.elements() == conv_dim * shape.conv_kernel, "{}: {:?}, expected [{conv_dim}, 1, {}]", conv.name, conv.shape, shape.conv_kernel);
        let a: Vec<f32> = match src {
            Source::Gguf(_) => src.tensor(&p("ssm_a"))?.to_f32()?,
            Source::Hf(_) => src.tensor(a_log_hf)?.to_f32()?.iter().map(|x| -x.exp()).collect(),
        };
        ensure!(a.len() == nh, "block {l}: A has {} values for {nh} heads", a.len());
        let bias = p("ssm_conv1d.bias");
        Ok(Mamba2 {
            // in_proj's rows are z, then xBC, then dt.
            in_z: dev.weight(&slice_rows(&in_proj, 0, inner)?)?,
            in_xbc: dev.weight(&slice_rows(&in_proj, inner, conv_dim)?)?,
            in_dt: dev.weight(&slice_rows(&in_proj, inner + conv_dim, nh)?)?,
            conv: dev.vector(&conv, 0.0)?,
            conv_bias: if src.has_tensor(&bias) { Some(v(&bias)?) } else { None },
            dt_bias: v(&p("ssm_dt.bias"))?,
            a: dev.upload(&a, 1, nh)?,
            d: v(&p("ssm_d"))?,
            norm: v(&p("ssm_norm.weight"))?,
            out: w(&p("ssm_out.weight"))?,
            conv_at: state.take(conv_dim * (shape.conv_kernel - 1)),
            ssm_at: state.take(nh * shape.ssm.head_dim * shape.ssm.state_dim),
        })
    }
}

impl<D: RecurrentOps> Mamba2<D> {
    /// The mixer over the normed rows `s.h` into `s.out`, reading and
    /// writing each sequence's row of `state`; scratch from `s.extra`.
    pub fn forward(&self, dev: &D, shape: &Mamba2Shape, s: &mut Scratch<D>, state: &mut D::Tensor, seqs: &[StateSeq]) -> Result<()> {
        let [z, xbc, dt, conv, y, gated, normed] = extras(dev, &mut s.extra);
        dev.matmul(&s.h, &[&self.in_z, &self.in_xbc, &self.in_dt], &mut [&mut *z, &mut *xbc, &mut *dt]);
        dev.short_conv(xbc, &self.conv, self.conv_bias.as_ref(), shape.conv_kernel, true, state, self.conv_at, seqs, conv)?;
        dev.ssm_scan(conv, dt, &self.dt_bias, &self.a, &self.d, &shape.ssm, state, self.ssm_at, seqs, y)?;
        // Gated norm: (y ⊙ silu(z)), normalised per group of channels.
        dev.gated(Act::Silu, z, y, gated);
        dev.group_rms_norm(gated, &self.norm, shape.inner() / shape.ssm.groups, shape.eps, normed)?;
        dev.matmul(normed, &[&self.out], &mut [&mut s.out]);
        Ok(())
    }
}
