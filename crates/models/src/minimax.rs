//! MiniMax-Text-01 (`minimax`): lightning (linear) attention layers with a
//! few softmax attention layers among them, and a softmax-routed mixture of
//! SwiGLU experts in every layer.
//!
//! The residuals are taken after the norms, each branch weighted:
//! `x = norm(h); h = α·x + β·mixer(x)`, then the same around the MoE.
//!
//! Lightning attention: `q, k, v = silu(qkv_proj(x))` per head; with a decay
//! `e^(-slope)` per head, `S = e^(-slope)·S + kᵀv` and `o = q·S`; the heads'
//! outputs are normalised together, gated by `sigmoid(output_gate(x))` and
//! projected. Its state is `S`, `[head_dim, head_dim]` per head.

use anyhow::{bail, ensure, Result};
use braid_ops::{Act, Device, KvShape, Map, MoeOps, RecurrentOps, Rope};

use crate::blocks::{model_sizes, Attention};
use crate::moe::{Activation, Experts, Moe, Router, Scoring};
use crate::recurrent::{extras, hf_config, state_seqs, StateLayout};
use crate::source::Source;
use crate::{lm_head, Batch, LayerState, Memory, Model, Scratch};

/// The lightning-attention output norm's epsilon: transformers uses its
/// default here whatever `rms_norm_eps` says.
const LINEAR_NORM_EPS: f32 = 1e-6;

#[derive(Clone, Debug)]
pub struct MiniMaxConfig {
    pub hidden: usize,
    pub layers: usize,
    /// Per layer: softmax attention (true) or lightning attention (false).
    pub full: Vec<bool>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f32,
    pub rope: Rope,
    pub context: usize,
    pub experts: usize,
    pub top_k: usize,
    /// (α, β) of the residuals: lightning layers, softmax layers, MoE.
    pub linear_ab: (f32, f32),
    pub full_ab: (f32, f32),
    pub mlp_ab: (f32, f32),
}

impl MiniMaxConfig {
    pub fn from_source(src: &Source) -> Result<MiniMaxConfig> {
        let c = hf_config(src, "minimax")?;
        let path = src.path();
        let path = path.display();
        let hidden = c.usize("hidden_size")?;
        let layers = c.usize("num_hidden_layers")?;
        let heads = c.usize("num_attention_heads")?;
        ensure!(heads > 0 && layers > 0, "{path}: {heads} heads, {layers} layers");
        let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0));
        // transformers 5.x: layer_types; Hub: attn_type_list (0 = lightning, 1 = softmax).
        let full: Vec<bool> = if let Some(t) = c.layer_types(layers)? {
            t.iter()
                .map(|k| match k.as_str() {
                    "full_attention" => Ok(true),
                    "linear_attention" => Ok(false),
                    other => bail!("{path}: layer type `{other}` (expected full_attention or linear_attention)"),
                })
                .collect::<Result<_>>()?
        } else if let Some(list) = c.get("attn_type_list") {
            let Some(list) = list.as_array() else { bail!("{path}: attn_type_list is not a list") };
            ensure!(list.len() == layers, "{path}: attn_type_list names {} layers, the model has {layers}", list.len());
            list.iter()
                .map(|v| match v.as_u64() {
                    Some(0) => Ok(false),
                    Some(1) => Ok(true),
                    _ => bail!("{path}: attn_type_list holds {v} (expected 0 or 1)"),
                })
                .collect::<Result<_>>()?
        } else {
            // transformers' default: softmax attention on even layers.
            (0..layers).map(|i| i % 2 == 0).collect()
        };
        let ab = |a: &str, b: &str| -> Result<(f32, f32)> { Ok((c.opt_f32(a)?.unwrap_or(1.0), c.opt_f32(b)?.unwrap_or(1.0))) };
        Ok(MiniMaxConfig {
            hidden,
            layers,
            full,
            heads,
            kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(heads),
            head_dim,
            vocab: c.usize("vocab_size")?,
            eps: c.opt_f32("rms_norm_eps")?.unwrap_or(1e-5),
            // transformers rotates the whole head (it ignores `rotary_dim`).
            rope: Rope::new(c.rope(None, 10_000.0)?.theta, head_dim, true),
            context: c.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            experts: c.usize("num_local_experts")?,
            top_k: c.usize("num_experts_per_tok")?,
            linear_ab: ab("linear_attn_alpha_factor", "linear_attn_beta_factor")?,
            full_ab: ab("full_attn_alpha_factor", "full_attn_beta_factor")?,
            mlp_ab: ab("mlp_alpha_factor", "mlp_beta_factor")?,
        })
    }

    /// The decay rate of each head of lightning layer `layer`: a geometric
    /// series over heads, smaller in deeper layers.
    pub fn slopes(&self, layer: usize) -> Vec<f32> {
        let base = 2f64.powf(-8.0 / self.heads as f64);
        let depth = 1.0 - layer as f64 / (self.layers as f64 - 1.0 + 1e-5) + 1e-5;
        (0..self.heads).map(|h| (base.powi(h as i32 + 1) * depth) as f32).collect()
    }
}

struct Lightning<D: Device> {
    qkv: D::Weight,
    gate: D::Weight,
    norm: D::Tensor,
    out: D::Weight,
    slopes: D::Tensor,
    state_at: usize,
}

enum Mixer<D: Device> {
    Lightning(Lightning<D>),
    /// With this layer's index in the KV pool.
    Attention(Attention<D>, usize),
}

struct Block<D: Device> {
    in_norm: D::Tensor,
    mixer: Mixer<D>,
    post_norm: D::Tensor,
    gate: D::Weight,
    moe: Moe<D>,
}

pub struct MiniMax<D: Device> {
    pub cfg: MiniMaxConfig,
    embed: D::Weight,
    blocks: Vec<Block<D>>,
    out_norm: D::Tensor,
    head: Option<D::Weight>,
    state: StateLayout,
}

impl<D: Device> MiniMax<D> {
    pub fn load(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<MiniMax<D>> {
        let cfg = MiniMaxConfig::from_source(src)?;
        crate::config::check_minimax(&cfg, src)?;
        let w = |n: &str| dev.weight(&src.tensor(n)?);
        let v = |n: &str| dev.vector(&src.tensor(n)?, 0.0);
        let mut state = StateLayout::default();
        let mut kv = 0;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = |n: &str| format!("model.layers.{l}.{n}");
            let mixer = if cfg.full[l] {
                kv += 1;
                Mixer::Attention(
                    Attention::load_hf(&w, &v, &p("self_attn."), "o_proj", None)?.checked(dev, l, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden)?,
                    kv - 1,
                )
            } else {
                Mixer::Lightning(Lightning {
                    qkv: w(&p("self_attn.qkv_proj.weight"))?,
                    gate: w(&p("self_attn.output_gate.weight"))?,
                    norm: v(&p("self_attn.norm.weight"))?,
                    out: w(&p("self_attn.out_proj.weight"))?,
                    // Computed, not read: the file's decay tables are derived buffers.
                    slopes: dev.upload(&cfg.slopes(l), 1, cfg.heads)?,
                    state_at: state.take(cfg.heads * cfg.head_dim * cfg.head_dim),
                })
            };
            let e = |n: String| p(&format!("block_sparse_moe.experts.{n}"));
            let experts = Experts::load_split(dev, src, cfg.experts, Activation::Gated(Act::Silu), |x| {
                (Some(e(format!("{x}.w1.weight"))), e(format!("{x}.w3.weight")), e(format!("{x}.w2.weight")))
            })?;
            let router = Router { scoring: Scoring::Softmax, top_k: cfg.top_k, ..Router::default() };
            blocks.push(Block {
                in_norm: v(&p("input_layernorm.weight"))?,
                mixer,
                post_norm: v(&p("post_attention_layernorm.weight"))?,
                gate: w(&p("block_sparse_moe.gate.weight"))?,
                moe: Moe { router, experts },
            });
            progress(l + 1, cfg.layers);
        }
        let head = if src.has_tensor("lm_head.weight") { Some(w("lm_head.weight")?) } else { None };
        Ok(MiniMax { embed: w("model.embed_tokens.weight")?, blocks, out_norm: v("model.norm.weight")?, head, state, cfg })
    }
}

impl<D: RecurrentOps + MoeOps> Model<D> for MiniMax<D> {
    fn kv_layers(&self) -> Vec<KvShape> {
        let shape = KvShape { kv_heads: self.cfg.kv_heads, head_dim: self.cfg.head_dim };
        self.cfg.full.iter().filter(|&&f| f).map(|_| shape).collect()
    }

    fn layer_states(&self) -> Vec<LayerState> {
        self.cfg.full.iter().map(|&f| if f { LayerState::Kv } else { LayerState::LinearAttention }).collect()
    }

    model_sizes!(state);

    /// Lightning attention runs its recurrence token by token (not in
    /// blocks), the rest is row-wise: any chunking gives the same bits.
    fn chunk_invariant(&self) -> bool {
        true
    }

    fn forward(&self, dev: &D, batch: &Batch<'_>, mem: &mut Memory<D>, s: &mut Scratch<D>) -> Result<()> {
        let c = &self.cfg;
        let seqs = state_seqs(batch)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        dev.embed(&self.embed, batch.tokens, 1.0, &mut s.x);
        for (l, b) in self.blocks.iter().enumerate() {
            // The residual of both branches is the normed stream h: x = α·h + β·f(h).
            dev.rms_norm(&s.x, &b.in_norm, c.eps, &mut s.h);
            let (alpha, beta) = match &b.mixer {
                Mixer::Lightning(m) => {
                    let [qkv, gate, normed] = extras(dev, &mut s.extra);
                    dev.matmul(&s.h, &[&m.qkv, &m.gate], &mut [&mut *qkv, &mut *gate]);
                    dev.map(qkv, Map::Silu);
                    dev.linear_attention(qkv, &m.slopes, c.heads, c.head_dim, &mut mem.state, m.state_at, &seqs, &mut s.att)?;
                    dev.rms_norm(&s.att, &m.norm, LINEAR_NORM_EPS, normed);
                    dev.gated(Act::Sigmoid, gate, normed, &mut s.act);
                    dev.matmul(&s.act, &[&m.out], &mut [&mut s.out]);
                    c.linear_ab
                }
                Mixer::Attention(a, kv) => {
                    a.forward(dev, s, &mut mem.kv, *kv, batch, batch.slots, &batch.seqs, c.head_dim, Some(&c.rope), c.eps, scale, None);
                    c.full_ab
                }
            };
            residual(dev, s, alpha, beta);

            dev.rms_norm(&s.x, &b.post_norm, c.eps, &mut s.h);
            b.moe.routed(dev, &b.gate, s)?;
            let (alpha, beta) = c.mlp_ab;
            residual(dev, s, alpha, beta);
            s.tap(dev, l);
        }
        lm_head(dev, s, batch.logit_rows, &self.out_norm, c.eps, self.head.as_ref().unwrap_or(&self.embed), None);
        Ok(())
    }
}

/// `x = α·h + β·out`: a branch's output joins its scaled input.
fn residual<D: Device>(dev: &D, s: &mut Scratch<D>, alpha: f32, beta: f32) {
    dev.map(&mut s.out, Map::Scale(beta));
    dev.map(&mut s.h, Map::Scale(alpha));
    std::mem::swap(&mut s.x, &mut s.out);
    dev.add(&mut s.x, &s.h);
}
