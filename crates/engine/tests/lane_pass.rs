//! Prompt passes in a lane: stepped chunks equal the whole pass's, cancel
//! and resume cut the same, chunks share the decode rounds' forward, and
//! memory, `max_rows` and `prefill_share` shape the steps.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use braid_engine::fake::{Call, CallLog, FakeBackend, FakeConfig};
use braid_engine::{prefill_whole, Backend, CutPlan, Event, EventSink, FinishReason, LaneConfig, Pass};
use common::*;

// 1. Stepped chunks equal the whole pass's (same cuts, same rows in order),
//    while another stream decodes between them; and the replies agree.
#[test]
fn stepped_pass_runs_the_whole_pass_chunks() {
    // The whole pass from the same rules: marks every 12 tokens and at the
    // prompt end.
    let p = prompt(30, 2);
    let (stepped, whole_calls, whole, out) = stepped_and_whole(slow(), greedy(p.clone(), 3));

    assert_eq!(stepped, whole_calls);
    let starts: Vec<usize> = stepped.iter().map(|c| c.0).collect();
    assert_eq!(starts, vec![0, 8, 12, 16, 24]);
    assert_eq!(whole.marks.iter().map(|m| m.0).collect::<Vec<_>>(), vec![12, 24, 30]);
    // The same reply: the stepped stream's first token is the whole pass's argmax.
    let logits = whole.logits.unwrap();
    let best = (0..logits.len()).max_by(|&x, &y| logits[x].total_cmp(&logits[y])).unwrap() as u32;
    assert_eq!(out.tokens[0], best);
    assert_eq!(out.tokens, oracle(&p, 3, 64));
}

// 2 and 3. A cancel keeps the last chunk's end; a resumed pass cuts as an
//    uninterrupted one does.
#[test]
fn cancel_keeps_the_chunk_end_and_resume_cuts_the_same() {
    for (inv, max_rows) in [(false, None), (true, Some(3))] {
        let p: Vec<u32> = prompt(23, 3);
        let plan = CutPlan { prompt_len: 23, chunk_tokens: 8, planned_start: 0, marks: vec![10], max_rows, free_cuts: inv, images: Vec::new() };
        let caps = FakeConfig::default().caps;
        let fc = FakeConfig { caps: braid_engine::Capabilities { chunk_invariant: inv, ..caps }, ..FakeConfig::default() };

        let log_a = CallLog::default();
        let mut a = FakeBackend::new(fc.clone(), log_a.clone());
        a.open(1).unwrap();
        let mut pass = Pass::new(1, p.clone().into(), plan.clone(), true);
        let first = pass.step(&mut a, None).unwrap();
        let second = pass.step(&mut a, None).unwrap();
        pass.cancel(&mut a);
        // The state holds exactly the rows up to the last chunk's end.
        assert_eq!(pass.pos(), second.end);
        assert!(first.end < second.end && second.end < 23);
        let resumed = prefill_whole(&mut a, None, &mut pass).unwrap();

        let log_b = CallLog::default();
        let mut b = FakeBackend::new(fc, log_b.clone());
        b.open(1).unwrap();
        let mut pass_b = Pass::new(1, p.clone().into(), plan, true);
        let straight = prefill_whole(&mut b, None, &mut pass_b).unwrap();

        assert_eq!(prefills(&log_a.snapshot(), 1), prefills(&log_b.snapshot(), 1));
        assert_eq!(resumed.logits, straight.logits);
        let calls: Vec<Call> = log_a.snapshot().into_iter().filter(|c| matches!(c, Call::Prefill(_) | Call::CancelPrefill(_))).collect();
        let at = calls.iter().position(|c| *c == Call::CancelPrefill(1)).unwrap();
        // The cancel sits between the second and third chunks, and the next
        // chunk starts where the second ended.
        assert!(matches!(&calls[at - 1], Call::Prefill(c) if c.start + c.tokens.len() == second.end));
        assert!(matches!(&calls[at + 1], Call::Prefill(c) if c.start == second.end));
        // The backend state after the pass is the whole prompt (chunks
        // resumed at the right rows, or the fake would have refused them).
        let feats = a.features().unwrap().to_vec();
        assert_eq!(*feats.last().unwrap(), 22.0);
    }
}

// A lane stops a pass for lack of memory (cancel_prefill) and resumes it
// with the same cuts; a decode step past the memory ends its stream with
// `length`.
#[test]
fn a_pass_paused_for_memory_resumes_on_the_same_cuts() {
    let hold = Arc::new(Mutex::new(()));
    let fc = FakeConfig { blocks_total: 8, block_tokens: 4, hold: Some(hold.clone()), ..FakeConfig::default() };
    let lc = LaneConfig { chunk_tokens: 4, decode_reserve: 0, ..no_marks() };
    let (lane, log) = lane(fc.clone(), lc);
    assert_eq!(lane.max_context(), 32);
    let pa = prompt(4, 4);
    let pb = prompt(24, 5);
    let guard = hold.lock().unwrap();
    let a = lane.submit(greedy(pa.clone(), 27)).unwrap();
    wait_log(&log, "A's open", |l| l.contains(&Call::Open(a.id)));
    let b = lane.submit(greedy(pb.clone(), 1)).unwrap();
    drop(guard);
    let out_b = drain(&b);
    let out_a = drain(&a);

    let calls = log.snapshot();
    let chunks = prefills(&calls, b.id);
    let expect: Vec<usize> = (0..6).map(|i| i * 4).collect();
    assert_eq!(chunks.iter().map(|c| c.0).collect::<Vec<_>>(), expect);
    let cancel = calls.iter().position(|c| *c == Call::CancelPrefill(b.id)).expect("the pass should have been stopped");
    let before = chunk_calls(&calls[..cancel], b.id).len();
    assert!(before > 0 && before < 6, "stopped between chunks, after {before}");
    assert_eq!(out_b.tokens, oracle(&pb, 1, 64));
    // A ran out of memory before max_tokens and ended with `length`, with
    // the tokens it had right.
    assert_eq!(out_a.reason, Some(FinishReason::Length));
    assert!(out_a.tokens.len() < 27);
    assert_eq!(out_a.tokens, oracle(&pa, out_a.tokens.len(), 64));
    assert!(lane.stats().prefill_pauses >= 1);
}

// 4. Another stream decodes between two chunks of a prefilling stream (in
//    the round that carries the later chunk, or one before it).
#[test]
fn decode_rounds_run_between_chunks() {
    let (lane, log) = lane(slow(), LaneConfig { chunk_tokens: 4, ..no_marks() });
    let a = decoding(&lane, prompt(3, 6), LONG);
    let b = lane.submit(greedy(prompt(20, 7), 2)).unwrap();
    let out = drain(&b);
    assert_eq!(out.reason, Some(FinishReason::Length));
    a.cancel();
    drain(&a);
    let calls = log.snapshot();
    let idx = chunk_calls(&calls, b.id);
    assert_eq!(idx.len(), 5);
    for w in idx.windows(2) {
        let between = &calls[w[0] + 1..=w[1]];
        assert!(between.iter().any(|c| c.decodes(a.id)), "no decode round of A between B's chunks: {between:?}");
    }
}

// 4b. When a decode round and a chunk are both due, they run in one
//     forward: every chunk of B comes with A's round, and both streams
//     still get exactly their own tokens.
#[test]
fn a_chunk_shares_the_decode_rounds_forward() {
    let (lane, log) = lane(slow(), LaneConfig { chunk_tokens: 4, ..no_marks() });
    let (a, b) = beside_decoding(&lane, (prompt(3, 6), 40), (prompt(20, 7), 3));
    let calls = log.snapshot();
    let chunks = chunk_calls(&calls, b.id);
    assert_eq!(chunks.len(), 5);
    for &i in &chunks {
        assert!(
            matches!(&calls[i], Call::Round { chunk: Some(_), .. }) && calls[i].decodes(a.id),
            "chunk at call {i} did not share A's round: {:?}",
            &calls[i.saturating_sub(2)..=i]
        );
    }
    assert!(lane.stats().fused_rounds >= 5);
}

/// A sink whose receiver can be made to vanish without dropping the control.
struct Flaky {
    closed: Arc<AtomicBool>,
    events: Arc<Mutex<Vec<Event>>>,
}

impl EventSink for Flaky {
    fn send(&mut self, event: Event) -> bool {
        self.events.lock().unwrap().push(event);
        !self.closed.load(Ordering::SeqCst)
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}

// 6. A stream that leaves mid-pass is forgotten and its fill returns: by
//    dropping its handle, by an explicit cancel, and by its receiver closing.
#[test]
fn a_stream_that_leaves_mid_pass_is_forgotten() {
    for how in ["drop", "cancel", "closed"] {
        let fc = FakeConfig { prefill_delay: Some(Duration::from_millis(5)), ..FakeConfig::default() };
        let (lane, log) = lane(fc, LaneConfig { chunk_tokens: 4, ..no_marks() });
        let req = greedy(prompt(160, 9), 4);
        let closed = Arc::new(AtomicBool::new(false));
        let events = Arc::new(Mutex::new(Vec::new()));
        let (id, handle, control) = match how {
            "closed" => {
                let c = lane.submit_with(req, Box::new(Flaky { closed: closed.clone(), events: events.clone() })).unwrap();
                (c.id, None, Some(c))
            }
            _ => {
                let h = lane.submit(req).unwrap();
                (h.id, Some(h), None)
            }
        };
        wait_log(&log, "two chunks", |l| chunk_calls(l, id).len() >= 2);
        assert!(lane.stats().fill.blocks_used > 0);
        match how {
            "drop" => drop(handle),
            "cancel" => {
                let h = handle.unwrap();
                h.cancel();
                let out = drain(&h);
                assert_eq!(out.reason, Some(FinishReason::Cancelled));
            }
            _ => closed.store(true, Ordering::SeqCst),
        }
        wait_log(&log, "forget", |l| l.contains(&Call::Forget(id)));
        let calls = log.snapshot();
        let n = prefills(&calls, id).len();
        assert!(n < 40, "{how}: the pass ran to the end ({n} chunks)");
        let forget = calls.iter().position(|c| *c == Call::Forget(id)).unwrap();
        assert!(!calls[forget..].iter().any(|c| c.chunk().is_some()), "{how}: chunks after forget");
        wait_until("fill to return", || lane.stats().fill.blocks_used == 0 && lane.stats().fill.slots_used == 0);
        assert_eq!(lane.stats().cancelled, 1, "{how}");
        drop(control);
    }
}

// 7. A backend without chunk invariance is never capped and keeps the
//    pass's cuts (every `chunk_tokens` rows); with it, `max_rows` is
//    honoured and no cut falls on that grid (none is needed).
#[test]
fn max_rows_caps_only_chunk_invariant_backends() {
    for inv in [false, true] {
        let mut fc = FakeConfig::default();
        fc.caps.chunk_invariant = inv;
        let (lane, log) = lane(fc, LaneConfig { chunk_tokens: 8, max_rows: Some(3), ..no_marks() });
        let p = prompt(20, 10);
        let h = lane.submit(greedy(p.clone(), 2)).unwrap();
        let out = drain(&h);
        assert_eq!(out.tokens, oracle(&p, 2, 64));
        let chunks = log.chunks(h.id);
        if inv {
            assert!(chunks.iter().all(|c| c.1 <= 3), "{chunks:?}");
            let ends: Vec<usize> = chunks.iter().map(|c| c.0 + c.1).collect();
            assert_eq!(ends, vec![3, 6, 9, 12, 15, 18, 20]);
        } else {
            assert_eq!(chunks, vec![(0, 8), (8, 8), (16, 4)]);
        }
    }
}

// A round holds at most `max_batch` rows, the chunk included: a chunk
// that does not fit beside the decode rows (a backend that is not chunk
// invariant keeps its cuts) runs alone, every other round, so neither the
// pass nor the decoding streams stall.
#[test]
fn a_chunk_too_big_to_share_alternates_with_the_decode_rounds() {
    let mut fc = slow();
    fc.caps.max_batch = 8;
    let (lane, log) = lane(fc, LaneConfig { chunk_tokens: 100, ..no_marks() });
    assert_eq!(lane.config().chunk_tokens, 8, "the chunk cap is held to the batch");
    let pb = prompt(40, 13);
    let (a, b) = beside_decoding(&lane, (prompt(3, 12), 30), (pb.clone(), 2));
    let calls = log.snapshot();
    let chunks = chunk_calls(&calls, b.id);
    assert_eq!(log.chunks(b.id), (0..5).map(|i| (i * 8, 8)).collect::<Vec<_>>());
    for w in chunks.windows(2) {
        assert!(matches!(calls[w[0]], Call::Prefill(_)), "a chunk of 8 cannot share a round of 8");
        assert!(calls[w[0] + 1..w[1]].iter().any(|c| c.decodes(a.id)), "A waited out two chunks");
    }
    // And a chunk-invariant backend cuts the chunk to the room instead.
    let mut fc = slow();
    fc.caps.max_batch = 8;
    fc.caps.chunk_invariant = true;
    let (lane2, log) = common::lane(fc, LaneConfig { chunk_tokens: 8, ..no_marks() });
    let a = decoding(&lane2, prompt(3, 12), LONG);
    let b = lane2.submit(greedy(pb.clone(), 2)).unwrap();
    assert_eq!(drain(&b).tokens, oracle(&pb, 2, 64));
    a.cancel();
    let calls = log.snapshot();
    assert!(chunk_calls(&calls, b.id).iter().all(|&i| calls[i].decodes(a.id) && calls[i].chunk().unwrap().tokens.len() <= 7));
}

// Time-budgeted steps: with `prefill_share`, a chunk-invariant backend's
// pass runs small steps while another stream decodes (starting with a probe
// step, never growing by more than half), and whole chunks when it
// is alone.
#[test]
fn prefill_share_sizes_steps_only_while_others_decode() {
    let mut fc = slow();
    fc.caps.chunk_invariant = true;
    // Prefill rows are slow relative to decode rounds, so the budget allows
    // far fewer rows than the chunk cap.
    fc.prefill_delay = Some(Duration::from_millis(4));
    let (lane, log) = lane(fc, LaneConfig { chunk_tokens: 64, prefill_share: Some(0.5), ..no_marks() });
    // Alone: whole chunks.
    let p = prompt(100, 11);
    let alone = lane.submit(greedy(p.clone(), 1)).unwrap();
    assert_eq!(drain(&alone).tokens, oracle(&p, 1, 64));
    assert_eq!(log.chunks(alone.id), vec![(0, 64), (64, 36)]);
    // With another stream decoding: a probe step, then steps that never
    // more than double, and still the same reply.
    let a = decoding(&lane, prompt(3, 6), LONG);
    let b = lane.submit(greedy(p.clone(), 1)).unwrap();
    assert_eq!(drain(&b).tokens, oracle(&p, 1, 64));
    a.cancel();
    drain(&a);
    let chunks = log.chunks(b.id);
    assert_eq!(chunks[0], (0, 1), "the first step probes the cost: {chunks:?}");
    assert!(chunks.len() > 2, "steps were not tightened: {chunks:?}");
    // A step cut short by the chunk's end (64) does not shrink the budget,
    // so growth is measured from the largest step run so far.
    let mut largest = 0;
    for c in &chunks {
        assert!(largest == 0 || c.1 <= largest + largest / 2 + 1, "a step grew by more than half: {chunks:?}");
        largest = largest.max(c.1);
    }
    assert!(chunks.iter().all(|c| c.1 < 64), "{chunks:?}");
}
