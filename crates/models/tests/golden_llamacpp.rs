//! Teacher-forced agreement with llama.cpp on the real GGUF models.
//!
//! Feed `prompt_ids + tokens` of each greedy record; at every generated
//! position compare braid's top-1 with llama.cpp's token. llama.cpp rounds
//! differently (8-bit activations in other blocks, f16 accumulation in its
//! CPU flash attention), so near-ties may flip: measured here, even an exact
//! f32 evaluation of the same weights differs from llama.cpp's logprobs by up
//! to ~0.3 at such positions. The test therefore asserts: top-1 agreement of
//! at least 95%, and every disagreement is a near-tie in llama.cpp's own
//! top-5 (the two candidates within `TIE`). Positions where the two differ by
//! less than `MARGIN` (the bar) are counted and reported separately.

use std::path::PathBuf;

use braid_engine::{Backend, DecodeRow};
use braid_formats::cache::cached_model;
use braid_models::{BackendConfig, ModelBackend};
use braid_ops::cpu::Cpu;
use serde_json::Value;

const MARGIN: f32 = 0.05;
const TIE: f32 = 0.5;

fn golden(name: &str) -> Value {
    let dir = std::env::var_os("BRAID_GOLDEN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/golden"));
    let p = dir.join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let s: f64 = x.iter().map(|v| ((v - m) as f64).exp()).sum();
    let ls = m + s.ln() as f32;
    x.iter().map(|v| v - ls).collect()
}

fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap()
}

/// Returns (positions, agreeing top-1, largest |logprob diff| over tokens in both top-5s).
fn teacher_forced(model_file: &str, golden_file: &str) -> Option<(usize, usize, f32)> {
    let Some(path) = cached_model(model_file) else {
        eprintln!("SKIP: {model_file} not in the model cache (run `braid fetch` or .ci/run)");
        return None;
    };
    let dev = Cpu::new(None);
    let (_src, model) = braid_models::open(&dev, &path).unwrap();
    let vocab = model.vocab();
    let mut be = ModelBackend::new(dev, model, BackendConfig { kv_tokens: 1024, context: 1024, max_batch: 1024, ..Default::default() }).unwrap();
    let g = golden(golden_file);
    let (mut n, mut agree, mut max_diff) = (0usize, 0usize, 0f32);
    let mut failures = Vec::new();
    let mut within_margin = 0usize;
    for (ri, rec) in g["greedy"].as_array().unwrap().iter().enumerate() {
        let prompt: Vec<u32> = rec["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let toks: Vec<u32> = rec["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let all: Vec<u32> = prompt.iter().chain(&toks).cloned().collect();
        be.open(ri as u64).unwrap();
        let logits = be.decode_logits(&[DecodeRow { stream: ri as u64, tokens: all.clone() }]).unwrap();
        be.forget(ri as u64);
        for (i, step) in rec["steps"].as_array().unwrap().iter().enumerate() {
            let row = &logits[(prompt.len() - 1 + i) * vocab..(prompt.len() + i) * vocab];
            let lp = log_softmax(row);
            let ours = argmax(row) as u64;
            let theirs = step["id"].as_u64().unwrap();
            let top: Vec<(u64, f32)> =
                step["top"].as_array().unwrap().iter().map(|t| (t["id"].as_u64().unwrap(), t["logprob"].as_f64().unwrap() as f32)).collect();
            // Compare logprobs only for tokens in both top-5s.
            let mut ours_sorted: Vec<usize> = (0..vocab).collect();
            ours_sorted.select_nth_unstable_by(4, |&a, &b| lp[b].total_cmp(&lp[a]));
            for &(id, l) in &top {
                if ours_sorted[..5].contains(&(id as usize)) {
                    let d = (lp[id as usize] - l).abs();
                    if std::env::var("GOLDEN_DEBUG").is_ok() && d > 0.2 {
                        eprintln!("record {ri} step {i} (pos {}): token {id} braid {:.4} llama.cpp {l:.4}", prompt.len() - 1 + i, lp[id as usize]);
                    }
                    max_diff = max_diff.max(d);
                }
            }
            n += 1;
            if ours == theirs {
                agree += 1;
            } else {
                let their_lp = |id: u64| top.iter().find(|t| t.0 == id).map(|t| t.1);
                let (a, b) = (their_lp(theirs), their_lp(ours));
                let gap = match (a, b) {
                    (Some(a), Some(b)) => (a - b).abs(),
                    _ => f32::INFINITY,
                };
                if gap < MARGIN {
                    within_margin += 1;
                } else {
                    eprintln!(
                        "{golden_file} record {ri} step {i}: braid's top-1 {ours} vs llama.cpp's {theirs} (llama.cpp logprobs {a:?} vs {b:?}; braid's {:.4} vs {:.4})",
                        lp[theirs as usize], lp[ours as usize]
                    );
                }
                if gap >= TIE {
                    failures.push(format!(
                        "{golden_file} record {ri} step {i}: braid's top-1 {ours} vs llama.cpp's {theirs} (llama.cpp logprobs {a:?} vs {b:?}; braid's {:.4} vs {:.4})",
                        lp[theirs as usize], lp[ours as usize]
                    ));
                }
            }
        }
    }
    for f in &failures {
        eprintln!("{f}");
    }
    assert!(failures.is_empty(), "{} positions disagree beyond the margin", failures.len());
    eprintln!(
        "{model_file}: teacher-forced top-1 agreement {agree}/{n} ({:.1}%); with near-ties under {MARGIN}: {}/{n}; largest logprob diff for tokens in both top-5s {max_diff:.4}",
        100.0 * agree as f64 / n as f64,
        agree + within_margin
    );
    Some((n, agree, max_diff))
}

/// At least 95% of more than 100 teacher-forced positions agree with
/// llama.cpp's pick (skips where the model file is absent).
fn agrees_with_llamacpp(file: &str, golden: &str) {
    if let Some((n, agree, _)) = teacher_forced(file, golden) {
        assert!(n > 100, "too few positions checked: {n}");
        assert!(agree * 100 >= n * 95, "agreement {agree}/{n} under 95%");
    }
}

#[test]
fn smollm2_agrees_with_llamacpp() {
    agrees_with_llamacpp("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-public.json");
}

#[test]
fn gemma3_agrees_with_llamacpp() {
    agrees_with_llamacpp("gemma-3-270m-q4_k_m.gguf", "gemma3-public.json");
}

#[test]
fn qwen25_coder_05b_agrees_with_llamacpp() {
    agrees_with_llamacpp("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen25coder05-public.json");
}

/// The 1.5B is not fetched in CI (`braid fetch qwen2.5-coder-1.5b` to run it).
#[test]
fn qwen25_coder_15b_agrees_with_llamacpp() {
    agrees_with_llamacpp("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen25coder15-public.json");
}
