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
        Ok(Attention { wq: w(&p("attn_q"))?, wk: w(&p("attn_k"))?, wv: w(&p("attn_v"))?, qk_norm, wo: w(&p("attn_output"))? })
    }

    /// q, k and v of the normed rows in `s.h`, into `s.q`, `s.k` and `s.v`:
    /// q and k normed when the layer has norms, then turned by `rope` (none:
    /// no positional encoding); k and v are written to KV layer `layer`.
    /// `s.att` and `s.gate` are clobbered.
    ///
    /// The fused ops (one launch for q, k and v; RoPE and the KV write in
    /// one) give the plain ops' results, and a device that fuses them saves
    /// launches.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv(&self, dev: &D, s: &mut Scratch<D>, kv: &mut D::Kv, layer: usize, batch: &Batch<'_>, head_dim: usize, rope: Option<&Rope>, eps: f32) {
        self.qkv_of(dev, s, None, kv, layer, batch, head_dim, rope, eps)
    }

    /// [`Attention::qkv`] of `rms_norm(s.x)` with the layer's input norm
    /// `w_norm` (which a device may fold into the products); `s.h` is
    /// clobbered too.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_qkv(
        &self,
        dev: &D,
        s: &mut Scratch<D>,
        w_norm: &D::Tensor,
        kv: &mut D::Kv,
        layer: usize,
        batch: &Batch<'_>,
        head_dim: usize,
        rope: Option<&Rope>,
        eps: f32,
    ) {
        self.qkv_of(dev, s, Some(w_norm), kv, layer, batch, head_dim, rope, eps)
    }

    #[allow(clippy::too_many_arguments)]
    fn qkv_of(
        &self,
        dev: &D,
        s: &mut Scratch<D>,
        norm: Option<&D::Tensor>,
        kv: &mut D::Kv,
        layer: usize,
        batch: &Batch<'_>,
        head_dim: usize,
        rope: Option<&Rope>,
        eps: f32,
    ) {
        let ws = [&self.wq, &self.wk, &self.wv];
        if let (None, Some(r)) = (&self.qk_norm, rope) {
            // The input: s.x normed (s.h scratch), or s.h as it is.
            let (x, normed) = match norm {
                Some(_) => (&s.x, &mut s.h),
                None => (&s.h, &mut s.att),
            };
            let norm = norm.map(|w| (w, eps));
            return dev.qkv_rope_kv(x, norm, normed, ws, &mut s.q, &mut s.k, &mut s.v, kv, layer, batch.positions, batch.slots, head_dim, r);
        }
        if let Some(w) = norm {
            dev.rms_norm(&s.x, w, eps, &mut s.h);
        }
        match &self.qk_norm {
            Some((q_norm, k_norm)) => {
                dev.matmul_many(&s.h, &ws, &mut [&mut s.att, &mut s.gate, &mut s.v]);
                dev.rms_norm(&s.att, q_norm, eps, &mut s.q);
                dev.rms_norm(&s.gate, k_norm, eps, &mut s.k);
            }
            None => dev.matmul_many(&s.h, &ws, &mut [&mut s.q, &mut s.k, &mut s.v]),
        }
        match rope {
            Some(r) => dev.rope_kv_write(&mut s.q, &mut s.k, &s.v, kv, layer, batch.positions, batch.slots, head_dim, r),
            None => dev.kv_write(kv, layer, &s.k, &s.v, batch.slots),
        }
    }
}
