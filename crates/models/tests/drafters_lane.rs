//! Drafters in a lane over a real backend (fixtures on the CPU): the
//! DFlash and DSpark drafters (the gemma3_text fixture's taps feeding the tiny random
//! drafters of `scripts/fixtures/make_dflash.py` and `make_dspark.py`), prompt lookup, and a
//! draft model (a qwen2 fixture drafting for the qwen2 fixture). Output
//! with a drafter equals output without, token for token, alone, with
//! streams arriving together and with a prompt arriving while others
//! decode; seeded sampling with a draft model follows the target's own
//! probabilities (a chi-square test); and the DFlash drafter is fed every
//! prompt row's real features.

mod fixtures_common;

use std::sync::Arc;

use braid_engine::{
    Backend, DraftModel, DraftModelConfig, Drafter, Lane, LaneConfig, LaneStats, NgramConfig, PromptLookup, Request, SamplingParams, StopRules,
};
use braid_models::dflash::{DFlash, DFlashDrafter};
use braid_models::Source;
use braid_ops::cpu::Cpu;
use braid_ops::KvDtype;
use fixtures_common::*;

/// What the lane handed the drafter.
type Log = Absorbs;

fn request(prompt: Vec<u32>, seed: Option<u64>) -> Request {
    Request {
        prompt,
        sampling: match seed {
            None => SamplingParams::greedy(),
            Some(s) => SamplingParams { temperature: 0.9, seed: Some(s), ..Default::default() },
        },
        stop: StopRules { max_tokens: Some(24), ignore_eos: true, ..Default::default() },
        ..Default::default()
    }
}

/// Which drafter a lane runs.
#[derive(Clone)]
enum Kind {
    None,
    /// A block drafter (DFlash or DSpark) from the fixture folder of this
    /// name, fed the host rows the lane hands on, or (`true`) reading them
    /// where the backend keeps them (`share_taps`).
    DFlash(Log, Proposals, &'static str, bool),
    Ngram,
    /// A draft model: the fixture of this name, on a backend of its own.
    Model(&'static str),
}

/// A lane over the gemma3_text fixture with the drafter `kind`.
fn lane(fx: &Fixture, kind: &Kind) -> Lane {
    // Small chunks and a row cap, so passes take many steps between rounds.
    let config = LaneConfig { chunk_tokens: 5, max_rows: Some(3), max_running: 8, draft_max_streams: 8, ..LaneConfig::default() };
    let mut backend = fx.backend();
    let drafter: Option<Box<dyn Drafter>> = match kind {
        Kind::None => None,
        Kind::DFlash(log, proposals, name, shared) => {
            let target = Source::open(&fx.dir).unwrap();
            let model = DFlash::load(&Cpu::new(None), &fixtures_dir().join(name), &target).unwrap();
            let mut inner = DFlashDrafter::new(Cpu::new(None), model, 4096, 4, KvDtype::F32).unwrap();
            if *shared {
                inner.share_taps(&mut backend).unwrap();
            } else {
                inner.model().attach(&mut backend).unwrap();
            }
            Some(Box::new(Recording { inner, absorbs: log.clone(), proposals: proposals.clone() }))
        }
        Kind::Ngram => Some(Box::new(PromptLookup::new(NgramConfig { min_n: 1, ..NgramConfig::default() }))),
        Kind::Model(name) => {
            let draft = Fixture::load(name).backend();
            Some(Box::new(DraftModel::new(Box::new(draft), DraftModelConfig { max_tokens: 4, patience: 4 }).unwrap()))
        }
    };
    Lane::spawn_with_drafter(Box::new(backend), drafter, Arc::new(NoText), config)
}

/// Every prompt alone, then all together; the replies and the stats of the run together.
fn serve(fx: &Fixture, prompts: &[Vec<u32>], seed: Option<u64>, kind: Kind) -> (Vec<Vec<u32>>, Vec<Vec<u32>>, LaneStats) {
    let alone = {
        let l = lane(fx, &kind);
        prompts.iter().enumerate().map(|(i, p)| tokens(l.submit(request(p.clone(), seed.map(|s| s + i as u64))).unwrap())).collect()
    };
    let l = lane(fx, &kind);
    let hs: Vec<_> = prompts.iter().enumerate().map(|(i, p)| l.submit(request(p.clone(), seed.map(|s| s + i as u64))).unwrap()).collect();
    let together = hs.into_iter().map(tokens).collect();
    (alone, together, l.stats())
}

#[test]
fn dflash_drafting_is_lossless_on_a_real_backend() {
    block_drafting_is_lossless("dflash_gemma3");
}

#[test]
fn dspark_drafting_is_lossless_on_a_real_backend() {
    block_drafting_is_lossless("dspark_gemma3");
}

fn block_drafting_is_lossless(drafter: &'static str) {
    let fx = Fixture::load("gemma3_text");
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| fx.tokens[i * 3..i * 3 + 9 + 4 * i].to_vec()).collect();
    for seed in [None, Some(42)] {
        let (plain_alone, plain_together, _) = serve(&fx, &prompts, seed, Kind::None);
        let (alone, together, stats) = serve(&fx, &prompts, seed, Kind::DFlash(Log::default(), Proposals::default(), drafter, true));
        assert_eq!(alone, plain_alone, "seed {seed:?}: drafted streams alone differ from plain ones");
        assert_eq!(together, plain_together, "seed {seed:?}: drafted streams together differ from plain ones");
        assert_eq!(together, alone, "seed {seed:?}");
        assert!(together.iter().all(|t| t.len() == 24));
        // The drafter ran, and (its random guesses never accepted) each
        // stream's gate cut its proposals short of a block per round.
        assert!(stats.draft_proposed > 0 && stats.draft_proposed < 3 * stats.decode_streams, "{stats:?}");
        eprintln!(
            "{drafter}, seed {seed:?}: {} drafts proposed, {} accepted ({:.1}%), {} decode rounds for {} tokens",
            stats.draft_proposed,
            stats.draft_accepted,
            100.0 * stats.draft_accepted as f64 / stats.draft_proposed.max(1) as f64,
            stats.decode_rounds,
            together.iter().map(Vec::len).sum::<usize>()
        );
    }
}

/// A run of `prompts` together with the DFlash drafter reading the
/// backend's kept rows (`shared`) or the lane's host rows: the replies,
/// and each stream's proposals in order.
fn proposals(fx: &Fixture, prompts: &[Vec<u32>], shared: bool) -> (Vec<Vec<u32>>, Vec<Proposal>) {
    let (log, proposals) = (Log::default(), Proposals::default());
    let l = lane(fx, &Kind::DFlash(log.clone(), proposals.clone(), "dflash_gemma3", shared));
    let hs: Vec<_> = prompts.iter().map(|p| l.submit(request(p.clone(), None)).unwrap()).collect();
    let outs = hs.into_iter().map(tokens).collect();
    // Shared, no row went through the host; else every absorb had its rows.
    assert!(log.lock().unwrap().iter().all(|(_, t, f)| f.is_empty() == shared || t.is_empty()));
    let mut p = proposals.lock().unwrap().clone();
    // Each stream's in order (the sort is stable).
    p.sort_by_key(|e| e.0);
    (outs, p)
}

#[test]
fn the_drafter_absorbs_every_prompt_rows_real_features() {
    let fx = Fixture::load("gemma3_text");
    let reference = read_safetensors(&fixtures_dir().join("dflash_gemma3/reference.safetensors"));
    let width = reference["features"].shape[1];
    let prompt = fx.tokens[..17].to_vec();
    let log: Log = Arc::default();
    let l = lane(&fx, &Kind::DFlash(log.clone(), Proposals::default(), "dflash_gemma3", false));
    let out = tokens(l.submit(request(prompt.clone(), None)).unwrap());
    assert_eq!(out.len(), 24);
    let log = log.lock().unwrap();
    // The prompt arrives in chunks of at most 3 rows (the row cap), each
    // absorbed whole, in order; together they are transformers' rows.
    let mut fed = Vec::new();
    let mut rows = Vec::new();
    for (_, t, f) in log.iter() {
        if rows.len() >= prompt.len() {
            break;
        }
        assert!(t.len() <= 3 && f.len() == t.len() * width, "a chunk of {} rows with {} features", t.len(), f.len());
        fed.extend_from_slice(f);
        rows.extend_from_slice(t);
    }
    assert_eq!(rows, prompt, "the chunks' tokens are the prompt's");
    assert_close("absorbed prompt features", &fed, &reference["features"].data[..prompt.len() * width], width, 1e-4);
    // After the prompt, each round's kept rows (the fed token and the
    // accepted drafts): every generated token is fed but the last, and the
    // round that ends the stream absorbs nothing (it holds 1 to 4 of them).
    let after: Vec<u32> = log.iter().flat_map(|(_, t, _)| t.iter().copied()).skip(prompt.len()).collect();
    assert_eq!(after, out[..after.len()], "the generated rows absorbed are the tokens generated");
    let after = after.len();
    assert!((out.len() - 5..=out.len() - 2).contains(&after), "{after} rows absorbed after the prompt for {} tokens", out.len());
}

#[test]
fn prompt_lookup_is_lossless_on_a_real_backend() {
    let fx = Fixture::load("gemma3_text");
    // Prompts that repeat themselves, so lookups find matches (the tiny
    // random model copies some of them and not others).
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| fx.tokens[i * 3..i * 3 + 6 + i].repeat(3)).collect();
    for seed in [None, Some(7)] {
        let (plain_alone, plain_together, plain) = serve(&fx, &prompts, seed, Kind::None);
        let (alone, together, stats) = serve(&fx, &prompts, seed, Kind::Ngram);
        assert_eq!(alone, plain_alone, "seed {seed:?}: drafted streams alone differ from plain ones");
        assert_eq!(together, plain_together, "seed {seed:?}: drafted streams together differ from plain ones");
        assert!(stats.draft_proposed > 0, "{stats:?}");
        eprintln!(
            "prompt lookup, seed {seed:?}: {} drafts proposed, {} accepted ({:.1}%), {} decode rounds against {} without",
            stats.draft_proposed,
            stats.draft_accepted,
            100.0 * stats.draft_accepted as f64 / stats.draft_proposed.max(1) as f64,
            stats.decode_rounds,
            plain.decode_rounds
        );
        if seed.is_none() {
            // Greedy: accepted drafts save rounds.
            assert!(stats.draft_accepted > 0, "{stats:?}");
            assert!(stats.decode_rounds < plain.decode_rounds);
        }
    }
}

/// The qwen2 fixture's prompts for the draft-model runs.
fn qwen2_prompts(fx: &Fixture) -> Vec<Vec<u32>> {
    (0..4).map(|i| fx.tokens[i * 2..i * 2 + 7 + 3 * i].to_vec()).collect()
}

#[test]
fn a_draft_model_is_lossless_on_a_real_backend() {
    let fx = Fixture::load("qwen2");
    let prompts = qwen2_prompts(&fx);
    // The target drafting for itself (its drafts are its own greedy
    // tokens) and another random model of the same vocabulary (mostly wrong).
    for draft in ["qwen2", "qwen2_tied"] {
        for seed in [None, Some(11)] {
            let (plain_alone, plain_together, plain) = serve(&fx, &prompts, seed, Kind::None);
            let (alone, together, stats) = serve(&fx, &prompts, seed, Kind::Model(draft));
            assert_eq!(alone, plain_alone, "{draft}, seed {seed:?}: drafted streams alone differ from plain ones");
            assert_eq!(together, plain_together, "{draft}, seed {seed:?}: drafted streams together differ from plain ones");
            assert!(together.iter().all(|t| t.len() == 24));
            assert!(stats.draft_proposed > 0, "{stats:?}");
            eprintln!(
                "draft model {draft}, seed {seed:?}: {} drafts proposed, {} accepted, {} decode rounds against {} without",
                stats.draft_proposed, stats.draft_accepted, stats.decode_rounds, plain.decode_rounds
            );
            if draft == "qwen2" && seed.is_none() {
                // Greedy drafts of the target itself: (nearly) all accepted,
                // so far fewer rounds (about half; the streams' overlap,
                // and so the rounds, vary with timing).
                assert!(stats.draft_accepted * 10 >= stats.draft_proposed * 9, "{stats:?}");
                assert!(stats.decode_rounds * 3 < plain.decode_rounds * 2, "{stats:?} against {plain:?}");
            }
        }
    }
}

#[test]
fn a_draft_model_is_lossless_with_a_prompt_arriving() {
    let fx = Fixture::load("qwen2");
    let prompts = qwen2_prompts(&fx);
    let run = |kind: Kind| {
        let l = lane(&fx, &kind);
        let first: Vec<_> = prompts[..3].iter().map(|p| l.submit(request(p.clone(), None)).unwrap()).collect();
        // The last prompt arrives once the first stream decodes.
        let mut head = Vec::new();
        while let Some(e) = first[0].recv() {
            if let braid_engine::Event::Token { id, .. } = e {
                head.push(id);
                break;
            }
        }
        let late = l.submit(request(prompts[3].clone(), None)).unwrap();
        let mut outs: Vec<Vec<u32>> = Vec::new();
        let mut it = first.into_iter();
        let h0 = it.next().unwrap();
        head.extend(tokens(h0));
        outs.push(head);
        outs.extend(it.map(tokens));
        outs.push(tokens(late));
        (outs, l.stats())
    };
    let (plain, _) = run(Kind::None);
    for draft in ["qwen2", "qwen2_tied"] {
        let (drafted, stats) = run(Kind::Model(draft));
        assert_eq!(drafted, plain, "{draft}: a prompt arriving changed the drafted output");
        assert!(stats.draft_proposed > 0 && stats.fused_rounds > 0, "{stats:?}");
    }
}

/// Pearson's chi-square of `seen` (token -> draws) against `probs`, cells
/// expected fewer than 5 times pooled; and its degrees of freedom.
fn chi_square(seen: &std::collections::HashMap<u32, u64>, probs: &[f64]) -> (f64, usize) {
    let n: u64 = seen.values().sum();
    let (mut chi, mut cells, mut rest) = (0.0, 0usize, (0.0, 0.0));
    for (t, &p) in probs.iter().enumerate() {
        let (got, want) = (seen.get(&(t as u32)).copied().unwrap_or(0) as f64, p * n as f64);
        if want < 5.0 {
            rest = (rest.0 + got, rest.1 + want);
        } else {
            chi += (got - want).powi(2) / want;
            cells += 1;
        }
    }
    if rest.1 > 0.0 {
        chi += (rest.0 - rest.1).powi(2) / rest.1;
        cells += 1;
    }
    (chi, cells.saturating_sub(1))
}

#[test]
fn sampling_with_a_draft_model_follows_the_targets_distribution() {
    use std::collections::HashMap;
    const DRAWS: u64 = 3000;
    const TEMP: f32 = 0.6;
    let fx = Fixture::load("qwen2");
    let prompt = fx.tokens[..7].to_vec();
    let l = lane(&fx, &Kind::Model("qwen2"));
    let mut outs: Vec<Vec<u32>> = Vec::new();
    for seeds in (0..DRAWS).collect::<Vec<_>>().chunks(8) {
        let req = |s: u64| Request {
            prompt: prompt.clone(),
            sampling: SamplingParams { temperature: TEMP, seed: Some(s), ..Default::default() },
            stop: StopRules { max_tokens: Some(3), ignore_eos: true, ..Default::default() },
            ..Default::default()
        };
        let hs: Vec<_> = seeds.iter().map(|&s| l.submit(req(s)).unwrap()).collect();
        outs.extend(hs.into_iter().map(tokens));
    }
    let stats = l.stats();
    assert!(stats.draft_accepted > 50 && stats.draft_accepted < stats.draft_proposed, "drafts both accepted and rejected: {stats:?}");
    // The target's own probabilities, from a forward of its own.
    let mut be = fx.backend();
    let mut probs = |stream: u64, seq: &[u32]| -> Vec<f64> {
        be.open(stream).unwrap();
        let all = run_rows(&mut be, stream, seq);
        let row = &all[all.len() - fx.vocab..];
        let m = row.iter().fold(f32::MIN, |a, &b| a.max(b));
        let e: Vec<f64> = row.iter().map(|&x| (((x - m) / TEMP) as f64).exp()).collect();
        let sum: f64 = e.iter().sum();
        e.into_iter().map(|x| x / sum).collect()
    };
    let first = probs(1, &prompt);
    // The likeliest first token: its draft (the argmax) is accepted when drawn.
    let t1 = braid_ops::argmax_host(&first.iter().map(|&p| p as f32).collect::<Vec<_>>());
    let second = probs(2, &[prompt.clone(), vec![t1]].concat());
    let count = |pick: &dyn Fn(&[u32]) -> Option<u32>| {
        outs.iter().filter_map(|o| pick(o)).fold(HashMap::new(), |mut m, t| {
            *m.entry(t).or_insert(0u64) += 1;
            m
        })
    };
    for (what, seen, p) in
        [("first token", count(&|o| Some(o[0])), &first), ("second after the likeliest first", count(&|o| (o[0] == t1).then_some(o[1])), &second)]
    {
        let (chi, df) = chi_square(&seen, p);
        // The value a true fit passes with probability 1e-4 (Wilson-Hilferty, z = 3.72).
        let k = df as f64;
        let critical = k * (1.0 - 2.0 / (9.0 * k) + 3.72 * (2.0 / (9.0 * k)).sqrt()).powi(3);
        eprintln!("{what}: {} draws, chi-square {chi:.1} on {df} df (critical {critical:.1})", seen.values().sum::<u64>());
        assert!(df >= 3 && chi < critical, "{what}: chi-square {chi:.1} on {df} df");
    }
}

#[test]
fn rows_kept_on_the_device_draft_as_the_hosts_do() {
    // The target's rows reach the drafter two ways: copied to the host and
    // handed on by the lane, or kept where the backend made them and read
    // by stream. Four streams together: the same replies, and each
    // stream's proposals the same tokens from the same block logits.
    let fx = Fixture::load("gemma3_text");
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| fx.tokens[i * 3..i * 3 + 9 + 4 * i].to_vec()).collect();
    let (host_out, host) = proposals(&fx, &prompts, false);
    let (kept_out, kept) = proposals(&fx, &prompts, true);
    assert_eq!(kept_out, host_out);
    assert!(host.len() >= 8, "{} proposals", host.len());
    assert_eq!(kept.len(), host.len());
    for ((s, t, l), (hs, ht, hl)) in kept.iter().zip(&host) {
        assert_eq!((s, t), (hs, ht), "stream {s}'s proposal");
        assert_close("block logits", l, hl, hl.len(), 1e-5);
    }
}
