//! `braid serve`: the OpenAI-compatible server on one lane.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use braid_engine::Lane;
use braid_server::{ModelInfo, Server, ServerConfig, TokenizerText};
use clap::Args;

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
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, env = "BRAID_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
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
            api_key: a.api_key.clone().filter(|k| !k.is_empty()),
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
        config.max_running = a.max_running.max(1);
        config.queue_capacity = a.queue;
        let info = ModelInfo { tokenizer: m.tokenizer.clone(), template: m.template, context: m.context, stop_ids: m.tokenizer.stop_ids() };
        let lane = Lane::spawn(m.backend, Arc::new(TokenizerText(m.tokenizer.clone())), config);
        server.ready(lane, info);
        tracing::info!("ready: {} on {}", path.display(), server.local_addr());
        server.run_until(shutdown_signal()).await
    })?;
    // Give the runtime a moment to drop its connections.
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
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
