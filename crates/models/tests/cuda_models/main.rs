//! Models on the CUDA device: every family's tiny transformers fixture at
//! bf16 tolerance, stepped prefill equal to the whole pass, a model's
//! forwards with graphs, without and outside any forward (unfused) in
//! agreement, `ModelBackend`'s rounds (greedy, top-k, prepared and launched
//! ahead, and rounds that differ from the one launched ahead) against host
//! picks and a backend with ahead off, and teacher-forced agreement with
//! llama.cpp on SmolLM2. Each test skips (passes with a notice) where no GPU
//! or driver is present, as in CI.

#![cfg(feature = "cuda")]

#[path = "../fixtures_common/mod.rs"]
mod fixtures_common;

use std::collections::HashMap;
use std::path::PathBuf;

use braid_engine::{Backend, Chunk, DecodeRow, Draw, Pick, Picked, RoundMasks, RoundOut, Step, StreamId, TokenMask};
use braid_models::{device_draw, BackendConfig, Batch, Memory, Model, ModelBackend, Scratch};
use braid_ops::cuda::{Cuda, Tuning};
use braid_ops::{AttnSeq, Device, Forward, KvDtype, KvPoolSpec};
use serde_json::Value;

#[path = "../../../ops/tests/common/gpu.rs"]
mod gpu;
use gpu::gpu;

// The tests by topic (each module says what it holds); the helpers below
// are shared by all of them.
mod ahead_on_cpu;
mod drafting;
mod fixtures;
mod forwards;
mod golden_llamacpp;
mod rounds;
mod vision;

/// `testdata/` (or `$BRAID_TESTDATA`: the test binary may run on another
/// machine, from another checkout).
fn testdata() -> PathBuf {
    std::env::var_os("BRAID_TESTDATA").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata"))
}

fn fixture_dir(name: &str) -> PathBuf {
    testdata().join("fixtures").join(name)
}

/// F32 / I64 tensors of a reference.safetensors file, as f32.
fn reference(name: &str) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let tensors = fixtures_common::read_safetensors(&fixture_dir(name).join("reference.safetensors"));
    tensors.into_iter().map(|(k, t)| (k, (t.shape, t.data))).collect()
}

fn argmax(x: &[f32]) -> usize {
    braid_ops::argmax_host(x) as usize
}

fn backend<D: braid_ops::AllOps + Clone>(dev: &D, dir: &std::path::Path) -> ModelBackend<D> {
    let (_src, model) = braid_models::open(dev, dir).unwrap();
    ModelBackend::new(dev.clone(), model, gpu_config()).unwrap()
}

fn gpu_config() -> BackendConfig {
    BackendConfig { block_tokens: 16, kv_tokens: 8192, max_streams: 8, max_batch: 4096, context: 0, max_marks: 8, ..Default::default() }
}

/// Relative error of a whole logit table, and (agreeing, total) top-1 rows.
fn compare(got: &[f32], want: &[f32], vocab: usize) -> (f64, usize, usize) {
    assert_eq!(got.len(), want.len(), "logit tables of different sizes");
    let (mut num, mut den) = (0f64, 0f64);
    for (a, b) in got.iter().zip(want) {
        let d = if a.is_finite() { (a - b) as f64 } else { f64::INFINITY };
        num += d * d;
        den += (*b as f64).powi(2);
    }
    let rows = got.len() / vocab;
    let agree = (0..rows).filter(|&i| argmax(&got[i * vocab..(i + 1) * vocab]) == argmax(&want[i * vocab..(i + 1) * vocab])).count();
    ((num / den.max(1e-30)).sqrt(), agree, rows)
}

/// The bf16 tolerance of these checks.
const BF16_REL: f64 = 3e-2;
/// Top-k margins (router or block scores) under this are within bf16's
/// rounding of the hidden rows that make them.
const BF16_MARGIN: f64 = 1e-2;

/// The smallest top-k margin the fixture's generator measured, if it has
/// discrete choices.
fn discrete_margin(name: &str) -> Option<f64> {
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(fixture_dir(name).join("meta.json")).ok()?).ok()?;
    meta["measured"]["min_topk_margins"].as_object()?.values().filter_map(Value::as_f64).reduce(f64::min)
}

/// The logits of one decode row of `tokens` (a prompt, or one token).
fn feed<D: braid_ops::AllOps + Clone>(be: &mut ModelBackend<D>, stream: u64, tokens: &[u32]) -> Vec<f32> {
    be.decode_logits(&[DecodeRow { stream, tokens: tokens.to_vec() }]).unwrap()
}

fn tokens(out: RoundOut) -> Vec<u32> {
    match out.picked {
        Picked::Tokens(t) => t,
        other => panic!("an argmax round returned {other:?}"),
    }
}

/// `tok` is the argmax of `row` or within rounding of it: another batch
/// shape (the backend launched ahead splits a round the other serves whole)
/// changes the logits by bf16 rounding, so near-ties may flip; a wrong row
/// (position, KV, order) gives a token far below the best.
fn near_best(row: &[f32], tok: u32) -> bool {
    let best = row[argmax(row)];
    let worst = row.iter().cloned().fold(f32::INFINITY, f32::min);
    row[tok as usize] >= best - 1e-2 * (best - worst)
}
