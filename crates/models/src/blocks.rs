//! The attention projections several families share: q, k, v from the
//! normed rows, q and k optionally RMS-normed, RoPE, and the KV write.

use anyhow::Result;
use braid_ops::{Device, Rope};

use crate::{Batch, Scratch};

/// A grouped-query attention layer's weights.
pub struct Attention<D: Device> {
    pub wq: D::Weight,
    pub wk: D::Weight,
    pub wv: D::Weight,
    /// RMSNorm weights of q and of k, applied before RoPE: one head wide
    /// (every head normed on its own) or the projection's whole width.
    pub qk_norm: Option<(D::Tensor, D::Tensor)>,
    /// Biases of q, k and v (Qwen2), added to the projections before any
    /// norm or RoPE.
    pub qkv_bias: Option<[D::Tensor; 3]>,
    pub wo: D::Weight,
}

impl<D: Device> Attention<D> {
    /// HF names: `{prefix}{q,k,v}_proj.weight`, `{prefix}{o}.weight`, and the
    /// norms `{prefix}{q_norm}.weight`, `{prefix}{k_norm}.weight` when given.
    pub fn load_hf(
        w: &dyn Fn(&str) -> Result<D::Weight>,
        v: &dyn Fn(&str) -> Result<D::Tensor>,
        prefix: &str,
        o: &str,
        norms: Option<(&str, &str)>,
    ) -> Result<Attention<D>> {
        let qk_norm = match norms {
            Some((q, k)) => Some((v(&format!("{prefix}{q}.weight"))?, v(&format!("{prefix}{k}.weight"))?)),
            None => None,
        };
        Ok(Attention {
            wq: w(&format!("{prefix}q_proj.weight"))?,
            wk: w(&format!("{prefix}k_proj.weight"))?,
            wv: w(&format!("{prefix}v_proj.weight"))?,
            qk_norm,
            qkv_bias: None,
            wo: w(&format!("{prefix}{o}.weight"))?,
        })
    }

    /// GGUF names of block `i` (an HF folder maps them to
    /// `model.layers.{i}.self_attn.*`, see `source.rs`):
    /// `blk.{i}.attn_{q,k,v,output}.weight`, and
    /// `blk.{i}.attn_{q,k}_norm.weight` when `norms`.
    pub fn load_gguf(w: &dyn Fn(&str) -> Result<D::Weight>, v: &dyn Fn(&str) -> Result<D::Tensor>, i: usize, norms: bool) -> Result<Attention<D>> {
        let p = |n: &str| format!("blk.{i}.{n}.weight");
        let qk_norm = if norms { Some((v(&p("attn_q_norm"))?, v(&p("attn_k_norm"))?)) } else { None };
        Ok(Attention { wq: w(&p("attn_q"))?, wk: w(&p("attn_k"))?, wv: w(&p("attn_v"))?, qk_norm, qkv_bias: None, wo: w(&p("attn_output"))? })
    }

    /// The q, k and v biases of block `i` (`blk.{i}.attn_{q,k,v}.bias`).
    pub fn gguf_qkv_bias(v: &dyn Fn(&str) -> Result<D::Tensor>, i: usize) -> Result<[D::Tensor; 3]> {
        let p = |n: &str| format!("blk.{i}.{n}.bias");
        Ok([v(&p("attn_q"))?, v(&p("attn_k"))?, v(&p("attn_v"))?])
    }

    /// q, k and v of the normed rows in `s.h`, into `s.q`, `s.k` and `s.v`,
    /// plus their biases where the layer has them; q and k normed per head
    /// when the layer has norms, then turned by
    /// `rope` (none: no positional encoding); k and v are written to KV
    /// layer `layer`.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv(&self, dev: &D, s: &mut Scratch<D>, kv: &mut D::Kv, layer: usize, batch: &Batch<'_>, head_dim: usize, rope: Option<&Rope>, eps: f32) {
        let ws = [&self.wq, &self.wk, &self.wv];
        let bias = |dev: &D, q: &mut D::Tensor, k: &mut D::Tensor, v: &mut D::Tensor| {
            if let Some([bq, bk, bv]) = &self.qkv_bias {
                dev.add(q, bq);
                dev.add(k, bk);
                dev.add(v, bv);
            }
        };
        match &self.qk_norm {
            None => {
                dev.matmul(&s.h, &ws, &mut [&mut s.q, &mut s.k, &mut s.v]);
                bias(dev, &mut s.q, &mut s.k, &mut s.v);
            }
            Some((q_norm, k_norm)) => {
                dev.matmul(&s.h, &ws, &mut [&mut s.q_raw, &mut s.k_raw, &mut s.v]);
                bias(dev, &mut s.q_raw, &mut s.k_raw, &mut s.v);
                dev.rms_norm(&s.q_raw, q_norm, eps, &mut s.q);
                dev.rms_norm(&s.k_raw, k_norm, eps, &mut s.k);
            }
        }
        if let Some(r) = rope {
            dev.rope(&mut s.q, batch.positions, head_dim, r);
            dev.rope(&mut s.k, batch.positions, head_dim, r);
        }
        dev.kv_write(kv, layer, &s.k, &s.v, batch.slots);
    }
}
