//! Models with random weights made directly on the device, for benchmarks
//! (`braid bench --random-weights`): no file is read and nothing crosses
//! the bus but the launches.

use anyhow::{bail, Result};
use braid_ops::{Device, Rope};

use crate::llama::{Llama, LlamaConfig};

/// A device that can fill weights with random values itself.
pub trait RandomInit: Device {
    /// `[rows, cols]` of uniform values in `[-amp, amp)`, from `seed`.
    fn random_weight(&self, rows: usize, cols: usize, seed: u64, amp: f32) -> Result<Self::Weight>;
    /// One row of `n` values, all `v`.
    fn const_vector(&self, n: usize, v: f32) -> Result<Self::Tensor>;
}

#[cfg(feature = "cuda")]
impl RandomInit for braid_ops::cuda::Cuda {
    fn random_weight(&self, rows: usize, cols: usize, seed: u64, amp: f32) -> Result<Self::Weight> {
        braid_ops::cuda::Cuda::random_weight(self, rows, cols, seed, amp)
    }
    fn const_vector(&self, n: usize, v: f32) -> Result<Self::Tensor> {
        braid_ops::cuda::Cuda::const_vector(self, n, v)
    }
}

/// Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 heads over 8 KV heads
/// of 64, MLP 8192, vocabulary 128256, tied embeddings.
pub fn llama_3_2_1b() -> LlamaConfig {
    LlamaConfig {
        hidden: 2048,
        layers: 16,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        ffn: 8192,
        vocab: 128256,
        eps: 1e-5,
        rope: Rope::new(500000.0, 64, true),
        context: 131072,
    }
}

/// SmolLM2-135M's shape: hidden 576, 30 layers, 9 heads over 3 KV heads
/// of 64, MLP 1536, vocabulary 49152, tied embeddings.
pub fn smollm2_135m() -> LlamaConfig {
    LlamaConfig {
        hidden: 576,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        ffn: 1536,
        vocab: 49152,
        eps: 1e-5,
        rope: Rope::new(100000.0, 64, true),
        context: 8192,
    }
}

/// A named preset shape.
pub fn preset(name: &str) -> Result<LlamaConfig> {
    match name {
        "llama-3.2-1b" | "llama3.2-1b" => Ok(llama_3_2_1b()),
        "smollm2-135m" | "smollm2" => Ok(smollm2_135m()),
        other => bail!("unknown random-weight preset '{other}' (known: llama-3.2-1b, smollm2-135m)"),
    }
}

/// The `[out, in]` shape of a Llama tensor, by its GGUF name.
fn llama_shape(c: &LlamaConfig, name: &str) -> Result<(usize, usize)> {
    let short = name.rsplit_once('.').map(|(a, _)| a).unwrap_or(name);
    let short = short.rsplit('.').next().unwrap_or(short);
    Ok(match short {
        "token_embd" | "output" => (c.vocab, c.hidden),
        "attn_q" => (c.heads * c.head_dim, c.hidden),
        "attn_k" | "attn_v" => (c.kv_heads * c.head_dim, c.hidden),
        "attn_output" => (c.hidden, c.heads * c.head_dim),
        "ffn_gate" | "ffn_up" => (c.ffn, c.hidden),
        "ffn_down" => (c.hidden, c.ffn),
        "attn_norm" | "ffn_norm" | "output_norm" => (1, c.hidden),
        other => bail!("no random shape for tensor {name} ({other})"),
    })
}

/// A Llama of shape `cfg` with uniform random weights (std 0.02, as
/// transformers initialises) and unit norms; tied head unless `untied`.
pub fn llama<D: RandomInit>(dev: &D, cfg: LlamaConfig, seed: u64, untied: bool) -> Result<Llama<D>> {
    let amp = 0.02 * 3f32.sqrt();
    let counter = std::cell::Cell::new(0u64);
    let c = cfg.clone();
    let w = |n: &str| {
        let (r, k) = llama_shape(&c, n)?;
        counter.set(counter.get() + 1);
        dev.random_weight(r, k, seed.wrapping_mul(1000).wrapping_add(counter.get()), amp)
    };
    let v = |n: &str| {
        let (_, k) = llama_shape(&c, n)?;
        dev.const_vector(k, 1.0)
    };
    Llama::from_tensors(cfg, &w, &v, untied, &|_, _| {})
}
