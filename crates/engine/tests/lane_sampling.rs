//! What streams get back: greedy tokens and logprobs, seeded sampling,
//! stop ids and strings, held-back text, and what each round asks the
//! backend to pick (logits, argmax or top-k) for the same tokens.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use braid_engine::fake::{Call, CallLog, FakeBackend, FakeConfig, FakeText};
use braid_engine::{Event, FinishReason, Lane, LaneConfig, Pick, Picks, Request, SamplingParams, StopRules, Usage};
use common::*;

#[test]
fn greedy_output_and_logprobs() {
    let (lane, _log) = lane(FakeConfig::default(), no_marks());
    let p = prompt(9, 20);
    let h = lane.submit(Request { logprobs: Some(3), ..greedy(p.clone(), 16) }).unwrap();
    let out = drain(&h);
    assert_eq!(out.tokens, oracle(&p, 16, 64));
    assert_eq!(out.usage, Usage { prompt_tokens: 9, completion_tokens: 16, cached_tokens: 0 });
    for ev in &out.events {
        if let Event::Token { id, logprob, top, .. } = ev {
            assert_eq!(top.len(), 3);
            assert_eq!(top[0].0, *id);
            assert_eq!(Some(top[0].1), *logprob);
            assert!(top[0].1 > top[1].1 && top[1].1 > top[2].1 && top[0].1 < 0.0);
        }
    }
    let Some(Event::Finished { timing, .. }) = out.events.last() else { panic!() };
    assert!(timing.ttft.is_some() && timing.ttft.unwrap() <= timing.total);
}

// A backend that picks greedy tokens itself gets every round whose streams
// all sample plainly greedy; a round with a stream that wants logprobs, a
// penalty or a temperature gets logits. Tokens are the same either way.
#[test]
fn greedy_rounds_go_to_the_backend_only_when_every_row_allows() {
    let mut fc = FakeConfig::default();
    fc.caps.picks.argmax = true;
    let (lane, log) = lane(fc, no_marks());
    let p = prompt(9, 21);
    let plain = lane.submit(greedy(p.clone(), 12)).unwrap();
    assert_eq!(drain(&plain).tokens, oracle(&p, 12, 64));
    let greedy_calls = |log: &CallLog| log.picks().iter().filter(|&&p| p == Pick::Argmax).count();
    assert_eq!(greedy_calls(&log), 11, "every decode round of a plain greedy stream");
    log.clear();
    let with_logprobs = lane.submit(Request { logprobs: Some(2), ..greedy(p.clone(), 12) }).unwrap();
    assert_eq!(drain(&with_logprobs).tokens, oracle(&p, 12, 64));
    let mut penalised = greedy(p.clone(), 6);
    penalised.sampling.repetition_penalty = 1.3;
    drain(&lane.submit(penalised).unwrap());
    assert_eq!(greedy_calls(&log), 0, "a stream that needs its logits got greedy rounds");
    assert!(lane.stats().greedy_rounds >= 11);
}

// Each round asks for the least that every one of its decode rows allows:
// the argmax while every stream is plain greedy, the top k while every
// stream samples from its top k, else logits; rounds that carry a prompt
// chunk or drafts included (the chunk's stream does not decode yet, and
// drafts are verified from whatever was picked).
#[test]
fn a_rounds_pick_is_the_least_that_every_row_allows() {
    let mut fc = slow();
    fc.caps.picks = Picks { argmax: true, top_k: 8, ..Picks::default() };
    let (lane, log) = lane_with_drafter(fc, LaneConfig { chunk_tokens: 4, ..no_marks() }, 3);
    let pa = prompt(3, 22);
    let a = decoding(&lane, pa.clone(), LONG);
    let top5 = SamplingParams { temperature: 1.0, top_k: 5, seed: Some(9), ..Default::default() };
    let b = lane.submit(Request { sampling: top5, ..greedy(prompt(20, 23), 10) }).unwrap();
    let c = lane.submit(Request { logprobs: Some(1), ..greedy(prompt(6, 24), 5) }).unwrap();
    assert_eq!(drain(&b).usage.completion_tokens, 10);
    assert_eq!(drain(&c).tokens, oracle(&prompt(6, 24), 5, 64));
    a.cancel();
    let out_a = drain(&a);
    assert_eq!(out_a.tokens, oracle(&pa, 1 + out_a.tokens.len(), 64)[1..]);
    let need: HashMap<u64, Pick> = [(a.id, Pick::Argmax), (b.id, Pick::TopK(5)), (c.id, Pick::Logits)].into();
    let rank = |p: Pick| match p {
        Pick::Argmax => 0,
        Pick::TopK(_) => 1,
        Pick::Logits | Pick::Draw => 2,
    };
    let mut seen = HashMap::new();
    for call in log.snapshot() {
        let Call::Round { rows, chunk, pick, .. } = &call else { continue };
        let Some(want) = rows.iter().map(|r| need[&r.0]).max_by_key(|&p| rank(p)) else { continue };
        assert_eq!(*pick, want, "{call:?}");
        let drafts = rows.iter().any(|r| r.1.len() > 1);
        *seen.entry((rank(want), chunk.is_some(), drafts)).or_insert(0) += 1;
    }
    assert!(seen.contains_key(&(0, true, true)), "no argmax round carried a chunk and drafts: {seen:?}");
    assert!(seen.keys().any(|k| k.0 == 1), "no top-k round: {seen:?}");
    assert!(seen.keys().any(|k| k.0 == 2), "no logits round: {seen:?}");
}

// A backend that returns each row's top-k candidates gets every round
// whose streams sample from those alone (greedy or top-k, no penalty, no
// logprobs), asked for the largest k among them; the tokens are those of
// sampling whole rows on the host, seed for seed. A stream that needs the
// whole row (top-p alone, a penalty) gets logits.
#[test]
fn top_k_rounds_draw_the_host_samplers_tokens() {
    let req = |seed: u64, top_k: usize, p: &[u32]| Request {
        sampling: SamplingParams { temperature: 1.5, top_k, top_p: 0.95, seed: Some(seed), ..Default::default() },
        ..greedy(p.to_vec(), 16)
    };
    let run = |top_k: usize, reqs: Vec<Request>| {
        let mut fc = FakeConfig::default();
        fc.caps.picks.top_k = top_k;
        let (lane, log) = lane(fc, no_marks());
        let subs: Vec<_> = reqs.into_iter().map(|r| lane.submit(r).unwrap()).collect();
        let tokens: Vec<Vec<u32>> = subs.iter().map(|s| drain(s).tokens).collect();
        let tops: Vec<usize> = log.picks().iter().filter_map(|p| if let Pick::TopK(k) = p { Some(*k) } else { None }).collect();
        (tokens, tops, lane.stats().top_rounds)
    };
    let (p1, p2) = (prompt(9, 31), prompt(13, 32));
    let both = || vec![req(3, 5, &p1), req(4, 12, &p2), greedy(p1.clone(), 16)];
    let (host, none, _) = run(0, both());
    assert!(none.is_empty());
    let (dev, tops, rounds) = run(64, both());
    assert_eq!(dev, host, "top-k rounds changed the tokens");
    assert!(rounds >= 8 && tops.iter().all(|&k| k == 12 || k == 5 || k == 1), "top rounds {rounds}, k {tops:?}");
    assert!(tops.contains(&12), "a round of all three streams asks for the largest k");
    // Sampling is not greedy: the seeded streams differ from the argmax.
    assert_ne!(dev[0], dev[2]);
    // k past what the backend returns, top-p alone, or a penalty: whole rows.
    let mut penalised = req(5, 5, &p1);
    penalised.sampling.presence_penalty = 0.4;
    for r in [req(3, 65, &p1), req(3, 0, &p1), penalised] {
        let (_, tops, rounds) = run(64, vec![r]);
        assert!(tops.is_empty() && rounds == 0);
    }
}

// A backend that draws sampled tokens itself gets every round whose rows
// need no whole row back (top-p, min-p, plain temperature, top-k past what
// it returns, penalties it applies, drafts), each row with its stream's
// next number; the tokens are those of sampling whole rows on the host,
// seed for seed, also when a stream that wants logprobs turns rounds back
// to whole rows mid-way and when rejected drafts leave numbers unused.
#[test]
fn drawn_rounds_give_the_host_samplers_tokens() {
    let req = |seed: u64, s: SamplingParams, p: &[u32], n: usize| Request { sampling: SamplingParams { seed: Some(seed), ..s }, ..greedy(p.to_vec(), n) };
    let top_p = SamplingParams { temperature: 1.5, top_p: 0.8, ..Default::default() };
    let min_p = SamplingParams { temperature: 0.9, min_p: 0.2, ..Default::default() };
    let plain = SamplingParams { temperature: 1.2, ..Default::default() };
    let wide_k = SamplingParams { temperature: 1.1, top_k: 20, top_p: 0.9, ..Default::default() };
    let penalised = SamplingParams { temperature: 1.3, top_p: 0.9, presence_penalty: 0.8, ..Default::default() };
    let run = |picks: Picks| {
        let mut fc = slow();
        fc.caps.picks = picks;
        let (lane, log) = lane_with_drafter(fc, no_marks(), 2);
        let (p1, p2) = (prompt(9, 51), prompt(13, 52));
        let reqs = vec![
            req(1, top_p.clone(), &p1, 30),
            req(2, min_p.clone(), &p2, 30),
            req(3, plain.clone(), &p1, 30),
            req(4, wide_k.clone(), &p2, 30),
            req(5, penalised.clone(), &p1, 30),
            greedy(p2.clone(), 30),
        ];
        let subs: Vec<_> = reqs.into_iter().map(|r| lane.submit(r).unwrap()).collect();
        // A stream that wants its rows whole joins while they decode.
        wait_event(&subs[0], |e| matches!(e, Event::Token { .. }));
        let late = lane.submit(Request { logprobs: Some(2), ..req(6, top_p.clone(), &p2, 6) }).unwrap();
        let mut tokens: Vec<Vec<u32>> = subs.iter().map(|s| drain(s).tokens).collect();
        tokens.push(drain(&late).tokens);
        (tokens, log.picks(), lane.stats())
    };
    let (host, host_picks, _) = run(Picks::default());
    assert!(host_picks.iter().all(|&p| p == Pick::Logits));
    let (dev, dev_picks, stats) = run(Picks { argmax: true, top_k: 8, penalties: true, draw: true });
    assert_eq!(dev, host, "rounds drawn by the backend changed the tokens");
    let drawn = dev_picks.iter().filter(|&&p| p == Pick::Draw).count();
    assert!(drawn >= 10 && stats.draw_rounds == drawn as u64, "{dev_picks:?}");
    assert!(dev_picks.contains(&Pick::Logits), "the logprobs stream's rounds come back whole: {dev_picks:?}");
    assert!(stats.draft_proposed > stats.draft_accepted && stats.draft_accepted > 0, "drafts verified from drawn rows, some rejected");
    // Sampling is not greedy: the seeded streams differ from the argmax.
    assert_ne!(dev[0], oracle(&prompt(9, 51), 30, 64));
    // Without draws declared, such rows come back whole.
    let (_, picks, _) = run(Picks { argmax: true, top_k: 8, penalties: true, draw: false });
    assert!(!picks.contains(&Pick::Draw));
}

// A backend that applies penalties before it picks gets the rounds of
// penalised streams (greedy and top-k, repetition, presence and frequency
// penalties) as argmax and top-k rounds, and the tokens are those of
// penalising and sampling whole rows on the host, seed for seed.
#[test]
fn penalised_streams_pick_where_the_logits_are_and_draw_the_hosts_tokens() {
    let penalised = |seed: Option<u64>, top_k: usize, p: &[u32]| {
        let mut r = greedy(p.to_vec(), 24);
        r.sampling.repetition_penalty = 1.3;
        r.sampling.presence_penalty = 0.7;
        r.sampling.frequency_penalty = 0.3;
        if let Some(seed) = seed {
            r.sampling = SamplingParams { temperature: 1.5, top_k, seed: Some(seed), ..r.sampling };
        }
        r
    };
    let run = |picks: Picks| {
        let mut fc = FakeConfig::default();
        fc.caps.picks = picks;
        let (lane, log) = lane(fc, no_marks());
        let (p1, p2) = (prompt(9, 41), prompt(13, 42));
        let reqs = vec![penalised(None, 0, &p1), penalised(Some(5), 6, &p2), penalised(Some(6), 3, &p1), greedy(p2.clone(), 24)];
        let subs: Vec<_> = reqs.into_iter().map(|r| lane.submit(r).unwrap()).collect();
        let tokens: Vec<Vec<u32>> = subs.iter().map(|s| drain(s).tokens).collect();
        (tokens, log.picks())
    };
    let (host, host_picks) = run(Picks::default());
    assert!(host_picks.iter().all(|&p| p == Pick::Logits));
    let (dev, dev_picks) = run(Picks { argmax: true, top_k: 8, penalties: true, ..Picks::default() });
    assert_eq!(dev, host, "penalties applied before the pick changed the tokens");
    assert!(dev_picks.iter().filter(|&&p| p == Pick::TopK(6)).count() >= 10, "{dev_picks:?}");
    assert!(!dev_picks.contains(&Pick::Logits), "{dev_picks:?}");
    // The penalties bite: the penalised greedy stream is not the plain one.
    assert_ne!(dev[0], oracle(&prompt(9, 41), 24, 64));
    // Without penalties declared, a penalised stream's rows come back whole
    // (the plain greedy stream, alone at the end, is picked).
    let (_, picks) = run(Picks { argmax: true, top_k: 8, ..Picks::default() });
    assert!(!picks.iter().any(|p| matches!(p, Pick::TopK(_))) && picks.iter().filter(|&&p| p == Pick::Logits).count() >= 20, "{picks:?}");
}

#[test]
fn seeded_sampling_repeats_and_seeds_differ() {
    let (lane, _log) = lane(FakeConfig::default(), no_marks());
    let run = |seed| {
        let req = Request { sampling: SamplingParams { temperature: 3.0, seed: Some(seed), ..Default::default() }, ..greedy(prompt(5, 21), 24) };
        drain(&lane.submit(req).unwrap()).tokens
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5), run(6));
}

#[test]
fn eos_and_stop_ids_end_the_stream_unless_ignored() {
    let p = prompt(6, 22);
    let want = oracle(&p, 20, 64);
    // The first position where a token appears for the first time, past 2.
    let k = (2..20).find(|&k| !want[..k].contains(&want[k])).unwrap();
    let eos = want[k];
    let (lane, _log) = lane(FakeConfig::default(), LaneConfig { eos_ids: vec![eos], ..no_marks() });
    let out = drain(&lane.submit(greedy(p.clone(), 20)).unwrap());
    assert_eq!(out.reason, Some(FinishReason::Stop));
    assert_eq!(out.tokens, want[..k].to_vec(), "no Token event for the EOS");
    assert_eq!(out.usage.completion_tokens, k + 1);
    let req = Request { stop: StopRules { max_tokens: Some(20), ignore_eos: true, ..Default::default() }, ..greedy(p.clone(), 20) };
    let out = drain(&lane.submit(req).unwrap());
    assert_eq!(out.reason, Some(FinishReason::Length));
    assert_eq!(out.tokens, want);
    // stop_ids apply even with ignore_eos.
    let req = Request { stop: StopRules { max_tokens: Some(20), ignore_eos: true, stop_ids: vec![eos], ..Default::default() }, ..greedy(p.clone(), 20) };
    assert_eq!(drain(&lane.submit(req).unwrap()).tokens, want[..k].to_vec());
}

/// Token text with three letters per id, so stop strings can straddle tokens.
fn spelled() -> FakeText {
    FakeText { table: (0..64u8).map(|i| vec![b'a' + i / 8, b'a' + i % 8, b'.']).collect() }
}

#[test]
fn stop_strings_are_held_back_and_cut_across_tokens() {
    let text = spelled();
    let log = CallLog::default();
    let lane = Lane::spawn(Box::new(FakeBackend::new(FakeConfig::default(), log)), Arc::new(text.clone()), no_marks());
    let p = prompt(7, 23);
    let want = oracle(&p, 30, 64);
    let full: String = want.iter().map(|&t| String::from_utf8(text.table[t as usize].clone()).unwrap()).collect();
    // A stop string straddling tokens 4 and 5: ".xy" is the end of one
    // token's text and the start of the next.
    let stop = full[3 * 5 - 1..3 * 5 + 2].to_string();
    let at = full.find(&stop).unwrap();
    let req = Request { stop: StopRules { max_tokens: Some(30), stop_strings: vec![stop.clone()], ..Default::default() }, ..greedy(p, 30) };
    let out = drain(&lane.submit(req).unwrap());
    assert_eq!(out.reason, Some(FinishReason::Stop));
    assert_eq!(out.text, full[..at]);
    // The token that completed the stop string is the last one.
    assert_eq!(out.tokens.len(), (at + stop.len()).div_ceil(3));
    // Text was held back: the token ending in "." released nothing while
    // "." could begin the stop string.
    let held = out.events.iter().any(|e| matches!(e, Event::Token { text, .. } if text.is_empty()));
    assert!(held);
}

#[test]
fn held_text_is_released_at_the_end() {
    let text = spelled();
    let lane = Lane::spawn(Box::new(FakeBackend::new(FakeConfig::default(), CallLog::default())), Arc::new(text.clone()), no_marks());
    let p = prompt(7, 24);
    let want = oracle(&p, 6, 64);
    let full: String = want.iter().map(|&t| String::from_utf8(text.table[t as usize].clone()).unwrap()).collect();
    // "." then something that never comes: the final "." is held until the end.
    let req = Request { stop: StopRules { max_tokens: Some(6), stop_strings: vec![".~".into()], ..Default::default() }, ..greedy(p, 6) };
    let out = drain(&lane.submit(req).unwrap());
    assert_eq!(out.reason, Some(FinishReason::Length));
    assert_eq!(out.text, full);
}

#[test]
fn multi_byte_characters_are_emitted_whole() {
    let p = prompt(5, 25);
    let want = oracle(&p, 4, 64);
    assert!(want[0] != want[1] && want[1] != want[2] && want[0] != want[2], "need three distinct tokens: {want:?}");
    let mut text = FakeText { table: (0..64).map(|_| b"-".to_vec()).collect() };
    text.table[want[0] as usize] = b"\xE2".to_vec();
    text.table[want[1] as usize] = b"\x82".to_vec();
    text.table[want[2] as usize] = b"\xAC!".to_vec();
    let lane = Lane::spawn(Box::new(FakeBackend::new(FakeConfig::default(), CallLog::default())), Arc::new(text), no_marks());
    let out = drain(&lane.submit(greedy(p, 3)).unwrap());
    let texts: Vec<String> = out.events.iter().filter_map(|e| if let Event::Token { text, .. } = e { Some(text.clone()) } else { None }).collect();
    assert_eq!(texts, vec!["", "", "€!"]);
}
