//! Gemma 3 (text): embeddings scaled by √hidden; blocks of sliding-window
//! (local) and global attention with per-head q/k RMSNorm and norms after
//! both the attention and the MLP; a GELU-gated MLP; a tied head.

use anyhow::Result;
use braid_formats::DType;
use braid_ops::{Act, AttnSeq, Device, KvShape, MoeOps, Rope};

use crate::blocks::{gated_mlp, model_sizes, refuse_unread, Attention};
use crate::config::HfConfig;
use crate::llama::hf_rope;
use crate::siglip::{Gemma3Vision, Mmproj, VisionConfig, VisionStep};
use crate::source::Source;
use crate::{image_seqs, lm_head, place_images, Batch, LayerState, Memory, Model, Scratch};

#[derive(Clone, Debug)]
pub struct Gemma3Config {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub eps: f32,
    pub window: usize,
    /// Per layer: global (full) attention, else sliding-window (local).
    pub global: Vec<bool>,
    pub rope_global: Rope,
    pub rope_local: Rope,
    pub attn_scale: f32,
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
    /// Embeddings are scaled by √hidden (rounded to the weights' type, as transformers does).
    pub embed_scale: f32,
    /// Added to every norm weight: HF checkpoints store Gemma's `1 + w` as
    /// `w`; the GGUF converter already folded the 1 in.
    pub norm_offset: f32,
    pub context: usize,
}

/// A softcap of 0, infinity or none all mean no cap.
fn cap(v: Option<f32>) -> Option<f32> {
    v.filter(|c| c.is_finite() && *c > 0.0)
}

impl Gemma3Config {
    pub fn from_source(src: &Source) -> Result<Gemma3Config> {
        match src {
            Source::Gguf(g) => {
                let key = |k: &str| format!("gemma3.{k}");
                let hidden = g.get_u64(&key("embedding_length"))? as usize;
                let heads = g.get_u64(&key("attention.head_count"))? as usize;
                let head_dim = g.get_u64(&key("attention.key_length")).map(|v| v as usize).unwrap_or(hidden.checked_div(heads).unwrap_or(0));
                let layers = g.get_u64(&key("block_count"))? as usize;
                let rope = |theta| Rope::new(theta, head_dim, true);
                Ok(Gemma3Config {
                    hidden,
                    layers,
                    heads,
                    kv_heads: g.get_u64(&key("attention.head_count_kv")).map(|v| v as usize).unwrap_or(heads),
                    head_dim,
                    ffn: g.get_u64(&key("feed_forward_length"))? as usize,
                    vocab: src.tensor("token_embd.weight")?.shape[0],
                    eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
                    window: g.get_u64(&key("attention.sliding_window")).map(|v| v as usize).unwrap_or(512),
                    // Gemma 3 interleaves five local layers with one global.
                    global: (0..layers).map(|l| (l + 1).is_multiple_of(6)).collect(),
                    rope_global: rope(g.get_f32(&key("rope.freq_base")).unwrap_or(1_000_000.0)),
                    rope_local: rope(g.opt_f32(&key("rope.freq_base_swa"))?.unwrap_or(10_000.0)),
                    attn_scale: 1.0 / (head_dim as f32).sqrt(),
                    attn_softcap: None,
                    final_softcap: None,
                    embed_scale: (hidden as f32).sqrt(),
                    norm_offset: 0.0,
                    context: g.get_u64(&key("context_length")).map(|v| v as usize).unwrap_or(32768),
                })
            }
            Source::Hf(h) => {
                let c = HfConfig::new(h.config(), h.dir());
                let hidden = c.usize("hidden_size")?;
                let heads = c.usize("num_attention_heads")?;
                let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0));
                let layers = c.usize("num_hidden_layers")?;
                // transformers 5.x lists layer types; Hub configs give the pattern.
                let global = match c.layer_types(layers)? {
                    Some(t) => t.iter().map(|t| t != "sliding_attention").collect(),
                    None => {
                        let every = c.opt_usize("sliding_window_pattern")?.or(c.opt_usize("_sliding_window_pattern")?).unwrap_or(6).max(1);
                        (0..layers).map(|l| (l + 1).is_multiple_of(every)).collect()
                    }
                };
                let embed = src.tensor("token_embd.weight")?;
                Ok(Gemma3Config {
                    hidden,
                    layers,
                    heads,
                    kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(heads),
                    head_dim,
                    ffn: c.usize("intermediate_size")?,
                    vocab: c.usize("vocab_size")?,
                    eps: c.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
                    window: c.opt_usize("sliding_window")?.unwrap_or(4096),
                    global,
                    rope_global: hf_rope(&c, Some("full_attention"), head_dim, h.dir())?,
                    rope_local: hf_rope(&c, Some("sliding_attention"), head_dim, h.dir())?,
                    attn_scale: c.opt_f32("query_pre_attn_scalar")?.unwrap_or(head_dim as f32).powf(-0.5),
                    // transformers' Gemma 3 keeps `attn_logit_softcapping` in
                    // its config but never applies it (Gemma 2 did); llama.cpp's
                    // converter refuses a config that sets it. Run as transformers.
                    attn_softcap: None,
                    final_softcap: cap(c.opt_f32("final_logit_softcapping")?),
                    embed_scale: round_to(embed.dtype, (hidden as f32).sqrt()),
                    norm_offset: 1.0,
                    context: c.opt_usize("max_position_embeddings")?.unwrap_or(32768),
                })
            }
        }
    }
}

/// `x` rounded to a weight type (transformers multiplies by the scale in the weights' dtype).
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

struct Block<D: Device> {
    attn_norm: D::Tensor,
    attn: Attention<D>,
    post_attn_norm: D::Tensor,
    ffn_norm: D::Tensor,
    w_gate: D::Weight,
    w_up: D::Weight,
    w_down: D::Weight,
    post_ffn_norm: D::Tensor,
}

pub struct Gemma3<D: Device> {
    pub cfg: Gemma3Config,
    embed: D::Weight,
    blocks: Vec<Block<D>>,
    out_norm: D::Tensor,
    /// The vision tower and projector (`Gemma3ForConditionalGeneration`).
    vision: Option<Gemma3Vision<D>>,
}

impl<D: MoeOps> Gemma3<D> {
    pub fn load(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<Gemma3<D>> {
        Self::load_with(dev, src, None, progress)
    }

    /// [`Gemma3::load`], the vision tower and projector from `mmproj` where given.
    pub fn load_with(dev: &D, src: &Source, mmproj: Option<&Mmproj>, progress: &dyn Fn(usize, usize)) -> Result<Gemma3<D>> {
        let cfg = Gemma3Config::from_source(src)?;
        crate::config::check_gemma3(&cfg, src)?;
        let hf = matches!(src, Source::Hf(_));
        // Each tensor by its GGUF name or its HF name.
        let name = |gguf: &str, hf_name: &str| if hf { hf_name.to_string() } else { gguf.to_string() };
        let w = |g: &str, h: &str| dev.weight(&src.tensor(&name(g, h))?);
        let v = |g: &str, h: &str| dev.vector(&src.tensor(&name(g, h))?, cfg.norm_offset);
        // By GGUF name only (an HF folder maps these the same way).
        let w_gguf = |n: &str| dev.weight(&src.tensor(n)?);
        let v_gguf = |n: &str| dev.vector(&src.tensor(n)?, cfg.norm_offset);
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let g = |n: &str| format!("blk.{i}.{n}.weight");
            let h = |n: &str| format!("model.layers.{i}.{n}.weight");
            // Projection biases where the file has them (attention_bias); MLP biases are refused.
            let mut attn = Attention::load_gguf(&w_gguf, &v_gguf, i, true)?.checked(dev, i, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden)?;
            attn.load_biases(dev, src, i)?;
            refuse_unread(src, i, &["ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"], "MLP biases")?;
            blocks.push(Block {
                attn_norm: v(&g("attn_norm"), &h("input_layernorm"))?,
                attn,
                post_attn_norm: v(&g("post_attention_norm"), &h("post_attention_layernorm"))?,
                ffn_norm: v(&g("ffn_norm"), &h("pre_feedforward_layernorm"))?,
                w_gate: w(&g("ffn_gate"), &h("mlp.gate_proj"))?,
                w_up: w(&g("ffn_up"), &h("mlp.up_proj"))?,
                w_down: w(&g("ffn_down"), &h("mlp.down_proj"))?,
                post_ffn_norm: v(&g("post_ffw_norm"), &h("post_feedforward_layernorm"))?,
            });
            progress(i + 1, cfg.layers);
        }
        let embed = w("token_embd.weight", "model.embed_tokens.weight")?;
        let vision = Gemma3Vision::load(dev, src, mmproj, cfg.hidden)?;
        Ok(Gemma3 { embed, blocks, out_norm: v("output_norm.weight", "model.norm.weight")?, cfg, vision })
    }
}

impl<D: MoeOps> Model<D> for Gemma3<D> {
    fn kv_layers(&self) -> Vec<KvShape> {
        vec![KvShape { kv_heads: self.cfg.kv_heads, head_dim: self.cfg.head_dim }; self.cfg.layers]
    }

    fn kv_groups(&self) -> Vec<usize> {
        self.cfg.global.iter().map(|&g| if g { 0 } else { 1 }).collect()
    }

    fn layer_states(&self) -> Vec<LayerState> {
        self.cfg.global.iter().map(|&g| if g { LayerState::Kv } else { LayerState::SlidingKv { window: self.cfg.window } }).collect()
    }

    model_sizes!();

    fn forward(&self, dev: &D, batch: &Batch<'_>, mem: &mut Memory<D>, s: &mut Scratch<D>) -> Result<()> {
        let kv = &mut mem.kv;
        let c = &self.cfg;
        dev.embed(&self.embed, batch.tokens, c.embed_scale, &mut s.x);
        // Image rows replace their rows' embeddings (unscaled), and see
        // their whole image in every layer.
        place_images(dev, s, &batch.images);
        let global_seqs = image_seqs(&batch.seqs, &batch.images);
        // Sliding-window layers keep their KV apart (only the window).
        let local_seqs: Vec<AttnSeq<'_>> = batch.window_seqs.iter().map(|q| AttnSeq { window: Some(c.window), ..*q }).collect();
        let local_seqs = image_seqs(&local_seqs, &batch.images);
        for (l, b) in self.blocks.iter().enumerate() {
            let (rope, slots, seqs) = if c.global[l] { (&c.rope_global, batch.slots, &global_seqs) } else { (&c.rope_local, batch.window_slots, &local_seqs) };
            // Attention: q/k normalised per head before RoPE, the output normed
            // before it joins the residual stream.
            dev.rms_norm(&s.x, &b.attn_norm, c.eps, &mut s.h);
            b.attn.forward(dev, s, kv, l, batch, slots, seqs, c.head_dim, Some(rope), c.eps, c.attn_scale, c.attn_softcap);
            dev.rms_norm(&s.out, &b.post_attn_norm, c.eps, &mut s.post);
            dev.add(&mut s.x, &s.post);
            // GELU-gated MLP, likewise normed before and after.
            dev.rms_norm(&s.x, &b.ffn_norm, c.eps, &mut s.h);
            gated_mlp(dev, s, Act::GeluTanh, &b.w_gate, &b.w_up, &b.w_down);
            dev.rms_norm(&s.out, &b.post_ffn_norm, c.eps, &mut s.post);
            dev.add(&mut s.x, &s.post);
            s.tap(dev, l);
        }
        lm_head(dev, s, batch.logit_rows, &self.out_norm, c.eps, &self.embed, c.final_softcap);
        Ok(())
    }

    fn vision(&self) -> Option<&VisionConfig> {
        self.vision.as_ref().map(|v| &v.cfg)
    }

    fn encode_image_step(&self, dev: &D, pixels: &[f32], at: &mut usize, budget: Option<u64>) -> Result<VisionStep<D::Tensor>> {
        match &self.vision {
            Some(v) => v.encode_step(dev, pixels, at, budget),
            None => anyhow::bail!("this Gemma 3 has no vision tower"),
        }
    }
}
