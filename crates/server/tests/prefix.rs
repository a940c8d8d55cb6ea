//! The prefix cache through the server, over a real lane running
//! SmolLM2-135M on the CPU (an attention model: its KV blocks are cached by
//! content): the same prompt again, a shared system prompt, a document
//! with questions sent together, `/v1/warm`, salts and per-key isolation,
//! eviction under a small pool, and replies from the cache equal to cold
//! ones. Skipped (with a notice) when the model is not in the cache.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_engine::LaneConfig;
use braid_formats::tokenizer::Tokenizer;
use braid_server::{CacheIsolation, Server, ServerConfig};
use common::*;
use serde_json::{json, Value};

/// One test at a time: they share two cores, and the timing check should
/// not race another test's prefill.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A server over SmolLM2 with `kv_tokens` of KV memory, and its tokenizer.
async fn start(cfg: ServerConfig, context: usize, kv_tokens: usize) -> Option<(Server, Arc<Tokenizer>)> {
    let (lane, info) = smollm2::lane(LaneConfig::default(), context, kv_tokens)?;
    let tokenizer = info.tokenizer.clone();
    let server = Server::bind(ServerConfig { port: 0, model_name: "smollm2".into(), ..cfg }).await.expect("bind");
    server.ready(lane, info);
    Some((server, tokenizer))
}

/// Varied English-like text: `sentences` sentences drawn from `seed`.
fn text(seed: u64, sentences: usize) -> String {
    const WORDS: [&str; 24] = [
        "river", "garden", "lantern", "quiet", "market", "copper", "winter", "signal", "harbor", "meadow", "engine", "velvet", "orchard", "compass", "silver",
        "thunder", "library", "canyon", "ember", "violet", "station", "falcon", "marble", "forest",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = String::new();
    for i in 0..sentences {
        let n = 6 + (next() % 6) as usize;
        let words: Vec<&str> = (0..n).map(|_| WORDS[(next() % WORDS.len() as u64) as usize]).collect();
        out.push_str(&format!("Note {i}: the {} is {}. ", words[..n - 1].join(" "), words[n - 1]));
    }
    out
}

/// The first `n` token ids of a long text.
fn ids(tok: &Tokenizer, seed: u64, n: usize) -> Vec<u32> {
    let t = tok.encode(&text(seed, n / 4), false).unwrap();
    assert!(t.len() >= n, "{} tokens of text, {n} wanted", t.len());
    t[..n].to_vec()
}

/// A request's reply text, its cached prompt tokens and how long it took.
struct Answer {
    text: String,
    cached: u64,
    prompt: u64,
    secs: f64,
}

async fn ask(addr: std::net::SocketAddr, path: &str, body: Value, key: Option<&str>) -> Answer {
    let t = Instant::now();
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    let r = send(addr, "POST", path, &headers, body.to_string().as_bytes()).await.body().await;
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let c = &v["choices"][0];
    let text = c["text"].as_str().or(c["message"]["content"].as_str()).unwrap().to_string();
    let u = &v["usage"];
    Answer { text, cached: u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(), prompt: u["prompt_tokens"].as_u64().unwrap(), secs }
}

fn metric(text: &str, name: &str) -> f64 {
    let line = text.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{'])).unwrap_or_else(|| panic!("no {name} in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

fn chat(system: &str, question: &str, max_tokens: usize) -> Value {
    json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_prefix_reuse() {
    let _serial = SERIAL.lock().await;
    let Some((server, tok)) = start(ServerConfig::default(), 2048, 16384).await else {
        return;
    };
    let addr = server.local_addr();

    // The same 601-token prompt twice: the second runs only its last row.
    let p = ids(&tok, 1, 601);
    let once = |max_tokens: usize| json!({"prompt": p, "max_tokens": max_tokens, "temperature": 0});
    let first = ask(addr, "/v1/completions", once(1), None).await;
    let second = ask(addr, "/v1/completions", once(1), None).await;
    assert_eq!((first.prompt, first.cached), (601, 0));
    assert!(second.cached >= 600, "cached {} of 601", second.cached);
    eprintln!("601 tokens: cold {:.3} s, cached {:.3} s", first.secs, second.secs);
    assert!(second.secs <= 0.25 * first.secs, "the cached prompt took {:.3} s, the cold one {:.3} s", second.secs, first.secs);
    // Greedy replies from the cache equal cold ones (a fresh salt is a cold cache).
    let mut cold = once(24);
    cold["cache_salt"] = json!("cold-1");
    let (warm, cold) = (ask(addr, "/v1/completions", once(24), None).await, ask(addr, "/v1/completions", cold, None).await);
    assert_eq!(cold.cached, 0, "a new salt sees nothing cached");
    assert!(warm.cached >= 600);
    assert_eq!(warm.text, cold.text, "the reply from the cache differs from the cold one");

    // A 900-token system prompt with two different questions.
    let system = tok.decode(&ids(&tok, 2, 900));
    let q1 = ask(addr, "/v1/chat/completions", chat(&system, "What is the first note about?", 8), None).await;
    assert_eq!(q1.cached, 0);
    let q2 = ask(addr, "/v1/chat/completions", chat(&system, "Which note mentions a falcon?", 16), None).await;
    assert!(q2.cached >= 896, "cached {} of a {}-token chat behind a ~900-token system prompt", q2.cached, q2.prompt);
    let mut cold = chat(&system, "Which note mentions a falcon?", 16);
    cold["cache_salt"] = json!("cold-2");
    assert_eq!(ask(addr, "/v1/chat/completions", cold, None).await.text, q2.text);

    // A document with three questions, sent together: two of three hit.
    let doc = text(3, 60);
    let doc_tokens = tok.encode(&doc, false).unwrap().len() as u64;
    let body = |q: &str| json!({"prompt": format!("{doc}\nQuestion: {q}\nAnswer:"), "max_tokens": 4, "temperature": 0});
    let (a, b, c) = tokio::join!(
        ask(addr, "/v1/completions", body("What is note 3 about?"), None),
        ask(addr, "/v1/completions", body("How many notes are there?"), None),
        ask(addr, "/v1/completions", body("Which word comes last?"), None),
    );
    let hits = [&a, &b, &c].iter().filter(|x| x.cached + 16 >= doc_tokens).count();
    assert!(hits >= 2, "cached {} {} {} of a {doc_tokens}-token document", a.cached, b.cached, c.cached);
    for x in [&a, &b, &c] {
        assert!(x.cached < x.prompt, "cached_tokens beyond the prompt");
    }

    // Warm a system prompt, then chat behind it.
    let system = text(4, 30);
    let r = post(addr, "/v1/warm", &json!({"messages": [{"role": "system", "content": system}]})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let warmed = r.json();
    let n = warmed["prompt_tokens"].as_u64().unwrap();
    // Only the chat header and "Note 0: the" were seen before.
    assert!(warmed["cached_tokens"].as_u64().unwrap() < 16, "{warmed}");
    let after = ask(addr, "/v1/chat/completions", chat(&system, "Hello?", 4), None).await;
    assert!(after.cached >= n, "cached {} after warming {n}", after.cached);
    let again = post(addr, "/v1/warm", &json!({"messages": [{"role": "system", "content": system}]})).await.json();
    assert_eq!(again["cached_tokens"], n, "warming it again finds it all");

    let m = get(addr, "/metrics").await.text();
    let (queries, hits) = (metric(&m, "braid_prefix_cache_queries_total"), metric(&m, "braid_prefix_cache_hits_total"));
    assert!(hits > 0.0 && hits < queries, "{m}");
    assert!(metric(&m, "braid_prefix_cache_blocks") > 0.0);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_per_key_isolation() {
    let _serial = SERIAL.lock().await;
    let cfg = ServerConfig { api_keys: vec!["key-one".into(), "key-two".into()], cache_isolation: CacheIsolation::PerKey, ..ServerConfig::default() };
    let Some((server, tok)) = start(cfg, 1024, 8192).await else {
        return;
    };
    let addr = server.local_addr();
    let body = json!({"prompt": ids(&tok, 5, 120), "max_tokens": 1, "temperature": 0});
    assert_eq!(ask(addr, "/v1/completions", body.clone(), Some("key-one")).await.cached, 0);
    assert_eq!(ask(addr, "/v1/completions", body.clone(), Some("key-two")).await.cached, 0, "another key's prompt shows as cached");
    assert_eq!(ask(addr, "/v1/completions", body.clone(), Some("key-one")).await.cached, 119);
    let mut salted = body.clone();
    salted["cache_salt"] = json!("mine");
    assert_eq!(ask(addr, "/v1/completions", salted, Some("key-one")).await.cached, 0);
    server.shutdown().await.unwrap();
}

// A pool of 64 blocks: two prompts stay cached beside each other; a third
// needs room, and the older one's blocks give way first. Serving goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_eviction_frees_the_least_recently_used() {
    let _serial = SERIAL.lock().await;
    let Some((server, tok)) = start(ServerConfig::default(), 1024, 1024).await else {
        return;
    };
    let addr = server.local_addr();
    let body = |seed: u64, n: usize| json!({"prompt": ids(&tok, seed, n), "max_tokens": 2, "temperature": 0});
    let metrics = || async { get(addr, "/metrics").await.text() };
    ask(addr, "/v1/completions", body(6, 300), None).await;
    ask(addr, "/v1/completions", body(7, 300), None).await;
    // The lane's gauges are as of its last round.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let m = metrics().await;
    assert_eq!(metric(&m, "braid_prefix_cache_evicted_blocks_total"), 0.0, "evicted while blocks were free");
    assert!(metric(&m, "braid_prefix_cache_blocks") >= 36.0, "{m}");
    assert_eq!(metric(&m, "braid_fill_used"), 0.0, "cached blocks count as in use");
    ask(addr, "/v1/completions", body(8, 600), None).await;
    let evicted = metric(&metrics().await, "braid_prefix_cache_evicted_blocks_total");
    assert!(evicted > 0.0);
    let b = ask(addr, "/v1/completions", body(7, 300), None).await;
    assert_eq!(b.cached, 299, "the more recently used prompt kept its blocks");
    let a = ask(addr, "/v1/completions", body(6, 300), None).await;
    assert!(a.cached < 299, "the older prompt kept all its blocks ({})", a.cached);
    // Its reply is what a cold pass gives.
    let mut cold = body(6, 300);
    cold["cache_salt"] = json!("cold");
    assert_eq!(ask(addr, "/v1/completions", cold, None).await.text, a.text);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(metric(&metrics().await, "braid_fill_used"), 0.0);
    server.shutdown().await.unwrap();
}
