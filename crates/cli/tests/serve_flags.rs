//! `braid serve` refuses settings that could never work, before serving:
//! an empty API key (which would turn authentication off), a context too
//! short to answer anything, a KV pool too large to allocate.

use std::process::Command;

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Runs `braid serve` with `args` (on a free port) and `env`; it must exit
/// with an error: its stderr.
fn refused(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_braid"));
    cmd.args(["serve", "--device", "cpu", "--port", "0"]).args(args).env_remove("BRAID_API_KEY");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run braid");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "braid serve {args:?} started: {err}");
    err
}

fn model() -> Option<String> {
    let p = braid_formats::cache::cached_model(MODEL);
    if p.is_none() {
        eprintln!("SKIP: {MODEL} not in the model cache (run `braid fetch smollm2`)");
    }
    p.map(|p| p.display().to_string())
}

#[test]
fn an_empty_api_key_is_refused() {
    let err = refused(&["--model", "/nonexistent.gguf"], &[("BRAID_API_KEY", "")]);
    assert!(err.contains("empty key"), "{err}");
    let err = refused(&["--model", "/nonexistent.gguf", "--api-key", "a,,b"], &[]);
    assert!(err.contains("empty key"), "{err}");
}

#[test]
fn contexts_that_cannot_work_are_refused() {
    let Some(m) = model() else { return };
    for ctx in ["0", "1"] {
        let err = refused(&["--model", &m, "--ctx", ctx], &[]);
        assert!(err.contains("too short"), "--ctx {ctx}: {err}");
    }
    let err = refused(&["--model", &m, "--kv-tokens", "99999999999"], &[]);
    assert!(err.contains("KV memory"), "{err}");
    let err = refused(&["--model", &m, "--ctx", "99999999"], &[]);
    assert!(err.contains("KV memory"), "{err}");
}
