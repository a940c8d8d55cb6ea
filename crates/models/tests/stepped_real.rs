//! Stepped prefill equals the whole pass on the real SmolLM2 model (and,
//! for the chunked logits, on Qwen2.5-Coder-0.5B: K-quants, Q5_0, biases).
//!
//! The backend declares chunk invariance, so any chunking must give
//! bit-identical logits; and through a lane, greedy output must be the same
//! token for token whatever the chunk cap, also while another stream decodes
//! between the chunks.

use std::sync::Arc;

use braid_engine::{Backend, Chunk, Event, Lane, LaneConfig, Request, SamplingParams, StopRules, TokenText};
use braid_formats::cache::cached_model;
use braid_formats::gguf::Gguf;
use braid_formats::tokenizer::Tokenizer;
use braid_models::{BackendConfig, ModelBackend};
use braid_ops::cpu::Cpu;

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

struct Text(Tokenizer);
impl TokenText for Text {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.0.token_bytes(id).to_vec()
    }
}

fn backend() -> Option<(ModelBackend<Cpu>, Tokenizer)> {
    backend_of(MODEL)
}

fn backend_of(file: &str) -> Option<(ModelBackend<Cpu>, Tokenizer)> {
    let Some(path) = cached_model(file) else {
        eprintln!("SKIP: {file} not in the model cache");
        return None;
    };
    let dev = Cpu::new(None);
    let (_src, model) = braid_models::open(&dev, &path).unwrap();
    let tok = Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap();
    let be = ModelBackend::new(dev, model, BackendConfig { kv_tokens: 4096, context: 2048, ..Default::default() }).unwrap();
    Some((be, tok))
}

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and his daughter. Every morning",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
];

#[test]
fn chunked_prefill_logits_are_bit_identical() {
    for file in [MODEL, QWEN] {
        chunked_prefill_is_bit_identical(file);
    }
}

fn chunked_prefill_is_bit_identical(file: &str) {
    let Some((mut be, tok)) = backend_of(file) else { return };
    for p in PROMPTS {
        let ids = tok.encode(p, true).unwrap();
        let mut reference = None;
        for cap in [ids.len(), 1, 7, 64] {
            be.open(1).unwrap();
            let mut last = None;
            for (i, c) in ids.chunks(cap).enumerate() {
                let start = i * cap;
                last = be.prefill_step(1, Chunk { start, tokens: c, want_logits: start + c.len() == ids.len() }).unwrap();
            }
            be.forget(1);
            let last = last.expect("logits of the last chunk");
            match &reference {
                None => reference = Some(last),
                Some(r) => assert!(r == &last, "{file}, prompt {p:?}: chunk cap {cap} changed the logits"),
            }
        }
    }
}

fn greedy(lane: &Lane, prompt: Vec<u32>, n: usize) -> Vec<u32> {
    let req = Request {
        prompt,
        sampling: SamplingParams::greedy(),
        stop: StopRules { max_tokens: Some(n), ignore_eos: true, ..Default::default() },
        logprobs: None,
        ..Default::default()
    };
    lane.submit(req)
        .unwrap()
        .filter_map(|e| match e {
            Event::Token { id, .. } => Some(id),
            Event::Error(e) => panic!("{e}"),
            _ => None,
        })
        .collect()
}

#[test]
fn stepped_pass_equals_whole_pass_with_others_decoding() {
    let Some((be, tok)) = backend() else { return };
    let ids: Vec<Vec<u32>> = PROMPTS.iter().map(|p| tok.encode(p, true).unwrap()).collect();
    let text = Arc::new(Text(tok));
    let lane = |chunk: usize, max_rows: Option<usize>, be| {
        Lane::spawn(Box::new(be), text.clone(), LaneConfig { chunk_tokens: chunk, max_rows, prefix_marks: 0, ..LaneConfig::default() })
    };
    // Whole passes, one stream at a time.
    let whole = lane(4096, None, be);
    let expected: Vec<Vec<u32>> = ids.iter().map(|p| greedy(&whole, p.clone(), 12)).collect();
    let Some(be) = reclaim(whole) else { return };
    // Stepped passes with a background stream decoding between chunks.
    let mut be = Some(be);
    for (chunk, max_rows) in [(1, None), (7, None), (64, None), (4096, Some(3))] {
        let l = lane(chunk, max_rows, be.take().unwrap());
        let bg = l
            .submit(Request {
                prompt: vec![1, 2, 3],
                sampling: SamplingParams::greedy(),
                stop: StopRules { max_tokens: Some(1500), ignore_eos: true, ..Default::default() },
                ..Default::default()
            })
            .unwrap();
        // Wait until the background stream decodes.
        while !matches!(bg.recv(), Some(Event::Token { .. })) {}
        for (p, want) in ids.iter().zip(&expected) {
            let got = greedy(&l, p.clone(), 12);
            assert_eq!(&got, want, "chunk {chunk}, max_rows {max_rows:?}: stepped output differs from the whole pass");
        }
        let stats = l.stats();
        assert!(
            stats.decode_rounds > 0
                && stats.prefill_chunks as usize >= ids.iter().map(|p| p.len().div_ceil(chunk.min(max_rows.unwrap_or(chunk)))).sum::<usize>()
        );
        drop(bg);
        be = reclaim(l);
    }
}

/// A lane owns its backend; tests make a fresh one per lane instead.
fn reclaim(lane: Lane) -> Option<ModelBackend<Cpu>> {
    lane.shutdown();
    backend().map(|(b, _)| b)
}
