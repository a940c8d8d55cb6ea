//! The blocks several families share: the attention projections (q, k, v
//! from the normed rows, q and k optionally RMS-normed, RoPE, and the KV
//! write), the whole attention branch built on them, and the gated MLP.

use anyhow::{bail, Result};
use braid_ops::{Act, AttnSeq, Device, Rope};

use crate::source::Source;
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
    /// The output projection's bias (Llama's `attention_bias`), added in [`Self::forward`].
    pub o_bias: Option<D::Tensor>,
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
            o_bias: None,
        })
    }

    /// GGUF names of block `i` (an HF folder maps them to
    /// `model.layers.{i}.self_attn.*`, see `source.rs`):
    /// `blk.{i}.attn_{q,k,v,output}.weight`, and
    /// `blk.{i}.attn_{q,k}_norm.weight` when `norms`.
    pub fn load_gguf(w: &dyn Fn(&str) -> Result<D::Weight>, v: &dyn Fn(&str) -> Result<D::Tensor>, i: usize, norms: bool) -> Result<Attention<D>> {
        let p = |n: &str| format!("blk.{i}.{n}.weight");
        let qk_norm = if norms { Some((v(&p("attn_q_norm"))?, v(&p("attn_k_norm"))?)) } else { None };
        Ok(Attention { wq: w(&p("attn_q"))?, wk: w(&p("attn_k"))?, wv: w(&p("attn_v"))?, qk_norm, qkv_bias: None, wo: w(&p("attn_output"))?, o_bias: None })
    }

    /// Block `i`'s projection biases where the file has them
    /// (`blk.{i}.attn_{q,k,v,output}.bias`; an HF folder's
    /// `self_attn.{q,k,v,o}_proj.bias`): q, k and v all or none, o apart.
    pub fn load_biases(&mut self, dev: &D, src: &Source, i: usize) -> Result<()> {
        let name = |n: &str| format!("blk.{i}.{n}.bias");
        let b = |n: &str| dev.vector(&src.tensor(&name(n))?, 0.0);
        let qkv = ["attn_q", "attn_k", "attn_v"].map(|n| src.has_tensor(&name(n)));
        if self.qkv_bias.is_none() && qkv.iter().all(|&h| h) {
            self.qkv_bias = Some([b("attn_q")?, b("attn_k")?, b("attn_v")?]);
        } else if self.qkv_bias.is_none() && qkv.iter().any(|&h| h) {
            bail!("{}: block {i} has biases on some of q, k and v, not all", src.path().display());
        }
        if src.has_tensor(&name("attn_output")) {
            self.o_bias = Some(b("attn_output")?);
        }
        Ok(())
    }

    /// `self` if its projections have the shapes the config gives them:
    /// q of `heads`, k and v of `kv_heads` heads of `head_dim` over
    /// `hidden` columns, and the output back to `hidden` (else an error
    /// naming block `layer`: a config that miscounts heads would fail in
    /// the first forward instead).
    pub fn checked(self, dev: &D, layer: usize, heads: usize, kv_heads: usize, head_dim: usize, hidden: usize) -> Result<Attention<D>> {
        self.check(dev, layer, heads, kv_heads, head_dim, hidden)?;
        Ok(self)
    }

    /// [`Self::checked`] in place.
    pub fn check(&self, dev: &D, layer: usize, heads: usize, kv_heads: usize, head_dim: usize, hidden: usize) -> Result<()> {
        let (q, kv) = (heads * head_dim, kv_heads * head_dim);
        for (name, w, want) in [("q", &self.wq, (q, hidden)), ("k", &self.wk, (kv, hidden)), ("v", &self.wv, (kv, hidden)), ("output", &self.wo, (hidden, q))] {
            let got = dev.weight_shape(w);
            if got != want {
                bail!(
                    "block {layer}: the attention's {name} projection is {}x{}; the config gives {}x{} ({heads} heads, {kv_heads} KV heads of {head_dim}, hidden {hidden})",
                    got.0,
                    got.1,
                    want.0,
                    want.1
                );
            }
        }
        Ok(())
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
    /// layer `layer` at `slots` (the batch's slots in the layer's group:
    /// `Batch::slots`, or `Batch::window_slots` for a window layer).
    #[allow(clippy::too_many_arguments)]
    pub fn qkv(
        &self,
        dev: &D,
        s: &mut Scratch<D>,
        kv: &mut D::Kv,
        layer: usize,
        batch: &Batch<'_>,
        slots: &[u32],
        head_dim: usize,
        rope: Option<&Rope>,
        eps: f32,
    ) {
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
        dev.kv_write(kv, layer, &s.k, &s.v, slots);
    }

    /// The whole attention branch of the normed rows in `s.h`:
    /// [`Self::qkv`], attention of `s.q` over KV layer `layer` for `seqs`
    /// (`slots` and `seqs` of the layer's group), and the output
    /// projection into `s.out`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        dev: &D,
        s: &mut Scratch<D>,
        kv: &mut D::Kv,
        layer: usize,
        batch: &Batch<'_>,
        slots: &[u32],
        seqs: &[AttnSeq<'_>],
        head_dim: usize,
        rope: Option<&Rope>,
        eps: f32,
        scale: f32,
        softcap: Option<f32>,
    ) {
        self.qkv(dev, s, kv, layer, batch, slots, head_dim, rope, eps);
        dev.attention(&s.q, kv, layer, seqs, scale, softcap, &mut s.att);
        dev.matmul(&s.att, &[&self.wo], &mut [&mut s.out]);
        if let Some(b) = &self.o_bias {
            dev.add(&mut s.out, b);
        }
    }
}

/// `Model::vocab` and `Model::context` from the model's `cfg` (and, given
/// `state`, `Model::state_size` from its `state` layout): the same bodies
/// in every family, over each family's own config type.
macro_rules! model_sizes {
    () => {
        fn vocab(&self) -> usize {
            self.cfg.vocab
        }

        fn context(&self) -> usize {
            self.cfg.context
        }
    };
    (state) => {
        fn state_size(&self) -> usize {
            self.state.size()
        }

        $crate::blocks::model_sizes!();
    };
}
pub(crate) use model_sizes;

/// Refuse a file holding any of block `i`'s `tensors` (GGUF names): the
/// family does not read them, and running without them would be another
/// model (an MLP's biases, say).
pub fn refuse_unread(src: &Source, i: usize, tensors: &[&str], what: &str) -> Result<()> {
    for t in tensors {
        let n = format!("blk.{i}.{t}");
        if src.has_tensor(&n) {
            bail!("{}: block {i} has {n} ({}); {what} are not supported", src.path().display(), crate::source::hf_name(&src.architecture()?, &n));
        }
    }
    Ok(())
}

/// The gated MLP of the normed rows in `s.h`:
/// `s.out = down(act(gate · h) ⊙ (up · h))`.
pub fn gated_mlp<D: Device>(dev: &D, s: &mut Scratch<D>, act: Act, gate: &D::Weight, up: &D::Weight, down: &D::Weight) {
    dev.matmul(&s.h, &[gate, up], &mut [&mut s.gate, &mut s.up]);
    dev.gated(act, &s.gate, &s.up, &mut s.act);
    dev.matmul(&s.act, &[down], &mut [&mut s.out]);
}
