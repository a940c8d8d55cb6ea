//! The prefix cache in a lane: a shared prefix restores its mark, warm
//! feeds keep marks for later prompts, and the cache is bounded; a backend
//! that caches KV blocks itself serves repeats and shared documents, salts
//! keep clients apart, and cached blocks give way when memory is short.

mod common;

use std::sync::{Arc, Mutex};

use braid_engine::fake::{Call, CallLog, FakeConfig};
use braid_engine::{Event, FinishReason, Lane, LaneConfig, Request, SubmitError};
use common::*;

// A second prompt that shares a prefix restores the mark and starts there;
// cached tokens are reported.
#[test]
fn a_shared_prefix_restores_its_mark() {
    let lc = LaneConfig { chunk_tokens: 8, mark_every: 8, ..LaneConfig::default() };
    let (lane, log) = lane(FakeConfig::default(), lc);
    let p1 = prompt(20, 50);
    let out1 = drain(&lane.submit(greedy(p1.clone(), 3)).unwrap());
    assert_eq!(out1.usage.cached_tokens, 0);
    let kept: Vec<usize> = log.snapshot().iter().filter_map(|c| if let Call::KeepMark { len, .. } = c { Some(*len) } else { None }).collect();
    assert_eq!(kept, vec![8, 16, 20]);

    // Shares 18 tokens: the mark at 16 is the longest that fits.
    let mut p2 = p1[..18].to_vec();
    p2.extend(prompt(12, 51));
    let h = lane.submit(greedy(p2.clone(), 5)).unwrap();
    let out2 = drain(&h);
    assert_eq!(out2.events[0], Event::Started { cached_tokens: 16 });
    assert_eq!(out2.usage.cached_tokens, 16);
    assert_eq!(out2.tokens, oracle(&p2, 5, 64));
    let calls = log.snapshot();
    assert!(calls.iter().any(|c| matches!(c, Call::RestoreMark { stream, len: 16, .. } if *stream == h.id)));
    let chunks = log.chunks(h.id);
    assert_eq!(chunks[0].0, 16, "the pass starts at the mark");
    // The grid is anchored at the planned start; marks fall at 24 and 30.
    assert_eq!(chunks, vec![(16, 8), (24, 6)]);

    // The same prompt again: everything but the last row comes from the
    // cache (the mark at its end, cut back by a row: this backend rewinds).
    let h = lane.submit(greedy(p1.clone(), 3)).unwrap();
    let out3 = drain(&h);
    assert_eq!(out3.usage.cached_tokens, 19);
    assert_eq!(log.chunks(h.id), vec![(19, 1)]);
    assert_eq!(out3.tokens, out1.tokens);
    assert_eq!(lane.stats().cached_tokens, 35);
}

#[test]
fn warm_keeps_marks_for_later_prompts() {
    let lc = LaneConfig { chunk_tokens: 8, mark_every: 0, mark_prompt_end: false, ..LaneConfig::default() };
    let (lane, log) = lane(FakeConfig::default(), lc);
    let system = prompt(13, 60);
    let w = lane.warm(system.clone()).unwrap();
    let out = drain(&w);
    assert_eq!(out.reason, Some(FinishReason::Warmed));
    assert!(out.tokens.is_empty());
    assert!(prefills(&log.snapshot(), w.id).iter().all(|c| !c.2), "a warm feed asks for no logits");
    let mut p = system.clone();
    p.extend(prompt(5, 61));
    let out = drain(&lane.submit(greedy(p.clone(), 4)).unwrap());
    assert_eq!(out.usage.cached_tokens, 13);
    assert_eq!(out.tokens, oracle(&p, 4, 64));
    // Warming it again finds it all cached at once.
    let out = drain(&lane.warm(system).unwrap());
    assert_eq!(out.events[0], Event::Started { cached_tokens: 13 });
    assert_eq!(out.reason, Some(FinishReason::Warmed));
    // Without marks there is nothing to warm.
    let (plain, _) = lane_no_marks();
    assert!(matches!(plain.warm(vec![1, 2]), Err(SubmitError::Unsupported(_))));
}

fn lane_no_marks() -> (Lane, CallLog) {
    let mut fc = FakeConfig::default();
    fc.caps.supports_marks = false;
    lane(fc, LaneConfig::default())
}

#[test]
fn the_prefix_cache_is_bounded_and_drops_old_marks() {
    let lc = LaneConfig { chunk_tokens: 8, mark_every: 0, prefix_marks: 2, ..LaneConfig::default() };
    let (lane, log) = lane(FakeConfig::default(), lc);
    for i in 0..4 {
        drain(&lane.submit(greedy(prompt(10, 70 + i), 1)).unwrap());
    }
    let calls = log.snapshot();
    let kept: Vec<u64> = calls.iter().filter_map(|c| if let Call::KeepMark { mark, .. } = c { Some(*mark) } else { None }).collect();
    let dropped: Vec<u64> = calls.iter().filter_map(|c| if let Call::DropMark(m) = c { Some(*m) } else { None }).collect();
    assert_eq!(kept.len(), 4);
    assert_eq!(dropped, kept[..2].to_vec(), "oldest first");
    wait_until("the round to be published", || lane.stats().finished == 4);
    assert_eq!(lane.stats().marks, 2);
}

/// A fake that caches KV blocks itself, as attention-only models do.
fn block_cache() -> FakeConfig {
    let mut fc = FakeConfig::default();
    fc.caps.prefix_blocks = true;
    fc
}

/// A fake whose state cannot be rewound, as hybrid models' (marks only).
fn recurrent() -> FakeConfig {
    let mut fc = FakeConfig::default();
    fc.caps.supports_rewind = false;
    fc
}

fn attached(log: &CallLog, stream: u64) -> Vec<(u64, usize, usize)> {
    log.snapshot()
        .iter()
        .filter_map(|c| if let Call::AttachPrefix { stream: s, salt, max_len, len } = c { (*s == stream).then_some((*salt, *max_len, *len)) } else { None })
        .collect()
}

fn kept(log: &CallLog) -> Vec<usize> {
    log.snapshot().iter().filter_map(|c| if let Call::KeepMark { len, .. } = c { Some(*len) } else { None }).collect()
}

/// `doc` followed by a question of its own for each seed.
fn questions(doc: &[u32], seeds: std::ops::Range<u32>) -> Vec<Vec<u32>> {
    seeds
        .map(|i| {
            let mut p = doc.to_vec();
            p.extend(prompt(6, i));
            p
        })
        .collect()
}

/// Submit `prompts` while the lane is stopped in a backend call, so it
/// takes them all in one intake, as a burst of clients sent together.
fn burst(lane: &Lane, hold: &Arc<Mutex<()>>, prompts: &[Vec<u32>]) -> Vec<braid_engine::StreamHandle> {
    let guard = hold.lock().unwrap();
    // A stream decodes, so the lane reaches its next round at once and stops there.
    std::thread::sleep(std::time::Duration::from_millis(50));
    let handles = prompts.iter().map(|p| lane.submit(greedy(p.clone(), 3)).unwrap()).collect();
    drop(guard);
    handles
}

#[test]
fn a_backend_block_cache_serves_the_same_prompt_but_its_last_row() {
    let (lane, log) = lane(block_cache(), LaneConfig { chunk_tokens: 8, ..LaneConfig::default() });
    let p = prompt(21, 80);
    let first = drain(&lane.submit(greedy(p.clone(), 4)).unwrap());
    assert_eq!(first.usage.cached_tokens, 0);
    let h = lane.submit(greedy(p.clone(), 4)).unwrap();
    let second = drain(&h);
    assert_eq!(second.events[0], Event::Started { cached_tokens: 20 });
    assert_eq!(second.usage.cached_tokens, 20);
    assert_eq!(attached(&log, h.id), vec![(0, 20, 20)]);
    assert_eq!(log.chunks(h.id), vec![(20, 1)], "only the last row runs");
    assert_eq!(second.tokens, first.tokens);
    assert_eq!(second.tokens, oracle(&p, 4, 64));
    assert!(kept(&log).is_empty(), "the backend's blocks make marks redundant");
    wait_until("both streams to be counted", || lane.stats().finished == 2);
    let st = lane.stats();
    assert_eq!((st.prefix_query_tokens, st.cached_tokens), (42, 20));
    // Both streams are gone; their blocks stay, cached but not in use.
    assert_eq!(st.fill.blocks_used, 0);
    assert!(st.fill.blocks_cached >= 5, "{:?}", st.fill);
}

// A document sent with three questions at once: the second and third
// passes begin after the first, and start from its blocks (the document's
// last, partly shared block copied).
#[test]
fn questions_sent_together_share_the_first_ones_document() {
    for fc in [block_cache(), recurrent()] {
        let hold = Arc::new(Mutex::new(()));
        let (lane, log) = lane(FakeConfig { hold: Some(hold.clone()), ..fc.clone() }, LaneConfig { chunk_tokens: 8, ..LaneConfig::default() });
        // A stream decoding, for the lane to be stopped in its round.
        let bg = decoding(&lane, prompt(3, 5), LONG);
        let doc = prompt(30, 81);
        let qs = questions(&doc, 90..93);
        let hs = burst(&lane, &hold, &qs);
        let outs: Vec<_> = hs.iter().map(drain).collect();
        let cached: Vec<usize> = outs.iter().map(|o| o.usage.cached_tokens).collect();
        // Blocks match to the token; marks fall on block boundaries.
        let hit = if fc.caps.prefix_blocks { 30 } else { 28 };
        assert_eq!(cached, vec![0, hit, hit], "{fc:?}");
        for (o, q) in outs.iter().zip(&qs) {
            assert_eq!(o.tokens, oracle(q, 3, 64));
        }
        let calls = log.snapshot();
        let last_a = calls.iter().rposition(|c| c.chunk().is_some_and(|c| c.stream == hs[0].id)).unwrap();
        let open_b = calls.iter().position(|c| *c == Call::Open(hs[1].id)).unwrap();
        let first_b = calls.iter().position(|c| c.chunk().is_some_and(|c| c.stream == hs[1].id)).unwrap();
        assert!(open_b < last_a && last_a < first_b, "B is admitted during A's pass and begins after it");
        bg.cancel();
    }
}

#[test]
fn a_salt_keeps_prompts_apart() {
    for fc in [block_cache(), recurrent()] {
        let (lane, _log) = lane(fc.clone(), LaneConfig { chunk_tokens: 8, ..LaneConfig::default() });
        let p = prompt(21, 82);
        let salted = |salt: u64| Request { cache_salt: salt, ..greedy(p.clone(), 2) };
        assert_eq!(drain(&lane.submit(salted(1)).unwrap()).usage.cached_tokens, 0);
        assert_eq!(drain(&lane.submit(salted(2)).unwrap()).usage.cached_tokens, 0, "{fc:?}: another salt sees nothing");
        assert_eq!(drain(&lane.submit(salted(0)).unwrap()).usage.cached_tokens, 0, "{fc:?}: nor does the shared cache");
        assert_eq!(drain(&lane.submit(salted(1)).unwrap()).usage.cached_tokens, 20, "{fc:?}: the same salt hits");
    }
}

// A small pool: cached blocks count as free at admission, are evicted only
// when a stream needs their room, and the least recently used go first.
#[test]
fn cached_blocks_give_way_least_recently_used_first() {
    let fc = FakeConfig { blocks_total: 16, ..block_cache() };
    let (lane, _log) = lane(fc, LaneConfig { chunk_tokens: 8, ..LaneConfig::default() });
    let (a, b, c) = (prompt(20, 83), prompt(20, 84), prompt(32, 85));
    for p in [&a, &b] {
        assert_eq!(drain(&lane.submit(greedy(p.clone(), 1)).unwrap()).reason, Some(FinishReason::Length));
    }
    wait_until("the lane to publish", || lane.stats().finished == 2);
    let fill = lane.stats().fill;
    assert_eq!((fill.blocks_used, fill.blocks_cached, fill.blocks_evicted), (0, 10, 0), "nothing evicted while blocks are free");
    // C needs 8 blocks and finds 6 free: A's (the older) give way.
    assert_eq!(drain(&lane.submit(greedy(c.clone(), 1)).unwrap()).reason, Some(FinishReason::Length));
    wait_until("the lane to publish", || lane.stats().finished == 3);
    assert!(lane.stats().fill.blocks_evicted >= 2);
    assert_eq!(drain(&lane.submit(greedy(b.clone(), 1)).unwrap()).usage.cached_tokens, 19, "B was used more recently");
    let again = drain(&lane.submit(greedy(a.clone(), 2)).unwrap());
    assert!(again.usage.cached_tokens < 19, "A lost blocks: {:?}", again.usage);
    assert_eq!(again.tokens, oracle(&a, 2, 64));
}

// Where the state cannot be rewound, the prompt-end mark sits a row short
// of the end, so the same prompt again runs only its last row; a hinted
// boundary (a system turn's end) gets a mark of its own.
#[test]
fn marks_for_recurrent_state_fall_where_they_pay() {
    let (lane, log) = lane(recurrent(), LaneConfig { chunk_tokens: 8, mark_every: 0, ..LaneConfig::default() });
    let p = prompt(21, 86);
    let first = drain(&lane.submit(Request { prefix_hint: Some(13), ..greedy(p.clone(), 3) }).unwrap());
    assert_eq!(kept(&log), vec![13, 20]);
    let h = lane.submit(greedy(p.clone(), 3)).unwrap();
    let again = drain(&h);
    assert_eq!(again.usage.cached_tokens, 20);
    assert_eq!(log.chunks(h.id), vec![(20, 1)]);
    assert_eq!(again.tokens, first.tokens);
    // Another question after the same 13-token system turn.
    let mut q = p[..13].to_vec();
    q.extend(prompt(9, 87));
    let other = drain(&lane.submit(greedy(q.clone(), 3)).unwrap());
    assert_eq!(other.usage.cached_tokens, 13);
    assert_eq!(other.tokens, oracle(&q, 3, 64));
    // Prompts that shared 16 tokens (block-aligned) leave a mark there for the next.
    let mut r = p[..17].to_vec();
    r.extend(prompt(5, 88));
    drain(&lane.submit(greedy(r.clone(), 1)).unwrap());
    assert!(kept(&log).contains(&16), "{:?}", kept(&log));
}

#[test]
fn warming_a_backend_block_cache_keeps_the_whole_prefix() {
    let (lane, log) = lane(block_cache(), LaneConfig { chunk_tokens: 8, ..LaneConfig::default() });
    let system = prompt(13, 89);
    let w = lane.warm(system.clone()).unwrap();
    assert_eq!(drain(&w).reason, Some(FinishReason::Warmed));
    assert_eq!(attached(&log, w.id), vec![(0, 13, 0)]);
    let mut p = system.clone();
    p.extend(prompt(5, 90));
    let out = drain(&lane.submit(greedy(p.clone(), 4)).unwrap());
    assert_eq!(out.usage.cached_tokens, 13, "full blocks and the warm feed's tail");
    assert_eq!(out.tokens, oracle(&p, 4, 64));
}

// The backend's mark slots run out before the index's capacity: a mark it
// could not keep makes the oldest give way, so new prompts still get theirs.
#[test]
fn marks_keep_coming_when_the_backend_runs_out_of_slots() {
    let fc = FakeConfig { max_marks: Some(2), ..recurrent() };
    let (lane, log) = lane(fc, LaneConfig { chunk_tokens: 8, mark_every: 0, prefix_marks: 8, ..LaneConfig::default() });
    let ps: Vec<Vec<u32>> = (0..4).map(|i| prompt(9, 100 + i)).collect();
    for p in &ps {
        drain(&lane.submit(greedy(p.clone(), 1)).unwrap());
    }
    assert_eq!(kept(&log).len(), 3, "the third mark failed and made room for the fourth");
    assert_eq!(drain(&lane.submit(greedy(ps[3].clone(), 1)).unwrap()).usage.cached_tokens, 8);
    assert_eq!(drain(&lane.submit(greedy(ps[0].clone(), 1)).unwrap()).usage.cached_tokens, 0, "the oldest gave way");
}
