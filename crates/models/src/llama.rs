//! Llama (and SmolLM2): token embeddings, pre-norm blocks of grouped-query
//! attention with RoPE and a SwiGLU MLP, a final RMSNorm and a (possibly
//! tied) output head. Qwen3 is this model with q/k norms (`qwen3.rs`), Qwen2
//! with q/k/v biases (`qwen2.rs`).

use anyhow::{bail, Result};
use braid_ops::{Act, Device, KvShape, Rope};

use crate::blocks::{gated_mlp, model_sizes, refuse_unread, Attention};
use crate::config::HfConfig;
use crate::source::Source;
use crate::{lm_head, Batch, LayerState, Memory, Model, Scratch};

#[derive(Clone, Debug)]
pub struct LlamaConfig {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub eps: f32,
    pub rope: Rope,
    pub context: usize,
}

impl LlamaConfig {
    pub fn from_source(src: &Source) -> Result<LlamaConfig> {
        match src {
            Source::Gguf(g) => {
                let a = g.architecture()?.to_string();
                let key = |k: &str| format!("{a}.{k}");
                let hidden = g.get_u64(&key("embedding_length"))? as usize;
                let heads = g.get_u64(&key("attention.head_count"))? as usize;
                let kv_heads = g.get_u64(&key("attention.head_count_kv")).map(|v| v as usize).unwrap_or(heads);
                let head_dim = g.get_u64(&key("attention.key_length")).map(|v| v as usize).unwrap_or(hidden.checked_div(heads).unwrap_or(0));
                let vocab = src.tensor("token_embd.weight")?.shape[0];
                Ok(LlamaConfig {
                    hidden,
                    layers: g.get_u64(&key("block_count"))? as usize,
                    heads,
                    kv_heads,
                    head_dim,
                    ffn: g.get_u64(&key("feed_forward_length"))? as usize,
                    vocab,
                    eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
                    // llama.cpp's converter permutes q/k rows for llama, so
                    // the GGUF pairs adjacent dimensions (not NeoX).
                    rope: Rope::new(
                        g.get_f32(&key("rope.freq_base")).unwrap_or(10000.0),
                        g.get_u64(&key("rope.dimension_count")).map(|v| v as usize).unwrap_or(head_dim),
                        false,
                    ),
                    context: g.get_u64(&key("context_length")).map(|v| v as usize).unwrap_or(4096),
                })
            }
            Source::Hf(h) => {
                let c = HfConfig::new(h.config(), h.dir());
                let hidden = c.usize("hidden_size")?;
                let heads = c.usize("num_attention_heads")?;
                let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0));
                Ok(LlamaConfig {
                    hidden,
                    layers: c.usize("num_hidden_layers")?,
                    heads,
                    kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(heads),
                    head_dim,
                    ffn: c.usize("intermediate_size")?,
                    vocab: c.usize("vocab_size")?,
                    eps: c.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
                    rope: hf_rope(&c, None, head_dim, h.dir())?,
                    context: c.opt_usize("max_position_embeddings")?.unwrap_or(4096),
                })
            }
        }
    }
}

/// The RoPE of an HF config for one layer type: the NeoX pairing that HF
/// checkpoints use, over `partial_rotary_factor` of the head. Scaled variants
/// other than linear would need their own frequency tables, so they are
/// refused rather than run wrong.
pub fn hf_rope(c: &HfConfig<'_>, layer_type: Option<&str>, head_dim: usize, dir: &std::path::Path) -> Result<Rope> {
    let p = c.rope(layer_type, 10000.0)?;
    let scale = match p.rope_type.as_str() {
        "default" => 1.0,
        "linear" => p.factor,
        other => bail!("{}: rope_type '{other}' is not supported (supported: default, linear)", dir.display()),
    };
    Ok(Rope { scale, ..Rope::new(p.theta, (head_dim as f32 * p.partial_rotary_factor) as usize, true) })
}

/// The optional parts of the block that Llama's relatives add.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Variant {
    /// An RMSNorm on each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Biases on the q, k and v projections (Qwen2).
    pub qkv_bias: bool,
}

struct Block<D: Device> {
    attn_norm: D::Tensor,
    attn: Attention<D>,
    ffn_norm: D::Tensor,
    w_gate: D::Weight,
    w_up: D::Weight,
    w_down: D::Weight,
}

pub struct Llama<D: Device> {
    pub cfg: LlamaConfig,
    embed: D::Weight,
    blocks: Vec<Block<D>>,
    out_norm: D::Tensor,
    /// None when the head is tied to the embeddings.
    head: Option<D::Weight>,
}

impl<D: Device> Llama<D> {
    pub fn load(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<Llama<D>> {
        let cfg = LlamaConfig::from_source(src)?;
        crate::config::check_llama(&cfg, src)?;
        Self::load_with(dev, src, cfg, Variant::default(), progress)
    }

    /// Load with `cfg` and the optional parts `variant` names.
    pub(crate) fn load_with(dev: &D, src: &Source, cfg: LlamaConfig, variant: Variant, progress: &dyn Fn(usize, usize)) -> Result<Llama<D>> {
        let w = |n: &str| dev.weight(&src.tensor(n)?);
        let v = |n: &str| dev.vector(&src.tensor(n)?, 0.0);
        let mut m = Self::build(cfg, &w, &v, src.has_tensor("output.weight"), variant, progress)?;
        // Projection biases where the file has them (Llama's attention_bias);
        // MLP biases (mlp_bias) are refused rather than dropped.
        for (i, b) in m.blocks.iter_mut().enumerate() {
            b.attn.check(dev, i, m.cfg.heads, m.cfg.kv_heads, m.cfg.head_dim, m.cfg.hidden)?;
            b.attn.load_biases(dev, src, i)?;
            refuse_unread(src, i, &["ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"], "MLP biases (mlp_bias)")?;
        }
        Ok(m)
    }

    /// Build from tensors named as in GGUF, wherever they come from (a file,
    /// or random values for benchmarks: `random.rs`).
    pub fn from_tensors(
        cfg: LlamaConfig,
        w: &dyn Fn(&str) -> Result<D::Weight>,
        v: &dyn Fn(&str) -> Result<D::Tensor>,
        has_head: bool,
        progress: &dyn Fn(usize, usize),
    ) -> Result<Llama<D>> {
        Self::build(cfg, w, v, has_head, Variant::default(), progress)
    }

    fn build(
        cfg: LlamaConfig,
        w: &dyn Fn(&str) -> Result<D::Weight>,
        v: &dyn Fn(&str) -> Result<D::Tensor>,
        has_head: bool,
        variant: Variant,
        progress: &dyn Fn(usize, usize),
    ) -> Result<Llama<D>> {
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = |n: &str| format!("blk.{i}.{n}.weight");
            let mut attn = Attention::load_gguf(w, v, i, variant.qk_norm)?;
            if variant.qkv_bias {
                attn.qkv_bias = Some(Attention::<D>::gguf_qkv_bias(v, i)?);
            }
            blocks.push(Block {
                attn_norm: v(&p("attn_norm"))?,
                attn,
                ffn_norm: v(&p("ffn_norm"))?,
                w_gate: w(&p("ffn_gate"))?,
                w_up: w(&p("ffn_up"))?,
                w_down: w(&p("ffn_down"))?,
            });
            progress(i + 1, cfg.layers);
        }
        let head = if has_head { Some(w("output.weight")?) } else { None };
        Ok(Llama { embed: w("token_embd.weight")?, blocks, out_norm: v("output_norm.weight")?, head, cfg })
    }
}

impl<D: Device> Model<D> for Llama<D> {
    fn kv_layers(&self) -> Vec<KvShape> {
        vec![KvShape { kv_heads: self.cfg.kv_heads, head_dim: self.cfg.head_dim }; self.cfg.layers]
    }

    fn layer_states(&self) -> Vec<LayerState> {
        vec![LayerState::Kv; self.cfg.layers]
    }

    model_sizes!();

    fn forward(&self, dev: &D, batch: &Batch<'_>, mem: &mut Memory<D>, s: &mut Scratch<D>) -> Result<()> {
        let kv = &mut mem.kv;
        let c = &self.cfg;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        dev.embed(&self.embed, batch.tokens, 1.0, &mut s.x);
        for (l, b) in self.blocks.iter().enumerate() {
            // Attention (Qwen3: q/k normalised per head before RoPE; Qwen2: q/k/v biased).
            dev.rms_norm(&s.x, &b.attn_norm, c.eps, &mut s.h);
            b.attn.forward(dev, s, kv, l, batch, batch.slots, &batch.seqs, c.head_dim, Some(&c.rope), c.eps, scale, None);
            dev.add(&mut s.x, &s.out);
            // SwiGLU MLP.
            dev.rms_norm(&s.x, &b.ffn_norm, c.eps, &mut s.h);
            gated_mlp(dev, s, Act::Silu, &b.w_gate, &b.w_up, &b.w_down);
            dev.add(&mut s.x, &s.out);
            s.tap(dev, l);
        }
        // Head: only the rows whose logits are wanted.
        lm_head(dev, s, batch.logit_rows, &self.out_norm, c.eps, self.head.as_ref().unwrap_or(&self.embed), None);
        Ok(())
    }
}
