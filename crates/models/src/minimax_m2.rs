//! MiniMax-M2 (`minimax_m2`) and the MiniMax-M3 text tower
//! (`minimax_m3_vl_text`): pre-norm blocks of grouped-query softmax
//! attention with q/k RMSNorm and partial RoPE, and a sigmoid-routed mixture
//! of experts whose choice is biased by a score correction.
//!
//! M2 normalises q and k over their whole projection width; its experts are
//! SwiGLU. M3 normalises per head and scales every norm by `1 + w`; some of
//! its layers attend block-sparsely (an indexer scores blocks of keys and
//! each query attends to its best few, see [`Device::block_sparse_attention`];
//! the indexer keys are kept in the KV pool as one more layer); its MLPs are
//! clamped SwiGLUs — a dense one on some layers, and on the others the
//! experts, scaled, plus a shared expert.

use anyhow::{bail, ensure, Context, Result};
use braid_ops::{Act, BlockSparse, Device, KvShape, MoeOps, Rope, SparseAttentionOps};

use crate::blocks::{gated_mlp, model_sizes, Attention};
use crate::moe::{slice_rows, Activation, Experts, Moe, Router, Scoring};
use crate::recurrent::{extras, hf_config};
use crate::source::Source;
use crate::{lm_head, Batch, LayerState, Memory, Model, Scratch};

#[derive(Clone, Debug)]
pub struct MiniMaxM2Config {
    /// The MiniMax-M3 text tower (else MiniMax-M2).
    pub m3: bool,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f32,
    pub rope: Rope,
    pub context: usize,
    pub experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    pub routed_scale: f32,
    /// M3: per layer, block-sparse attention.
    pub sparse: Vec<bool>,
    /// M3: per layer, a dense MLP instead of the mixture.
    pub dense: Vec<bool>,
    /// M3's block selection.
    pub index: Option<BlockSparse>,
    /// M3's clamped SwiGLU (limit, alpha).
    pub swiglu: Option<(f32, f32)>,
}

impl MiniMaxM2Config {
    pub fn from_source(src: &Source) -> Result<MiniMaxM2Config> {
        match src {
            Source::Gguf(g) => Self::from_gguf(g),
            Source::Hf(_) => Self::from_hf(src),
        }
    }

    /// llama.cpp's `minimax-m2.*` keys (MiniMax-M2 only: the converter's
    /// MiniMax-M3 reads the Hub's checkpoint layout, not transformers').
    fn from_gguf(g: &braid_formats::gguf::Gguf) -> Result<MiniMaxM2Config> {
        let arch = g.architecture()?.to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let path = g.path().display();
        ensure!(arch == "minimax-m2", "{path}: architecture {arch} is not MiniMax-M2");
        let hidden = g.get_usize(&key("embedding_length"))?;
        let heads = g.get_usize(&key("attention.head_count"))?;
        let head_dim = match g.opt_u64(&key("attention.key_length"))? {
            Some(d) => d as usize,
            None => hidden.checked_div(heads).unwrap_or(0),
        };
        let rotary = g.opt_u64(&key("rope.dimension_count"))?.map_or(head_dim, |d| d as usize);
        ensure!(rotary > 0 && rotary <= head_dim && rotary.is_multiple_of(2), "{path}: {rotary} rotary dims of a head of {head_dim}");
        // llama.cpp's gating kinds: 1 softmax, 2 sigmoid (M2's, when absent).
        let scoring = match g.opt_u64(&key("expert_gating_func"))? {
            None | Some(2) => Scoring::Sigmoid,
            Some(1) => Scoring::Softmax,
            Some(f) => bail!("{path}: {} is {f} (expected 1, softmax, or 2, sigmoid)", key("expert_gating_func")),
        };
        let layers = g.get_usize(&key("block_count"))?;
        Ok(MiniMaxM2Config {
            m3: false,
            hidden,
            layers,
            heads,
            kv_heads: g.opt_u64(&key("attention.head_count_kv"))?.map_or(heads, |k| k as usize),
            head_dim,
            vocab: g.tensor("token_embd.weight")?.shape[0],
            eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            rope: Rope::new(g.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0), rotary, true),
            context: g.opt_u64(&key("context_length"))?.unwrap_or(4096) as usize,
            experts: g.get_usize(&key("expert_count"))?,
            top_k: g.get_usize(&key("expert_used_count"))?,
            scoring,
            routed_scale: g.opt_f32(&key("expert_weights_scale"))?.filter(|&s| s != 0.0).unwrap_or(1.0),
            sparse: vec![false; layers],
            dense: vec![false; layers],
            index: None,
            swiglu: None,
        })
    }

    fn from_hf(src: &Source) -> Result<MiniMaxM2Config> {
        let arch = src.architecture()?;
        let m3 = arch != "minimax_m2";
        let c = hf_config(src, &arch)?;
        let path = src.path();
        let path = path.display();
        let hidden = c.usize("hidden_size")?;
        let layers = c.usize("num_hidden_layers")?;
        let heads = c.usize("num_attention_heads")?;
        ensure!(heads > 0 && layers > 0, "{path}: {heads} heads, {layers} layers");
        let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0));
        let rp = c.rope(None, 10_000.0)?;
        // The rotated part of each head, as transformers reads it: M2's
        // config turns the Hub's legacy `rotary_dim` into a partial-rotary
        // factor when none is given; M3's does not, and its RoPE covers
        // head_dim × partial_rotary_factor whatever `rotary_dim` says.
        let explicit = c.get("rope_parameters").and_then(|p| p.get("partial_rotary_factor")).is_some() || c.get("partial_rotary_factor").is_some();
        let rotary = match c.opt_usize("rotary_dim")? {
            Some(r) if !m3 && !explicit => r,
            _ => (head_dim as f32 * rp.partial_rotary_factor) as usize,
        };
        ensure!(rotary > 0 && rotary <= head_dim && rotary.is_multiple_of(2), "{path}: {rotary} rotary dims of a head of {head_dim}");
        let flags = |key: &str, yes: &str, no: &str| -> Result<Vec<bool>> {
            match c.get(key) {
                None => Ok(vec![false; layers]),
                Some(v) => {
                    let Some(list) = v.as_array() else { bail!("{path}: {key} is not a list") };
                    ensure!(list.len() == layers, "{path}: {key} names {} layers, the model has {layers}", list.len());
                    list.iter()
                        .map(|t| match t.as_str() {
                            Some(s) if s == yes => Ok(true),
                            Some(s) if s == no => Ok(false),
                            _ => bail!("{path}: {key} holds {t} (expected {yes} or {no})"),
                        })
                        .collect()
                }
            }
        };
        let (sparse, dense, index, swiglu) = if m3 {
            // As transformers' M3 config reads them: the flat keys, or the Hub's
            // `sparse_attention_config` (its `sparse_*` keys win), and per-layer
            // lists from `layer_types` / `mlp_layer_types` or the Hub's
            // `sparse_attention_freq` / `moe_layer_freq` (1: sparse, MoE); the
            // defaults are transformers'.
            let sac = c.get("sparse_attention_config").filter(|v| v.is_object());
            let index_key = |flat: &str, legacy: &str, default: usize| -> Result<usize> {
                match sac.and_then(|s| s.get(legacy)) {
                    Some(v) => v
                        .as_u64()
                        .map(|x| x as usize)
                        .with_context(|| format!("{path}: sparse_attention_config.{legacy} is {v}, expected a non-negative integer")),
                    None => Ok(c.opt_usize(flat)?.unwrap_or(default)),
                }
            };
            let freq = |v: Option<&serde_json::Value>, key: &str| -> Result<Option<Vec<bool>>> {
                let Some(v) = v else { return Ok(None) };
                let Some(list) = v.as_array() else { bail!("{path}: {key} is not a list") };
                ensure!(list.len() == layers, "{path}: {key} names {} layers, the model has {layers}", list.len());
                list.iter()
                    .map(|f| f.as_u64().map(|f| f != 0).with_context(|| format!("{path}: {key} holds {f} (expected 0 or 1)")))
                    .collect::<Result<_>>()
                    .map(Some)
            };
            let sparse = match (c.get("layer_types"), freq(sac.and_then(|s| s.get("sparse_attention_freq")), "sparse_attention_config.sparse_attention_freq")?)
            {
                (None, Some(f)) => f,
                _ => flags("layer_types", "minimax_m3_sparse", "full_attention")?,
            };
            let dense = match (c.get("mlp_layer_types"), freq(c.get("moe_layer_freq"), "moe_layer_freq")?) {
                (None, Some(f)) => f.iter().map(|&moe| !moe).collect(),
                _ => flags("mlp_layer_types", "dense", "sparse")?,
            };
            let index = BlockSparse {
                block: index_key("index_block_size", "sparse_block_size", 128)?,
                local: index_key("index_local_blocks", "sparse_local_block", 1)?,
                topk: index_key("index_topk_blocks", "sparse_topk_blocks", 16)?,
                index_heads: index_key("index_n_heads", "sparse_num_index_heads", 4)?,
                index_dim: index_key("index_head_dim", "sparse_index_dim", 128)?,
            };
            ensure!(index.block > 0 && index.topk > 0, "{path}: index blocks of {} positions, {} kept", index.block, index.topk);
            ensure!(index.index_heads > 0 && heads.is_multiple_of(index.index_heads), "{path}: {heads} heads over {} indexer heads", index.index_heads);
            // The indexer takes the attention's RoPE table cut to its width,
            // which is the same partial RoPE only when it covers the rotated part.
            ensure!(index.index_dim >= rotary, "{path}: index_head_dim {} under the {rotary} rotary dims", index.index_dim);
            let swiglu = (c.opt_f32("swiglu_limit")?.unwrap_or(7.0), c.opt_f32("swiglu_alpha")?.unwrap_or(1.702));
            (sparse, dense, Some(index), Some(swiglu))
        } else {
            (vec![false; layers], vec![false; layers], None, None)
        };
        // transformers' M2 and M3 routers score by sigmoid whatever a Hub
        // config's `scoring_func` says, and only M3 scales the routed sum
        // (M2 has no `routed_scaling_factor` and ignores one in config.json).
        let scoring = Scoring::Sigmoid;
        let routed_scale = if m3 { c.opt_f32("routed_scaling_factor")?.unwrap_or(2.0) } else { 1.0 };
        Ok(MiniMaxM2Config {
            m3,
            hidden,
            layers,
            heads,
            kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(heads),
            head_dim,
            vocab: c.usize("vocab_size")?,
            eps: c.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            rope: Rope::new(rp.theta, rotary, true),
            context: c.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            experts: c.usize("num_local_experts")?,
            top_k: c.usize("num_experts_per_tok")?,
            scoring,
            routed_scale,
            sparse,
            dense,
            index,
            swiglu,
        })
    }
}

/// M3's lightning indexer of one block-sparse layer.
struct Indexer<D: Device> {
    wq: D::Weight,
    wk: D::Weight,
    q_norm: D::Tensor,
    k_norm: D::Tensor,
    /// The KV layer holding its keys.
    kv: usize,
}

/// A clamped-SwiGLU MLP (M3), from a fused `gate_up_proj` (gate rows first).
struct GluMlp<D: Device> {
    gate: D::Weight,
    up: D::Weight,
    down: D::Weight,
}

enum Ffn<D: Device> {
    Dense(GluMlp<D>),
    Moe { router: D::Weight, moe: Moe<D>, shared: Option<GluMlp<D>> },
}

struct Block<D: Device> {
    in_norm: D::Tensor,
    attn: Attention<D>,
    indexer: Option<Indexer<D>>,
    post_norm: D::Tensor,
    ffn: Ffn<D>,
}

pub struct MiniMaxM2<D: Device> {
    pub cfg: MiniMaxM2Config,
    embed: D::Weight,
    blocks: Vec<Block<D>>,
    out_norm: D::Tensor,
    head: Option<D::Weight>,
}

impl<D: Device> MiniMaxM2<D> {
    pub fn load(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<MiniMaxM2<D>> {
        let cfg = MiniMaxM2Config::from_source(src)?;
        crate::config::check_minimax_m2(&cfg, src)?;
        let w = |n: &str| dev.weight(&src.tensor(n)?);
        // M3's norms scale by 1 + w.
        let norm_offset = if cfg.m3 { 1.0 } else { 0.0 };
        let v = |n: &str| dev.vector(&src.tensor(n)?, norm_offset);
        let glu = |gate_up: &str, down: &str| -> Result<GluMlp<D>> {
            let gu = src.tensor(gate_up)?;
            ensure!(gu.shape.len() == 2 && gu.shape[0].is_multiple_of(2), "{gate_up}: {:?}, expected [2 x intermediate, hidden]", gu.shape);
            let i = gu.shape[0] / 2;
            Ok(GluMlp { gate: dev.weight(&slice_rows(&gu, 0, i)?)?, up: dev.weight(&slice_rows(&gu, i, i)?)?, down: w(down)? })
        };
        let mut index_kv = cfg.layers;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            // M3's own tensors by their HF names (it loads from HF folders only).
            let p = |n: &str| format!("model.layers.{l}.{n}");
            let indexer = if cfg.sparse[l] {
                index_kv += 1;
                Some(Indexer {
                    wq: w(&p("self_attn.indexer.q_proj.weight"))?,
                    wk: w(&p("self_attn.indexer.k_proj.weight"))?,
                    q_norm: v(&p("self_attn.indexer.q_norm.weight"))?,
                    k_norm: v(&p("self_attn.indexer.k_norm.weight"))?,
                    kv: index_kv - 1,
                })
            } else {
                None
            };
            let ffn = if cfg.dense[l] {
                Ffn::Dense(glu(&p("mlp.gate_up_proj.weight"), &p("mlp.down_proj.weight"))?)
            } else if let Some((limit, alpha)) = cfg.swiglu {
                let act = Activation::Gated(Act::SwiGluClamped { limit, alpha });
                let experts = Experts::load_fused(dev, &src.tensor(&p("mlp.experts.gate_up_proj"))?, &src.tensor(&p("mlp.experts.down_proj"))?, act)?;
                let bias = src.tensor(&p("mlp.gate.e_score_correction_bias"))?.to_f32()?;
                let shared_name = p("mlp.shared_experts.gate_up_proj.weight");
                let shared = if src.has_tensor(&shared_name) { Some(glu(&shared_name, &p("mlp.shared_experts.down_proj.weight"))?) } else { None };
                Ffn::Moe { router: w(&p("mlp.gate.weight"))?, moe: Moe { router: router(&cfg, bias), experts }, shared }
            } else {
                // M2 (from a GGUF too): by GGUF names.
                let b = |n: &str| format!("blk.{l}.{n}");
                let experts = Experts::load_stacked(
                    dev,
                    src,
                    cfg.experts,
                    Activation::Gated(Act::Silu),
                    Some(&b("ffn_gate_exps.weight")),
                    &b("ffn_up_exps.weight"),
                    &b("ffn_down_exps.weight"),
                )?;
                let bias = src.tensor(&b("exp_probs_b.bias"))?.to_f32()?;
                Ffn::Moe { router: w(&b("ffn_gate_inp.weight"))?, moe: Moe { router: router(&cfg, bias), experts }, shared: None }
            };
            blocks.push(Block {
                in_norm: v(&format!("blk.{l}.attn_norm.weight"))?,
                attn: Attention::load_gguf(&w, &v, l, true)?.checked(dev, l, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden)?,
                indexer,
                post_norm: v(&format!("blk.{l}.ffn_norm.weight"))?,
                ffn,
            });
            progress(l + 1, cfg.layers);
        }
        let head = if src.has_tensor("output.weight") { Some(w("output.weight")?) } else { None };
        Ok(MiniMaxM2 { embed: w("token_embd.weight")?, blocks, out_norm: v("output_norm.weight")?, head, cfg })
    }
}

/// Sigmoid scores, the choice biased by the score correction, the chosen
/// weights renormalised and scaled.
fn router(cfg: &MiniMaxM2Config, bias: Vec<f32>) -> Router {
    Router { scoring: cfg.scoring, top_k: cfg.top_k, choice_bias: Some(bias), normalize: true, norm_eps: 0.0, scale: cfg.routed_scale, per_expert_scale: None }
}

impl<D: MoeOps + SparseAttentionOps> Model<D> for MiniMaxM2<D> {
    /// One layer per block, then one per block-sparse layer for its
    /// indexer keys (k only; v is a copy, unused).
    fn kv_layers(&self) -> Vec<KvShape> {
        let c = &self.cfg;
        let mut v = vec![KvShape { kv_heads: c.kv_heads, head_dim: c.head_dim }; c.layers];
        if let Some(ix) = &c.index {
            v.extend(c.sparse.iter().filter(|&&s| s).map(|_| KvShape { kv_heads: 1, head_dim: ix.index_dim }));
        }
        v
    }

    fn layer_states(&self) -> Vec<LayerState> {
        vec![LayerState::Kv; self.cfg.layers]
    }

    model_sizes!();

    fn forward(&self, dev: &D, batch: &Batch<'_>, mem: &mut Memory<D>, s: &mut Scratch<D>) -> Result<()> {
        let c = &self.cfg;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        dev.embed(&self.embed, batch.tokens, 1.0, &mut s.x);
        for (l, b) in self.blocks.iter().enumerate() {
            // Attention: q and k normalised (over the whole width in M2, per
            // head in M3: the norm weight's width says which), then RoPE.
            dev.rms_norm(&s.x, &b.in_norm, c.eps, &mut s.h);
            b.attn.qkv(dev, s, &mut mem.kv, l, batch, batch.slots, c.head_dim, Some(&c.rope), c.eps);
            match (&b.indexer, &c.index) {
                (Some(ix), Some(sel)) => {
                    // The indexer's own q and k (k kept in its KV layer) choose the blocks.
                    let [tq, tk, iq, ik] = extras(dev, &mut s.extra);
                    dev.matmul(&s.h, &[&ix.wq, &ix.wk], &mut [&mut *tq, &mut *tk]);
                    dev.rms_norm(tq, &ix.q_norm, c.eps, iq);
                    dev.rope(iq, batch.positions, sel.index_dim, &c.rope);
                    dev.rms_norm(tk, &ix.k_norm, c.eps, ik);
                    dev.rope(ik, batch.positions, sel.index_dim, &c.rope);
                    dev.kv_write(&mut mem.kv, ix.kv, ik, ik, batch.slots);
                    dev.block_sparse_attention(&s.q, iq, &mem.kv, l, ix.kv, &batch.seqs, scale, sel, &mut s.att)?;
                }
                _ => dev.attention(&s.q, &mem.kv, l, &batch.seqs, scale, None, &mut s.att),
            }
            dev.matmul(&s.att, &[&b.attn.wo], &mut [&mut s.out]);
            dev.add(&mut s.x, &s.out);

            dev.rms_norm(&s.x, &b.post_norm, c.eps, &mut s.h);
            match &b.ffn {
                Ffn::Dense(m) => self.glu(dev, m, s),
                Ffn::Moe { router, moe, shared } => {
                    if let Some(m) = shared {
                        self.glu(dev, m, s);
                        dev.add(&mut s.x, &s.out);
                    }
                    moe.routed(dev, router, s)?;
                }
            }
            dev.add(&mut s.x, &s.out);
            s.tap(dev, l);
        }
        lm_head(dev, s, batch.logit_rows, &self.out_norm, c.eps, self.head.as_ref().unwrap_or(&self.embed), None);
        Ok(())
    }
}

impl<D: Device> MiniMaxM2<D> {
    /// `s.out = down(swiglu_clamped(gate(s.h), up(s.h)))`.
    fn glu(&self, dev: &D, m: &GluMlp<D>, s: &mut Scratch<D>) {
        let (limit, alpha) = self.cfg.swiglu.unwrap_or((f32::INFINITY, 1.702));
        gated_mlp(dev, s, Act::SwiGluClamped { limit, alpha }, &m.gate, &m.up, &m.down);
    }
}
