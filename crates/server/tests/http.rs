//! The HTTP layer against a fake lane: request parsing and validation,
//! response shapes (streamed and not), errors, auth, overload, disconnects
//! and shutdown. Fast: no model.

mod common;

use std::sync::Arc;
use std::time::Duration;

use braid_server::{CacheIsolation, Server, ServerConfig};
use common::fake::{self, FakeLane, REPLY};
use common::*;
use serde_json::{json, Value};

fn config() -> ServerConfig {
    ServerConfig { port: 0, model_name: "fake".into(), max_body_bytes: 64 << 10, max_n: 4, ..ServerConfig::default() }
}

async fn start_with(cfg: ServerConfig, lane: Arc<FakeLane>, template: bool) -> Server {
    let server = Server::bind(cfg).await.expect("bind");
    server.ready_with(lane, fake::model_info(template, 256));
    server
}

async fn start() -> (Server, Arc<FakeLane>) {
    let lane = FakeLane::new(8, 8, Duration::from_millis(1));
    (start_with(config(), lane.clone(), true).await, lane)
}

#[tokio::test]
async fn health_is_503_until_the_model_is_ready() {
    let server = Server::bind(config()).await.unwrap();
    let addr = server.local_addr();
    assert!(addr.ip().is_loopback(), "binds loopback by default");
    let r = get(addr, "/health").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["status"], "loading");
    // Generation is refused while loading, with the usual error shape.
    let e = post(addr, "/v1/completions", &json!({"prompt": "hi"})).await;
    e.expect_error(503);
    assert!(e.header("retry-after").is_some());
    server.ready_with(FakeLane::new(1, 1, Duration::ZERO), fake::model_info(true, 64));
    let r = get(addr, "/health").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!({"status": "ok"}));
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn models_lists_the_served_model() {
    let (server, _) = start().await;
    let addr = server.local_addr();
    let v = get(addr, "/v1/models").await.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "fake");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["max_model_len"], 256);
    assert_eq!(get(addr, "/v1/models/fake").await.json()["id"], "fake");
    get(addr, "/v1/models/other").await.expect_error(404);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn completion_whole_response() {
    let (server, lane) = start().await;
    let addr = server.local_addr();
    let r = post(addr, "/v1/completions", &json!({"model": "fake", "prompt": "abc", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 42, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "stop": "xyz", "ignore_eos": true, "some_unknown_field": {"x": 1}})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"), "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "fake");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["text"], &REPLY[..5]);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"], 8);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // Every parameter reached the lane; `ignore_eos` sends no stop ids.
    let seen = lane.seen.lock().unwrap()[0].clone();
    assert_eq!(seen.prompt, b"abc".iter().map(|&b| b as u32).collect::<Vec<_>>());
    assert_eq!(seen.stop.max_tokens, Some(5));
    let s = &seen.sampling;
    assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p), (0.5, 0.9, 7, 0.1));
    assert_eq!((s.presence_penalty, s.frequency_penalty, s.repetition_penalty), (0.5, -0.5, 1.1));
    assert_eq!(s.seed, Some(42));
    assert_eq!(seen.stop.stop_strings, vec!["xyz".to_string()]);
    assert!(seen.stop.ignore_eos);
    assert_eq!(seen.stop.stop_ids, Vec::<u32>::new());
    assert_eq!(seen.logprobs, None);

    // Without max_tokens the stream may run to the end of the context.
    let v = post(addr, "/v1/completions", &json!({"prompt": [1, 2, 3, 4]})).await.json();
    assert_eq!(v["choices"][0]["text"], REPLY);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let seen = lane.seen.lock().unwrap()[1].clone();
    assert_eq!(seen.stop.max_tokens, Some(256 - 4));
    assert_eq!(seen.prompt, vec![1, 2, 3, 4]);
    // The model's end tokens go with every request that does not ignore them.
    assert_eq!(seen.stop.stop_ids, vec![fake::EOS]);
    assert!(!seen.stop.ignore_eos);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn several_prompts_and_n_give_one_choice_each() {
    let (server, lane) = start().await;
    let addr = server.local_addr();
    let v = post(addr, "/v1/completions", &json!({"prompt": ["ab", [5, 6, 7]], "n": 2, "max_tokens": 3, "seed": 10})).await.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], &REPLY[..3]);
    }
    // Prompt tokens count once per prompt; completions per choice.
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 12);
    let seen = lane.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 4);
    assert_eq!(seen[0].prompt, vec![97, 98]);
    assert_eq!(seen[2].prompt, vec![5, 6, 7]);
    // Choices of one prompt get distinct, reproducible seeds.
    let seeds: Vec<_> = seen.iter().map(|r| r.sampling.seed).collect();
    assert_eq!(seeds, vec![Some(10), Some(11), Some(10), Some(11)]);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn chat_whole_response_renders_the_template() {
    let (server, lane) = start().await;
    let addr = server.local_addr();
    let body = json!({"model": "fake", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}
    ], "max_completion_tokens": 4});
    let v = post(addr, "/v1/chat/completions", &body).await.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": &REPLY[..4]}));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let rendered = "<system>Be brief.\n<user>Hi!\n<assistant>";
    assert_eq!(v["usage"]["prompt_tokens"], rendered.len());
    let seen = lane.seen.lock().unwrap()[0].clone();
    assert_eq!(seen.prompt, rendered.bytes().map(u32::from).collect::<Vec<_>>());
    assert_eq!(seen.stop.max_tokens, Some(4));
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn chat_stream_frames() {
    let (server, _) = start().await;
    let addr = server.local_addr();
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": true, "n": 2,
        "stream_options": {"include_usage": true}});
    let mut open = post_stream(addr, "/v1/chat/completions", &body).await;
    let events = open.events().await;
    // First a role announcement per choice.
    for (i, e) in events[..2].iter().enumerate() {
        assert_eq!(e["object"], "chat.completion.chunk");
        assert_eq!(e["choices"][0]["index"], i);
        assert_eq!(e["choices"][0]["delta"]["role"], "assistant");
    }
    let id = events[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    assert!(events.iter().all(|e| e["id"] == id), "one id for the whole stream");
    assert_eq!(stream_texts(&events, 2), vec![&REPLY[..6], &REPLY[..6]]);
    assert_eq!(stream_finishes(&events, 2), vec!["length", "length"]);
    // include_usage: `usage` null on every chunk but the last, which has no choices.
    let (last, rest) = events.split_last().unwrap();
    assert!(rest.iter().all(|e| e["usage"].is_null()));
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 12);
    assert_eq!(last["usage"]["prompt_tokens"], "<user>Hi\n<assistant>".len());
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn completion_stream_frames() {
    let (server, _) = start().await;
    let addr = server.local_addr();
    let mut open = post_stream(addr, "/v1/completions", &json!({"prompt": "x", "max_tokens": 3, "stream": true})).await;
    let events = open.events().await;
    assert!(events.iter().all(|e| e["object"] == "text_completion" && e.get("usage").is_none()));
    // One chunk per token, then the finish.
    assert_eq!(events.len(), 4);
    assert_eq!(stream_texts(&events, 1), vec![&REPLY[..3]]);
    assert_eq!(events[3]["choices"][0]["finish_reason"], "length");
    assert!(events[..3].iter().all(|e| e["choices"][0]["finish_reason"].is_null()));
    server.shutdown().await.unwrap();
}

/// Every token gets its frame, also one whose bytes end inside a
/// character (its text comes with the token that completes it): a client
/// sees each stream advance every round, whatever the text.
#[tokio::test]
async fn a_token_whose_text_is_held_back_still_gets_its_frame() {
    let reply = "n\u{e9}\u{2713}";
    let lane = FakeLane::with_reply(8, 8, Duration::from_millis(1), reply);
    let server = start_with(config(), lane, true).await;
    let addr = server.local_addr();
    let mut open = post_stream(addr, "/v1/completions", &json!({"prompt": "x", "max_tokens": 6, "stream": true})).await;
    let events = open.events().await;
    let texts: Vec<&str> = events.iter().map(|e| e["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(texts, ["n", "", "\u{e9}", "", "", "\u{2713}", ""], "a frame a token, then the finish");
    assert_eq!(stream_texts(&events, 1), vec![reply]);
    let body = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "stream": true});
    let mut open = post_stream(addr, "/v1/chat/completions", &body).await;
    let events = open.events().await;
    // The role announcement, six tokens, the finish.
    assert_eq!(events.len(), 8);
    assert_eq!(stream_texts(&events, 1), vec![reply]);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn logprobs_shapes() {
    let (server, lane) = start().await;
    let addr = server.local_addr();
    // Completions: `logprobs` is the count of alternatives.
    let v = post(addr, "/v1/completions", &json!({"prompt": "x", "max_tokens": 2, "logprobs": 2})).await.json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["H", "e"]));
    assert_eq!(lp["token_logprobs"], json!([-0.25, -0.25]));
    assert_eq!(lp["top_logprobs"][0], json!({"H": -0.25, "?": -2.0}));
    assert_eq!(lp["text_offset"], json!([0, 1]));
    assert_eq!(lane.seen.lock().unwrap()[0].logprobs, Some(2));

    // Chat: `logprobs: true` and `top_logprobs`.
    let body = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": true, "top_logprobs": 3});
    let v = post(addr, "/v1/chat/completions", &body).await.json();
    let c = &v["choices"][0]["logprobs"]["content"][0];
    assert_eq!(c["token"], "H");
    assert_eq!(c["logprob"], -0.25);
    assert_eq!(c["bytes"], json!([72]));
    let top = c["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), 3);
    // A control token shows its name.
    assert_eq!(top[2]["token"], "<|endoftext|>");

    // Streamed chat carries each token's logprobs in its chunk.
    let body = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": true, "stream": true});
    let events = post_stream(addr, "/v1/chat/completions", &body).await.events().await;
    let lps: Vec<&Value> = events.iter().filter_map(|e| e["choices"][0]["logprobs"]["content"].get(0)).collect();
    assert_eq!(lps.len(), 2);
    assert_eq!(lps[1]["token"], "e");
    assert_eq!(lps[1]["top_logprobs"], json!([]));

    // No logprobs asked: none sent, and the lane is not asked for them.
    let v = post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})).await.json();
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    server.shutdown().await.unwrap();
}

/// (path, body, status, param, words the error message must hold)
type Case = (&'static str, Value, u16, Option<&'static str>, &'static [&'static str]);

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let (server, lane) = start().await;
    let addr = server.local_addr();
    let user = json!([{"role": "user", "content": "x"}]);
    let cases: Vec<Case> = vec![
        ("/v1/completions", json!({"prompt": "x", "max_tokens": -1}), 400, Some("max_tokens"), &["at least 1", "-1"]),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": "5"}), 400, Some("max_tokens"), &["integer", "string"]),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 2.5}), 400, Some("max_tokens"), &["integer"]),
        ("/v1/completions", json!({"prompt": "x", "temperature": -0.1}), 400, Some("temperature"), &["between 0 and 2"]),
        ("/v1/completions", json!({"prompt": "x", "temperature": 2.5}), 400, Some("temperature"), &["2.5"]),
        ("/v1/completions", json!({"prompt": "x", "temperature": "hot"}), 400, Some("temperature"), &["number"]),
        ("/v1/completions", json!({"prompt": "x", "top_p": 0}), 400, Some("top_p"), &["(0, 1]"]),
        ("/v1/completions", json!({"prompt": "x", "top_p": 1.5}), 400, Some("top_p"), &["(0, 1]"]),
        ("/v1/completions", json!({"prompt": "x", "top_k": -2}), 400, Some("top_k"), &[]),
        ("/v1/completions", json!({"prompt": "x", "min_p": 2}), 400, Some("min_p"), &[]),
        ("/v1/completions", json!({"prompt": "x", "presence_penalty": 3}), 400, Some("presence_penalty"), &[]),
        ("/v1/completions", json!({"prompt": "x", "repetition_penalty": 0}), 400, Some("repetition_penalty"), &[]),
        ("/v1/completions", json!({"prompt": "x", "n": 0}), 400, Some("n"), &["at least 1"]),
        ("/v1/completions", json!({"prompt": "x", "n": 5}), 400, Some("n"), &["at most 4"]),
        ("/v1/completions", json!({"prompt": "x", "logprobs": 21}), 400, Some("logprobs"), &["20"]),
        ("/v1/completions", json!({"prompt": "x", "stop": 5}), 400, Some("stop"), &[]),
        ("/v1/completions", json!({"prompt": "x", "stop": ["a", 1]}), 400, Some("stop[1]"), &[]),
        ("/v1/completions", json!({"prompt": "x", "seed": "s"}), 400, Some("seed"), &[]),
        ("/v1/completions", json!({"prompt": "x", "seed": 1.5}), 400, Some("seed"), &["64-bit integer", "1.5"]),
        ("/v1/completions", json!({"prompt": "x", "stream": "yes"}), 400, Some("stream"), &["boolean"]),
        ("/v1/completions", json!({"prompt": "x", "echo": true}), 400, Some("echo"), &["not supported"]),
        ("/v1/completions", json!({"prompt": ""}), 400, Some("prompt"), &["empty"]),
        ("/v1/completions", json!({"prompt": []}), 400, Some("prompt"), &["empty"]),
        ("/v1/completions", json!({"prompt": [[]]}), 400, Some("prompt"), &["empty"]),
        ("/v1/completions", json!({"max_tokens": 3}), 400, Some("prompt"), &["required"]),
        ("/v1/completions", json!({"prompt": 7}), 400, Some("prompt"), &[]),
        ("/v1/completions", json!({"prompt": [1, -2]}), 400, Some("prompt"), &["token id"]),
        ("/v1/completions", json!({"prompt": [1, 999999]}), 400, Some("prompt"), &["999999", "vocabulary"]),
        ("/v1/completions", json!({"prompt": "x", "model": "gpt-4"}), 404, Some("model"), &["gpt-4", "fake"]),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 300}), 400, Some("max_tokens"), &["256", "301", "300"]),
        ("/v1/completions", json!({"prompt": [vec![1; 256]]}), 400, Some("prompt"), &["256"]),
        ("/v1/chat/completions", json!({"messages": []}), 400, Some("messages"), &["at least one"]),
        ("/v1/chat/completions", json!({}), 400, Some("messages"), &["required"]),
        ("/v1/chat/completions", json!({"messages": "hi"}), 400, Some("messages"), &["array"]),
        ("/v1/chat/completions", json!({"messages": [{"content": "x"}]}), 400, Some("messages[0].role"), &[]),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": 5}]}), 400, Some("messages[0].content"), &[]),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            400,
            Some("messages[0].content[0].image_url"),
            &["takes no images"],
        ),
        ("/v1/chat/completions", json!({"messages": user, "logprobs": true, "top_logprobs": 21}), 400, Some("top_logprobs"), &["20"]),
        ("/v1/chat/completions", json!({"messages": user, "top_logprobs": 2}), 400, Some("top_logprobs"), &["logprobs"]),
        ("/v1/chat/completions", json!({"messages": user, "logprobs": 3}), 400, Some("logprobs"), &["boolean"]),
        ("/v1/chat/completions", json!({"messages": user, "max_completion_tokens": 0}), 400, Some("max_completion_tokens"), &[]),
        ("/v1/chat/completions", json!({"messages": user, "model": "nope"}), 404, Some("model"), &[]),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x".repeat(300)}], "max_tokens": 1}), 400, Some("max_tokens"), &["256"]),
    ];
    for (path, body, status, param, words) in cases {
        let r = post(addr, path, &body).await;
        let e = r.expect_error(status);
        assert_eq!(e["param"].as_str(), param, "{body}: {e}");
        let msg = e["message"].as_str().unwrap();
        for w in words {
            assert!(msg.contains(w), "{body}: message {msg:?} lacks {w:?}");
        }
    }
    // Malformed bodies.
    for body in [&b"{\"prompt\": "[..], b"not json", b"[1, 2]", b"\"x\"", b""] {
        let r = post_raw(addr, "/v1/completions", body).await;
        r.expect_error(400);
    }
    // Too large.
    let big = json!({"prompt": "x".repeat(70 << 10)});
    let r = post(addr, "/v1/completions", &big).await;
    assert_eq!(r.expect_error(413)["code"], "request_too_large");
    // Routes and methods.
    get(addr, "/v1/nothing").await.expect_error(404);
    get(addr, "/v1/completions").await.expect_error(405);
    // None of these reached the lane.
    assert!(lane.seen.lock().unwrap().is_empty());
    // The server still works after all that.
    let r = post(addr, "/v1/completions", &json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(r.status, 200);
    let m = get(addr, "/metrics").await.text();
    assert!(m.contains("braid_requests_total{model_name=\"fake\",route=\"/v1/completions\",status=\"400\"}"), "{m}");
    assert!(m.contains("braid_requests_total{model_name=\"fake\",route=\"/v1/completions\",status=\"413\"} 1"), "{m}");
    server.shutdown().await.unwrap();
}

/// `Server::ready` over a real lane (on the engine's fake backend): the
/// model's stop ids go with each request only to a lane that has no EOS
/// ids of its own.
#[tokio::test]
async fn a_lane_without_eos_ids_stops_at_the_models_stop_ids() {
    use braid_engine::fake::{fake_next, CallLog, FakeBackend, FakeConfig, FakeText};
    use braid_engine::{Lane, LaneConfig};
    // The fake model's greedy tokens after [1, 2, 3] are 23, 20, 8, 37.
    let first = fake_next(3, 3, 64);
    for (eos_ids, finish, tokens) in [(vec![], "stop", 1), (vec![63], "length", 4)] {
        let backend = FakeBackend::new(FakeConfig::default(), CallLog::default());
        let lane = Lane::spawn(Box::new(backend), Arc::new(FakeText::default()), LaneConfig { eos_ids: eos_ids.clone(), ..LaneConfig::default() });
        let server = Server::bind(config()).await.unwrap();
        server.ready(lane, braid_server::ModelInfo { stop_ids: vec![first], ..fake::model_info(false, 256) });
        let r = post(server.local_addr(), "/v1/completions", &json!({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["choices"][0]["finish_reason"], finish, "eos_ids {eos_ids:?}: {v}");
        assert_eq!(v["usage"]["completion_tokens"], tokens, "eos_ids {eos_ids:?}: {v}");
        server.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn a_model_without_template_refuses_chat_but_serves_completions() {
    let lane = FakeLane::new(2, 2, Duration::ZERO);
    let server = start_with(config(), lane, false).await;
    let addr = server.local_addr();
    let r = post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "x"}]})).await;
    let e = r.expect_error(400);
    assert!(e["message"].as_str().unwrap().contains("chat template"), "{e}");
    let r = post(addr, "/v1/completions", &json!({"prompt": "x", "max_tokens": 2})).await;
    assert_eq!(r.status, 200);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn api_key_guards_every_route_but_health() {
    let lane = FakeLane::new(2, 2, Duration::ZERO);
    let cfg = ServerConfig { api_keys: vec!["sekrit".into()], ..config() };
    let server = start_with(cfg, lane, true).await;
    let addr = server.local_addr();
    let body = json!({"prompt": "x", "max_tokens": 1}).to_string();
    for path in ["/v1/models", "/metrics"] {
        let r = get(addr, path).await;
        assert_eq!(r.expect_error(401)["type"], "authentication_error");
    }
    for auth in [None, Some("Bearer wrong"), Some("Bearer sekri"), Some("sekrit"), Some("Basic sekrit")] {
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", *a)).collect();
        let r = send(addr, "POST", "/v1/completions", &headers, body.as_bytes()).await.body().await;
        r.expect_error(401);
    }
    let r = send(addr, "POST", "/v1/completions", &[("Authorization", "Bearer sekrit")], body.as_bytes()).await.body().await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = send(addr, "GET", "/v1/models", &[("Authorization", "Bearer sekrit")], b"").await.body().await;
    assert_eq!(r.status, 200);
    assert_eq!(get(addr, "/health").await.status, 200);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn overload_queues_then_refuses_with_retry_after() {
    // One running, one queued; the third is refused.
    let lane = FakeLane::new(1, 1, Duration::from_millis(20));
    let server = start_with(config(), lane.clone(), true).await;
    let addr = server.local_addr();
    let body = json!({"prompt": "x", "max_tokens": 10, "stream": true});
    let mut first = post_stream(addr, "/v1/completions", &body).await;
    assert!(eventually(Duration::from_secs(5), || lane.running() == 1).await);
    let mut second = post_stream(addr, "/v1/completions", &body).await;
    assert!(eventually(Duration::from_secs(5), || lane.queued() == 1).await);
    let r = post(addr, "/v1/completions", &json!({"prompt": "x", "max_tokens": 10})).await;
    assert_eq!(r.expect_error(503)["code"], "server_overloaded");
    assert_eq!(r.header("retry-after"), Some("1"));
    // The two accepted ones both complete.
    assert_eq!(stream_texts(&first.events().await, 1), vec![&REPLY[..10]]);
    assert_eq!(stream_texts(&second.events().await, 1), vec![&REPLY[..10]]);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_client_that_leaves_cancels_its_streams() {
    let lane = FakeLane::new(1, 4, Duration::from_millis(50));
    let server = start_with(config(), lane.clone(), true).await;
    let addr = server.local_addr();
    // 100 tokens at 50 ms: 5 s if nothing cancels them.
    let body = json!({"prompt": "x", "max_tokens": 100, "ignore_eos": true, "stream": true});
    let mut running = post_stream(addr, "/v1/completions", &body).await;
    let e = running.next_event().await.unwrap();
    assert!(e.contains("\"H\""), "{e}");
    // A second stream waits in the queue; its client leaves too.
    let queued = post_stream(addr, "/v1/completions", &body).await;
    assert!(eventually(Duration::from_secs(5), || lane.queued() == 1).await);
    drop(queued);
    assert!(eventually(Duration::from_secs(2), || lane.queued() == 0).await, "a queued stream whose client left stays queued");
    drop(running);
    // Cancelled within a couple of ticks, long before its 25 tokens.
    assert!(eventually(Duration::from_secs(1), || lane.running() == 0).await, "the stream kept running");
    assert_eq!(lane.cancelled.load(std::sync::atomic::Ordering::Relaxed), 2);

    // A non-streaming client that leaves also cancels.
    let whole = json!({"prompt": "x", "max_tokens": 100, "ignore_eos": true}).to_string();
    let client = tokio::spawn(async move { send(addr, "POST", "/v1/completions", &[], whole.as_bytes()).await.status });
    assert!(eventually(Duration::from_secs(5), || lane.running() == 1).await);
    assert!(!client.is_finished(), "answered too early");
    client.abort();
    assert!(eventually(Duration::from_secs(1), || lane.running() == 0).await, "a whole-response stream kept running");
    assert_eq!(lane.cancelled.load(std::sync::atomic::Ordering::Relaxed), 3);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn metrics_report_tokens_latency_and_lane_gauges() {
    let (server, _) = start().await;
    let addr = server.local_addr();
    post(addr, "/v1/completions", &json!({"prompt": "abcd", "max_tokens": 3})).await;
    let m = get(addr, "/metrics").await;
    assert_eq!(m.status, 200);
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    let m = m.text();
    let value = |name: &str| -> f64 {
        let line = m.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{'])).unwrap_or_else(|| panic!("no {name} in {m}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(value("braid_prompt_tokens_total"), 4.0);
    assert_eq!(value("braid_generated_tokens_total"), 3.0);
    assert_eq!(value("braid_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(value("braid_inter_token_seconds_count"), 2.0);
    assert_eq!(value("braid_queue_depth"), 0.0);
    assert_eq!(value("braid_running_streams"), 0.0);
    assert!(m.contains("braid_requests_total{model_name=\"fake\",route=\"/v1/completions\",status=\"200\"} 1"), "{m}");
    assert!(m.contains("# TYPE braid_decode_batch_mean gauge"));
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_cancels_streams_that_outlive_the_grace() {
    let lane = FakeLane::new(2, 2, Duration::from_millis(50));
    let cfg = ServerConfig { shutdown_grace: Duration::from_millis(200), ..config() };
    let server = start_with(cfg, lane.clone(), true).await;
    let addr = server.local_addr();
    let mut open = post_stream(addr, "/v1/completions", &json!({"prompt": "x", "max_tokens": 100, "ignore_eos": true, "stream": true})).await;
    open.next_event().await.unwrap();
    let t = std::time::Instant::now();
    server.shutdown().await.expect("clean shutdown");
    assert!(t.elapsed() < Duration::from_secs(2), "shutdown waited for the stream to finish");
    // The client got an error event and [DONE], not a cut connection.
    let mut rest = Vec::new();
    while let Some(e) = open.next_event().await {
        rest.push(e);
    }
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    assert!(rest.iter().any(|e| e.contains("shutting down")), "{rest:?}");
    assert!(eventually(Duration::from_millis(500), || lane.running() == 0).await);
    // Nothing listens any more.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

// The lane's cache salt: 0 (the shared cache) unless a request names its
// own with `cache_salt`, or caches are kept per API key; a chat's system
// turn's end goes along as the place for a mark.
#[tokio::test]
async fn cache_salts_and_keys_name_the_prefix_cache() {
    let lane = FakeLane::new(8, 8, Duration::ZERO);
    let cfg = ServerConfig { api_keys: vec!["k1".into(), "k2".into()], cache_isolation: CacheIsolation::PerKey, ..config() };
    let server = start_with(cfg, lane.clone(), true).await;
    let addr = server.local_addr();
    let call = |key: &'static str, path: &'static str, body: serde_json::Value| async move {
        let auth = format!("Bearer {key}");
        send(addr, "POST", path, &[("Authorization", auth.as_str())], body.to_string().as_bytes()).await.body().await
    };
    let plain = json!({"prompt": "x", "max_tokens": 1});
    let salted = json!({"prompt": "x", "max_tokens": 1, "cache_salt": "tenant-a"});
    for (key, body) in [("k1", &plain), ("k1", &plain), ("k2", &plain), ("k1", &salted), ("k2", &salted)] {
        assert_eq!(call(key, "/v1/completions", body.clone()).await.status, 200);
    }
    let salts: Vec<u64> = lane.seen.lock().unwrap().iter().map(|r| r.cache_salt).collect();
    assert!(salts.iter().all(|&s| s != 0), "{salts:?}");
    assert_eq!(salts[0], salts[1], "one key, one cache");
    assert_ne!(salts[0], salts[2], "another key, another cache");
    assert!(salts[3] != salts[0] && salts[3] != salts[4], "a salt splits a key's cache, and stays under its key: {salts:?}");
    let e = call("k1", "/v1/completions", json!({"prompt": "x", "cache_salt": ""})).await.expect_error(400);
    assert_eq!(e["param"], "cache_salt");

    let chat = json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 1});
    assert_eq!(call("k1", "/v1/chat/completions", chat).await.status, 200);
    let last = lane.seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.prefix_hint, Some("<system>Be brief.\n".len()));
    assert!(last.prompt.len() > "<system>Be brief.\n".len());
    // This fake keeps no prefix cache to warm.
    let r = call("k1", "/v1/warm", json!({"prompt": "x"})).await;
    assert_eq!(r.expect_error(400)["type"], "invalid_request_error");
    let e = call("k1", "/v1/warm", json!({"prompt": "x", "messages": []})).await.expect_error(400);
    assert_eq!(e["param"], "messages");
    server.shutdown().await.unwrap();

    // Shared: no salt, the shared cache, whatever the key.
    let lane = FakeLane::new(8, 8, Duration::ZERO);
    let server = start_with(config(), lane.clone(), true).await;
    assert_eq!(post(server.local_addr(), "/v1/completions", &plain).await.status, 200);
    assert_eq!(lane.seen.lock().unwrap()[0].cache_salt, 0);
    server.shutdown().await.unwrap();
}
