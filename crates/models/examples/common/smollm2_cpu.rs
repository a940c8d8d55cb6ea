//! What the CPU dev examples share: SmolLM2 from the model cache behind a
//! backend with room for many streams, and a long run of token ids.

use braid_formats::cache::cached_model;
use braid_models::{BackendConfig, ModelBackend};
use braid_ops::cpu::Cpu;

/// SmolLM2-135M Q4_1 on the CPU: 64 streams, 8192 tokens of context each.
pub fn backend() -> ModelBackend<Cpu> {
    let path = cached_model("SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    let dev = Cpu::new(None);
    let (_src, model) = braid_models::open(&dev, &path).unwrap();
    ModelBackend::new(dev, model, BackendConfig { kv_tokens: 65536, context: 8192, max_streams: 64, max_batch: 512, ..Default::default() }).unwrap()
}

/// 8000 token ids for prompts and contexts.
pub fn tokens() -> Vec<u32> {
    (0..8000).map(|i| (i * 7919 + 17) % 32000).collect()
}
