//! Nemotron-H (NVIDIA): every block is one mixer behind a pre-norm and a
//! residual — Mamba2, attention (no positional encoding), a squared-ReLU
//! MLP, or a sigmoid-routed mixture of squared-ReLU experts with a shared
//! expert; a final norm and an untied head.
//!
//! Mamba2 is `mamba2.rs`'s. `dt` is clamped to `time_step_min` in every pass: transformers does
//! so in prefill only, which makes its own decode drift (see the fixtures'
//! README); clamping in both keeps prefill and decode one computation.

use anyhow::{bail, ensure, Result};
use braid_ops::{Device, KvShape, Map, MoeOps, RecurrentOps, SsmShape};

use crate::blocks::{model_sizes, Attention};
use crate::mamba2::{Mamba2, Mamba2Shape};
use crate::moe::{Activation, Experts, Moe, Router, Scoring};
use crate::recurrent::{extras, hf_config, state_seqs, StateLayout};
use crate::source::Source;
use crate::{lm_head, Batch, LayerState, Memory, Model, Scratch};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mixer {
    Mamba,
    Attention,
    Mlp,
    Moe,
}

#[derive(Clone, Debug)]
pub struct NemotronHConfig {
    pub hidden: usize,
    pub mixers: Vec<Mixer>,
    pub vocab: usize,
    pub eps: f32,
    pub context: usize,
    // Mamba2.
    pub ssm: SsmShape,
    pub conv_kernel: usize,
    // Attention.
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    // Mixture of experts.
    pub experts: usize,
    pub top_k: usize,
    pub normalize: bool,
    pub routed_scale: f32,
}

/// transformers' `time_step_min` when a config leaves it out (and a GGUF,
/// which has no field for it).
const TIME_STEP_MIN: f32 = 0.001;

impl NemotronHConfig {
    pub fn from_source(src: &Source) -> Result<NemotronHConfig> {
        match src {
            Source::Gguf(g) => Self::from_gguf(g),
            Source::Hf(_) => Self::from_hf(src),
        }
    }

    /// llama.cpp's keys (`nemotron_h.*`, `nemotron_h_moe.*`); each block's
    /// mixer is told by the tensors it holds. The GGUF keeps no dt limits:
    /// dt is clamped to transformers' default `time_step_min`, as from an
    /// HF folder that leaves it out.
    fn from_gguf(g: &braid_formats::gguf::Gguf) -> Result<NemotronHConfig> {
        let arch = g.architecture()?.to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let path = g.path().display();
        let layers = g.get_usize(&key("block_count"))?;
        let mixers: Vec<Mixer> = (0..layers)
            .map(|l| {
                let has = |n: &str| g.has_tensor(&format!("blk.{l}.{n}.weight"));
                if has("ssm_in") {
                    Ok(Mixer::Mamba)
                } else if has("attn_q") {
                    Ok(Mixer::Attention)
                } else if has("ffn_gate_inp") {
                    Ok(Mixer::Moe)
                } else if has("ffn_up") {
                    Ok(Mixer::Mlp)
                } else {
                    bail!("{path}: block {l} has none of ssm_in, attn_q, ffn_gate_inp, ffn_up (which mixer is it?)")
                }
            })
            .collect::<Result<_>>()?;
        let per_layer_max = |k: &str| -> Result<usize> {
            let k = key(k);
            Ok(match g.get(&k).and_then(|v| v.as_array()) {
                Some(_) => g.get_u64_array(&k)?.into_iter().max().unwrap_or(0) as usize,
                None => g.get_usize(&k)?,
            })
        };
        let heads = per_layer_max("attention.head_count")?;
        let ssm_heads = g.get_usize(&key("ssm.time_step_rank"))?;
        let inner = g.get_usize(&key("ssm.inner_size"))?;
        ensure!(ssm_heads > 0 && inner.is_multiple_of(ssm_heads), "{path}: ssm.inner_size {inner} over {ssm_heads} heads (ssm.time_step_rank)");
        let hidden = g.get_usize(&key("embedding_length"))?;
        Ok(NemotronHConfig {
            hidden,
            mixers,
            vocab: g.tensor("token_embd.weight")?.shape[0],
            eps: g.get_f32(&key("attention.layer_norm_epsilon"))?,
            context: g.opt_u64(&key("context_length"))?.unwrap_or(4096) as usize,
            ssm: SsmShape {
                heads: ssm_heads,
                head_dim: inner / ssm_heads,
                state_dim: g.get_usize(&key("ssm.state_size"))?,
                groups: g.get_usize(&key("ssm.group_count"))?,
                dt_min: TIME_STEP_MIN,
                dt_max: f32::INFINITY,
            },
            conv_kernel: g.get_usize(&key("ssm.conv_kernel"))?,
            heads,
            kv_heads: per_layer_max("attention.head_count_kv")?,
            head_dim: match g.opt_u64(&key("attention.key_length"))? {
                Some(d) => d as usize,
                None => hidden.checked_div(heads).unwrap_or(0),
            },
            experts: g.opt_u64(&key("expert_count"))?.unwrap_or(0) as usize,
            top_k: g.opt_u64(&key("expert_used_count"))?.unwrap_or(0) as usize,
            normalize: g.opt_bool(&key("expert_weights_norm"))?.unwrap_or(true),
            routed_scale: g.opt_f32(&key("expert_weights_scale"))?.filter(|&s| s != 0.0).unwrap_or(1.0),
        })
    }

    fn from_hf(src: &Source) -> Result<NemotronHConfig> {
        let c = hf_config(src, "nemotron_h")?;
        let path = src.path();
        let path = path.display();
        // transformers 5.x: layers_block_type (with "linear_attention" for
        // Mamba2); Hub configs: hybrid_override_pattern such as "M-M*-E".
        let mixers: Vec<Mixer> = if let Some(list) = c.get("layers_block_type").or_else(|| c.get("layer_types")) {
            let Some(list) = list.as_array() else { bail!("{path}: layers_block_type is not a list") };
            list.iter()
                .map(|v| match v.as_str() {
                    Some("linear_attention" | "mamba") => Ok(Mixer::Mamba),
                    Some("full_attention" | "attention") => Ok(Mixer::Attention),
                    Some("mlp") => Ok(Mixer::Mlp),
                    Some("moe") => Ok(Mixer::Moe),
                    _ => bail!("{path}: layer type {v} (expected linear_attention/mamba, full_attention, mlp or moe)"),
                })
                .collect::<Result<_>>()?
        } else if let Some(p) = c.opt_str("hybrid_override_pattern")? {
            p.chars()
                .map(|ch| match ch {
                    'M' => Ok(Mixer::Mamba),
                    '*' => Ok(Mixer::Attention),
                    '-' => Ok(Mixer::Mlp),
                    'E' => Ok(Mixer::Moe),
                    _ => bail!("{path}: hybrid_override_pattern has '{ch}' (expected M, *, - or E)"),
                })
                .collect::<Result<_>>()?
        } else {
            bail!("{path}: config.json has neither layers_block_type nor hybrid_override_pattern")
        };
        ensure!(!mixers.is_empty(), "{path}: no layers");
        if let Some(act) = c.opt_str("mlp_hidden_act")? {
            ensure!(act == "relu2", "{path}: mlp_hidden_act {act} (only relu2 is supported)");
        }
        ensure!(c.get("moe_latent_size").is_none(), "{path}: moe_latent_size (latent MoE projections) is not supported");
        for k in ["n_group", "topk_group"] {
            if let Some(g) = c.opt_usize(k)? {
                ensure!(g == 1, "{path}: {k} = {g} (only ungrouped routing is supported)");
            }
        }
        let hidden = c.usize("hidden_size")?;
        let heads = c.usize("num_attention_heads")?;
        ensure!(heads > 0, "{path}: no attention heads");
        // transformers clamps dt to [time_step_min, inf) and ignores
        // time_step_limit (its mixer sets the limit itself).
        let dt_min = c.opt_f32("time_step_min")?.unwrap_or(TIME_STEP_MIN);
        let dt_max = f32::INFINITY;
        let ssm = SsmShape {
            heads: c.usize("mamba_num_heads")?,
            head_dim: c.usize("mamba_head_dim")?,
            state_dim: c.usize("ssm_state_size")?,
            groups: c.usize("n_groups")?,
            dt_min,
            dt_max,
        };
        ensure!(ssm.groups > 0 && ssm.heads.is_multiple_of(ssm.groups), "{path}: {} Mamba heads in {} groups", ssm.heads, ssm.groups);
        let conv_kernel = c.usize("conv_kernel")?;
        ensure!(conv_kernel >= 1, "{path}: conv_kernel of 0");
        Ok(NemotronHConfig {
            hidden,
            mixers,
            vocab: c.usize("vocab_size")?,
            eps: c.opt_f32("layer_norm_epsilon")?.or(c.opt_f32("rms_norm_eps")?).unwrap_or(1e-5),
            context: c.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            ssm,
            conv_kernel,
            heads,
            kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(heads),
            head_dim: c.opt_usize("head_dim")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0)),
            experts: c.opt_usize("n_routed_experts")?.unwrap_or(0),
            top_k: c.opt_usize("num_experts_per_tok")?.unwrap_or(0),
            normalize: c.opt_bool("norm_topk_prob")?.unwrap_or(true),
            routed_scale: c.opt_f32("routed_scaling_factor")?.unwrap_or(1.0),
        })
    }

    fn mamba(&self) -> Mamba2Shape {
        Mamba2Shape { hidden: self.hidden, ssm: self.ssm, conv_kernel: self.conv_kernel, eps: self.eps }
    }
}

/// An attention layer holds its index in the KV pool.
enum Layer<D: Device> {
    Mamba(Mamba2<D>),
    Attention(Attention<D>, usize),
    Mlp { up: D::Weight, down: D::Weight },
    Moe { gate: D::Weight, moe: Moe<D>, shared_up: D::Weight, shared_down: D::Weight },
}

struct Block<D: Device> {
    norm: D::Tensor,
    mixer: Layer<D>,
}

pub struct NemotronH<D: Device> {
    pub cfg: NemotronHConfig,
    embed: D::Weight,
    blocks: Vec<Block<D>>,
    out_norm: D::Tensor,
    head: D::Weight,
    state: StateLayout,
}

impl<D: Device> NemotronH<D> {
    pub fn load(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<NemotronH<D>> {
        let cfg = NemotronHConfig::from_source(src)?;
        crate::config::check_nemotron_h(&cfg, src)?;
        let w = |n: &str| dev.weight(&src.tensor(n)?);
        let v = |n: &str| dev.vector(&src.tensor(n)?, 0.0);
        let mut state = StateLayout::default();
        let mut kv = 0;
        let mut blocks = Vec::with_capacity(cfg.mixers.len());
        for (l, &kind) in cfg.mixers.iter().enumerate() {
            let p = |n: &str| format!("blk.{l}.{n}");
            let mixer = match kind {
                Mixer::Mamba => Layer::Mamba(Mamba2::load(dev, src, l, &cfg.mamba(), &format!("backbone.layers.{l}.mixer.A_log"), &mut state)?),
                Mixer::Attention => {
                    kv += 1;
                    Layer::Attention(Attention::load_gguf(&w, &v, l, false)?.checked(dev, l, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden)?, kv - 1)
                }
                Mixer::Mlp => Layer::Mlp { up: w(&p("ffn_up.weight"))?, down: w(&p("ffn_down.weight"))? },
                Mixer::Moe => {
                    let router = Router {
                        scoring: Scoring::Sigmoid,
                        top_k: cfg.top_k,
                        choice_bias: Some(src.tensor(&p("exp_probs_b.bias"))?.to_f32()?),
                        normalize: cfg.normalize,
                        norm_eps: 1e-20,
                        scale: cfg.routed_scale,
                        per_expert_scale: None,
                    };
                    let experts = Experts::load_stacked(
                        dev,
                        src,
                        cfg.experts,
                        Activation::Plain(Map::Relu2),
                        None,
                        &p("ffn_up_exps.weight"),
                        &p("ffn_down_exps.weight"),
                    )?;
                    Layer::Moe {
                        gate: w(&p("ffn_gate_inp.weight"))?,
                        moe: Moe { router, experts },
                        shared_up: w(&p("ffn_up_shexp.weight"))?,
                        shared_down: w(&p("ffn_down_shexp.weight"))?,
                    }
                }
            };
            blocks.push(Block { norm: v(&p("attn_norm.weight"))?, mixer });
            progress(l + 1, cfg.mixers.len());
        }
        Ok(NemotronH { embed: w("token_embd.weight")?, blocks, out_norm: v("output_norm.weight")?, head: w("output.weight")?, state, cfg })
    }
}

impl<D: RecurrentOps + MoeOps> Model<D> for NemotronH<D> {
    fn kv_layers(&self) -> Vec<KvShape> {
        let shape = KvShape { kv_heads: self.cfg.kv_heads, head_dim: self.cfg.head_dim };
        self.cfg.mixers.iter().filter(|&&m| m == Mixer::Attention).map(|_| shape).collect()
    }

    fn layer_states(&self) -> Vec<LayerState> {
        self.cfg
            .mixers
            .iter()
            .map(|m| match m {
                // The conv tail and the scan state, both kept by a mark.
                Mixer::Mamba => LayerState::Ssm,
                Mixer::Attention => LayerState::Kv,
                Mixer::Mlp | Mixer::Moe => LayerState::None,
            })
            .collect()
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
        let mamba = c.mamba();
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        dev.embed(&self.embed, batch.tokens, 1.0, &mut s.x);
        for (l, b) in self.blocks.iter().enumerate() {
            dev.rms_norm(&s.x, &b.norm, c.eps, &mut s.h);
            match &b.mixer {
                Layer::Mamba(m) => m.forward(dev, &mamba, s, &mut mem.state, &seqs)?,
                Layer::Attention(a, kv) => {
                    // No positional encoding.
                    a.forward(dev, s, &mut mem.kv, *kv, batch, batch.slots, &batch.seqs, c.head_dim, None, c.eps, scale, None);
                }
                Layer::Mlp { up, down } => {
                    dev.matmul(&s.h, &[up], &mut [&mut s.up]);
                    dev.map(&mut s.up, Map::Relu2);
                    dev.matmul(&s.up, &[down], &mut [&mut s.out]);
                }
                Layer::Moe { gate, moe, shared_up, shared_down } => {
                    moe.routed(dev, gate, s)?;
                    // The seventh scratch buffer, after the mixture's six.
                    let [.., shared] = extras::<D, 7>(dev, &mut s.extra);
                    // The shared expert: down(relu(up(h))²), beside the routed ones.
                    dev.matmul(&s.h, &[shared_up], &mut [&mut s.up]);
                    dev.map(&mut s.up, Map::Relu2);
                    dev.matmul(&s.up, &[shared_down], &mut [&mut *shared]);
                    dev.add(&mut s.out, shared);
                }
            }
            dev.add(&mut s.x, &s.out);
            s.tap(dev, l);
        }
        lm_head(dev, s, batch.logit_rows, &self.out_norm, c.eps, &self.head, None);
        Ok(())
    }
}
