//! Qwen3 (dense): the Llama block with an RMSNorm on each head of q and k
//! before RoPE, a head dimension read from the config (heads × head_dim need
//! not equal hidden), and usually an untied head.

use anyhow::Result;
use braid_ops::{Device, KvShape};

use crate::llama::LlamaConfig;
use crate::source::Source;
use crate::{lm_head, Batch, LayerState, Memory, Model, Scratch};

struct Block<D: Device> {
    attn_norm: D::Tensor,
    wq: D::Weight,
    wk: D::Weight,
    wv: D::Weight,
    /// One head wide: applied to every head.
    q_norm: D::Tensor,
    k_norm: D::Tensor,
    wo: D::Weight,
    ffn_norm: D::Tensor,
    w_gate: D::Weight,
    w_up: D::Weight,
    w_down: D::Weight,
}

pub struct Qwen3<D: Device> {
    pub cfg: LlamaConfig,
    embed: D::Weight,
    blocks: Vec<Block<D>>,
    out_norm: D::Tensor,
    /// None when the head is tied to the embeddings.
    head: Option<D::Weight>,
}

impl<D: Device> Qwen3<D> {
    pub fn load(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<Qwen3<D>> {
        let mut cfg = LlamaConfig::from_source(src)?;
        // Qwen checkpoints (and their GGUFs) pair dimensions NeoX style.
        cfg.rope.neox = true;
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
                q_norm: v(&p("attn_q_norm"))?,
                k_norm: v(&p("attn_k_norm"))?,
                wo: w(&p("attn_output"))?,
                ffn_norm: v(&p("ffn_norm"))?,
                w_gate: w(&p("ffn_gate"))?,
                w_up: w(&p("ffn_up"))?,
                w_down: w(&p("ffn_down"))?,
            });
            progress(i + 1, cfg.layers);
        }
        let head = if src.has_tensor("output.weight") { Some(w("output.weight")?) } else { None };
        Ok(Qwen3 { embed: w("token_embd.weight")?, blocks, out_norm: v("output_norm.weight")?, head, cfg })
    }
}

impl<D: Device> Model<D> for Qwen3<D> {
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
            // Attention, with q/k normalised per head before RoPE.
            dev.rms_norm(&s.x, &b.attn_norm, c.eps, &mut s.h);
            dev.matmul(&s.h, &b.wq, &mut s.att);
            dev.rms_norm(&s.att, &b.q_norm, c.eps, &mut s.q);
            dev.matmul(&s.h, &b.wk, &mut s.att);
            dev.rms_norm(&s.att, &b.k_norm, c.eps, &mut s.k);
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
        lm_head(dev, s, batch.logit_rows, &self.out_norm, c.eps, self.head.as_ref().unwrap_or(&self.embed), None);
        Ok(())
    }
}
