//! Drafters in a lane over the GPU (the CPU's `drafters_lane` on the
//! device): the DFlash and DSpark drafters fed the gemma3_text fixture's
//! taps, prompt lookup, and a draft model (the qwen2 fixture drafting for
//! itself), each with its target on the GPU, against the same lane with no
//! drafter: alone and with the streams together. On the CPU a row's result
//! does not depend on its batch, so outputs are equal token for token; here
//! a verify round's 1 + k rows take other kernels than a row alone (the
//! GEMV, the skinny GEMM, cuBLAS), so logits move by bf16 rounding and a
//! near-tie may flip. So each pair of outputs is equal up to its first
//! difference, and there the two tokens must be within rounding of the
//! best in the target's own row for that prefix; a wrong verify (a draft
//! accepted that the target did not pick, a rewind off by one) picks a
//! token far from it.

use std::sync::Arc;

use braid_engine::{DraftModel, DraftModelConfig, Drafter, Lane, LaneConfig, LaneStats, NgramConfig, PromptLookup, Request, SamplingParams, StopRules};
use braid_models::dflash::{DFlash, DFlashDrafter};
use braid_models::Source;

use super::*;
use fixtures_common::{Absorbs, Fixture, NoText, Proposals, Recording};

#[derive(Clone, Copy, Debug)]
enum Kind {
    None,
    Block(&'static str),
    Ngram,
    Model(&'static str),
}

fn lane(dev: &Cuda, fx: &Fixture, kind: Kind) -> Lane {
    let config = LaneConfig { chunk_tokens: 5, max_rows: Some(3), max_running: 8, draft_max_streams: 8, ..LaneConfig::default() };
    let mut target = backend(dev, &fx.dir);
    let drafter: Option<Box<dyn Drafter>> = match kind {
        Kind::None => None,
        Kind::Block(name) => Some(Box::new(block_drafter(dev, fx, &mut target, name, true))),
        Kind::Ngram => Some(Box::new(PromptLookup::new(NgramConfig { min_n: 1, ..NgramConfig::default() }))),
        Kind::Model(name) => {
            let draft = backend(dev, &fixture_dir(name));
            Some(Box::new(DraftModel::new(Box::new(draft), DraftModelConfig { max_tokens: 4, patience: 4 }).unwrap()))
        }
    };
    Lane::spawn_with_drafter(Box::new(target), drafter, Arc::new(NoText), config)
}

fn request(prompt: &[u32]) -> Request {
    Request {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        stop: StopRules { max_tokens: Some(24), ignore_eos: true, ..Default::default() },
        ..Default::default()
    }
}

/// The block drafter in fixture folder `name` for `target`, reading its
/// rows on the device (`shared`) or from the host copies the lane hands on.
fn block_drafter(dev: &Cuda, fx: &Fixture, target: &mut ModelBackend<Cuda>, name: &str, shared: bool) -> DFlashDrafter<Cuda> {
    let model = DFlash::load(dev, &fixture_dir(name), &Source::open(&fx.dir).unwrap()).unwrap();
    let mut d = DFlashDrafter::new(dev.clone(), model, 4096, 16, KvDtype::F16).unwrap();
    if shared {
        d.share_taps(target).unwrap();
    } else {
        d.model().attach(target).unwrap();
    }
    d
}

/// Greedy replies to `prompts`, each alone, then all together; and the
/// together run's stats.
fn serve(dev: &Cuda, fx: &Fixture, prompts: &[Vec<u32>], kind: Kind) -> (Vec<Vec<u32>>, Vec<Vec<u32>>, LaneStats) {
    let l = lane(dev, fx, kind);
    let alone = prompts.iter().map(|p| fixtures_common::tokens(l.submit(request(p)).unwrap())).collect();
    drop(l);
    let l = lane(dev, fx, kind);
    let hs: Vec<_> = prompts.iter().map(|p| l.submit(request(p)).unwrap()).collect();
    (alone, hs.into_iter().map(fixtures_common::tokens).collect(), l.stats())
}

/// `got` equals `want` up to their first difference, where both tokens
/// are near the best of the target's row after the shared prefix.
/// Returns how many tokens were compared equal.
fn equal_up_to_near_ties(dev: &Cuda, fx: &Fixture, what: &str, prompt: &[u32], got: &[u32], want: &[u32]) -> usize {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) else { return got.len() };
    let mut be = backend(dev, &fx.dir);
    be.open(1).unwrap();
    let row = feed(&mut be, 1, &[prompt, &want[..i]].concat());
    let row = &row[row.len() - fx.vocab..];
    assert!(
        near_best(row, got[i]) && near_best(row, want[i]),
        "{what}: token {i} is {} with the drafter and {} without, not a near-tie (logits {} and {}, best {})",
        got[i],
        want[i],
        row[got[i] as usize],
        row[want[i] as usize],
        row[argmax(row)]
    );
    eprintln!("{what}: a near-tie flipped at token {i}");
    i
}

/// Every reply with `kind` against the same without a drafter; returns
/// the run's stats.
fn check(fx: &Fixture, prompts: &[Vec<u32>], kind: Kind) -> Option<LaneStats> {
    let dev = gpu()?;
    let (plain_alone, plain_together, plain) = serve(&dev, fx, prompts, Kind::None);
    let (alone, together, stats) = serve(&dev, fx, prompts, kind);
    let mut same = 0;
    for (i, p) in prompts.iter().enumerate() {
        same += equal_up_to_near_ties(&dev, fx, &format!("{kind:?} stream {i} alone"), p, &alone[i], &plain_alone[i]);
        same += equal_up_to_near_ties(&dev, fx, &format!("{kind:?} stream {i} together"), p, &together[i], &plain_together[i]);
    }
    let total = 2 * prompts.len() * 24;
    eprintln!(
        "{kind:?} on {}: {same}/{total} tokens equal before any near-tie; {} drafts proposed, {} accepted; {} decode rounds against {} without",
        dev.name(),
        stats.draft_proposed,
        stats.draft_accepted,
        stats.decode_rounds,
        plain.decode_rounds
    );
    // Near-ties are rare: most of the output is compared.
    assert!(same * 4 >= total * 3, "{kind:?}: only {same}/{total} tokens before the first differences");
    assert!(stats.draft_proposed > 0, "{kind:?}: the drafter proposed nothing: {stats:?}");
    Some(stats)
}

#[test]
fn block_drafters_are_lossless_on_the_gpu() {
    let fx = Fixture::load("gemma3_text");
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| fx.tokens[i * 3..i * 3 + 9 + 4 * i].to_vec()).collect();
    for name in ["dflash_gemma3", "dspark_gemma3"] {
        if check(&fx, &prompts, Kind::Block(name)).is_none() {
            return;
        }
    }
}

#[test]
fn prompt_lookup_is_lossless_on_the_gpu() {
    let fx = Fixture::load("gemma3_text");
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| fx.tokens[i * 3..i * 3 + 6 + i].repeat(3)).collect();
    if let Some(stats) = check(&fx, &prompts, Kind::Ngram) {
        assert!(stats.draft_accepted > 0, "{stats:?}");
    }
}

#[test]
fn a_draft_model_is_lossless_on_the_gpu() {
    let fx = Fixture::load("qwen2");
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| fx.tokens[i * 2..i * 2 + 7 + 3 * i].to_vec()).collect();
    if let Some(stats) = check(&fx, &prompts, Kind::Model("qwen2")) {
        // The target drafting for itself: most drafts are its own picks.
        assert!(stats.draft_accepted * 10 >= stats.draft_proposed * 7, "{stats:?}");
    }
}

#[test]
fn rows_kept_on_the_gpu_draft_as_the_hosts_do() {
    // The target's rows kept on the device and read by stream
    // (`share_taps`) against the same rows copied to the host and back:
    // each prompt alone, the same replies and the same proposals.
    let Some(dev) = gpu() else { return };
    let fx = Fixture::load("gemma3_text");
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| fx.tokens[i * 3..i * 3 + 9 + 4 * i].to_vec()).collect();
    let run = |shared: bool| {
        let mut target = backend(&dev, &fx.dir);
        let inner = block_drafter(&dev, &fx, &mut target, "dflash_gemma3", shared);
        let proposals = Proposals::default();
        let drafter: Box<dyn Drafter> = Box::new(Recording { inner, absorbs: Absorbs::default(), proposals: proposals.clone() });
        let config = LaneConfig { chunk_tokens: 5, max_rows: Some(3), max_running: 8, draft_max_streams: 8, ..LaneConfig::default() };
        let l = Lane::spawn_with_drafter(Box::new(target), Some(drafter), Arc::new(NoText), config);
        let outs: Vec<Vec<u32>> = prompts.iter().map(|p| fixtures_common::tokens(l.submit(request(p)).unwrap())).collect();
        drop(l);
        let p = proposals.lock().unwrap().clone();
        (outs, p)
    };
    let (host_out, host) = run(false);
    let (kept_out, kept) = run(true);
    assert_eq!(kept_out, host_out);
    assert!(host.len() >= 8, "{} proposals", host.len());
    assert_eq!(kept.len(), host.len());
    for ((s, t, l), (hs, ht, hl)) in kept.iter().zip(&host) {
        assert_eq!((s, t), (hs, ht), "stream {s}'s proposal");
        let d = l.iter().zip(hl).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(l.len() == hl.len() && d <= 1e-3, "stream {s}: block logits differ by {d}");
    }
    eprintln!("{} proposals the same on {}", kept.len(), dev.name());
}
