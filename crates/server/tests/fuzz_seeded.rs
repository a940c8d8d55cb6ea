//! Seeded mutation fuzzing of request bodies through validation (see
//! crates/formats/tests/fuzz_seeded.rs for the runner and its budget).

use std::path::PathBuf;
use std::time::Duration;

#[test]
fn request() {
    let secs = std::env::var("BRAID_FUZZ_SECS").ok().and_then(|s| s.parse::<f64>().ok()).unwrap_or(2.0);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let crashes = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-crashes").join("request");
    match braid_formats::fuzz::run(&root.join("corpus/request"), &crashes, Duration::from_secs_f64(secs.max(0.0)), braid_server::fuzz::request) {
        Ok(r) => eprintln!("fuzz request: {} executions from a corpus of {}", r.executions, r.corpus),
        Err(e) => panic!("fuzz request: {e}"),
    }
}
