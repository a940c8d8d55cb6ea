//! Qwen3-Next (`qwen3_next`; llama.cpp's `qwen3next`): pre-norm blocks
//! whose mixer is a gated DeltaNet or gated full attention, each followed
//! by a softmax-routed mixture of SwiGLU experts beside a sigmoid-gated
//! shared expert (or by a dense SwiGLU MLP, on `mlp_only_layers` and off
//! `decoder_sparse_step`); a final norm and a head.
//!
//! Gated DeltaNet: `qkv, z, b, a = projections(x)`; `qkv = silu(conv(qkv))`
//! (a causal depthwise filter over `[q of every key head | k | v of every
//! value head]`); then per value head the gated delta rule
//! ([`RecurrentOps::gated_delta_rule`]: q, k L2-normalised, q /= √dk,
//! `g = -exp(A_log)·softplus(a + dt_bias)`, `β = sigmoid(b)`, `S = e^g·S`,
//! `S += k ⊗ β(v − Sᵀk)`, `o = Sᵀq`), value head h reading key head
//! `h / (nv/nk)`; `rms(o)·w·silu(z)` per value head; `out_proj`. Its state:
//! the conv's last `kernel - 1` inputs and `S` (`[dk, dv]`) per value head.
//!
//! Gated attention: `q_proj` gives each head's query and an output gate
//! (per head: query rows, then gate rows); q and k are RMS-normed per head,
//! partial NeoX RoPE; `out = o_proj(attn ⊙ sigmoid(gate))`.
//!
//! Norms: every norm but the DeltaNet's gated one scales by `1 + w` (a GGUF
//! stores those weights plus one already).
//!
//! Layouts. An HF folder fuses the DeltaNet's projections per key head:
//! `in_proj_qkvz` holds, for each key head, q (dk rows), k (dk), v (r·dv),
//! z (r·dv), r = nv/nk; `in_proj_ba` b (r), a (r). The converter writes
//! `attn_qkv` as `[q all | k all | v all]` and z apart (`attn_gate`), keeps
//! `ssm_ba` grouped per key head, and stores `ssm_a = -exp(A_log)`. Both
//! are regrouped here at load into one weight per part.
//!
//! transformers runs a prompt through the chunked form of the delta rule
//! (chunks of 64) and decode through the recurrence (they agree within
//! 2e-5); braid steps every row through the recurrence.

use anyhow::{bail, ensure, Result};
use braid_formats::TensorView;
use braid_ops::{Act, DeltaShape, Device, KvShape, MoeOps, RecurrentOps, Rope, StateSeq};

use crate::blocks::{gated_mlp, model_sizes, Attention};
use crate::config::Checks;
use crate::llama::hf_rope;
use crate::moe::{join_rows, Activation, Experts, Moe, Router, Scoring};
use crate::recurrent::{extras, gguf_kv_heads, hf_config, state_seqs, StateLayout};
use crate::source::Source;
use crate::{lm_head, Batch, LayerState, Memory, Model, Scratch};

/// q and k's L2-norm epsilon (transformers' and fla's fixed value).
const L2_EPS: f32 = 1e-6;

#[derive(Clone, Debug)]
pub struct Qwen3NextConfig {
    pub hidden: usize,
    /// Per layer: full attention (true) or a gated DeltaNet (false).
    pub full: Vec<bool>,
    /// Per layer: the mixture of experts (true) or a dense MLP.
    pub moe: Vec<bool>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f32,
    pub context: usize,
    pub rope: Rope,
    pub experts: usize,
    pub top_k: usize,
    /// Renormalise the chosen experts' weights (`norm_topk_prob`).
    pub norm_topk: bool,
    pub delta: DeltaShape,
    pub conv_kernel: usize,
}

impl Qwen3NextConfig {
    pub fn from_source(src: &Source) -> Result<Qwen3NextConfig> {
        match src {
            Source::Gguf(g) => Self::from_gguf(g),
            Source::Hf(_) => Self::from_hf(src),
        }
    }

    /// llama.cpp's `qwen3next.*` keys: the DeltaNet layers in
    /// `attention.recurrent_layers`; `ssm.state_size` is the key head dim,
    /// `ssm.group_count` the key heads, `ssm.time_step_rank` the value
    /// heads, `ssm.inner_size` their width. The converter keeps no
    /// `norm_topk_prob` (llama.cpp renormalises) and writes no dense MLPs
    /// (a layer without a router is one).
    fn from_gguf(g: &braid_formats::gguf::Gguf) -> Result<Qwen3NextConfig> {
        let arch = g.architecture()?.to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let path = g.path().display();
        let layers = g.get_usize(&key("block_count"))?;
        let recurrent = match g.get(&key("attention.recurrent_layers")).and_then(|v| v.as_array()) {
            Some(a) => a.iter().map(|v| v.as_bool()).collect::<Option<Vec<bool>>>(),
            None => None,
        };
        let Some(recurrent) = recurrent else { bail!("{path}: {} is not a list of booleans", key("attention.recurrent_layers")) };
        ensure!(recurrent.len() == layers, "{path}: {} names {} layers, the model has {layers}", key("attention.recurrent_layers"), recurrent.len());
        let hidden = g.get_usize(&key("embedding_length"))?;
        let heads = g.get_usize(&key("attention.head_count"))?;
        let head_dim = g.opt_u64(&key("attention.key_length"))?.map_or(hidden.checked_div(heads).unwrap_or(0), |d| d as usize);
        // One KV head count for all attention layers, or a per-layer list.
        let kv_heads = match g.get(&key("attention.head_count_kv")).and_then(|v| v.as_array()) {
            Some(_) => gguf_kv_heads(g, &arch, layers)?.into_iter().max().unwrap_or(0) as usize,
            None => g.get_usize(&key("attention.head_count_kv"))?,
        };
        let value_heads = g.get_usize(&key("ssm.time_step_rank"))?;
        let inner = g.get_usize(&key("ssm.inner_size"))?;
        ensure!(value_heads > 0 && inner.is_multiple_of(value_heads), "{path}: ssm.inner_size {inner} over {value_heads} heads (ssm.time_step_rank)");
        let key_dim = g.get_usize(&key("ssm.state_size"))?;
        Ok(Qwen3NextConfig {
            hidden,
            moe: (0..layers).map(|l| g.has_tensor(&format!("blk.{l}.ffn_gate_inp.weight"))).collect(),
            full: recurrent.iter().map(|r| !r).collect(),
            heads,
            kv_heads,
            head_dim,
            vocab: g.tensor("token_embd.weight")?.shape[0],
            eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            context: g.opt_u64(&key("context_length"))?.unwrap_or(2048) as usize,
            rope: Rope::new(
                g.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
                g.opt_u64(&key("rope.dimension_count"))?.map_or(head_dim, |d| d as usize),
                true,
            ),
            experts: g.opt_u64(&key("expert_count"))?.unwrap_or(0) as usize,
            top_k: g.opt_u64(&key("expert_used_count"))?.unwrap_or(0) as usize,
            norm_topk: g.opt_bool(&key("expert_weights_norm"))?.unwrap_or(true),
            delta: DeltaShape {
                key_heads: g.get_usize(&key("ssm.group_count"))?,
                value_heads,
                key_dim,
                value_dim: inner / value_heads,
                l2_eps: L2_EPS,
                scale: 1.0 / (key_dim as f32).sqrt(),
            },
            conv_kernel: g.get_usize(&key("ssm.conv_kernel"))?,
        })
    }

    fn from_hf(src: &Source) -> Result<Qwen3NextConfig> {
        let c = hf_config(src, "qwen3_next")?;
        let path = src.path();
        let path = path.display();
        let hidden = c.usize("hidden_size")?;
        let layers = c.usize("num_hidden_layers")?;
        let heads = c.usize("num_attention_heads")?;
        let types = match c.layer_types(layers)? {
            Some(t) => t,
            // transformers' default: full attention every `full_attention_interval` layers.
            None => {
                let every = c.opt_usize("full_attention_interval")?.unwrap_or(4).max(1);
                (0..layers).map(|l| if (l + 1) % every == 0 { "full_attention" } else { "linear_attention" }.to_string()).collect()
            }
        };
        let full = types
            .iter()
            .map(|t| match t.as_str() {
                "full_attention" => Ok(true),
                "linear_attention" => Ok(false),
                other => bail!("{path}: layer type `{other}` (expected full_attention or linear_attention)"),
            })
            .collect::<Result<Vec<bool>>>()?;
        if c.opt_bool("attention_bias")?.unwrap_or(false) {
            bail!("{path}: attention_bias (projection biases) is not supported for qwen3_next");
        }
        if let Some(act) = c.opt_str("hidden_act")? {
            ensure!(act == "silu", "{path}: hidden_act {act} (only silu is supported)");
        }
        let experts = c.opt_usize("num_experts")?.unwrap_or(0);
        let step = c.opt_usize("decoder_sparse_step")?.unwrap_or(1);
        let mlp_only: Vec<u64> = match c.get("mlp_only_layers") {
            None => Vec::new(),
            Some(v) => match v.as_array().map(|a| a.iter().map(|x| x.as_u64()).collect::<Option<Vec<u64>>>()) {
                Some(Some(l)) => l,
                _ => bail!("{path}: mlp_only_layers is {v}, expected a list of layer indices"),
            },
        };
        ensure!(step > 0, "{path}: decoder_sparse_step is 0");
        let moe = (0..layers).map(|l| experts > 0 && !mlp_only.contains(&(l as u64)) && (l + 1) % step == 0).collect();
        let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0));
        let key_dim = c.usize("linear_key_head_dim")?;
        Ok(Qwen3NextConfig {
            hidden,
            full,
            moe,
            heads,
            kv_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(heads),
            head_dim,
            vocab: c.usize("vocab_size")?,
            eps: c.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            context: c.opt_usize("max_position_embeddings")?.unwrap_or(2048),
            rope: hf_rope(&c, None, head_dim, &src.path())?,
            experts,
            top_k: c.opt_usize("num_experts_per_tok")?.unwrap_or(0),
            norm_topk: c.opt_bool("norm_topk_prob")?.unwrap_or(true),
            delta: DeltaShape {
                key_heads: c.usize("linear_num_key_heads")?,
                value_heads: c.usize("linear_num_value_heads")?,
                key_dim,
                value_dim: c.usize("linear_value_head_dim")?,
                l2_eps: L2_EPS,
                scale: 1.0 / (key_dim as f32).sqrt(),
            },
            conv_kernel: c.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
        })
    }

    fn check(&self, src: &Source) -> Result<()> {
        let d = &self.delta;
        let mut k = Checks::new(src);
        k.common(self.hidden, self.full.len(), self.vocab, self.eps, self.context)
            .attention(self.heads, self.kv_heads, self.head_dim)
            .rope(&self.rope, self.head_dim);
        k.count("ssm.conv_kernel (linear_conv_kernel_dim)", self.conv_kernel)
            .count("ssm.state_size (linear_key_head_dim)", d.key_dim)
            .count("linear_value_head_dim", d.value_dim)
            .count("ssm.time_step_rank (linear_num_value_heads)", d.value_heads)
            .divides("ssm.group_count (linear_num_key_heads)", d.key_heads, "ssm.time_step_rank (linear_num_value_heads)", d.value_heads);
        if self.moe.iter().any(|&m| m) {
            k.top_k(self.experts, self.top_k);
        }
        k.done()
    }
}

/// A gated DeltaNet layer: the projections regrouped by part, the conv,
/// the gate's parameters, the gated norm and the output projection.
struct DeltaNet<D: Device> {
    /// `[q all | k all | v all]`: what the conv filters.
    in_qkv: D::Weight,
    in_z: D::Weight,
    in_b: D::Weight,
    in_a: D::Weight,
    conv: D::Tensor,
    dt_bias: D::Tensor,
    /// `-exp(A_log)`.
    decay: D::Tensor,
    norm: D::Tensor,
    out: D::Weight,
    conv_at: usize,
    state_at: usize,
}

impl<D: Device> DeltaNet<D> {
    fn load(dev: &D, src: &Source, l: usize, c: &Qwen3NextConfig, state: &mut StateLayout) -> Result<DeltaNet<D>> {
        let d = &c.delta;
        let (nk, nv, dk, dv) = (d.key_heads, d.value_heads, d.key_dim, d.value_dim);
        let r = nv / nk;
        let p = |n: &str| format!("blk.{l}.{n}");
        let hf = |n: &str| format!("model.layers.{l}.linear_attn.{n}");
        let expect = |t: &TensorView, rows: usize| -> Result<()> {
            ensure!(t.shape == [rows, c.hidden], "{}: {:?}, expected [{rows}, {}]", t.name, t.shape, c.hidden);
            Ok(())
        };
        let conv_dim = d.qkv_width();
        let (qkv, z, a) = match src {
            Source::Gguf(_) => {
                let (qkv, z) = (src.tensor(&p("attn_qkv.weight"))?, src.tensor(&p("attn_gate.weight"))?);
                expect(&qkv, conv_dim)?;
                expect(&z, nv * dv)?;
                (qkv, z, src.tensor(&p("ssm_a"))?.to_f32()?)
            }
            Source::Hf(_) => {
                // Per key head: q, k, v, z; regrouped to [q all | k all | v all] and z.
                let fused = src.tensor(&hf("in_proj_qkvz.weight"))?;
                expect(&fused, nk * (2 * dk + 2 * r * dv))?;
                let part = |at: usize, len: usize| -> Vec<(usize, usize)> { (0..nk).map(|g| (g * (2 * dk + 2 * r * dv) + at, len)).collect() };
                let ranges = [part(0, dk), part(dk, dk), part(2 * dk, r * dv)].concat();
                let a = src.tensor(&hf("A_log"))?.to_f32()?.iter().map(|x| -x.exp()).collect();
                (join_rows(&fused, &ranges)?, join_rows(&fused, &part(2 * dk + r * dv, r * dv))?, a)
            }
        };
        ensure!(a.len() == nv, "block {l}: A has {} values for {nv} value heads", a.len());
        // Both files group b and a per key head: b (r rows), a (r rows).
        let ba = src.tensor(&p("ssm_ba.weight"))?;
        expect(&ba, 2 * nv)?;
        let part = |at: usize| -> Vec<(usize, usize)> { (0..nk).map(|g| (g * 2 * r + at, r)).collect() };
        let conv = src.tensor(&p("ssm_conv1d.weight"))?;
        ensure!(conv.elements() == conv_dim * c.conv_kernel, "{}: {:?}, expected [{conv_dim}, 1, {}]", conv.name, conv.shape, c.conv_kernel);
        Ok(DeltaNet {
            in_qkv: dev.weight(&qkv)?,
            in_z: dev.weight(&z)?,
            in_b: dev.weight(&join_rows(&ba, &part(0))?)?,
            in_a: dev.weight(&join_rows(&ba, &part(r))?)?,
            conv: dev.vector(&conv, 0.0)?,
            dt_bias: dev.vector(&src.tensor(&p("ssm_dt.bias"))?, 0.0)?,
            decay: dev.upload(&a, 1, nv)?,
            // The gated norm's weight is used as it is, in both files.
            norm: dev.vector(&src.tensor(&p("ssm_norm.weight"))?, 0.0)?,
            out: dev.weight(&src.tensor(&p("ssm_out.weight"))?)?,
            conv_at: state.take(conv_dim * (c.conv_kernel - 1)),
            state_at: state.take(nv * dk * dv),
        })
    }
}

impl<D: RecurrentOps> DeltaNet<D> {
    /// The mixer over the normed rows `s.h` into `s.out`.
    fn forward(&self, dev: &D, c: &Qwen3NextConfig, s: &mut Scratch<D>, state: &mut D::Tensor, seqs: &[StateSeq]) -> Result<()> {
        let [qkv, z, b, a, conv, o, normed] = extras(dev, &mut s.extra);
        dev.matmul(&s.h, &[&self.in_qkv, &self.in_z, &self.in_b, &self.in_a], &mut [&mut *qkv, &mut *z, &mut *b, &mut *a]);
        dev.short_conv(qkv, &self.conv, None, c.conv_kernel, true, state, self.conv_at, seqs, conv)?;
        dev.gated_delta_rule(conv, a, b, &self.dt_bias, &self.decay, &c.delta, state, self.state_at, seqs, o)?;
        // rms(o)·w per value head (the weight is one head wide), then ⊙ silu(z).
        dev.rms_norm(o, &self.norm, c.eps, normed);
        dev.gated(Act::Silu, z, normed, &mut s.act);
        dev.matmul(&s.act, &[&self.out], &mut [&mut s.out]);
        Ok(())
    }
}

enum Mixer<D: Device> {
    DeltaNet(DeltaNet<D>),
    /// The attention, its output gate's projection, and its index in the KV pool.
    Attention(Attention<D>, D::Weight, usize),
}

/// A SwiGLU MLP.
struct Mlp<D: Device> {
    gate: D::Weight,
    up: D::Weight,
    down: D::Weight,
}

impl<D: Device> Mlp<D> {
    fn load(w: &dyn Fn(&str) -> Result<D::Weight>, l: usize, suffix: &str) -> Result<Mlp<D>> {
        let p = |n: &str| format!("blk.{l}.ffn_{n}{suffix}.weight");
        Ok(Mlp { gate: w(&p("gate"))?, up: w(&p("up"))?, down: w(&p("down"))? })
    }
}

enum Ffn<D: Device> {
    Dense(Mlp<D>),
    /// The router's projection, the mixture, the shared expert and its
    /// gate's projection (`[1, hidden]`).
    Moe {
        router: D::Weight,
        moe: Moe<D>,
        shared: Mlp<D>,
        shared_gate: D::Weight,
    },
}

struct Block<D: Device> {
    in_norm: D::Tensor,
    mixer: Mixer<D>,
    post_norm: D::Tensor,
    ffn: Ffn<D>,
}

pub struct Qwen3Next<D: Device> {
    pub cfg: Qwen3NextConfig,
    embed: D::Weight,
    blocks: Vec<Block<D>>,
    out_norm: D::Tensor,
    /// None when the head is tied to the embeddings.
    head: Option<D::Weight>,
    state: StateLayout,
}

impl<D: Device> Qwen3Next<D> {
    pub fn load(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<Qwen3Next<D>> {
        let cfg = Qwen3NextConfig::from_source(src)?;
        cfg.check(src)?;
        let w = |n: &str| dev.weight(&src.tensor(n)?);
        // The (1 + w) norms: a GGUF holds 1 + w.
        let one = if src.is_gguf() { 0.0 } else { 1.0 };
        let v1 = |n: &str| dev.vector(&src.tensor(n)?, one);
        let (heads, hd) = (cfg.heads, cfg.head_dim);
        let mut state = StateLayout::default();
        let mut kv = 0;
        let layers = cfg.full.len();
        let mut blocks = Vec::with_capacity(layers);
        for l in 0..layers {
            let p = |n: &str| format!("blk.{l}.{n}");
            let mixer = if cfg.full[l] {
                // Per head: the query's rows, then the gate's.
                let q = src.tensor(&p("attn_q.weight"))?;
                ensure!(q.shape == [heads * 2 * hd, cfg.hidden], "{}: {:?}, expected [{}, {}]", q.name, q.shape, heads * 2 * hd, cfg.hidden);
                let rows = |at: usize| -> Vec<(usize, usize)> { (0..heads).map(|h| (h * 2 * hd + at, hd)).collect() };
                let attn = Attention {
                    wq: dev.weight(&join_rows(&q, &rows(0))?)?,
                    wk: w(&p("attn_k.weight"))?,
                    wv: w(&p("attn_v.weight"))?,
                    qk_norm: Some((v1(&p("attn_q_norm.weight"))?, v1(&p("attn_k_norm.weight"))?)),
                    qkv_bias: None,
                    wo: w(&p("attn_output.weight"))?,
                    o_bias: None,
                };
                kv += 1;
                Mixer::Attention(attn, dev.weight(&join_rows(&q, &rows(hd))?)?, kv - 1)
            } else {
                Mixer::DeltaNet(DeltaNet::load(dev, src, l, &cfg, &mut state)?)
            };
            let ffn = if cfg.moe[l] {
                let act = Activation::Gated(Act::Silu);
                let experts =
                    Experts::load_stacked(dev, src, cfg.experts, act, Some(&p("ffn_gate_exps.weight")), &p("ffn_up_exps.weight"), &p("ffn_down_exps.weight"))?;
                // Softmax over all experts, then the top-k (renormalised or not).
                let router = Router { scoring: Scoring::Softmax, top_k: cfg.top_k, normalize: cfg.norm_topk, ..Router::default() };
                let shared_gate = src.tensor(&p("ffn_gate_inp_shexp.weight"))?;
                ensure!(shared_gate.elements() == cfg.hidden, "{}: {:?}, expected [1, {}]", shared_gate.name, shared_gate.shape, cfg.hidden);
                let shared_gate = TensorView { shape: vec![1, cfg.hidden], ..shared_gate };
                Ffn::Moe {
                    router: w(&p("ffn_gate_inp.weight"))?,
                    moe: Moe { router, experts },
                    shared: Mlp::load(&w, l, "_shexp")?,
                    shared_gate: dev.weight(&shared_gate)?,
                }
            } else {
                Ffn::Dense(Mlp::load(&w, l, "")?)
            };
            blocks.push(Block { in_norm: v1(&p("attn_norm.weight"))?, mixer, post_norm: v1(&p("post_attention_norm.weight"))?, ffn });
            progress(l + 1, layers);
        }
        let head = if src.has_tensor("output.weight") { Some(w("output.weight")?) } else { None };
        Ok(Qwen3Next { embed: w("token_embd.weight")?, blocks, out_norm: v1("output_norm.weight")?, head, state, cfg })
    }
}

impl<D: RecurrentOps + MoeOps> Model<D> for Qwen3Next<D> {
    fn kv_layers(&self) -> Vec<KvShape> {
        let shape = KvShape { kv_heads: self.cfg.kv_heads, head_dim: self.cfg.head_dim };
        self.cfg.full.iter().filter(|&&f| f).map(|_| shape).collect()
    }

    fn layer_states(&self) -> Vec<LayerState> {
        // A DeltaNet: the conv tail and the state matrices, both kept by a mark.
        self.cfg.full.iter().map(|&f| if f { LayerState::Kv } else { LayerState::DeltaNet }).collect()
    }

    model_sizes!(state);

    /// The conv and the delta rule step token by token, the experts are
    /// visited in order, the rest is row-wise: any chunking gives the same bits.
    fn chunk_invariant(&self) -> bool {
        true
    }

    fn forward(&self, dev: &D, batch: &Batch<'_>, mem: &mut Memory<D>, s: &mut Scratch<D>) -> Result<()> {
        let c = &self.cfg;
        let seqs = state_seqs(batch)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        dev.embed(&self.embed, batch.tokens, 1.0, &mut s.x);
        for (l, b) in self.blocks.iter().enumerate() {
            dev.rms_norm(&s.x, &b.in_norm, c.eps, &mut s.h);
            match &b.mixer {
                Mixer::DeltaNet(m) => m.forward(dev, c, s, &mut mem.state, &seqs)?,
                Mixer::Attention(a, gate_w, kv) => {
                    a.qkv(dev, s, &mut mem.kv, *kv, batch, batch.slots, c.head_dim, Some(&c.rope), c.eps);
                    let [gate] = extras(dev, &mut s.extra);
                    dev.matmul(&s.h, &[gate_w], &mut [&mut *gate]);
                    dev.attention(&s.q, &mem.kv, *kv, &batch.seqs, scale, None, &mut s.att);
                    dev.gated(Act::Sigmoid, gate, &s.att, &mut s.act);
                    dev.matmul(&s.act, &[&a.wo], &mut [&mut s.out]);
                }
            }
            dev.add(&mut s.x, &s.out);

            dev.rms_norm(&s.x, &b.post_norm, c.eps, &mut s.h);
            match &b.ffn {
                Ffn::Dense(m) => gated_mlp(dev, s, Act::Silu, &m.gate, &m.up, &m.down),
                Ffn::Moe { router, moe, shared, shared_gate } => {
                    moe.routed(dev, router, s)?;
                    // The shared expert, weighted per row by sigmoid(shared_gate · h):
                    // one number a row, applied on the host as the routing is.
                    let [.., y, gate_logit] = extras::<D, 8>(dev, &mut s.extra);
                    dev.matmul(&s.h, &[&shared.gate, &shared.up, shared_gate], &mut [&mut s.gate, &mut s.up, &mut *gate_logit]);
                    dev.gated(Act::Silu, &s.gate, &s.up, &mut s.act);
                    dev.matmul(&s.act, &[&shared.down], &mut [&mut *y]);
                    let weights: Vec<f32> = dev.download(gate_logit)?.iter().map(|&g| 1.0 / (1.0 + (-g).exp())).collect();
                    let rows: Vec<u32> = (0..weights.len() as u32).collect();
                    dev.scatter_add_rows(&mut s.out, y, &rows, &weights)?;
                }
            }
            dev.add(&mut s.x, &s.out);
            s.tap(dev, l);
        }
        lm_head(dev, s, batch.logit_rows, &self.out_norm, c.eps, self.head.as_ref().unwrap_or(&self.embed), None);
        Ok(())
    }
}
