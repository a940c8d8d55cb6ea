//! Rounds of N decode rows beside a prompt chunk on the CPU (SmolLM2 from
//! the model cache): what a chunk of each size adds to the round.
//! `cargo run --release -p braid-models --example cpu_mixed [STREAMS] [CTX] [START]`
use braid_engine::{Backend, Chunk, DecodeRow, Pick, Step};
use std::time::Instant;

#[path = "common/smollm2_cpu.rs"]
mod smollm2_cpu;

fn main() {
    let arg = |i: usize, d: usize| std::env::args().nth(i).map_or(d, |a| a.parse().expect("a number"));
    let (n, ctx, start) = (arg(1, 6) as u64, arg(2, 200), arg(3, 500));
    let mut be = smollm2_cpu::backend();
    let toks = smollm2_cpu::tokens();
    let ids: Vec<u64> = (0..n).collect();
    for &s in &ids {
        be.open(s).unwrap();
        be.prefill_step(s, Chunk { start: 0, tokens: &toks[..ctx], want_logits: false }).unwrap();
    }
    let newcomer = 1000;
    println!("| chunk rows | ms a round (median of 9) |\n| ---: | ---: |");
    for c in [0usize, 1, 2, 4, 8, 16, 32] {
        let mut ts = Vec::new();
        for _ in 0..9 {
            be.open(newcomer).unwrap();
            be.prefill_step(newcomer, Chunk { start: 0, tokens: &toks[..start], want_logits: false }).unwrap();
            let rows: Vec<DecodeRow> = ids.iter().map(|&stream| DecodeRow { stream, tokens: vec![5] }).collect();
            let chunk = (c > 0).then(|| (newcomer, Chunk { start, tokens: &toks[start..start + c], want_logits: false }));
            let t = Instant::now();
            be.round(Step::new(&rows, chunk, Pick::Argmax)).unwrap();
            ts.push(t.elapsed().as_secs_f64() * 1e3);
            for &s in &ids {
                be.rewind(s, ctx).unwrap();
            }
            be.forget(newcomer);
        }
        ts.sort_by(f64::total_cmp);
        println!("| {c} | {:.2} |", ts[ts.len() / 2]);
    }
}
