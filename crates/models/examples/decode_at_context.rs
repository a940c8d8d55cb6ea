//! Decode rounds of N streams at several context lengths on the CPU
//! (SmolLM2 from the model cache): where attention starts to dominate.
//! `cargo run --release -p braid-models --example decode_at_context [STREAMS]`
use braid_engine::{Backend, Chunk, DecodeRow, Pick, Step};
use std::time::Instant;

#[path = "common/smollm2_cpu.rs"]
mod smollm2_cpu;

fn main() {
    let n: u64 = std::env::args().nth(1).map_or(1, |a| a.parse().expect("STREAMS is a number"));
    let mut be = smollm2_cpu::backend();
    let toks = smollm2_cpu::tokens();
    for (round, ctx) in [100usize, 500, 1000, 1500, 3000].into_iter().enumerate() {
        let ids: Vec<u64> = (0..n).map(|i| 100 * round as u64 + i).collect();
        for &s in &ids {
            be.open(s).unwrap();
            for c in (0..ctx).step_by(512) {
                let e = (c + 512).min(ctx);
                if let Err(e) = be.prefill_step(s, Chunk { start: c, tokens: &toks[c..e], want_logits: false }) {
                    panic!("{e:#}")
                }
            }
        }
        let rows: Vec<DecodeRow> = ids.iter().map(|&stream| DecodeRow { stream, tokens: vec![5] }).collect();
        let mut ts = Vec::new();
        for _ in 0..15 {
            let t = Instant::now();
            be.decode_logits(&rows).unwrap();
            ts.push(t.elapsed().as_secs_f64() * 1e3);
        }
        ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("{n} streams at ctx {ctx}: a round {:.2} ms (median of 15)", ts[7]);
        // The same rounds beside a prompt chunk of each size.
        for rows_in_chunk in [1usize, 4, 16] {
            let p = 100 * round as u64 + 99;
            be.open(p).unwrap();
            // The chunk deep into its prompt, as an arrival's later chunks are.
            let at = std::env::var("AT").map_or(0, |v| v.parse().expect("AT is a number"));
            for c in (0..at).step_by(512) {
                let e = (c + 512).min(at);
                be.prefill_step(p, Chunk { start: c, tokens: &toks[c..e], want_logits: false }).unwrap();
            }
            let mut ts = Vec::new();
            for i in 0..9 {
                let s0 = at + i * rows_in_chunk;
                let chunk = Chunk { start: s0, tokens: &toks[s0..s0 + rows_in_chunk], want_logits: false };
                let t = Instant::now();
                be.round(Step::new(&rows, Some((p, chunk)), Pick::Logits)).unwrap();
                ts.push(t.elapsed().as_secs_f64() * 1e3);
            }
            be.forget(p);
            ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
            println!("  beside a {rows_in_chunk}-row chunk: {:.2} ms (median of 9)", ts[4]);
        }
        for &s in &ids {
            be.forget(s);
        }
    }
}
