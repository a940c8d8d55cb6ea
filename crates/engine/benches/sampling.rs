//! Host sampling of one logits row: `cargo bench -p braid-engine --bench sampling`.
//!
//! A 262,144-token row (Gemma 3's vocabulary) and the median time a token
//! under each filter: plain temperature, top-k 40, top-p 0.95, min-p 0.05,
//! and a repetition penalty. Two rows: flat (uniform logits in [-6, 6]: the
//! nucleus is most of the row, so top-p sorts most of it, the worst case)
//! and peaked (logit 12 - 3 ln(1 + rank), ranks shuffled: a model's row,
//! whose nucleus is a few hundred tokens). A full sort where none is due,
//! or a second exp pass, shows at once. `BENCH_REPS=n` sets the timed
//! tokens (default 21); `BENCH_VOCAB=n` the row's length.

use std::time::{Duration, Instant};

use braid_engine::rng::Rng;
use braid_engine::sampling::{Sampler, SamplingParams};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let (vocab, reps) = (env("BENCH_VOCAB", 262_144), env("BENCH_REPS", 21).max(1));
    let mut r = Rng::new(12);
    let flat: Vec<f32> = (0..vocab).map(|_| (r.next_f64() * 12.0 - 6.0) as f32).collect();
    // Ranks shuffled (Fisher-Yates) so the largest logits are not at the front.
    let mut rank: Vec<usize> = (0..vocab).collect();
    for i in (1..vocab).rev() {
        rank.swap(i, (r.next_f64() * (i + 1) as f64) as usize % (i + 1));
    }
    let peaked: Vec<f32> = rank.iter().map(|&k| (12.0 - 3.0 * (1.0 + k as f64).ln()) as f32).collect();
    let base = SamplingParams { seed: Some(1), ..SamplingParams::default() };
    let cases = [
        ("temperature 1", base.clone()),
        ("top-k 40", SamplingParams { top_k: 40, ..base.clone() }),
        ("top-p 0.95", SamplingParams { top_p: 0.95, ..base.clone() }),
        ("min-p 0.05", SamplingParams { min_p: 0.05, ..base.clone() }),
        ("repetition penalty 1.1", SamplingParams { repetition_penalty: 1.1, ..base.clone() }),
    ];
    println!("| filter ({vocab} tokens) | flat row, median per token | peaked row |\n| --- | ---: | ---: |");
    let prompt: Vec<u32> = (0..64).map(|i| i * 97 % vocab as u32).collect();
    for (name, params) in cases {
        let median = |logits: &[f32]| {
            let mut s = Sampler::new(&params, &prompt);
            let mut row = logits.to_vec();
            let mut times: Vec<Duration> = (0..reps)
                .map(|_| {
                    row.copy_from_slice(logits);
                    let t = Instant::now();
                    std::hint::black_box(s.sample(&mut row, None));
                    t.elapsed()
                })
                .collect();
            times.sort();
            times[times.len() / 2]
        };
        println!("| {name} | {:?} | {:?} |", median(&flat), median(&peaked));
    }
}
