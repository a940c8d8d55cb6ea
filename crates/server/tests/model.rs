//! The server over a real lane running SmolLM2-135M on the CPU: answers,
//! streaming equals whole, stop strings, `n`, seeds, logprobs, cached
//! prompt tokens, context errors, disconnects (memory returns), overload,
//! and the official OpenAI Python client. Skipped (with a notice) when the
//! model is not in the cache.

mod common;

use std::time::Duration;

use braid_engine::{Lane, LaneConfig};
use braid_server::{ModelInfo, Server, ServerConfig};
use common::*;
use serde_json::{json, Value};

const CONTEXT: usize = 1024;

/// One model test at a time: they share two cores, and the timing checks
/// should not race each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn load(lane_cfg: LaneConfig) -> Option<(Lane, ModelInfo)> {
    let (lane, info) = smollm2::lane(lane_cfg, CONTEXT, 4 * CONTEXT)?;
    assert!(info.template.is_some(), "SmolLM2 ships a chat template");
    Some((lane, info))
}

async fn start(lane_cfg: LaneConfig) -> Option<Server> {
    let (lane, info) = load(lane_cfg)?;
    let cfg = ServerConfig { port: 0, model_name: "smollm2".into(), ..ServerConfig::default() };
    let server = Server::bind(cfg).await.expect("bind");
    server.ready(lane, info);
    Some(server)
}

fn metric(text: &str, name: &str) -> f64 {
    let line = text.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{'])).unwrap_or_else(|| panic!("no {name} in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_endpoints() {
    let _serial = SERIAL.lock().await;
    let Some(server) = start(LaneConfig { max_running: 4, queue_capacity: 8, ..LaneConfig::default() }).await else {
        return;
    };
    let addr = server.local_addr();
    assert_eq!(get(addr, "/health").await.status, 200);

    // A greedy completion knows its geography, and streaming gives the same text.
    let body = json!({"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0});
    let whole = post(addr, "/v1/completions", &body).await;
    assert_eq!(whole.status, 200, "{}", whole.text());
    let whole = whole.json();
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.contains("Paris"), "{text:?}");
    assert_eq!(whole["usage"]["prompt_tokens"], 5, "{whole}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = post_stream(addr, "/v1/completions", &streamed).await.events().await;
    assert_eq!(stream_texts(&events, 1), vec![text.clone()]);
    assert_eq!(stream_finishes(&events, 1), vec![whole["choices"][0]["finish_reason"].as_str().unwrap()]);

    // Chat, whole and streamed, renders the template and stops at <|im_end|>.
    let chat = json!({"messages": user("What is the capital of France? Answer in one short sentence."), "max_tokens": 40, "temperature": 0});
    let v = post(addr, "/v1/chat/completions", &chat).await.json();
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(answer.contains("Paris"), "{answer:?}");
    assert!(!answer.contains("<|im_end|>"));
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let mut chat_stream = chat.clone();
    chat_stream["stream"] = json!(true);
    chat_stream["stream_options"] = json!({"include_usage": true});
    let events = post_stream(addr, "/v1/chat/completions", &chat_stream).await.events().await;
    assert_eq!(stream_texts(&events, 1), vec![answer.clone()]);
    let usage = &events.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], v["usage"]["prompt_tokens"]);
    assert_eq!(usage["completion_tokens"], v["usage"]["completion_tokens"]);
    // The next turn of the conversation starts from the first turn, kept
    // in the prefix cache: its whole prompt, and the reply's rows as far as
    // the new prompt tokenizes the reply the same (never the whole prompt).
    let first_prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let turn = json!({"messages": [
        {"role": "user", "content": "What is the capital of France? Answer in one short sentence."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Germany?"}
    ], "max_tokens": 5, "temperature": 0});
    let v2 = post(addr, "/v1/chat/completions", &turn).await.json();
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let second_prompt = v2["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached >= first_prompt && cached < second_prompt, "cached {cached} of a {second_prompt}-token turn after a {first_prompt}-token one: {v2}");

    // Stop strings: cut a known greedy continuation at a word inside it.
    let long = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let full = post(addr, "/v1/completions", &long).await.json()["choices"][0]["text"].as_str().unwrap().to_string();
    let words: Vec<&str> = full.split_whitespace().collect();
    assert!(words.len() >= 4, "{full:?}");
    let stop = format!(" {}", words[3]);
    let at = full.find(&stop).unwrap();
    for stream in [false, true] {
        let mut b = long.clone();
        b["stop"] = json!(["<never>", stop]);
        b["stream"] = json!(stream);
        let (text, finish) = if stream {
            let events = post_stream(addr, "/v1/completions", &b).await.events().await;
            (stream_texts(&events, 1).remove(0), stream_finishes(&events, 1).remove(0))
        } else {
            let v = post(addr, "/v1/completions", &b).await.json();
            (v["choices"][0]["text"].as_str().unwrap().to_string(), v["choices"][0]["finish_reason"].as_str().unwrap().to_string())
        };
        assert_eq!(text, full[..at], "stream={stream}");
        assert_eq!(finish, "stop");
    }

    // n choices sample together; a seed reproduces them, another seed differs.
    let sample = |seed: u64| json!({"prompt": "My favourite animal is", "max_tokens": 10, "temperature": 1.0, "n": 3, "seed": seed, "ignore_eos": true});
    let texts = |v: &Value| -> Vec<String> { v["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap().to_string()).collect() };
    let a = post(addr, "/v1/completions", &sample(7)).await.json();
    let b = post(addr, "/v1/completions", &sample(7)).await.json();
    let c = post(addr, "/v1/completions", &sample(8)).await.json();
    let (ta, tb, tc) = (texts(&a), texts(&b), texts(&c));
    assert_eq!(ta.len(), 3);
    assert_eq!(ta, tb, "the same seed gave different choices");
    assert_ne!(ta, tc, "different seeds gave the same choices");
    assert!(ta[0] != ta[1] || ta[1] != ta[2], "the choices of one request are all equal: {ta:?}");
    assert_eq!(a["usage"]["completion_tokens"], 30);
    // Streamed n=2: two independent choices, each finished.
    let mut sn = sample(7);
    sn["stream"] = json!(true);
    sn["n"] = json!(2);
    let events = post_stream(addr, "/v1/completions", &sn).await.events().await;
    assert_eq!(stream_texts(&events, 2), ta[..2].to_vec(), "streamed choices differ from whole ones");
    assert_eq!(stream_finishes(&events, 2), vec!["length", "length"]);

    // Logprobs: greedy picks the top alternative; the alternatives are sorted.
    let lp = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 3});
    let v = post(addr, "/v1/completions", &lp).await.json();
    let l = &v["choices"][0]["logprobs"];
    let tokens = l["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 4);
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, v["choices"][0]["text"].as_str().unwrap());
    for (i, t) in tokens.iter().enumerate() {
        let chosen = l["token_logprobs"][i].as_f64().unwrap();
        assert!(chosen <= 0.0);
        let top = l["top_logprobs"][i].as_object().unwrap();
        assert!(top.len() <= 3 && !top.is_empty());
        let best = top.values().map(|v| v.as_f64().unwrap()).fold(f64::MIN, f64::max);
        assert!((best - chosen).abs() < 1e-4, "greedy token {t} is not the most likely");
        assert_eq!(top[t.as_str().unwrap()].as_f64().unwrap(), chosen);
    }
    let chat_lp = json!({"messages": user("Hi"), "max_tokens": 3, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let v = post(addr, "/v1/chat/completions", &chat_lp).await.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!content.is_empty());
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
        assert_eq!(top[0]["token"], e["token"]);
    }

    // Prompt + max_tokens beyond the context: 400 naming both numbers.
    let e = post(addr, "/v1/completions", &json!({"prompt": "Hello there", "max_tokens": CONTEXT})).await.expect_error(400);
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains(&CONTEXT.to_string()) && msg.contains(&(CONTEXT + 2).to_string()), "{msg}");
    assert_eq!(e["code"], "context_length_exceeded");

    // The metrics saw it all.
    let m = get(addr, "/metrics").await.text();
    assert!(metric(&m, "braid_generated_tokens_total") >= 60.0, "{m}");
    assert!(metric(&m, "braid_prefill_chunks_total") >= 1.0);
    assert!(metric(&m, "braid_decode_rounds_total") >= 1.0);
    assert!(metric(&m, "braid_decode_batch_max") >= 3.0, "n=3 decoded together");
    assert!(metric(&m, "braid_time_to_first_token_seconds_count") >= 10.0);
    // The lane's gauges are as of its last round: give it a moment.
    let mut running = metric(&m, "braid_running_streams");
    for _ in 0..100 {
        if running == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        running = metric(&get(addr, "/metrics").await.text(), "braid_running_streams");
    }
    assert_eq!(running, 0.0, "streams left running after every request finished");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_disconnect_and_overload() {
    let _serial = SERIAL.lock().await;
    // One running stream, one queued; no prefix marks, so the memory in
    // use with no streams is exactly zero.
    let lane_cfg = LaneConfig { max_running: 1, queue_capacity: 1, prefix_marks: 0, ..LaneConfig::default() };
    let Some(server) = start(lane_cfg).await else {
        return;
    };
    let addr = server.local_addr();
    let numbers = |m: &str| (metric(m, "braid_fill_used"), metric(m, "braid_running_streams"), metric(m, "braid_queue_depth"));
    let before = get(addr, "/metrics").await.text();
    let fill_before = metric(&before, "braid_fill_used");

    let long = json!({"prompt": "Tell me a long story about a dragon.", "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut running = post_stream(addr, "/v1/completions", &long).await;
    // Wait for real tokens: the stream holds memory now.
    let mut got = 0;
    while got < 3 {
        let e = running.next_event().await.expect("stream ended early");
        got += usize::from(e.contains("\"text\""));
    }
    let m = get(addr, "/metrics").await.text();
    let (fill, run, _) = numbers(&m);
    assert!(fill > fill_before, "a decoding stream holds no memory? {m}");
    assert_eq!(run, 1.0);

    // The second waits in the queue; the third is refused.
    let queued = post_stream(addr, "/v1/completions", &long).await;
    let mut depth = 0.0;
    for _ in 0..200 {
        depth = numbers(&get(addr, "/metrics").await.text()).2;
        if depth == 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(depth, 1.0, "the second stream is not queued");
    let r = post(addr, "/v1/completions", &json!({"prompt": "Hi", "max_tokens": 5})).await;
    assert_eq!(r.expect_error(503)["code"], "server_overloaded");
    assert_eq!(r.header("retry-after"), Some("1"));

    // The queued client leaves: its stream leaves the queue.
    drop(queued);
    let mut left = false;
    for _ in 0..100 {
        if numbers(&get(addr, "/metrics").await.text()).2 == 0.0 {
            left = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(left, "a cancelled stream stayed in the queue");

    // The running client leaves: the stream ends and its memory returns,
    // long before its 400 tokens would have run out.
    let generated = metric(&get(addr, "/metrics").await.text(), "braid_generated_tokens_total");
    drop(running);
    let t = std::time::Instant::now();
    let mut last = String::new();
    let mut restored = false;
    for _ in 0..200 {
        last = get(addr, "/metrics").await.text();
        let (fill, run, _) = numbers(&last);
        if run == 0.0 && fill == fill_before {
            restored = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(restored, "fill not restored after the client left:\n{last}");
    assert!(t.elapsed() < Duration::from_secs(1), "took {:?}", t.elapsed());
    assert!(metric(&last, "braid_cancelled_streams_total") >= 2.0);
    // Only the in-flight round(s) finished after the disconnect.
    let after = metric(&last, "braid_generated_tokens_total");
    assert!(after < 400.0, "the stream ran to its end");
    let _ = generated;

    // Free again: a new request is served.
    let r = post(addr, "/v1/completions", &json!({"prompt": "Hi", "max_tokens": 3, "temperature": 0})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    server.shutdown().await.unwrap();
}

/// Runs `script` (in `tests/`) with `BRAID_PYTHON` against a server over
/// SmolLM2; its output, or `None` (with a notice) when Python, its
/// `modules` or the model are missing.
async fn python_client(script: &str, modules: &str) -> Option<String> {
    let Some(python) = std::env::var_os("BRAID_PYTHON") else {
        eprintln!("SKIP: BRAID_PYTHON is not set (scripts/test.sh sets it to a venv with the openai package)");
        return None;
    };
    let has = std::process::Command::new(&python).args(["-c", &format!("import {modules}")]).output().is_ok_and(|o| o.status.success());
    if !has {
        eprintln!("SKIP: {} cannot `import {modules}`", python.to_string_lossy());
        return None;
    }
    let server = start(LaneConfig::default()).await?;
    let url = format!("http://{}/v1", server.local_addr());
    let script = format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR"));
    let out =
        tokio::task::spawn_blocking(move || std::process::Command::new(python).args([&script, &url, "smollm2"]).output()).await.unwrap().expect("run python");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the Python client failed:\n{log}");
    server.shutdown().await.unwrap();
    Some(log)
}

// A schema no finite output satisfies (every object must hold another):
// llguidance compiles it, but its forced opening runs past the parser's
// limits. The server finds that before a stream starts: a 400 naming the
// grammar, whole or streamed, and it serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_no_output_satisfies_is_refused_before_it_runs() {
    let _serial = SERIAL.lock().await;
    let Some(server) = start(LaneConfig::default()).await else { return };
    let addr = server.local_addr();
    let endless = json!({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}}, "$ref": "#/$defs/n"});
    for stream in [false, true] {
        let body = json!({"messages": user("Some JSON, please."), "max_tokens": 20, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "endless", "schema": endless}}});
        let e = post(addr, "/v1/chat/completions", &body).await.expect_error(400);
        assert_eq!((e["param"].as_str(), e["code"].as_str()), (Some("response_format"), Some("invalid_grammar")), "{e}");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains("Too many items") && !msg.contains("<state>"), "{msg}");
    }
    let ok = post(addr, "/v1/chat/completions", &json!({"messages": user("Hi"), "max_tokens": 3, "temperature": 0})).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client() {
    let _serial = SERIAL.lock().await;
    let Some(log) = python_client("openai_client.py", "openai").await else { return };
    assert!(log.contains("ok: streamed chat") && log.contains("ok: completion"), "{log}");
}

// Structured outputs (20 schemas validated by jsonschema), tool-call round
// trips streamed and not, and /tokenize -> /detokenize, through the
// official client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_guided() {
    let _serial = SERIAL.lock().await;
    let Some(log) = python_client("openai_guided.py", "openai, jsonschema").await else { return };
    eprintln!("{log}");
    assert_eq!(log.matches("ok: schema").count(), 20, "{log}");
    for want in ["ok: named tool_choice", "ok: answer after", "ok: streamed required tool call", "ok: streamed answer", "ok: tokenize", "ok: a refused schema"]
    {
        assert!(log.contains(want), "no `{want}` in\n{log}");
    }
}
