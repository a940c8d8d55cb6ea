//! Llama (and SmolLM2): token embeddings, pre-norm blocks of grouped-query
//! attention with RoPE and a SwiGLU MLP, a final RMSNorm and a (possibly
//! tied) output head.

use anyhow::{Context, Result};
use braid_ops::{Device, KvShape, Rope};

use crate::source::Source;
use crate::{Batch, LayerState, Memory, Model, Scratch};

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
                let head_dim = g.get_u64(&key("attention.key_length")).map(|v| v as usize).unwrap_or(hidden / heads);
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
                    rope: Rope {
                        theta: g.get_f32(&key("rope.freq_base")).unwrap_or(10000.0),
                        dims: g.get_u64(&key("rope.dimension_count")).map(|v| v as usize).unwrap_or(head_dim),
                        // llama.cpp's converter permutes q/k rows for llama, so
                        // the GGUF pairs adjacent dimensions.
                        neox: false,
                        scale: 1.0,
                    },
                    context: g.get_u64(&key("context_length")).map(|v| v as usize).unwrap_or(4096),
                })
            }
            Source::Hf(h) => {
                let c = h.config();
                let u = |k: &str| -> Result<usize> {
                    c.get(k).and_then(|v| v.as_u64()).map(|v| v as usize).with_context(|| format!("{}: config.json lacks {k}", h.dir().display()))
                };
                let hidden = u("hidden_size")?;
                let heads = u("num_attention_heads")?;
                let head_dim = u("head_dim").unwrap_or(hidden / heads);
                let theta =
                    c.get("rope_theta").or_else(|| c.get("rope_parameters").and_then(|p| p.get("rope_theta"))).and_then(|v| v.as_f64()).unwrap_or(10000.0)
                        as f32;
                Ok(LlamaConfig {
                    hidden,
                    layers: u("num_hidden_layers")?,
                    heads,
                    kv_heads: u("num_key_value_heads").unwrap_or(heads),
                    head_dim,
                    ffn: u("intermediate_size")?,
                    vocab: u("vocab_size")?,
                    eps: c.get("rms_norm_eps").and_then(|v| v.as_f64()).unwrap_or(1e-6) as f32,
                    rope: Rope { theta, dims: head_dim, neox: true, scale: 1.0 },
                    context: u("max_position_embeddings").unwrap_or(4096),
                })
            }
        }
    }
}

struct Block<D: Device> {
    attn_norm: D::Tensor,
    wq: D::Weight,
    wk: D::Weight,
    wv: D::Weight,
    wo: D::Weight,
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
        let w = |n: &str| dev.weight(&src.tensor(n)?);
        let v = |n: &str| dev.vector(&src.tensor(n)?, 0.0);
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = |n: &str| format!("blk.{i}.{n}.weight");
            blocks.push(Block {
                attn_norm: v(&p("attn_norm"))?,
                wq: w(&p("attn_q"))?,
                wk: w(&p("attn_k"))?,
                wv: w(&p("attn_v"))?,
                wo: w(&p("attn_output"))?,
                ffn_norm: v(&p("ffn_norm"))?,
                w_gate: w(&p("ffn_gate"))?,
                w_up: w(&p("ffn_up"))?,
                w_down: w(&p("ffn_down"))?,
            });
            progress(i + 1, cfg.layers);
        }
        let head = if src.has_tensor("output.weight") { Some(w("output.weight")?) } else { None };
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

    fn vocab(&self) -> usize {
        self.cfg.vocab
    }

    fn context(&self) -> usize {
        self.cfg.context
    }

    fn forward(&self, dev: &D, batch: &Batch<'_>, mem: &mut Memory<D>, s: &mut Scratch<D>) -> Result<()> {
        let kv = &mut mem.kv;
        let c = &self.cfg;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        dev.embed(&self.embed, batch.tokens, 1.0, &mut s.x);
        for (l, b) in self.blocks.iter().enumerate() {
            // Attention.
            dev.rms_norm(&s.x, &b.attn_norm, c.eps, &mut s.h);
            dev.matmul(&s.h, &b.wq, &mut s.q);
            dev.matmul(&s.h, &b.wk, &mut s.k);
            dev.matmul(&s.h, &b.wv, &mut s.v);
            dev.rope(&mut s.q, batch.positions, c.head_dim, &c.rope);
            dev.rope(&mut s.k, batch.positions, c.head_dim, &c.rope);
            dev.kv_write(kv, l, &s.k, &s.v, batch.slots);
            dev.attention(&s.q, kv, l, &batch.seqs, scale, None, &mut s.att);
            dev.matmul(&s.att, &b.wo, &mut s.h);
            dev.add(&mut s.x, &s.h);
            // MLP.
            dev.rms_norm(&s.x, &b.ffn_norm, c.eps, &mut s.h);
            dev.matmul(&s.h, &b.w_gate, &mut s.gate);
            dev.matmul(&s.h, &b.w_up, &mut s.up);
            dev.silu_mul(&s.gate, &s.up, &mut s.act);
            dev.matmul(&s.act, &b.w_down, &mut s.h);
            dev.add(&mut s.x, &s.h);
        }
        // Head: only the rows whose logits are wanted.
        dev.gather_rows(&s.x, batch.logit_rows, &mut s.h);
        dev.rms_norm(&s.h, &self.out_norm, c.eps, &mut s.q);
        dev.matmul(&s.q, self.head.as_ref().unwrap_or(&self.embed), &mut s.logits);
        Ok(())
    }
}
