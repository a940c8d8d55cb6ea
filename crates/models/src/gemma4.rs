//! Gemma 4 (text), dense and MoE: Gemma 3's sandwich-normed blocks of
//! sliding-window and global attention, with
//! * plain `w` RMSNorms (not Gemma 3's `1 + w`), per-head q/k norms and a
//!   weightless v norm, attention scale 1;
//! * global layers with their own head dim (and kv heads), "proportional"
//!   partial RoPE, and optionally K = V (no v projection: v is the normed raw k);
//! * per-layer embeddings (PLE): each layer adds a gated projection of its
//!   own slice of a second token embedding mixed with a projection of the
//!   input embeddings;
//! * a shared-KV tail: the last layers compute no k/v and attend over the
//!   cache of the last earlier layer of their type;
//! * optionally a routed MoE beside the dense MLP in every layer;
//! * a learned scalar per layer and a final logit softcap.

use anyhow::{bail, ensure, Context, Result};
use braid_formats::TensorView;
use braid_ops::{Act, AttnSeq, Device, KvShape, Map, MoeOps, Rope};

use crate::blocks::model_sizes;
use crate::config::HfConfig;
use crate::gemma3::round_to;
use crate::moe::{slice_rows, Activation, Experts, Moe, Router, Scoring};
use crate::source::Source;
use crate::{lm_head, Batch, LayerState, Memory, Model, Scratch};

#[derive(Clone, Debug)]
pub struct LayerCfg {
    pub sliding: bool,
    pub head_dim: usize,
    pub kv_heads: usize,
    /// How the layer rotates q and k (a frequency table for "proportional"
    /// RoPE: zeros past the rotated part).
    pub rope: Rope,
    /// The pool layer this layer's k/v live in.
    pub kv_layer: usize,
    /// Whether this layer writes its own k/v (false in the shared-KV tail).
    pub stores_kv: bool,
}

#[derive(Clone, Debug)]
pub struct Gemma4Config {
    pub hidden: usize,
    pub heads: usize,
    pub vocab: usize,
    pub eps: f32,
    pub window: usize,
    pub layers: Vec<LayerCfg>,
    /// Per-layer input width (0: no per-layer embeddings).
    pub ple_dim: usize,
    /// Tokens the per-layer embedding table covers (others use token 0).
    pub ple_vocab: usize,
    pub embed_scale: f32,
    pub ple_embed_scale: f32,
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
    /// Experts and top-k of the MoE block (None: dense MLP only).
    pub moe: Option<(usize, usize)>,
    pub context: usize,
}

/// "Proportional" RoPE: over the whole head dim `d`, the first
/// `partial · d / 2` frequencies are `theta^(-2j/d)` (the exponent over the
/// full `d`), the rest zero, so those pairs pass unchanged.
pub fn proportional_freqs(theta: f32, head_dim: usize, partial: f32) -> Vec<f32> {
    let angles = (partial * head_dim as f32 / 2.0) as usize;
    (0..head_dim / 2).map(|j| if j < angles { 1.0 / theta.powf((2 * j) as f32 / head_dim as f32) } else { 0.0 }).collect()
}

fn cap(v: Option<f32>) -> Option<f32> {
    v.filter(|c| c.is_finite() && *c > 0.0)
}

impl Gemma4Config {
    pub fn from_source(src: &Source) -> Result<Gemma4Config> {
        let Source::Hf(h) = src else { bail!("{}: Gemma 4 loads from an HF folder only (no GGUF mapping yet)", src.path().display()) };
        let dir = h.dir();
        let c = HfConfig::new(h.config(), dir);
        let hidden = c.usize("hidden_size")?;
        let heads = c.usize("num_attention_heads")?;
        let n = c.usize("num_hidden_layers")?;
        let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0));
        let kv_heads = c.opt_usize("num_key_value_heads")?.unwrap_or(heads);
        let k_eq_v = c.opt_bool("attention_k_eq_v")?.unwrap_or(false);
        let types = c.layer_types(n)?.with_context(|| format!("{}: config.json has no layer_types", dir.display()))?;
        let shared = c.opt_usize("num_kv_shared_layers")?.unwrap_or(0);
        ensure!(shared <= n, "{}: num_kv_shared_layers {shared} exceeds the {n} layers", dir.display());
        let first_shared = n - shared;
        let mut layers: Vec<LayerCfg> = Vec::with_capacity(n);
        let mut pool_layers = 0;
        for (l, t) in types.iter().enumerate() {
            let sliding = match t.as_str() {
                "sliding_attention" => true,
                "full_attention" => false,
                other => bail!("{}: layer {l} has type '{other}' (expected sliding_attention or full_attention)", dir.display()),
            };
            // Global layers: transformers 5.x writes per_layer_config, Hub configs global_* keys.
            let hd = match c.per_layer_usize(l, "head_dim")? {
                Some(d) => d,
                None if !sliding => c.opt_usize("global_head_dim")?.unwrap_or(head_dim),
                None => head_dim,
            };
            let kvh = match c.per_layer_usize(l, "num_key_value_heads")? {
                Some(k) => k,
                None if !sliding && k_eq_v => c.opt_usize("num_global_key_value_heads")?.unwrap_or(kv_heads),
                None => kv_heads,
            };
            let p = c.rope(Some(t), if sliding { 10_000.0 } else { 1_000_000.0 })?;
            let rope = match p.rope_type.as_str() {
                "default" => Rope::new(p.theta, (hd as f32 * p.partial_rotary_factor) as usize, true),
                "proportional" => Rope::table(proportional_freqs(p.theta, hd, p.partial_rotary_factor)),
                other => bail!("{}: rope_type '{other}' is not supported for Gemma 4 (supported: default, proportional)", dir.display()),
            };
            let (kv_layer, stores_kv) = if l < first_shared {
                pool_layers += 1;
                (pool_layers - 1, true)
            } else {
                // The last earlier layer of the same type that has its own cache.
                let src = (0..first_shared)
                    .rev()
                    .find(|&j| layers[j].sliding == sliding)
                    .with_context(|| format!("{}: shared-KV layer {l} has no earlier {t} layer to read", dir.display()))?;
                ensure!(
                    layers[src].head_dim == hd && layers[src].kv_heads == kvh,
                    "{}: shared-KV layer {l} and its source {src} differ in shape",
                    dir.display()
                );
                (layers[src].kv_layer, false)
            };
            layers.push(LayerCfg { sliding, head_dim: hd, kv_heads: kvh, rope, kv_layer, stores_kv });
        }
        let ple_dim = c.opt_usize("hidden_size_per_layer_input")?.unwrap_or(0);
        let vocab = c.usize("vocab_size")?;
        let embed_dtype = h.tensor("model.embed_tokens.weight")?.dtype;
        let moe = if c.opt_bool("enable_moe_block")?.unwrap_or(false) { Some((c.usize("num_experts")?, c.usize("top_k_experts")?)) } else { None };
        Ok(Gemma4Config {
            hidden,
            heads,
            vocab,
            eps: c.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            window: c.opt_usize("sliding_window")?.unwrap_or(512),
            layers,
            ple_dim,
            ple_vocab: c.opt_usize("vocab_size_per_layer_input")?.unwrap_or(vocab),
            embed_scale: round_to(embed_dtype, (hidden as f32).sqrt()),
            ple_embed_scale: round_to(embed_dtype, (ple_dim as f32).sqrt()),
            attn_softcap: cap(c.opt_f32("attn_logit_softcapping")?),
            final_softcap: cap(c.opt_f32("final_logit_softcapping")?),
            moe,
            context: c.opt_usize("max_position_embeddings")?.unwrap_or(32768),
        })
    }
}

struct Attn<D: Device> {
    wq: D::Weight,
    q_norm: D::Tensor,
    /// None in the shared-KV tail.
    kv: Option<KvProj<D>>,
    wo: D::Weight,
}

struct KvProj<D: Device> {
    wk: D::Weight,
    k_norm: D::Tensor,
    /// None when K = V (v is the normed raw k projection).
    wv: Option<D::Weight>,
    /// Ones, one head wide: the weightless v norm.
    v_norm: D::Tensor,
}

struct MoeBlock<D: Device> {
    /// `router.scale · hidden^-1/2`: the router reads `rms(r) · this`.
    router_in: D::Tensor,
    router: D::Weight,
    moe: Moe<D>,
    pre_norm: D::Tensor,
    post_norm_dense: D::Tensor,
    post_norm_moe: D::Tensor,
}

struct Ple<D: Device> {
    /// `[ple_dim, hidden]`: this layer's rows of the per-layer model projection.
    model_proj: D::Weight,
    gate: D::Weight,
    proj: D::Weight,
    post_norm: D::Tensor,
}

struct Block<D: Device> {
    attn_norm: D::Tensor,
    attn: Attn<D>,
    post_attn_norm: D::Tensor,
    ffn_norm: D::Tensor,
    w_gate: D::Weight,
    w_up: D::Weight,
    w_down: D::Weight,
    post_ffn_norm: D::Tensor,
    moe: Option<MoeBlock<D>>,
    ple: Option<Ple<D>>,
    scalar: f32,
}

pub struct Gemma4<D: Device> {
    pub cfg: Gemma4Config,
    embed: D::Weight,
    /// The per-layer embedding table seen as `[ple_vocab · layers, ple_dim]`:
    /// token t's slice for layer l is row `t · layers + l`.
    ple_embed: Option<D::Weight>,
    ple_norm: Option<D::Tensor>,
    blocks: Vec<Block<D>>,
    out_norm: D::Tensor,
}

impl<D: Device> Gemma4<D> {
    pub fn load(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<Gemma4<D>> {
        let cfg = Gemma4Config::from_source(src)?;
        crate::config::check_gemma4(&cfg, src)?;
        let n = cfg.layers.len();
        let t = |name: &str| src.tensor(name);
        let w = |name: &str| dev.weight(&t(name)?);
        let v = |name: &str| dev.vector(&t(name)?, 0.0);
        let scalar = |name: &str| -> Result<f32> {
            let x = t(name)?.to_f32()?;
            ensure!(x.len() == 1, "{name}: expected one value, found {}", x.len());
            Ok(x[0])
        };
        let ones = |len: usize| dev.upload(&vec![1.0; len], 1, len);
        let (ple_embed, ple_norm, ple_model_proj) = if cfg.ple_dim > 0 {
            let table = t("model.embed_tokens_per_layer.weight")?;
            ensure!(
                table.shape == [cfg.ple_vocab, n * cfg.ple_dim],
                "{}: shape {:?}, expected [{}, {}]",
                table.name,
                table.shape,
                cfg.ple_vocab,
                n * cfg.ple_dim
            );
            let flat = TensorView { shape: vec![cfg.ple_vocab * n, cfg.ple_dim], ..table };
            (Some(dev.weight(&flat)?), Some(v("model.per_layer_projection_norm.weight")?), Some(t("model.per_layer_model_projection.weight")?))
        } else {
            (None, None, None)
        };
        let mut blocks = Vec::with_capacity(n);
        for (i, lc) in cfg.layers.iter().enumerate() {
            let p = |name: &str| format!("model.layers.{i}.{name}");
            let kv = if lc.stores_kv {
                let wv_name = p("self_attn.v_proj.weight");
                let wk = w(&p("self_attn.k_proj.weight"))?;
                // A config that misreads this layer's head dim would
                // otherwise fail in the first forward's KV write.
                let rows = dev.weight_shape(&wk).0;
                ensure!(
                    rows == lc.kv_heads * lc.head_dim,
                    "{}: layer {i}'s k_proj has {rows} rows; the config gives it {} KV heads of {} (head_dim / global_head_dim / per_layer_config)",
                    src.path().display(),
                    lc.kv_heads,
                    lc.head_dim
                );
                Some(KvProj {
                    wk,
                    k_norm: v(&p("self_attn.k_norm.weight"))?,
                    wv: if src.has_tensor(&wv_name) { Some(w(&wv_name)?) } else { None },
                    v_norm: ones(lc.head_dim)?,
                })
            } else {
                None
            };
            let moe = match cfg.moe {
                None => None,
                Some((count, top_k)) => {
                    let h = cfg.hidden as f32;
                    let scale: Vec<f32> = t(&p("router.scale"))?.to_f32()?.iter().map(|s| s * h.powf(-0.5)).collect();
                    let per_expert = t(&p("router.per_expert_scale"))?.to_f32()?;
                    let router = Router { scoring: Scoring::Softmax, top_k, normalize: true, per_expert_scale: Some(per_expert), ..Router::default() };
                    let experts = Experts::load_fused(dev, &t(&p("experts.gate_up_proj"))?, &t(&p("experts.down_proj"))?, Activation::Gated(Act::GeluTanh))?;
                    ensure!(experts.experts.len() == count, "layer {i}: {} experts, config.json says {count}", experts.experts.len());
                    Some(MoeBlock {
                        router_in: dev.upload(&scale, 1, scale.len())?,
                        router: w(&p("router.proj.weight"))?,
                        moe: Moe { router, experts },
                        pre_norm: v(&p("pre_feedforward_layernorm_2.weight"))?,
                        post_norm_dense: v(&p("post_feedforward_layernorm_1.weight"))?,
                        post_norm_moe: v(&p("post_feedforward_layernorm_2.weight"))?,
                    })
                }
            };
            let ple = match &ple_model_proj {
                None => None,
                Some(mp) => Some(Ple {
                    model_proj: dev.weight(&slice_rows(mp, i * cfg.ple_dim, cfg.ple_dim)?)?,
                    gate: w(&p("per_layer_input_gate.weight"))?,
                    proj: w(&p("per_layer_projection.weight"))?,
                    post_norm: v(&p("post_per_layer_input_norm.weight"))?,
                }),
            };
            blocks.push(Block {
                attn_norm: v(&p("input_layernorm.weight"))?,
                attn: Attn { wq: w(&p("self_attn.q_proj.weight"))?, q_norm: v(&p("self_attn.q_norm.weight"))?, kv, wo: w(&p("self_attn.o_proj.weight"))? },
                post_attn_norm: v(&p("post_attention_layernorm.weight"))?,
                ffn_norm: v(&p("pre_feedforward_layernorm.weight"))?,
                w_gate: w(&p("mlp.gate_proj.weight"))?,
                w_up: w(&p("mlp.up_proj.weight"))?,
                w_down: w(&p("mlp.down_proj.weight"))?,
                post_ffn_norm: v(&p("post_feedforward_layernorm.weight"))?,
                moe,
                ple,
                scalar: scalar(&p("layer_scalar"))?,
            });
            progress(i + 1, n);
        }
        Ok(Gemma4 { embed: w("model.embed_tokens.weight")?, ple_embed, ple_norm, blocks, out_norm: v("model.norm.weight")?, cfg })
    }
}

impl<D: MoeOps> Model<D> for Gemma4<D> {
    fn kv_layers(&self) -> Vec<KvShape> {
        self.cfg.layers.iter().filter(|l| l.stores_kv).map(|l| KvShape { kv_heads: l.kv_heads, head_dim: l.head_dim }).collect()
    }

    fn kv_groups(&self) -> Vec<usize> {
        self.cfg.layers.iter().filter(|l| l.stores_kv).map(|l| if l.sliding { 1 } else { 0 }).collect()
    }

    fn layer_states(&self) -> Vec<LayerState> {
        self.cfg
            .layers
            .iter()
            .map(|l| match (l.stores_kv, l.sliding) {
                (false, _) => LayerState::None,
                (true, true) => LayerState::SlidingKv { window: self.cfg.window },
                (true, false) => LayerState::Kv,
            })
            .collect()
    }

    model_sizes!();

    fn forward(&self, dev: &D, batch: &Batch<'_>, mem: &mut Memory<D>, s: &mut Scratch<D>) -> Result<()> {
        let kv = &mut mem.kv;
        let c = &self.cfg;
        let n = c.layers.len();
        // Extra buffers: the fixed ones named below, then each layer's per-layer input.
        const FIXED: usize = 13;
        let ple_bufs = if c.ple_dim > 0 { n } else { 0 };
        s.extra(dev, FIXED + ple_bufs - 1);
        let (fixed, ple_in) = s.extra.split_at_mut(FIXED);
        let [v_raw, ple_rows, ple_proj, ple_gate, dense, router_in, router_logits, moe_in, t0, t1, t2, t3, t4] = fixed else {
            unreachable!("{FIXED} fixed extra buffers")
        };

        dev.embed(&self.embed, batch.tokens, c.embed_scale, &mut s.x);
        if let (Some(table), Some(norm)) = (&self.ple_embed, &self.ple_norm) {
            // per_layer_input[l] = (norm(proj_l(x0) · hidden^-½) + table[t, l] · √P) · 2^-½
            for (l, (b, buf)) in self.blocks.iter().zip(ple_in.iter_mut()).enumerate() {
                let p = b.ple.as_ref().context("per-layer weights missing")?;
                // Tokens past the per-layer table (Gemma's extra special tokens) read token 0's slice, as transformers does.
                let ids: Vec<u32> = batch.tokens.iter().map(|&t| (if (t as usize) < c.ple_vocab { t } else { 0 }) * n as u32 + l as u32).collect();
                dev.embed(table, &ids, c.ple_embed_scale, ple_rows);
                dev.matmul(&s.x, &[&p.model_proj], &mut [&mut *ple_proj]);
                dev.map(ple_proj, Map::Scale((c.hidden as f32).powf(-0.5)));
                dev.rms_norm(ple_proj, norm, c.eps, buf);
                dev.add(buf, ple_rows);
                dev.map(buf, Map::Scale(std::f32::consts::FRAC_1_SQRT_2));
            }
        }
        // Sliding-window layers keep their KV apart (only the window); a
        // shared-KV layer reads a layer of its own kind, so of its group.
        let local_seqs: Vec<AttnSeq<'_>> = batch.window_seqs.iter().map(|sq| AttnSeq { window: Some(c.window), ..*sq }).collect();
        for (l, (b, lc)) in self.blocks.iter().zip(&c.layers).enumerate() {
            let (slots, seqs) = if lc.sliding { (batch.window_slots, &local_seqs) } else { (batch.slots, &batch.seqs) };
            // Attention: q/k normed per head then rotated; v normed (no weight); scale 1.
            dev.rms_norm(&s.x, &b.attn_norm, c.eps, &mut s.h);
            match &b.attn.kv {
                Some(p) => {
                    match &p.wv {
                        Some(wv) => dev.matmul(&s.h, &[&b.attn.wq, &p.wk, wv], &mut [&mut s.q_raw, &mut s.k_raw, &mut *v_raw]),
                        None => dev.matmul(&s.h, &[&b.attn.wq, &p.wk], &mut [&mut s.q_raw, &mut s.k_raw]),
                    }
                    dev.rms_norm(&s.k_raw, &p.k_norm, c.eps, &mut s.k);
                    dev.rope(&mut s.k, batch.positions, lc.head_dim, &lc.rope);
                    // K = V: v is the raw k projection, normed.
                    let raw = if p.wv.is_some() { &*v_raw } else { &s.k_raw };
                    dev.rms_norm(raw, &p.v_norm, c.eps, &mut s.v);
                    dev.kv_write(kv, lc.kv_layer, &s.k, &s.v, slots);
                }
                None => dev.matmul(&s.h, &[&b.attn.wq], &mut [&mut s.q_raw]),
            }
            dev.rms_norm(&s.q_raw, &b.attn.q_norm, c.eps, &mut s.q);
            dev.rope(&mut s.q, batch.positions, lc.head_dim, &lc.rope);
            dev.attention(&s.q, kv, lc.kv_layer, seqs, 1.0, c.attn_softcap, &mut s.att);
            dev.matmul(&s.att, &[&b.attn.wo], &mut [&mut s.out]);
            dev.rms_norm(&s.out, &b.post_attn_norm, c.eps, &mut s.post);
            dev.add(&mut s.x, &s.post);
            // Dense MLP (and the MoE beside it, both reading the residual x).
            dev.rms_norm(&s.x, &b.ffn_norm, c.eps, &mut s.h);
            dev.matmul(&s.h, &[&b.w_gate, &b.w_up], &mut [&mut s.gate, &mut s.up]);
            dev.gated(Act::GeluTanh, &s.gate, &s.up, &mut s.act);
            dev.matmul(&s.act, &[&b.w_down], &mut [&mut s.out]);
            if let Some(m) = &b.moe {
                dev.rms_norm(&s.out, &m.post_norm_dense, c.eps, dense);
                dev.rms_norm(&s.x, &m.router_in, c.eps, router_in);
                dev.matmul(router_in, &[&m.router], &mut [&mut *router_logits]);
                dev.rms_norm(&s.x, &m.pre_norm, c.eps, moe_in);
                m.moe.forward(dev, moe_in, router_logits, &mut s.att, [&mut *t0, &mut *t1, &mut *t2, &mut *t3, &mut *t4])?;
                dev.rms_norm(&s.att, &m.post_norm_moe, c.eps, &mut s.out);
                dev.add(&mut s.out, dense);
            }
            dev.rms_norm(&s.out, &b.post_ffn_norm, c.eps, &mut s.post);
            dev.add(&mut s.x, &s.post);
            // Per-layer input: x += norm(proj(gelu(gate(x)) · ple[l])).
            if let Some(p) = &b.ple {
                dev.matmul(&s.x, &[&p.gate], &mut [&mut *ple_gate]);
                dev.gated(Act::GeluTanh, ple_gate, &ple_in[l], &mut s.act);
                dev.matmul(&s.act, &[&p.proj], &mut [&mut s.out]);
                dev.rms_norm(&s.out, &p.post_norm, c.eps, &mut s.post);
                dev.add(&mut s.x, &s.post);
            }
            dev.map(&mut s.x, Map::Scale(b.scalar));
            crate::tap_rows(dev, &s.taps, &s.x, &mut s.tapped, l);
        }
        lm_head(dev, s, batch.logit_rows, &self.out_norm, c.eps, &self.embed, c.final_softcap);
        Ok(())
    }
}
