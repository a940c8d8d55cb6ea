//! `--mmproj FILE` (llama.cpp's vision tower file) on the command line: a
//! wrong one is refused by name, and the one `mmproj*.gguf` beside a Gemma 3
//! GGUF is taken without the flag (several: none, with a warning).

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures")
}

fn braid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(args)
        .env_remove("BRAID_MODEL")
        .env_remove("BRAID_MMPROJ")
        .env("BRAID_LOG", "info")
        .env("NO_COLOR", "1")
        .output()
        .expect("run braid")
}

fn text_of(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// `braid logits` of three tokens on `model`, with `extra` flags.
fn logits(model: &std::path::Path, extra: &[&str]) -> Output {
    let mut args = vec!["logits", "--device", "cpu", "-m", model.to_str().unwrap(), "--tokens", "1,2,3", "--top", "1"];
    args.extend_from_slice(extra);
    braid(&args)
}

#[test]
fn a_wrong_mmproj_is_refused_by_name() {
    let dir = fixtures().join("gemma3_vision_gguf");
    let mmproj = dir.join("mmproj-f32.gguf");
    let out = logits(&fixtures().join("llama/model-f32.gguf"), &["--mmproj", mmproj.to_str().unwrap()]);
    let text = text_of(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("architecture 'llama' takes no images") && text.contains("mmproj-f32.gguf"), "{text}");
    let model = dir.join("model-f32.gguf");
    let out = logits(&model, &["--mmproj", model.to_str().unwrap()]);
    let text = text_of(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("not an mmproj file"), "{text}");
    let out = logits(&model, &["--mmproj", "/nonexistent/mmproj.gguf"]);
    assert!(!out.status.success() && text_of(&out).contains("/nonexistent/mmproj.gguf"), "{}", text_of(&out));
    // With the right one it loads.
    let out = logits(&model, &["--mmproj", mmproj.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text_of(&out));
}

#[test]
fn the_one_mmproj_beside_the_model_is_taken() {
    let src = fixtures().join("gemma3_vision_gguf");
    let dir = std::env::temp_dir().join(format!("braid-mmproj-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("gemma3.gguf");
    std::fs::copy(src.join("model-f32.gguf"), &model).unwrap();
    // None beside it: a text model.
    let out = logits(&model, &[]);
    assert!(out.status.success() && !text_of(&out).contains("mmproj"), "{}", text_of(&out));
    // One: taken (a broken one shows it is read).
    std::fs::copy(src.join("model-f32.gguf"), dir.join("mmproj-broken.gguf")).unwrap();
    let out = logits(&model, &[]);
    let text = text_of(&out);
    assert!(!out.status.success() && text.contains("mmproj-broken.gguf") && text.contains("not an mmproj file"), "{text}");
    std::fs::remove_file(dir.join("mmproj-broken.gguf")).unwrap();
    std::fs::copy(src.join("mmproj-f32.gguf"), dir.join("mmproj-f32.gguf")).unwrap();
    let out = logits(&model, &[]);
    let text = text_of(&out);
    assert!(out.status.success() && text.contains("taking the vision tower from the mmproj"), "{text}");
    // Two: which is meant cannot be told; none is taken, and the log says so.
    std::fs::copy(src.join("mmproj-f16.gguf"), dir.join("mmproj-f16.gguf")).unwrap();
    let out = logits(&model, &[]);
    let text = text_of(&out);
    assert!(out.status.success() && text.contains("several mmproj files") && !text.contains("taking the vision tower"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_and_serve_document_the_flag() {
    for cmd in ["run", "serve"] {
        let out = braid(&[cmd, "--help"]);
        let text = text_of(&out);
        assert!(text.contains("--mmproj <FILE>") && text.contains("mmproj*.gguf"), "{cmd}: {text}");
    }
}
