//! Every family served from the prefix cache through a lane, as `braid
//! serve` serves it: attention families from the backend's cached KV
//! blocks, hybrids from the lane's marks. A separate test binary from
//! `fixtures_lane`, whose check that streams overlap is timing-bound and
//! should not share the cores with this one.

mod fixtures_common;

use std::sync::Arc;

use braid_engine::{Event, Lane, LaneConfig, Request, SamplingParams, StopRules};
use fixtures_common::{Fixture, NoText, FAMILIES};

fn request(prompt: Vec<u32>) -> Request {
    Request {
        prompt,
        sampling: SamplingParams::greedy(),
        stop: StopRules { max_tokens: Some(10), ignore_eos: true, ..Default::default() },
        logprobs: Some(1),
        ..Default::default()
    }
}

/// Each token with its logprob's bits: equal only if the logits were.
fn scored(h: braid_engine::StreamHandle) -> (Vec<(u32, u32)>, usize) {
    let mut out = Vec::new();
    for e in h {
        match e {
            Event::Token { id, logprob, .. } => out.push((id, logprob.expect("asked for logprobs").to_bits())),
            Event::Finished { usage, .. } => return (out, usage.cached_tokens),
            Event::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
    panic!("the stream ended without finishing")
}

/// A document with three questions, then the first again, served from the
/// prefix cache (attention families from the backend's cached blocks,
/// hybrids from the lane's marks) and cold: the same tokens with the same
/// logprobs, bit for bit.
#[test]
fn every_family_answers_from_the_prefix_cache_as_cold() {
    for name in FAMILIES {
        let f = Fixture::load(name);
        let doc = &f.tokens[..21];
        let mut prompts: Vec<Vec<u32>> = [21..27, 27..33, 33..39].into_iter().map(|q| [doc, &f.tokens[q]].concat()).collect();
        prompts.push(prompts[0].clone());
        let serve = |config: LaneConfig| -> Vec<(Vec<(u32, u32)>, usize)> {
            let l = Lane::spawn(Box::new(f.backend()), Arc::new(NoText), config);
            prompts.iter().map(|p| scored(l.submit(request(p.clone())).unwrap())).collect()
        };
        let config = LaneConfig { chunk_tokens: 5, max_rows: Some(3), ..LaneConfig::default() };
        let cold = serve(LaneConfig { prefix_marks: 0, ..config.clone() });
        let warm = serve(config);
        for (i, (w, c)) in warm.iter().zip(&cold).enumerate() {
            assert_eq!(w.0, c.0, "{name}: prompt {i} answered differently from the cache");
            assert_eq!(c.1, 0);
        }
        let cached: Vec<usize> = warm.iter().map(|w| w.1).collect();
        // The third question finds the document (whole blocks of 4 at
        // least); the first again finds all of itself but its last row.
        assert!(cached[2] >= 20, "{name}: {cached:?}");
        assert_eq!(cached[3], prompts[3].len() - 1, "{name}: {cached:?}");
    }
}
