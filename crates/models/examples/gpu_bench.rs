//! The GPU benchmark as a standalone program (what `braid bench --device
//! cuda --random-weights` runs): a Llama-3.2-1B-shaped model with random
//! bf16 weights made on the device.
//!
//! `gpu_bench [--device cuda:N] [--preset llama-3.2-1b|smollm2-135m] [--streams 1,8,32,64]
//! [--prompt 128] [--rounds 64] [--prefill 2048] [--no-graphs] [--no-eager] [--json FILE] [--profile]
//! [--mixed STREAMS:CTX:START:ROWS,ROWS,...]`

#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
use anyhow::{bail, Context, Result};

fn main() -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        run()
    }
    #[cfg(not(feature = "cuda"))]
    {
        bail!("built without the cuda feature")
    }
}

#[cfg(feature = "cuda")]
const USAGE: &str = "usage: gpu_bench [--device cuda:N] [--preset llama-3.2-1b|smollm2-135m] [--streams 1,8,32,64] [--prompt 128] \
[--rounds 64] [--prefill 2048 (0: none)] [--no-graphs] [--no-eager] [--json FILE] [--profile]
[--mixed STREAMS:CTX:START:ROWS,ROWS,...] [--skinny-rows N] [--gemv-rows N]
  decode tokens/s at each stream count (with and without CUDA graphs unless --no-eager), a prefill,
  and the copy-bandwidth and GEMM ceilings, all through the backend's round call (the serving
  path); --profile prints GPU time per kernel instead. --mixed times instead rounds of STREAMS
  decode rows at CTX tokens beside a prompt chunk of each ROWS rows from position START (with
  --profile, GPU time per kernel of the last size). --skinny-rows and --gemv-rows
  open the device with those tuning values (cuda::Tuning) instead of the defaults.";

#[cfg(feature = "cuda")]
fn run() -> Result<()> {
    use braid_models::gpubench::{bench_llama, GpuBenchOpts};
    let mut o = GpuBenchOpts::default();
    let (mut device, mut preset, mut json) = ("cuda".to_string(), "llama-3.2-1b".to_string(), None);
    let mut profile = false;
    let mut mixed: Option<String> = None;
    // The defaults, or a cuda-tuning build's BRAID_CUDA_* settings.
    let mut tuning = braid_ops::cuda::Tuning::initial();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--device" => device = val()?,
            "--preset" => preset = val()?,
            "--streams" => o.streams = val()?.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?,
            "--prompt" => o.prompt = val()?.parse()?,
            "--rounds" => o.rounds = val()?.parse()?,
            "--prefill" => o.prefill = val()?.parse()?,
            "--no-graphs" => o.graphs = false,
            "--no-eager" => o.compare_eager = false,
            "--json" => json = Some(val()?),
            "--profile" => profile = true,
            "--mixed" => mixed = Some(val()?),
            "--skinny-rows" => tuning.skinny_max_rows = val()?.parse()?,
            "--gemv-rows" => tuning.gemv_max_rows = val()?.parse()?,
            "--help" | "-h" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    let ordinal = braid_ops::cuda::Cuda::parse_ordinal(&device).with_context(|| format!("bad device {device} (cuda or cuda:N)"))?;
    let dev = braid_ops::cuda::Cuda::with_tuning(ordinal, tuning)?;
    let cfg = braid_models::random::preset(&preset)?;
    let t = std::time::Instant::now();
    let model = braid_models::random::llama(&dev, cfg.clone(), 1, false)?;
    dev.sync()?;
    eprintln!("{}: random {preset} made in {:.2} s", braid_ops::Device::name(&dev), t.elapsed().as_secs_f64());
    if let Some(m) = mixed {
        let f: Vec<&str> = m.split(':').collect();
        let [n, ctx, start, rows] = f[..] else { bail!("--mixed STREAMS:CTX:START:ROWS,ROWS,...\n{USAGE}") };
        let (n, ctx, start): (usize, usize, usize) = (n.parse()?, ctx.parse()?, start.parse()?);
        let rows: Vec<usize> = rows.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?;
        let most = rows.iter().copied().max().unwrap_or(0);
        let mut be = braid_models::gpubench::backend(&dev, Box::new(model), n + 1, (ctx + 256).max(start + most))?;
        // As served: rounds keyed where the backend keys them (graphs), but
        // eager when profiling (the profile times each launch).
        dev.set_graphs(o.graphs && !profile);
        let mut rep = String::new();
        let got = braid_models::gpubench::mixed_run(&mut be, n, ctx, start, &rows, o.rounds.min(16), profile.then_some(&mut rep))?;
        println!("## {n} decode rows at {ctx} tokens, a chunk from position {start}\n\n| chunk rows | ms a round | ms over decode alone | us a chunk row |\n| ---: | ---: | ---: | ---: |");
        let base = got.iter().find(|g| g.0 == 0).map(|g| g.1);
        for (c, ms) in &got {
            let over = base.map(|b| ms - b);
            let per = over.filter(|_| *c > 0).map(|o| format!("{:.1}", 1e3 * o / *c as f64)).unwrap_or_default();
            println!("| {c} | {ms:.3} | {} | {per} |", over.map(|o| format!("{o:.3}")).unwrap_or_default());
        }
        if profile {
            println!("\n## kernels, chunk of {} rows\n\n{rep}", rows.last().unwrap_or(&0));
        }
        return Ok(());
    }
    let streams = o.streams.iter().copied().max().unwrap_or(1);
    let mut be = braid_models::gpubench::backend(&dev, Box::new(model), streams, (o.prompt + o.warmup + o.rounds).max(o.prefill))?;
    if profile {
        // GPU time per kernel (CUDA events around each launch), eager.
        println!("## prefill {} tokens, one chunk\n\n{}", o.prefill, braid_models::gpubench::prefill_profile(&mut be, o.prefill)?);
        for &n in &o.streams {
            println!("## decode, {n} streams, 8 eager rounds\n\n{}", braid_models::gpubench::decode_profile(&mut be, n, o.prompt, 8)?);
        }
        return Ok(());
    }
    let rep = bench_llama(&mut be, &cfg, &o, &mut |s| eprintln!("{s}"))?;
    println!("{}", rep.table());
    if let Some(p) = json {
        std::fs::write(&p, rep.json()).with_context(|| p.clone())?;
    }
    Ok(())
}
