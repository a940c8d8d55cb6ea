//! Models on the CUDA device: the tiny transformers fixtures at bf16
//! tolerance, stepped prefill equal to the whole pass, graphs equal to
//! eager, and teacher-forced agreement with llama.cpp on SmolLM2. Each test
//! skips (passes with a notice) where no GPU or driver is present, as in CI.

#![cfg(feature = "cuda")]

use std::path::PathBuf;

use braid_engine::{Backend, Chunk, DecodeRow};
use braid_models::{BackendConfig, ModelBackend};
use braid_ops::cuda::Cuda;
use braid_ops::Device;
use serde_json::Value;

fn gpu() -> Option<Cuda> {
    match Cuda::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIP: no CUDA device: {e:#}");
            None
        }
    }
}

/// `testdata/` (or `$BRAID_TESTDATA`: the test binary may run on another
/// machine, from another checkout).
fn testdata() -> PathBuf {
    std::env::var_os("BRAID_TESTDATA").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata"))
}

fn fixture_dir(name: &str) -> PathBuf {
    testdata().join("fixtures").join(name)
}

/// F32 / I64 tensors of a reference.safetensors file, as f32.
fn reference(name: &str) -> std::collections::HashMap<String, (Vec<usize>, Vec<f32>)> {
    let p = fixture_dir(name).join("reference.safetensors");
    let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = std::collections::HashMap::new();
    for (k, e) in header.as_object().unwrap() {
        if k == "__metadata__" {
            continue;
        }
        let shape: Vec<usize> = e["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        let off: Vec<usize> = e["data_offsets"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        let raw = &data[off[0]..off[1]];
        let vals: Vec<f32> = match e["dtype"].as_str().unwrap() {
            "F32" => raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
            "I64" => raw.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f32).collect(),
            _ => continue,
        };
        out.insert(k.clone(), (shape, vals));
    }
    out
}

fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold(0, |b, (i, v)| if *v > x[b] { i } else { b })
}

fn backend(dev: &Cuda, dir: &std::path::Path) -> ModelBackend<Cuda> {
    let (_src, model) = braid_models::open(dev, dir).unwrap();
    ModelBackend::new(
        dev.clone(),
        model,
        BackendConfig { block_tokens: 16, kv_tokens: 8192, max_streams: 8, max_batch: 4096, context: 0, max_marks: 8, ..Default::default() },
    )
    .unwrap()
}

/// Full-pass logits against transformers' (f32) at bf16 tolerance: relative
/// error of the whole table, and top-1 agreement row by row.
fn check_fixture(name: &str) {
    let Some(dev) = gpu() else { return };
    let r = reference(name);
    let toks: Vec<u32> = r["tokens"].1.iter().map(|&t| t as u32).collect();
    let (shape, want) = &r["logits_full"];
    let vocab = shape[1];
    let mut be = backend(&dev, &fixture_dir(name));
    be.open(1).unwrap();
    let got = be.decode_round(&[DecodeRow { stream: 1, tokens: toks.clone() }]).unwrap();
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (a, b) in got.iter().zip(want) {
        assert!(a.is_finite(), "{name}: non-finite logit");
        num += ((a - b) as f64).powi(2);
        den += (*b as f64).powi(2);
    }
    let rel = (num / den).sqrt();
    let rows = toks.len();
    let agree = (0..rows).filter(|&i| argmax(&got[i * vocab..(i + 1) * vocab]) == argmax(&want[i * vocab..(i + 1) * vocab])).count();
    eprintln!("{name} on {}: full-pass logits rel err {rel:.2e}, top-1 agreement {agree}/{rows}", dev.name());
    assert!(rel < 3e-2, "{name}: logits rel err {rel} over the bf16 tolerance 3e-2");
    assert!(agree * 10 >= rows * 9, "{name}: top-1 agreement {agree}/{rows}");

    // Incremental: prefill 24, then one token per round, against logits_incremental.
    let (_, inc) = &r["logits_incremental"];
    be.open(2).unwrap();
    let mut got = be.decode_round(&[DecodeRow { stream: 2, tokens: toks[..24].to_vec() }]).unwrap();
    for &t in &toks[24..] {
        got.extend(be.decode_round(&[DecodeRow { stream: 2, tokens: vec![t] }]).unwrap());
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (a, b) in got.iter().zip(inc) {
        num += ((a - b) as f64).powi(2);
        den += (*b as f64).powi(2);
    }
    let rel = (num / den).sqrt();
    eprintln!("{name}: incremental logits rel err {rel:.2e}");
    assert!(rel < 3e-2, "{name}: incremental logits rel err {rel}");
}

#[test]
fn llama_fixture_bf16() {
    check_fixture("llama");
}

#[test]
fn qwen3_fixture_bf16() {
    check_fixture("qwen3");
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
                    be.decode_round(&[DecodeRow { stream: id + 100, tokens: vec![1] }]).unwrap();
                }
            }
            let mut out = Vec::new();
            let mut t = argmax(&last) as u32;
            for _ in 0..8 {
                out.push(t);
                let l = be.decode_round(&[DecodeRow { stream: id, tokens: vec![t] }]).unwrap();
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

/// Decode rounds as CUDA graphs equal eager rounds bit for bit.
#[test]
fn graphs_equal_eager_on_a_model() {
    let Some(dev) = gpu() else { return };
    let cfg = tiny_llama();
    let model = braid_models::random::llama(&dev, cfg, 3, false).unwrap();
    let eager = braid_models::gpubench::decode_run(&dev, &model, 5, 40, 2, 10, false).unwrap();
    let graphed = braid_models::gpubench::decode_run(&dev, &model, 5, 40, 2, 10, true).unwrap();
    eprintln!("tiny model: eager {eager:.0} tok/s, graphs {graphed:.0} tok/s, stats {:?}", dev.graph_stats());
    // Same tokens, round by round.
    let a = braid_models::gpubench::decode_tokens(&dev, &model, 5, 40, 12, false).unwrap();
    let b = braid_models::gpubench::decode_tokens(&dev, &model, 5, 40, 12, true).unwrap();
    assert_eq!(a, b, "graph rounds differ from eager rounds");
    assert!(dev.graph_stats().0 > 0, "no graph was replayed");
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
        rope: braid_ops::Rope { theta: 10000.0, dims: 32, neox: true, scale: 1.0 },
        context: 4096,
    }
}

/// Decode rounds served by `ModelBackend` replay CUDA graphs (one per
/// batch shape) and give the same logits, bit for bit, as eager rounds;
/// a round fused with a prompt chunk runs eagerly beside them.
#[test]
fn backend_decode_rounds_replay_graphs() {
    let Some(dev) = gpu() else { return };
    let cfg = tiny_llama();
    let mut runs = Vec::new();
    for graphs in [false, true] {
        dev.set_graphs(graphs);
        let before = dev.graph_stats();
        let model = braid_models::random::llama(&dev, cfg.clone(), 7, false).unwrap();
        let mut be = ModelBackend::new(dev.clone(), Box::new(model), BackendConfig { kv_tokens: 4096, context: 1024, ..Default::default() }).unwrap();
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
                let (l, last) = be.decode_round_with_chunk(&rows, 9, Chunk { start: 0, tokens: &late, want_logits: true }).unwrap();
                out.extend(l);
                out.extend(last.unwrap());
            } else {
                out.extend(be.decode_round(&rows).unwrap());
            }
        }
        let after = dev.graph_stats();
        if graphs {
            // 7 plain rounds: captures, then replays (the fused round's
            // larger buffers retire the graphs recorded before it).
            assert!(after.0 - before.0 >= 3, "decode rounds did not replay graphs: {before:?} -> {after:?}");
        }
        runs.push(out);
    }
    dev.set_graphs(true);
    assert!(runs[0] == runs[1], "graph-replayed decode rounds differ from eager ones");
}

/// A backend over a random tiny Llama (vocabulary 1000) with streams 0-2
/// prompted, and each one's greedy first token.
fn three_prompted_streams(dev: &Cuda, cfg: &braid_models::llama::LlamaConfig) -> (ModelBackend<Cuda>, Vec<u32>) {
    let model = braid_models::random::llama(dev, cfg.clone(), 11, false).unwrap();
    let mut be = ModelBackend::new(dev.clone(), Box::new(model), BackendConfig { kv_tokens: 4096, context: 1024, ..Default::default() }).unwrap();
    let mut first = Vec::new();
    for s in 0..3u64 {
        be.open(s).unwrap();
        let prompt: Vec<u32> = (0..10 + 5 * s as u32).map(|i| (i * 31 + 7 * s as u32) % 1000).collect();
        let l = be.prefill_step(s, Chunk { start: 0, tokens: &prompt, want_logits: true }).unwrap().unwrap();
        first.push(argmax(&l) as u32);
    }
    (be, first)
}

/// Greedy rounds picked on the device (only token ids come back) give the
/// tokens that the host's argmax of the round's logits gives.
#[test]
fn backend_greedy_rounds_equal_host_argmax() {
    let Some(dev) = gpu() else { return };
    let cfg = tiny_llama();
    let mut runs = Vec::new();
    for on_device in [false, true] {
        let (mut be, mut last) = three_prompted_streams(&dev, &cfg);
        assert!(be.capabilities().greedy_rounds);
        let mut out = last.clone();
        for _ in 0..10 {
            let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![last[s as usize]] }).collect();
            last = if on_device {
                be.decode_round_greedy(&rows, true).unwrap()
            } else {
                be.decode_round(&rows).unwrap().chunks(1000).map(|r| argmax(r) as u32).collect()
            };
            out.extend(&last);
        }
        runs.push(out);
    }
    assert_eq!(runs[0], runs[1], "device-picked greedy tokens differ from the host's argmax");
}

/// Greedy rounds whose host work was done ahead, while the GPU ran the
/// round before (`Device::replay_ahead`), and which were launched before
/// the engine asked for them (`Device::argmax_rows_launch_ahead`), give
/// the tokens eager rounds give, through rounds that are not the one
/// expected: a stream leaves, one joins, one is rewound, block boundaries
/// pass.
#[test]
fn rounds_prepared_ahead_equal_eager() {
    let Some(dev) = gpu() else { return };
    let cfg = tiny_llama();
    let mut runs = Vec::new();
    for graphs in [false, true] {
        dev.set_graphs(graphs);
        let hits = dev.ahead_hits();
        let (mut be, first) = three_prompted_streams(&dev, &cfg);
        let mut last: std::collections::HashMap<u64, u32> = (0..3u64).zip(first).collect();
        let mut lens: std::collections::HashMap<u64, usize> = [(0, 10), (1, 15), (2, 20)].into();
        let mut out = Vec::new();
        for round in 0..40 {
            if round == 12 {
                be.forget(1);
                last.remove(&1);
            }
            if round == 20 {
                be.open(5).unwrap();
                let prompt: Vec<u32> = (0..13).map(|i| (i * 17 + 3) % 1000).collect();
                let l = be.prefill_step(5, Chunk { start: 0, tokens: &prompt, want_logits: true }).unwrap().unwrap();
                last.insert(5, argmax(&l) as u32);
                lens.insert(5, 13);
            }
            if round == 28 {
                // Back two rows: the next round repeats a position the
                // round prepared ahead did not expect.
                let l = lens[&0] - 2;
                be.rewind(0, l).unwrap();
                lens.insert(0, l);
                last.insert(0, 42);
            }
            let mut ids: Vec<u64> = last.keys().copied().collect();
            ids.sort();
            let rows: Vec<DecodeRow> = ids.iter().map(|&s| DecodeRow { stream: s, tokens: vec![last[&s]] }).collect();
            let toks = be.decode_round_greedy(&rows, true).unwrap();
            for (&s, &t) in ids.iter().zip(&toks) {
                last.insert(s, t);
                *lens.get_mut(&s).unwrap() += 1;
            }
            out.push(toks);
        }
        if graphs {
            let (n, launched) = (dev.ahead_hits().0 - hits.0, dev.ahead_hits().1 - hits.1);
            eprintln!("rounds replayed from a pass done ahead: {n} of 40, {launched} of them launched before they were asked for");
            assert!(n >= 20, "only {n} of 40 rounds were prepared ahead");
            assert!(launched >= 20, "only {launched} of 40 rounds were launched ahead");
        }
        runs.push(out);
    }
    dev.set_graphs(true);
    assert_eq!(runs[0], runs[1], "rounds prepared ahead differ from eager rounds");
}

/// Top-k rounds (only each row's k best logits come back) give the
/// candidates the host finds in the same round's logits.
#[test]
fn backend_top_k_rounds_equal_host_top_k() {
    let Some(dev) = gpu() else { return };
    let cfg = tiny_llama();
    let mut runs = Vec::new();
    for on_device in [false, true] {
        let (mut be, mut last) = three_prompted_streams(&dev, &cfg);
        assert_eq!(be.capabilities().top_rounds, 64);
        let mut out = Vec::new();
        for round in 0..10 {
            let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![last[s as usize]] }).collect();
            let cands = if on_device { be.decode_round_top(&rows, 40).unwrap() } else { braid_ops::top_k_host(&be.decode_round(&rows).unwrap(), 1000, 40) };
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
        let logits = be.decode_round(&[DecodeRow { stream: ri as u64, tokens: all }]).unwrap();
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

// ---- the hybrid families (and Gemma 4) on CUDA: the recurrent ops, the
// MoE scatter, RoPE from a table and block-sparse attention in a model ----

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

/// The bf16 tolerance of these checks (as for the attention fixtures).
const BF16_REL: f64 = 3e-2;

fn feed(be: &mut ModelBackend<Cuda>, stream: u64, tokens: &[u32]) -> Vec<f32> {
    be.decode_round(&[DecodeRow { stream, tokens: tokens.to_vec() }]).unwrap()
}

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
    let check = |what: &str, got: &[f32], key: &str| {
        let (rel, agree, rows) = compare(got, &r[key].1, vocab);
        eprintln!("{name} on {}: {what} logits rel err {rel:.2e}, top-1 agreement {agree}/{rows}", dev.name());
        assert!(rel < BF16_REL, "{name} {what}: logits rel err {rel} over the bf16 tolerance {BF16_REL}");
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
        let l = be.decode_round(&rows).unwrap();
        for (s, t) in together.iter_mut().enumerate() {
            t.extend_from_slice(&l[s * vocab..(s + 1) * vocab]);
        }
    }
    for (s, p) in prompts.iter().enumerate() {
        let mut alone_be = backend(&dev, &fixture_dir(name));
        alone_be.open(0).unwrap();
        feed(&mut alone_be, 0, p);
        let mut alone = Vec::new();
        for round in 0..rounds {
            alone.extend(feed(&mut alone_be, 0, &[step(s, round)]));
        }
        let (rel, agree, rows) = compare(&together[s], &alone, vocab);
        eprintln!("{name}: stream {s} decoding beside two others vs alone: rel err {rel:.2e}, top-1 {agree}/{rows}");
        // (A state row mixed up between streams moves logits by O(1).)
        assert!(rel < 1e-2, "{name}: stream {s} batched differs from alone (rel err {rel}, top-1 {agree}/{rows})");
    }
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

#[test]
fn gemma4_fixtures_bf16() {
    check_hybrid("gemma4_text", "logits_incremental");
    check_hybrid("gemma4_text_moe", "logits_incremental");
}
