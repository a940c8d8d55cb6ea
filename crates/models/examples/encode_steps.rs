//! The image tower's steps on the CPU, timed one by one: what a step of
//! each stage costs, first and later (where a step beside decoding
//! streams goes). `cargo run --release -p braid-models --example
//! encode_steps MODEL_DIR [BUDGET]` (a Gemma 3 HF folder with a vision
//! tower, e.g. scripts/bench/make_vision_stall_model.py's).

use braid_ops::cpu::Cpu;
use std::time::Instant;

fn main() {
    let dir = std::env::args().nth(1).expect("MODEL_DIR");
    let budget: u64 = std::env::args().nth(2).map_or(100_000_000, |b| b.parse().expect("BUDGET is a number"));
    let dev = Cpu::new(None);
    let (_src, model) = braid_models::open(&dev, std::path::Path::new(&dir)).unwrap();
    let c = model.vision().expect("a model with a vision tower").clone();
    let pixels: Vec<f32> = (0..c.channels * c.image_size * c.image_size).map(|i| ((i * 7919) % 255) as f32 / 127.5 - 1.0).collect();
    // The same image's first steps twice (the second starts it over):
    // what the first use of each stage costs, and what it costs after.
    for image in 0..2 {
        let (mut at, mut kind) = (0, u32::MAX);
        for n in 0..160 {
            // One row at the start of each kind (as the pacer starts), then the budget.
            let b = if n == 0 || kind == u32::MAX { 1 } else { budget };
            let t = Instant::now();
            let step = model.encode_image_step(&dev, &pixels, &mut at, Some(b)).unwrap();
            let ms = t.elapsed().as_secs_f64() * 1e3;
            if b == 1 || ms > 3.0 {
                println!("image {image} step {n}: budget {b} work {} at {at} {ms:.1} ms", step.work);
            }
            kind = if b == 1 {
                step.next
            } else if step.next != kind {
                u32::MAX
            } else {
                kind
            };
        }
    }
}
