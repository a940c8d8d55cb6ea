//! A minimal HTTP/1.1 client over a raw TCP stream (content-length,
//! chunked and close-delimited bodies) and an SSE reader, so the tests need
//! no HTTP client crate.
#![allow(dead_code)]

pub mod fake;
pub mod smollm2;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Every test read gives up after this long, so a hung server fails the
/// test instead of hanging it.
pub const TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts an OpenAI-style error with this status; returns `error`.
    pub fn expect_error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "wanted {status}, got {}: {}", self.status, self.text());
        let v = self.json();
        let e = v["error"].clone();
        assert!(e["message"].is_string() && !e["message"].as_str().unwrap().is_empty(), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
        e
    }
}

/// An open response: status and headers read, body still to come.
pub struct Open {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    body: BodyMode,
    /// Bytes read but not yet handed out (SSE).
    pending: Vec<u8>,
}

enum BodyMode {
    Length(usize),
    /// Bytes left in the current chunk; `None` before the first chunk header.
    Chunked {
        left: usize,
        done: bool,
    },
    UntilClose {
        done: bool,
    },
}

pub async fn send(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Open {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    // The server takes JSON bodies only.
    if method == "POST" && !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type")) {
        head.push_str("Content-Type: application/json\r\n");
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await.expect("write head");
    // The server may answer (413) and close before reading a large body.
    let _ = s.write_all(body).await;
    read_head(s).await
}

async fn read_head(s: TcpStream) -> Open {
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    tokio::time::timeout(TIMEOUT, reader.read_line(&mut line)).await.expect("timed out waiting for a reply").expect("read");
    let status: u16 = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line).await.expect("read header");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let get = |n: &str| headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(n)).map(|(_, v)| v.clone());
    let body = if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        BodyMode::Chunked { left: 0, done: false }
    } else if let Some(n) = get("content-length") {
        BodyMode::Length(n.parse().expect("content-length"))
    } else {
        BodyMode::UntilClose { done: false }
    };
    Open { status, headers, reader, body, pending: Vec::new() }
}

impl Open {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The next piece of body, `None` at its end.
    pub async fn read_some(&mut self) -> Option<Vec<u8>> {
        tokio::time::timeout(TIMEOUT, self.read_some_inner()).await.expect("timed out reading the body")
    }

    async fn read_some_inner(&mut self) -> Option<Vec<u8>> {
        match &mut self.body {
            BodyMode::Length(0) => None,
            BodyMode::Length(n) => {
                let mut buf = vec![0; (*n).min(64 << 10)];
                let got = self.reader.read(&mut buf).await.expect("read body");
                assert!(got > 0, "connection closed with {n} body bytes missing");
                *n -= got;
                buf.truncate(got);
                Some(buf)
            }
            BodyMode::Chunked { done: true, .. } | BodyMode::UntilClose { done: true } => None,
            BodyMode::Chunked { left, done } => {
                if *left == 0 {
                    let mut line = String::new();
                    self.reader.read_line(&mut line).await.expect("chunk size");
                    if line.trim().is_empty() {
                        // The CRLF that ends the previous chunk.
                        line.clear();
                        self.reader.read_line(&mut line).await.expect("chunk size");
                    }
                    let size =
                        usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16).unwrap_or_else(|_| panic!("bad chunk size line {line:?}"));
                    if size == 0 {
                        *done = true;
                        return None;
                    }
                    *left = size;
                }
                let mut buf = vec![0; *left];
                let got = self.reader.read(&mut buf).await.expect("read chunk");
                assert!(got > 0, "connection closed inside a chunk");
                *left -= got;
                buf.truncate(got);
                Some(buf)
            }
            BodyMode::UntilClose { done } => {
                let mut buf = vec![0; 64 << 10];
                let got = self.reader.read(&mut buf).await.expect("read body");
                if got == 0 {
                    *done = true;
                    return None;
                }
                buf.truncate(got);
                Some(buf)
            }
        }
    }

    pub async fn body(mut self) -> Reply {
        let mut body = std::mem::take(&mut self.pending);
        while let Some(b) = self.read_some().await {
            body.extend_from_slice(&b);
        }
        Reply { status: self.status, headers: self.headers, body }
    }

    /// The next SSE event's `data:` payload, `None` at the end of the body.
    pub async fn next_event(&mut self) -> Option<String> {
        loop {
            if let Some(at) = find(&self.pending, b"\n\n") {
                let event: Vec<u8> = self.pending.drain(..at + 2).collect();
                let text = String::from_utf8(event).expect("SSE is UTF-8");
                let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
                if data.is_empty() {
                    continue; // a comment or keep-alive
                }
                return Some(data.join("\n"));
            }
            match self.read_some().await {
                Some(b) => self.pending.extend_from_slice(&b),
                None => {
                    assert!(self.pending.iter().all(u8::is_ascii_whitespace), "unterminated SSE event");
                    return None;
                }
            }
        }
    }

    /// Every event up to `[DONE]` (which must come last), parsed.
    pub async fn events(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        while let Some(data) = self.next_event().await {
            if data == "[DONE]" {
                assert!(self.next_event().await.is_none(), "events after [DONE]");
                return out;
            }
            out.push(serde_json::from_str(&data).unwrap_or_else(|e| panic!("bad SSE JSON {data:?}: {e}")));
        }
        panic!("the stream ended without [DONE]; got {out:?}");
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    send(addr, "GET", path, &[], b"").await.body().await
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    post_raw(addr, path, body.to_string().as_bytes()).await
}

pub async fn post_raw(addr: SocketAddr, path: &str, body: &[u8]) -> Reply {
    send(addr, "POST", path, &[("Content-Type", "application/json")], body).await.body().await
}

/// Starts a streaming POST; the caller reads events.
pub async fn post_stream(addr: SocketAddr, path: &str, body: &Value) -> Open {
    let open = send(addr, "POST", path, &[("Content-Type", "application/json")], body.to_string().as_bytes()).await;
    assert_eq!(open.status, 200, "streaming request refused");
    assert_eq!(open.header("content-type"), Some("text/event-stream"));
    open
}

/// Concatenated text of a completions or chat stream, per choice index.
pub fn stream_texts(events: &[Value], choices: usize) -> Vec<String> {
    let mut out = vec![String::new(); choices];
    for e in events {
        for c in e["choices"].as_array().into_iter().flatten() {
            let i = c["index"].as_u64().unwrap() as usize;
            if let Some(t) = c["text"].as_str() {
                out[i].push_str(t);
            }
            if let Some(t) = c["delta"]["content"].as_str() {
                out[i].push_str(t);
            }
        }
    }
    out
}

/// Finish reason per choice index in a stream (each must appear once).
pub fn stream_finishes(events: &[Value], choices: usize) -> Vec<String> {
    let mut out = vec![None; choices];
    for e in events {
        for c in e["choices"].as_array().into_iter().flatten() {
            if let Some(r) = c["finish_reason"].as_str() {
                let i = c["index"].as_u64().unwrap() as usize;
                assert!(out[i].is_none(), "two finish reasons for choice {i}");
                out[i] = Some(r.to_string());
            }
        }
    }
    out.into_iter().map(|r| r.expect("a choice without finish_reason")).collect()
}

/// Polls `cond` every 10 ms until it holds or `within` passes.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < end {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}
