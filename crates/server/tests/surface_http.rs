//! The surface around chat and completions against a fake lane (no model,
//! fast): `/v1/responses` shapes whole and streamed, `/props`,
//! `x-request-id`, unknown fields (`--strict`), sampling defaults,
//! `chat_template_kwargs`, `/metrics` finish reasons and `--metrics-public`,
//! `/v1/embeddings`, and the chat page at `/`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use braid_formats::template::ChatTemplate;
use braid_server::{ModelInfo, SamplingDefaults, Server, ServerConfig};
use common::fake::{self, FakeLane, REPLY};
use common::*;
use serde_json::{json, Value};

fn config() -> ServerConfig {
    ServerConfig { port: 0, model_name: "fake".into(), ..ServerConfig::default() }
}

async fn start_with(cfg: ServerConfig, info: ModelInfo) -> (Server, Arc<FakeLane>) {
    let lane = FakeLane::new(4, 4, Duration::from_millis(1));
    let server = Server::bind(cfg).await.expect("bind");
    server.ready_with(lane.clone(), info);
    (server, lane)
}

async fn start(cfg: ServerConfig) -> (Server, Arc<FakeLane>) {
    start_with(cfg, fake::model_info(true, 256)).await
}

/// The text of a prompt the fake lane saw (its tokenizer is one byte per token).
fn prompt_text(lane: &FakeLane, i: usize) -> String {
    let ids = lane.seen.lock().unwrap()[i].prompt.clone();
    String::from_utf8(ids.iter().map(|&t| t as u8).collect()).unwrap()
}

#[tokio::test]
async fn responses_whole_has_openais_shape() {
    let (server, lane) = start(config()).await;
    let addr = server.local_addr();
    let r = post(addr, "/v1/responses", &json!({"model": "fake", "instructions": "Be brief.", "input": "Hi", "max_output_tokens": 100})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "response");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"), "{v}");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["output"][0]["type"], "message");
    assert_eq!(v["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(v["output"][0]["content"][0]["text"], REPLY);
    assert_eq!(v["usage"]["output_tokens"], REPLY.len());
    assert_eq!(v["usage"]["input_tokens"], v["usage"]["total_tokens"].as_u64().unwrap() - REPLY.len() as u64);
    // `instructions` is the system turn, `input` the user's.
    assert_eq!(prompt_text(&lane, 0), "<system>Be brief.\n<user>Hi\n<assistant>");

    // Cut by max_output_tokens: incomplete, with the reason.
    let v = post(addr, "/v1/responses", &json!({"input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 3})).await.json();
    assert_eq!((v["status"].as_str(), v["incomplete_details"]["reason"].as_str()), (Some("incomplete"), Some("max_output_tokens")), "{v}");
    assert_eq!(v["output"][0]["content"][0]["text"], &REPLY[..3]);

    let e = post(addr, "/v1/responses", &json!({"input": "x", "previous_response_id": "resp_1"})).await.expect_error(400);
    assert_eq!(e["param"], "previous_response_id");
    let e = post(addr, "/v1/responses", &json!({"input": [{"type": "input_image", "image_url": "x"}]})).await.expect_error(400);
    assert_eq!(e["param"], "input[0]");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn responses_stream_sends_typed_events_in_order() {
    let (server, _) = start(config()).await;
    let mut open = post_stream(server.local_addr(), "/v1/responses", &json!({"input": "Hi", "stream": true})).await;
    let mut events: Vec<Value> = Vec::new();
    while let Some(data) = open.next_event().await {
        events.push(serde_json::from_str(&data).unwrap());
    }
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    let deltas = kinds.iter().filter(|k| **k == "response.output_text.delta").count();
    let mut want = vec!["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"];
    want.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    want.extend(["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]);
    assert_eq!(kinds, want);
    let seqs: Vec<u64> = events.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (0..events.len() as u64).collect::<Vec<_>>());
    let text: String = events.iter().filter(|e| e["type"] == "response.output_text.delta").map(|e| e["delta"].as_str().unwrap()).collect();
    assert_eq!(text, REPLY);
    let last = &events[events.len() - 1]["response"];
    assert_eq!(last["status"], "completed");
    assert_eq!(last["output"][0]["content"][0]["text"], REPLY);
    assert_eq!(last["id"], events[0]["response"]["id"]);
    assert!(events[0]["response"]["usage"].is_null() && last["usage"]["output_tokens"] == REPLY.len(), "{last}");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn request_ids_are_echoed_or_made() {
    let (server, _) = start(config()).await;
    let addr = server.local_addr();
    let body = json!({"prompt": "x", "max_tokens": 1}).to_string();
    let r = send(addr, "POST", "/v1/completions", &[("x-request-id", "client-id-7")], body.as_bytes()).await.body().await;
    assert_eq!(r.header("x-request-id"), Some("client-id-7"));
    // Without one, the server makes one (a UUID), on every route.
    let r = get(addr, "/health").await;
    let made = r.header("x-request-id").expect("a request id");
    assert_eq!(made.len(), 36, "{made}");
    assert_ne!(get(addr, "/health").await.header("x-request-id"), Some(made));
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn unknown_fields_pass_unless_strict() {
    let body = json!({"prompt": "x", "max_tokens": 1, "bogus": 1, "store": true});
    let (server, _) = start(config()).await;
    assert_eq!(post(server.local_addr(), "/v1/completions", &body).await.status, 200);
    server.shutdown().await.unwrap();

    let (server, lane) = start(ServerConfig { strict: true, ..config() }).await;
    let addr = server.local_addr();
    let e = post(addr, "/v1/completions", &body).await.expect_error(400);
    assert_eq!((e["param"].as_str(), e["code"].as_str()), (Some("bogus"), Some("unknown_field")), "{e}");
    assert!(e["message"].as_str().unwrap().contains("`bogus`"), "{e}");
    // A chat field is unknown to completions, and the other way round.
    let e = post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "x"}], "prompt": "y"})).await.expect_error(400);
    assert_eq!(e["param"], "prompt");
    let e = post(addr, "/v1/responses", &json!({"input": "x", "messages": []})).await.expect_error(400);
    assert_eq!(e["param"], "messages");
    assert!(lane.seen.lock().unwrap().is_empty(), "nothing refused reached the lane");
    let ok = post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "store": false})).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn absent_sampling_fields_take_the_servers_defaults() {
    let sampling = SamplingDefaults { temperature: 0.3, top_k: 5, top_p: 0.7, min_p: 0.2, repetition_penalty: 1.1, source: "test".into() };
    let (server, lane) = start(ServerConfig { sampling, ..config() }).await;
    let addr = server.local_addr();
    post(addr, "/v1/completions", &json!({"prompt": "x", "max_tokens": 1})).await;
    post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "temperature": 0, "top_k": null})).await;
    post(addr, "/v1/responses", &json!({"input": "x", "max_output_tokens": 1, "top_p": 1})).await;
    let seen = lane.seen.lock().unwrap().clone();
    let s: Vec<(f32, usize, f32, f32, f32)> =
        seen.iter().map(|r| (r.sampling.temperature, r.sampling.top_k, r.sampling.top_p, r.sampling.min_p, r.sampling.repetition_penalty)).collect();
    assert_eq!(s, [(0.3, 5, 0.7, 0.2, 1.1), (0.0, 5, 0.7, 0.2, 1.1), (0.3, 5, 1.0, 0.2, 1.1)]);
    let props = get(addr, "/props").await.json();
    assert_eq!(props["default_generation_settings"]["top_k"], 5);
    assert_eq!(props["default_generation_settings"]["source"], "test");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn chat_template_kwargs_reach_the_template() {
    let template = ChatTemplate::new(
        "{% if enable_thinking %}<think>{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
        "",
        "",
    )
    .unwrap();
    let info = ModelInfo { template: Some(template), ..fake::model_info(false, 256) };
    let (server, lane) = start_with(config(), info).await;
    let addr = server.local_addr();
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    post(addr, "/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": true}})).await;
    post(addr, "/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 1})).await;
    post(addr, "/v1/responses", &json!({"input": "Hi", "max_output_tokens": 1, "chat_template_kwargs": {"enable_thinking": true}})).await;
    assert_eq!(prompt_text(&lane, 0), "<think><user>Hi\n<assistant>");
    assert_eq!(prompt_text(&lane, 1), "<user>Hi\n<assistant>");
    assert_eq!(prompt_text(&lane, 2), "<think><user>Hi\n<assistant>");
    let e = post(addr, "/v1/chat/completions", &json!({"messages": msgs, "chat_template_kwargs": {"messages": []}})).await.expect_error(400);
    assert_eq!(e["param"], "chat_template_kwargs");
    let e = post(addr, "/v1/chat/completions", &json!({"messages": msgs, "chat_template_kwargs": true})).await.expect_error(400);
    assert_eq!(e["param"], "chat_template_kwargs");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_base_model_says_it_has_no_template() {
    let (server, _) = start_with(config(), fake::model_info(false, 256)).await;
    let addr = server.local_addr();
    for (path, body) in [("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}]})), ("/v1/responses", json!({"input": "x"}))] {
        let e = post(addr, path, &body).await.expect_error(400);
        assert_eq!(e["code"], "no_chat_template", "{path}: {e}");
        assert!(e["message"].as_str().unwrap().contains("--chat-template"), "{e}");
    }
    assert!(get(addr, "/props").await.json()["chat_template"].is_null());
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn metrics_count_finish_reasons_and_can_be_public() {
    let cfg = ServerConfig { api_keys: vec!["k".into()], metrics_public: true, ..config() };
    let (server, _) = start(cfg).await;
    let addr = server.local_addr();
    let auth = [("Authorization", "Bearer k")];
    for body in [json!({"prompt": "x", "max_tokens": 2}), json!({"prompt": "x", "max_tokens": 100}), json!({"prompt": "x", "max_tokens": 100})] {
        let r = send(addr, "POST", "/v1/completions", &auth, body.to_string().as_bytes()).await.body().await;
        assert_eq!(r.status, 200);
    }
    let m = get(addr, "/metrics").await;
    assert_eq!(m.status, 200, "public metrics need no key");
    let m = m.text();
    assert!(m.contains("braid_finished_streams_total{model_name=\"fake\",finish_reason=\"length\"} 1\n"), "{m}");
    assert!(m.contains("braid_finished_streams_total{model_name=\"fake\",finish_reason=\"stop\"} 2\n"), "{m}");
    assert!(m.contains("braid_queue_time_seconds_count{model_name=\"fake\"} 3\n"), "{m}");
    assert!(m.contains("braid_prefill_time_seconds_bucket{model_name=\"fake\",le=\"+Inf\"}"), "{m}");
    assert!(m.contains("braid_prompt_tokens_total{model_name=\"fake\"} 3\n"), "{m}");
    // Everything else still needs the key.
    get(addr, "/props").await.expect_error(401);
    server.shutdown().await.unwrap();

    let (server, _) = start(ServerConfig { api_keys: vec!["k".into()], ..config() }).await;
    get(server.local_addr(), "/metrics").await.expect_error(401);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn props_tell_the_model_context_template_and_pool() {
    let (server, _) = start(config()).await;
    server.set_about(braid_server::About {
        architecture: "llama".into(),
        parameters: 135_000_000,
        device: "cpu (2 threads)".into(),
        template: "model".into(),
        ..Default::default()
    });
    let p = get(server.local_addr(), "/props").await.json();
    assert_eq!(p["model"], "fake");
    assert_eq!(p["context"], 256);
    assert!(p["chat_template"].as_str().unwrap().contains("add_generation_prompt"), "{p}");
    assert_eq!((p["architecture"].as_str(), p["parameters"].as_u64(), p["device"].as_str()), (Some("llama"), Some(135_000_000), Some("cpu (2 threads)")));
    assert_eq!(p["chat_template_source"], "model");
    assert_eq!(p["kv_pool"]["blocks_total"], 4, "the fake lane's pool: {p}");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn embeddings_say_no_embedding_model_is_loaded() {
    let (server, _) = start(config()).await;
    let e = post(server.local_addr(), "/v1/embeddings", &json!({"model": "fake", "input": "hello"})).await.expect_error(400);
    assert_eq!(e["code"], "model_not_embedding");
    assert!(e["message"].as_str().unwrap().contains("embedding model"), "{e}");
    server.shutdown().await.unwrap();
}

// A grammar that fails mid-generation is the request's fault: a 400
// `invalid_grammar` (whole), or that error as the stream's last event
// after the tokens that came; the library's parser dump stays in the log.
#[tokio::test]
async fn a_grammar_failing_mid_generation_is_a_400() {
    let (server, _) = start(config()).await;
    let addr = server.local_addr();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "response_format": {"type": "json_object"}});
    let e = post(addr, "/v1/chat/completions", &body).await.expect_error(400);
    assert_eq!((e["type"].as_str(), e["code"].as_str()), (Some("invalid_request_error"), Some("invalid_grammar")), "{e}");
    let first = fake::GRAMMAR_FAILURE.lines().next().unwrap();
    assert!(e["message"].as_str().unwrap().ends_with(first), "{e}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = post_stream(addr, "/v1/chat/completions", &streamed).await.events().await;
    assert_eq!(stream_texts(&events, 1), vec![REPLY[..3].to_string()], "the tokens before the failure came");
    assert_eq!(events.last().unwrap()["error"]["code"], "invalid_grammar", "{events:?}");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_chat_page_is_served_at_the_root_without_a_key() {
    let (server, _) = start(ServerConfig { api_keys: vec!["k".into()], ..config() }).await;
    let r = get(server.local_addr(), "/").await;
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/html"), "{:?}", r.headers);
    let page = r.text();
    // It streams chat completions, has the controls, and a stop button.
    for want in
        ["/v1/chat/completions", "stream: true", "/v1/models", "id=\"temperature\"", "id=\"max_tokens\"", "id=\"stop\"", "controller.abort()", "Authorization"]
    {
        assert!(page.contains(want), "no {want:?} in the page");
    }
    // Model output is written as text, never parsed as HTML.
    assert!(!page.contains("innerHTML"), "the page must not set innerHTML");
    server.shutdown().await.unwrap();
}
