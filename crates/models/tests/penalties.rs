//! A sampler's penalties applied where the logits are (`Step::penalties`,
//! `Device::pick`) give the pick that penalising the whole row on the host
//! gives, on a real model's round (the qwen2 fixture, CPU; `cuda_ops`
//! checks the CUDA kernel against the same arithmetic, bit for bit).

mod fixtures_common;

use braid_engine::{Backend, Chunk, DecodeRow, Penalty, Pick, Picked, Sampler, SamplingParams, Step};
use fixtures_common::*;

#[test]
fn penalties_before_the_pick_equal_the_hosts() {
    let fx = Fixture::load("qwen2");
    let prompts: [Vec<u32>; 2] = [(0..12).map(|i| (i * 37 + 5) % 200).collect(), (0..9).map(|i| (i * 11 + 3) % 150).collect()];
    let rows: Vec<DecodeRow> = (0..2).map(|s| DecodeRow { stream: s, tokens: vec![prompts[s as usize][0]] }).collect();
    let round = |pick: Pick, penalties: &[Penalty]| {
        let mut be = fx.backend();
        for (s, p) in prompts.iter().enumerate() {
            be.open(s as u64).unwrap();
            be.prefill_step(s as u64, Chunk { start: 0, tokens: p, want_logits: false }).unwrap();
        }
        be.round(Step { penalties, ..Step::new(&rows, None, pick) }).unwrap().picked
    };
    let Picked::Tokens(plain) = round(Pick::Argmax, &[]) else { panic!("tokens asked for") };
    // Completions so far: the unpenalised picks among them, some tokens
    // twice (frequency counts them), so the penalties change the pick.
    let params = SamplingParams { repetition_penalty: 1.3, presence_penalty: 4.0, frequency_penalty: 0.2, ..SamplingParams::greedy() };
    let mut samplers: Vec<Sampler> = prompts.iter().map(|p| Sampler::new(&params, p)).collect();
    for ((s, done), &first) in samplers.iter_mut().zip([[7u32, 9, 7], [3, 3, 150]]).zip(&plain) {
        done.iter().chain([&first]).for_each(|&t| s.accept(t));
    }
    let mut penalties: Vec<Penalty> = Vec::new();
    samplers.iter().enumerate().for_each(|(row, s)| s.penalties(row as u32, &mut penalties));
    assert!(penalties.len() > 12, "the history's tokens: {}", penalties.len());
    let Picked::Logits(mut logits) = round(Pick::Logits, &penalties) else { panic!("whole rows asked for") };
    let vocab = logits.len() / 2;
    // Rows that come back whole come back raw: the host penalises them.
    for (row, s) in logits.chunks_mut(vocab).zip(&samplers) {
        s.apply_penalties(row);
    }
    let want: Vec<u32> = braid_ops::top_k_host(&logits, vocab, 1).iter().map(|r| r[0].0).collect();
    assert_eq!(round(Pick::Argmax, &penalties), Picked::Tokens(want.clone()));
    assert!(want.iter().zip(&plain).all(|(a, b)| a != b), "the penalties did not change the picks: {want:?}");
}
