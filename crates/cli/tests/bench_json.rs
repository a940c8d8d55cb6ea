//! `braid bench --json` prints one JSON object on stdout and nothing else
//! (the table goes to stderr). Skipped when SmolLM2 is not in the cache.

use braid_formats::cache::cached_model;

#[test]
fn bench_json_is_one_object_on_stdout() {
    let Some(model) = cached_model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        eprintln!("SKIP: SmolLM2 not in the model cache (run `braid fetch smollm2`)");
        return;
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(["bench", "--device", "cpu", "-t", "1", "--pp", "16", "--tg", "4", "--reps", "1", "--streams", "2", "--json", "-m"])
        .arg(&model)
        .output()
        .expect("run braid bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).expect("UTF-8");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("stdout is not one JSON value ({e}):\n{stdout}"));
    let tests: Vec<&str> = v["results"].as_array().expect("results").iter().map(|r| r["test"].as_str().unwrap()).collect();
    assert_eq!(tests, ["pp16", "tg4", "decode x2 streams (aggregate)"], "{v}");
    assert!(v["results"][1]["tokens_per_s"]["median"].as_f64().unwrap() > 0.0, "{v}");
    assert!(stderr.contains("| tg4 |"), "the table goes to stderr:\n{stderr}");
}
