//! Admission, refusal and the lane's life: memory and `max_running` gate
//! admission, malformed or oversized requests are refused with what is
//! wrong, and shutdown, idling and a panicking backend end cleanly.

mod common;

use std::sync::Arc;
use std::time::Duration;

use braid_engine::fake::{Call, CallLog, FakeBackend, FakeConfig, FakeText};
use braid_engine::{Backend, Event, FinishReason, Lane, LaneConfig, Request, SamplingParams, Step, StreamHandle, SubmitError};
use common::*;

// 8. Admission waits while fill says full, shows queue positions, and
//    proceeds when a stream finishes.
#[test]
fn admission_waits_for_memory() {
    let fc = FakeConfig { blocks_total: 8, block_tokens: 16, decode_delay: Some(Duration::from_millis(10)), ..FakeConfig::default() };
    let lc = LaneConfig { decode_reserve: 16, chunk_tokens: 64, ..no_marks() };
    let (lane, log) = lane(fc, lc);
    assert_eq!(lane.max_context(), 128);
    // A claims 80 + 16 tokens = 6 blocks; B (40 + 16: 4 blocks) and C
    // (60 + 16: 5 blocks) must wait, and do not both fit after A.
    let a = lane.submit(greedy(prompt(80, 11), 45)).unwrap();
    wait_event(&a, |e| matches!(e, Event::Started { .. }));
    // (The reserve is capped by max_tokens, so these ask for 16.)
    let b = lane.submit(greedy(prompt(40, 12), 16)).unwrap();
    let c = lane.submit(greedy(prompt(60, 13), 16)).unwrap();
    assert_eq!(wait_event(&b, |e| matches!(e, Event::Queued { .. })), Event::Queued { position: 0 });
    assert_eq!(wait_event(&c, |e| matches!(e, Event::Queued { .. })), Event::Queued { position: 1 });
    assert_eq!(b.queue_position(), Some(0));
    assert_eq!(c.queue_position(), Some(1));
    assert_eq!(lane.stats().queued, 2);
    assert!(!log.snapshot().contains(&Call::Open(b.id)));
    a.cancel();
    drain(&a);
    let out_b = drain(&b);
    assert_eq!(out_b.reason, Some(FinishReason::Length));
    // C moved up once B was admitted, then got in when B finished.
    let out_c = drain(&c);
    assert!(out_c.events.contains(&Event::Queued { position: 0 }), "{:?}", out_c.events);
    assert_eq!(out_c.reason, Some(FinishReason::Length));
    let calls = log.snapshot();
    let pos = |c: &Call| calls.iter().position(|x| x == c).unwrap();
    assert!(pos(&Call::Forget(a.id)) < pos(&Call::Open(b.id)));
    assert!(pos(&Call::Forget(b.id)) < pos(&Call::Open(c.id)));
}

// Backends that report no fill are admitted by `max_running` alone.
#[test]
fn without_fill_max_running_gates_admission() {
    let mut fc = FakeConfig { blocks_total: 1, ..slow() };
    fc.caps.reports_fill = false;
    let (lane, log) = lane(fc, LaneConfig { max_running: 1, ..no_marks() });
    let a = decoding(&lane, prompt(3, 14), LONG);
    let b = lane.submit(greedy(prompt(3, 15), 1)).unwrap();
    wait_event(&b, |e| matches!(e, Event::Queued { .. }));
    assert!(!log.snapshot().contains(&Call::Open(b.id)));
    drop(a);
    assert_eq!(drain(&b).reason, Some(FinishReason::Length));
}

#[test]
fn a_full_queue_rejects_with_its_capacity() {
    let (lane, _log) = lane(slow(), LaneConfig { max_running: 1, queue_capacity: 1, ..no_marks() });
    let a = lane.submit(greedy(prompt(3, 16), LONG)).unwrap();
    wait_event(&a, |e| matches!(e, Event::Started { .. }));
    let b = lane.submit(greedy(prompt(3, 17), 1)).unwrap();
    let c = lane.submit(greedy(prompt(3, 18), 1));
    assert_eq!(c.err(), Some(SubmitError::QueueFull { capacity: 1 }));
    assert_eq!(lane.stats().rejected, 1);
    a.cancel();
    assert_eq!(drain(&b).reason, Some(FinishReason::Length));
    // Room again.
    let d = lane.submit(greedy(prompt(3, 19), 1)).unwrap();
    assert_eq!(drain(&d).reason, Some(FinishReason::Length));
}

#[test]
fn too_long_requests_are_rejected_with_both_numbers() {
    let (lane, _log) = lane(FakeConfig::default(), LaneConfig { max_context: 64, ..no_marks() });
    let e = lane.submit(greedy(prompt(60, 1), 10)).err().unwrap();
    assert_eq!(e, SubmitError::TooLong { prompt_tokens: 60, max_tokens: Some(10), max_context: 64 });
    let msg = e.to_string();
    assert!(msg.contains("64") && msg.contains("70"), "{msg}");
    let e = lane.submit(Request::new(prompt(64, 1))).err().unwrap();
    assert_eq!(e, SubmitError::TooLong { prompt_tokens: 64, max_tokens: None, max_context: 64 });
    // Exactly full is fine, and stops at the context.
    let h = lane.submit(greedy(prompt(60, 1), 4)).unwrap();
    let out = drain(&h);
    assert_eq!(out.usage.completion_tokens, 4);
    let h = lane.submit(Request { sampling: SamplingParams::greedy(), ..Request::new(prompt(61, 1)) }).unwrap();
    let out = drain(&h);
    assert_eq!(out.reason, Some(FinishReason::Length));
    assert_eq!(out.usage.completion_tokens, 3);
}

#[test]
fn malformed_requests_say_what_is_wrong() {
    let (lane, _log) = lane(FakeConfig::default(), no_marks());
    assert!(matches!(lane.submit(Request::new(vec![])), Err(SubmitError::Invalid(m)) if m.contains("empty")));
    assert!(matches!(lane.submit(Request::new(vec![1, 64])), Err(SubmitError::Invalid(m)) if m.contains("64")));
    let bad = Request { sampling: SamplingParams { top_p: 2.0, ..Default::default() }, ..Request::new(vec![1]) };
    assert!(matches!(lane.submit(bad), Err(SubmitError::Invalid(m)) if m.contains("top_p")));
    assert!(matches!(lane.submit(greedy(vec![1], 0)), Err(SubmitError::Invalid(m)) if m.contains("max_tokens")));
}

#[test]
fn an_idle_lane_sleeps() {
    let (lane, _log) = lane(FakeConfig::default(), no_marks());
    drain(&lane.submit(greedy(prompt(4, 80), 2)).unwrap());
    std::thread::sleep(Duration::from_millis(30));
    let before = lane.stats().rounds;
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(lane.stats().rounds, before, "the lane spun while idle");
}

#[test]
fn shutdown_cancels_running_and_queued_streams() {
    let (lane, log) = lane(slow(), LaneConfig { max_running: 1, ..no_marks() });
    let a = decoding(&lane, prompt(4, 81), LONG);
    let b = lane.submit(greedy(prompt(4, 82), 10)).unwrap();
    wait_event(&b, |e| matches!(e, Event::Queued { .. }));
    lane.shutdown();
    assert_eq!(drain(&a).reason, Some(FinishReason::Cancelled));
    assert_eq!(drain(&b).reason, Some(FinishReason::Cancelled));
    assert!(a.recv().is_none(), "the channel closes after the last event");
    assert!(log.snapshot().contains(&Call::Forget(a.id)));
}

/// How a [`Faulting`] fake's `at`-th round goes wrong.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// It panics.
    Panic,
    /// It panics, and so does every `forget`: the lane cannot recover.
    PanicForgetToo,
    /// It fails.
    Fail,
    /// It fails and the backend is lost from then on: every later call
    /// fails too, as a faulted CUDA context's would.
    Lose,
}

/// A fake whose `at`-th round goes wrong as `fault` says.
struct Faulting {
    inner: FakeBackend,
    rounds: usize,
    at: usize,
    fault: Fault,
    lost: Option<String>,
}

impl Faulting {
    fn check(&self) -> anyhow::Result<()> {
        match &self.lost {
            Some(e) => anyhow::bail!("{e}"),
            None => Ok(()),
        }
    }
}

impl Backend for Faulting {
    fn capabilities(&self) -> braid_engine::Capabilities {
        self.inner.capabilities()
    }
    fn fill(&self) -> braid_engine::Fill {
        self.inner.fill()
    }
    fn open(&mut self, stream: u64) -> anyhow::Result<()> {
        self.check()?;
        self.inner.open(stream)
    }
    fn round(&mut self, step: Step<'_>) -> anyhow::Result<braid_engine::RoundOut> {
        self.check()?;
        self.rounds += 1;
        if self.rounds == self.at {
            match self.fault {
                Fault::Panic | Fault::PanicForgetToo => panic!("boom in round {}", self.rounds),
                Fault::Fail => anyhow::bail!("device fault in round {}", self.rounds),
                Fault::Lose => {
                    let e = format!("device fault in round {}", self.rounds);
                    self.lost = Some(e.clone());
                    anyhow::bail!("{e}");
                }
            }
        }
        self.inner.round(step)
    }
    fn prefill_step(&mut self, stream: u64, chunk: braid_engine::Chunk<'_>) -> anyhow::Result<Option<Vec<f32>>> {
        self.check()?;
        self.inner.prefill_step(stream, chunk)
    }
    fn cancel_prefill(&mut self, stream: u64) {
        self.inner.cancel_prefill(stream)
    }
    fn forget(&mut self, stream: u64) {
        if self.fault == Fault::PanicForgetToo {
            panic!("forget broke too");
        }
        self.inner.forget(stream)
    }
    fn lost(&self) -> Option<String> {
        self.lost.clone()
    }
}

/// A lane over a [`Faulting`] fake logging to `log`.
fn faulting(at: usize, fault: Fault, log: CallLog, cfg: LaneConfig) -> Lane {
    let inner = FakeBackend::new(FakeConfig::default(), log);
    Lane::spawn(Box::new(Faulting { inner, rounds: 0, at, fault, lost: None }), Arc::new(FakeText::default()), cfg)
}

#[test]
fn a_panicking_round_fails_its_streams_and_the_lane_serves_on() {
    let log = CallLog::default();
    let lane = faulting(5, Fault::Panic, log.clone(), no_marks());
    let h = lane.submit(greedy(prompt(4, 100), 50)).unwrap();
    let out = drain(&h);
    assert!(out.error.as_deref().is_some_and(|e| e.contains("boom in round 5")), "{:?}", out.error);
    assert_eq!(out.tokens.len(), 5, "the first token and four decoded ones came before the panic");
    // Its memory returned, and the next stream is served as usual.
    wait_until("the failed stream forgotten", || log.snapshot().contains(&Call::Forget(h.id)));
    let next = lane.submit(greedy(prompt(4, 101), 3)).unwrap();
    let out = drain(&next);
    assert_eq!((out.reason, out.error), (Some(FinishReason::Length), None));
    assert!(lane.alive());
    wait_until("the slots free", || lane.stats().fill.slots_used == 0);
    let st = lane.stats();
    assert_eq!((st.errors, st.lane_failures, st.queued), (1, 1, 0));
}

#[test]
fn a_lane_that_cannot_recover_says_it_is_dead() {
    let lane = faulting(2, Fault::PanicForgetToo, CallLog::default(), no_marks());
    assert!(lane.alive());
    let h = lane.submit(greedy(prompt(4, 100), 50)).unwrap();
    let out = drain(&h);
    assert!(out.error.as_deref().is_some_and(|e| e.contains("boom in round 2")), "{:?}", out.error);
    wait_until("the lane to close", || matches!(lane.submit(greedy(prompt(4, 101), 1)), Err(SubmitError::Closed)));
    assert!(!lane.alive());
    // (A probe may have been queued before the lane died: it failed too.)
    assert!(lane.stats().errors >= 1);
}

#[test]
fn a_failed_round_of_a_backend_that_recovers_fails_its_streams_only() {
    let lane = faulting(4, Fault::Fail, CallLog::default(), LaneConfig { max_running: 1, ..no_marks() });
    let out = drain(&lane.submit(greedy(prompt(4, 110), 50)).unwrap());
    assert!(out.error.as_deref().is_some_and(|e| e.contains("device fault in round 4")), "{:?}", out.error);
    let out = drain(&lane.submit(greedy(prompt(4, 111), 3)).unwrap());
    assert_eq!((out.reason, out.error), (Some(FinishReason::Length), None));
    assert!(lane.alive());
}

#[test]
fn a_lost_backend_stops_the_lane_and_fails_every_stream() {
    // One stream runs at a time: the second waits in the queue when the
    // backend is lost, and fails with the reason instead of waiting for ever.
    let lane = faulting(4, Fault::Lose, CallLog::default(), LaneConfig { max_running: 1, ..no_marks() });
    let a = lane.submit(greedy(prompt(4, 112), 50)).unwrap();
    let b = lane.submit(greedy(prompt(4, 113), 5)).unwrap();
    let out = drain(&a);
    assert!(out.error.as_deref().is_some_and(|e| e.contains("device fault in round 4")), "{:?}", out.error);
    let out = drain(&b);
    assert!(out.error.as_deref().is_some_and(|e| e.contains("failed for good") && e.contains("device fault")), "{:?}", out.error);
    wait_until("the lane to close", || matches!(lane.submit(greedy(prompt(4, 114), 1)), Err(SubmitError::Closed)));
    assert!(!lane.alive(), "a lane whose backend is lost says it is dead (the server's /health answers 503)");
}

#[test]
fn lanes_and_controls_can_be_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Lane>();
    send_sync::<braid_engine::StreamControl>();
    send::<StreamHandle>();
    send::<Event>();
}
