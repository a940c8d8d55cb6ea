//! A fake lane for testing the HTTP layer without a model: a byte-level
//! tokenizer (one token per byte) and a generator that "writes" a fixed
//! text one byte per tick, with a bounded queue and a running limit like
//! the real lane's.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use braid_engine::{Event, EventSink, Fill, FinishReason, LaneStats, Request, SubmitError, TextStops, Timing, Usage};
use braid_formats::template::ChatTemplate;
use braid_formats::tokenizer::{GgufTokenizerSpec, Tokenizer};
use braid_server::{Generator, ModelInfo, Ticket};

/// What every fake stream writes, cut at `max_tokens` (then "length"); the
/// whole of it ends with "stop", unless `ignore_eos` (then it repeats).
pub const REPLY: &str = "Hello from the fake lane.";
pub const EOS: u32 = 256;

/// GPT-2's byte-to-character map: printable bytes stand for themselves,
/// the rest move to U+0100 and up.
fn byte_char(b: u8) -> char {
    let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    if printable {
        return b as char;
    }
    let shift = (0..b).filter(|&x| !((33..=126).contains(&x) || (161..=172).contains(&x) || (174..=255).contains(&x))).count();
    char::from_u32(256 + shift as u32).unwrap()
}

pub fn tokenizer() -> Tokenizer {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    tokens.push("<|endoftext|>".into());
    let mut types = vec![1; 256];
    types.push(3);
    Tokenizer::from_spec(GgufTokenizerSpec {
        model: "gpt2".into(),
        tokens,
        token_types: Some(types),
        merges: Some(Vec::new()),
        eos: Some(EOS),
        add_bos: Some(false),
        ..GgufTokenizerSpec::default()
    })
    .expect("byte tokenizer")
}

pub fn model_info(with_template: bool, context: usize) -> ModelInfo {
    let template = with_template.then(|| {
        ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
            "",
            "<|endoftext|>",
        )
        .expect("template")
    });
    ModelInfo { tokenizer: Arc::new(tokenizer()), template, context, stop_ids: vec![EOS], vision: None }
}

#[derive(Default)]
struct State {
    queued: usize,
    running: usize,
}

/// What a guided stream's grammar says when it fails (see `FakeLane`).
pub const GRAMMAR_FAILURE: &str = "parser error: Too many items (limit 50000)\n<state>\nTokens: ...\n</state>";

pub struct FakeLane {
    pub max_running: usize,
    pub queue: usize,
    pub tick: Duration,
    state: Arc<(Mutex<State>, Condvar)>,
    pub cancelled: Arc<AtomicU64>,
    /// Every request submitted, in order.
    pub seen: Mutex<Vec<Request>>,
    /// Set to play a lane that stopped for good.
    pub dead: AtomicBool,
    /// What each stream writes (REPLY unless `with_reply`).
    reply: &'static str,
}

impl FakeLane {
    pub fn new(max_running: usize, queue: usize, tick: Duration) -> Arc<FakeLane> {
        FakeLane::with_reply(max_running, queue, tick, REPLY)
    }

    /// A lane whose streams write `reply` a byte a token; a token that
    /// leaves a character incomplete has empty text, as the real lane's.
    pub fn with_reply(max_running: usize, queue: usize, tick: Duration, reply: &'static str) -> Arc<FakeLane> {
        Arc::new(FakeLane {
            max_running,
            queue,
            tick,
            state: Arc::default(),
            cancelled: Arc::default(),
            seen: Mutex::new(Vec::new()),
            dead: AtomicBool::new(false),
            reply,
        })
    }

    pub fn queued(&self) -> usize {
        self.state.0.lock().unwrap().queued
    }

    pub fn running(&self) -> usize {
        self.state.0.lock().unwrap().running
    }
}

impl Generator for FakeLane {
    fn submit(&self, req: Request, mut sink: Box<dyn EventSink>) -> Result<Ticket, SubmitError> {
        {
            let mut s = self.state.0.lock().unwrap();
            if s.running >= self.max_running && s.queued >= self.queue {
                return Err(SubmitError::QueueFull { capacity: self.queue });
            }
            s.queued += 1;
        }
        self.seen.lock().unwrap().push(req.clone());
        let state = self.state.clone();
        let cancelled = self.cancelled.clone();
        let (max_running, tick, reply) = (self.max_running, self.tick, self.reply);
        std::thread::spawn(move || {
            let (lock, cv) = &*state;
            // Wait for a running slot; leave the queue if the client left.
            {
                let mut s = lock.lock().unwrap();
                sink.send(Event::Queued { position: s.queued - 1 });
                while s.running >= max_running {
                    if sink.is_closed() {
                        s.queued -= 1;
                        cancelled.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    s = cv.wait_timeout(s, Duration::from_millis(5)).unwrap().0;
                }
                s.queued -= 1;
                s.running += 1;
            }
            let leave = || {
                lock.lock().unwrap().running -= 1;
                cv.notify_all();
            };
            sink.send(Event::Started { cached_tokens: 0 });
            let bytes = reply.as_bytes();
            let mut n = 0;
            let mut text = TextStops::new(&[]);
            let reason = loop {
                if Some(n) == req.stop.max_tokens {
                    break FinishReason::Length;
                }
                // Like EOS: the reply's end stops the stream unless ignored.
                if n == bytes.len() && !req.stop.ignore_eos {
                    break FinishReason::Stop;
                }
                // A guided stream's grammar fails after three tokens (the
                // real lane's `GrammarError`, with a library's long message).
                if n == 3 && req.sampling.guide.is_some() {
                    leave();
                    sink.send(Event::GrammarError(GRAMMAR_FAILURE.into()));
                    return;
                }
                std::thread::sleep(tick);
                let b = bytes[n % bytes.len()];
                let ev = Event::Token {
                    id: b as u32,
                    text: text.push(&[b]).text,
                    logprob: req.logprobs.map(|_| -0.25),
                    top: vec![(b as u32, -0.25), (b'?' as u32, -2.0), (EOS, -3.0)],
                };
                if !sink.send(ev) {
                    cancelled.fetch_add(1, Ordering::Relaxed);
                    leave();
                    return;
                }
                n += 1;
            };
            leave();
            let usage = Usage { prompt_tokens: req.prompt.len(), completion_tokens: n, cached_tokens: 0 };
            sink.send(Event::Finished { reason, usage, tail: String::new(), timing: Timing::default() });
        });
        Ok(Ticket::default())
    }

    fn alive(&self) -> bool {
        !self.dead.load(Ordering::SeqCst)
    }

    fn max_running(&self) -> Option<usize> {
        Some(self.max_running)
    }

    fn stats(&self) -> LaneStats {
        let s = self.state.0.lock().unwrap();
        LaneStats {
            queued: s.queued,
            decoding: s.running,
            fill: Fill { blocks_used: s.running, blocks_total: self.max_running, ..Fill::default() },
            cancelled: self.cancelled.load(Ordering::Relaxed),
            ..LaneStats::default()
        }
    }
}
