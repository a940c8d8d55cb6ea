//! braid's OpenAI-compatible HTTP server over a lane.
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions` (SSE
//! streaming or not), `GET /v1/models`, `GET /health`, `GET /metrics`.
//! The server knows streams and lanes, never tensors: it validates a
//! request, renders and tokenizes the prompt, submits one lane stream per
//! choice, and turns the lane's events into OpenAI-shaped JSON. A client
//! that leaves cancels its streams.
//!
//! ```no_run
//! # async fn example(lane: braid_engine::Lane, model: braid_server::ModelInfo) -> anyhow::Result<()> {
//! let cfg = braid_server::ServerConfig { model_name: "smollm2".into(), ..Default::default() };
//! braid_server::serve(cfg, lane, model, async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```

mod api;
mod error;
mod generate;
mod lane;
mod metrics;
mod params;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use braid_formats::template::{ChatMessage, ChatTemplate};
use braid_formats::tokenizer::Tokenizer;
use serde_json::json;
use tokio::sync::{oneshot, watch};

pub use error::ApiError;
pub use generate::{Finish, GenEvent, GenRequest, Generator, LaneNumbers, Refusal, Sampling, Sink, Ticket};
pub use lane::{LaneGenerator, TokenizerText};

/// How the server listens and what it accepts.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to bind; loopback by default, so nothing outside the machine
    /// reaches the server unless asked.
    pub host: String,
    /// `0` picks a free port (see [`Server::local_addr`]).
    pub port: u16,
    /// When set, every route but `/health` needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// The model name clients must use (`model` field) and `/v1/models` lists.
    pub model_name: String,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// Largest `n` (choices per prompt) a request may ask for.
    pub max_n: usize,
    /// Completion budget when a request gives no `max_tokens` (`None`: up
    /// to the end of the context).
    pub default_max_tokens: Option<usize>,
    /// At shutdown, how long running streams may take to finish before
    /// they are cancelled.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            model_name: "braid".into(),
            max_body_bytes: 4 << 20,
            max_n: 16,
            default_max_tokens: None,
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// What the server needs to know of the loaded model.
pub struct ModelInfo {
    pub tokenizer: Arc<Tokenizer>,
    /// `None`: chat requests get a 400; completions still work.
    pub template: Option<ChatTemplate>,
    /// Longest stream (prompt + completion), in tokens.
    pub context: usize,
    /// Tokens that end a generation (the tokenizer's EOS/EOT ids). The
    /// lane's own `LaneConfig::eos_ids` normally do this; these are sent
    /// with each request (unless it sets `ignore_eos`) only when the lane
    /// was spawned without any.
    pub stop_ids: Vec<u32>,
}

/// The loaded model: its lane and what the server needs to know of it.
#[derive(Clone)]
pub(crate) struct Loaded {
    pub(crate) gen: Arc<dyn Generator>,
    pub(crate) info: Arc<ModelInfo>,
}

/// State every handler shares.
pub(crate) struct App {
    pub(crate) cfg: ServerConfig,
    loaded: RwLock<Option<Loaded>>,
    pub(crate) metrics: metrics::Metrics,
    /// Set to true to end every running stream (shutdown after the grace).
    pub(crate) cancel: watch::Sender<bool>,
    started: u64,
}

impl App {
    pub(crate) fn loaded(&self) -> Result<Loaded, ApiError> {
        self.loaded.read().unwrap_or_else(|e| e.into_inner()).clone().ok_or_else(|| ApiError::unavailable("The model is still loading."))
    }
}

/// Renders a chat with the model's template and tokenizes it.
pub(crate) fn chat_prompt(info: &ModelInfo, messages: &[params::Message]) -> Result<Vec<u32>, ApiError> {
    let Some(template) = &info.template else {
        return Err(ApiError::invalid(
            "This model has no chat template, so /v1/chat/completions cannot format messages; \
             use /v1/completions with a prompt instead.",
        )
        .with_code("no_chat_template"));
    };
    let messages: Vec<ChatMessage> = messages.iter().map(|m| ChatMessage::new(&m.role, &m.content)).collect();
    let text =
        template.render(&messages, true).map_err(|e| ApiError::param("messages", format!("The chat template could not render these messages: {e:#}")))?;
    // Templates usually write the BOS token themselves; add it only when
    // the text does not already start with it.
    let tok = &info.tokenizer;
    let has_bos = tok.bos().and_then(|b| tok.token_text(b)).is_some_and(|b| !b.is_empty() && text.starts_with(b));
    tok.encode(&text, !has_bos).map_err(|e| ApiError::param("messages", format!("Could not tokenize the rendered chat: {e:#}")))
}

/// A bound, running server. Serves `/health` (503) and `/metrics` at once;
/// generation starts once [`Server::ready`] hands it the model.
pub struct Server {
    addr: SocketAddr,
    app: Arc<App>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// Binds `cfg.host:cfg.port` and starts serving. Call from a tokio runtime.
    pub async fn bind(cfg: ServerConfig) -> anyhow::Result<Server> {
        let listener =
            tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port)).await.with_context(|| format!("could not listen on {}:{}", cfg.host, cfg.port))?;
        let addr = listener.local_addr()?;
        let app = Arc::new(App {
            loaded: RwLock::new(None),
            metrics: metrics::Metrics::default(),
            cancel: watch::Sender::new(false),
            started: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            cfg,
        });
        let router = router(app.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
        });
        tracing::info!("listening on http://{addr}");
        Ok(Server { addr, app, stop: Some(stop), task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The model is loaded: start generating with `lane`.
    /// The model is loaded: start generating with `lane`. The context
    /// checked per request is `model.context` capped by the lane's own.
    pub fn ready(&self, lane: braid_engine::Lane, mut model: ModelInfo) {
        let gen = LaneGenerator::new(lane, &model.stop_ids);
        if let Some(c) = gen.max_context() {
            model.context = model.context.min(c);
        }
        self.ready_with(Arc::new(gen), model);
    }

    /// Like [`ready`](Self::ready) with any [`Generator`] (tests use fakes).
    pub fn ready_with(&self, gen: Arc<dyn Generator>, model: ModelInfo) {
        *self.app.loaded.write().unwrap_or_else(|e| e.into_inner()) = Some(Loaded { gen, info: Arc::new(model) });
        tracing::info!(model = %self.app.cfg.model_name, "model ready");
    }

    /// Graceful shutdown: stop accepting, let running streams finish for up
    /// to `shutdown_grace`, cancel the rest, stop the lane.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let grace = self.app.cfg.shutdown_grace;
        let result = match tokio::time::timeout(grace, &mut self.task).await {
            Ok(r) => r,
            Err(_) => {
                tracing::info!("shutdown: cancelling the streams still running");
                self.app.cancel.send_replace(true);
                (&mut self.task).await
            }
        };
        let loaded = self.app.loaded.write().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(l) = loaded {
            // Stopping the lane joins its thread: keep it off the runtime.
            tokio::task::spawn_blocking(move || l.gen.shutdown()).await.context("the lane's shutdown panicked")?;
        }
        result.context("the server task panicked")?.context("the server failed")?;
        tracing::info!("server stopped");
        Ok(())
    }

    /// Serve until `signal` resolves, then shut down gracefully.
    pub async fn run_until(self, signal: impl Future<Output = ()>) -> anyhow::Result<()> {
        signal.await;
        self.shutdown().await
    }
}

/// Binds, serves `lane` until `shutdown` resolves, then shuts down
/// gracefully. For `/health` to answer 503 while the model loads, use
/// [`Server::bind`] first and [`Server::ready`] once loaded.
pub async fn serve(cfg: ServerConfig, lane: braid_engine::Lane, model: ModelInfo, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let server = Server::bind(cfg).await?;
    server.ready(lane, model);
    server.run_until(shutdown).await
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(api::chat))
        .route("/v1/completions", post(api::completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(|| async { ApiError::not_found("Unknown route.") })
        .method_not_allowed_fallback(|| async { ApiError { status: StatusCode::METHOD_NOT_ALLOWED, ..ApiError::invalid("Method not allowed on this route.") } })
        .layer(DefaultBodyLimit::max(app.cfg.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(app.clone(), gate))
        .with_state(app)
}

/// Route label for metrics (bounded: unknown paths share one label).
fn route_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/models" => "/v1/models",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        "/health" => "/health",
        "/metrics" => "/metrics",
        _ => "other",
    }
}

/// Every request passes here: the API key check, then the count by status.
async fn gate(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let route = route_label(req.uri().path());
    let res = match &app.cfg.api_key {
        Some(key) if route != "/health" && !authorized(&req, key) => ApiError::unauthorized().into_response(),
        _ => next.run(req).await,
    };
    app.metrics.request(route, res.status().as_u16());
    res
}

fn authorized(req: &Request, key: &str) -> bool {
    let Some(value) = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some(given) = value.strip_prefix("Bearer ").or_else(|| value.strip_prefix("bearer ")) else {
        return false;
    };
    // Compare in time independent of where the first difference is.
    let (a, b) = (given.trim().as_bytes(), key.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn model_entry(app: &App) -> serde_json::Value {
    let context = app.loaded().ok().map(|l| l.info.context);
    json!({
        "id": app.cfg.model_name,
        "object": "model",
        "created": app.started,
        "owned_by": "braid",
        "max_model_len": context,
    })
}

async fn models(State(app): State<Arc<App>>) -> Response {
    Json(json!({"object": "list", "data": [model_entry(&app)]})).into_response()
}

async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if id != app.cfg.model_name {
        return ApiError::model_not_found(&id, &app.cfg.model_name).into_response();
    }
    Json(model_entry(&app)).into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.loaded().is_ok() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        let mut res = (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading"}))).into_response();
        res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(1));
        res
    }
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    let numbers = app.loaded().ok().map(|l| l.gen.numbers());
    let text = app.metrics.render(numbers.as_ref());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}
