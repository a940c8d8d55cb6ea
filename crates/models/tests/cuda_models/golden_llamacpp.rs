//! Teacher-forced agreement with llama.cpp on SmolLM2.

use super::*;

/// Teacher-forced top-1 agreement with llama.cpp on SmolLM2 (Q4_1 blocks
/// dequantized to bf16 at load): reported, and at least 90%.
#[test]
fn smollm2_teacher_forced_bf16() {
    let Some(dev) = gpu() else { return };
    let Some(path) = braid_formats::cache::cached_model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        eprintln!("SKIP: SmolLM2-135M-Instruct.Q4_1.gguf not in the model cache");
        return;
    };
    let gdir = std::env::var_os("BRAID_GOLDEN").map(PathBuf::from).unwrap_or_else(|| testdata().join("golden"));
    let g: Value = serde_json::from_str(&std::fs::read_to_string(gdir.join("smollm2-public.json")).unwrap()).unwrap();
    let (_src, model) = braid_models::open(&dev, &path).unwrap();
    let vocab = model.vocab();
    let mut be = ModelBackend::new(dev.clone(), model, BackendConfig { kv_tokens: 4096, context: 2048, max_batch: 4096, ..Default::default() }).unwrap();
    let (mut n, mut agree) = (0usize, 0usize);
    for (ri, rec) in g["greedy"].as_array().unwrap().iter().enumerate() {
        let prompt: Vec<u32> = rec["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let toks: Vec<u32> = rec["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let all: Vec<u32> = prompt.iter().chain(&toks).cloned().collect();
        be.open(ri as u64).unwrap();
        let logits = feed(&mut be, ri as u64, &all);
        be.forget(ri as u64);
        for (i, step) in rec["steps"].as_array().unwrap().iter().enumerate() {
            let row = &logits[(prompt.len() - 1 + i) * vocab..(prompt.len() + i) * vocab];
            n += 1;
            if argmax(row) as u64 == step["id"].as_u64().unwrap() {
                agree += 1;
            }
        }
    }
    eprintln!("SmolLM2 on {}: teacher-forced top-1 agreement with llama.cpp {agree}/{n} ({:.1}%)", dev.name(), 100.0 * agree as f64 / n as f64);
    assert!(n > 100, "too few positions: {n}");
    assert!(agree * 10 >= n * 9, "agreement {agree}/{n} under 90%");
}
