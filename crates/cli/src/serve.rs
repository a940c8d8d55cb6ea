//! `braid serve`: the OpenAI-compatible server on one lane.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use braid_engine::Lane;
use braid_server::{CacheIsolation, ModelInfo, Server, ServerConfig, TokenizerText};
use clap::{Args, ValueEnum};
use serde_json::{json, Value};

use crate::load;
use crate::run::lane_config;
use crate::ModelArgs;

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
    /// Most streams running at once (prefilling or decoding).
    #[arg(long, default_value_t = 16)]
    pub max_running: usize,
    /// Most requests waiting for a running slot; beyond it, 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// KV memory for all streams together, in tokens.
    #[arg(long, default_value_t = 32768)]
    pub kv_tokens: usize,
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
    /// token sooner. 0 = whole chunks.
    #[arg(long, default_value_t = 0.15)]
    pub prefill_share: f32,
    /// Hold every decoding stream's inter-token gap under this many
    /// milliseconds while a prompt is prefilled beside them: each chunk
    /// gets the most rows a cost model fitted as the server runs allows (at
    /// least one a round). Takes the place of --prefill-share. Where the
    /// decode rounds alone exceed it, the log says so and /metrics counts it.
    #[arg(long, value_name = "MS")]
    pub itl_target: Option<f64>,
    /// Completion budget when a request sets no max_tokens (default: up to the context).
    #[arg(long)]
    pub default_max_tokens: Option<usize>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body: usize,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let path = crate::fetch::resolve(&a.model.model)?;
        let name = a.served_name.clone().unwrap_or_else(|| path.file_stem().and_then(|s| s.to_str()).unwrap_or("braid").to_string());
        let cfg = ServerConfig {
            host: a.host.clone(),
            port: a.port,
            api_keys: a.api_key.iter().filter(|k| !k.is_empty()).cloned().collect(),
            cache_isolation: match a.cache_isolation {
                Isolation::Shared => CacheIsolation::Shared,
                Isolation::PerKey => CacheIsolation::PerKey,
            },
            model_name: name.clone(),
            max_body_bytes: a.max_body,
            default_max_tokens: a.default_max_tokens,
            ..ServerConfig::default()
        };
        // Listen first: /health says 503 until the model is loaded.
        let server = Server::bind(cfg).await?;
        tracing::info!("listening on http://{} (model {name}, loading)", server.local_addr());
        let model_args = a.model.clone();
        let (kv, streams) = (a.kv_tokens, a.max_running);
        let mut m = tokio::task::spawn_blocking(move || {
            load::load_with(&model_args, braid_models::BackendConfig { kv_tokens: kv, max_streams: streams.max(1) * 2, ..Default::default() })
        })
        .await??;
        load::warm_up(&mut *m.backend, &m.device, a.chunk.max(1) + a.max_running.max(1))?;
        let mut config = lane_config(&m);
        config.chunk_tokens = a.chunk.max(1);
        config.max_rows = a.max_rows;
        config.prefill_share = (a.prefill_share > 0.0).then_some(a.prefill_share);
        config.itl_target = load::itl_target(a.itl_target)?;
        config.max_running = a.max_running.max(1);
        config.queue_capacity = a.queue;
        let tokenizer = m.tokenizer()?.clone();
        let info = ModelInfo { tokenizer: tokenizer.clone(), template: m.template, context: m.context, stop_ids: tokenizer.stop_ids() };
        let lane = Lane::spawn(m.backend, Arc::new(TokenizerText(tokenizer)), config);
        server.ready(lane, info);
        tracing::info!("ready: {} on {}", path.display(), server.local_addr());
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
        server.run_until(shutdown_signal()).await
    })?;
    // Give the runtime a moment to drop its connections.
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
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
