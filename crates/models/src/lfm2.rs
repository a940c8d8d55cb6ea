//! LFM2 and LFM2-MoE (Liquid): pre-norm blocks whose operator is either a
//! gated short convolution or grouped-query attention with per-head q/k
//! norms and RoPE; a SwiGLU MLP, or (LFM2-MoE, past the first dense layers)
//! a sigmoid-routed mixture of SwiGLU experts; a final norm and a tied head.
//!
//! The conv operator: `B, C, x = in_proj(h)`; `y = conv(B ⊙ x)` (a causal
//! depthwise filter of `L_cache` taps over time); `out_proj(C ⊙ y)`. Its
//! state is the last `L_cache - 1` values of `B ⊙ x` per channel.

use anyhow::{bail, ensure, Result};
use braid_ops::{Act, Device, KvShape, MoeOps, RecurrentOps, Rope};

use crate::blocks::{gated_mlp, model_sizes, Attention};
use crate::moe::{slice_rows, Activation, Experts, Moe, Router, Scoring};
use crate::recurrent::{extras, gguf_kv_heads, hf_config, state_seqs, StateLayout};
use crate::source::Source;
use crate::{lm_head, Batch, LayerState, Memory, Model, Scratch};

#[derive(Clone, Debug)]
pub struct Lfm2Config {
    pub hidden: usize,
    pub layers: usize,
    /// Per layer: attention (true) or short conv (false).
    pub attention: Vec<bool>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f32,
    /// Conv taps (`conv_L_cache`).
    pub kernel: usize,
    pub rope: Rope,
    pub context: usize,
    /// LFM2-MoE: layers from `dense_layers` on use the mixture.
    pub moe: Option<Lfm2Moe>,
}

#[derive(Clone, Debug)]
pub struct Lfm2Moe {
    pub dense_layers: usize,
    pub experts: usize,
    pub top_k: usize,
    pub normalize: bool,
    pub scale: f32,
    pub expert_bias: bool,
}

impl Lfm2Config {
    pub fn from_source(src: &Source) -> Result<Lfm2Config> {
        match src {
            Source::Gguf(g) => Self::from_gguf(g),
            Source::Hf(_) => Self::from_hf(src),
        }
    }

    /// llama.cpp's keys (`lfm2.*`, `lfm2moe.*`): attention layers are those
    /// with KV heads in the per-layer `attention.head_count_kv`.
    fn from_gguf(g: &braid_formats::gguf::Gguf) -> Result<Lfm2Config> {
        let arch = g.architecture()?.to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let hidden = g.get_usize(&key("embedding_length"))?;
        let layers = g.get_usize(&key("block_count"))?;
        let heads = g.get_usize(&key("attention.head_count"))?;
        let kv = gguf_kv_heads(g, &arch, layers)?;
        let head_dim = hidden.checked_div(heads).unwrap_or(0);
        let moe = if arch == "lfm2moe" {
            if let Some(f) = g.opt_u64(&key("expert_gating_func"))? {
                ensure!(f == 2, "{}: {} is {f}; LFM2-MoE routes by sigmoid (2)", g.path().display(), key("expert_gating_func"));
            }
            Some(Lfm2Moe {
                dense_layers: g.opt_u64(&key("leading_dense_block_count"))?.unwrap_or(0) as usize,
                experts: g.get_usize(&key("expert_count"))?,
                top_k: g.get_usize(&key("expert_used_count"))?,
                // llama.cpp always renormalises LFM2-MoE's weights; the converter writes no scale.
                normalize: g.opt_bool(&key("expert_weights_norm"))?.unwrap_or(true),
                scale: g.opt_f32(&key("expert_weights_scale"))?.filter(|&s| s != 0.0).unwrap_or(1.0),
                expert_bias: (0..layers).any(|l| g.has_tensor(&format!("blk.{l}.exp_probs_b.bias"))),
            })
        } else {
            None
        };
        Ok(Lfm2Config {
            hidden,
            layers,
            attention: kv.iter().map(|&k| k > 0).collect(),
            heads,
            kv_heads: kv.iter().copied().max().unwrap_or(0) as usize,
            head_dim,
            vocab: g.tensor("token_embd.weight")?.shape[0],
            eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            kernel: g.get_usize(&key("shortconv.l_cache"))?,
            rope: Rope::new(g.opt_f32(&key("rope.freq_base"))?.unwrap_or(1_000_000.0), head_dim, true),
            context: g.opt_u64(&key("context_length"))?.unwrap_or(128_000) as usize,
            moe,
        })
    }

    fn from_hf(src: &Source) -> Result<Lfm2Config> {
        let arch = src.architecture()?;
        let c = hf_config(src, &arch)?;
        let hidden = c.usize("hidden_size")?;
        let layers = c.usize("num_hidden_layers")?;
        let heads = c.usize("num_attention_heads")?;
        // transformers 5.x writes layer_types; Hub configs may list full_attn_idxs.
        let attention = match c.layer_types(layers)? {
            Some(t) => t
                .iter()
                .map(|k| match k.as_str() {
                    "conv" => Ok(false),
                    "full_attention" | "attention" => Ok(true),
                    other => bail!("{}: layer type `{other}` (expected conv or full_attention)", src.path().display()),
                })
                .collect::<Result<Vec<bool>>>()?,
            None => {
                let Some(idx) = c.get("full_attn_idxs").and_then(|v| v.as_array()) else {
                    bail!("{}: config.json has neither layer_types nor full_attn_idxs", src.path().display())
                };
                let idx: Vec<usize> = idx.iter().filter_map(|v| v.as_u64().map(|v| v as usize)).collect();
                ensure!(idx.iter().all(|&i| i < layers), "{}: full_attn_idxs past {layers} layers", src.path().display());
                (0..layers).map(|l| idx.contains(&l)).collect()
            }
        };
        ensure!(heads > 0 && hidden.is_multiple_of(heads), "{}: hidden {hidden} over {heads} heads", src.path().display());
        let head_dim = hidden.checked_div(heads).unwrap_or(0);
        let kernel = c.opt_usize("conv_L_cache")?.unwrap_or(3);
        ensure!(kernel >= 1, "{}: conv_L_cache of 0", src.path().display());
        let moe = if arch == "lfm2_moe" {
            Some(Lfm2Moe {
                dense_layers: c.usize("num_dense_layers")?,
                experts: c.usize("num_experts")?,
                top_k: c.usize("num_experts_per_tok")?,
                normalize: c.opt_bool("norm_topk_prob")?.unwrap_or(true),
                scale: c.opt_f32("routed_scaling_factor")?.unwrap_or(1.0),
                expert_bias: c.opt_bool("use_expert_bias")?.unwrap_or(false),
            })
        } else {
            None
        };
        Ok(Lfm2Config {
            hidden,
            layers,
            attention,
            heads,
            kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(heads),
            head_dim,
            vocab: c.usize("vocab_size")?,
            eps: c.opt_f32("norm_eps")?.unwrap_or(1e-5),
            kernel,
            rope: Rope::new(c.rope(None, 1_000_000.0)?.theta, head_dim, true),
            context: c.opt_usize("max_position_embeddings")?.unwrap_or(128_000),
            moe,
        })
    }
}

/// The gated short convolution.
struct ShortConv<D: Device> {
    in_b: D::Weight,
    in_c: D::Weight,
    in_x: D::Weight,
    /// `[hidden × kernel]`, channel-major.
    filter: D::Tensor,
    bias: Option<D::Tensor>,
    /// `conv_bias` also biases both projections: in_proj's (B, C, x thirds) and out_proj's.
    in_bias: Option<[D::Tensor; 3]>,
    out: D::Weight,
    out_bias: Option<D::Tensor>,
    /// Where this layer's tail of inputs sits in the state row.
    state_at: usize,
}

enum Operator<D: Device> {
    Conv(ShortConv<D>),
    /// With this layer's index in the KV pool.
    Attention(Attention<D>, usize),
}

enum FeedForward<D: Device> {
    Mlp { w1: D::Weight, w3: D::Weight, w2: D::Weight },
    Moe { gate: D::Weight, moe: Moe<D> },
}

struct Block<D: Device> {
    operator_norm: D::Tensor,
    op: Operator<D>,
    ffn_norm: D::Tensor,
    ffn: FeedForward<D>,
}

pub struct Lfm2<D: Device> {
    pub cfg: Lfm2Config,
    embed: D::Weight,
    blocks: Vec<Block<D>>,
    /// Named `embedding_norm`, but applied after the last block.
    out_norm: D::Tensor,
    /// None when the head is tied to the embeddings.
    head: Option<D::Weight>,
    state: StateLayout,
}

impl<D: Device> Lfm2<D> {
    pub fn load(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<Lfm2<D>> {
        let cfg = Lfm2Config::from_source(src)?;
        crate::config::check_lfm2(&cfg, src)?;
        let w = |n: &str| dev.weight(&src.tensor(n)?);
        let v = |n: &str| dev.vector(&src.tensor(n)?, 0.0);
        let h = cfg.hidden;
        let mut state = StateLayout::default();
        let mut kv = 0;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = |n: &str| format!("blk.{l}.{n}");
            let op = if cfg.attention[l] {
                kv += 1;
                Operator::Attention(Attention::load_gguf(&w, &v, l, true)?.checked(dev, l, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden)?, kv - 1)
            } else {
                let in_proj = src.tensor(&p("shortconv.in_proj.weight"))?;
                ensure!(in_proj.shape == [3 * h, h], "{}: {:?}, expected [{}, {h}]", in_proj.name, in_proj.shape, 3 * h);
                let filter = src.tensor(&p("shortconv.conv.weight"))?;
                ensure!(filter.elements() == h * cfg.kernel, "{}: {:?}, expected [{h}, 1, {}]", filter.name, filter.shape, cfg.kernel);
                let bias_name = p("shortconv.conv.bias");
                let in_bias = match src.has_tensor(&p("shortconv.in_proj.bias")) {
                    true => {
                        let b = src.tensor(&p("shortconv.in_proj.bias"))?.to_f32()?;
                        ensure!(b.len() == 3 * h, "{}: {} values, expected {}", p("shortconv.in_proj.bias"), b.len(), 3 * h);
                        Some([dev.upload(&b[..h], 1, h)?, dev.upload(&b[h..2 * h], 1, h)?, dev.upload(&b[2 * h..], 1, h)?])
                    }
                    false => None,
                };
                let out_bias_name = p("shortconv.out_proj.bias");
                Operator::Conv(ShortConv {
                    // in_proj's rows are B, C, x in that order.
                    in_b: dev.weight(&slice_rows(&in_proj, 0, h)?)?,
                    in_c: dev.weight(&slice_rows(&in_proj, h, h)?)?,
                    in_x: dev.weight(&slice_rows(&in_proj, 2 * h, h)?)?,
                    filter: dev.vector(&filter, 0.0)?,
                    bias: if src.has_tensor(&bias_name) { Some(v(&bias_name)?) } else { None },
                    in_bias,
                    out: w(&p("shortconv.out_proj.weight"))?,
                    out_bias: if src.has_tensor(&out_bias_name) { Some(v(&out_bias_name)?) } else { None },
                    state_at: state.take(h * (cfg.kernel - 1)),
                })
            };
            let ffn = match &cfg.moe {
                Some(m) if l >= m.dense_layers => {
                    let router = Router {
                        scoring: Scoring::Sigmoid,
                        top_k: m.top_k,
                        choice_bias: if m.expert_bias { Some(src.tensor(&p("exp_probs_b.bias"))?.to_f32()?) } else { None },
                        normalize: m.normalize,
                        norm_eps: 1e-6,
                        scale: m.scale,
                        per_expert_scale: None,
                    };
                    let experts = Experts::load_stacked(
                        dev,
                        src,
                        m.experts,
                        Activation::Gated(Act::Silu),
                        Some(&p("ffn_gate_exps.weight")),
                        &p("ffn_up_exps.weight"),
                        &p("ffn_down_exps.weight"),
                    )?;
                    FeedForward::Moe { gate: w(&p("ffn_gate_inp.weight"))?, moe: Moe { router, experts } }
                }
                _ => FeedForward::Mlp { w1: w(&p("ffn_gate.weight"))?, w3: w(&p("ffn_up.weight"))?, w2: w(&p("ffn_down.weight"))? },
            };
            blocks.push(Block { operator_norm: v(&p("attn_norm.weight"))?, op, ffn_norm: v(&p("ffn_norm.weight"))?, ffn });
            progress(l + 1, cfg.layers);
        }
        let head = if src.has_tensor("output.weight") { Some(w("output.weight")?) } else { None };
        Ok(Lfm2 { embed: w("token_embd.weight")?, blocks, out_norm: v("token_embd_norm.weight")?, head, state, cfg })
    }
}

impl<D: RecurrentOps + MoeOps> Model<D> for Lfm2<D> {
    fn kv_layers(&self) -> Vec<KvShape> {
        let shape = KvShape { kv_heads: self.cfg.kv_heads, head_dim: self.cfg.head_dim };
        self.cfg.attention.iter().filter(|&&a| a).map(|_| shape).collect()
    }

    fn layer_states(&self) -> Vec<LayerState> {
        self.cfg.attention.iter().map(|&a| if a { LayerState::Kv } else { LayerState::Conv }).collect()
    }

    model_sizes!(state);

    /// Every op works row by row or, for the conv, tap by tap in time
    /// order, so any chunking gives the same bits.
    fn chunk_invariant(&self) -> bool {
        true
    }

    fn forward(&self, dev: &D, batch: &Batch<'_>, mem: &mut Memory<D>, s: &mut Scratch<D>) -> Result<()> {
        let c = &self.cfg;
        let seqs = state_seqs(batch)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        dev.embed(&self.embed, batch.tokens, 1.0, &mut s.x);
        for (l, b) in self.blocks.iter().enumerate() {
            dev.rms_norm(&s.x, &b.operator_norm, c.eps, &mut s.h);
            match &b.op {
                Operator::Conv(cv) => {
                    // y = C · conv(B · x), the three from one input.
                    let [bb, cc, xx, bx, y] = extras(dev, &mut s.extra);
                    dev.matmul(&s.h, &[&cv.in_b, &cv.in_c, &cv.in_x], &mut [&mut *bb, &mut *cc, &mut *xx]);
                    if let Some([b0, b1, b2]) = &cv.in_bias {
                        dev.add(bb, b0);
                        dev.add(cc, b1);
                        dev.add(xx, b2);
                    }
                    dev.gated(Act::Identity, bb, xx, bx);
                    dev.short_conv(bx, &cv.filter, cv.bias.as_ref(), c.kernel, false, &mut mem.state, cv.state_at, &seqs, y)?;
                    dev.gated(Act::Identity, cc, y, bx);
                    dev.matmul(bx, &[&cv.out], &mut [&mut s.out]);
                    if let Some(b) = &cv.out_bias {
                        dev.add(&mut s.out, b);
                    }
                }
                Operator::Attention(a, kv) => {
                    a.forward(dev, s, &mut mem.kv, *kv, batch, batch.slots, &batch.seqs, c.head_dim, Some(&c.rope), c.eps, scale, None);
                }
            }
            dev.add(&mut s.x, &s.out);
            dev.rms_norm(&s.x, &b.ffn_norm, c.eps, &mut s.h);
            match &b.ffn {
                FeedForward::Mlp { w1, w3, w2 } => {
                    gated_mlp(dev, s, Act::Silu, w1, w3, w2);
                }
                FeedForward::Moe { gate, moe } => {
                    moe.routed(dev, gate, s)?;
                }
            }
            dev.add(&mut s.x, &s.out);
            s.tap(dev, l);
        }
        lm_head(dev, s, batch.logit_rows, &self.out_norm, c.eps, self.head.as_ref().unwrap_or(&self.embed), None);
        Ok(())
    }
}
