//! Qwen2 / Qwen2.5: the Llama block with biases on the q, k and v
//! projections, NeoX-paired RoPE, and an output head that is tied to the
//! embeddings or not as the file says (Qwen2.5-0.5B ties, 1.5B does not).

use anyhow::{bail, Result};
use braid_ops::Device;

use crate::config::HfConfig;
use crate::llama::{Llama, LlamaConfig, Variant};
use crate::source::Source;

/// Load a Qwen2 checkpoint (GGUF `qwen2` or HF `qwen2`) as a [`Llama`] with q/k/v biases.
pub fn load<D: Device>(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<Llama<D>> {
    let mut cfg = LlamaConfig::from_source(src)?;
    // llama.cpp's converter leaves Qwen2's q/k rows as HF has them (no
    // permutation), so GGUFs pair dimensions NeoX style as HF does.
    cfg.rope.neox = true;
    match src {
        Source::Hf(h) => {
            let c = HfConfig::new(h.config(), h.dir());
            let file = h.dir().join("config.json");
            // Sliding-window layers would need a windowed KV; none of the
            // released Qwen2.5 models use them, so refuse rather than run wrong.
            if c.opt_bool("use_sliding_window")?.unwrap_or(false) {
                bail!("{}: use_sliding_window = true is not supported for qwen2", file.display());
            }
            if let Some(t) = c.layer_types(cfg.layers)? {
                if let Some(other) = t.iter().find(|t| t.as_str() != "full_attention") {
                    bail!("{}: layer type '{other}' is not supported for qwen2 (only full_attention)", file.display());
                }
            }
            // transformers ties the head when the config says so (Qwen2's
            // default is untied) and then saves no `lm_head.weight`.
            let tied = c.opt_bool("tie_word_embeddings")?.unwrap_or(false);
            if !tied && !src.has_tensor("output.weight") {
                bail!("{}: tie_word_embeddings is false but the weights hold no lm_head.weight", h.dir().display());
            }
        }
        // A GGUF ties by leaving `output.weight` out (as llama.cpp reads it).
        Source::Gguf(_) => {}
    }
    crate::config::check_llama(&cfg, src)?;
    Llama::load_with(dev, src, cfg, Variant { qk_norm: false, qkv_bias: true }, progress)
}
