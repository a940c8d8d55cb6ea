//! `braid bench`: speed in the figures users compare engines by.
//!
//! * pp / tg: a prompt of `--pp` tokens in one pass, then `--tg` tokens
//!   decoded one at a time from an empty context (llama-bench's pp512 and
//!   tg128), min / median / max over `--reps`, plus peak RSS.
//! * `--streams 1,4,8`: aggregate decode tokens/s with N streams decoding
//!   together in shared rounds.
//! * `--spec-streams 1,8,32` with a drafter (`--drafter`, `--draft-model`):
//!   aggregate decode tokens/s of N greedy streams through a lane, with and
//!   without the drafter, alternating runs, on a code-writing prompt (each
//!   stream its own instruction), with the drafts' acceptance.
//! * `--stall`: the scenario braid exists for, in-process: background
//!   streams decode, a long prompt arrives; their usual and largest
//!   inter-token gaps, and the newcomer's time to first token against a
//!   whole-pass prefill of the same prompt on an idle lane.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use braid_engine::{Backend, Chunk, DecodeRow, Event, Lane, LaneConfig, Pick, Picked, Request, SamplingParams, Step, StopRules, TokenText};
use braid_models::BackendConfig;
use braid_server::TokenizerText;
use clap::Args;

use crate::load::{self, Loaded};
use crate::ModelArgs;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens for the prefill figure (0 skips it).
    #[arg(long, default_value_t = 512)]
    pub pp: usize,
    /// Generated tokens for the decode figure (0 skips it).
    #[arg(long, default_value_t = 128)]
    pub tg: usize,
    /// Repeats of each figure.
    #[arg(long, short = 'r', default_value_t = 3)]
    pub reps: usize,
    /// Aggregate decode tokens/s for these stream counts, e.g. 1,4,8.
    #[arg(long, value_delimiter = ',')]
    pub streams: Vec<usize>,
    /// Run the stall scenario instead of pp/tg.
    #[arg(long)]
    pub stall: bool,
    /// Stall scenario: background streams.
    #[arg(long, default_value_t = 4)]
    pub bg: usize,
    /// Stall scenario: tokens in the arriving prompt.
    #[arg(long, default_value_t = 1500)]
    pub arrival: usize,
    /// Stall scenario: prompts arriving one after another (each a new
    /// prompt of --arrival tokens); the table reports the first, and each
    /// later one's largest gap and TTFT are listed after it (what a first
    /// arrival pays once, a later one does not).
    #[arg(long, default_value_t = 1)]
    pub arrivals: usize,
    /// Prompt chunk cap (the whole-pass cuts).
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Per-step row cap while others decode (chunk-invariant models).
    #[arg(long)]
    pub max_rows: Option<usize>,
    /// While others decode, size prefill steps to this fraction of a decode round.
    #[arg(long)]
    pub prefill_share: Option<f32>,
    /// While others decode, keep their inter-token gap under this many
    /// milliseconds (the stall scenario; see `braid serve --help`).
    #[arg(long, value_name = "MS")]
    pub itl_target: Option<f64>,
    /// Print one JSON object on stdout (the results) and nothing else: the
    /// table goes to stderr.
    #[arg(long)]
    pub json: bool,
    /// Benchmark a model made from a preset shape with random weights on
    /// the device (needs no weight files; CUDA builds): decode at each
    /// `--streams` count, a `--pp`-token prefill, and the device's ceilings.
    #[arg(long)]
    pub random_weights: bool,
    /// Shape for --random-weights.
    #[arg(long, default_value = "llama-3.2-1b")]
    pub preset: String,
    /// With a drafter: aggregate decode tokens/s at these stream counts
    /// through a lane, with and without it, side by side (`--tg` tokens
    /// per stream, `--reps` pairs of runs).
    #[arg(long, value_delimiter = ',')]
    pub spec_streams: Vec<usize>,
    #[command(flatten)]
    pub draft: load::DraftArgs,
}

/// A table line: on stdout, or on stderr under `--json` (stdout then holds
/// only the JSON object).
macro_rules! say {
    ($json:expr, $($arg:tt)*) => {
        if $json { eprintln!($($arg)*) } else { println!($($arg)*) }
    };
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.random_weights {
        return random_weights(&a);
    }
    // --ctx sizes the context and KV pool as a peer's benchmark does
    // (llama-bench allocates n_prompt + n_gen per test), for comparable RSS.
    let ctx = match a.model.ctx {
        Some(c) => {
            let need = if a.stall { a.arrival + 64 } else { a.pp.max(a.tg.max(32) + 16) };
            if c < need {
                bail!("--ctx {c} is too short for this benchmark: it needs at least {need} tokens");
            }
            c
        }
        None => (a.pp + a.tg + 16).max(a.arrival + 512).max(2048),
    };
    if !a.spec_streams.is_empty() {
        return spec_streams(&a, ctx);
    }
    let kv = if a.stall { ctx * (a.bg + 2) } else { ctx * a.streams.iter().copied().max().unwrap_or(1).max(1) };
    let m = load::load_with(&a.model, BackendConfig { context: ctx, kv_tokens: kv, max_streams: 64, max_batch: ctx.max(64), ..Default::default() })?;
    say!(a.json, "model: {}  device: {}", m.path.display(), m.device);
    if a.stall {
        return stall(a, m);
    }
    let mut m = m;
    let vocab = m.vocab as u32;
    // Deterministic, varied token ids.
    let tokens: Vec<u32> = (0..a.pp.max(1)).map(|i| (i as u32 * 7919 + 13) % vocab.min(32000)).collect();
    say!(a.json, "| test | tokens/s min | median | max |");
    say!(a.json, "| --- | ---: | ---: | ---: |");
    let mut results = Vec::new();
    if a.pp > 0 {
        let mut rates = timed_runs(&mut m, a.reps, 1000, a.pp, |be, id| {
            be.prefill_step(id, Chunk { start: 0, tokens: &tokens, want_logits: true })?;
            Ok(())
        })?;
        results.push(report(&format!("pp{}", a.pp), &mut rates, a.json));
    }
    if a.tg > 0 {
        let mut rates = timed_runs(&mut m, a.reps, 2000, a.tg, |be, id| {
            let mut tok = 1u32;
            for _ in 0..a.tg {
                tok = greedy_round(be, &[DecodeRow { stream: id, tokens: vec![tok] }])?[0];
            }
            Ok(())
        })?;
        results.push(report(&format!("tg{}", a.tg), &mut rates, a.json));
    }
    for &n in &a.streams {
        let mut rates = Vec::new();
        for r in 0..a.reps.max(1) {
            rates.push(multi_stream(&mut m, n, a.tg.max(32), 3000 + 100 * r as u64)?);
        }
        results.push(report(&format!("decode x{n} streams (aggregate)"), &mut rates, a.json));
    }
    let rss = peak_rss_kib() as f64 / 1024.0;
    say!(a.json, "peak RSS: {rss:.1} MiB");
    if a.json {
        let device = m.device.clone();
        println!("{}", serde_json::json!({"model": m.path.display().to_string(), "device": device, "results": results, "peak_rss_mib": rss}));
    }
    Ok(())
}

/// Tokens per second of `run` over `tokens` tokens, each run on a fresh
/// stream (ids from `first_id`): `reps` (at least one) timed runs after one
/// that warms caches and the pool.
fn timed_runs(m: &mut Loaded, reps: usize, first_id: u64, tokens: usize, mut run: impl FnMut(&mut dyn Backend, u64) -> Result<()>) -> Result<Vec<f64>> {
    let mut rates = Vec::new();
    for r in 0..reps.max(1) + 1 {
        let id = first_id + r as u64;
        m.backend.open(id)?;
        let t = Instant::now();
        run(m.backend.as_mut(), id)?;
        let dt = t.elapsed().as_secs_f64();
        m.backend.forget(id);
        if r > 0 {
            rates.push(tokens as f64 / dt);
        }
    }
    Ok(rates)
}

/// Decode rounds run before `multi_stream` starts its clock.
const WARM_ROUNDS: usize = 8;

/// Aggregate tokens/s of `n` streams decoding `tg` tokens each in shared
/// rounds, each stream first holding a short distinct prompt (then
/// [`WARM_ROUNDS`] untimed rounds).
fn multi_stream(m: &mut Loaded, n: usize, tg: usize, base: u64) -> Result<f64> {
    let ids: Vec<u64> = (0..n as u64).map(|i| base + i).collect();
    for (i, &id) in ids.iter().enumerate() {
        m.backend.open(id)?;
        let prompt: Vec<u32> = (0..8 + i as u32).map(|t| 100 + t * 3 + i as u32).collect();
        m.backend.prefill_step(id, Chunk { start: 0, tokens: &prompt, want_logits: false })?;
    }
    let mut last: Vec<u32> = vec![1; n];
    let mut t = Instant::now();
    for i in 0..WARM_ROUNDS + tg {
        // Untimed rounds first, as gpu_bench and llama-bench warm up: the
        // first rounds at a new batch size record its graphs.
        if i == WARM_ROUNDS {
            t = Instant::now();
        }
        let rows: Vec<DecodeRow> = ids.iter().zip(&last).map(|(&stream, &tok)| DecodeRow { stream, tokens: vec![tok] }).collect();
        last = greedy_round(m.backend.as_mut(), &rows)?;
    }
    let dt = t.elapsed().as_secs_f64();
    for &id in &ids {
        m.backend.forget(id);
    }
    Ok((n * tg) as f64 / dt)
}

/// `--spec-streams`: for each stream count, `--reps` pairs of lane runs
/// (without the drafter and with it, in turns first; a fresh load each, so
/// neither inherits the other's caches), reporting the median aggregate decode
/// tokens/s of each, their ratio and the drafts' acceptance.
fn spec_streams(a: &BenchArgs, ctx: usize) -> Result<()> {
    if a.draft.drafter.is_none() && a.draft.draft_model.is_none() {
        bail!("--spec-streams compares runs with and without a drafter: give --drafter or --draft-model");
    }
    let tg = a.tg.max(8);
    let most = a.spec_streams.iter().copied().max().unwrap_or(1).max(1);
    let cfg = BackendConfig { context: ctx, kv_tokens: ctx * (most + 1), max_streams: most * 2, max_batch: 512.max(most * 16), ..Default::default() };
    say!(a.json, "| streams | plain tokens/s | drafted tokens/s | ratio | end to end: plain | drafted | ratio | drafts accepted | tokens per stream round |");
    say!(a.json, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut results = Vec::new();
    for &n in &a.spec_streams {
        let (mut plain, mut drafted, mut acc, mut prop, mut per_round) = (Vec::new(), Vec::new(), 0, 0, Vec::new());
        let (mut plain_all, mut drafted_all) = (Vec::new(), Vec::new());
        for rep in 0..a.reps.max(1) {
            // The order alternates: the second run of a pair measured ~5%
            // slower whichever it was (a draft model that drafted nothing
            // read 0.93x second, 0.98x first, on 8 streams of the CPU).
            let order = if rep % 2 == 0 { [false, true] } else { [true, false] };
            for with in order {
                let none = load::DraftArgs::default();
                let m = load::load_drafted(&a.model, cfg.clone(), if with { &a.draft } else { &none })?;
                let most = a.draft.max_streams(&m.device);
                let (rate, all, st) = lane_run(m, n, tg, most)?;
                if with {
                    drafted.push(rate);
                    drafted_all.push(all);
                    acc += st.draft_accepted;
                    prop += st.draft_proposed;
                    per_round.push(st.generated_tokens as f64 / st.decode_streams.max(1) as f64);
                } else {
                    plain.push(rate);
                    plain_all.push(all);
                }
            }
        }
        let (p, d, r) = (median(&mut plain), median(&mut drafted), median(&mut per_round));
        let (pa, da) = (median(&mut plain_all), median(&mut drafted_all));
        say!(a.json, "| {n} | {p:.1} | {d:.1} | {:.2}x | {pa:.1} | {da:.1} | {:.2}x | {acc}/{prop} | {r:.2} |", d / p, da / pa);
        results.push(serde_json::json!({"streams": n, "plain": p, "drafted": d, "ratio": d / p, "plain_end_to_end": pa, "drafted_end_to_end": da,
            "accepted": acc, "proposed": prop, "tokens_per_stream_round": r}));
    }
    if a.json {
        println!("{}", serde_json::json!({"model": a.model.model, "spec_streams": results}));
    }
    Ok(())
}

/// Aggregate tokens/s of `n` greedy streams of `tg` tokens through a lane
/// over `m`: while all `n` decode, from the second token of the last stream
/// to start to the end of the first to finish (decode alone, the whole
/// batch: a window to the end of all counted the tail, where early
/// streams had ended, and a drafted run, whose draft model prefills each
/// prompt too, started its last stream later and so had more such tail:
/// a draft model that drafted nothing read 0.88x at 32 streams), and from
/// the submissions to the end (end to end: prompt passes, the draft
/// model's included); and the lane's counters.
fn lane_run(m: Loaded, n: usize, tg: usize, draft_max_streams: usize) -> Result<(f64, f64, braid_engine::LaneStats)> {
    let tasks = ["checks whether a number is prime", "reverses a linked list", "parses a CSV line", "merges two sorted lists"];
    let prompts: Vec<Vec<u32>> = match m.tokenizer() {
        Ok(tok) => (0..n)
            .map(|i| tok.encode(&format!("# Python\n# Write a function that {} (version {i}).\ndef ", tasks[i % tasks.len()]), true))
            .collect::<Result<_>>()?,
        // No tokenizer: distinct token ids, within the vocabulary (a tiny
        // fixture's is 256).
        Err(_) => {
            let vocab = m.vocab.max(1) as u32;
            (0..n).map(|i| (0..24u32).map(|t| (100 + t * 7 + i as u32) % vocab).collect()).collect()
        }
    };
    let config = LaneConfig { max_context: m.context, max_running: n.max(1), draft_max_streams, ..LaneConfig::default() };
    let text: Arc<dyn TokenText> = match m.tokenizer() {
        Ok(t) => Arc::new(TokenizerText(t.clone())),
        Err(_) => Arc::new(braid_engine::fake::FakeText::default()),
    };
    let lane = Lane::spawn_with_drafter(m.backend, m.drafter, text, config);
    let submitted = Instant::now();
    let hs: Vec<_> = prompts
        .into_iter()
        .map(|p| {
            let stop = StopRules { max_tokens: Some(tg), ignore_eos: true, ..StopRules::default() };
            lane.submit(Request { prompt: p, sampling: SamplingParams::greedy(), stop, ..Request::default() })
        })
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("a bench stream was refused: {e}"))?;
    // Time from when every stream has its second token, so prompt passes
    // (which drafting does not change) stay out of the decode figure, the
    // draft model's prefill of the last prompt too (it runs after the
    // round that made that stream's first token).
    let mut seen = vec![0usize; hs.len()];
    let mut firsts = 0;
    let mut start = Instant::now();
    let mut counted = 0usize;
    // When the first stream ended after the window opened.
    let mut end: Option<Instant> = None;
    let mut open: Vec<bool> = vec![true; hs.len()];
    while open.iter().any(|&o| o) {
        for (i, h) in hs.iter().enumerate() {
            if !open[i] {
                continue;
            }
            while let Ok(ev) = h.try_recv() {
                match ev {
                    Event::Token { .. } if firsts < hs.len() && counted == 0 => {
                        seen[i] += 1;
                        firsts += usize::from(seen[i] == 2);
                        if firsts == hs.len() {
                            start = Instant::now();
                            counted = 1;
                        }
                    }
                    Event::Token { .. } if counted > 0 && end.is_none() => counted += 1,
                    Event::Token { .. } => {}
                    Event::Finished { .. } => {
                        open[i] = false;
                        if counted > 0 && end.is_none() {
                            end = Some(Instant::now());
                        }
                    }
                    Event::Error(e) => bail!("a bench stream failed: {e}"),
                    _ => {}
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let secs = end.unwrap_or_else(Instant::now).duration_since(start).as_secs_f64();
    let all = submitted.elapsed().as_secs_f64();
    let stats = lane.stats();
    lane.shutdown();
    Ok(((counted.saturating_sub(1)) as f64 / secs, (n * tg) as f64 / all, stats))
}

/// One greedy round of `rows` as the lane runs it: the tokens picked where
/// the backend picks (on a GPU, the logits stay there and the next round
/// starts before the ids reach the host), else the host's argmax of the
/// logits. Copying every row's logits to the host held 64 streams on the
/// H200 to a tenth of their speed.
fn greedy_round(be: &mut dyn Backend, rows: &[DecodeRow]) -> Result<Vec<u32>> {
    if !be.capabilities().picks.argmax {
        let vocab = be.capabilities().vocab_size;
        return Ok(be.decode_logits(rows)?.chunks_exact(vocab).map(|r| argmax(r) as u32).collect());
    }
    match be.round(Step::new(rows, None, Pick::Argmax))?.picked {
        Picked::Tokens(t) => Ok(t),
        _ => bail!("a greedy round returned no token ids"),
    }
}

fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap_or(0)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One table row; its JSON for `--json`.
fn report(name: &str, rates: &mut [f64], json: bool) -> serde_json::Value {
    let med = median(rates);
    say!(json, "| {name} | {:.1} | {med:.1} | {:.1} |", rates[0], rates[rates.len() - 1]);
    serde_json::json!({"test": name, "tokens_per_s": {"min": rates[0], "median": med, "max": rates[rates.len() - 1]}})
}

/// Peak resident set size of this process, in KiB (Linux; 0 elsewhere).
pub fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

/// Token text for streams whose text nobody reads (random weights, or a
/// model without a tokenizer): every token prints nothing.
struct NoText;
impl TokenText for NoText {
    fn token_bytes(&self, _: u32) -> Vec<u8> {
        Vec::new()
    }
}

/// The stall scenario on one lane. It runs on token ids: a model without a
/// tokenizer runs it too, with no text and no EOS.
fn stall(a: BenchArgs, m: Loaded) -> Result<()> {
    let (text, eos): (Arc<dyn TokenText>, Vec<u32>) = match m.tokenizer() {
        Ok(t) => (Arc::new(TokenizerText(t.clone())), t.stop_ids()),
        Err(_) => (Arc::new(NoText), Vec::new()),
    };
    stall_on(&a, &m.device, m.backend, m.vocab, m.context, text, eos)
}

/// The stall scenario over any backend (a loaded model, or random weights).
fn stall_on(
    a: &BenchArgs,
    device: &str,
    mut backend: Box<dyn Backend>,
    vocab: usize,
    context: usize,
    text: Arc<dyn TokenText>,
    eos_ids: Vec<u32>,
) -> Result<()> {
    // As `braid serve` does: a chunk plus a full decode round in one forward.
    let round_costs = load::warm_up(&mut *backend, device, a.chunk + a.bg + 8)?;
    let vocab = vocab as u32;
    let arrival: Vec<u32> = (0..a.arrival).map(|i| (i as u32 * 7919 + 17) % vocab.min(32000)).collect();
    // Reference: a whole pass of the same prompt on an idle backend.
    let mut whole = Vec::new();
    for r in 0..2 {
        let id = 9000 + r;
        backend.open(id)?;
        let t = Instant::now();
        for (start, chunk) in arrival.chunks(a.chunk).enumerate().map(|(i, c)| (i * a.chunk, c)) {
            backend.prefill_step(id, Chunk { start, tokens: chunk, want_logits: start + chunk.len() == arrival.len() })?;
        }
        whole.push(t.elapsed().as_secs_f64());
        backend.forget(id);
    }
    let whole_s = whole.iter().cloned().fold(f64::INFINITY, f64::min);

    let bg_tokens = context.saturating_sub(64).max(1);
    let mut config = LaneConfig {
        max_context: context,
        eos_ids,
        chunk_tokens: a.chunk,
        prefill_share: a.prefill_share,
        itl_target: load::itl_target(a.itl_target)?,
        max_rows: a.max_rows,
        prefix_marks: 0,
        round_costs,
        ..LaneConfig::default()
    };
    config.max_running = a.bg + 2;
    let lane = Lane::spawn(backend, text, config);
    let greedy = || SamplingParams::greedy();
    // Background streams: token arrival times, recorded by their readers.
    let stop_bg = Arc::new(AtomicBool::new(false));
    let times: Arc<Mutex<Vec<Vec<Instant>>>> = Arc::new(Mutex::new(vec![Vec::new(); a.bg]));
    let mut readers = Vec::new();
    for i in 0..a.bg {
        let prompt: Vec<u32> = (0..16 + i as u32).map(|t| 200 + t * 5 + i as u32).collect();
        let req = Request {
            prompt,
            sampling: greedy(),
            stop: StopRules { max_tokens: Some(bg_tokens), ignore_eos: true, ..StopRules::default() },
            logprobs: None,
            ..Default::default()
        };
        let h = lane.submit(req).context("background stream refused")?;
        let (times, stop) = (times.clone(), stop_bg.clone());
        readers.push(std::thread::spawn(move || {
            for ev in h {
                if let Event::Token { .. } = ev {
                    times.lock().unwrap()[i].push(Instant::now());
                }
                if stop.load(Ordering::Relaxed) {
                    break; // dropping the handle cancels the stream
                }
            }
        }));
    }
    // Let them settle into steady decoding, then measure the usual gap.
    std::thread::sleep(Duration::from_secs(2));
    let usual_from = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    // Each arrival: (arrived, done, time to first token). Later arrivals
    // are new prompts (no prefix to reuse), a second apart.
    let mut spans = Vec::new();
    for n in 0..a.arrivals.max(1) {
        if n > 0 {
            std::thread::sleep(Duration::from_secs(1));
        }
        let prompt: Vec<u32> = arrival.iter().map(|&t| (t + 101 * n as u32) % vocab.min(32000)).collect();
        let arrived = Instant::now();
        let req = Request { prompt, sampling: greedy(), stop: StopRules { max_tokens: Some(1), ..StopRules::default() }, logprobs: None, ..Default::default() };
        let h = lane.submit(req).context("the arriving prompt was refused")?;
        let mut ttft = None;
        for ev in h {
            match ev {
                Event::Token { .. } => {
                    ttft.get_or_insert_with(|| arrived.elapsed());
                }
                Event::Error(e) => bail!("the arriving prompt failed: {e}"),
                _ => {}
            }
        }
        spans.push((arrived, Instant::now(), ttft));
    }
    let (arrived, done, ttft) = spans[0];
    std::thread::sleep(Duration::from_millis(300));
    stop_bg.store(true, Ordering::Relaxed);
    let times = times.lock().unwrap().clone();
    let st = lane.stats();
    eprintln!(
        "plain decode rounds: {} averaging {:.2} ms in the backend (longest {:.2} ms); {} rounds shared with a chunk (longest {:.2} ms)",
        st.plain_rounds,
        st.plain_round_secs / st.plain_rounds.max(1) as f64 * 1e3,
        st.longest_plain_round_secs * 1e3,
        st.fused_rounds,
        st.longest_fused_round_secs * 1e3
    );
    drop(lane);
    for r in readers {
        let _ = r.join();
    }
    let gaps = |from: Instant, to: Instant| -> Vec<f64> {
        let mut g = Vec::new();
        for t in &times {
            for w in t.windows(2) {
                if w[1] > from && w[0] < to {
                    g.push((w[1] - w[0]).as_secs_f64());
                }
            }
        }
        g
    };
    let mut usual = gaps(usual_from, arrived);
    if usual.is_empty() {
        bail!("the background streams produced no tokens");
    }
    let rest_max = usual.iter().cloned().fold(0.0, f64::max);
    let usual_gap = median(&mut usual);
    let mut during = gaps(arrived, done);
    let max_gap = during.iter().cloned().fold(0.0, f64::max);
    let during_median = if during.is_empty() { f64::NAN } else { median(&mut during) };
    let ttft = ttft.map(|d| d.as_secs_f64()).unwrap_or(f64::NAN);
    let later: Vec<(f64, f64)> =
        spans[1..].iter().map(|&(from, to, t)| (gaps(from, to).into_iter().fold(0.0, f64::max) * 1e3, t.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3))).collect();
    say!(a.json, "| stall scenario | value |");
    say!(a.json, "| --- | ---: |");
    say!(a.json, "| background streams | {} |", a.bg);
    say!(a.json, "| arriving prompt | {} tokens |", a.arrival);
    say!(a.json, "| usual inter-token gap (median) | {:.1} ms |", usual_gap * 1e3);
    say!(a.json, "| largest gap before the arrival (3 s, noise floor) | {:.1} ms |", rest_max * 1e3);
    say!(a.json, "| largest gap during the arrival's prefill | {:.1} ms |", max_gap * 1e3);
    say!(a.json, "| median gap during the arrival's prefill | {:.1} ms |", during_median * 1e3);
    say!(a.json, "| stall ratio (largest / usual) | {:.2} |", max_gap / usual_gap);
    say!(a.json, "| newcomer time to first token | {:.0} ms |", ttft * 1e3);
    say!(a.json, "| whole-pass prefill on an idle lane | {:.0} ms |", whole_s * 1e3);
    say!(a.json, "| TTFT / whole pass | {:.2} |", ttft / whole_s);
    for (i, (gap, t)) in later.iter().enumerate() {
        say!(a.json, "| arrival {}: largest gap, TTFT | {gap:.1} ms, {t:.0} ms |", i + 2);
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({"bg_streams": a.bg, "arrival_tokens": a.arrival, "usual_gap_ms": usual_gap * 1e3, "max_gap_ms": max_gap * 1e3, "median_gap_during_ms": during_median * 1e3, "rest_max_gap_ms": rest_max * 1e3,
                "stall_ratio": max_gap / usual_gap, "newcomer_ttft_ms": ttft * 1e3, "whole_pass_ms": whole_s * 1e3, "ttft_over_whole": ttft / whole_s,
                "later_arrivals_max_gap_ttft_ms": later})
        );
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn random_weights(a: &BenchArgs) -> Result<()> {
    use braid_models::gpubench::{bench_llama, GpuBenchOpts};
    let ordinal = match load::device_choice(&a.model.device)? {
        load::DeviceChoice::Cuda(n) => n,
        load::DeviceChoice::Cpu => bail!("--random-weights runs on a CUDA device: pass --device cuda"),
    };
    let dev = braid_ops::cuda::Cuda::new(ordinal)?;
    let cfg = braid_models::random::preset(&a.preset)?;
    let model = braid_models::random::llama(&dev, cfg.clone(), 1, false)?;
    let mut o = GpuBenchOpts::default();
    if !a.streams.is_empty() {
        o.streams = a.streams.clone();
    }
    if a.pp > 0 {
        o.prefill = a.pp;
    }
    if !a.stall {
        let tokens = o.prompt + o.warmup + o.rounds;
        let streams = o.streams.iter().copied().max().unwrap_or(1);
        let mut be = braid_models::gpubench::backend(&dev, Box::new(model), streams, tokens.max(o.prefill))?;
        let rep = bench_llama(&mut be, &cfg, &o, &mut |s| eprintln!("{s}"))?;
        if a.json {
            // The device report is a table; under --json it goes whole
            // into one string field.
            eprintln!("{}", rep.table());
            println!("{}", serde_json::json!({"random_weights": a.preset, "table": rep.table()}));
        } else {
            println!("{}", rep.table());
        }
        return Ok(());
    }
    // The stall scenario on the device: random weights give arbitrary
    // tokens, so the streams ignore EOS and print no text.
    let (vocab, context) = (cfg.vocab, 8192);
    let be = braid_models::ModelBackend::new(
        dev,
        Box::new(model),
        BackendConfig { context, kv_tokens: context * (a.bg + 2), max_streams: 64, max_batch: 4096, ..Default::default() },
    )?;
    let device = braid_ops::Device::name(be.device());
    say!(a.json, "random-weight {} on {device}", a.preset);
    let dev = be.device().clone();
    stall_on(a, &device, Box::new(be), vocab, context, Arc::new(NoText), Vec::new())?;
    let (replays, captures) = dev.graph_stats();
    let (ahead, launched) = dev.ahead_hits();
    eprintln!("graphs: {replays} replays, {captures} captures; rounds prepared ahead {ahead}, of which launched ahead {launched}");
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn random_weights(_: &BenchArgs) -> Result<()> {
    bail!("--random-weights needs a CUDA build: `cargo build --release --features cuda`, then --device cuda")
}
