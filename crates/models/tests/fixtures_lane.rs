//! Every family served through a lane, as `braid serve` serves it: several
//! streams with different prompts arrive together, prefill in steps while
//! the others decode in shared rounds, and each greedy reply equals the same
//! stream served alone.

mod fixtures_common;

use std::sync::{Arc, Mutex};

use braid_engine::fake::Held;
use braid_engine::{Backend, Chunk, DecodeRow, Lane, LaneConfig, Pick, Picked, Request, SamplingParams, Step, StopRules};
use fixtures_common::{tokens, Fixture, NoText, FAMILIES};

fn request(prompt: Vec<u32>) -> Request {
    Request {
        prompt,
        sampling: SamplingParams::greedy(),
        stop: StopRules { max_tokens: Some(10), ignore_eos: true, ..Default::default() },
        logprobs: None,
        ..Default::default()
    }
}

/// A lane on `f` that stops at its first `open` while `hold` is held.
fn lane(f: &Fixture, hold: &Arc<Mutex<()>>) -> Lane {
    // Small chunks and a row cap, so passes take many steps between rounds.
    let config = LaneConfig { chunk_tokens: 5, max_rows: Some(3), max_running: 8, ..LaneConfig::default() };
    Lane::spawn(Box::new(Held { inner: f.backend(), hold: hold.clone() }), Arc::new(NoText), config)
}

#[test]
fn every_family_serves_streams_together_as_alone() {
    for name in FAMILIES {
        let f = Fixture::load(name);
        let prompts: Vec<Vec<u32>> = (0..4).map(|i| f.tokens[i * 3..i * 3 + 9 + 4 * i].to_vec()).collect();
        let hold = Arc::new(Mutex::new(()));
        let alone: Vec<Vec<u32>> = {
            let l = lane(&f, &hold);
            prompts.iter().map(|p| tokens(l.submit(request(p.clone())).unwrap())).collect()
        };
        // All four are queued before the lane opens the first, so they
        // overlap however busy the machine is.
        let l = lane(&f, &hold);
        let guard = hold.lock().unwrap();
        let handles: Vec<_> = prompts.iter().map(|p| l.submit(request(p.clone())).unwrap()).collect();
        drop(guard);
        let together: Vec<Vec<u32>> = handles.into_iter().map(tokens).collect();
        assert_eq!(together, alone, "{name}: streams served together differ from alone");
        assert!(together.iter().all(|t| t.len() == 10), "{name}: {together:?}");
        let stats = l.stats();
        assert!(stats.max_decode_batch >= 2, "{name}: no shared decode round (max batch {})", stats.max_decode_batch);
        assert!(stats.fused_rounds > 0, "{name}: no chunk shared a decode round's forward");
        assert!(stats.prefill_chunks >= prompts.iter().map(|p| p.len().div_ceil(3) as u64).sum::<u64>(), "{name}: passes were not stepped");
    }
}

/// A decode round and a prompt chunk in one forward give bit-identical
/// logits to the two forwards run one after the other (the CPU device is
/// batch-invariant), and leave the same state behind.
#[test]
fn a_fused_forward_equals_the_two_forwards() {
    for name in FAMILIES {
        let f = Fixture::load(name);
        let (pa, pb) = (&f.tokens[..6], &f.tokens[6..17]);
        let mut runs = Vec::new();
        for fused in [false, true] {
            let mut b = f.backend();
            let mut out = Vec::new();
            b.open(1).unwrap();
            b.open(2).unwrap();
            out.extend(b.prefill_step(1, Chunk { start: 0, tokens: pa, want_logits: true }).unwrap().unwrap());
            let mut last = 7;
            for (start, end) in [(0, 4), (4, 11)] {
                let chunk = Chunk { start, tokens: &pb[start..end], want_logits: end == pb.len() };
                let rows = [DecodeRow { stream: 1, tokens: vec![last] }];
                let (round, first) = if fused {
                    let out = b.round(Step::new(&rows, Some((2, chunk)), Pick::Logits)).unwrap();
                    let Picked::Logits(round) = out.picked else { panic!("{name}: a logits round returned {:?}", out.picked) };
                    (round, out.chunk_logits)
                } else {
                    let round = b.decode_logits(&rows).unwrap();
                    (round, b.prefill_step(2, chunk).unwrap())
                };
                assert_eq!(first.is_some(), chunk.want_logits, "{name}");
                last = (start as u32 * 13 + 5) % 50;
                out.extend(round);
                out.extend(first.unwrap_or_default());
            }
            // The state after: one more round of both streams.
            out.extend(b.decode_logits(&[DecodeRow { stream: 1, tokens: vec![3] }, DecodeRow { stream: 2, tokens: vec![4] }]).unwrap());
            runs.push(out);
        }
        assert!(runs[0] == runs[1], "{name}: the fused forward differs from the two forwards");
    }
}
