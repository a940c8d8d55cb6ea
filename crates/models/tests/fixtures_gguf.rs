//! GGUF files made from the tiny HF fixtures by llama.cpp b11434's own
//! converter (`scripts/fixtures/make_ggufs.py`): braid reads the metadata
//! keys and tensor names real GGUFs carry (and, for llama and Granite, the
//! converter's q/k row permutation; for the MoE families its stacked
//! experts; for the Mamba2 hybrids its `A = -exp(A_log)`), so its GGUF logits equal its HF-folder
//! logits — F32 within 1e-5, Q8_0 within the 8-bit quantization's error of
//! transformers' reference, and incremental decode as the whole pass.
//!
//! Families the converter writes and braid reads from GGUF: llama, qwen2
//! (untied and tied), qwen3, gemma3 (`gemma3_text_six`), lfm2, lfm2_moe, nemotron_h (as
//! `nemotron_h_moe`), minimax_m2, granitemoehybrid (as `granitehybrid`,
//! converted from the Hub's layer-type names, which the converter reads).
//! Not here:
//! * gemma3_text: the GGUF cannot hold this fixture's model. llama.cpp
//!   takes every sixth layer as global and 1/√head_dim as the attention
//!   scale; the converter writes neither `layer_types` nor
//!   `query_pre_attn_scalar` (the fixture: global layer 2 of 4, scalar 24).
//!   Its variant `gemma3_text_six` is in the released pattern and is here
//!   (converted with a stand-in tokenizer.json: the converter counts the
//!   vocabulary in it).
//! * gemma4_text, gemma4_text_moe: the converter writes them, braid reads
//!   Gemma 4 from HF folders only so far.
//! * minimax (MiniMax-Text-01): the converter registers the Hub's
//!   `MiniMaxText01ForCausalLM`, whose config keys differ from
//!   transformers' `MiniMaxConfig` (`layernorm_*_alpha/beta`, all betas 1),
//!   and reads a tokenizer and a sharded checkpoint's index.
//! * minimax_m3_vl_text: the converter registers the Hub's
//!   `MiniMaxM3SparseForCausalLM` (per-expert tensors,
//!   `sparse_attention_config`, `moe_layer_freq`), not transformers' text
//!   tower with fused experts.

mod fixtures_common;
use fixtures_common::*;

use braid_models::ModelBackend;
use braid_ops::cpu::Cpu;

const FAMILIES: [&str; 10] = ["llama", "qwen2", "qwen2_tied", "qwen3", "gemma3_text_six", "lfm2", "lfm2_moe", "nemotron_h", "minimax_m2", "granitemoehybrid"];

fn backend(path: &std::path::Path) -> ModelBackend<Cpu> {
    let dev = Cpu::new(None);
    let (_src, model) = braid_models::open(&dev, path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
    ModelBackend::new(dev, model, backend_config()).unwrap()
}

#[test]
fn f32_gguf_logits_equal_hf_folder_logits() {
    for name in FAMILIES {
        let fx = Fixture::load(name);
        let hf = stepped(&mut fx.backend(), 1, &fx.tokens, usize::MAX);
        let mut be = backend(&fx.dir.join("model-f32.gguf"));
        let gguf = stepped(&mut be, 1, &fx.tokens, usize::MAX);
        // 1e-5, relative past |logit| 10: llama's GGUF pairs RoPE dimensions
        // differently (the converter permutes q/k rows), which reorders the
        // f32 sums of q·k; the tied llama's logits reach 60.
        for (i, (a, b)) in gguf.iter().zip(&hf).enumerate() {
            let tol = 1e-5 * b.abs().max(10.0) / 10.0;
            assert!((a - b).abs() <= tol, "{name} F32 GGUF vs HF folder, row {} col {}: {a} vs {b}", i / fx.vocab, i % fx.vocab);
        }
        let d = diff(&gguf, &hf, fx.vocab);
        eprintln!("{name} F32 GGUF vs HF folder: max |diff| {:.2e}", d.max);
        assert_close(&format!("{name} F32 GGUF vs transformers"), &gguf, fx.logits("logits_full"), fx.vocab, 1e-4);
        let inc = incremental(&mut backend(&fx.dir.join("model-f32.gguf")), 1, &fx.tokens, PREFILL);
        // Nemotron-H: transformers' own decode skips the dt clamp; braid clamps
        // in every pass, as its clamped reference does.
        let reference = if name == "nemotron_h" { "logits_incremental_clamped" } else { "logits_incremental" };
        assert_close(&format!("{name} F32 GGUF incremental"), &inc, fx.logits(reference), fx.vocab, 1e-4);
    }
}

#[test]
fn q8_0_gguf_logits_are_within_quantization_error() {
    for name in FAMILIES {
        let fx = Fixture::load(name);
        let want = fx.logits("logits_full");
        let got = stepped(&mut backend(&fx.dir.join("model-q8_0.gguf")), 1, &fx.tokens, usize::MAX);
        // 8-bit weights and activations at hidden 64: the error's RMS
        // measured 1.6-2% of the logits' RMS for the attention families,
        // 3-6% for the hybrids (their recurrences carry it along the
        // sequence); a misread tensor is off by the whole spread. No bound
        // per element: an MoE row whose top-k flips under quantization
        // (the fixtures' routing margins are 2e-3) moves by several logits.
        let rms = |v: &mut dyn Iterator<Item = f32>| {
            let (n, s) = v.fold((0usize, 0f64), |(n, s), x| (n + 1, s + (x as f64) * (x as f64)));
            (s / n as f64).sqrt() as f32
        };
        let spread = rms(&mut want.iter().copied());
        let err = rms(&mut got.iter().zip(want).map(|(a, b)| a - b)) / spread;
        eprintln!("{name} Q8_0 GGUF vs transformers: error RMS {:.2}% of the logits' RMS", 100.0 * err);
        assert!(err <= 0.1, "{name} Q8_0 GGUF vs transformers: error RMS {:.2}% of the logits' RMS", 100.0 * err);
        let d = diff(&got, want, fx.vocab);
        // And quantization really happened: not the F32 logits.
        assert!(d.max > 1e-4, "{name}: Q8_0 logits equal the F32 reference ({:.2e})", d.max);
    }
}
