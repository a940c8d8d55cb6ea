//! One stream's decode step at several context lengths on the CPU
//! (SmolLM2 from the model cache): where attention starts to dominate.
//! `cargo run --release -p braid-models --example decode_at_context`
use braid_engine::{Backend, Chunk, DecodeRow};
use braid_formats::cache::cached_model;
use braid_models::{BackendConfig, ModelBackend};
use braid_ops::cpu::Cpu;
use std::time::Instant;

fn main() {
    let path = cached_model("SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    let dev = Cpu::new(None);
    let (_src, model) = braid_models::open(&dev, &path).unwrap();
    let mut be = ModelBackend::new(dev, model, BackendConfig { kv_tokens: 16384, context: 8192, ..Default::default() }).unwrap();
    let toks: Vec<u32> = (0..8000).map(|i| (i * 7919 + 17) % 32000).collect();
    for (s, ctx) in [(1u64, 100usize), (2, 1000), (3, 3000), (4, 6000)] {
        be.open(s).unwrap();
        for c in (0..ctx).step_by(512) {
            let e = (c + 512).min(ctx);
            be.prefill_step(s, Chunk { start: c, tokens: &toks[c..e], want_logits: false }).unwrap();
        }
        let mut ts = Vec::new();
        for _ in 0..15 {
            let t = Instant::now();
            be.decode_logits(&[DecodeRow { stream: s, tokens: vec![5] }]).unwrap();
            ts.push(t.elapsed().as_secs_f64() * 1e3);
        }
        ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("ctx {ctx}: decode {:.2} ms (median of 15)", ts[7]);
    }
}
