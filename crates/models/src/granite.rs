//! Granite 4 hybrid (`granitemoehybrid`, IBM): pre-norm blocks whose mixer
//! is Mamba2 (`mamba2.rs`) or grouped-query attention (RoPE or none), each
//! followed by a softmax-routed mixture of SwiGLU experts beside a shared
//! SwiGLU MLP; a final norm and a (usually tied) head.
//!
//! Its muP-style multipliers: the embeddings are scaled by
//! `embedding_multiplier`, both branches join the residual scaled by
//! `residual_multiplier`, attention scores are scaled by
//! `attention_multiplier` (not 1/√head_dim), and the logits are divided by
//! `logits_scaling`.
//!
//! `dt` is clamped to `time_step_limit` in every pass (transformers does so
//! in its chunked scan; its default `(0, inf)` changes nothing).

use anyhow::{bail, ensure, Result};
use braid_ops::{Act, Device, KvShape, Map, MoeOps, RecurrentOps, Rope, SsmShape};

use crate::blocks::{gated_mlp, model_sizes, Attention};
use crate::config::Checks;
use crate::llama::hf_rope;
use crate::mamba2::{Mamba2, Mamba2Shape};
use crate::moe::{slice_rows, Activation, Experts, Moe, Router, Scoring};
use crate::recurrent::{extras, gguf_kv_heads, hf_config, state_seqs, StateLayout};
use crate::source::Source;
use crate::{lm_head, Batch, LayerState, Memory, Model, Scratch};

#[derive(Clone, Debug)]
pub struct GraniteHybridConfig {
    pub hidden: usize,
    /// Per layer: Mamba2 (true) or attention (false).
    pub mamba: Vec<bool>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f32,
    pub context: usize,
    /// None: no positional encoding (`position_embedding_type` other than rope).
    pub rope: Option<Rope>,
    pub embedding_multiplier: f32,
    pub residual_multiplier: f32,
    pub attention_multiplier: f32,
    pub logits_scaling: f32,
    /// 0: the shared MLP alone.
    pub experts: usize,
    pub top_k: usize,
    pub ssm: SsmShape,
    pub conv_kernel: usize,
}

impl GraniteHybridConfig {
    pub fn from_source(src: &Source) -> Result<GraniteHybridConfig> {
        match src {
            Source::Gguf(g) => Self::from_gguf(g),
            Source::Hf(_) => Self::from_hf(src),
        }
    }

    /// llama.cpp's `granitehybrid.*` keys: attention layers are those with
    /// KV heads in the per-layer `attention.head_count_kv`; RoPE only where
    /// `rope.scaling.finetuned` says so (the converter writes false for
    /// Granite 4's hybrids, which have none), over rows the converter
    /// permuted as llama's (adjacent pairs). The GGUF keeps no dt limits:
    /// transformers' default `(0, inf)`.
    fn from_gguf(g: &braid_formats::gguf::Gguf) -> Result<GraniteHybridConfig> {
        let arch = g.architecture()?.to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let path = g.path().display();
        let layers = g.get_usize(&key("block_count"))?;
        let kv = gguf_kv_heads(g, &arch, layers)?;
        let hidden = g.get_usize(&key("embedding_length"))?;
        let heads = g.get_usize(&key("attention.head_count"))?;
        let head_dim = g.opt_u64(&key("attention.key_length"))?.map_or(hidden.checked_div(heads).unwrap_or(0), |d| d as usize);
        let rope = match g.opt_bool(&key("rope.scaling.finetuned"))?.unwrap_or(true) {
            true => Some(Rope::new(
                g.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
                g.opt_u64(&key("rope.dimension_count"))?.map_or(head_dim, |d| d as usize),
                false,
            )),
            false => None,
        };
        let ssm_heads = g.get_usize(&key("ssm.time_step_rank"))?;
        let inner = g.get_usize(&key("ssm.inner_size"))?;
        ensure!(ssm_heads > 0 && inner.is_multiple_of(ssm_heads), "{path}: ssm.inner_size {inner} over {ssm_heads} heads (ssm.time_step_rank)");
        let one = |k: &str| -> Result<f32> { Ok(g.opt_f32(&key(k))?.unwrap_or(1.0)) };
        Ok(GraniteHybridConfig {
            hidden,
            mamba: kv.iter().map(|&k| k == 0).collect(),
            heads,
            kv_heads: kv.iter().copied().max().unwrap_or(0) as usize,
            head_dim,
            vocab: g.tensor("token_embd.weight")?.shape[0],
            eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            context: g.opt_u64(&key("context_length"))?.unwrap_or(2048) as usize,
            rope,
            embedding_multiplier: one("embedding_scale")?,
            residual_multiplier: one("residual_scale")?,
            attention_multiplier: one("attention.scale")?,
            logits_scaling: one("logit_scale")?,
            experts: g.opt_u64(&key("expert_count"))?.unwrap_or(0) as usize,
            top_k: g.opt_u64(&key("expert_used_count"))?.unwrap_or(0) as usize,
            ssm: SsmShape {
                heads: ssm_heads,
                head_dim: inner / ssm_heads,
                state_dim: g.get_usize(&key("ssm.state_size"))?,
                groups: g.get_usize(&key("ssm.group_count"))?,
                dt_min: 0.0,
                dt_max: f32::INFINITY,
            },
            conv_kernel: g.get_usize(&key("ssm.conv_kernel"))?,
        })
    }

    fn from_hf(src: &Source) -> Result<GraniteHybridConfig> {
        let c = hf_config(src, "granitemoehybrid")?;
        let path = src.path();
        let path = path.display();
        let hidden = c.usize("hidden_size")?;
        let layers = c.usize("num_hidden_layers")?;
        let heads = c.usize("num_attention_heads")?;
        let types = match c.layer_types(layers)? {
            Some(t) => t,
            None => match c.get("layers_block_type").and_then(|v| v.as_array()) {
                Some(a) => a.iter().map(|v| v.as_str().unwrap_or("").to_string()).collect(),
                None => vec!["linear_attention".to_string(); layers],
            },
        };
        ensure!(types.len() == layers, "{path}: {} layer types for {layers} layers", types.len());
        let mamba = types
            .iter()
            .map(|t| match t.as_str() {
                "linear_attention" | "mamba" => Ok(true),
                "full_attention" | "attention" => Ok(false),
                other => bail!("{path}: layer type `{other}` (expected linear_attention/mamba or full_attention/attention)"),
            })
            .collect::<Result<Vec<bool>>>()?;
        if c.opt_bool("mamba_proj_bias")?.unwrap_or(false) || c.opt_bool("attention_bias")?.unwrap_or(false) {
            bail!("{path}: mamba_proj_bias / attention_bias (projection biases) are not supported for granitemoehybrid");
        }
        if let Some(act) = c.opt_str("hidden_act")? {
            ensure!(act == "silu", "{path}: hidden_act {act} (only silu is supported)");
        }
        let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0));
        let rope = match c.opt_str("position_embedding_type")? {
            Some("rope") => Some(hf_rope(&c, None, head_dim, &src.path())?),
            _ => None,
        };
        let ssm_heads = c.usize("mamba_n_heads")?;
        let inner = c.opt_usize("mamba_expand")?.unwrap_or(2) * hidden;
        // `mamba_d_head` is a number or "auto" (the intermediate width over the heads).
        let ssm_head_dim = match c.get("mamba_d_head") {
            Some(v) if v.as_str() == Some("auto") => inner.checked_div(ssm_heads).unwrap_or(0),
            _ => c.opt_usize("mamba_d_head")?.unwrap_or(inner.checked_div(ssm_heads).unwrap_or(0)),
        };
        ensure!(ssm_head_dim * ssm_heads == inner, "{path}: {ssm_heads} Mamba heads of {ssm_head_dim} are not mamba_expand × hidden ({inner})");
        let limit = |i: usize| c.get("time_step_limit").and_then(|v| v.as_array()).and_then(|a| a.get(i)).and_then(crate::config::json_f32);
        let (dt_min, dt_max) = (limit(0).unwrap_or(0.0), limit(1).unwrap_or(f32::INFINITY));
        ensure!(dt_min <= dt_max, "{path}: time_step_limit [{dt_min}, {dt_max}]");
        let one = |k: &str| -> Result<f32> { Ok(c.opt_f32(k)?.unwrap_or(1.0)) };
        Ok(GraniteHybridConfig {
            hidden,
            mamba,
            heads,
            kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(heads),
            head_dim,
            vocab: c.usize("vocab_size")?,
            eps: c.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            context: c.opt_usize("max_position_embeddings")?.unwrap_or(2048),
            rope,
            embedding_multiplier: one("embedding_multiplier")?,
            residual_multiplier: one("residual_multiplier")?,
            attention_multiplier: one("attention_multiplier")?,
            logits_scaling: one("logits_scaling")?,
            experts: c.opt_usize("num_local_experts")?.unwrap_or(0),
            top_k: c.opt_usize("num_experts_per_tok")?.unwrap_or(0),
            ssm: SsmShape {
                heads: ssm_heads,
                head_dim: ssm_head_dim,
                state_dim: c.usize("mamba_d_state")?,
                groups: c.opt_usize("mamba_n_groups")?.unwrap_or(1),
                dt_min,
                dt_max,
            },
            conv_kernel: c.opt_usize("mamba_d_conv")?.unwrap_or(4),
        })
    }

    fn mamba_shape(&self) -> Mamba2Shape {
        Mamba2Shape { hidden: self.hidden, ssm: self.ssm, conv_kernel: self.conv_kernel, eps: self.eps }
    }

    fn check(&self, src: &Source) -> Result<()> {
        let mut k = Checks::new(src);
        k.common(self.hidden, self.mamba.len(), self.vocab, self.eps, self.context).attention(self.heads, self.kv_heads, self.head_dim);
        k.count("ssm.conv_kernel (mamba_d_conv)", self.conv_kernel).count("ssm.state_size (mamba_d_state)", self.ssm.state_dim);
        k.count("ssm.head_count (mamba_n_heads)", self.ssm.heads).divides(
            "ssm.group_count (mamba_n_groups)",
            self.ssm.groups,
            "ssm.head_count (mamba_n_heads)",
            self.ssm.heads,
        );
        k.positive("logits_scaling", self.logits_scaling).positive("attention_multiplier", self.attention_multiplier);
        if let Some(r) = &self.rope {
            k.rope(r, self.head_dim);
        }
        if self.experts > 0 {
            k.top_k(self.experts, self.top_k);
        }
        k.done()
    }
}

/// An attention layer holds its index in the KV pool.
enum Mixer<D: Device> {
    Mamba(Mamba2<D>),
    Attention(Attention<D>, usize),
}

/// A SwiGLU MLP from a fused `[2I, H]` input projection (gate rows first).
struct SharedMlp<D: Device> {
    gate: D::Weight,
    up: D::Weight,
    down: D::Weight,
}

struct Block<D: Device> {
    in_norm: D::Tensor,
    mixer: Mixer<D>,
    post_norm: D::Tensor,
    /// The router's projection and the mixture; None without experts.
    moe: Option<(D::Weight, Moe<D>)>,
    shared: SharedMlp<D>,
}

pub struct GraniteHybrid<D: Device> {
    pub cfg: GraniteHybridConfig,
    embed: D::Weight,
    blocks: Vec<Block<D>>,
    out_norm: D::Tensor,
    /// None when the head is tied to the embeddings.
    head: Option<D::Weight>,
    state: StateLayout,
}

impl<D: Device> GraniteHybrid<D> {
    pub fn load(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<GraniteHybrid<D>> {
        let cfg = GraniteHybridConfig::from_source(src)?;
        cfg.check(src)?;
        let w = |n: &str| dev.weight(&src.tensor(n)?);
        let v = |n: &str| dev.vector(&src.tensor(n)?, 0.0);
        let shape = cfg.mamba_shape();
        let mut state = StateLayout::default();
        let mut kv = 0;
        let layers = cfg.mamba.len();
        let mut blocks = Vec::with_capacity(layers);
        for l in 0..layers {
            let p = |n: &str| format!("blk.{l}.{n}");
            // The tensors an HF folder fuses, by their HF names.
            let hf = |n: &str| format!("model.layers.{l}.{n}");
            let mixer = if cfg.mamba[l] {
                Mixer::Mamba(Mamba2::load(dev, src, l, &shape, &hf("mamba.A_log"), &mut state)?)
            } else {
                kv += 1;
                Mixer::Attention(Attention::load_gguf(&w, &v, l, false)?.checked(dev, l, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden)?, kv - 1)
            };
            let act = Activation::Gated(Act::Silu);
            let moe = if cfg.experts > 0 {
                // A GGUF stacks gate, up and down apart; an HF folder fuses gate and up.
                let experts = match src {
                    Source::Gguf(_) => Experts::load_stacked(
                        dev,
                        src,
                        cfg.experts,
                        act,
                        Some(&p("ffn_gate_exps.weight")),
                        &p("ffn_up_exps.weight"),
                        &p("ffn_down_exps.weight"),
                    )?,
                    Source::Hf(_) => Experts::load_fused(
                        dev,
                        &src.tensor(&hf("block_sparse_moe.input_linear.weight"))?,
                        &src.tensor(&hf("block_sparse_moe.output_linear.weight"))?,
                        act,
                    )?,
                };
                ensure!(experts.experts.len() == cfg.experts, "block {l}: {} experts, num_local_experts is {}", experts.experts.len(), cfg.experts);
                // Softmax over the chosen logits = softmax over all, renormalised.
                let router = Router { scoring: Scoring::Softmax, top_k: cfg.top_k, normalize: true, ..Router::default() };
                Some((w(&p("ffn_gate_inp.weight"))?, Moe { router, experts }))
            } else {
                None
            };
            let shared = match src {
                Source::Gguf(_) => {
                    SharedMlp { gate: w(&p("ffn_gate_shexp.weight"))?, up: w(&p("ffn_up_shexp.weight"))?, down: w(&p("ffn_down_shexp.weight"))? }
                }
                Source::Hf(_) => {
                    let input = src.tensor(&hf("shared_mlp.input_linear.weight"))?;
                    ensure!(
                        input.shape.len() == 2 && input.shape[0].is_multiple_of(2),
                        "{}: {:?}, expected [2 × shared_intermediate_size, hidden]",
                        input.name,
                        input.shape
                    );
                    let i = input.shape[0] / 2;
                    SharedMlp {
                        gate: dev.weight(&slice_rows(&input, 0, i)?)?,
                        up: dev.weight(&slice_rows(&input, i, i)?)?,
                        down: w(&hf("shared_mlp.output_linear.weight"))?,
                    }
                }
            };
            blocks.push(Block { in_norm: v(&p("attn_norm.weight"))?, mixer, post_norm: v(&p("ffn_norm.weight"))?, moe, shared });
            progress(l + 1, layers);
        }
        let head = if src.has_tensor("output.weight") { Some(w("output.weight")?) } else { None };
        Ok(GraniteHybrid { embed: w("token_embd.weight")?, blocks, out_norm: v("output_norm.weight")?, head, state, cfg })
    }
}

impl<D: RecurrentOps + MoeOps> Model<D> for GraniteHybrid<D> {
    fn kv_layers(&self) -> Vec<KvShape> {
        let shape = KvShape { kv_heads: self.cfg.kv_heads, head_dim: self.cfg.head_dim };
        self.cfg.mamba.iter().filter(|&&m| !m).map(|_| shape).collect()
    }

    fn layer_states(&self) -> Vec<LayerState> {
        // Mamba2: the conv tail and the scan state, both kept by a mark.
        self.cfg.mamba.iter().map(|&m| if m { LayerState::Ssm } else { LayerState::Kv }).collect()
    }

    model_sizes!(state);

    /// The conv and the scan step token by token, the rest is row-wise: any
    /// chunking gives the same bits.
    fn chunk_invariant(&self) -> bool {
        true
    }

    fn forward(&self, dev: &D, batch: &Batch<'_>, mem: &mut Memory<D>, s: &mut Scratch<D>) -> Result<()> {
        let c = &self.cfg;
        let seqs = state_seqs(batch)?;
        let shape = c.mamba_shape();
        dev.embed(&self.embed, batch.tokens, c.embedding_multiplier, &mut s.x);
        for (l, b) in self.blocks.iter().enumerate() {
            dev.rms_norm(&s.x, &b.in_norm, c.eps, &mut s.h);
            match &b.mixer {
                Mixer::Mamba(m) => m.forward(dev, &shape, s, &mut mem.state, &seqs)?,
                Mixer::Attention(a, kv) => {
                    a.forward(dev, s, &mut mem.kv, *kv, batch, batch.slots, &batch.seqs, c.head_dim, c.rope.as_ref(), c.eps, c.attention_multiplier, None);
                }
            }
            dev.map(&mut s.out, Map::Scale(c.residual_multiplier));
            dev.add(&mut s.x, &s.out);

            // The experts plus the shared MLP, together scaled into the residual.
            dev.rms_norm(&s.x, &b.post_norm, c.eps, &mut s.h);
            match &b.moe {
                Some((router, moe)) => {
                    moe.routed(dev, router, s)?;
                    let [.., shared] = extras::<D, 7>(dev, &mut s.extra);
                    dev.matmul(&s.h, &[&b.shared.gate, &b.shared.up], &mut [&mut s.gate, &mut s.up]);
                    dev.gated(Act::Silu, &s.gate, &s.up, &mut s.act);
                    dev.matmul(&s.act, &[&b.shared.down], &mut [&mut *shared]);
                    dev.add(&mut s.out, shared);
                }
                None => gated_mlp(dev, s, Act::Silu, &b.shared.gate, &b.shared.up, &b.shared.down),
            }
            dev.map(&mut s.out, Map::Scale(c.residual_multiplier));
            dev.add(&mut s.x, &s.out);
            s.tap(dev, l);
        }
        lm_head(dev, s, batch.logit_rows, &self.out_norm, c.eps, self.head.as_ref().unwrap_or(&self.embed), None);
        if c.logits_scaling != 1.0 {
            dev.map(&mut s.logits, Map::Scale(1.0 / c.logits_scaling));
        }
        Ok(())
    }
}
