//! A server whose lane is a metronome: every stream gets a token each
//! tick, all in one burst as a lane's round ends, and a newcomer's prompt
//! costs nothing. The stall probe against it (`stall_probe`, the same
//! arguments as against `braid serve`) then reads only what the HTTP stack
//! and the probe add to perfectly even rounds: on the GPU host the probe's
//! quiet window reached 1.44–1.69 ms over a 0.90–0.97 ms median while the
//! lane's rounds stayed within ~1.1 ms (docs/dev/cuda-sessions.md, stop 56).
//!
//! `cargo run --release -p braid-server --example metronome -- [--port 8112]
//! [--tick-us 1000] [--keep-hot]`, then e.g. `stall_probe http://127.0.0.1:8112
//! --streams 6 --gen 4000 --long-tokens 1800 --ignore-eos`. The byte-level
//! tokenizer of the server's tests: a token is a byte.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use braid_engine::{Event, EventSink, FinishReason, LaneStats, Request, SubmitError, Timing, Usage};
use braid_server::{Generator, Server, ServerConfig, Ticket};

#[allow(dead_code)]
#[path = "../tests/common/fake.rs"]
mod fake;

/// A stream the metronome writes to.
struct Beat {
    sink: Box<dyn EventSink>,
    sent: usize,
    max: usize,
    prompt: usize,
}

struct Metronome {
    beats: Arc<Mutex<Vec<Beat>>>,
}

impl Metronome {
    /// Starts the beat: every `tick`, a token to every stream, in one burst.
    fn start(tick: Duration) -> Metronome {
        let beats: Arc<Mutex<Vec<Beat>>> = Arc::default();
        let shared = beats.clone();
        std::thread::spawn(move || {
            let mut next = Instant::now();
            loop {
                next += tick;
                // Sleep most of the tick, then spin to its end: the burst
                // leaves when a round would, not when the scheduler wakes us.
                if let Some(rest) = next.checked_duration_since(Instant::now()).and_then(|d| d.checked_sub(Duration::from_micros(300))) {
                    std::thread::sleep(rest);
                }
                while Instant::now() < next {
                    std::hint::spin_loop();
                }
                shared.lock().unwrap().retain_mut(|b| {
                    let token = Event::Token { id: b'a' as u32, text: "a".into(), logprob: None, top: Vec::new() };
                    if !b.sink.send(token) {
                        return false;
                    }
                    b.sent += 1;
                    if b.sent < b.max {
                        return true;
                    }
                    let usage = Usage { prompt_tokens: b.prompt, completion_tokens: b.sent, cached_tokens: 0 };
                    b.sink.send(Event::Finished { reason: FinishReason::Length, usage, tail: String::new(), timing: Timing::default() });
                    false
                });
            }
        });
        Metronome { beats }
    }
}

impl Generator for Metronome {
    fn submit(&self, req: Request, mut sink: Box<dyn EventSink>) -> Result<Ticket, SubmitError> {
        sink.send(Event::Started { cached_tokens: 0 });
        let max = req.stop.max_tokens.unwrap_or(usize::MAX).max(1);
        self.beats.lock().unwrap().push(Beat { sink, sent: 0, max, prompt: req.prompt.len() });
        Ok(Ticket::default())
    }

    fn stats(&self) -> LaneStats {
        LaneStats { decoding: self.beats.lock().unwrap().len(), ..LaneStats::default() }
    }
}

fn main() -> Result<()> {
    let (mut port, mut tick_us, mut keep_hot) = (8112u16, 1000u64, false);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--port" => port = val()?.parse().context("--port")?,
            "--tick-us" => tick_us = val()?.parse().context("--tick-us")?,
            "--keep-hot" => keep_hot = true,
            _ => bail!("usage: metronome [--port 8112] [--tick-us 1000] [--keep-hot]"),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let cfg = ServerConfig { port, model_name: "metronome".into(), max_body_bytes: 16 << 20, keep_hot, ..ServerConfig::default() };
        let server = Server::bind(cfg).await?;
        server.ready_with(Arc::new(Metronome::start(Duration::from_micros(tick_us))), fake::model_info(false, 1 << 20));
        eprintln!("metronome: a token every {tick_us} µs to every stream, on {}", server.local_addr());
        server.run_until(async { tokio::signal::ctrl_c().await.ok().unwrap_or(()) }).await
    })
}
