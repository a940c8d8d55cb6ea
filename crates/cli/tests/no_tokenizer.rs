//! Commands on token ids run on an HF folder without `tokenizer.json`
//! (the committed tiny Qwen2 fixture); commands that need text refuse it
//! with the reason.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/qwen2")
}

fn braid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_braid")).args(args).env_remove("BRAID_MODEL").env("BRAID_LOG", "warn").output().expect("run braid")
}

/// `name` from the fixture's reference.safetensors, as f64 (F32 and I64 only).
fn reference(name: &str) -> (Vec<usize>, Vec<f64>) {
    let bytes = std::fs::read(fixture().join("reference.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let e = &header[name];
    let shape = e["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let off: Vec<usize> = e["data_offsets"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let raw = &bytes[8 + n + off[0]..8 + n + off[1]];
    let data = match e["dtype"].as_str().unwrap() {
        "F32" => raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        "I64" => raw.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        d => panic!("{name}: dtype {d}"),
    };
    (shape, data)
}

#[test]
fn logits_run_without_a_tokenizer_and_match_transformers() {
    assert!(!fixture().join("tokenizer.json").exists(), "the fixture must have no tokenizer for this test");
    let (_, toks) = reference("tokens");
    let (shape, logits) = reference("logits_full");
    let vocab = shape[1];
    let n = 6;
    let ids: Vec<String> = toks[..n].iter().map(|t| (*t as u32).to_string()).collect();
    let dir = fixture();
    let out = braid(&["logits", "--model", dir.to_str().unwrap(), "--device", "cpu", "--threads", "1", "--top", "3", "--tokens", &ids.join(",")]);
    assert!(out.status.success(), "braid logits failed: {}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Value> = String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), n);
    for (pos, line) in lines.iter().enumerate() {
        // transformers' log-softmax of this row (causal: the first rows of a
        // 40-token forward are those of a 6-token one).
        let row = &logits[pos * vocab..(pos + 1) * vocab];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        let top = line["top"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        for t in top {
            let (id, lp) = (t[0].as_u64().unwrap() as usize, t[1].as_f64().unwrap());
            // The CLI keeps KV in f16 as `serve` does, hence more than the fixtures' 1e-4.
            assert!((lp - (row[id] - lse)).abs() < 2e-3, "pos {pos} token {id}: braid {lp}, transformers {}", row[id] - lse);
        }
        let best = (0..vocab).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
        assert_eq!(top[0][0].as_u64().unwrap() as usize, best, "pos {pos}: top-1");
    }
}

#[test]
fn bench_runs_without_a_tokenizer() {
    let dir = fixture();
    let out = braid(&["bench", "--model", dir.to_str().unwrap(), "--device", "cpu", "--threads", "1", "--pp", "16", "--tg", "4", "-r", "1", "--json"]);
    assert!(out.status.success(), "braid bench failed: {}", String::from_utf8_lossy(&out.stderr));
    // One JSON object on stdout (`--json`), its results by test.
    let v: Value = serde_json::from_slice(&out.stdout).expect("bench --json prints one JSON object");
    let tests: Vec<String> = v["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| {
            assert!(r["tokens_per_s"]["median"].as_f64().unwrap() > 0.0, "{r}");
            r["test"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(tests, ["pp16", "tg4"]);
}

#[test]
fn commands_that_need_text_say_what_is_missing() {
    let dir = fixture();
    let d = dir.to_str().unwrap();
    for args in [vec!["run", "--model", d, "--device", "cpu", "hello"], vec!["tokenize", "--model", d, "hello"]] {
        let out = braid(&args);
        assert!(!out.status.success(), "{args:?} ran without a tokenizer");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("has no tokenizer.json"), "{args:?}: {err}");
    }
}
