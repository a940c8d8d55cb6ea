//! Helpers shared by the lane tests: lanes over recording fakes, the fake
//! model's own continuation, and readers for events and call logs.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use braid_engine::fake::{fake_next, Call, CallLog, FakeBackend, FakeConfig, FakeDrafter, FakeText};
use braid_engine::{
    prefill_whole, Backend, CutPlan, Event, FinishReason, Lane, LaneConfig, Pass, Request, SamplingParams, StopRules, StreamHandle, Usage, WholePass,
};

pub const WAIT: Duration = Duration::from_secs(20);

/// A completion that outlasts the test's checks (the test cancels it), on
/// fakes whose decode rounds take `SLOW`.
pub const LONG: usize = 4000;
pub const SLOW: Option<Duration> = Some(Duration::from_millis(1));

pub fn slow() -> FakeConfig {
    FakeConfig { decode_delay: SLOW, ..FakeConfig::default() }
}

pub fn lane(fc: FakeConfig, lc: LaneConfig) -> (Lane, CallLog) {
    let log = CallLog::default();
    let backend = FakeBackend::new(fc, log.clone());
    (Lane::spawn(Box::new(backend), Arc::new(FakeText::default()), lc), log)
}

pub fn lane_with_drafter(fc: FakeConfig, lc: LaneConfig, wrong_every: usize) -> (Lane, CallLog) {
    let (lane, log, _) = lane_with_checked_drafter(fc, lc, wrong_every);
    (lane, log)
}

/// A lane with a drafter of 4-token blocks, and the count of feature rows
/// the drafter was fed out of order (see [`FakeDrafter`]).
pub fn lane_with_checked_drafter(fc: FakeConfig, lc: LaneConfig, wrong_every: usize) -> (Lane, CallLog, Arc<Mutex<usize>>) {
    let log = CallLog::default();
    let vocab = fc.caps.vocab_size;
    let backend = FakeBackend::new(fc, log.clone());
    let drafter = FakeDrafter::new(log.clone(), vocab, 4, wrong_every);
    let errors = drafter.feature_errors.clone();
    (Lane::spawn_with_drafter(Box::new(backend), Some(Box::new(drafter)), Arc::new(FakeText::default()), lc), log, errors)
}

/// The fake model's greedy continuation, computed independently of the lane.
pub fn oracle(prompt: &[u32], n: usize, vocab: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..n {
        let t = fake_next(*seq.last().unwrap(), seq.len(), vocab);
        seq.push(t);
    }
    seq[prompt.len()..].to_vec()
}

pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        prompt,
        sampling: SamplingParams::greedy(),
        stop: StopRules { max_tokens: Some(max_tokens), ..StopRules::default() },
        logprobs: None,
        ..Default::default()
    }
}

pub fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + seed * 13 + 1) % 64).collect()
}

pub fn no_marks() -> LaneConfig {
    LaneConfig { prefix_marks: 0, ..LaneConfig::default() }
}

#[derive(Debug, Default)]
pub struct Outcome {
    pub events: Vec<Event>,
    pub tokens: Vec<u32>,
    pub text: String,
    pub reason: Option<FinishReason>,
    pub usage: Usage,
    pub error: Option<String>,
    /// The error was the stream's grammar's (`Event::GrammarError`).
    pub grammar_failed: bool,
}

/// Read a stream's events up to its last one.
pub fn drain(h: &StreamHandle) -> Outcome {
    let mut o = Outcome::default();
    loop {
        let ev = h.recv_timeout(WAIT).expect("the stream should end in time");
        o.events.push(ev.clone());
        match ev {
            Event::Token { id, text, .. } => {
                o.tokens.push(id);
                o.text.push_str(&text);
            }
            Event::Finished { reason, usage, tail, .. } => {
                o.text.push_str(&tail);
                o.reason = Some(reason);
                o.usage = usage;
                return o;
            }
            Event::Error(e) => {
                o.error = Some(e);
                return o;
            }
            Event::GrammarError(e) => {
                o.error = Some(e);
                o.grammar_failed = true;
                return o;
            }
            _ => {}
        }
    }
}

/// Wait for the next event matching `pred`.
pub fn wait_event(h: &StreamHandle, pred: impl Fn(&Event) -> bool) -> Event {
    loop {
        let ev = h.recv_timeout(WAIT).expect("the event should come in time");
        if pred(&ev) {
            return ev;
        }
        assert!(!matches!(ev, Event::Finished { .. } | Event::Error(_) | Event::GrammarError(_)), "the stream ended first: {ev:?}");
    }
}

/// A greedy stream submitted and past its first token (`wait_event` takes
/// it), so it is decoding when the test goes on.
pub fn decoding(lane: &Lane, prompt: Vec<u32>, max_tokens: usize) -> StreamHandle {
    let h = lane.submit(greedy(prompt, max_tokens)).unwrap();
    wait_event(&h, |e| matches!(e, Event::Token { .. }));
    h
}

/// Greedy B (`b`: prompt and tokens) submitted while greedy A decodes
/// (past its first token, see `decoding`); both get exactly the model's
/// own continuation. Their handles, drained.
pub fn beside_decoding(lane: &Lane, a: (Vec<u32>, usize), b: (Vec<u32>, usize)) -> (StreamHandle, StreamHandle) {
    let ((pa, na), (pb, nb)) = (a, b);
    let ha = decoding(lane, pa.clone(), na);
    let hb = lane.submit(greedy(pb.clone(), nb)).unwrap();
    assert_eq!(drain(&hb).tokens, oracle(&pb, nb, 64));
    // (A's first token went to `wait_event`.)
    assert_eq!(drain(&ha).tokens, oracle(&pa, na, 64)[1..]);
    (ha, hb)
}

pub fn wait_log(log: &CallLog, what: &str, pred: impl Fn(&[Call]) -> bool) {
    let t = Instant::now();
    while !pred(&log.snapshot()) {
        assert!(t.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub fn wait_until(what: &str, mut pred: impl FnMut() -> bool) {
    let t = Instant::now();
    while !pred() {
        assert!(t.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `(start, tokens, want_logits)` of every prompt chunk of `stream`, alone
/// or in a round, in order.
pub fn prefills(log: &[Call], stream: u64) -> Vec<(usize, Vec<u32>, bool)> {
    log.iter().filter_map(Call::chunk).filter(|c| c.stream == stream).map(|c| (c.start, c.tokens.clone(), c.want_logits)).collect()
}

/// Indices of the calls that ran a chunk of `stream`.
pub fn chunk_calls(log: &[Call], stream: u64) -> Vec<usize> {
    log.iter().enumerate().filter(|(_, c)| c.chunk().is_some_and(|c| c.stream == stream)).map(|(i, _)| i).collect()
}

/// Prefill chunk calls as [`prefills`] reads them.
pub type Prefills = Vec<(usize, Vec<u32>, bool)>;

/// `req` served stepped (chunks of 8, marks every 12 tokens) while another
/// stream decodes, then the whole pass of the same prompt, under the same
/// rules, over a fresh backend: the stepped chunk calls, the whole pass's
/// chunk calls, the whole pass, and the stepped reply.
pub fn stepped_and_whole(fc: FakeConfig, req: Request) -> (Prefills, Prefills, WholePass, Outcome) {
    let lc = LaneConfig { chunk_tokens: 8, mark_every: 12, ..LaneConfig::default() };
    let (lane, log) = lane(fc.clone(), lc);
    let a = decoding(&lane, prompt(5, 1), LONG);
    let (p, images) = (req.prompt.clone(), req.images.clone());
    let b = lane.submit(req).unwrap();
    let out = drain(&b);
    a.cancel();
    drain(&a);
    let stepped = prefills(&log.snapshot(), b.id);

    let whole_log = CallLog::default();
    let mut backend = FakeBackend::new(fc, whole_log.clone());
    backend.open(b.id).unwrap();
    let marks = (12..p.len()).step_by(12).chain([p.len()]).collect();
    let spans = images.iter().map(|i| (i.start, i.end())).collect();
    let plan = CutPlan { prompt_len: p.len(), chunk_tokens: 8, planned_start: 0, marks, max_rows: None, free_cuts: false, images: spans };
    let mut pass = Pass::new(b.id, p.into(), plan, true).with_images(images.into());
    let whole = prefill_whole(&mut backend, None, &mut pass).unwrap();
    (stepped, prefills(&whole_log.snapshot(), b.id), whole, out)
}
