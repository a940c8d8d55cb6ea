//! Seeded mutation fuzzing on stable Rust, of every parser a model file
//! reaches: each target runs from its corpus in `fuzz/corpus/<target>` for
//! `BRAID_FUZZ_SECS` seconds (2 by default; CI sets more), and a panic
//! fails the test with the input saved. The same targets run under
//! libFuzzer with `cargo fuzz` (see fuzz/README.md).

use std::path::PathBuf;
use std::time::Duration;

use braid_formats::fuzz;

fn budget() -> Duration {
    let secs = std::env::var("BRAID_FUZZ_SECS").ok().and_then(|s| s.parse::<f64>().ok()).unwrap_or(2.0);
    Duration::from_secs_f64(secs.max(0.0))
}

fn go(name: &str, target: fn(&[u8])) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let crashes = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-crashes").join(name);
    match fuzz::run(&root.join("corpus").join(name), &crashes, budget(), target) {
        Ok(r) => eprintln!("fuzz {name}: {} executions from a corpus of {}", r.executions, r.corpus),
        Err(e) => panic!("fuzz {name}: {e}"),
    }
}

/// One test per fuzz target, named as the target and its corpus folder.
macro_rules! targets {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                go(stringify!($name), fuzz::$name);
            }
        )*
    };
}

targets!(gguf, safetensors_header, tokenizer_json, gguf_tokenizer, chat_template);
