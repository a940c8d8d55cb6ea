//! Gemma 3 (text): embeddings scaled by √hidden; blocks of sliding-window
//! (local) and global attention with per-head q/k RMSNorm and norms after
//! both the attention and the MLP; a GELU-gated MLP; a tied head.

use anyhow::Result;
use braid_ops::{AttnSeq, Device, KvShape, Rope};

use crate::source::Source;
use crate::{Batch, LayerState, Memory, Model, Scratch};

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
    /// Layer i is global when `(i + 1) % global_every == 0`.
    pub global_every: usize,
    pub rope_global: Rope,
    pub rope_local: Rope,
    pub attn_scale: f32,
    pub final_softcap: Option<f32>,
    pub context: usize,
}

impl Gemma3Config {
    pub fn from_source(src: &Source) -> Result<Gemma3Config> {
        match src {
            Source::Gguf(g) => {
                let key = |k: &str| format!("gemma3.{k}");
                let hidden = g.get_u64(&key("embedding_length"))? as usize;
                let heads = g.get_u64(&key("attention.head_count"))? as usize;
                let head_dim = g.get_u64(&key("attention.key_length")).map(|v| v as usize).unwrap_or(hidden / heads);
                let rope = |theta| Rope { theta, dims: head_dim, neox: true, scale: 1.0 };
                Ok(Gemma3Config {
                    hidden,
                    layers: g.get_u64(&key("block_count"))? as usize,
                    heads,
                    kv_heads: g.get_u64(&key("attention.head_count_kv")).map(|v| v as usize).unwrap_or(heads),
                    head_dim,
                    ffn: g.get_u64(&key("feed_forward_length"))? as usize,
                    vocab: src.tensor("token_embd.weight")?.shape[0],
                    eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
                    window: g.get_u64(&key("attention.sliding_window")).map(|v| v as usize).unwrap_or(512),
                    // Gemma 3 interleaves five local layers with one global.
                    global_every: 6,
                    rope_global: rope(g.get_f32(&key("rope.freq_base")).unwrap_or(1_000_000.0)),
                    rope_local: rope(10_000.0),
                    attn_scale: 1.0 / (head_dim as f32).sqrt(),
                    final_softcap: None,
                    context: g.get_u64(&key("context_length")).map(|v| v as usize).unwrap_or(32768),
                })
            }
            Source::Hf(h) => anyhow::bail!("{}: gemma3 from safetensors is not supported yet", h.dir().display()),
        }
    }

    fn is_global(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(self.global_every)
    }
}

struct Block<D: Device> {
    attn_norm: D::Tensor,
    wq: D::Weight,
    wk: D::Weight,
    wv: D::Weight,
    q_norm: D::Tensor,
    k_norm: D::Tensor,
    wo: D::Weight,
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
}

impl<D: Device> Gemma3<D> {
    pub fn load(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<Gemma3<D>> {
        let cfg = Gemma3Config::from_source(src)?;
        let w = |n: &str| dev.weight(&src.tensor(n)?);
        // The GGUF converter already folded Gemma's `1 + w` into the norms.
        let v = |n: &str| dev.vector(&src.tensor(n)?, 0.0);
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = |n: &str| format!("blk.{i}.{n}.weight");
            blocks.push(Block {
                attn_norm: v(&p("attn_norm"))?,
                wq: w(&p("attn_q"))?,
                wk: w(&p("attn_k"))?,
                wv: w(&p("attn_v"))?,
                q_norm: v(&p("attn_q_norm"))?,
                k_norm: v(&p("attn_k_norm"))?,
                wo: w(&p("attn_output"))?,
                post_attn_norm: v(&p("post_attention_norm"))?,
                ffn_norm: v(&p("ffn_norm"))?,
                w_gate: w(&p("ffn_gate"))?,
                w_up: w(&p("ffn_up"))?,
                w_down: w(&p("ffn_down"))?,
                post_ffn_norm: v(&p("post_ffw_norm"))?,
            });
            progress(i + 1, cfg.layers);
        }
        Ok(Gemma3 { embed: w("token_embd.weight")?, blocks, out_norm: v("output_norm.weight")?, cfg })
    }
}

impl<D: Device> Model<D> for Gemma3<D> {
    fn kv_layers(&self) -> Vec<KvShape> {
        vec![KvShape { kv_heads: self.cfg.kv_heads, head_dim: self.cfg.head_dim }; self.cfg.layers]
    }

    fn layer_states(&self) -> Vec<LayerState> {
        (0..self.cfg.layers).map(|l| if self.cfg.is_global(l) { LayerState::Kv } else { LayerState::SlidingKv { window: self.cfg.window } }).collect()
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
        dev.embed(&self.embed, batch.tokens, (c.hidden as f32).sqrt(), &mut s.x);
        let local_seqs: Vec<AttnSeq<'_>> = batch.seqs.iter().map(|q| AttnSeq { window: Some(c.window), ..*q }).collect();
        for (l, b) in self.blocks.iter().enumerate() {
            let (rope, seqs) = if c.is_global(l) { (&c.rope_global, &batch.seqs) } else { (&c.rope_local, &local_seqs) };
            // Attention, with q/k normalised per head before RoPE.
            dev.rms_norm(&s.x, &b.attn_norm, c.eps, &mut s.h);
            dev.matmul(&s.h, &b.wq, &mut s.att);
            dev.rms_norm(&s.att, &b.q_norm, c.eps, &mut s.q);
            dev.matmul(&s.h, &b.wk, &mut s.att);
            dev.rms_norm(&s.att, &b.k_norm, c.eps, &mut s.k);
            dev.matmul(&s.h, &b.wv, &mut s.v);
            dev.rope(&mut s.q, batch.positions, c.head_dim, rope);
            dev.rope(&mut s.k, batch.positions, c.head_dim, rope);
            dev.kv_write(kv, l, &s.k, &s.v, batch.slots);
            dev.attention(&s.q, kv, l, seqs, c.attn_scale, None, &mut s.att);
            dev.matmul(&s.att, &b.wo, &mut s.h);
            dev.rms_norm(&s.h, &b.post_attn_norm, c.eps, &mut s.up);
            dev.add(&mut s.x, &s.up);
            // MLP.
            dev.rms_norm(&s.x, &b.ffn_norm, c.eps, &mut s.h);
            dev.matmul(&s.h, &b.w_gate, &mut s.gate);
            dev.matmul(&s.h, &b.w_up, &mut s.up);
            dev.gelu_mul(&s.gate, &s.up, &mut s.act);
            dev.matmul(&s.act, &b.w_down, &mut s.h);
            dev.rms_norm(&s.h, &b.post_ffn_norm, c.eps, &mut s.up);
            dev.add(&mut s.x, &s.up);
        }
        dev.gather_rows(&s.x, batch.logit_rows, &mut s.h);
        dev.rms_norm(&s.h, &self.out_norm, c.eps, &mut s.q);
        dev.matmul(&s.q, &self.embed, &mut s.logits);
        if let Some(cap) = c.final_softcap {
            dev.softcap(&mut s.logits, cap);
        }
        Ok(())
    }
}
