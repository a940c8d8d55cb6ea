//! Guided streams: every token within its mask whatever the backend could
//! pick, drafts verified within masks and still lossless, a complete
//! grammar ends the stream, and a slow mask delays only its own stream.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_engine::fake::{fake_allows, fake_guided, fake_next, Call, FakeConfig, FakeGrammar};
use braid_engine::{Event, FinishReason, Guide, Lane, LaneConfig, Pick, Picks, Request, SamplingParams, StreamHandle};
use common::*;

const EVERY: usize = 3;

fn grammar() -> FakeGrammar {
    FakeGrammar { vocab: 64, every: EVERY, ..FakeGrammar::default() }
}

fn guided(prompt: Vec<u32>, max_tokens: usize, g: &FakeGrammar) -> Request {
    let mut r = greedy(prompt, max_tokens);
    r.sampling.guide = Some(Guide::new(g.clone()));
    r
}

/// How many of `tokens` (greedy and guided, after `prompt`) were not the
/// row's argmax: the grammar refused that.
fn refusals(prompt: &[u32], tokens: &[u32]) -> usize {
    let seq = [prompt, tokens].concat();
    (0..tokens.len()).filter(|&n| !fake_allows(EVERY, n, fake_next(seq[prompt.len() + n - 1], prompt.len() + n, 64))).count()
}

/// A fake whose decode rounds take ~1 ms and that picks argmax and top-k
/// on the device (asking for guided rows' masks when it picks), as CUDA.
fn on_device() -> FakeConfig {
    let mut fc = slow();
    fc.caps.picks = Picks { argmax: true, top_k: 8, ..Picks::default() };
    fc
}

/// A lane on a device-picking fake whose pick asks for its masks as soon
/// as it is called (a round launched ahead), with one mask worker; and the
/// count of rounds picked without a guided row's mask.
fn asked_at_once() -> (Lane, Arc<AtomicUsize>) {
    let mut fc = on_device();
    fc.masks_first = true;
    let missing = fc.masks_missing.clone();
    (lane(fc, LaneConfig { mask_threads: 1, ..no_marks() }).0, missing)
}

fn assert_within(tokens: &[u32]) {
    for (n, &t) in tokens.iter().enumerate() {
        assert!(fake_allows(EVERY, n, t), "token {t} at {n} is outside its mask");
    }
}

#[test]
fn a_guided_stream_samples_within_its_mask() {
    let (lane, _log) = lane(FakeConfig::default(), no_marks());
    let g = grammar();
    let p = prompt(7, 50);
    let out = drain(&lane.submit(guided(p.clone(), 30, &g)).unwrap());
    assert_eq!(out.tokens, fake_guided(&p, 30, 64, EVERY));
    assert_ne!(out.tokens, oracle(&p, 30, 64), "the grammar should change the greedy output");
    // Greedy on a backend that picks nothing: each argmax is checked, and a
    // mask computed only where the grammar refused it.
    let refused = refusals(&p, &out.tokens);
    assert!(refused > 0 && refused < 30, "{refused} of 30 refused: the test proves nothing");
    assert_eq!(g.masks.load(Ordering::SeqCst), refused, "masks computed");
    assert!(g.checks.load(Ordering::SeqCst) >= 30);
    wait_until("the check count", || lane.stats().guided_checks == (30 - refused) as u64);
    // Sampled at a temperature, with logprobs: still within the mask, each
    // mask computed ahead.
    let mut r = guided(prompt(5, 51), 60, &g);
    r.sampling = SamplingParams { temperature: 1.5, seed: Some(4), guide: r.sampling.guide, ..SamplingParams::default() };
    r.logprobs = Some(2);
    let out = drain(&lane.submit(r).unwrap());
    assert_eq!(out.tokens.len(), 60);
    assert_within(&out.tokens);
    assert!(g.masks.load(Ordering::SeqCst) >= refused + 60);
    // The lane publishes its counters after the round that ended the stream.
    wait_until("the mask count", || lane.stats().guided_masks >= (refused + 60) as u64);
}

#[test]
fn a_complete_grammar_ends_the_stream_with_stop() {
    let (lane, _log) = lane(FakeConfig::default(), no_marks());
    let g = FakeGrammar { length: Some(5), ..grammar() };
    let p = prompt(4, 52);
    let out = drain(&lane.submit(guided(p.clone(), 50, &g)).unwrap());
    assert_eq!(out.reason, Some(FinishReason::Stop));
    assert_eq!(out.tokens, fake_guided(&p, 5, 64, EVERY));
    assert_eq!(out.usage.completion_tokens, 5);
}

// A guided stream sampled among its top k has its candidates found where
// the backend finds top-k, within masks the backend asks for when it
// picks: its rounds stay top-k rounds, and its tokens (seeded) are those
// of the host's masked sampling over whole rows. A mask slower than the
// round turns that round into logits: still the same tokens.
#[test]
fn sampled_guided_rows_take_their_top_k_within_their_masks_on_the_device() {
    let run = |picks: Picks, delay: Option<Duration>| {
        let mut fc = slow();
        fc.caps.picks = picks;
        let (lane, log) = lane(fc, LaneConfig { mask_threads: 1, ..no_marks() });
        let g = FakeGrammar { delay, ..grammar() };
        let (pa, pb) = (prompt(3, 53), prompt(6, 54));
        let a = decoding(&lane, pa.clone(), 80);
        let top5 = SamplingParams { temperature: 0.8, top_k: 5, top_p: 0.9, seed: Some(3), guide: Some(Guide::new(g.clone())), ..SamplingParams::default() };
        let b = lane.submit(Request { sampling: top5, ..greedy(pb.clone(), 24) }).unwrap();
        let out_b = drain(&b);
        assert_within(&out_b.tokens);
        assert_eq!(out_b.tokens.len(), 24);
        assert_eq!(drain(&a).tokens, oracle(&pa, 80, 64)[1..]);
        let with_b: Vec<Pick> = (log.snapshot().iter())
            .filter_map(|c| match c {
                Call::Round { rows, pick, .. } if rows.iter().any(|r| r.0 == b.id) => Some(*pick),
                _ => None,
            })
            .collect();
        (out_b.tokens, with_b, lane.stats().mask_waits)
    };
    // The host's: a backend that picks nothing gets every row as logits.
    let (host, rounds, _) = run(Picks { argmax: false, top_k: 0, ..Picks::default() }, None);
    assert!(rounds.iter().all(|&p| p == Pick::Logits));
    assert_ne!(host, fake_guided(&prompt(6, 54), 24, 64, EVERY), "sampling at 0.8 should leave the greedy path");
    for delay in [None, Some(Duration::from_millis(5))] {
        let (tokens, rounds, waits) = run(on_device().caps.picks, delay);
        assert_eq!(tokens, host, "delay {delay:?}");
        assert!(rounds.len() >= 23, "{} rounds with the guided stream", rounds.len());
        assert!(rounds.iter().all(|&p| p == Pick::TopK(5)), "a round with the guided stream asked for {rounds:?}");
        if delay.is_some() {
            assert!(waits > 0, "the masks were never late: the fallback went untested");
        }
    }
}

// A greedy guided stream's rows are picked on the device, within masks the
// backend asks for when it picks: its rounds stay argmax rounds, beside a
// free stream, and the tokens are those of the host's masked sampling. A
// mask slower than the round turns that round into logits (the stream
// waits for it): still the same tokens, and the free stream keeps going.
#[test]
fn greedy_guided_rows_are_picked_within_their_masks_on_the_device() {
    for delay in [None, Some(Duration::from_millis(5))] {
        let (lane, log) = lane(on_device(), LaneConfig { mask_threads: 1, ..no_marks() });
        let g = FakeGrammar { delay, ..grammar() };
        let (pa, pb) = (prompt(3, 58), prompt(6, 59));
        let a = decoding(&lane, pa.clone(), 120);
        let b = lane.submit(guided(pb.clone(), 30, &g)).unwrap();
        assert_eq!(drain(&b).tokens, fake_guided(&pb, 30, 64, EVERY), "delay {delay:?}");
        assert_eq!(drain(&a).tokens, oracle(&pa, 120, 64)[1..]);
        let with_b: Vec<Pick> = (log.snapshot().iter())
            .filter_map(|c| match c {
                Call::Round { rows, pick, .. } if rows.iter().any(|r| r.0 == b.id) => Some(*pick),
                _ => None,
            })
            .collect();
        assert!(with_b.len() >= 29, "{} rounds with the guided stream", with_b.len());
        assert!(with_b.iter().all(|&p| p == Pick::Argmax), "a round with the guided stream asked for {with_b:?}");
        let waits = lane.stats().mask_waits;
        if delay.is_some() {
            assert!(waits > 0, "the masks were never late: the fallback went untested");
        } else {
            assert!(waits <= 3, "{waits} waits for masks while rounds take a ms");
        }
    }
}

// A greedy stream picked on the device whose masks come late (5 ms against
// ~1 ms rounds) goes on with each token its grammar takes, checked on the
// lane's thread by a copy of its constraint: it sits out rounds only for
// the tokens its grammar refuses, and its tokens are still the masked
// argmax.
#[test]
fn a_late_mask_holds_back_only_a_refused_token() {
    let (lane, _log) = lane(on_device(), LaneConfig { mask_threads: 1, ..no_marks() });
    let g = FakeGrammar { delay: Some(Duration::from_millis(5)), ..grammar() };
    let p = prompt(6, 61);
    let out = drain(&lane.submit(guided(p.clone(), 30, &g)).unwrap()).tokens;
    assert_eq!(out, fake_guided(&p, 30, 64, EVERY));
    let refused = refusals(&p, &out);
    assert!(refused > 0 && refused < 30, "{refused} of 30 refused: the test proves nothing");
    wait_until("the counts", || lane.stats().guided_checks > 0);
    let st = lane.stats();
    assert!(st.guided_checks as usize >= 30 - refused - 3, "{} tokens taken on a check, {refused} of 30 refused", st.guided_checks);
    assert!(st.mask_waits as usize <= refused, "{} waits for masks, {refused} refused", st.mask_waits);
}

// After a late mask the checker takes the stream on, and its constraint,
// back behind it, must catch up and not stay a token behind (every round
// after would return logits): with one mask in ten slow (2 ms against
// ~1 ms rounds, the rest 0.1 ms), the rounds whose masks were missing are
// a few after each slow one (22 of 120 here; 111 when it stayed behind).
// The pick asks at once (a round launched ahead), so a mask sent a token
// late is always missing.
#[test]
fn after_a_late_mask_the_masks_apply_on_the_device_again() {
    let (lane, missing) = asked_at_once();
    // A grammar that refuses few argmaxes: a refused one waits for its
    // mask, and waiting would catch the constraint up anyway.
    let g =
        FakeGrammar { vocab: 64, every: 61, delay: Some(Duration::from_micros(100)), slow_every: 10, slow: Duration::from_millis(2), ..FakeGrammar::default() };
    let p = prompt(6, 63);
    let out = drain(&lane.submit(guided(p.clone(), 120, &g)).unwrap()).tokens;
    assert_eq!(out, fake_guided(&p, 120, 64, 61));
    let (missing, slow) = (missing.load(Ordering::SeqCst), g.masks.load(Ordering::SeqCst) / 10);
    assert!(slow >= 3, "{slow} slow masks: the test proves nothing");
    assert!(missing <= slow * 5, "{missing} of 120 rounds without their masks, {slow} masks slow");
}

// A backend that picks as soon as it is called (a GPU's round launched
// ahead) asks for the mask of the token just committed while its worker is
// still at it: the pick waits a little for the mask instead of taking the
// round's logits, which ends launching ahead.
#[test]
fn a_pick_asked_at_once_waits_a_little_for_a_mask_on_its_way() {
    let (lane, missing) = asked_at_once();
    // Each mask takes 0.2 ms: less than the wait, more than the lane takes
    // from a commit to the next round.
    let g = FakeGrammar { delay: Some(Duration::from_micros(200)), ..grammar() };
    let pb = prompt(6, 60);
    let b = lane.submit(guided(pb.clone(), 40, &g)).unwrap();
    assert_eq!(drain(&b).tokens, fake_guided(&pb, 40, 64, EVERY));
    let missing = missing.load(Ordering::SeqCst);
    // Without the wait nearly every round does (39 of 40); a loaded
    // machine may keep the worker from its mask past the wait now and then
    // (11 of 40 once, beside the whole suite on two cores).
    assert!(missing <= 20, "{missing} of 40 rounds picked without their masks");
}

// Drafts are verified within masks (the worker computes one per draft
// token): the tokens are those without a drafter, greedy and seeded, and
// drafts the grammar forbids are cut before they run.
#[test]
fn guided_drafting_is_lossless() {
    for seed in [None, Some(7)] {
        let run = |drafter: bool| {
            let g = grammar();
            let (lane, log) = if drafter { lane_with_drafter(FakeConfig::default(), no_marks(), 5) } else { lane(FakeConfig::default(), no_marks()) };
            let hs: Vec<StreamHandle> = (0..3)
                .map(|i| {
                    let mut r = guided(prompt(4 + i * 3, 55 + i as u32), 40, &g);
                    if let Some(s) = seed {
                        r.sampling = SamplingParams { temperature: 0.7, seed: Some(s + i as u64), ..r.sampling };
                    }
                    lane.submit(r).unwrap()
                })
                .collect();
            let outs: Vec<Vec<u32>> = hs.iter().map(|h| drain(h).tokens).collect();
            (outs, lane.stats(), log)
        };
        let (plain, _, _) = run(false);
        let (drafted, stats, log) = run(true);
        assert_eq!(plain, drafted, "seed {seed:?}");
        for (i, toks) in plain.iter().enumerate() {
            assert_within(toks);
            if seed.is_none() {
                assert_eq!(*toks, fake_guided(&prompt(4 + i * 3, 55 + i as u32), 40, 64, EVERY));
            }
        }
        assert!(stats.draft_accepted > 0 && stats.draft_accepted < stats.draft_proposed, "{stats:?}");
        assert!(log.snapshot().iter().any(|c| c.rows().iter().any(|r| r.1.len() > 1)), "no round verified a draft");
    }
}

// Picked on the device, with masks now and then late and drafts to
// verify: a late round's draft rows wait for their masks, a lone row may
// go on by its checker, and the tokens are still the masked argmax's,
// drafted or not.
#[test]
fn guided_drafting_with_late_masks_on_the_device_is_lossless() {
    let run = |drafter: bool| {
        let fc = on_device();
        let lc = LaneConfig { mask_threads: 1, draft_max_streams: 4, ..no_marks() };
        let (lane, _log) = if drafter { lane_with_drafter(fc, lc, 5) } else { lane(fc, lc) };
        let g = FakeGrammar { delay: Some(Duration::from_micros(100)), slow_every: 4, slow: Duration::from_millis(3), ..grammar() };
        let hs: Vec<StreamHandle> = (0..2).map(|i| lane.submit(guided(prompt(5 + i, 64 + i as u32), 40, &g)).unwrap()).collect();
        let outs: Vec<Vec<u32>> = hs.iter().map(|h| drain(h).tokens).collect();
        (outs, lane.stats())
    };
    let (plain, _) = run(false);
    let (drafted, stats) = run(true);
    assert_eq!(plain, drafted);
    for (i, toks) in plain.iter().enumerate() {
        assert_eq!(*toks, fake_guided(&prompt(5 + i, 64 + i as u32), 40, 64, EVERY));
    }
    assert!(stats.draft_accepted > 0, "{stats:?}");
}

// A mask slower than a round holds back its own stream only: the other
// stream's tokens keep their pace while the guided one waits for masks,
// and the guided stream's tokens are still right.
#[test]
fn a_slow_mask_never_stalls_the_other_streams() {
    let (lane, _log) = lane(slow(), LaneConfig { mask_threads: 1, ..no_marks() });
    let g = FakeGrammar { delay: Some(Duration::from_millis(40)), ..grammar() };
    let pa = prompt(3, 56);
    let a = decoding(&lane, pa.clone(), LONG);
    let pb = prompt(5, 57);
    // Greedy on a backend that picks nothing: only the tokens its grammar
    // refuses wait for a mask (about one in three).
    let b = lane.submit(guided(pb.clone(), 24, &g)).unwrap();
    let (mut gaps, mut last, mut b_done) = (Vec::new(), Instant::now(), false);
    let mut out_b = Vec::new();
    while !b_done {
        if let Ok(Event::Token { .. }) = a.recv_timeout(WAIT) {
            gaps.push(last.elapsed());
            last = Instant::now();
        }
        while let Ok(ev) = b.try_recv() {
            match ev {
                Event::Token { id, .. } => out_b.push(id),
                Event::Finished { .. } => b_done = true,
                Event::Error(e) => panic!("{e}"),
                _ => {}
            }
        }
    }
    a.cancel();
    assert_eq!(out_b, fake_guided(&pb, 24, 64, EVERY));
    let worst = gaps.iter().max().unwrap();
    // Rounds take ~1 ms; a mask takes 40.
    assert!(*worst < Duration::from_millis(25), "the unguided stream waited {worst:?} for a mask");
    assert!(gaps.len() > 100, "only {} tokens while the guided stream ran", gaps.len());
    wait_until("a wait for masks (else the test proves nothing)", || lane.stats().mask_waits > 0);
}

/// A grammar whose constraints break at their `at`-th mask: they panic (a
/// bug in a grammar library, say), or fail (past its limits).
#[derive(Clone)]
struct Breaking {
    at: usize,
    panics: bool,
}

struct BreakingConstraint {
    inner: Box<dyn braid_engine::Constraint>,
    how: Breaking,
    masks: usize,
}

impl braid_engine::Grammar for Breaking {
    fn start(&self) -> Result<Box<dyn braid_engine::Constraint>, String> {
        Ok(Box::new(BreakingConstraint { inner: braid_engine::Grammar::start(&grammar())?, how: self.clone(), masks: 0 }))
    }
}

impl braid_engine::Constraint for BreakingConstraint {
    fn mask(&mut self) -> Result<braid_engine::TokenMask, String> {
        self.masks += 1;
        match self.how {
            Breaking { at, panics: true } if self.masks >= at => panic!("mask {} broke", self.masks),
            Breaking { at, panics: false } if self.masks >= at => Err("too many items".into()),
            _ => self.inner.mask(),
        }
    }
    // By its masks, so a check may break too (on the lane's thread).
    fn allows(&mut self, token: u32) -> Result<bool, String> {
        self.mask().map(|m| m.allows(token))
    }
    fn commit(&mut self, token: u32) -> Result<bool, String> {
        self.inner.commit(token)
    }
    fn rollback(&mut self, tokens: usize) -> Result<(), String> {
        self.inner.rollback(tokens)
    }
}

// A grammar that fails is the request's fault, told apart from the
// server's (`Event::GrammarError`), whether its masks come from a worker
// (sampled) or its tokens are checked on the lane's thread (greedy).
#[test]
fn a_failing_grammar_is_the_requests_error() {
    let (lane, _log) = lane(FakeConfig::default(), no_marks());
    for temperature in [0.0, 0.9] {
        let mut r = greedy(prompt(4, 62), 30);
        r.sampling = SamplingParams { temperature, seed: Some(1), guide: Some(Guide::new(Breaking { at: 4, panics: false })), ..SamplingParams::default() };
        let out = drain(&lane.submit(r).unwrap());
        assert!(out.grammar_failed && out.error.as_deref().is_some_and(|e| e.contains("too many items")), "temperature {temperature}: {:?}", out.error);
        assert!(out.tokens.len() < 4, "{} tokens", out.tokens.len());
    }
    assert!(lane.alive());
}

#[test]
fn a_grammar_that_panics_fails_its_stream_and_the_workers_serve_on() {
    // One mask worker: the panic must not take it away from the next stream.
    let (lane, _log) = lane(FakeConfig::default(), LaneConfig { mask_threads: 1, ..no_marks() });
    // Sampled: its masks are computed ahead, on the worker.
    let mut r = greedy(prompt(4, 58), 30);
    r.sampling = SamplingParams { temperature: 0.9, seed: Some(2), guide: Some(Guide::new(Breaking { at: 5, panics: true })), ..SamplingParams::default() };
    let out = drain(&lane.submit(r).unwrap());
    assert!(out.error.as_deref().is_some_and(|e| e.contains("panicked") && e.contains("mask 5 broke")), "{:?}", out.error);
    assert!(!out.grammar_failed, "a grammar library's panic is the server's error, not the request's");
    assert_eq!(out.tokens.len(), 4, "the tokens before the broken mask came");
    // Greedy: it checks its tokens on the lane's thread (this grammar by
    // its masks), where the panic fails the stream, not the lane.
    let mut r = greedy(prompt(4, 58), 30);
    r.sampling.guide = Some(Guide::new(Breaking { at: 5, panics: true }));
    let out = drain(&lane.submit(r).unwrap());
    assert!(out.error.as_deref().is_some_and(|e| e.contains("panicked") && e.contains("mask 5 broke")), "{:?}", out.error);
    assert!(out.tokens.len() < 5, "{} tokens", out.tokens.len());
    let p = prompt(7, 59);
    let out = drain(&lane.submit(guided(p.clone(), 20, &grammar())).unwrap());
    assert_eq!((out.reason, out.error), (Some(FinishReason::Length), None));
    assert_eq!(out.tokens, fake_guided(&p, 20, 64, EVERY));
    assert!(lane.alive());
    assert_eq!(lane.stats().lane_failures, 0);
}
