//! Models on the CUDA device: every family's tiny transformers fixture at
//! bf16 tolerance, stepped prefill equal to the whole pass, a model's
//! forwards with graphs, without and outside any forward (unfused) in
//! agreement, `ModelBackend`'s rounds (greedy, top-k, prepared and launched
//! ahead, and rounds that differ from the one launched ahead) against host
//! picks and a backend with ahead off, and teacher-forced agreement with
//! llama.cpp on SmolLM2. Each test skips (passes with a notice) where no GPU
//! or driver is present, as in CI.

#![cfg(feature = "cuda")]

mod fixtures_common;

use std::collections::HashMap;
use std::path::PathBuf;

use braid_engine::{Backend, Chunk, DecodeRow, Pick, Picked, RoundMasks, RoundOut, Step, StreamId, TokenMask};
use braid_models::{BackendConfig, Batch, Memory, Model, ModelBackend, Scratch};
use braid_ops::cuda::{Cuda, Tuning};
use braid_ops::{AttnSeq, Device, Forward, KvDtype, KvPoolSpec};
use serde_json::Value;

#[path = "../../ops/tests/common/gpu.rs"]
mod gpu;
use gpu::gpu;

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

/// Full-pass logits against transformers' (f32) at bf16 tolerance: relative
/// error of the whole table, and top-1 agreement row by row; then prefill
/// 24 and one token a round against the incremental table.
fn check_fixture(name: &str) {
    let Some(dev) = gpu() else { return };
    let r = reference(name);
    let toks: Vec<u32> = r["tokens"].1.iter().map(|&t| t as u32).collect();
    let (shape, want) = &r["logits_full"];
    let vocab = shape[1];
    let mut be = backend(&dev, &fixture_dir(name));
    be.open(1).unwrap();
    let got = feed(&mut be, 1, &toks);
    let (rel, agree, rows) = compare(&got, want, vocab);
    eprintln!("{name} on {}: full-pass logits rel err {rel:.2e}, top-1 agreement {agree}/{rows}", dev.name());
    assert!(rel < BF16_REL, "{name}: logits rel err {rel} over the bf16 tolerance {BF16_REL}");
    assert!(agree * 10 >= rows * 9, "{name}: top-1 agreement {agree}/{rows}");

    be.open(2).unwrap();
    let mut got = feed(&mut be, 2, &toks[..24]);
    for &t in &toks[24..] {
        got.extend(feed(&mut be, 2, &[t]));
    }
    let (rel, _, _) = compare(&got, &r["logits_incremental"].1, vocab);
    eprintln!("{name}: incremental logits rel err {rel:.2e}");
    assert!(rel < BF16_REL, "{name}: incremental logits rel err {rel}");
}

#[test]
fn llama_fixture_bf16() {
    check_fixture("llama");
}

#[test]
fn qwen3_fixture_bf16() {
    check_fixture("qwen3");
}

/// Qwen2's q/k/v biases and untied (or tied) head on the GPU.
#[test]
fn qwen2_fixtures_bf16() {
    check_fixture("qwen2");
    check_fixture("qwen2_tied");
}

/// How a model's forwards run in [`direct`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    /// `Model::forward` called outside any `Device::forward`, on weights no
    /// `prepare` saw: every op runs at once, unfused.
    Unfused,
    /// Inside `Device::forward` without a key (eager), after `prepare`.
    Eager,
    /// Inside keyed forwards (CUDA graphs, replayed when a shape recurs),
    /// after `prepare`.
    Graphs,
}

/// Forwards of `model` over one stream, without `ModelBackend`: the prompt
/// `toks[..24]` whole, then one token a forward; the logits of every row.
/// With `prepare`, the device first sees one row at position 0 (as
/// `ModelBackend::new` shows it).
fn direct(dev: &Cuda, model: &dyn Model<Cuda>, how: How, prepare: bool, toks: &[u32]) -> Vec<f32> {
    let bt = 16;
    let spec = KvPoolSpec::new(toks.len().div_ceil(bt) + 1, bt, model.kv_layers());
    let mut state = dev.tensor(1, model.state_size());
    if model.state_size() > 0 {
        dev.zero_rows(&mut state, &[0]);
    }
    let mut mem = Memory { kv: dev.kv_pool(&spec, KvDtype::F16).unwrap(), state };
    let mut s = Scratch::new(dev);
    let table: Vec<u32> = (0..spec.group_blocks[0] as u32).collect();
    if prepare {
        let one = Batch::warm_up(&table);
        dev.prepare(&mut || model.forward(dev, &one, &mut mem, &mut s)).unwrap();
    }
    let mut out = Vec::new();
    let mut start = 0;
    let mut parts: Vec<&[u32]> = vec![&toks[..24]];
    parts.extend(toks[24..].chunks(1));
    for part in parts {
        let n = part.len();
        let positions: Vec<u32> = (start as u32..(start + n) as u32).collect();
        let rows: Vec<usize> = (0..n).collect();
        let batch = Batch {
            tokens: part,
            positions: &positions,
            slots: &positions,
            seqs: vec![AttnSeq { q_start: 0, q_len: n, kv_len: start + n, blocks: &table, window: None }],
            window_slots: &positions,
            window_seqs: vec![AttnSeq { q_start: 0, q_len: n, kv_len: start + n, blocks: &table, window: None }],
            logit_rows: &rows,
            state_slots: &[0],
            images: Vec::new(),
        };
        match how {
            How::Unfused => model.forward(dev, &batch, &mut mem, &mut s).unwrap(),
            How::Eager | How::Graphs => {
                let key = (how == How::Graphs).then(|| batch.key());
                dev.forward(Forward { key, tokens: part }, &mut || model.forward(dev, &batch, &mut mem, &mut s)).unwrap()
            }
        }
        out.extend(dev.download(&s.logits).unwrap());
        start += n;
    }
    out
}

/// A fixture's forwards (prompt whole, then a token a forward) fused and
/// folded, eagerly and as replayed graphs, and unfused outside any forward
/// on weights never prepared: graphs give the eager bits, unfused agrees
/// within bf16 rounding, and all three match transformers' incremental
/// table. The MoE fixtures read their routing back mid-forward (such
/// forwards run eagerly, and so do all after them on the device).
fn check_direct(name: &str, incremental_key: &str, tol: f64) {
    let Some(dev) = gpu() else { return };
    let r = reference(name);
    let toks: Vec<u32> = r["tokens"].1.iter().map(|&t| t as u32).collect();
    let vocab = r["logits_full"].0[1];
    let want = &r[incremental_key].1;
    let (_, unprepared) = braid_models::open(&dev, &fixture_dir(name)).unwrap();
    let (_, prepared) = braid_models::open(&dev, &fixture_dir(name)).unwrap();
    let unfused = direct(&dev, unprepared.as_ref(), How::Unfused, false, &toks);
    let eager = direct(&dev, prepared.as_ref(), How::Eager, true, &toks);
    let before = dev.graph_stats();
    let graphs = direct(&dev, prepared.as_ref(), How::Graphs, false, &toks);
    let (replays, captures) = (dev.graph_stats().0 - before.0, dev.graph_stats().1 - before.1);
    eprintln!("{name}: keyed forwards: {replays} graph replays, {captures} captures");
    assert!(graphs.iter().zip(&eager).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: forwards as graphs differ from eager ones");
    for (what, got) in [("unfused", &unfused), ("fused and folded", &eager)] {
        let (rel, agree, rows) = compare(got, want, vocab);
        eprintln!("{name} {what}: incremental logits rel err {rel:.2e}, top-1 {agree}/{rows}");
        assert!(rel < BF16_REL, "{name} {what}: incremental logits rel err {rel} over {BF16_REL}");
        assert!(agree * 10 >= rows * 9, "{name} {what}: top-1 agreement {agree}/{rows}");
    }
    let (rel, agree, rows) = compare(&eager, &unfused, vocab);
    eprintln!("{name}: fused and folded vs unfused: rel err {rel:.2e}, top-1 {agree}/{rows}");
    assert!(rel < tol, "{name}: fused and folded vs unfused: rel err {rel} over {tol}");
}

#[test]
fn llama_fixture_graphs_eager_and_unfused_agree() {
    check_direct("llama", "logits_incremental", 1e-2);
}

#[test]
fn qwen3_fixture_graphs_eager_and_unfused_agree() {
    check_direct("qwen3", "logits_incremental", 1e-2);
}

/// Forwards that read their MoE routing back mid-way (LFM2-MoE, Gemma 4's
/// MoE, whose router reads a norm of its own right before the read, and the
/// MiniMax families) equal the same ops unfused and the reference (at the
/// bf16 tolerance: rounding may move a near-tie of the routing).
#[test]
fn moe_fixtures_reading_back_midway_agree() {
    for name in ["lfm2_moe", "gemma4_text_moe", "minimax", "minimax_m2", "minimax_m3_vl_text"] {
        check_direct(name, "logits_incremental", BF16_REL);
    }
}

/// A prompt run whole (chunks back to back) and stepped (the same cuts, a
/// decode round of another stream between chunks) gives bit-identical
/// logits and the same greedy continuation.
#[test]
fn stepped_prefill_equals_whole() {
    let Some(dev) = gpu() else { return };
    for name in ["llama", "qwen3"] {
        let r = reference(name);
        let toks: Vec<u32> = r["tokens"].1.iter().map(|&t| t as u32).collect();
        let mut be = backend(&dev, &fixture_dir(name));
        let vocab = be.capabilities().vocab_size;
        let run = |be: &mut ModelBackend<Cuda>, id: u64, interleave: bool| -> (Vec<f32>, Vec<u32>) {
            be.open(id).unwrap();
            if interleave {
                be.open(id + 100).unwrap();
                be.prefill_step(id + 100, Chunk { start: 0, tokens: &toks[..5], want_logits: false }).unwrap();
            }
            let mut last = Vec::new();
            let mut start = 0;
            for cut in toks.chunks(7) {
                let want = start + cut.len() == toks.len();
                if let Some(l) = be.prefill_step(id, Chunk { start, tokens: cut, want_logits: want }).unwrap() {
                    last = l;
                }
                start += cut.len();
                if interleave {
                    be.decode_logits(&[DecodeRow { stream: id + 100, tokens: vec![1] }]).unwrap();
                }
            }
            let mut out = Vec::new();
            let mut t = argmax(&last) as u32;
            for _ in 0..8 {
                out.push(t);
                let l = feed(be, id, &[t]);
                t = argmax(&l[..vocab]) as u32;
            }
            be.forget(id);
            be.forget(id + 100);
            (last, out)
        };
        let (whole, wt) = run(&mut be, 1, false);
        let (stepped, st) = run(&mut be, 2, true);
        eprintln!("{name}: whole {wt:?} stepped {st:?}");
        assert_eq!(wt, st, "{name}: greedy continuations differ");
        assert!(whole.iter().zip(&stepped).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: last-row logits not bit-identical");
    }
}

/// A two-layer Llama shape for random-weight tests.
fn tiny_llama() -> braid_models::llama::LlamaConfig {
    braid_models::llama::LlamaConfig {
        hidden: 256,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        head_dim: 32,
        ffn: 512,
        vocab: 1000,
        eps: 1e-5,
        rope: braid_ops::Rope::new(10000.0, 32, true),
        context: 4096,
    }
}

fn tiny_backend(dev: &Cuda, seed: u64) -> ModelBackend<Cuda> {
    let model = braid_models::random::llama(dev, tiny_llama(), seed, false).unwrap();
    ModelBackend::new(dev.clone(), Box::new(model), BackendConfig { kv_tokens: 4096, context: 1024, ..Default::default() }).unwrap()
}

/// The benchmark's greedy rounds (`Backend::round`, picked and launched
/// ahead on the device) give the same tokens as graphs or eager rounds.
#[test]
fn graphs_equal_eager_on_a_model() {
    let Some(dev) = gpu() else { return };
    let model = || Box::new(braid_models::random::llama(&dev, tiny_llama(), 3, false).unwrap());
    let mut be = braid_models::gpubench::backend(&dev, model(), 5, 60).unwrap();
    let (eager_tok_s, eager) = braid_models::gpubench::decode_run(&mut be, 5, 40, 2, 10, false).unwrap();
    let (graph_tok_s, graphed) = braid_models::gpubench::decode_run(&mut be, 5, 40, 2, 10, true).unwrap();
    eprintln!("tiny model: eager {eager_tok_s:.0} tok/s, graphs {graph_tok_s:.0} tok/s, stats {:?}, ahead {:?}", dev.graph_stats(), dev.ahead_hits());
    assert_eq!(eager, graphed, "graph rounds differ from eager rounds");
    assert!(dev.graph_stats().0 > 0, "no graph was replayed");
}

/// Decode rounds served by `ModelBackend` replay CUDA graphs (one per
/// batch shape) and give the same logits, bit for bit, as eager rounds;
/// a round with a prompt chunk runs eagerly beside them.
#[test]
fn backend_decode_rounds_replay_graphs() {
    let Some(dev) = gpu() else { return };
    let mut runs = Vec::new();
    for graphs in [false, true] {
        dev.set_graphs(graphs);
        let before = dev.graph_stats();
        let mut be = tiny_backend(&dev, 7);
        let mut out = Vec::new();
        for s in 0..3u64 {
            be.open(s).unwrap();
            let prompt: Vec<u32> = (0..20 + 7 * s as u32).map(|i| (i * 37 + s as u32) % 1000).collect();
            out.extend(be.prefill_step(s, Chunk { start: 0, tokens: &prompt, want_logits: true }).unwrap().unwrap());
        }
        be.open(9).unwrap();
        let late: Vec<u32> = (0..40).map(|i| (i * 11 + 5) % 1000).collect();
        for round in 0..8u32 {
            let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![(round * 13 + s as u32) % 1000] }).collect();
            if round == 4 {
                let o = be.round(Step::new(&rows, Some((9, Chunk { start: 0, tokens: &late, want_logits: true })), Pick::Logits)).unwrap();
                match o.picked {
                    Picked::Logits(l) => out.extend(l),
                    other => panic!("a logits round returned {other:?}"),
                }
                out.extend(o.chunk_logits.unwrap());
            } else {
                out.extend(be.decode_logits(&rows).unwrap());
            }
        }
        let after = dev.graph_stats();
        if graphs {
            assert!(after.0 - before.0 >= 3, "decode rounds did not replay graphs: {before:?} -> {after:?}");
        }
        runs.push(out);
    }
    dev.set_graphs(true);
    assert!(runs[0].iter().zip(&runs[1]).all(|(a, b)| a.to_bits() == b.to_bits()), "graph-replayed decode rounds differ from eager ones");
}

/// A backend over a random tiny Llama (vocabulary 1000) with streams 0-2
/// prompted, and each one's greedy first token.
fn three_prompted_streams(dev: &Cuda) -> (ModelBackend<Cuda>, Vec<u32>) {
    let mut be = tiny_backend(dev, 11);
    let mut first = Vec::new();
    for s in 0..3u64 {
        be.open(s).unwrap();
        let l = be.prefill_step(s, Chunk { start: 0, tokens: &prompt(s, 10 + 5 * s as usize), want_logits: true }).unwrap().unwrap();
        first.push(argmax(&l) as u32);
    }
    (be, first)
}

fn prompt(s: u64, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 31 + 7 * s as u32) % 1000).collect()
}

/// Greedy rounds picked on the device (only token ids come back, each
/// round launched ahead) give the tokens that the host's argmax of the
/// round's logits gives.
#[test]
fn backend_greedy_rounds_equal_host_argmax() {
    let Some(dev) = gpu() else { return };
    let mut runs = Vec::new();
    for on_device in [false, true] {
        let (mut be, mut last) = three_prompted_streams(&dev);
        assert!(be.capabilities().picks.argmax);
        let mut out = last.clone();
        for _ in 0..10 {
            let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![last[s as usize]] }).collect();
            last = if on_device {
                tokens(be.round(Step::new(&rows, None, Pick::Argmax)).unwrap())
            } else {
                be.decode_logits(&rows).unwrap().chunks(1000).map(|r| argmax(r) as u32).collect()
            };
            out.extend(&last);
        }
        runs.push(out);
    }
    assert_eq!(runs[0], runs[1], "device-picked greedy tokens differ from the host's argmax");
}

/// Greedy rounds whose host work was done ahead, while the GPU ran the
/// round before, and which were launched before the engine asked for them,
/// give the tokens eager rounds give (graphs off: the same batches, nothing
/// done ahead), through rounds that are not the one expected: a stream
/// leaves, one joins, one is rewound, block boundaries pass.
#[test]
fn rounds_prepared_ahead_equal_eager() {
    let Some(dev) = gpu() else { return };
    let mut runs = Vec::new();
    for graphs in [false, true] {
        dev.set_graphs(graphs);
        let hits = dev.ahead_hits();
        let (mut be, first) = three_prompted_streams(&dev);
        let mut last: HashMap<u64, u32> = (0..3u64).zip(first).collect();
        let mut lens: HashMap<u64, usize> = [(0, 10), (1, 15), (2, 20)].into();
        let mut out = Vec::new();
        for round in 0..40 {
            if round == 12 {
                be.forget(1);
                last.remove(&1);
            }
            if round == 20 {
                be.open(5).unwrap();
                let p: Vec<u32> = (0..13).map(|i| (i * 17 + 3) % 1000).collect();
                let l = be.prefill_step(5, Chunk { start: 0, tokens: &p, want_logits: true }).unwrap().unwrap();
                last.insert(5, argmax(&l) as u32);
                lens.insert(5, 13);
            }
            if round == 28 {
                // Back two rows: the next round repeats a position the
                // round launched ahead did not expect.
                let l = lens[&0] - 2;
                be.rewind(0, l).unwrap();
                lens.insert(0, l);
                last.insert(0, 42);
            }
            let mut ids: Vec<u64> = last.keys().copied().collect();
            ids.sort();
            let rows: Vec<DecodeRow> = ids.iter().map(|&s| DecodeRow { stream: s, tokens: vec![last[&s]] }).collect();
            let toks = tokens(be.round(Step::new(&rows, None, Pick::Argmax)).unwrap());
            for (&s, &t) in ids.iter().zip(&toks) {
                last.insert(s, t);
                *lens.get_mut(&s).unwrap() += 1;
            }
            out.push(toks);
        }
        if graphs {
            let (n, launched) = (dev.ahead_hits().0 - hits.0, dev.ahead_hits().1 - hits.1);
            eprintln!("rounds served from a forward done ahead: {n} of 40, {launched} of them launched before they were asked for");
            assert!(n >= 20, "only {n} of 40 rounds were prepared ahead");
            assert!(launched >= 20, "only {launched} of 40 rounds were launched ahead");
        }
        runs.push(out);
    }
    dev.set_graphs(true);
    assert_eq!(runs[0], runs[1], "rounds prepared ahead differ from eager rounds");
}

/// Rounds that carry a prompt chunk and name the next one (as the lane's
/// pacer does, `Step::next_chunk`) start that round on the device before
/// it is asked for; the tokens and the prompt's last logits equal eager
/// rounds' (graphs off: nothing started ahead), also where the chunk that
/// runs is not the one named.
#[test]
fn rounds_with_a_named_chunk_started_ahead_equal_eager() {
    let Some(dev) = gpu() else { return };
    let p = prompt(9, 44);
    // The chunks run, and the one each round names for the next (the
    // fourth names 8 rows, then 4 run).
    let runs_rows = [4usize, 8, 8, 16, 4, 4];
    let named = [Some(8usize), Some(8), Some(16), Some(8), Some(4), None];
    let mut runs = Vec::new();
    for graphs in [false, true] {
        dev.set_graphs(graphs);
        let hits = dev.ahead_hits();
        let (mut be, mut last) = three_prompted_streams(&dev);
        be.open(9).unwrap();
        let (mut out, mut pos, mut first, mut last_ahead) = (Vec::new(), 0, None, 0);
        for (i, &n) in runs_rows.iter().enumerate() {
            let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![last[s as usize]] }).collect();
            // The first chunk wants logits too: the logits buffer then holds
            // the row the last chunk adds, so that one can start ahead.
            let chunk = Chunk { start: pos, tokens: &p[pos..pos + n], want_logits: pos + n == p.len() || i == 0 };
            let next = named[i].map(|m| Chunk { start: pos + n, tokens: &p[pos + n..pos + n + m], want_logits: pos + n + m == p.len() });
            let before = dev.ahead_hits().1;
            let o = be.round(Step { next_chunk: next.map(|c| (9, c)), ..Step::new(&rows, Some((9, chunk)), Pick::Argmax) }).unwrap();
            if i + 1 == runs_rows.len() {
                last_ahead = dev.ahead_hits().1 - before;
            }
            if let Some(l) = &o.chunk_logits {
                first = Some(argmax(l) as u32);
            }
            last = tokens(o);
            out.push(last.clone());
            pos += n;
        }
        last.push(first.expect("the last chunk's logits"));
        let in_pass = dev.ahead_hits().1 - hits.1;
        for _ in 0..6 {
            let rows: Vec<DecodeRow> = [0u64, 1, 2, 9].iter().zip(&last).map(|(&s, &t)| DecodeRow { stream: s, tokens: vec![t] }).collect();
            last = tokens(be.round(Step::new(&rows, None, Pick::Argmax)).unwrap());
            out.push(last.clone());
        }
        if graphs {
            let launched = dev.ahead_hits().1 - hits.1;
            eprintln!("{launched} rounds found themselves launched ahead, {in_pass} of them with a chunk");
            // The second and third chunks ran as named ahead (8, 16); the
            // first could not start ahead (stream 1 filled its block, whose
            // next is given only with the round that needs it).
            assert!(in_pass >= 2, "only {in_pass} rounds with a chunk were launched ahead");
            assert_eq!(last_ahead, 1, "the last chunk, which wants logits, was not launched ahead");
            assert!(launched > in_pass, "no decode round after the pass was launched ahead");
        }
        runs.push(out);
    }
    dev.set_graphs(true);
    assert_eq!(runs[0], runs[1], "rounds started ahead with a chunk differ from eager rounds");
}

/// One scripted step of [`rounds_that_differ_from_the_one_launched_ahead`].
#[derive(Clone, Debug)]
enum Event {
    /// Open a stream and prefill its prompt in a chunk-only round.
    Join(StreamId, usize),
    /// Open a stream whose prompt arrives as the chunk of the next round.
    Open(StreamId, usize),
    Forget(StreamId),
    /// Drop the stream's last rows.
    Rewind(StreamId, usize),
    /// The next round: this stream's row carries a draft of `n` tokens after its token.
    Draft(StreamId, usize),
    /// The next round: this stream is fed another token than the one picked.
    Other(StreamId),
    /// The next round: the rows in reverse order.
    Reversed,
    /// The next round asks for `pick` (not argmax).
    Pick(Pick),
}

/// A round's decode rows: each stream of `next` fed its next token
/// (another one for `other`), `draft`'s stream with `n` draft tokens after
/// it, in stream order or `reversed`.
fn decode_rows(next: &HashMap<StreamId, u32>, draft: Option<(StreamId, usize)>, other: Option<StreamId>, reversed: bool, vocab: usize) -> Vec<DecodeRow> {
    let mut ids: Vec<StreamId> = next.keys().copied().collect();
    ids.sort();
    if reversed {
        ids.reverse();
    }
    ids.iter()
        .map(|&s| {
            let mut t = vec![if other == Some(s) { (next[&s] + 1) % vocab as u32 } else { next[&s] }];
            if let Some((_, n)) = draft.filter(|d| d.0 == s) {
                let t0 = t[0];
                t.extend((0..n as u32).map(|i| (t0 + 7 * i + 3) % vocab as u32));
            }
            DecodeRow { stream: s, tokens: t }
        })
        .collect()
}

/// The rounds of the scenario: (round, what happens before it), a stream
/// leaving last when `leave`.
fn script(leave: bool) -> Vec<(usize, Event)> {
    let mut v = vec![
        (4, Event::Open(3, 13)),
        (7, Event::Other(1)),
        (9, Event::Draft(0, 2)),
        (11, Event::Reversed),
        (13, Event::Join(4, 9)),
        (15, Event::Pick(Pick::TopK(5))),
        (16, Event::Pick(Pick::Logits)),
        (18, Event::Rewind(2, 3)),
        (20, Event::Draft(3, 3)),
        (22, Event::Reversed),
    ];
    if leave {
        v.push((26, Event::Forget(1)));
    }
    v
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

/// `ModelBackend` decides when to launch the next round ahead (after an
/// argmax round of one token per stream); when the next round differs from
/// the one launched, the rows it asks again come from the launched round
/// and the rest (and a chunk) run in another forward. Against a backend
/// with ahead off (`Tuning { ahead: false, launch_ahead: false }`) over the
/// same weights, fed the same tokens: each round's picks are the other's
/// argmax (or a near-tie of it: the batches differ where one splits a
/// round), its chunk logits the same within rounding, through a chunk
/// arriving beside decode rows, a stream joining, one fed another token, a
/// draft row, rows in another order, top-k and logits rounds, a rewind,
/// block boundaries and, last, a stream leaving.
#[test]
fn rounds_that_differ_from_the_one_launched_ahead() {
    let Some(dev) = gpu() else { return };
    let off_dev = Cuda::with_tuning(0, Tuning { ahead: false, launch_ahead: false, ..Tuning::default() }).unwrap();
    assert!(dev.caps().ahead && !off_dev.caps().ahead);
    let vocab = 1000;
    let (mut on, mut off) = (tiny_backend(&dev, 23), tiny_backend(&off_dev, 23));
    let mut next: HashMap<StreamId, u32> = HashMap::new();
    // Each stream's rows, as both backends hold them.
    let mut lens: HashMap<StreamId, usize> = HashMap::new();
    for s in 0..3u64 {
        let p = prompt(s, 10 + 5 * s as usize);
        lens.insert(s, p.len());
        let mut firsts = Vec::new();
        for be in [&mut on, &mut off] {
            be.open(s).unwrap();
            firsts.push(be.prefill_step(s, Chunk { start: 0, tokens: &p, want_logits: true }).unwrap().unwrap());
        }
        assert!(firsts[0].iter().zip(&firsts[1]).all(|(a, b)| a.to_bits() == b.to_bits()), "stream {s}: prompt logits differ");
        next.insert(s, argmax(&firsts[0]) as u32);
    }
    let script = script(true);
    let hits0 = dev.ahead_hits();
    let (mut exact, mut total) = (0usize, 0usize);
    let mut pending_chunk: Option<(StreamId, Vec<u32>)> = None;
    for round in 0..32usize {
        let (mut draft, mut other, mut reversed, mut pick) = (None, None, false, Pick::Argmax);
        for (_, ev) in script.iter().filter(|(r, _)| *r == round) {
            eprintln!("round {round}: {ev:?}");
            match *ev {
                Event::Join(s, n) => {
                    let p = prompt(s, n);
                    let mut l = Vec::new();
                    for be in [&mut on, &mut off] {
                        be.open(s).unwrap();
                        l.push(be.prefill_step(s, Chunk { start: 0, tokens: &p, want_logits: true }).unwrap().unwrap());
                    }
                    let (rel, _, _) = compare(&l[0], &l[1], vocab);
                    assert!(rel < 1e-6, "round {round}: the joining stream's prompt logits differ ({rel})");
                    next.insert(s, argmax(&l[0]) as u32);
                    lens.insert(s, n);
                }
                Event::Open(s, n) => {
                    for be in [&mut on, &mut off] {
                        be.open(s).unwrap();
                    }
                    lens.insert(s, 0);
                    pending_chunk = Some((s, prompt(s, n)));
                }
                Event::Forget(s) => {
                    for be in [&mut on, &mut off] {
                        be.forget(s);
                    }
                    next.remove(&s);
                    lens.remove(&s);
                }
                Event::Rewind(s, n) => {
                    let len = lens[&s] - n;
                    for be in [&mut on, &mut off] {
                        be.rewind(s, len).unwrap();
                    }
                    lens.insert(s, len);
                    next.insert(s, 42);
                }
                Event::Draft(s, n) => draft = Some((s, n)),
                Event::Other(s) => other = Some(s),
                Event::Reversed => reversed = true,
                Event::Pick(p) => pick = p,
            }
        }
        let rows = decode_rows(&next, draft, other, reversed, vocab);
        let chunk = pending_chunk.take();
        let step_chunk = chunk.as_ref().map(|(s, p)| (*s, Chunk { start: 0, tokens: p.as_slice(), want_logits: true }));
        let a = on.round(Step::new(&rows, step_chunk, pick)).unwrap();
        let b = off.round(Step::new(&rows, step_chunk, Pick::Logits)).unwrap();
        let Picked::Logits(want) = b.picked else { panic!("a logits round returned other picks") };
        if let Some((s, p)) = &chunk {
            let (l_on, l_off) = (a.chunk_logits.as_ref().unwrap(), b.chunk_logits.as_ref().unwrap());
            let (rel, _, _) = compare(l_on, l_off, vocab);
            assert!(rel < 1e-2 && near_best(l_off, argmax(l_on) as u32), "round {round}: stream {s}'s chunk logits differ (rel err {rel})");
            next.insert(*s, argmax(l_on) as u32);
            *lens.get_mut(s).unwrap() += p.len();
        }
        // Each token row's pick against the other backend's logits.
        let n_rows = want.len() / vocab;
        let want_rows: Vec<&[f32]> = want.chunks(vocab).collect();
        let picked_first: Vec<u32> = match &a.picked {
            Picked::Tokens(t) => {
                assert_eq!(t.len(), n_rows, "round {round}: picks for {} rows of {n_rows}", t.len());
                for (i, (&tok, row)) in t.iter().zip(&want_rows).enumerate() {
                    total += 1;
                    exact += (tok as usize == argmax(row)) as usize;
                    assert!(
                        near_best(row, tok),
                        "round {round}: row {i} picked {tok}, the other backend's best is {} ({} against {})",
                        argmax(row),
                        row[tok as usize],
                        row[argmax(row)]
                    );
                }
                t.clone()
            }
            Picked::Top(c) => {
                assert_eq!(c.len(), n_rows);
                for (i, (cands, row)) in c.iter().zip(&want_rows).enumerate() {
                    assert!(near_best(row, cands[0].0), "round {round}: row {i}'s best candidate {:?} is not the other's best", cands[0]);
                    for &(t, v) in cands {
                        assert!(
                            (v - row[t as usize]).abs() <= 1e-2 * row[t as usize].abs().max(0.1),
                            "round {round}: row {i} candidate {t}: {v} against {}",
                            row[t as usize]
                        );
                    }
                }
                c.iter().map(|c| c[0].0).collect()
            }
            Picked::Logits(l) => {
                let (rel, agree, rows) = compare(l, &want, vocab);
                assert!(rel < 1e-2 && agree * 10 >= rows * 9, "round {round}: logits differ (rel err {rel}, top-1 {agree}/{rows})");
                want_rows.iter().map(|r| argmax(r) as u32).collect()
            }
        };
        // Each stream goes on from its row's first pick (a draft's other
        // picks are checked above; its drafts are then dropped).
        let mut at = 0;
        for r in &rows {
            next.insert(r.stream, picked_first[at]);
            at += r.tokens.len();
            *lens.get_mut(&r.stream).unwrap() += r.tokens.len();
        }
        if let Some((s, n)) = draft {
            let len = lens[&s] - n;
            for be in [&mut on, &mut off] {
                be.rewind(s, len).unwrap();
            }
            lens.insert(s, len);
        }
    }
    let (h, l) = (dev.ahead_hits().0 - hits0.0, dev.ahead_hits().1 - hits0.1);
    eprintln!(
        "rounds differing from the one launched ahead: {exact}/{total} picks exactly the other backend's argmax; {h} forwards served ahead, {l} launched"
    );
    assert!(l >= 10, "only {l} rounds were launched ahead: the scenario did not exercise it");
    assert!(exact * 10 >= total * 9, "only {exact}/{total} picks equal the other backend's argmax");
}

/// Top-k rounds (only each row's k best logits come back) give the
/// candidates the host finds in the same round's logits.
#[test]
fn backend_top_k_rounds_equal_host_top_k() {
    let Some(dev) = gpu() else { return };
    let mut runs = Vec::new();
    for on_device in [false, true] {
        let (mut be, mut last) = three_prompted_streams(&dev);
        assert_eq!(be.capabilities().picks.top_k, 64);
        let mut out = Vec::new();
        for round in 0..10 {
            let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![last[s as usize]] }).collect();
            let cands = if on_device {
                match be.round(Step::new(&rows, None, Pick::TopK(40))).unwrap().picked {
                    Picked::Top(c) => c,
                    other => panic!("a top-k round returned {other:?}"),
                }
            } else {
                braid_ops::top_k_host(&be.decode_logits(&rows).unwrap(), 1000, 40)
            };
            // Walk on through the candidates (not always the first).
            last = cands.iter().map(|c| c[round % 3].0).collect();
            out.push(cands);
        }
        runs.push(out);
    }
    assert_eq!(runs[0], runs[1], "device top-k candidates differ from the host's");
}

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

// ---- the other families on CUDA: the recurrent ops, the MoE scatter,
// RoPE from a table and block-sparse attention in a model ----

/// One fixture on the GPU against its transformers tables (full pass,
/// transformers' chunks of 16/11/13, prefill 24 then one token a round),
/// each within the bf16 tolerance with top-1 agreement on 90% of rows; and
/// the state slots: a stream restored from a mark continues exactly as the
/// marked stream does (same shapes, so bit for bit), and streams decoding
/// in one round match each decoding alone.
fn check_hybrid(name: &str, incremental_key: &str) {
    let Some(dev) = gpu() else { return };
    let r = reference(name);
    let toks: Vec<u32> = r["tokens"].1.iter().map(|&t| t as u32).collect();
    let vocab = r["logits_full"].0[1];
    let mut be = backend(&dev, &fixture_dir(name));
    // A fixture whose discrete choices (MoE or block top-k) are closer
    // than bf16 resolves takes other branches on the GPU than in f32
    // wherever rounding flips one, so its whole table is not a bf16
    // tolerance test; its top-1 agreement still is.
    let margin = discrete_margin(name);
    let exact_choices = margin.is_none_or(|m| m >= BF16_MARGIN);
    let check = |what: &str, got: &[f32], key: &str| {
        let (rel, agree, rows) = compare(got, &r[key].1, vocab);
        eprintln!("{name} on {}: {what} logits rel err {rel:.2e}, top-1 agreement {agree}/{rows}", dev.name());
        if exact_choices {
            assert!(rel < BF16_REL, "{name} {what}: logits rel err {rel} over the bf16 tolerance {BF16_REL}");
        } else {
            eprintln!("{name}: its smallest top-k margin {margin:?} is under bf16's {BF16_MARGIN}: top-1 checked, not the table");
        }
        assert!(agree * 10 >= rows * 9, "{name} {what}: top-1 agreement {agree}/{rows}");
    };

    be.open(1).unwrap();
    check("full-pass", &feed(&mut be, 1, &toks), "logits_full");

    be.open(2).unwrap();
    let mut got = Vec::new();
    for part in [&toks[..16], &toks[16..27], &toks[27..]] {
        got.extend(feed(&mut be, 2, part));
    }
    check("chunked (16, 11, 13)", &got, "logits_chunked");

    be.open(3).unwrap();
    let mut got = feed(&mut be, 3, &toks[..24]);
    for &t in &toks[24..] {
        got.extend(feed(&mut be, 3, &[t]));
    }
    check("incremental", &got, incremental_key);
    for s in 1..=3 {
        be.forget(s);
    }

    // A mark mid-prompt, restored into a fresh stream after the marked one
    // and the mark are gone.
    let m = 13;
    be.open(4).unwrap();
    feed(&mut be, 4, &toks[..m]);
    let mark = be.keep_mark(4).unwrap();
    let rest_a = feed(&mut be, 4, &toks[m..]);
    be.forget(4);
    be.open(5).unwrap();
    assert_eq!(be.restore_mark(5, mark).unwrap(), m, "{name}: restored length");
    be.drop_mark(mark);
    let rest_b = feed(&mut be, 5, &toks[m..]);
    be.forget(5);
    assert!(rest_a.iter().zip(&rest_b).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: the restored stream differs from the marked one");
    eprintln!("{name}: stream restored from a mark at {m} == the marked stream, bit-identical");

    // Three streams (different prompts, each prefilled alone), decoding
    // together, against each decoding alone in a fresh backend.
    let n = toks.len();
    let prompts: Vec<Vec<u32>> =
        [(0usize, 9usize), (11, 17), (30, 23)].iter().map(|&(at, len)| toks.iter().cycle().skip(at).take(len).cloned().collect()).collect();
    let step = |s: usize, round: usize| toks[(7 * s + 5 * round) % n];
    let rounds = 4;
    let mut together: Vec<Vec<f32>> = vec![Vec::new(); 3];
    for (s, p) in prompts.iter().enumerate() {
        be.open(10 + s as u64).unwrap();
        feed(&mut be, 10 + s as u64, p);
    }
    for round in 0..rounds {
        let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: 10 + s as u64, tokens: vec![step(s, round)] }).collect();
        let l = be.decode_logits(&rows).unwrap();
        for (s, t) in together.iter_mut().enumerate() {
            t.extend_from_slice(&l[s * vocab..(s + 1) * vocab]);
        }
    }
    let cpu = braid_ops::cpu::Cpu::new(None);
    for (s, p) in prompts.iter().enumerate() {
        let mut alone_be = backend(&dev, &fixture_dir(name));
        alone_be.open(0).unwrap();
        feed(&mut alone_be, 0, p);
        let mut alone = Vec::new();
        for round in 0..rounds {
            alone.extend(feed(&mut alone_be, 0, &[step(s, round)]));
        }
        // The same stream alone on the CPU, in f32: the truth both GPU runs
        // are within bf16 tolerance of.
        let mut cpu_be = backend(&cpu, &fixture_dir(name));
        cpu_be.open(0).unwrap();
        feed(&mut cpu_be, 0, p);
        let mut truth = Vec::new();
        for round in 0..rounds {
            truth.extend(feed(&mut cpu_be, 0, &[step(s, round)]));
        }
        let (rel, agree, rows) = compare(&together[s], &alone, vocab);
        let (rel_b, agree_b, _) = compare(&together[s], &truth, vocab);
        let (rel_a, _, _) = compare(&alone, &truth, vocab);
        eprintln!(
            "{name}: stream {s} decoding beside two others vs alone: rel err {rel:.2e}, top-1 {agree}/{rows}; against the CPU's f32: beside {rel_b:.2e} (top-1 {agree_b}/{rows}), alone {rel_a:.2e}"
        );
        // A state row mixed up between streams moves logits by O(1). bf16
        // puts a stream at ~1e-2 of itself alone, and a family with a
        // discrete choice on the logits' path (MiniMax-M3's block top-k)
        // further where a near-tie flips; against the f32 truth the batched
        // stream keeps to the tolerance its transformers checks keep to.
        assert!(
            rel_b < BF16_REL || !exact_choices && rel_b < 2.0 * rel_a.max(BF16_REL),
            "{name}: stream {s} batched is {rel_b:.2e} from the f32 result (alone: {rel_a:.2e}; batched vs alone {rel})"
        );
        // Where a flipped choice moved the GPU off the f32 path alone too,
        // the batched pick follows the GPU's own path.
        for (i, row) in together[s].chunks(vocab).enumerate() {
            let pick = argmax(row) as u32;
            let at = i * vocab..(i + 1) * vocab;
            assert!(
                near_best(&truth[at.clone()], pick) || !exact_choices && near_best(&alone[at], pick),
                "{name}: stream {s} round {i} batched picks {pick}, not a near-tie of the f32 best (nor of its own alone)"
            );
        }
    }
}

#[test]
fn gemma3_fixture_bf16() {
    check_hybrid("gemma3_text", "logits_incremental");
}

#[test]
fn lfm2_fixture_bf16() {
    check_hybrid("lfm2", "logits_incremental");
}

#[test]
fn lfm2_moe_fixture_bf16() {
    check_hybrid("lfm2_moe", "logits_incremental");
}

#[test]
fn nemotron_h_fixture_bf16() {
    // transformers' own decode does not clamp dt; braid does, as its prefill.
    check_hybrid("nemotron_h", "logits_incremental_clamped");
}

#[test]
fn minimax_fixture_bf16() {
    check_hybrid("minimax", "logits_incremental");
}

#[test]
fn minimax_m2_fixture_bf16() {
    check_hybrid("minimax_m2", "logits_incremental");
}

#[test]
fn minimax_m3_fixture_bf16() {
    check_hybrid("minimax_m3_vl_text", "logits_incremental");
}

/// Gemma 3 with window-only KV on CUDA (blocks of 16, a window of 8: a
/// 200-token stream holds a few window blocks of its 13): greedy tokens and
/// logits equal those of full KV in every layer (`window_kv` off) whole and
/// in chunks of 48, and, fed the CPU's greedy continuation, every row's
/// top-1 agrees with the CPU's (f32, window-only too) at bf16 tolerance.
#[test]
fn gemma3_window_kv_matches_full_kv_and_the_cpu() {
    let Some(dev) = gpu() else { return };
    let dir = fixture_dir("gemma3_text");
    let greedy = |be: &mut ModelBackend<Cuda>, prompt: &[u32], cap: usize, n: usize| -> (Vec<f32>, Vec<u32>) {
        be.open(1).unwrap();
        let mut out = Vec::new();
        for c in prompt.chunks(cap) {
            out.extend(feed(be, 1, c));
        }
        let vocab = be.model().vocab();
        let mut toks = Vec::new();
        for _ in 0..n {
            let t = argmax(&out[out.len() - vocab..]) as u32;
            toks.push(t);
            out.extend(feed(be, 1, &[t]));
        }
        be.forget(1);
        (out, toks)
    };
    let (_src, m) = braid_models::open(&dev, &dir).unwrap();
    let vocab = m.vocab();
    let prompt: Vec<u32> = (0..200).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    for cap in [usize::MAX, 48] {
        let mut window = backend(&dev, &dir);
        assert!(window.fill().window_blocks_total > 0, "a window group");
        let (_src, m) = braid_models::open(&dev, &dir).unwrap();
        let mut full = ModelBackend::new(dev.clone(), m, BackendConfig { window_kv: false, ..gpu_config() }).unwrap();
        let (w, wt) = greedy(&mut window, &prompt, cap, 40);
        let (f, ft) = greedy(&mut full, &prompt, cap, 40);
        let (rel, _, _) = compare(&w, &f, vocab);
        let bits = w.iter().zip(&f).all(|(a, b)| a.to_bits() == b.to_bits());
        eprintln!("gemma3 window-only KV on CUDA (chunks of {cap}): rel err {rel:.2e} against full KV, bit-identical {bits}");
        assert_eq!(wt, ft, "greedy tokens, window-only against full KV (chunks of {cap})");
        assert!(rel < 1e-5, "window-only KV moved the logits by {rel} (chunks of {cap})");
    }
    // The CPU's greedy continuation, teacher-forced on CUDA.
    let cpu = braid_ops::cpu::Cpu::new(None);
    let (_src, m) = braid_models::open(&cpu, &dir).unwrap();
    let mut cb = ModelBackend::new(cpu, m, BackendConfig { kv_dtype: KvDtype::F32, ..gpu_config() }).unwrap();
    cb.open(1).unwrap();
    let mut want = feed(&mut cb, 1, &prompt);
    let mut seq = prompt.clone();
    for _ in 0..40 {
        let t = argmax(&want[want.len() - vocab..]) as u32;
        seq.push(t);
        want.extend(feed(&mut cb, 1, &[t]));
    }
    let mut gb = backend(&dev, &dir);
    gb.open(1).unwrap();
    let mut got = feed(&mut gb, 1, &prompt);
    for &t in &seq[200..] {
        got.extend(feed(&mut gb, 1, &[t]));
    }
    let (rel, agree, rows) = compare(&got, &want, vocab);
    eprintln!("gemma3 window-only KV, CUDA against the CPU: rel err {rel:.2e}, top-1 agreement {agree}/{rows}");
    assert!(rel < BF16_REL, "rel err {rel} over the bf16 tolerance");
    assert!(agree * 10 >= rows * 9, "top-1 agreement {agree}/{rows}");
    let decode = (199..rows).filter(|&i| argmax(&got[i * vocab..(i + 1) * vocab]) == argmax(&want[i * vocab..(i + 1) * vocab])).count();
    assert!(decode * 10 >= (rows - 199) * 9, "the decode rows' tokens: {decode}/{} agree with the CPU's", rows - 199);
}

#[test]
fn gemma4_fixtures_bf16() {
    check_hybrid("gemma4_text", "logits_incremental");
    check_hybrid("gemma4_text_moe", "logits_incremental");
}

/// Every family's fixture with forwards as graphs, eager, and unfused: the
/// families without MoE (the read-back ones are above).
#[test]
fn other_fixtures_graphs_eager_and_unfused_agree() {
    for (name, key) in [
        ("qwen2", "logits_incremental"),
        ("gemma3_text", "logits_incremental"),
        ("gemma4_text", "logits_incremental"),
        ("lfm2", "logits_incremental"),
        ("nemotron_h", "logits_incremental_clamped"),
    ] {
        check_direct(name, key, 1e-2);
    }
}

// ---- `ModelBackend`'s rounds launched ahead, on the CPU ----
//
// Only a device whose `caps().ahead` is set (CUDA) makes `ModelBackend`
// launch rounds ahead and serve the next round from them. The CPU device
// wrapped to claim it runs those paths too (its `forward_ahead` and launch
// do nothing, so the backend's served rows come from the forward it runs
// for them), and the CPU is batch-invariant: there, ahead on and ahead off
// must give the same bits. This checks the backend's bookkeeping (which
// rows are served, the rest run, picks merged back in order, lengths)
// without a GPU.

mod ahead_on_cpu {
    use super::*;
    use braid_formats::{Bytes, DType, TensorView};
    use braid_ops::cpu::{Cpu, CpuKv, CpuTensor, CpuWeight};
    use braid_ops::{Act, DeviceCaps, Map, Rope};

    /// The CPU device, claiming `ahead` (and top-k on the host).
    #[derive(Clone, Copy)]
    pub struct AheadCpu(Cpu, bool);

    impl Device for AheadCpu {
        type Tensor = CpuTensor;
        type Weight = CpuWeight;
        type Kv = CpuKv;
        fn name(&self) -> String {
            format!("cpu claiming ahead {}", self.1)
        }
        fn caps(&self) -> DeviceCaps {
            DeviceCaps { ahead: self.1, argmax: true, top_k: 64, ..self.0.caps() }
        }
        fn tensor(&self, r: usize, c: usize) -> CpuTensor {
            self.0.tensor(r, c)
        }
        fn resize(&self, t: &mut CpuTensor, r: usize, c: usize) {
            self.0.resize(t, r, c)
        }
        fn shape(&self, t: &CpuTensor) -> (usize, usize) {
            self.0.shape(t)
        }
        fn upload(&self, d: &[f32], r: usize, c: usize) -> anyhow::Result<CpuTensor> {
            self.0.upload(d, r, c)
        }
        fn download(&self, t: &CpuTensor) -> anyhow::Result<Vec<f32>> {
            self.0.download(t)
        }
        fn weight(&self, v: &TensorView) -> anyhow::Result<CpuWeight> {
            self.0.weight(v)
        }
        fn weight_shape(&self, w: &CpuWeight) -> (usize, usize) {
            self.0.weight_shape(w)
        }
        fn vector(&self, v: &TensorView, o: f32) -> anyhow::Result<CpuTensor> {
            self.0.vector(v, o)
        }
        fn kv_pool(&self, s: &KvPoolSpec, d: KvDtype) -> anyhow::Result<CpuKv> {
            self.0.kv_pool(s, d)
        }
        fn embed(&self, t: &CpuWeight, ids: &[u32], s: f32, o: &mut CpuTensor) {
            self.0.embed(t, ids, s, o)
        }
        fn matmul(&self, x: &CpuTensor, ws: &[&CpuWeight], o: &mut [&mut CpuTensor]) {
            self.0.matmul(x, ws, o)
        }
        fn gather_rows(&self, x: &CpuTensor, r: &[usize], o: &mut CpuTensor) {
            self.0.gather_rows(x, r, o)
        }
        fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, e: f32, o: &mut CpuTensor) {
            self.0.rms_norm(x, w, e, o)
        }
        fn add(&self, x: &mut CpuTensor, y: &CpuTensor) {
            self.0.add(x, y)
        }
        fn map(&self, x: &mut CpuTensor, f: Map) {
            self.0.map(x, f)
        }
        fn gated(&self, a: Act, g: &CpuTensor, u: &CpuTensor, o: &mut CpuTensor) {
            self.0.gated(a, g, u, o)
        }
        fn rope(&self, x: &mut CpuTensor, p: &[u32], h: usize, r: &Rope) {
            self.0.rope(x, p, h, r)
        }
        fn kv_write(&self, kv: &mut CpuKv, l: usize, k: &CpuTensor, v: &CpuTensor, s: &[u32]) {
            self.0.kv_write(kv, l, k, v, s)
        }
        fn kv_copy_blocks(&self, kv: &mut CpuKv, g: usize, s: &[u32], d: &[u32]) {
            self.0.kv_copy_blocks(kv, g, s, d)
        }
        fn attention(&self, q: &CpuTensor, kv: &CpuKv, l: usize, s: &[AttnSeq<'_>], sc: f32, c: Option<f32>, o: &mut CpuTensor) {
            self.0.attention(q, kv, l, s, sc, c, o)
        }
        fn copy_rows(&self, t: &mut CpuTensor, s: &[u32], d: &[u32]) {
            self.0.copy_rows(t, s, d)
        }
        fn zero_rows(&self, t: &mut CpuTensor, r: &[u32]) {
            self.0.zero_rows(t, r)
        }
    }

    impl braid_models::random::RandomInit for AheadCpu {
        fn random_weight(&self, rows: usize, cols: usize, seed: u64, amp: f32) -> anyhow::Result<CpuWeight> {
            let mut s = seed | 1;
            let bytes: Vec<u8> = (0..rows * cols)
                .flat_map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp).to_le_bytes()
                })
                .collect();
            self.weight(&TensorView { name: "random".into(), dtype: DType::F32, shape: vec![rows, cols], data: Bytes::from_vec(bytes) })
        }
        fn const_vector(&self, n: usize, v: f32) -> anyhow::Result<CpuTensor> {
            self.upload(&vec![v; n], 1, n)
        }
    }

    /// The scenario's rounds on a backend over `dev`: each round's picks
    /// (logits as bits) and chunk logits, as text.
    const VOCAB: usize = 100;

    /// A tiny random Llama on `dev`, and streams 0, 1, 2 prefilled with
    /// their next tokens and lengths.
    fn three_streams(dev: AheadCpu) -> (ModelBackend<AheadCpu>, HashMap<StreamId, u32>, HashMap<StreamId, usize>) {
        let vocab = VOCAB;
        let cfg = braid_models::llama::LlamaConfig {
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 128,
            vocab,
            eps: 1e-5,
            rope: Rope::new(1e4, 16, true),
            context: 512,
        };
        let model = braid_models::random::llama(&dev, cfg, 5, false).unwrap();
        let mut be = ModelBackend::new(dev, Box::new(model), BackendConfig { kv_tokens: 2048, context: 512, ..Default::default() }).unwrap();
        let prompt = |s: u64, n: usize| -> Vec<u32> { (0..n as u32).map(|i| (i * 31 + 7 * s as u32) % vocab as u32).collect() };
        let (mut next, mut lens) = (HashMap::new(), HashMap::new());
        for s in 0..3u64 {
            be.open(s).unwrap();
            let p = prompt(s, 10 + 5 * s as usize);
            let l = be.prefill_step(s, Chunk { start: 0, tokens: &p, want_logits: true }).unwrap().unwrap();
            next.insert(s, argmax(&l) as u32);
            lens.insert(s, p.len());
        }
        (be, next, lens)
    }

    /// Each round's picks (and chunk logits) as text, with the blocks in
    /// use after it, the streams open, and the blocks free for the plan.
    fn drive(dev: AheadCpu, script: &[(usize, Event)]) -> Vec<(String, usize, usize, usize)> {
        let vocab = VOCAB;
        let (mut be, mut next, mut lens) = three_streams(dev);
        let prompt = |s: u64, n: usize| -> Vec<u32> { (0..n as u32).map(|i| (i * 31 + 7 * s as u32) % vocab as u32).collect() };
        let mut log = Vec::new();
        let mut pending: Option<(StreamId, Vec<u32>)> = None;
        for round in 0..32usize {
            let (mut draft, mut other, mut reversed, mut pick) = (None, None, false, Pick::Argmax);
            for (_, ev) in script.iter().filter(|(r, _)| *r == round) {
                match *ev {
                    Event::Join(s, n) => {
                        be.open(s).unwrap();
                        let l = be.prefill_step(s, Chunk { start: 0, tokens: &prompt(s, n), want_logits: true }).unwrap().unwrap();
                        next.insert(s, argmax(&l) as u32);
                        lens.insert(s, n);
                    }
                    Event::Open(s, n) => {
                        be.open(s).unwrap();
                        lens.insert(s, 0);
                        pending = Some((s, prompt(s, n)));
                    }
                    Event::Forget(s) => {
                        be.forget(s);
                        next.remove(&s);
                        lens.remove(&s);
                    }
                    Event::Rewind(s, n) => {
                        let len = lens[&s] - n;
                        be.rewind(s, len).unwrap();
                        lens.insert(s, len);
                        next.insert(s, 42);
                    }
                    Event::Draft(s, n) => draft = Some((s, n)),
                    Event::Other(s) => other = Some(s),
                    Event::Reversed => reversed = true,
                    Event::Pick(p) => pick = p,
                }
            }
            let rows = decode_rows(&next, draft, other, reversed, vocab);
            let chunk = pending.take();
            let step_chunk = chunk.as_ref().map(|(s, p)| (*s, Chunk { start: 0, tokens: p.as_slice(), want_logits: true }));
            let out = be.round(Step::new(&rows, step_chunk, pick)).unwrap();
            if let Some((s, p)) = &chunk {
                let l = out.chunk_logits.as_ref().unwrap();
                log.push((format!("round {round}: chunk logits {:?}", l.iter().map(|v| v.to_bits()).collect::<Vec<_>>()), 0, 0, 0));
                next.insert(*s, argmax(l) as u32);
                *lens.get_mut(s).unwrap() += p.len();
            }
            let firsts: Vec<u32> = match &out.picked {
                Picked::Tokens(t) => t.clone(),
                Picked::Top(c) => c.iter().map(|c| c[0].0).collect(),
                Picked::Logits(l) => l.chunks(vocab).map(|r| argmax(r) as u32).collect(),
            };
            let picked = match &out.picked {
                Picked::Logits(l) => format!("{:?}", l.iter().map(|v| v.to_bits()).collect::<Vec<_>>()),
                other => format!("{other:?}"),
            };
            // Blocks in use too: a stream that left keeps its blocks for the
            // round launched ahead of it, and only until that round.
            log.push((
                format!("round {round}: rows {:?}: {picked}", rows.iter().map(|r| (r.stream, r.tokens.clone())).collect::<Vec<_>>()),
                be.fill().blocks_used,
                next.len(),
                be.fill().blocks_free(),
            ));
            let mut at = 0;
            for r in &rows {
                next.insert(r.stream, firsts[at]);
                at += r.tokens.len();
                *lens.get_mut(&r.stream).unwrap() += r.tokens.len();
            }
            if let Some((s, n)) = draft {
                let len = lens[&s] - n;
                be.rewind(s, len).unwrap();
                lens.insert(s, len);
            }
        }
        log
    }

    fn check(script: &[(usize, Event)]) {
        let on = drive(AheadCpu(Cpu::new(Some(1)), true), script);
        let off = drive(AheadCpu(Cpu::new(Some(1)), false), script);
        assert_eq!(on.len(), off.len());
        for ((a, used_on, open, free_on), (b, used_off, _, free_off)) in on.iter().zip(&off) {
            assert_eq!(a, b, "ahead on and off differ");
            // A round launched ahead holds the blocks of its rows: at most
            // one more a stream (one whose blocks were full). The lane's
            // plan counts those rows' blocks, so it sees them free.
            assert!(used_off <= used_on && *used_on <= used_off + open, "{a}: {used_on} blocks used with ahead on, {used_off} off ({open} streams)");
            assert_eq!(free_on, free_off, "{a}: blocks free for the plan with ahead on and off");
        }
        assert!(on.iter().zip(&off).any(|(a, b)| a.1 > b.1), "no round launched ahead past a block's end");
    }

    /// The scenario of `rounds_that_differ_from_the_one_launched_ahead`
    /// (but the stream leaving) on the CPU: ahead on equals ahead off, bit
    /// for bit.
    #[test]
    fn rounds_that_differ_from_the_one_launched_ahead_on_the_cpu() {
        check(&script(false));
    }

    /// A stream forgotten after a round launched ahead for it, the others
    /// going on: the launched round is not served for the stream gone.
    #[test]
    fn a_stream_leaving_after_a_round_launched_ahead_on_the_cpu() {
        check(&script(true));
    }

    /// A stream still open that sits a round out (a guided stream waiting
    /// for its mask) keeps the round after from being launched ahead: the
    /// stream likely rejoins, and a round launched without it would serve
    /// that round only in part (two forwards). A stream that left does
    /// not, nor rows asked in another order.
    #[test]
    fn no_round_is_launched_ahead_while_an_open_stream_sits_out() {
        let (mut be, mut next, _) = three_streams(AheadCpu(Cpu::new(Some(1)), true));
        let round = |be: &mut ModelBackend<AheadCpu>, next: &mut HashMap<StreamId, u32>, streams: &[StreamId], pick: Pick| -> bool {
            let rows: Vec<DecodeRow> = streams.iter().map(|&s| DecodeRow { stream: s, tokens: vec![next[&s]] }).collect();
            let firsts: Vec<u32> = match be.round(Step::new(&rows, None, pick)).unwrap().picked {
                Picked::Tokens(t) => t,
                Picked::Logits(l) => l.chunks(VOCAB).map(|r| argmax(r) as u32).collect(),
                Picked::Top(c) => c.iter().map(|c| c[0].0).collect(),
            };
            for (&s, &t) in streams.iter().zip(&firsts) {
                next.insert(s, t);
            }
            be.launched_ahead()
        };
        // (The first round follows the prompts' chunks: nothing launched.)
        round(&mut be, &mut next, &[0, 1, 2], Pick::Argmax);
        assert!(round(&mut be, &mut next, &[0, 1, 2], Pick::Argmax), "the same streams again: launched ahead");
        // A guided stream's rounds: all the rows' logits (nothing launched),
        // then a greedy round while it waits for its mask.
        assert!(!round(&mut be, &mut next, &[0, 1, 2], Pick::Logits));
        assert!(!round(&mut be, &mut next, &[1, 2], Pick::Argmax), "stream 0 sits out, still open: not launched ahead");
        assert!(!round(&mut be, &mut next, &[0, 1, 2], Pick::Logits));
        be.forget(0);
        assert!(round(&mut be, &mut next, &[1, 2], Pick::Argmax), "stream 0 left: the others go on launched ahead");
        // One leaving after a round was launched for it: that round serves
        // the others, and the round after them is launched too.
        assert!(round(&mut be, &mut next, &[1, 2], Pick::Argmax));
        be.forget(1);
        assert!(round(&mut be, &mut next, &[2], Pick::Argmax), "stream 1 left after a round launched with it: the next still launched ahead");
        // Or the rows asked in another order than launched.
        be.open(1).unwrap();
        let l = be.prefill_step(1, Chunk { start: 0, tokens: &[5, 6, 7], want_logits: true }).unwrap().unwrap();
        next.insert(1, argmax(&l) as u32);
        round(&mut be, &mut next, &[1, 2], Pick::Argmax);
        assert!(round(&mut be, &mut next, &[1, 2], Pick::Argmax));
        assert!(round(&mut be, &mut next, &[2, 1], Pick::Argmax), "the same rows reversed: launched ahead");
    }

    /// Masks given once, or late (None: the round returns logits).
    struct Masks(Option<Vec<Option<TokenMask>>>);

    impl RoundMasks for Masks {
        fn masks(&self) -> Option<Vec<Option<TokenMask>>> {
            self.0.clone()
        }
    }

    /// Guided greedy rows picked within their masks by the device's argmax
    /// equal the host's masked argmax of the same rounds' logits, rounds
    /// launched ahead as without masks, also once another stream has left;
    /// a late mask makes the round return its logits and launch nothing
    /// ahead.
    #[test]
    fn masked_argmax_rounds_pick_what_the_host_would() {
        let (mut be, mut next, _) = three_streams(AheadCpu(Cpu::new(Some(1)), true));
        let (mut host, mut host_next, _) = three_streams(AheadCpu(Cpu::new(Some(1)), false));
        // Stream 1 guided: a mask allowing a third of the vocabulary, which
        // changes with the round.
        let mask = |round: usize| TokenMask::of(VOCAB, (0..VOCAB as u32).filter(|t| (t + round as u32).is_multiple_of(3)));
        let (mut changed, mut ahead) = (0, 0);
        for round in 0..12 {
            // Stream 0 leaves after round 8, a round launched ahead with it
            // running: that round serves streams 1 and 2 (1 now the first row).
            if round == 9 {
                be.forget(0);
                host.forget(0);
            }
            let streams: &[StreamId] = if round < 9 { &[0, 1, 2] } else { &[1, 2] };
            let g = usize::from(round < 9);
            let rows = |next: &HashMap<StreamId, u32>| -> Vec<DecodeRow> { streams.iter().map(|&s| DecodeRow { stream: s, tokens: vec![next[&s]] }).collect() };
            let late = round == 7;
            let mut row_masks = vec![None; streams.len()];
            row_masks[g] = Some(mask(round));
            let masks = Masks((!late).then_some(row_masks));
            let r = rows(&next);
            let got = be.round(Step { masks: Some(&masks), ..Step::new(&r, None, Pick::Argmax) }).unwrap().picked;
            let r = rows(&host_next);
            let Picked::Logits(mut l) = host.round(Step::new(&r, None, Pick::Logits)).unwrap().picked else { panic!("logits asked") };
            let free = argmax(&l[g * VOCAB..(g + 1) * VOCAB]) as u32;
            mask(round).apply(&mut l[g * VOCAB..(g + 1) * VOCAB]);
            let want: Vec<u32> = l.chunks(VOCAB).map(|r| argmax(r) as u32).collect();
            let picked: Vec<u32> = match got {
                Picked::Tokens(t) => {
                    assert!(!late, "round {round}: a late mask, yet tokens");
                    t
                }
                Picked::Logits(l) => {
                    assert!(late, "round {round}: masks given, yet logits");
                    assert!(!be.launched_ahead(), "a round returning logits launched the next ahead");
                    let mut l = l;
                    mask(round).apply(&mut l[g * VOCAB..(g + 1) * VOCAB]);
                    l.chunks(VOCAB).map(|r| argmax(r) as u32).collect()
                }
                other => panic!("round {round}: {other:?}"),
            };
            assert_eq!(picked, want, "round {round}");
            // Every round launches the next but the first (right after the
            // prompts' chunks: another chunk likely follows) and the one
            // with the late mask, block ends or not (streams cross them),
            // and a stream leaving or not.
            ahead += usize::from(be.launched_ahead());
            changed += usize::from(free != want[g]);
            for (i, &s) in streams.iter().enumerate() {
                next.insert(s, picked[i]);
                host_next.insert(s, want[i]);
            }
        }
        assert!(changed >= 4, "the mask changed stream 1's pick in {changed} of 12 rounds: the test shows little");
        assert_eq!(ahead, 10, "{ahead} of 12 masked rounds launched the next ahead");
    }

    /// A top-k round with a guided row: the backend asks for the masks
    /// when it picks and that row's candidates are the host's top k of the
    /// masked row (-inf past what the mask allows, in column order); a late
    /// mask gives the logits.
    #[test]
    fn masked_top_k_rounds_find_what_the_host_would() {
        let (mut be, mut next, _) = three_streams(AheadCpu(Cpu::new(Some(1)), true));
        let (mut host, _, _) = three_streams(AheadCpu(Cpu::new(Some(1)), false));
        // Stream 1's mask allows 3 tokens a round: fewer than k.
        let mask = |round: usize| TokenMask::of(VOCAB, (0..3u32).map(|i| (i * 37 + round as u32 * 11) % VOCAB as u32));
        let k = 5;
        for round in 0..8 {
            let streams = [0u64, 1, 2];
            let r: Vec<DecodeRow> = streams.iter().map(|&s| DecodeRow { stream: s, tokens: vec![next[&s]] }).collect();
            let late = round == 5;
            let masks = Masks((!late).then(|| vec![None, Some(mask(round)), None]));
            let got = be.round(Step { masks: Some(&masks), ..Step::new(&r, None, Pick::TopK(k)) }).unwrap().picked;
            let Picked::Logits(mut l) = host.round(Step::new(&r, None, Pick::Logits)).unwrap().picked else { panic!("logits asked") };
            match got {
                Picked::Top(c) => {
                    assert!(!late, "round {round}: a late mask, yet candidates");
                    mask(round).apply(&mut l[VOCAB..2 * VOCAB]);
                    let want = braid_ops::top_k_host(&l, VOCAB, k);
                    assert_eq!(c, want, "round {round}");
                    assert!(c[1][..3].iter().all(|&(t, v)| mask(round).allows(t) && v.is_finite()) && c[1][3..].iter().all(|&(_, v)| v == f32::NEG_INFINITY));
                    streams.iter().enumerate().for_each(|(i, &s)| _ = next.insert(s, c[i][0].0));
                }
                Picked::Logits(got) => {
                    assert!(late, "round {round}: masks given, yet logits");
                    assert_eq!(got, l);
                    streams.iter().enumerate().for_each(|(i, &s)| _ = next.insert(s, argmax(&l[i * VOCAB..(i + 1) * VOCAB]) as u32));
                }
                other => panic!("round {round}: {other:?}"),
            }
        }
    }
}

/// The fixtures that vary each family's configuration (head and rotary
/// dims, soft-caps, tied heads, MoE scaling, grouped Mamba2 norms, the
/// M3 index width, …) on the GPU, as the base fixtures are above.
macro_rules! variant_bf16 {
    ($($test:ident: $name:literal, $key:literal;)*) => {$(
        #[test]
        fn $test() {
            check_hybrid($name, $key);
        }
    )*};
}

variant_bf16! {
    gemma3_softcap_bf16: "gemma3_softcap", "logits_incremental";
    gemma3_text_six_bf16: "gemma3_text_six", "logits_incremental";
    gemma4_text_k_eq_v_bf16: "gemma4_text_k_eq_v", "logits_incremental";
    granitemoehybrid_bf16: "granitemoehybrid", "logits_incremental";
    granitemoehybrid_rope_dense_bf16: "granitemoehybrid_rope_dense", "logits_incremental";
    lfm2_conv4_bf16: "lfm2_conv4", "logits_incremental";
    lfm2_moe_scaled_bf16: "lfm2_moe_scaled", "logits_incremental";
    llama_attention_bias_bf16: "llama_attention_bias", "logits_incremental";
    llama_linear_rope_bf16: "llama_linear_rope", "logits_incremental";
    minimax_m2_quarter_rope_bf16: "minimax_m2_quarter_rope", "logits_incremental";
    minimax_m3_wide_index_bf16: "minimax_m3_vl_text_wide_index", "logits_incremental";
    minimax_plain_bf16: "minimax_plain", "logits_incremental";
    nemotron_h_grouped_bf16: "nemotron_h_grouped", "logits_incremental_clamped";
    qwen3_tied_bf16: "qwen3_tied", "logits_incremental";
    qwen3_next_bf16: "qwen3_next", "logits_incremental";
    qwen3_next_dense_wide_keys_bf16: "qwen3_next_dense_wide_keys", "logits_incremental";
}

/// Gemma 3's vision tower and projector on the GPU: each image's rows, and
/// the logits of the fixture's two-image prompt (every text row and each
/// image's last), against transformers at bf16 tolerance.
#[test]
fn gemma3_vision_fixture_bf16() {
    let Some(dev) = gpu() else { return };
    vision_bf16(&dev, "gemma3_vision", &fixture_dir("gemma3_vision"), None);
}

/// The same from the text GGUF and the F32 mmproj (`gemma3_vision_gguf`).
#[test]
fn gemma3_vision_gguf_mmproj_bf16() {
    let Some(dev) = gpu() else { return };
    let dir = fixture_dir("gemma3_vision_gguf");
    vision_bf16(&dev, "gemma3_vision_gguf", &dir.join("model-f32.gguf"), Some(&dir.join("mmproj-f32.gguf")));
}

/// [`gemma3_vision_fixture_bf16`] for fixture `name`, its model at `model`
/// with the mmproj `mmproj` where given.
fn vision_bf16(dev: &Cuda, name: &str, model_path: &std::path::Path, mmproj: Option<&std::path::Path>) {
    let r = reference(name);
    let config: Value = serde_json::from_str(&std::fs::read_to_string(fixture_dir(name).join("config.json")).unwrap()).unwrap();
    let (_src, model) = braid_models::open_with(dev, model_path, mmproj).unwrap();
    let (pshape, pixels) = &r["image_rows"];
    let (tokens, hidden) = (pshape[1], pshape[2]);
    let px = &r["pixel_values"].1;
    let per = px.len() / r["pixel_values"].0[0];
    for n in 0..pshape[0] {
        let rows = dev.download(&model.encode_image(dev, &px[n * per..(n + 1) * per]).unwrap()).unwrap();
        let (rel, _, _) = compare(&rows[..tokens * hidden], &pixels[n * tokens * hidden..(n + 1) * tokens * hidden], hidden);
        eprintln!("{name} on {}: image {n} rows rel err {rel:.2e}", dev.name());
        assert!(rel < BF16_REL, "{name}: image {n} rows rel err {rel}");
    }

    let image_token = config["image_token_index"].as_u64().unwrap() as u32;
    let tokens: Vec<u32> = r["tokens"].1.iter().map(|&t| t as u32).collect();
    let (prompt, images) = fixtures_common::image_prompt(&tokens, image_token, px, per);
    let mut be = ModelBackend::new(dev.clone(), model, gpu_config()).unwrap();
    be.open(1).unwrap();
    be.encode_images(1, &images).unwrap();
    let (vocab, full) = (r["logits_full"].0[1], &r["logits_full"].1);
    let (mut got, mut want) = (Vec::new(), Vec::new());
    let mut pos = 0;
    while pos < prompt.len() {
        let end = images.iter().find(|m| m.start <= pos && pos < m.end()).map_or(pos + 1, |m| m.end());
        got.extend(be.prefill_step(1, Chunk { start: pos, tokens: &prompt[pos..end], want_logits: true }).unwrap().unwrap());
        want.extend_from_slice(&full[(end - 1) * vocab..end * vocab]);
        pos = end;
    }
    let (rel, agree, rows) = compare(&got, &want, vocab);
    eprintln!("{name} on {}: prompt with two images, logits rel err {rel:.2e}, top-1 {agree}/{rows}", dev.name());
    assert!(rel < BF16_REL, "{name}: logits rel err {rel}");
    assert!(agree * 10 >= rows * 9, "{name}: top-1 agreement {agree}/{rows}");
}

/// Drafters in a lane over the GPU (the CPU's `drafters_lane` on the
/// device): the DFlash and DSpark drafters fed the gemma3_text fixture's
/// taps, prompt lookup, and a draft model (the qwen2 fixture drafting for
/// itself), each with its target on the GPU, against the same lane with no
/// drafter: alone and with the streams together. On the CPU a row's result
/// does not depend on its batch, so outputs are equal token for token; here
/// a verify round's 1 + k rows take other kernels than a row alone (the
/// GEMV, the skinny GEMM, cuBLAS), so logits move by bf16 rounding and a
/// near-tie may flip. So each pair of outputs is equal up to its first
/// difference, and there the two tokens must be within rounding of the
/// best in the target's own row for that prefix; a wrong verify (a draft
/// accepted that the target did not pick, a rewind off by one) picks a
/// token far from it.
mod drafting {
    use std::sync::Arc;

    use braid_engine::{DraftModel, DraftModelConfig, Drafter, Lane, LaneConfig, LaneStats, NgramConfig, PromptLookup, Request, SamplingParams, StopRules};
    use braid_models::dflash::{DFlash, DFlashDrafter};
    use braid_models::Source;

    use super::*;
    use fixtures_common::{Fixture, NoText};

    #[derive(Clone, Copy, Debug)]
    enum Kind {
        None,
        Block(&'static str),
        Ngram,
        Model(&'static str),
    }

    fn lane(dev: &Cuda, fx: &Fixture, kind: Kind) -> Lane {
        let config = LaneConfig { chunk_tokens: 5, max_rows: Some(3), max_running: 8, draft_max_streams: 8, ..LaneConfig::default() };
        let mut target = backend(dev, &fx.dir);
        let drafter: Option<Box<dyn Drafter>> = match kind {
            Kind::None => None,
            Kind::Block(name) => {
                let model = DFlash::load(dev, &fixture_dir(name), &Source::open(&fx.dir).unwrap()).unwrap();
                model.attach(&mut target).unwrap();
                Some(Box::new(DFlashDrafter::new(dev.clone(), model, 4096, 16, KvDtype::F16).unwrap()))
            }
            Kind::Ngram => Some(Box::new(PromptLookup::new(NgramConfig { min_n: 1, ..NgramConfig::default() }))),
            Kind::Model(name) => {
                let draft = backend(dev, &fixture_dir(name));
                Some(Box::new(DraftModel::new(Box::new(draft), DraftModelConfig { max_tokens: 4, patience: 4 }).unwrap()))
            }
        };
        Lane::spawn_with_drafter(Box::new(target), drafter, Arc::new(NoText), config)
    }

    fn request(prompt: &[u32]) -> Request {
        Request {
            prompt: prompt.to_vec(),
            sampling: SamplingParams::greedy(),
            stop: StopRules { max_tokens: Some(24), ignore_eos: true, ..Default::default() },
            ..Default::default()
        }
    }

    /// Greedy replies to `prompts`, each alone, then all together; and the
    /// together run's stats.
    fn serve(dev: &Cuda, fx: &Fixture, prompts: &[Vec<u32>], kind: Kind) -> (Vec<Vec<u32>>, Vec<Vec<u32>>, LaneStats) {
        let l = lane(dev, fx, kind);
        let alone = prompts.iter().map(|p| fixtures_common::tokens(l.submit(request(p)).unwrap())).collect();
        drop(l);
        let l = lane(dev, fx, kind);
        let hs: Vec<_> = prompts.iter().map(|p| l.submit(request(p)).unwrap()).collect();
        (alone, hs.into_iter().map(fixtures_common::tokens).collect(), l.stats())
    }

    /// `got` equals `want` up to their first difference, where both tokens
    /// are near the best of the target's row after the shared prefix.
    /// Returns how many tokens were compared equal.
    fn equal_up_to_near_ties(dev: &Cuda, fx: &Fixture, what: &str, prompt: &[u32], got: &[u32], want: &[u32]) -> usize {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) else { return got.len() };
        let mut be = backend(dev, &fx.dir);
        be.open(1).unwrap();
        let row = feed(&mut be, 1, &[prompt, &want[..i]].concat());
        let row = &row[row.len() - fx.vocab..];
        assert!(
            near_best(row, got[i]) && near_best(row, want[i]),
            "{what}: token {i} is {} with the drafter and {} without, not a near-tie (logits {} and {}, best {})",
            got[i],
            want[i],
            row[got[i] as usize],
            row[want[i] as usize],
            row[argmax(row)]
        );
        eprintln!("{what}: a near-tie flipped at token {i}");
        i
    }

    /// Every reply with `kind` against the same without a drafter; returns
    /// the run's stats.
    fn check(fx: &Fixture, prompts: &[Vec<u32>], kind: Kind) -> Option<LaneStats> {
        let dev = gpu()?;
        let (plain_alone, plain_together, plain) = serve(&dev, fx, prompts, Kind::None);
        let (alone, together, stats) = serve(&dev, fx, prompts, kind);
        let mut same = 0;
        for (i, p) in prompts.iter().enumerate() {
            same += equal_up_to_near_ties(&dev, fx, &format!("{kind:?} stream {i} alone"), p, &alone[i], &plain_alone[i]);
            same += equal_up_to_near_ties(&dev, fx, &format!("{kind:?} stream {i} together"), p, &together[i], &plain_together[i]);
        }
        let total = 2 * prompts.len() * 24;
        eprintln!(
            "{kind:?} on {}: {same}/{total} tokens equal before any near-tie; {} drafts proposed, {} accepted; {} decode rounds against {} without",
            dev.name(),
            stats.draft_proposed,
            stats.draft_accepted,
            stats.decode_rounds,
            plain.decode_rounds
        );
        // Near-ties are rare: most of the output is compared.
        assert!(same * 4 >= total * 3, "{kind:?}: only {same}/{total} tokens before the first differences");
        assert!(stats.draft_proposed > 0, "{kind:?}: the drafter proposed nothing: {stats:?}");
        Some(stats)
    }

    #[test]
    fn block_drafters_are_lossless_on_the_gpu() {
        let fx = Fixture::load("gemma3_text");
        let prompts: Vec<Vec<u32>> = (0..4).map(|i| fx.tokens[i * 3..i * 3 + 9 + 4 * i].to_vec()).collect();
        for name in ["dflash_gemma3", "dspark_gemma3"] {
            if check(&fx, &prompts, Kind::Block(name)).is_none() {
                return;
            }
        }
    }

    #[test]
    fn prompt_lookup_is_lossless_on_the_gpu() {
        let fx = Fixture::load("gemma3_text");
        let prompts: Vec<Vec<u32>> = (0..4).map(|i| fx.tokens[i * 3..i * 3 + 6 + i].repeat(3)).collect();
        if let Some(stats) = check(&fx, &prompts, Kind::Ngram) {
            assert!(stats.draft_accepted > 0, "{stats:?}");
        }
    }

    #[test]
    fn a_draft_model_is_lossless_on_the_gpu() {
        let fx = Fixture::load("qwen2");
        let prompts: Vec<Vec<u32>> = (0..4).map(|i| fx.tokens[i * 2..i * 2 + 7 + 3 * i].to_vec()).collect();
        if let Some(stats) = check(&fx, &prompts, Kind::Model("qwen2")) {
            // The target drafting for itself: most drafts are its own picks.
            assert!(stats.draft_accepted * 10 >= stats.draft_proposed * 7, "{stats:?}");
        }
    }
}
