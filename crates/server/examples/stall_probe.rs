//! The stall scenario with no interpreter between the socket and the clock:
//! `scripts/bench/stall_select.py`'s scenario and JSON keys, each stream
//! read by a thread of its own that stamps every read as it returns.
//!
//! The Python probes read 0.4–1 ms over the lane's own largest gap on the
//! GPU (a 1 ms round): this one tells the server's emission from the
//! client's pauses.
//!
//! `cargo run --release -p braid-server --example stall_probe -- URL
//! [--streams 6] [--gen 4000] [--short-tokens 32] [--long-tokens 1800]
//! [--newcomer-max-tokens 16] [--arrival-after 2] [--ignore-eos] [--seed 1]
//! [--label TEXT] [--timeout 120] [--dump FILE] [--spin]`. Loopback URLs only; the
//! last line printed is the JSON object.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde_json::{json, Value};

const WORDS: &str = "river stone lamp garden paper window engine bridge music winter summer orange silver \
market harbor letter candle forest meadow castle valley island kitchen teacher doctor \
pilot sailor basket ladder compass anchor blanket morning evening village station";

/// `words` words drawn from WORDS by a small generator seeded with `seed`
/// (not Python's: the prompts differ from the Python probe's, their
/// lengths do not).
fn text(words: usize, seed: u64) -> String {
    let list: Vec<&str> = WORDS.split_whitespace().collect();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..words)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            list[(x % list.len() as u64) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

struct Opts {
    host: String,
    port: u16,
    streams: usize,
    gen: usize,
    short_tokens: usize,
    long_tokens: usize,
    newcomer_max_tokens: usize,
    arrival_after: f64,
    ignore_eos: bool,
    seed: u64,
    label: String,
    timeout: f64,
    /// Write every stream's token times here (JSON), to line them up
    /// against the server's round trace.
    dump: Option<String>,
    /// Each stream's thread spins on a non-blocking socket instead of
    /// sleeping in `read`: a core a stream, and no wake-up between the
    /// server's write and the stamp (is the spread the probe's own?).
    spin: bool,
}

fn parse() -> Result<Opts> {
    let mut args = std::env::args().skip(1);
    const USAGE: &str = "usage: stall_probe URL [--streams 6] [--gen 4000] [--short-tokens 32] [--long-tokens 1800] \
[--newcomer-max-tokens 16] [--arrival-after 2] [--ignore-eos] [--seed 1] [--label TEXT] [--timeout 120] [--dump FILE] [--spin]";
    let url = args.next().ok_or_else(|| anyhow!(USAGE))?;
    if url == "--help" || url == "-h" {
        println!("{USAGE}");
        std::process::exit(0);
    }
    let rest = url.strip_prefix("http://").ok_or_else(|| anyhow!("{url}: only http:// URLs"))?;
    let hostport = rest.split('/').next().unwrap_or("");
    let (host, port) = hostport.rsplit_once(':').map_or((hostport, 80), |(h, p)| (h, p.parse().unwrap_or(80)));
    ensure!(host == "localhost" || host.starts_with("127.") || host == "[::1]", "refusing non-loopback host {host:?}");
    let mut o = Opts {
        host: host.to_string(),
        port,
        streams: 6,
        gen: 4000,
        short_tokens: 32,
        long_tokens: 1800,
        newcomer_max_tokens: 16,
        arrival_after: 2.0,
        ignore_eos: false,
        seed: 1,
        label: String::new(),
        timeout: 120.0,
        dump: None,
        spin: false,
    };
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| anyhow!("{a} needs a value"));
        match a.as_str() {
            "--streams" => o.streams = val()?.parse()?,
            "--gen" => o.gen = val()?.parse()?,
            "--short-tokens" => o.short_tokens = val()?.parse()?,
            "--long-tokens" => o.long_tokens = val()?.parse()?,
            "--newcomer-max-tokens" => o.newcomer_max_tokens = val()?.parse()?,
            "--arrival-after" => o.arrival_after = val()?.parse()?,
            "--seed" => o.seed = val()?.parse()?,
            "--label" => o.label = val()?,
            "--timeout" => o.timeout = val()?.parse()?,
            "--dump" => o.dump = Some(val()?),
            "--ignore-eos" => o.ignore_eos = true,
            "--spin" => o.spin = true,
            other => bail!("unknown option {other}"),
        }
    }
    Ok(o)
}

fn request(o: &Opts, body: &Value) -> Vec<u8> {
    let body = body.to_string();
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        o.host,
        o.port,
        body.len()
    )
    .into_bytes()
}

fn payload(o: &Opts, prompt: String, max_tokens: usize, stream: bool) -> Value {
    let mut p = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream});
    if o.ignore_eos {
        p["ignore_eos"] = json!(true);
    }
    p
}

/// The SSE events of a response read so far: headers, de-chunking, then
/// `data:` lines. Each token event gets the time of the read it came in.
#[derive(Default)]
struct Events {
    raw: Vec<u8>,
    head: Option<bool>,
    body: Vec<u8>,
    done: bool,
}

impl Events {
    /// Feed one read; the number of token events it completed.
    fn feed(&mut self, data: &[u8]) -> Result<usize> {
        self.raw.extend_from_slice(data);
        if self.head.is_none() {
            let Some(end) = find(&self.raw, b"\r\n\r\n") else { return Ok(0) };
            let head = String::from_utf8_lossy(&self.raw[..end]).to_lowercase();
            let status = head.split_whitespace().nth(1).unwrap_or("");
            ensure!(status.starts_with('2'), "server answered {}", head.lines().next().unwrap_or(""));
            self.head = Some(head.contains("transfer-encoding: chunked"));
            self.raw.drain(..end + 4);
        }
        if self.head == Some(true) {
            while let Some(nl) = find(&self.raw, b"\r\n") {
                let size_text = String::from_utf8_lossy(&self.raw[..nl]).split(';').next().unwrap_or("").trim().to_string();
                let size = usize::from_str_radix(&size_text, 16).with_context(|| format!("bad chunk size {size_text:?}"))?;
                if self.raw.len() < nl + 2 + size + 2 {
                    break;
                }
                self.body.extend_from_slice(&self.raw[nl + 2..nl + 2 + size]);
                self.raw.drain(..nl + 2 + size + 2);
                if size == 0 {
                    self.done = true;
                    break;
                }
            }
        } else {
            self.body.append(&mut self.raw);
        }
        let mut tokens = 0;
        // Events end at a blank line (bytes: a character split between
        // reads stays whole until its event is complete).
        loop {
            let (lf, crlf) = (find(&self.body, b"\n\n"), find(&self.body, b"\r\n\r\n"));
            let (end, sep) = match (lf, crlf) {
                (Some(a), Some(b)) if b < a => (b, 4),
                (Some(a), _) => (a, 2),
                (None, Some(b)) => (b, 4),
                (None, None) => break,
            };
            let event = String::from_utf8_lossy(&self.body[..end]).into_owned();
            self.body.drain(..end + sep);
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else { continue };
                let data = data.trim();
                if data == "[DONE]" {
                    self.done = true;
                    continue;
                }
                let Ok(ev) = serde_json::from_str::<Value>(data) else { continue };
                let ch = &ev["choices"][0];
                let has_text = ch["text"].as_str().is_some_and(|t| !t.is_empty());
                if ch.is_object() && (has_text || ch["finish_reason"].is_null()) {
                    tokens += 1;
                }
            }
        }
        Ok(tokens)
    }
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

/// One streamed completion read on its own thread: its token times (as
/// seconds since `t0`) and the time its request was sent.
struct Stream {
    times: Arc<Mutex<Vec<f64>>>,
    sent: f64,
    handle: thread::JoinHandle<Result<()>>,
}

fn start(o: &Opts, body: &Value, t0: Instant, stop: Arc<AtomicBool>) -> Result<Stream> {
    let mut sock = TcpStream::connect((o.host.trim_matches(['[', ']']), o.port))?;
    sock.set_nodelay(true)?;
    sock.set_read_timeout(Some(Duration::from_millis(200)))?;
    let req = request(o, body);
    let spin = o.spin;
    let times = Arc::new(Mutex::new(Vec::new()));
    let sent = t0.elapsed().as_secs_f64();
    sock.write_all(&req)?;
    let mine = times.clone();
    let handle = thread::spawn(move || -> Result<()> {
        // The request is written: from here on a spinning thread polls.
        sock.set_nonblocking(spin)?;
        let mut ev = Events::default();
        let mut buf = vec![0u8; 65536];
        while !ev.done && !stop.load(Ordering::Relaxed) {
            let n = match sock.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
                Err(e) => return Err(e.into()),
            };
            let now = t0.elapsed().as_secs_f64();
            let k = ev.feed(&buf[..n])?;
            mine.lock().unwrap().extend(std::iter::repeat_n(now, k));
        }
        Ok(())
    });
    Ok(Stream { times, sent, handle })
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p / 100.0).round() as usize]
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

fn main() -> Result<()> {
    let o = parse()?;
    // Words per token, from one request's usage (a seed never used again).
    let mut c = TcpStream::connect((o.host.trim_matches(['[', ']']), o.port)).context("connecting")?;
    c.write_all(&request(&o, &payload(&o, text(400, o.seed + 99991), 1, false)))?;
    let mut resp = Vec::new();
    c.read_to_end(&mut resp)?;
    let body = find(&resp, b"\r\n\r\n").map_or(&resp[..], |i| &resp[i + 4..]);
    let used = serde_json::from_slice::<Value>(body).ok().and_then(|v| v["usage"]["prompt_tokens"].as_f64()).unwrap_or(400.0);
    let per_token = 400.0 / used.max(1.0);
    let words = |tokens: usize| ((tokens as f64 * per_token).round() as usize).max(1);

    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Duration::from_secs_f64(o.timeout);
    let bg: Vec<Stream> = (0..o.streams)
        .map(|i| start(&o, &payload(&o, text(words(o.short_tokens), o.seed * 31 + i as u64), o.gen, true), t0, stop.clone()))
        .collect::<Result<_>>()?;
    while !bg.iter().all(|s| !s.times.lock().unwrap().is_empty()) {
        ensure!(t0.elapsed() < deadline, "the background streams did not all start decoding");
        thread::sleep(Duration::from_millis(1));
    }
    thread::sleep(Duration::from_secs_f64(o.arrival_after));
    let nc = start(&o, &payload(&o, text(words(o.long_tokens), o.seed * 31 + 500), o.newcomer_max_tokens, true), t0, stop.clone())?;
    let nc_sent = nc.sent;
    while !nc.handle.is_finished() {
        if t0.elapsed() > deadline {
            stop.store(true, Ordering::Relaxed);
            bail!("the newcomer did not finish within {} s", o.timeout);
        }
        thread::sleep(Duration::from_millis(1));
    }
    nc.handle.join().map_err(|_| anyhow!("newcomer thread panicked"))??;
    // Keep the background a little past the newcomer's last token, then stop.
    thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let t_first = nc.times.lock().unwrap().first().copied();
    let (mut base, mut during, mut gaps, mut counts) = (vec![], vec![], vec![], vec![]);
    let mut all = vec![];
    // The largest gap during the arrival and when it began (ms after the newcomer was sent).
    let mut worst_at = (0.0f64, 0.0f64);
    for s in bg {
        let _ = s.handle.join();
        let t = s.times.lock().unwrap();
        counts.push(t.len());
        all.push(t.clone());
        for w in t.windows(2) {
            let g = (w[1] - w[0]) * 1e3;
            gaps.push(g);
            if w[1] <= nc_sent {
                base.push(g);
            } else if t_first.is_some_and(|f| w[0] < f) {
                during.push(g);
                if g > worst_at.0 {
                    worst_at = (g, (w[0] - nc_sent) * 1e3);
                }
            }
        }
    }
    let usual = (!base.is_empty()).then(|| pct(&base, 50.0));
    let worst = during.iter().copied().reduce(f64::max);
    // The largest gap in a window as long as the arrival's, just before it:
    // what the streams' gaps reach with no arrival (the client's and the
    // server's own jitter), beside `max_gap_in_prefill_ms`.
    let quiet = t_first.map(|f| {
        let from = nc_sent - (f - nc_sent);
        all.iter().flat_map(|t| t.windows(2)).filter(|w| w[0] >= from && w[1] <= nc_sent).map(|w| (w[1] - w[0]) * 1e3).fold(0.0, f64::max)
    });
    let out = json!({
        "label": o.label,
        "seed": o.seed,
        "probe": "rust",
        "streams": o.streams,
        "baseline_median_gap_ms": usual.map(round3),
        "max_gap_in_prefill_ms": worst.map(round3),
        "max_gap_before_ms": quiet.map(round3),
        "stall_ratio": usual.zip(worst).map(|(u, w)| round3(w / u)),
        "max_gap_starts_ms": round3(worst_at.1),
        "p99_gap_ms": (!gaps.is_empty()).then(|| round3(pct(&gaps, 99.0))),
        "newcomer_ttft_ms": t_first.map(|f| round3((f - nc_sent) * 1e3)),
        "bg_tokens": counts,
    });
    if let Some(path) = &o.dump {
        // Seconds since the probe's start; `unix_start` puts them on the wall clock.
        let unix_start = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs_f64() - t0.elapsed().as_secs_f64();
        std::fs::write(path, json!({"unix_start": unix_start, "newcomer_sent": nc_sent, "newcomer_first": t_first, "streams": all}).to_string())?;
    }
    println!("{out}");
    Ok(())
}
