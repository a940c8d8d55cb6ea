//! `braid run --image FILE` on the tiny random Gemma 3 vision fixture:
//! the image's rows go into the prompt, and a bad image is refused with
//! the reason.

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/gemma3_vision")
}

fn braid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_braid")).args(args).env_remove("BRAID_MODEL").env("BRAID_LOG", "warn").output().expect("run braid")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("braid-run-image-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn an_image_goes_into_the_prompt() {
    let img = scratch("gradient.png");
    image::RgbImage::from_fn(48, 40, |x, y| image::Rgb([(x * 5) as u8, (y * 6) as u8, 128])).save(&img).unwrap();
    let model = fixture();
    let args = ["run", "-m", model.to_str().unwrap(), "--temperature", "0", "-n", "3", "--image", img.to_str().unwrap(), "hi"];
    let out = braid(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("hi"));
    // "hi" (2 bytes) and the image: \n\n, begin, 16 rows, end, \n\n.
    assert!(err.contains("[24 prompt tokens, 3 generated"), "{err}");

    // Without the image: the prompt alone.
    let out = braid(&args[..args.len() - 3].iter().chain(&["hi"]).copied().collect::<Vec<_>>());
    assert!(String::from_utf8_lossy(&out.stderr).contains("[2 prompt tokens"), "{}", String::from_utf8_lossy(&out.stderr));

    // A truncated image is refused, naming the file and the problem.
    let bytes = std::fs::read(&img).unwrap();
    let bad = scratch("truncated.png");
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    let out = braid(&["run", "-m", model.to_str().unwrap(), "-n", "1", "--image", bad.to_str().unwrap(), "hi"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("truncated.png") && err.contains("truncated or corrupt"), "{err}");
    let _ = std::fs::remove_dir_all(img.parent().unwrap());
}
