//! `braid serve`'s log: the start-up summary (model, architecture,
//! parameters, context, KV pool, template, device) as a JSON line under
//! `--log-format json`, RUST_LOG / BRAID_LOG filtering, and the template
//! `--chat-template` picks, seen through `/props`. Skipped when SmolLM2 is
//! not in the cache.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

use braid_formats::cache::cached_model;
use serde_json::Value;

struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `braid serve` on a free port with `args` and `env`; the JSON log
/// lines up to the ready line, and the server.
fn serve(args: &[&str], env: &[(&str, &str)]) -> Option<(Vec<Value>, Serve)> {
    let model = cached_model("SmolLM2-135M-Instruct.Q4_1.gguf")?;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_braid"));
    cmd.args(["--log-format", "json", "serve", "--device", "cpu", "-t", "1", "--port", "0", "--kv-tokens", "4096", "-m"]).arg(&model).args(args);
    cmd.env_remove("RUST_LOG").env_remove("BRAID_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().expect("spawn braid serve");
    let stderr = child.stderr.take().unwrap();
    let server = Serve(child);
    let mut lines = Vec::new();
    let mut log = BufReader::new(stderr).lines();
    for line in log.by_ref() {
        let line = line.expect("read the log");
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("a log line is not JSON ({e}): {line}"));
        let ready = v["fields"]["message"].as_str().is_some_and(|m| m.starts_with("ready on "));
        lines.push(v);
        if ready {
            // Keep reading, so the server's later lines never meet a closed pipe.
            std::thread::spawn(move || log.for_each(drop));
            return Some((lines, server));
        }
    }
    panic!("braid serve ended before it was ready: {lines:?}");
}

fn get(addr: &str, path: &str) -> Value {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}"))
}

#[test]
fn the_start_up_summary_names_the_model_and_where_it_runs() {
    let Some((lines, _server)) = serve(&["--chat-template", "chatml"], &[]) else {
        eprintln!("SKIP: SmolLM2 not in the model cache");
        return;
    };
    let ready = &lines.last().unwrap()["fields"];
    assert_eq!(ready["architecture"], "llama", "{ready}");
    assert_eq!(ready["parameters"], "135M", "{ready}");
    assert_eq!(ready["template"], "builtin chatml", "{ready}");
    // The pool the backend made (at least one whole context).
    assert!(ready["kv_pool_tokens"].as_u64().unwrap() >= ready["context"].as_u64().unwrap(), "{ready}");
    assert!(ready["context"].as_u64().unwrap() > 0 && ready["device"].as_str().unwrap().starts_with("cpu"), "{ready}");
    assert!(ready["sampling"].as_str().unwrap().contains("(braid)"), "{ready}");
    // The template --chat-template picked is the one served.
    let addr = ready["message"].as_str().unwrap().trim_start_matches("ready on http://").to_string();
    let props = get(&addr, "/props");
    assert_eq!(props["chat_template_source"], "builtin chatml", "{props}");
    assert!(props["chat_template"].as_str().unwrap().starts_with("{% for m in messages %}<|im_start|>"), "{props}");
    assert_eq!(props["architecture"], "llama");
}

#[test]
fn rust_log_filters_and_braid_log_is_its_alias() {
    for var in ["RUST_LOG", "BRAID_LOG"] {
        let Some((lines, _server)) = serve(&[], &[(var, "warn,braid::serve=info")]) else { return };
        let targets: Vec<&str> = lines.iter().map(|l| l["target"].as_str().unwrap()).collect();
        // braid_server's own info line ("listening") is filtered out; serve's are kept.
        assert!(targets.iter().all(|t| *t == "braid::serve"), "{var}: {targets:?}");
        assert!(!targets.is_empty());
    }
    let Some((lines, _server)) = serve(&[], &[]) else { return };
    assert!(lines.iter().any(|l| l["target"] == "braid_server"), "info is the default: {lines:?}");
}

#[test]
fn an_unknown_template_name_is_refused_with_the_known_ones() {
    let Some(model) = cached_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let out = Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(["run", "--device", "cpu", "-t", "1", "--chat", "--chat-template", "nope", "-n", "1", "-m"])
        .arg(&model)
        .arg("hi")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--chat-template nope") && err.contains("chatml, llama3, gemma, plain"), "{err}");
}
