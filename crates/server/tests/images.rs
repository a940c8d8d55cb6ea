//! Chats with images through the server, over the tiny random Gemma 3
//! vision fixture on the CPU (a byte tokenizer and a plain template stand
//! in for the fixture's, which it has none of): a base64 image part
//! streams an answer that depends on the image, the same image again comes
//! from the prefix cache, bad images get a 400 naming the problem, and
//! `/metrics` counts the images encoded. With `BRAID_PYTHON` (a venv with
//! `openai`), the same through the official client (`openai_images.py`).

mod common;

use std::io::Cursor;
use std::path::PathBuf;
use std::sync::Arc;

use base64::Engine as _;
use braid_engine::{Lane, LaneConfig};
use braid_formats::images::ImagePrep;
use braid_formats::template::ChatTemplate;
use braid_models::{BackendConfig, ModelBackend};
use braid_ops::cpu::Cpu;
use braid_server::{ModelInfo, Server, ServerConfig, TokenizerText, VisionInfo};
use common::{get, post, post_stream, stream_finishes, stream_texts};
use serde_json::{json, Value};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/gemma3_vision")
}

/// The fixture's images (`images_u8` of its reference) as PNG data URLs.
fn images() -> Vec<String> {
    let bytes = std::fs::read(fixture().join("reference.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let e = &header["images_u8"];
    let shape: Vec<usize> = e["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let off: Vec<usize> = e["data_offsets"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let data: Vec<u8> = bytes[8 + n + off[0]..8 + n + off[1]].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as u8).collect();
    let (count, side) = (shape[0], shape[1]);
    (0..count)
        .map(|i| {
            let px = data[i * side * side * 3..(i + 1) * side * side * 3].to_vec();
            let img = image::RgbImage::from_raw(side as u32, side as u32, px).unwrap();
            data_url(&png(&img))
        })
        .collect()
}

fn png(img: &image::RgbImage) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

async fn start() -> Server {
    let dev = Cpu::new(Some(1));
    let (_src, model) = braid_models::open(&dev, &fixture()).expect("load the fixture");
    let backend =
        ModelBackend::new(dev, model, BackendConfig { block_tokens: 4, kv_tokens: 2048, max_streams: 8, max_batch: 256, ..Default::default() }).unwrap();
    let tokenizer = Arc::new(common::fake::tokenizer());
    let lane = Lane::spawn(Box::new(backend), Arc::new(TokenizerText(tokenizer.clone())), LaneConfig { max_context: 256, ..LaneConfig::default() });
    let template =
        ChatTemplate::new("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}", "", "")
            .unwrap();
    let vision = VisionInfo { prep: ImagePrep::load(&fixture(), 32).unwrap(), tokens: 16, boi: Some(253), eoi: Some(254) };
    let info = ModelInfo { tokenizer, template: Some(template), context: 256, stop_ids: Vec::new(), vision: Some(vision) };
    let server = Server::bind(ServerConfig { port: 0, model_name: "tiny-vision".into(), ..ServerConfig::default() }).await.expect("bind");
    server.ready(lane, info);
    server
}

fn chat(url: &str, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": !stream,
        "top_logprobs": if stream { 0 } else { 5 },
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_with_an_image_streams_and_the_same_image_is_cached() {
    let server = start().await;
    let addr = server.local_addr();
    let imgs = images();

    // Streamed: an answer, then usage with no cached rows.
    let events = post_stream(addr, "/v1/chat/completions", &chat(&imgs[0], true)).await.events().await;
    let streamed = stream_texts(&events, 1).remove(0);
    assert_eq!(stream_finishes(&events, 1), vec!["length"]);
    let usage = &events.iter().rev().find(|e| e["usage"].is_object()).expect("a usage chunk")["usage"];
    assert_eq!(usage["completion_tokens"], 6);
    // Text, \n\n, boi, 16 image rows, eoi, \n\n, the rest: more than the text alone.
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 16 + 2 + "What is in this picture?".len() as u64, "{usage}");
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    // The same image again: its rows come from the prefix cache, and the answer is the same.
    let again = post(addr, "/v1/chat/completions", &chat(&imgs[0], false)).await;
    assert_eq!(again.status, 200, "{}", again.text());
    let again = again.json();
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > 16 + 30, "the image's rows are cached: {cached}");
    assert_eq!(again["choices"][0]["message"]["content"].as_str().unwrap(), streamed);

    // Another image at the same place: the cache stops before it, and the answer reads it.
    let other = post(addr, "/v1/chat/completions", &chat(&imgs[1], false)).await.json();
    let cached = other["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached < 30 + 4, "rows past the text before the image are not shared: {cached}");
    // (A tiny random model answers both with the same bytes: their chances differ.)
    let top = |v: &Value| -> Vec<f64> {
        v["choices"][0]["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap().iter().map(|t| t["logprob"].as_f64().unwrap()).collect()
    };
    let (a, b) = (top(&again), top(&other));
    assert!(a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-3), "the answer reads the image: first-token alternatives {a:?} and {b:?}");

    // Two images encoded (the repeat found its rows cached), and their time.
    let metrics = get(addr, "/metrics").await.text();
    assert!(metrics.contains("braid_images_encoded_total{model_name=\"tiny-vision\"} 2"), "{metrics}");
    assert!(metrics.contains("braid_image_encode_seconds_total"), "{metrics}");
    server.shutdown().await.unwrap();
}

/// A PNG whose header says `w`x`h` pixels and that holds no pixel data.
fn png_header(w: u32, h: u32) -> Vec<u8> {
    fn crc32(data: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in data {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
            }
        }
        !c
    }
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend(w.to_be_bytes());
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    out.extend(13u32.to_be_bytes());
    out.extend(&ihdr);
    out.extend(crc32(&ihdr).to_be_bytes());
    // A first (empty) data chunk: decoders read the header up to it.
    out.extend(0u32.to_be_bytes());
    out.extend(b"IDAT");
    out.extend(crc32(b"IDAT").to_be_bytes());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_images_get_a_400_naming_the_problem() {
    let server = start().await;
    let addr = server.local_addr();
    let good = png(&image::RgbImage::new(40, 24));
    let cases: Vec<(String, &str)> = vec![
        ("http://example.invalid/cat.png".into(), "not fetched"),
        (data_url(&good[..good.len() / 2]), "truncated"),
        (data_url(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"), "not taken"),
        (data_url(b"plain text, not an image at all"), "not a PNG, JPEG or WebP"),
        (data_url(&png_header(100_000, 100_000)), "at most 8192 per side"),
        (data_url(&png_header(8000, 8000)), "decompression bomb"),
        ("data:image/png;base64,@@@@".into(), "base64"),
        ("data:image/png,rawbytes".into(), "not base64"),
    ];
    for (url, words) in cases {
        let r = post(addr, "/v1/chat/completions", &chat(&url, false)).await;
        let e = r.expect_error(400);
        assert_eq!(e["param"], "messages[0].content[1].image_url", "{e}");
        assert!(e["message"].as_str().unwrap().contains(words), "wanted `{words}` in {e}");
    }
    // An image of another size is resized, not refused.
    let r = post(addr, "/v1/chat/completions", &chat(&data_url(&good), false)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_sends_images() {
    let Some(python) = std::env::var_os("BRAID_PYTHON") else {
        eprintln!("SKIP: BRAID_PYTHON is not set (scripts/test.sh sets it to a venv with the openai package)");
        return;
    };
    if !std::process::Command::new(&python).args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success()) {
        eprintln!("SKIP: {} cannot `import openai`", python.to_string_lossy());
        return;
    }
    let server = start().await;
    let url = format!("http://{}/v1", server.local_addr());
    let script = format!("{}/tests/openai_images.py", env!("CARGO_MANIFEST_DIR"));
    let image = images().remove(0);
    let out = tokio::task::spawn_blocking(move || std::process::Command::new(python).args([&script, &url, "tiny-vision", &image]).output())
        .await
        .unwrap()
        .expect("run python");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{log}");
    assert!(out.status.success(), "the Python client failed:\n{log}");
    for want in ["ok: streamed chat with an image", "ok: the same image again is cached"] {
        assert!(log.contains(want), "no `{want}` in\n{log}");
    }
    server.shutdown().await.unwrap();
}
