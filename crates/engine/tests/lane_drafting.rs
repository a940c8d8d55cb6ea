//! Speculative drafting in a lane: lossless under every pick, the drafter
//! absorbs every chunk and every kept row in order (also when a chunk and
//! drafts share a round), and a mark is kept only after the absorb.

mod common;

use std::sync::Arc;

use braid_engine::fake::{Call, CallLog, FakeBackend, FakeConfig, FakeText};
use braid_engine::{DraftModel, DraftModelConfig, Lane, LaneConfig, Pick, Picks, Request, SamplingParams, StreamHandle};
use common::*;

// 5. The drafter absorbs every chunk (and every kept decode row), and a
//    mark reached by a chunk is kept only after the drafter's absorb.
#[test]
fn the_drafter_absorbs_every_chunk_before_a_mark_is_kept() {
    let lc = LaneConfig { chunk_tokens: 4, mark_every: 8, ..LaneConfig::default() };
    let (lane, log) = lane_with_drafter(FakeConfig::default(), lc, 3);
    let p = prompt(22, 8);
    let h = lane.submit(greedy(p.clone(), 12)).unwrap();
    let out = drain(&h);
    assert_eq!(out.tokens, oracle(&p, 12, 64));
    let calls: Vec<Call> = log.snapshot();
    let chunk_of = |c: &Call| c.chunk().filter(|c| c.stream == h.id).map(|c| (c.start, c.tokens.len()));
    let mine: Vec<&Call> = calls
        .iter()
        .filter(|c| match c {
            Call::Absorb { stream, .. } | Call::KeepMark { stream, .. } => *stream == h.id,
            _ => chunk_of(c).is_some() || c.decodes(h.id),
        })
        .collect();
    let mut marks = Vec::new();
    for (i, c) in mine.iter().enumerate() {
        if let Some((_, rows)) = chunk_of(c) {
            assert_eq!(mine.get(i + 1), Some(&&Call::Absorb { stream: h.id, rows }), "chunk not absorbed next");
        } else if let Call::KeepMark { len, .. } = c {
            marks.push(*len);
            assert!(matches!(mine[i - 1], Call::Absorb { .. }), "mark kept before the absorb");
            assert_eq!(chunk_of(mine[i - 2]).map(|(start, rows)| start + rows), Some(*len));
        } else if c.decodes(h.id) {
            assert!(matches!(mine.get(i + 1), Some(Call::Absorb { .. })) || i + 1 == mine.len(), "decode round not absorbed");
        }
    }
    assert_eq!(marks, vec![8, 16, 22]);
}

// Drafting is lossless: the same tokens with a drafter that is sometimes
// right as without one, greedy and seeded.
#[test]
fn drafting_is_lossless() {
    let requests = |seed: Option<u64>| -> Vec<Request> {
        (0..3)
            .map(|i| Request {
                sampling: match seed {
                    None => SamplingParams::greedy(),
                    Some(s) => SamplingParams { temperature: 0.7, seed: Some(s + i), ..Default::default() },
                },
                ..greedy(prompt(6 + i as usize * 5, 30 + i as u32), 40)
            })
            .collect()
    };
    for seed in [None, Some(100)] {
        let run = |drafter: bool| {
            let (lane, log) = if drafter { lane_with_drafter(FakeConfig::default(), no_marks(), 3) } else { lane(FakeConfig::default(), no_marks()) };
            let hs: Vec<StreamHandle> = requests(seed).into_iter().map(|r| lane.submit(r).unwrap()).collect();
            let outs: Vec<Vec<u32>> = hs.iter().map(|h| drain(h).tokens).collect();
            (outs, lane.stats(), log)
        };
        let (plain, plain_stats, _) = run(false);
        let (drafted, stats, log) = run(true);
        assert_eq!(plain, drafted, "seed {seed:?}");
        if seed.is_none() {
            for (i, r) in requests(None).iter().enumerate() {
                assert_eq!(plain[i], oracle(&r.prompt, 40, 64));
            }
        }
        assert!(stats.draft_accepted > 0, "the drafter was never right");
        assert!(stats.draft_accepted < stats.draft_proposed, "the drafter was never wrong");
        assert!(log.snapshot().iter().any(|c| matches!(c, Call::Rewind { .. })));
        // Verified drafts mean fewer rounds for the same tokens.
        assert!(stats.decode_rounds < plain_stats.decode_rounds);
    }
}

/// `reqs` through a lane on a fake of `fc`, with a drafter wrong every
/// `wrong_every` positions (0: never) or none: each stream's tokens, the
/// lane's stats and the call log.
fn run_requests(fc: FakeConfig, wrong_every: Option<usize>, reqs: Vec<Request>) -> (Vec<Vec<u32>>, braid_engine::LaneStats, CallLog) {
    let (lane, log) = match wrong_every {
        Some(w) => lane_with_drafter(fc, no_marks(), w),
        None => lane(fc, no_marks()),
    };
    let hs: Vec<StreamHandle> = reqs.into_iter().map(|r| lane.submit(r).unwrap()).collect();
    let outs: Vec<Vec<u32>> = hs.iter().map(|h| drain(h).tokens).collect();
    (outs, lane.stats(), log)
}

// Drafts ride in every pick: verified from the backend's argmax, from its
// top-k candidates (the same token and the same random draw as sampling
// the whole row) or from logits, and the tokens are those of a lane with
// neither a drafter nor picks.
#[test]
fn drafting_is_lossless_under_every_pick() {
    // Greedy streams, or seeded ones that sample from their top 5.
    let set = |top5: bool| -> Vec<Request> {
        (0..3)
            .map(|i| Request {
                sampling: if top5 {
                    SamplingParams { temperature: 0.3, top_k: 5, seed: Some(200 + i as u64), ..Default::default() }
                } else {
                    SamplingParams::greedy()
                },
                ..greedy(prompt(5 + i * 4, 33 + i as u32), 30)
            })
            .collect()
    };
    // Penalised too: a draft's rows are each penalised with the drafts
    // before them counted, where the backend picks.
    let penalised = |top5: bool| -> Vec<Request> {
        let mut reqs = set(top5);
        for r in &mut reqs {
            r.sampling.repetition_penalty = 1.3;
            r.sampling.presence_penalty = 0.5;
            r.sampling.frequency_penalty = 0.2;
        }
        reqs
    };
    let argmax = Picks { argmax: true, top_k: 0, ..Picks::default() };
    let top_k = Picks { argmax: false, top_k: 8, ..Picks::default() };
    let with_penalties = |p: Picks| Picks { penalties: true, ..p };
    let cases = [
        (Picks::default(), false, false, Pick::Logits),
        (argmax, false, false, Pick::Argmax),
        (top_k, false, false, Pick::TopK(1)),
        (top_k, true, false, Pick::TopK(5)),
        (argmax, true, false, Pick::Logits),
        (with_penalties(argmax), false, true, Pick::Argmax),
        (with_penalties(top_k), true, true, Pick::TopK(5)),
        (argmax, false, true, Pick::Logits),
    ];
    for (picks, top5, penalties, want) in cases {
        let requests = || if penalties { penalised(top5) } else { set(top5) };
        let (plain, _, _) = run_requests(FakeConfig::default(), None, requests());
        let mut fc = FakeConfig::default();
        fc.caps.picks = picks;
        let (drafted, stats, log) = run_requests(fc, Some(3), requests());
        assert_eq!(plain, drafted, "{want:?}");
        assert!(stats.draft_accepted > 0, "{want:?}: the drafter was never right");
        assert!(stats.draft_accepted < stats.draft_proposed, "{want:?}: the drafter was never wrong");
        let rounds: Vec<Call> = log.snapshot().into_iter().filter(|c| !c.rows().is_empty()).collect();
        assert!(rounds.iter().all(|c| matches!(c, Call::Round { pick, .. } if *pick == want)), "{want:?}");
        assert!(rounds.iter().any(|c| c.rows().iter().any(|r| r.1.len() > 1)), "{want:?}: no round verified a draft");
    }
}

// A chunk and drafts share a round: decode rows with their drafts, then
// the chunk, in one forward. The decoding stream stays lossless, the
// drafter gets every feature row in order (the decode rows' first, the
// chunk's after them), and a mark reached by the chunk is kept after the
// drafter absorbed it.
#[test]
fn a_drafter_rides_mixed_rounds() {
    let lc = LaneConfig { chunk_tokens: 4, mark_every: 8, ..LaneConfig::default() };
    let (lane, log, feature_errors) = lane_with_checked_drafter(slow(), lc, 3);
    let (a, b) = beside_decoding(&lane, (prompt(3, 40), 60), (prompt(22, 41), 6));
    assert_eq!(*feature_errors.lock().unwrap(), 0, "the drafter was fed features out of place");
    let calls = log.snapshot();
    let mixed: Vec<usize> = chunk_calls(&calls, b.id).into_iter().filter(|&i| calls[i].rows().iter().any(|r| r.0 == a.id && r.1.len() > 1)).collect();
    assert!(!mixed.is_empty(), "no chunk of B shared a round with A's drafts");
    for &i in &chunk_calls(&calls, b.id) {
        let rows = calls[i].chunk().unwrap().tokens.len();
        let end = calls[i].chunk().unwrap().start + rows;
        // B's absorb follows its chunk (A's absorb of the same round may
        // come first), and B's mark, if the chunk reached one, after that.
        let next: Vec<&Call> =
            calls[i + 1..].iter().filter(|c| matches!(c, Call::Absorb { stream, .. } | Call::KeepMark { stream, .. } if *stream == b.id)).take(2).collect();
        assert_eq!(next.first(), Some(&&Call::Absorb { stream: b.id, rows }), "chunk at call {i} not absorbed next");
        let marked = calls.iter().any(|c| matches!(c, Call::KeepMark { stream, len, .. } if *stream == b.id && *len == end));
        if marked {
            assert!(matches!(next.get(1), Some(Call::KeepMark { len, .. }) if *len == end), "mark at {end} not kept right after the absorb");
        }
    }
    let kept: Vec<usize> =
        calls.iter().filter_map(|c| if let Call::KeepMark { stream, len, .. } = c { (*stream == b.id).then_some(*len) } else { None }).collect();
    assert_eq!(kept, vec![8, 16, 22]);
    assert!(lane.stats().fused_rounds >= mixed.len() as u64);
}

#[test]
fn no_drafting_without_rewind() {
    let mut fc = FakeConfig::default();
    fc.caps.supports_rewind = false;
    let (lane, log) = lane_with_drafter(fc, no_marks(), 3);
    let p = prompt(5, 40);
    let out = drain(&lane.submit(greedy(p.clone(), 10)).unwrap());
    assert_eq!(out.tokens, oracle(&p, 10, 64));
    assert!(log.snapshot().iter().all(|c| !matches!(c, Call::Propose { .. } | Call::Absorb { .. } | Call::Rewind { .. })));
    assert!(log.snapshot().iter().all(|c| !c.rows().iter().any(|r| r.1.len() > 1)));
}

// A request's own cap: `Some(0)` keeps the drafter off the stream (never
// opened, absorbed or asked), `Some(1)` verifies one draft a round; the
// output is the same either way.
#[test]
fn a_request_caps_or_turns_off_its_drafts() {
    let (lane, log) = lane_with_drafter(FakeConfig::default(), no_marks(), 0);
    let reqs: Vec<Request> =
        [None, Some(0), Some(1)].into_iter().enumerate().map(|(i, cap)| Request { draft_tokens: cap, ..greedy(prompt(7 + i, 40 + i as u32), 20) }).collect();
    let hs: Vec<StreamHandle> = reqs.iter().map(|r| lane.submit(r.clone()).unwrap()).collect();
    for (h, r) in hs.iter().zip(&reqs) {
        assert_eq!(drain(h).tokens, oracle(&r.prompt, 20, 64));
    }
    let calls = log.snapshot();
    let (free, off, one) = (hs[0].id, hs[1].id, hs[2].id);
    let most = |id: u64| calls.iter().flat_map(|c| c.rows().iter().filter(|r| r.0 == id).map(|r| r.1.len() - 1)).max().unwrap_or(0);
    assert!(most(free) > 1, "the uncapped stream drafts more than one token a round");
    assert_eq!(most(one), 1, "the capped stream verifies one draft a round");
    assert_eq!(most(off), 0);
    let touched = |id: u64| calls.iter().any(|c| matches!(c, Call::Absorb { stream, .. } | Call::Propose { stream, .. } if *stream == id));
    assert!(!touched(off), "the drafter saw the stream that turned it off");
    assert!(touched(one) && touched(free));
}

// Past `draft_max_streams` decoding streams, rounds carry no drafts and
// the drafter is not asked; as streams finish, drafting resumes. Output is
// the same as without a drafter.
#[test]
fn a_large_batch_turns_drafting_down() {
    let lc = LaneConfig { draft_max_streams: 2, ..no_marks() };
    let (lane, log) = lane_with_drafter(FakeConfig::default(), lc, 0);
    // Four streams of different lengths: four, then three, then two decode.
    let reqs: Vec<Request> = (0..4).map(|i| greedy(prompt(6, 50 + i), 40 + 20 * i as usize)).collect();
    let hs: Vec<StreamHandle> = reqs.iter().map(|r| lane.submit(r.clone()).unwrap()).collect();
    for (h, r) in hs.iter().zip(&reqs) {
        assert_eq!(drain(h).tokens, oracle(&r.prompt, r.stop.max_tokens.unwrap(), 64));
    }
    let calls = log.snapshot();
    let rounds: Vec<&[(u64, Vec<u32>)]> = calls.iter().map(|c| c.rows()).filter(|r| !r.is_empty()).collect();
    let drafted = |r: &[(u64, Vec<u32>)]| r.iter().any(|row| row.1.len() > 1);
    assert!(rounds.iter().filter(|r| r.len() > 2).all(|r| !drafted(r)), "a round of more than 2 streams carried drafts");
    assert!(rounds.iter().filter(|r| r.len() == 4).count() > 3, "the four streams decoded together");
    assert!(rounds.iter().any(|r| r.len() <= 2 && drafted(r)), "drafting never resumed");
    // Nor was the drafter asked after a round of four (three at least decode on).
    let mut last = 0;
    for c in &calls {
        match c {
            Call::Round { rows, .. } if !rows.is_empty() => last = rows.len(),
            Call::Propose { .. } => assert!(last < 4, "a proposal after a round of {last} streams"),
            _ => {}
        }
    }
    let stats = lane.stats();
    assert!(stats.draft_accepted > 0 && stats.draft_accept_lengths.iter().sum::<u64>() > 0, "{stats:?}");
}

// A draft model (here the target's own fake) is fed prompts only while the
// lane drafts: streams that arrive into a batch too large to draft cost it
// no prefill. Output is the same.
#[test]
fn a_draft_model_prefills_only_while_the_lane_drafts() {
    let draft_log = CallLog::default();
    let draft = DraftModel::new(Box::new(FakeBackend::new(FakeConfig::default(), draft_log.clone())), DraftModelConfig::default()).unwrap();
    let target = FakeBackend::new(FakeConfig::default(), CallLog::default());
    let lc = LaneConfig { draft_max_streams: 1, chunk_tokens: 8, ..no_marks() };
    let lane = Lane::spawn_with_drafter(Box::new(target), Some(Box::new(draft)), Arc::new(FakeText::default()), lc);
    // The first decodes alone (its prompt fed as it comes) and goes on
    // until the three that arrive next are done.
    let first = greedy(prompt(20, 70), 4000);
    let h0 = lane.submit(first.clone()).unwrap();
    wait_event(&h0, |e| matches!(e, braid_engine::Event::Token { .. }));
    let late: Vec<Request> = (0..3).map(|i| greedy(prompt(24, 71 + i), 10 + 10 * i as usize)).collect();
    let hs: Vec<StreamHandle> = late.iter().map(|r| lane.submit(r.clone()).unwrap()).collect();
    for (h, r) in hs.iter().zip(&late) {
        assert_eq!(drain(h).tokens, oracle(&r.prompt, r.stop.max_tokens.unwrap(), 64));
    }
    h0.cancel();
    let out0 = drain(&h0).tokens;
    assert_eq!(out0, oracle(&first.prompt, out0.len() + 1, 64)[1..]);
    // The first stream's prompt reached the draft model; the late ones'
    // did not: they arrived into a batch of two or more.
    let fed: Vec<(u64, usize)> = draft_log.snapshot().iter().filter_map(|c| c.chunk().map(|ch| (ch.stream, ch.tokens.len()))).collect();
    assert!(fed.iter().any(|&(s, _)| s == h0.id), "{fed:?}");
    assert!(fed.iter().all(|(s, _)| !hs.iter().any(|h| h.id == *s)), "{fed:?}");
}

/// Pearson's chi-square of `counts` (token -> draws) against `probs` (the
/// model's own), tokens expected fewer than 5 times pooled into one cell;
/// and the degrees of freedom.
fn chi_square(counts: &std::collections::HashMap<u32, u64>, probs: &[f64]) -> (f64, usize) {
    let n: u64 = counts.values().sum();
    let (mut chi, mut cells, mut rest_seen, mut rest_want) = (0.0, 0, 0.0, 0.0);
    for (t, &p) in probs.iter().enumerate() {
        let seen = counts.get(&(t as u32)).copied().unwrap_or(0) as f64;
        let want = p * n as f64;
        if want < 5.0 {
            rest_seen += seen;
            rest_want += want;
        } else {
            chi += (seen - want).powi(2) / want;
            cells += 1;
        }
    }
    if rest_want > 0.0 {
        chi += (rest_seen - rest_want).powi(2) / rest_want;
        cells += 1;
    }
    (chi, cells - 1)
}

/// The chi-square value a true fit exceeds with probability 1e-4 at `df`
/// degrees of freedom (Wilson-Hilferty; z = 3.72).
fn chi_critical(df: usize) -> f64 {
    let k = df as f64;
    k * (1.0 - 2.0 / (9.0 * k) + 3.72 * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

fn softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

// Seeded sampling with a drafter draws from the target's own distribution:
// over many seeds, the first token, the second given the first and the
// third given both (each verified against a draft in some rounds and
// rejected in others) follow the fake model's softmax, by a chi-square test.
#[test]
fn sampling_with_drafts_follows_the_targets_distribution() {
    use braid_engine::fake::fake_logits;
    use std::collections::HashMap;
    const DRAWS: u64 = 3000;
    let lc = LaneConfig { draft_max_streams: 64, ..no_marks() };
    // Drafts right (the fake's argmax) except every third position.
    let (lane, _) = lane_with_drafter(FakeConfig::default(), lc, 3);
    let p = prompt(5, 9);
    let mut outs = Vec::new();
    for chunk in (0..DRAWS).collect::<Vec<_>>().chunks(32) {
        let hs: Vec<StreamHandle> = chunk
            .iter()
            .map(|&s| {
                lane.submit(Request { sampling: SamplingParams { temperature: 1.0, seed: Some(s), ..Default::default() }, ..greedy(p.clone(), 3) }).unwrap()
            })
            .collect();
        outs.extend(hs.iter().map(|h| drain(h).tokens));
    }
    let stats = lane.stats();
    assert!(stats.draft_accepted > DRAWS / 4 && stats.draft_accepted < stats.draft_proposed, "drafts were both accepted and rejected: {stats:?}");
    let check = |what: &str, given: &[u32], pick: &dyn Fn(&[u32]) -> Option<u32>| {
        let counts = outs.iter().filter_map(|o| pick(o)).fold(HashMap::new(), |mut m, t| {
            *m.entry(t).or_insert(0u64) += 1;
            m
        });
        let seq: Vec<u32> = p.iter().chain(given).copied().collect();
        let (chi, df) = chi_square(&counts, &softmax(&fake_logits(&seq, 64)));
        eprintln!("{what}: {} draws, chi-square {chi:.1} on {df} df (critical {:.1})", counts.values().sum::<u64>(), chi_critical(df));
        assert!(df >= 3 && chi < chi_critical(df), "{what}: chi-square {chi:.1} on {df} df");
    };
    check("first token", &[], &|o| o.first().copied());
    // The most common first token (the argmax: its draft was right) and
    // second token after it.
    let top = |i: usize, prefix: &[u32]| {
        let mut c: HashMap<u32, usize> = HashMap::new();
        for o in outs.iter().filter(|o| o.starts_with(prefix)) {
            *c.entry(o[i]).or_default() += 1;
        }
        c.into_iter().max_by_key(|&(t, n)| (n, std::cmp::Reverse(t))).unwrap().0
    };
    let t1 = top(0, &[]);
    check("second token after the likeliest first", &[t1], &|o| (o[0] == t1).then_some(o[1]));
    let t1b = (t1 + 1) % 64;
    check("second token after the second likeliest first", &[t1b], &|o| (o[0] == t1b).then_some(o[1]));
    let t2 = top(1, &[t1]);
    check("third token after the likeliest two", &[t1, t2], &|o| (o[..2] == [t1, t2]).then_some(o[2]));
}

// A penalised stream's draft rows are each picked with the drafts before
// them in its history, as the host's sampler, verifying them one by one,
// has them: on a small vocabulary, where a draft's next token is often one
// just drafted, the tokens are those of a lane with neither drafter nor
// picks.
#[test]
fn penalised_draft_rows_count_the_drafts_before_them() {
    let vocab = 12;
    let reqs = || -> Vec<Request> {
        (0..3u32)
            .map(|i| {
                let mut r = greedy(prompt(6, 40 + i).iter().map(|t| t % vocab as u32).collect(), 40);
                r.sampling.presence_penalty = 0.6;
                r.sampling.repetition_window = 4;
                r
            })
            .collect()
    };
    let mut fc = FakeConfig::default();
    fc.caps.vocab_size = vocab;
    let (plain, _, _) = run_requests(fc.clone(), None, reqs());
    fc.caps.picks = Picks { argmax: true, top_k: 0, penalties: true, ..Picks::default() };
    let (drafted, stats, log) = run_requests(fc, Some(0), reqs());
    assert_eq!(plain, drafted);
    assert!(stats.draft_accepted > 0, "the drafter was never right");
    assert!(log.picks().iter().all(|&p| p == Pick::Argmax));
}

/// What each round with decode rows said of the next (`Step::next_drafts`).
fn said_drafts_next(log: &CallLog) -> Vec<bool> {
    log.snapshot()
        .iter()
        .filter_map(|c| if let Call::Round { rows, next_drafts, .. } = c { (!rows.is_empty()).then_some(*next_drafts) } else { None })
        .collect()
}

// A round says whether the next will likely carry drafts, so a backend that
// starts rounds ahead (one token a stream) starts none that the device
// would run for nothing: with a drafter proposing, every round of a
// drafting stream says so; none without a drafter, for a stream that keeps
// it off, or while more streams decode than draft.
#[test]
fn a_round_says_when_drafts_come_next() {
    let (drafting, log) = lane_with_drafter(FakeConfig::default(), no_marks(), 3);
    drain(&drafting.submit(greedy(prompt(9, 3), 20)).unwrap());
    let said = said_drafts_next(&log);
    assert!(!said.is_empty() && said.iter().all(|&d| d), "{said:?}");
    let drafted = log.snapshot().iter().filter(|c| c.rows().iter().any(|r| r.1.len() > 1)).count();
    assert!(drafted > 0, "the drafter's proposals never ran");

    let (plain, log) = lane(FakeConfig::default(), no_marks());
    drain(&plain.submit(greedy(prompt(9, 3), 20)).unwrap());
    assert!(said_drafts_next(&log).iter().all(|&d| !d));

    let (off, log) = lane_with_drafter(FakeConfig::default(), no_marks(), 3);
    drain(&off.submit(Request { draft_tokens: Some(0), ..greedy(prompt(9, 3), 20) }).unwrap());
    let said = said_drafts_next(&log);
    assert!(!said.is_empty() && said.iter().all(|&d| !d), "{said:?}");

    // Three streams at once, one drafting at most: rounds of all three say no.
    let lc = LaneConfig { draft_max_streams: 1, ..no_marks() };
    let (busy, log) = lane_with_drafter(FakeConfig::default(), lc, 3);
    let hs: Vec<StreamHandle> = (0..3).map(|i| busy.submit(greedy(prompt(9, 3 + i), 30)).unwrap()).collect();
    hs.iter().for_each(|h| drop(drain(h)));
    let rounds: Vec<Call> = log.snapshot().into_iter().filter(|c| c.rows().len() == 3).collect();
    assert!(!rounds.is_empty());
    assert!(rounds.iter().all(|c| matches!(c, Call::Round { next_drafts: false, .. })), "{rounds:?}");
}
