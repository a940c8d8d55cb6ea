//! `braid serve`: the OpenAI-compatible server on one lane.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use braid_engine::Lane;
use braid_server::{About, CacheIsolation, ConnLimits, ModelInfo, SamplingDefaults, Server, ServerConfig, TokenizerText};
use clap::{Args, ValueEnum};
use serde_json::{json, Value};

use crate::run::lane_config;
use crate::ModelArgs;
use crate::{about, load};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on. The default answers only this machine.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, short = 'p', default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health
    /// (repeat, or separate with commas, for several clients' keys).
    #[arg(long, env = "BRAID_API_KEY", hide_env_values = true, value_delimiter = ',')]
    pub api_key: Vec<String>,
    /// Who shares cached prompts: `shared` (everyone, per cache_salt) or
    /// `per-key` (each API key its own cache, so no client's cached_tokens
    /// or timing reveal another's prompts).
    #[arg(long, value_enum, default_value_t = Isolation::Shared)]
    pub cache_isolation: Isolation,
    /// Feed prefixes into the prefix cache at start (repeatable): a text
    /// file is one prompt; a .json / .jsonl file holds /v1/warm bodies
    /// ({"prompt": ...} or {"messages": [...]}), one object, an array, or
    /// one per line. Under per-key isolation, every key's cache is warmed.
    #[arg(long, value_name = "FILE")]
    pub warm: Vec<PathBuf>,
    /// The model name clients send (and /v1/models lists); default: the file's name.
    #[arg(long)]
    pub served_name: Option<String>,
    /// Most streams running at once (prefilling or decoding) [default: 16
    /// on the CPU, 64 on a GPU].
    #[arg(long)]
    pub max_running: Option<usize>,
    /// Most requests waiting for a running slot; beyond it, 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// KV memory for all streams together, in tokens [default: 32768 on
    /// the CPU; on a GPU, room for every stream's full context, within half
    /// the device memory the weights leave free].
    #[arg(long)]
    pub kv_tokens: Option<usize>,
    /// Most prompt rows one prefill step runs (smaller: shorter pauses for the others).
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Cap each prefill step to this many rows while other streams decode
    /// (models whose results do not depend on chunking only).
    #[arg(long)]
    pub max_rows: Option<usize>,
    /// While other streams decode, size each prefill step (run inside their
    /// decode round) to add about this fraction to the round: lower keeps
    /// their tokens flowing evenly, higher gives a new prompt its first
    /// token sooner. 0 = whole chunks [default: 0.15 on the CPU; 0.45 on a
    /// GPU, where a step is the largest chunk size the GPU replays whose
    /// round has added at most that].
    #[arg(long)]
    pub prefill_share: Option<f32>,
    /// Hold every decoding stream's inter-token gap under this many
    /// milliseconds while a prompt is prefilled beside them: each chunk
    /// gets the most rows a cost model fitted as the server runs allows (at
    /// least one a round). Takes the place of --prefill-share. Where the
    /// decode rounds alone exceed it, the log says so and /metrics counts it.
    /// On a GPU its chunks beside decode rows go up to 256 rows.
    #[arg(long, value_name = "MS")]
    pub itl_target: Option<f64>,
    /// Completion budget when a request sets no max_tokens (default: up to the context).
    #[arg(long)]
    pub default_max_tokens: Option<usize>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body: usize,
    /// The chat template: a Jinja file, or a built-in name (chatml, llama3,
    /// gemma, plain). Default: chat_template.jinja beside the model, else
    /// the model's own.
    #[arg(long, value_name = "FILE|NAME")]
    pub chat_template: Option<String>,
    /// Answer 400 to request fields the server does not read (by default
    /// they are logged by name and ignored).
    #[arg(long)]
    pub strict: bool,
    /// Serve /metrics without the API key (for a scraper on a trusted network).
    #[arg(long)]
    pub metrics_public: bool,
    #[command(flatten)]
    pub draft: load::DraftArgs,
    /// Draft only for requests that ask (`"speculative": {"method": ...}`);
    /// by default every request drafts unless it asks for `"method": "none"`.
    #[arg(long)]
    pub speculative_opt_in: bool,
    /// When the lane stops after a failure it cannot recover from, load
    /// the model again and serve on (default: exit with an error, for a
    /// supervisor to restart the process; /health says 503 meanwhile).
    #[arg(long)]
    pub restart_lane: bool,
    /// Most choices (prompts × n) one request may ask for; more is a 400.
    /// However many it asks for, a request runs in all but one running
    /// slot at once (an even share while other requests run).
    #[arg(long, default_value_t = 16)]
    pub max_choices: usize,
    /// Seconds a client may take to send a request's headers, and may keep
    /// an idle connection open between requests.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    pub header_timeout: f64,
    /// Seconds a request body may pause between two pieces (408 after).
    #[arg(long, default_value_t = 30.0, value_name = "SECS")]
    pub body_timeout: f64,
    /// Most connections open at once; past it /health still answers and
    /// the rest get 503. Lowered to fit the open-file limit.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Host names clients may reach the server by, besides IP addresses,
    /// localhost and --host (comma-separated; `*`: any). Others get 421,
    /// against DNS rebinding.
    #[arg(long, value_delimiter = ',', value_name = "NAMES")]
    pub allowed_hosts: Vec<String>,
    /// Web origins whose pages may call the API, with CORS headers
    /// (comma-separated, e.g. https://app.example; `*`: any). Requests
    /// from other origins get 403; the server's own pages always may.
    #[arg(long, value_delimiter = ',', value_name = "ORIGINS")]
    pub allowed_origins: Vec<String>,
    /// Fetch http:// image URLs in chat messages (off: only base64 data:
    /// URLs are taken, and the server reaches nothing on a client's behalf).
    #[arg(long)]
    pub allow_image_urls: bool,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    // A worker a core (tokio's default; `TOKIO_WORKER_THREADS` sets it), so
    // a round's frames for many streams go out side by side rather than
    // through two workers. Where the forward takes every core they sleep
    // between rounds; elsewhere one polls while requests run
    // (`ServerConfig::keep_hot`).
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        // An empty key would turn authentication off without a word.
        let empty_env = std::env::var_os("BRAID_API_KEY").is_some_and(|v| v.is_empty());
        if empty_env || a.api_key.iter().any(|k| k.trim().is_empty()) {
            anyhow::bail!("--api-key (or BRAID_API_KEY) holds an empty key: give a key, or unset it to serve without authentication");
        }
        let path = crate::fetch::resolve(&a.model.model)?;
        let name = a.served_name.clone().unwrap_or_else(|| path.file_stem().and_then(|s| s.to_str()).unwrap_or("braid").to_string());
        let sampling = about::sampling_defaults(&path);
        let cfg = ServerConfig {
            host: a.host.clone(),
            port: a.port,
            api_keys: a.api_key.iter().map(|k| k.trim().to_string()).collect(),
            cache_isolation: match a.cache_isolation {
                Isolation::Shared => CacheIsolation::Shared,
                Isolation::PerKey => CacheIsolation::PerKey,
            },
            model_name: name.clone(),
            max_body_bytes: a.max_body,
            default_max_tokens: a.default_max_tokens,
            sampling: sampling.clone(),
            strict: a.strict,
            metrics_public: a.metrics_public,
            allowed_hosts: a.allowed_hosts.clone(),
            allowed_origins: a.allowed_origins.clone(),
            images: braid_server::ImageRules { allow_urls: a.allow_image_urls, duty: image_duty(&a.model)?, ..Default::default() },
            speculative: braid_server::Speculation { method: a.draft.method(), opt_in: a.speculative_opt_in },
            max_n: a.max_choices.max(1),
            max_choices: a.max_choices.max(1),
            conn: ConnLimits {
                header_timeout: secs("--header-timeout", a.header_timeout)?,
                body_timeout: secs("--body-timeout", a.body_timeout)?,
                max_connections: fit_connections(a.max_connections)?,
            },
            keep_hot: !takes_every_core(&a.model)?,
            ..ServerConfig::default()
        };
        // Listen first: /health says 503 until the model is loaded.
        let server = Server::bind(cfg).await?;
        tracing::info!("listening on http://{} (model {name}, loading)", server.local_addr());
        go_live(&server, &a, &path, &name, &sampling).await?;
        let stop = shutdown_signal();
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => return server.shutdown().await,
                _ = server.lane_died() => {
                    if !a.restart_lane {
                        server.shutdown().await?;
                        anyhow::bail!("the lane stopped after a failure (see the log above); pass --restart-lane to load the model again instead");
                    }
                    tracing::warn!("the lane stopped after a failure; loading the model again");
                    go_live(&server, &a, &path, &name, &sampling).await?;
                }
            }
        }
    })?;
    // Give the runtime a moment to drop its connections.
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// Load the model, start its lane and serve it: `/props` tells what was
/// loaded, the log says it is ready, and the `--warm` files are fed (again,
/// after a restart: the cache went with the lane).
async fn go_live(server: &Server, a: &ServeArgs, path: &Path, name: &str, sampling: &SamplingDefaults) -> Result<()> {
    let (lane, info, summary) = start_lane(a, path).await?;
    let Summary { template, device, context, architecture, parameters, kv_pool_tokens } = summary;
    server.set_about(About {
        path: path.display().to_string(),
        architecture: architecture.clone(),
        parameters,
        device: device.clone(),
        template: template.clone(),
    });
    // Ready before the line says so: a client that reads it may ask at once.
    server.ready(lane, info);
    tracing::info!(
        model = %name,
        architecture = %architecture,
        parameters = %about::short_count(parameters),
        context,
        kv_pool_tokens,
        template = %template,
        sampling = format!("temperature {} top_k {} top_p {} min_p {} ({})", sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.source),
        device = %device,
        "ready on http://{}",
        server.local_addr()
    );
    // Under per-key isolation each key has its own cache to warm.
    let keys: Vec<Option<&str>> = match a.cache_isolation {
        Isolation::PerKey if !a.api_key.is_empty() => a.api_key.iter().map(|k| Some(k.as_str())).collect(),
        _ => vec![None],
    };
    for file in &a.warm {
        for body in warm_bodies(file)? {
            for &key in &keys {
                let out = server.warm(&body, key).await.map_err(|e| anyhow::anyhow!("{}: {}", file.display(), e.message))?;
                tracing::info!("warmed {} tokens from {} ({} were cached)", out["prompt_tokens"], file.display(), out["cached_tokens"]);
            }
        }
    }
    Ok(())
}

/// The most of a core a request's image decoding takes at a time: a
/// quarter where the forward takes every core. There a round waits on the
/// slowest of its threads, and an image decoded in one burst (tens of ms)
/// beside it took a round on two cores from 21 ms to 43-59 (paced:
/// 25-49); with spare cores or a GPU, all it gets.
fn image_duty(m: &ModelArgs) -> Result<f64> {
    Ok(if takes_every_core(m)? { 0.25 } else { 1.0 })
}

/// Whether the model runs on the CPU with a thread on every core: then
/// nothing else may keep a core busy (no hot async worker, image decoding
/// paced).
fn takes_every_core(m: &ModelArgs) -> Result<bool> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok(crate::load::device_choice(&m.device)? == crate::load::DeviceChoice::Cpu && m.threads.is_none_or(|t| t >= cores))
}

/// A timeout flag's value.
fn secs(flag: &str, v: f64) -> Result<Duration> {
    if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
        anyhow::bail!("{flag} must be between 0 and 86400 seconds, got {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

/// File descriptors kept for the model files, the reserve connections
/// that answer /health past the cap, and the rest of the process.
const SPARE_FILES: usize = 64;

/// `--max-connections`, after raising the open-file limit as far as the
/// system allows: lowered to fit it, so that accepting never runs out of
/// file descriptors (and /health stays reachable).
fn fit_connections(want: usize) -> Result<usize> {
    if want == 0 {
        anyhow::bail!("--max-connections must be at least 1");
    }
    let Some(files) = raise_file_limit() else { return Ok(want) };
    let fit = files.saturating_sub(SPARE_FILES).max(1);
    if fit < want {
        tracing::warn!("--max-connections lowered from {want} to {fit} to fit the open-file limit of {files}");
    }
    Ok(want.min(fit))
}

/// Raises this process's soft open-file limit to the hard one; the limit
/// in effect.
#[cfg(unix)]
fn raise_file_limit() -> Option<usize> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit only read and write the struct given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    usize::try_from(lim.rlim_cur).ok()
}

#[cfg(not(unix))]
fn raise_file_limit() -> Option<usize> {
    None
}

/// What the start-up summary and `/props` say of the model loaded.
struct Summary {
    template: String,
    device: String,
    context: usize,
    architecture: String,
    parameters: u64,
    kv_pool_tokens: usize,
}

/// Loads the model (and its drafter) and starts its lane.
async fn start_lane(a: &ServeArgs, path: &Path) -> Result<(Lane, ModelInfo, Summary)> {
    let model_args = a.model.clone();
    let gpu = load::device_choice(&a.model.device)? != load::DeviceChoice::Cpu;
    let streams = a.max_running.unwrap_or(if gpu { 64 } else { 16 }).max(1);
    // 0: the loader sizes the pool to the device's free memory.
    let kv = a.kv_tokens.unwrap_or(if gpu { 0 } else { load::HOST_KV_TOKENS });
    let draft = a.draft.clone();
    // A round holds every decoding stream's row and one prompt chunk.
    let max_batch = a.chunk.max(1) + streams;
    let mut m = tokio::task::spawn_blocking(move || {
        let cfg = braid_models::BackendConfig { kv_tokens: kv, max_streams: streams * 2, max_batch, ..Default::default() };
        load::load_drafted(&model_args, cfg, &draft)
    })
    .await??;
    let template = about::choose_template(&mut m, a.chat_template.as_deref())?;
    if m.template.is_none() {
        tracing::warn!(
            "{} has no chat template (a base model?): /v1/chat/completions and /v1/responses answer 400; \
             /v1/completions works. Pass --chat-template FILE|NAME to chat with it.",
            path.display()
        );
    }
    let round_costs = load::warm_up(&mut *m.backend, &m.device, max_batch)?;
    let mut config = lane_config(&m);
    config.round_costs = round_costs;
    config.chunk_tokens = a.chunk.max(1);
    config.max_rows = a.max_rows;
    // On a GPU the share counts a chunk's whole cost (on the H100, Llama-1B's
    // shape beside six streams: 48 rows add ~0.45 of a plain round, 64 rows
    // ~0.5): the promise's 1.5x, with room for noise. On the CPU a chunk row
    // costs what a decode row does, so a larger share slows the others more.
    let share = a.prefill_share.unwrap_or(if gpu { 0.45 } else { 0.15 });
    config.prefill_share = (share > 0.0).then_some(share);
    config.itl_target = load::itl_target(a.itl_target)?;
    config.max_running = streams;
    config.queue_capacity = a.queue;
    config.draft_max_streams = a.draft.max_streams(&m.device);
    let tokenizer = m.tokenizer()?.clone();
    let info = ModelInfo { tokenizer: tokenizer.clone(), template: m.template, context: m.context, stop_ids: tokenizer.stop_ids(), vision: m.vision };
    let (device, context) = (m.device.clone(), m.context);
    let lane = Lane::spawn_with_drafter(m.backend, m.drafter, Arc::new(TokenizerText(tokenizer)), config);
    let fill = lane.stats().fill;
    let (architecture, parameters) = about::architecture_and_parameters(path);
    let summary = Summary { template: template.to_string(), device, context, architecture, parameters, kv_pool_tokens: fill.blocks_total * fill.block_tokens };
    Ok((lane, info, summary))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Isolation {
    Shared,
    PerKey,
}

/// The /v1/warm bodies of a `--warm` file.
fn warm_bodies(file: &Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(file).with_context(|| format!("could not read the warm file {}", file.display()))?;
    let json = matches!(file.extension().and_then(|e| e.to_str()), Some("json" | "jsonl"));
    if !json {
        return Ok(vec![json!({ "prompt": text })]);
    }
    let bad = |e: serde_json::Error| anyhow::anyhow!("{}: not JSON /v1/warm bodies: {e}", file.display());
    let bodies = match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(items)) => items,
        Ok(one) => vec![one],
        // JSON lines: one body per non-blank line.
        Err(_) => text.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).map_err(bad)).collect::<Result<_>>()?,
    };
    Ok(bodies)
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}
