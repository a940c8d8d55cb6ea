//! Qwen3 (dense): the Llama block with an RMSNorm on each head of q and k
//! before RoPE, a head dimension read from the config (heads × head_dim need
//! not equal hidden), and usually an untied head.

use anyhow::Result;
use braid_ops::Device;

use crate::llama::{Llama, LlamaConfig, Variant};
use crate::source::Source;

/// Load a Qwen3 checkpoint as a [`Llama`] with per-head q/k norms.
pub fn load<D: Device>(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<Llama<D>> {
    let mut cfg = LlamaConfig::from_source(src)?;
    // Qwen checkpoints (and their GGUFs) pair dimensions NeoX style.
    cfg.rope.neox = true;
    crate::config::check_llama(&cfg, src)?;
    Llama::load_with(dev, src, cfg, Variant { qk_norm: true, qkv_bias: false }, progress)
}
