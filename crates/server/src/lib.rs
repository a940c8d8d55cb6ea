//! braid's OpenAI-compatible HTTP server over a lane.
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions` (SSE
//! streaming or not; structured outputs and tool calls, see `guide` and
//! `tools`), `POST /v1/warm` (a prefix into the prefix cache, no
//! completion), `POST /tokenize` and `/detokenize` (llama.cpp's shapes),
//! `GET /v1/models`, `GET /health`, `GET /metrics`; `POST /v1/responses`
//! (the stateless subset, over the chat path), `GET /props`, `POST
//! /v1/embeddings` (a 400 until an embedding model can be loaded), and a
//! chat page at `/`. Every answer carries an `x-request-id` (the client's,
//! or one made here), which the request's log lines name.
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
mod defaults;
mod error;
mod fields;
mod guard;
mod guide;
mod images;
mod lane;
mod listen;
mod logsafe;
mod metrics;
mod page;
mod params;
mod props;
mod responses;
mod sse;
mod tokenize;
mod tools;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use braid_formats::template::ChatTemplate;
use braid_formats::tokenizer::Tokenizer;
use serde_json::json;
use tokio::sync::{oneshot, watch};

pub use defaults::SamplingDefaults;
pub use error::ApiError;
pub use images::{image_block, ImageRules, VisionInfo};

/// Fuzz targets (see `braid_formats::fuzz`): arbitrary bytes in, never a panic.
#[doc(hidden)]
pub mod fuzz {
    /// A request body through every endpoint's validation, and the
    /// `Host` / `Origin` checks on its text.
    pub fn request(data: &[u8]) {
        let text = String::from_utf8_lossy(data);
        let _ = crate::guard::host_allowed(&text, "127.0.0.1", &["box.lan".into()]);
        let _ = crate::guard::origin_allowed(&text, Some("127.0.0.1:8080"), &["https://app.example".into()]);
        let _ = crate::logsafe::clip(&text);
        let Ok(map) = crate::params::parse_object(data) else { return };
        let _ = crate::params::parse_chat(&map, 16);
        let _ = crate::params::parse_completion(&map, 16);
        let _ = crate::params::parse_warm(&map);
    }
}
pub use lane::{Generator, Ticket, TokenizerText};
pub use listen::ConnLimits;
pub use props::About;

/// How the server listens and what it accepts.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to bind; loopback by default, so nothing outside the machine
    /// reaches the server unless asked.
    pub host: String,
    /// `0` picks a free port (see [`Server::local_addr`]).
    pub port: u16,
    /// When not empty, every route but `/health` needs
    /// `Authorization: Bearer <key>` with one of these keys.
    pub api_keys: Vec<String>,
    /// Whether clients with different API keys share cached prompts.
    pub cache_isolation: CacheIsolation,
    /// The model name clients must use (`model` field) and `/v1/models` lists.
    pub model_name: String,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// Largest `n` (choices per prompt) a request may ask for.
    pub max_n: usize,
    /// Most choices (prompts × `n`) one request may ask for.
    pub max_choices: usize,
    /// Completion budget when a request gives no `max_tokens` (`None`: up
    /// to the end of the context).
    pub default_max_tokens: Option<usize>,
    /// At shutdown, how long running streams may take to finish before
    /// they are cancelled.
    pub shutdown_grace: Duration,
    /// What a request samples with for the fields it leaves out.
    pub sampling: SamplingDefaults,
    /// Refuse (400) request fields the server does not read, rather than
    /// log and ignore them.
    pub strict: bool,
    /// Serve `/metrics` without the API key.
    pub metrics_public: bool,
    /// Timeouts and the connection cap.
    pub conn: ConnLimits,
    /// `Host` names answered besides IP addresses, `localhost` and `host`
    /// (`*`: any), against DNS rebinding.
    pub allowed_hosts: Vec<String>,
    /// Web origins (`https://app.example`) whose pages may call the API,
    /// with CORS (`*`: any); others get 403. The server's own pages always may.
    pub allowed_origins: Vec<String>,
    /// How images in chat messages may arrive, and how large.
    pub images: images::ImageRules,
    /// The lane's speculative drafter and who uses it.
    pub speculative: Speculation,
    /// While requests run, keep one async worker polling rather than
    /// asleep, so a round's tokens leave as it ends instead of after a
    /// sleeping thread wakes (on a virtual machine, waking an idle core
    /// took 0.1-0.3 ms: gaps of 1.2-1.3 ms behind even 1 ms rounds). It
    /// costs a core while requests run: for a model that leaves one free
    /// (on a GPU, or on fewer CPU threads than cores).
    pub keep_hot: bool,
}

/// What `"speculative"` in a request may ask for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Speculation {
    /// The lane's drafter: `ngram`, `draft` (a draft model), `dflash` or
    /// `dspark`; `None`: there is none.
    pub method: Option<String>,
    /// Only requests that ask (`"speculative": {"method": ...}`) draft;
    /// otherwise every request does unless it says `"method": "none"`.
    pub opt_in: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_keys: Vec::new(),
            cache_isolation: CacheIsolation::Shared,
            model_name: "braid".into(),
            max_body_bytes: 4 << 20,
            max_n: 16,
            max_choices: 16,
            default_max_tokens: None,
            shutdown_grace: Duration::from_secs(10),
            sampling: SamplingDefaults::default(),
            strict: false,
            metrics_public: false,
            conn: ConnLimits::default(),
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            images: images::ImageRules::default(),
            speculative: Speculation::default(),
            keep_hot: false,
        }
    }
}

/// [`ServerConfig::keep_hot`]: while requests run, yield in a loop, so
/// the worker running this polls for woken tasks instead of parking.
async fn keep_hot(app: Arc<App>) {
    let mut stop = app.cancel.subscribe();
    while !*stop.borrow() {
        if app.active.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            // A permit stored by a request that started before we wait
            // wakes this at once.
            tokio::select! {
                _ = app.busy.notified() => {}
                _ = stop.changed() => {}
            }
        } else {
            tokio::task::yield_now().await;
        }
    }
}

/// Who shares the prefix cache. Requests also name their own cache with
/// `cache_salt`; isolation comes on top of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CacheIsolation {
    /// Every client (of one salt) shares cached prompts.
    #[default]
    Shared,
    /// Each bearer token has a cache of its own: one client's
    /// `cached_tokens` and timing tell nothing of another's prompts.
    PerKey,
}

/// The lane's cache salt of a request: its `cache_salt`, under its bearer
/// token when caches are kept per key (0, the shared cache, when neither).
pub(crate) fn cache_salt(cfg: &ServerConfig, headers: &HeaderMap, salt: Option<&str>) -> u64 {
    use std::hash::{Hash, Hasher};
    let key = match cfg.cache_isolation {
        CacheIsolation::PerKey => headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer),
        CacheIsolation::Shared => None,
    };
    if key.is_none() && salt.is_none() {
        return 0;
    }
    // SipHash with fixed keys: the same salt maps the same way for the
    // process's life, and one salt cannot be made to collide with another.
    let mut h = std::hash::DefaultHasher::new();
    (key, salt).hash(&mut h);
    h.finish().max(1)
}

/// What the server needs to know of the loaded model.
pub struct ModelInfo {
    pub tokenizer: Arc<Tokenizer>,
    /// `None`: chat requests get a 400; completions still work.
    pub template: Option<ChatTemplate>,
    /// Longest stream (prompt + completion), in tokens.
    pub context: usize,
    /// Tokens that end a generation (the tokenizer's EOS/EOT ids), sent
    /// with each request unless it sets `ignore_eos`. The lane's own
    /// `LaneConfig::eos_ids` normally do this, so [`Server::ready`] sends
    /// these only to a lane spawned without any.
    pub stop_ids: Vec<u32>,
    /// How the model takes images (`None`: it takes none).
    pub vision: Option<images::VisionInfo>,
}

/// The loaded model: its lane and what the server needs to know of it.
#[derive(Clone)]
pub(crate) struct Loaded {
    pub(crate) gen: Arc<dyn Generator>,
    pub(crate) info: Arc<ModelInfo>,
    /// The vocabulary as grammars see it, built by the first request that
    /// needs one (it takes a moment for a large vocabulary).
    grammars: Arc<OnceLock<Result<Arc<guide::Grammars>, String>>>,
}

impl Loaded {
    /// The grammar compiler (call off the async workers: the first call
    /// builds it).
    pub(crate) fn grammars(&self) -> Result<Arc<guide::Grammars>, ApiError> {
        let built = self.grammars.get_or_init(|| {
            let tok = &self.info.tokenizer;
            guide::Grammars::new(tok, &tok.stop_ids()).map(Arc::new).map_err(|e| format!("{e:#}"))
        });
        built.clone().map_err(|e| ApiError::internal(format!("Structured output is not available for this model's vocabulary: {e}")))
    }
}

/// State every handler shares.
pub(crate) struct App {
    pub(crate) cfg: ServerConfig,
    loaded: RwLock<Option<Loaded>>,
    pub(crate) metrics: metrics::Metrics,
    /// Set to true to end every running stream (shutdown after the grace).
    pub(crate) cancel: watch::Sender<bool>,
    /// Generation requests in progress (their choices share the lane).
    pub(crate) active: std::sync::atomic::AtomicUsize,
    /// Told when `active` leaves zero (see [`keep_hot`]).
    pub(crate) busy: tokio::sync::Notify,
    started: u64,
    /// What `/props` tells of the model beyond `ModelInfo`.
    about: RwLock<About>,
}

impl App {
    pub(crate) fn loaded(&self) -> Result<Loaded, ApiError> {
        self.loaded.read().unwrap_or_else(|e| e.into_inner()).clone().ok_or_else(|| ApiError::unavailable("The model is still loading."))
    }
}

/// A chat's prompt: its tokens with its images placed, and where its
/// leading system turns end, when the rendered chat starts with them as
/// rendered alone: a boundary that later chats with the same system prompt
/// share (a place for a mark).
pub(crate) struct ChatPrompt {
    pub tokens: Vec<u32>,
    pub hint: Option<usize>,
    pub images: Vec<braid_engine::PromptImage>,
}

/// Renders and tokenizes `messages` (see [`render_chat`]), decoding their
/// images as `rules` allow.
pub(crate) fn chat_prompt(
    info: &ModelInfo,
    messages: &[params::Message],
    tools: Option<&tools::Toolset>,
    kwargs: &serde_json::Map<String, serde_json::Value>,
    generation: bool,
    rules: &images::ImageRules,
) -> Result<ChatPrompt, ApiError> {
    let decoded = images::decode_all(info, messages, rules)?;
    let (tokens, placed) = render_chat(info, messages, tools, kwargs, generation, &decoded)?;
    let system = messages.iter().take_while(|m| m.role == "system").count();
    if system == 0 || system == messages.len() {
        return Ok(ChatPrompt { tokens, hint: None, images: placed });
    }
    let (head, _) = render_chat(info, &messages[..system], tools, kwargs, false, &decoded)?;
    let hint = (!head.is_empty() && tokens.starts_with(&head)).then_some(head.len());
    Ok(ChatPrompt { tokens, hint, images: placed })
}

/// Renders `messages` (with `tools`) with the model's template and
/// tokenizes them, with `kwargs` (`chat_template_kwargs`) as extra
/// template variables; `generation`: open the assistant's turn after them.
/// The messages' images (`decoded`, in order) are placed where they stood.
pub(crate) fn render_chat(
    info: &ModelInfo,
    messages: &[params::Message],
    tools: Option<&tools::Toolset>,
    kwargs: &serde_json::Map<String, serde_json::Value>,
    generation: bool,
    decoded: &[images::Decoded],
) -> Result<(Vec<u32>, Vec<braid_engine::PromptImage>), ApiError> {
    let Some(template) = &info.template else {
        return Err(ApiError::invalid(
            "This model has no chat template (a base model?), so it cannot format chat messages; \
             use /v1/completions with a prompt, or start the server with --chat-template FILE|NAME.",
        )
        .with_code("no_chat_template"));
    };
    let (messages, mut vars) = match tools {
        Some(t) => (t.messages(messages), t.template_vars()),
        None => (messages.iter().map(tools::message_value).collect(), serde_json::Map::new()),
    };
    for (k, v) in kwargs {
        vars.entry(k.clone()).or_insert_with(|| v.clone());
    }
    // Every string the client sent is quoted, so only the template's own
    // markup becomes control tokens: no message can forge a turn.
    let tok = &info.tokenizer;
    let messages: Vec<serde_json::Value> = messages.into_iter().map(|m| quoted(tok, m)).collect();
    let vars: serde_json::Map<String, serde_json::Value> = vars.into_iter().map(|(k, v)| (k, quoted(tok, v))).collect();
    let text = template
        .render_with(&messages, generation, &vars)
        .map_err(|e| ApiError::param("messages", format!("The chat template could not render these messages: {e:#}")))?;
    // Templates usually write the BOS token themselves; add it only when
    // the text does not already start with it.
    let has_bos = tok.bos().and_then(|b| tok.token_text(b)).is_some_and(|b| !b.is_empty() && text.starts_with(b));
    let encode = |piece: &str, special: bool| {
        tok.encode_rendered(piece, special).map_err(|e| ApiError::param("messages", format!("Could not tokenize the rendered chat: {e:#}")))
    };
    images::place(info, &text, decoded, &encode, !has_bos)
}

/// `v` with every string in it (keys too) quoted by the tokenizer.
fn quoted(tok: &Tokenizer, v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::String(s) => Value::String(tok.quote(&s).into_owned()),
        Value::Array(a) => Value::Array(a.into_iter().map(|x| quoted(tok, x)).collect()),
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, x)| (tok.quote(&k).into_owned(), quoted(tok, x))).collect()),
        other => other,
    }
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
            active: Default::default(),
            busy: tokio::sync::Notify::new(),
            started: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            about: RwLock::new(About::default()),
            cfg,
        });
        let router = router(app.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(listen::serve(listener, router, app.cfg.conn, stopped));
        if app.cfg.keep_hot {
            tokio::spawn(keep_hot(app.clone()));
        }
        tracing::info!("listening on http://{addr}");
        Ok(Server { addr, app, stop: Some(stop), task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The model is loaded: start generating with `lane`. The context
    /// checked per request is `model.context` capped by the lane's own.
    pub fn ready(&self, lane: braid_engine::Lane, mut model: ModelInfo) {
        model.context = model.context.min(lane.max_context());
        if !lane.config().eos_ids.is_empty() {
            model.stop_ids.clear();
        }
        self.ready_with(Arc::new(lane), model);
    }

    /// Like [`ready`](Self::ready) with any [`Generator`] (tests use
    /// fakes); `model` is taken as it is, `stop_ids` included.
    pub fn ready_with(&self, gen: Arc<dyn Generator>, model: ModelInfo) {
        *self.app.loaded.write().unwrap_or_else(|e| e.into_inner()) = Some(Loaded { gen, info: Arc::new(model), grammars: Arc::default() });
        tracing::info!(model = %self.app.cfg.model_name, "model ready");
    }

    /// What `/props` reports of the model (architecture, device, where
    /// the template came from, ...).
    pub fn set_about(&self, about: About) {
        *self.app.about.write().unwrap_or_else(|e| e.into_inner()) = about;
    }

    /// Resolves once the lane serving the model has stopped for good after
    /// a failure (never while the model is loading or the lane lives).
    pub async fn lane_died(&self) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            if self.app.loaded().is_ok_and(|l| !l.gen.alive()) {
                return;
            }
        }
    }

    /// Feed a prefix into the prefix cache, as `POST /v1/warm` does with
    /// `body` (`prompt` or `messages`, optionally `cache_salt`) sent with
    /// `api_key` (whose cache it fills under per-key isolation), and wait
    /// for it: the answer `/v1/warm` gives.
    pub async fn warm(&self, body: &serde_json::Value, api_key: Option<&str>) -> Result<serde_json::Value, ApiError> {
        let Some(map) = body.as_object() else { return Err(ApiError::invalid("A warm body must be a JSON object.")) };
        let mut headers = HeaderMap::new();
        if let Some(v) = api_key.and_then(|k| HeaderValue::from_str(&format!("Bearer {k}")).ok()) {
            headers.insert(header::AUTHORIZATION, v);
        }
        api::warm_with(self.app.clone(), &headers, map).await
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
            // Every request is over, so this is the lane's last handle, and
            // dropping it stops the lane: that joins the lane's thread, so
            // drop it off the runtime.
            tokio::task::spawn_blocking(move || drop(l)).await.context("the lane's shutdown panicked")?;
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
    use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
    surface_routes(Router::new())
        .route("/v1/chat/completions", post(api::chat))
        .route("/v1/completions", post(api::completions))
        .route("/v1/warm", post(api::warm))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(|| async { ApiError::not_found("Unknown route.") })
        .method_not_allowed_fallback(|| async { ApiError { status: StatusCode::METHOD_NOT_ALLOWED, ..ApiError::invalid("Method not allowed on this route.") } })
        .layer(DefaultBodyLimit::max(app.cfg.max_body_bytes))
        // The guard runs inside the gate, so /metrics counts what it refuses.
        .layer(axum::middleware::from_fn_with_state(app.clone(), guard::check))
        .layer(axum::middleware::from_fn_with_state(app.clone(), gate))
        .layer(guard::cors(&app.cfg.allowed_origins))
        .layer(body_timeout(&app.cfg))
        .layer(catch_panic())
        // Outermost: a request without an `x-request-id` gets one, and the
        // answer carries it back.
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .with_state(app)
}

/// The routes beyond chat and completions that clients of a local server
/// reach for.
fn surface_routes(router: Router<Arc<App>>) -> Router<Arc<App>> {
    router
        .route("/v1/responses", post(responses::responses))
        .route("/v1/embeddings", post(responses::embeddings))
        .route("/props", get(props::props))
        .route("/", get(page::page))
}

/// A request's `x-request-id` (the layer above sets one on every request).
pub(crate) fn request_id(headers: &HeaderMap) -> String {
    headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("-").to_string()
}

/// A handler that panics answers a generic 500 (the panic goes to the log
/// under the id the client sees), and the connection lives on.
fn catch_panic() -> tower_http::catch_panic::CatchPanicLayer<fn(Box<dyn std::any::Any + Send + 'static>) -> Response> {
    fn answer(p: Box<dyn std::any::Any + Send + 'static>) -> Response {
        let what = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
        ApiError::internal_logged(&format!("a handler panicked: {what}")).into_response()
    }
    tower_http::catch_panic::CatchPanicLayer::custom(answer as fn(_) -> _)
}

/// A request body that stops arriving for `conn.body_timeout` fails (408).
fn body_timeout(cfg: &ServerConfig) -> tower_http::timeout::RequestBodyTimeoutLayer {
    tower_http::timeout::RequestBodyTimeoutLayer::new(cfg.conn.body_timeout)
}

/// Route label for metrics (bounded: unknown paths share one label).
fn route_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/warm" => "/v1/warm",
        "/v1/models" => "/v1/models",
        "/tokenize" => "/tokenize",
        "/detokenize" => "/detokenize",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        "/health" => "/health",
        "/metrics" => "/metrics",
        "/v1/responses" => "/v1/responses",
        "/v1/embeddings" => "/v1/embeddings",
        "/props" => "/props",
        "/" => "/",
        _ => "other",
    }
}

/// Every request passes here: the API key check, then the count by status.
/// Its log lines name its request id.
async fn gate(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    use tracing::Instrument as _;
    let route = route_label(req.uri().path());
    let keys = &app.cfg.api_keys;
    let span = tracing::info_span!("request", request_id = %request_id(req.headers()));
    // The page is static (no data in it), and asks for the key itself.
    let open = route == "/health" || route == "/" || (route == "/metrics" && app.cfg.metrics_public);
    let res = if !keys.is_empty() && !open && !authorized(&req, keys) {
        let mut res = ApiError::unauthorized().into_response();
        res.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        res
    } else {
        next.run(req).instrument(span).await
    };
    app.metrics.request(route, res.status().as_u16());
    res
}

fn authorized(req: &Request, keys: &[String]) -> bool {
    let Some(given) = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer) else {
        return false;
    };
    // Compare in time independent of where the first difference is (and
    // of which key matches).
    let same = |key: &String| {
        let (a, b) = (given.as_bytes(), key.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    };
    keys.iter().fold(false, |ok, k| ok | same(k))
}

/// The token of an `Authorization: Bearer <token>` header's value (the
/// scheme in any case, as HTTP says).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
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
    match app.loaded() {
        Ok(l) if l.gen.alive() => Json(json!({"status": "ok"})).into_response(),
        // A dead lane serves nothing: say so, so that a supervisor restarts it.
        Ok(_) => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "error", "error": "The lane has stopped after a failure."}))).into_response(),
        Err(_) => {
            let mut res = (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading"}))).into_response();
            res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(1));
            res
        }
    }
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    let stats = app.loaded().ok().map(|l| l.gen.stats());
    let text = app.metrics.render(&app.cfg.model_name, app.cfg.speculative.method.as_deref(), stats.as_ref());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}
