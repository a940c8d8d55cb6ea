//! The generation endpoints: `/v1/chat/completions` and `/v1/completions`,
//! streamed (SSE) or not; and `/v1/warm`, which only fills the prefix cache.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use braid_engine::{Event, EventSink, FinishReason, Guide, Request, SamplingParams, StopRules, SubmitError};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use crate::error::ApiError;
use crate::guide::Spec;
use crate::lane::{Generator, Ticket};
use crate::params::{self, Common, Endpoint, Prompt};
pub(crate) use crate::sse::{sse, stream_response, ChatWriter, Writer};
use crate::tools::{CallParser, Piece, Toolset};
use crate::{App, ModelInfo};

pub(crate) async fn chat(axum::extract::State(app): axum::extract::State<Arc<App>>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    answer(app, Endpoint::Chat, headers, body).await
}

pub(crate) async fn completions(
    axum::extract::State(app): axum::extract::State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(app, Endpoint::Completions, headers, body).await
}

async fn answer(app: Arc<App>, endpoint: Endpoint, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    match generate(app, endpoint, &headers, body).await {
        Ok(res) => res,
        Err(e) => {
            // Requests that never reached the lane get their line too.
            tracing::info!(endpoint = endpoint.path(), status = e.status.as_u16(), error = %crate::logsafe::clip_to(&e.message, 300), "request refused");
            e.into_response()
        }
    }
}

/// A body the extractor refused (too large, or unreadable).
pub(crate) fn rejected(r: BytesRejection) -> ApiError {
    let status = r.status();
    if timed_out(&r) {
        return ApiError { status: StatusCode::REQUEST_TIMEOUT, ..ApiError::invalid("The request body stopped arriving.") }.with_code("request_timeout");
    }
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError { status, ..ApiError::invalid("The request body is too large.") }.with_code("request_too_large")
    } else {
        ApiError { status, ..ApiError::invalid(format!("Could not read the request body: {}", r.body_text())) }
    }
}

/// Whether the body failed for tower-http's body timeout.
fn timed_out(r: &BytesRejection) -> bool {
    let mut e: Option<&(dyn std::error::Error + 'static)> = Some(r);
    while let Some(x) = e {
        if x.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        e = x.source();
    }
    false
}

async fn generate(app: Arc<App>, endpoint: Endpoint, headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body = body.map_err(rejected)?;
    let map = params::parse_object(&body)?;
    let started = start(app, endpoint, headers, &map, arrived).await?;
    if started.stream {
        Ok(stream_response(started.run, started.rx, started.cancel, ChatWriter))
    } else {
        let run = whole(started.run, started.rx, started.cancel).await?;
        Ok(axum::Json(run.whole_body()).into_response())
    }
}

/// A request whose streams are submitted: its run, the channel its
/// events come on, and whether the client asked for a stream.
pub(crate) struct Started {
    pub(crate) run: Run,
    pub(crate) rx: mpsc::UnboundedReceiver<(usize, Event)>,
    pub(crate) cancel: watch::Receiver<bool>,
    pub(crate) stream: bool,
}

/// Validates a chat or completions body (`map`), renders and tokenizes
/// its prompts, and submits one lane stream per choice. `/v1/responses`
/// comes here too, its body turned into a chat body.
pub(crate) async fn start(
    app: Arc<App>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    map: &serde_json::Map<String, Value>,
    arrived: Instant,
) -> Result<Started, ApiError> {
    crate::fields::check(&app.cfg, endpoint.path(), map)?;
    let max_n = app.cfg.max_n;
    let (mut common, prompts, tools) = match endpoint {
        Endpoint::Chat => {
            let req = params::parse_chat(map, max_n)?;
            (req.common, Input::Chat(req.messages), Some((req.tools, req.tool_choice, req.parallel_tool_calls)))
        }
        Endpoint::Completions => {
            let req = params::parse_completion(map, max_n)?;
            (req.common, Input::Prompts(req.prompts), None)
        }
    };
    if let Some(model) = &common.model {
        if *model != app.cfg.model_name {
            return Err(ApiError::model_not_found(model, &app.cfg.model_name));
        }
    }
    // The fields the request left out sample as the server's defaults say.
    app.cfg.sampling.fill(map, &mut common.sampling);
    let kwargs = crate::fields::template_kwargs(map)?;
    let prompt_count = match &prompts {
        Input::Chat(_) => 1,
        Input::Prompts(ps) => ps.len(),
    };
    let choices = prompt_count.saturating_mul(common.n);
    if choices > app.cfg.max_choices {
        // Never retryable, so a 400 rather than a 503.
        return Err(ApiError::param(
            "n",
            format!(
                "This request asks for {choices} choices ({prompt_count} prompts × n = {}); a request may ask for at most {}.",
                common.n, app.cfg.max_choices
            ),
        ));
    }
    let loaded = app.loaded()?;
    let (gen, info) = (loaded.gen.clone(), loaded.info.clone());
    let template = info.template.as_ref().map_or("", |t| t.source());
    let toolset = tools.and_then(|(tools, choice, parallel)| Toolset::new(template, tools, choice, parallel)).map(Arc::new);
    // What the output must follow: the request's format, or a forced call.
    let spec = common.format.clone().or_else(|| toolset.as_ref().and_then(|t| t.grammar()).map(Spec::Lark));
    let forced_call = common.format.is_none() && spec.is_some();
    // Rendering and tokenizing a large prompt, and compiling a grammar,
    // take a while: keep them off the async workers. Each prompt comes
    // with where a mark would pay (a chat's system turn's end).
    let (tok_info, tok_tools, rules) = (info.clone(), toolset.clone(), app.cfg.images.clone());
    let (hinted, guide) = tokio::task::spawn_blocking(move || -> Result<(Vec<Hinted>, Option<Guide>), ApiError> {
        let hinted = match prompts {
            Input::Chat(messages) => {
                let c = crate::chat_prompt(&tok_info, &messages, tok_tools.as_deref(), &kwargs, true, &rules)?;
                vec![(c.tokens, c.hint, c.images)]
            }
            Input::Prompts(ps) => ps.into_iter().map(|p| Ok((tokenize(&tok_info, p)?, None, Vec::new()))).collect::<Result<Vec<_>, ApiError>>()?,
        };
        let guide = match &spec {
            None => None,
            Some(spec) => Some(loaded.grammars()?.compile(spec).map_err(|e| refused_grammar(spec, forced_call, &e))?),
        };
        Ok((hinted, guide))
    })
    .await
    .map_err(|e| ApiError::internal_logged(&format!("preparing the request failed: {e}")))??;
    let mut prompts = Vec::with_capacity(hinted.len());
    let mut hints = Vec::with_capacity(hinted.len());
    let mut images = Vec::with_capacity(hinted.len());
    for (p, h, i) in hinted {
        prompts.push(p);
        hints.push(h);
        images.push(i);
    }
    let cache_salt = crate::cache_salt(&app.cfg, headers, common.cache_salt.as_deref());
    let max_tokens = prompts.iter().map(|p| fit(&common, p.len(), info.context, endpoint, app.cfg.default_max_tokens)).collect::<Result<Vec<_>, _>>()?;

    let draft_tokens = crate::params::draft_tokens(&app.cfg.speculative, common.speculative.as_ref())?;
    let n = common.n;
    // The model's end tokens, unless the request runs past them.
    let stop_ids = if common.stop.ignore_eos { Vec::new() } else { info.stop_ids.clone() };
    let mut pending = VecDeque::with_capacity(prompts.len() * n);
    for (i, prompt) in prompts.iter().enumerate() {
        for j in 0..n {
            let req = Request {
                prompt: prompt.clone(),
                // Each choice its own seed, so n > 1 with a seed still gives
                // different (but reproducible) choices.
                sampling: SamplingParams { seed: common.sampling.seed.map(|s| s.wrapping_add(j as u64)), guide: guide.clone(), ..common.sampling.clone() },
                stop: StopRules { max_tokens: Some(max_tokens[i]), stop_ids: stop_ids.clone(), ..common.stop.clone() },
                logprobs: common.logprobs,
                cache_salt,
                prefix_hint: hints[i],
                images: images[i].clone(),
                draft_tokens,
            };
            pending.push_back((i * n + j, req));
        }
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let mut feed = Feed::new(&app, gen, pending, tx);
    // On refusal, dropping the feed cancels the choices already queued.
    feed.fill().map_err(refused)?;

    let run = Run {
        app: app.clone(),
        info,
        id: format!("{}{}", if endpoint == Endpoint::Chat { "chatcmpl-" } else { "cmpl-" }, random_id()),
        request_id: crate::request_id(headers),
        endpoint,
        route: endpoint.path(),
        created: unix_now(),
        model: app.cfg.model_name.clone(),
        arrived,
        n,
        prompt_lens: prompts.iter().map(Vec::len).collect(),
        choices: (0..prompts.len() * n).map(|_| Choice { parser: toolset.as_ref().map(|t| t.parser()), ..Choice::default() }).collect(),
        logprobs: common.logprobs,
        include_usage: common.include_usage,
        user: common.user.clone(),
        done: false,
        feed,
    };
    Ok(Started { run, rx, cancel: app.cancel.subscribe(), stream: common.stream })
}

/// A tokenized prompt, where a mark would pay in it, and its images.
type Hinted = (Vec<u32>, Option<usize>, Vec<braid_engine::PromptImage>);

enum Input {
    Chat(Vec<params::Message>),
    Prompts(Vec<Prompt>),
}

/// A 400 for a grammar llguidance refused, naming the field it came from.
fn refused_grammar(spec: &Spec, forced_call: bool, why: &str) -> ApiError {
    let (param, what) = match spec {
        _ if forced_call => ("tools", "The tools' parameter schemas"),
        Spec::JsonObject | Spec::JsonSchema { .. } => ("response_format", "The JSON schema"),
        Spec::Lark(_) => ("grammar", "The grammar"),
        Spec::Regex(_) => ("regex", "The regex"),
    };
    ApiError::param(param, format!("{what} cannot be used for constrained decoding: {why}")).with_code("invalid_grammar")
}

pub(crate) async fn warm(axum::extract::State(app): axum::extract::State<Arc<App>>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let r = match body.map_err(rejected).and_then(|b| params::parse_object(&b)) {
        Ok(map) => warm_with(app, &headers, &map).await,
        Err(e) => Err(e),
    };
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => {
            tracing::info!(endpoint = "/v1/warm", status = e.status.as_u16(), error = %crate::logsafe::clip_to(&e.message, 300), "request refused");
            e.into_response()
        }
    }
}

/// Feed a `/v1/warm` body's prefix into the prefix cache and wait for it:
/// its length and how much of it was cached already.
pub(crate) async fn warm_with(app: Arc<App>, headers: &HeaderMap, map: &serde_json::Map<String, Value>) -> Result<Value, ApiError> {
    let arrived = Instant::now();
    let req = params::parse_warm(map)?;
    if let Some(model) = &req.model {
        if *model != app.cfg.model_name {
            return Err(ApiError::model_not_found(model, &app.cfg.model_name));
        }
    }
    let loaded = app.loaded()?;
    let (gen, info) = (loaded.gen.clone(), loaded.info.clone());
    let tok_info = info.clone();
    let input = req.input;
    let rules = app.cfg.images.clone();
    let (prompt, hint, images) = tokio::task::spawn_blocking(move || match input {
        // The start of a later chat: no assistant turn opened.
        params::WarmInput::Chat(messages) => {
            crate::chat_prompt(&tok_info, &messages, None, &serde_json::Map::new(), false, &rules).map(|c| (c.tokens, c.hint, c.images))
        }
        params::WarmInput::Prompt(p) => Ok((tokenize(&tok_info, p)?, None, Vec::new())),
    })
    .await
    .map_err(|e| ApiError::internal_logged(&format!("tokenizing the prefix failed: {e}")))??;
    let param = if map.contains_key("messages") { "messages" } else { "prompt" };
    if prompt.is_empty() {
        return Err(ApiError::param(param, "The prefix is empty."));
    }
    if prompt.len() > info.context {
        return Err(ApiError::param(param, format!("The prefix has {} tokens, past this model's context of {}.", prompt.len(), info.context))
            .with_code("context_length_exceeded"));
    }
    let n = prompt.len();
    let salt = crate::cache_salt(&app.cfg, headers, req.cache_salt.as_deref());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let lane_req = Request { prompt, cache_salt: salt, prefix_hint: hint, images, ..Request::default() };
    let _ticket = gen.warm(lane_req, Box::new(ChoiceSink { index: 0, tx })).map_err(refused)?;
    let mut cached = 0;
    let mut cancel = app.cancel.subscribe();
    loop {
        tokio::select! {
            ev = rx.recv() => match ev {
                Some((_, Event::Started { cached_tokens })) => cached = cached_tokens,
                Some((_, Event::Finished { reason: FinishReason::Warmed, .. })) => break,
                Some((_, Event::Finished { reason, .. })) => return Err(ApiError::unavailable(format!("The warm feed ended early ({}).", reason.as_str()))),
                Some((_, Event::Error(m) | Event::GrammarError(m))) => return Err(ApiError::internal_logged(&format!("warming failed: {m}"))),
                Some(_) => {}
                None => return Err(ApiError::unavailable("The lane stopped before the warm feed finished.")),
            },
            _ = cancelled(&mut cancel) => return Err(ApiError::unavailable("The server is shutting down.")),
        }
    }
    tracing::info!(
        endpoint = "/v1/warm",
        prompt_tokens = n,
        cached_tokens = cached,
        total_ms = format!("{:.1}", arrived.elapsed().as_secs_f64() * 1e3),
        "warmed"
    );
    Ok(json!({"object": "prefix_cache.warm", "model": app.cfg.model_name, "prompt_tokens": n, "cached_tokens": cached}))
}

fn tokenize(info: &ModelInfo, p: Prompt) -> Result<Vec<u32>, ApiError> {
    match p {
        Prompt::Text(s) => info.tokenizer.encode(&s, true).map_err(|e| ApiError::param("prompt", format!("Could not tokenize the prompt: {e:#}"))),
        Prompt::Tokens(ids) => {
            let vocab = info.tokenizer.vocab_size();
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::param("prompt", format!("Token id {bad} is outside the vocabulary (0..{vocab}).")));
            }
            Ok(ids)
        }
    }
}

/// The completion budget of one prompt: `max_tokens` if prompt and
/// completion fit the context, else a 400 naming both numbers.
fn fit(common: &Common, prompt: usize, context: usize, endpoint: Endpoint, default_max: Option<usize>) -> Result<usize, ApiError> {
    let prompt_param = if endpoint == Endpoint::Chat { "messages" } else { "prompt" };
    match common.stop.max_tokens {
        Some(m) if prompt.saturating_add(m) > context => Err(ApiError::param(
            "max_tokens",
            format!(
                "This model's maximum context length is {context} tokens, but {} tokens were requested \
                 ({prompt} in the prompt, {m} for the completion). Shorten the prompt or lower max_tokens.",
                prompt.saturating_add(m)
            ),
        )
        .with_code("context_length_exceeded")),
        Some(m) => Ok(m),
        None if prompt >= context => Err(ApiError::param(
            prompt_param,
            format!(
                "This model's maximum context length is {context} tokens, but the prompt alone has \
                 {prompt} tokens, leaving no room for a completion."
            ),
        )
        .with_code("context_length_exceeded")),
        None => Ok((context - prompt).min(default_max.unwrap_or(usize::MAX))),
    }
}

/// A stream's grammar failed mid-generation: the request's grammar (a
/// schema that allows no finite output, say), so a 400. The grammar
/// library's message goes on with its parser state, for the log; the
/// client gets its first line.
fn grammar_failed(m: &str) -> ApiError {
    tracing::info!("a request's grammar failed mid-generation: {m}");
    let first = m.lines().next().unwrap_or(m);
    ApiError::invalid(format!("The output could not follow the request's grammar: {first}")).with_code("invalid_grammar")
}

/// Why the lane refused a stream, as the client sees it: a full queue is
/// a 503 to retry later; the rest are the request's fault, or a lane gone.
fn refused(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull { capacity } => ApiError::overloaded(format!("The server is busy: all {capacity} queue places are taken. Retry later.")),
        SubmitError::TooLong { prompt_tokens, max_tokens, max_context } => {
            // The server always sends `max_tokens`.
            let max_tokens = max_tokens.unwrap_or(0);
            ApiError::param(
                "max_tokens",
                format!(
                    "This model's maximum context length is {max_context} tokens, but {} tokens were requested \
                     ({prompt_tokens} in the prompt, {max_tokens} for the completion).",
                    prompt_tokens + max_tokens
                ),
            )
            .with_code("context_length_exceeded")
        }
        SubmitError::Invalid(m) | SubmitError::Unsupported(m) => ApiError::invalid(m),
        SubmitError::Closed => ApiError::unavailable("The lane has shut down."),
    }
}

/// Where one choice's events go: its request's channel, tagged with the
/// choice's index. The receiver goes when the request is over or its
/// client left, and the lane then cancels the stream.
struct ChoiceSink {
    index: usize,
    tx: mpsc::UnboundedSender<(usize, Event)>,
}

impl EventSink for ChoiceSink {
    fn send(&mut self, event: Event) -> bool {
        self.tx.send((self.index, event)).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// One choice's progress.
#[derive(Default)]
pub(crate) struct Choice {
    pub(crate) text: String,
    pub(crate) tokens: usize,
    pub(crate) finish: Option<FinishReason>,
    first: Option<Instant>,
    last: Option<Instant>,
    pub(crate) cached: usize,
    /// Submission to admission, as the lane measured it.
    queued: Option<std::time::Duration>,
    logprobs: Vec<TokenLogprob>,
    /// With tools: the output's parser, the content outside calls, and
    /// the calls.
    pub(crate) parser: Option<Box<dyn CallParser>>,
    pub(crate) content: String,
    pub(crate) calls: Vec<CallOut>,
}

pub(crate) struct CallOut {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) arguments: String,
}

/// A streamed change to a chat choice with tools.
pub(crate) enum Delta {
    Content(String),
    Call { index: usize, id: String, name: String },
    Args { index: usize, text: String },
}

impl Choice {
    /// Record parsed pieces: content, and calls with their ids.
    fn take(&mut self, pieces: Vec<Piece>) -> Vec<Delta> {
        let mut out = Vec::with_capacity(pieces.len());
        for p in pieces {
            match p {
                Piece::Text(t) if t.is_empty() => {}
                Piece::Text(t) => {
                    self.content.push_str(&t);
                    out.push(Delta::Content(t));
                }
                Piece::Call(name) => {
                    let id = format!("call_{}", random_id());
                    self.calls.push(CallOut { id: id.clone(), name: name.clone(), arguments: String::new() });
                    out.push(Delta::Call { index: self.calls.len() - 1, id, name });
                }
                Piece::Args(text) => {
                    if let Some(c) = self.calls.last_mut() {
                        c.arguments.push_str(&text);
                        out.push(Delta::Args { index: self.calls.len() - 1, text });
                    }
                }
            }
        }
        out
    }

    /// OpenAI's finish reason: `tool_calls` when a stopped choice called.
    pub(crate) fn finish_reason(&self) -> Option<&'static str> {
        self.finish.map(|r| if r == FinishReason::Stop && !self.calls.is_empty() { "tool_calls" } else { r.as_str() })
    }
}

#[derive(Clone)]
pub(crate) struct TokenLogprob {
    id: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
    /// Where this token's text begins in the choice's text (completions'
    /// `text_offset`).
    offset: usize,
}

/// What one event changed, for the streaming writer.
pub(crate) enum Update {
    /// New text (maybe empty) with its token's logprobs when asked for.
    Token {
        index: usize,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// With tools: what the new text made (maybe nothing yet).
    Deltas {
        index: usize,
        deltas: Vec<Delta>,
        logprob: Option<TokenLogprob>,
    },
    /// The choice ended; `text` is what was still held back (or, with
    /// tools, `deltas` what it made).
    Finished {
        index: usize,
        text: String,
        deltas: Vec<Delta>,
        reason: &'static str,
    },
    /// The request failed: the lane's error, classified.
    Error(ApiError),
    Nothing,
}

/// One request's streams, from submission to the log line.
pub(crate) struct Run {
    app: Arc<App>,
    info: Arc<ModelInfo>,
    pub(crate) id: String,
    /// The client's `x-request-id` (or the one the server gave it), for
    /// the log line.
    request_id: String,
    endpoint: Endpoint,
    /// The route the log line names (`/v1/responses` runs the chat path).
    pub(crate) route: &'static str,
    pub(crate) created: u64,
    pub(crate) model: String,
    arrived: Instant,
    n: usize,
    pub(crate) prompt_lens: Vec<usize>,
    pub(crate) choices: Vec<Choice>,
    logprobs: Option<usize>,
    include_usage: bool,
    user: Option<String>,
    pub(crate) done: bool,
    /// The choices not yet submitted, and the lifelines of those that
    /// were: dropped with the run, they cancel whatever is still running.
    feed: Feed,
}

/// Submits a request's choices to the lane a share at a time, the next
/// as one ends: a request holds all but one of the lane's running slots,
/// and an even share as more requests share the lane, so one client's `n`
/// cannot keep another's request waiting behind all of its choices.
struct Feed {
    app: Arc<App>,
    gen: Arc<dyn Generator>,
    pending: VecDeque<(usize, Request)>,
    /// Kept while choices wait to be submitted (each needs a sink); then
    /// dropped, so the channel closes when the lane lets go of the sinks.
    tx: Option<mpsc::UnboundedSender<(usize, Event)>>,
    in_flight: usize,
    tickets: Vec<Ticket>,
}

impl Feed {
    fn new(app: &Arc<App>, gen: Arc<dyn Generator>, pending: VecDeque<(usize, Request)>, tx: mpsc::UnboundedSender<(usize, Event)>) -> Feed {
        if app.active.fetch_add(1, Ordering::SeqCst) == 0 {
            app.busy.notify_one();
        }
        let tickets = Vec::with_capacity(pending.len());
        Feed { app: app.clone(), gen, pending, tx: Some(tx), in_flight: 0, tickets }
    }

    /// How many of this request's choices may be in the lane at once.
    fn share(&self) -> usize {
        let Some(running) = self.gen.max_running() else { return usize::MAX };
        let active = self.app.active.load(Ordering::SeqCst).max(1);
        // One slot stays free for the next request, so it starts at once.
        running.saturating_sub(1).min(running / active).max(1)
    }

    /// Submit choices up to the share.
    fn fill(&mut self) -> Result<(), SubmitError> {
        let share = self.share();
        while self.in_flight < share {
            let Some((index, req)) = self.pending.pop_front() else { break };
            let Some(tx) = self.tx.clone() else { break };
            match self.gen.submit(req.clone(), Box::new(ChoiceSink { index, tx })) {
                Ok(t) => {
                    self.tickets.push(t);
                    self.in_flight += 1;
                }
                Err(e) => {
                    self.pending.push_front((index, req));
                    // Later choices wait for one of ours to end; with none
                    // in the lane there is nothing to wait for.
                    return if self.in_flight == 0 { Err(e) } else { Ok(()) };
                }
            }
        }
        if self.pending.is_empty() {
            self.tx = None;
        }
        Ok(())
    }

    /// One choice ended: submit the next.
    fn ended(&mut self) -> Result<(), SubmitError> {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.fill()
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.app.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Run {
    pub(crate) fn all_finished(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    pub(crate) fn apply(&mut self, index: usize, event: Event) -> Update {
        let now = Instant::now();
        let Some(choice) = self.choices.get_mut(index) else {
            return Update::Nothing;
        };
        match event {
            Event::Queued { .. } => Update::Nothing,
            Event::Started { cached_tokens } => {
                choice.cached = cached_tokens;
                Update::Nothing
            }
            Event::Token { id, text, logprob, top } => {
                let m = &self.app.metrics;
                match choice.last {
                    None => m.ttft.observe((now - self.arrived).as_secs_f64()),
                    Some(last) => m.inter_token.observe((now - last).as_secs_f64()),
                }
                choice.first.get_or_insert(now);
                choice.last = Some(now);
                choice.tokens += 1;
                let lp = match (self.logprobs, logprob) {
                    (Some(k), Some(logprob)) => {
                        let top = top.into_iter().take(k).collect();
                        let t = TokenLogprob { id, logprob, top, offset: choice.text.len() };
                        choice.logprobs.push(t.clone());
                        Some(t)
                    }
                    _ => None,
                };
                choice.text.push_str(&text);
                let Some(parser) = choice.parser.as_mut() else { return Update::Token { index, text, logprob: lp } };
                // Control tokens print nothing, but a call syntax may be
                // made of them (LFM2's `<|tool_call_start|>`). Their own
                // text comes after the held-back text this event releases.
                let mut raw = text;
                let tok = &self.info.tokenizer;
                if tok.is_control(id) {
                    raw.push_str(tok.token_text(id).unwrap_or(""));
                }
                let mut pieces = Vec::new();
                parser.push(&raw, &mut pieces);
                Update::Deltas { index, deltas: choice.take(pieces), logprob: lp }
            }
            Event::Finished { reason, usage, tail, timing } => {
                if let Err(e) = self.feed.ended() {
                    return Update::Error(refused(e));
                }
                let Some(choice) = self.choices.get_mut(index) else { return Update::Nothing };
                choice.queued = Some(timing.queued);
                // Prefill time: admission to the first token.
                self.app.metrics.timing(timing.queued, timing.ttft.map(|t| t.saturating_sub(timing.queued)));
                choice.text.push_str(&tail);
                choice.tokens = usage.completion_tokens;
                choice.cached = choice.cached.max(usage.cached_tokens);
                choice.finish = Some(reason);
                let (text, deltas) = match choice.parser.as_mut() {
                    None => (tail, Vec::new()),
                    Some(parser) => {
                        let mut pieces = Vec::new();
                        parser.push(&tail, &mut pieces);
                        parser.finish(&mut pieces);
                        (String::new(), choice.take(pieces))
                    }
                };
                Update::Finished { index, text, deltas, reason: choice.finish_reason().unwrap_or("stop") }
            }
            Event::Error(m) => Update::Error(ApiError::internal_logged(&format!("generation failed: {m}"))),
            Event::GrammarError(m) => Update::Error(grammar_failed(&m)),
        }
    }

    fn usage(&self) -> Value {
        let prompt: usize = self.prompt_lens.iter().sum();
        let completion: usize = self.choices.iter().map(|c| c.tokens).sum();
        // Prompt tokens count once per prompt (not per choice), as OpenAI does.
        let cached: usize = self.choices.iter().step_by(self.n.max(1)).map(|c| c.cached).sum();
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    fn envelope(&self, choices: Value, chunk: bool) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if chunk && self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    fn token_string(&self, id: u32) -> (String, Vec<u8>) {
        let t = &self.info.tokenizer;
        let bytes = t.token_bytes(id).to_vec();
        if bytes.is_empty() {
            // Control tokens print nothing; show their name instead.
            let name = t.token_text(id).unwrap_or_default().to_string();
            return (name.clone(), name.into_bytes());
        }
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    fn chat_logprobs(&self, lps: &[TokenLogprob]) -> Value {
        let entry = |id: u32, logprob: f32| {
            let (token, bytes) = self.token_string(id);
            json!({"token": token, "logprob": logprob, "bytes": bytes})
        };
        let content: Vec<Value> = lps
            .iter()
            .map(|t| {
                let mut e = entry(t.id, t.logprob);
                e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                e
            })
            .collect();
        json!({"content": content, "refusal": null})
    }

    fn completion_logprobs(&self, lps: &[TokenLogprob], base: usize) -> Value {
        let tokens: Vec<String> = lps.iter().map(|t| self.token_string(t.id).0).collect();
        let token_logprobs: Vec<f32> = lps.iter().map(|t| t.logprob).collect();
        let top: Vec<Value> = lps
            .iter()
            .map(|t| {
                let mut m = serde_json::Map::new();
                for &(id, lp) in &t.top {
                    m.entry(self.token_string(id).0).or_insert(json!(lp));
                }
                Value::Object(m)
            })
            .collect();
        let offsets: Vec<usize> = lps.iter().map(|t| base + t.offset).collect();
        json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
    }

    fn whole_body(&self) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let finish = c.finish_reason();
                match self.endpoint {
                    Endpoint::Chat => json!({
                        "index": i,
                        "message": message(c),
                        "logprobs": self.logprobs.map(|_| self.chat_logprobs(&c.logprobs)),
                        "finish_reason": finish,
                    }),
                    Endpoint::Completions => json!({
                        "index": i,
                        "text": c.text,
                        "logprobs": self.logprobs.map(|_| self.completion_logprobs(&c.logprobs, 0)),
                        "finish_reason": finish,
                    }),
                }
            })
            .collect();
        let mut v = self.envelope(Value::Array(choices), false);
        v["usage"] = self.usage();
        v
    }

    /// The SSE frames one update produces.
    pub(crate) fn frames(&self, update: Update, out: &mut VecDeque<Bytes>) {
        match update {
            Update::Nothing => {}
            Update::Error(e) => out.push_back(sse(&e.body())),
            Update::Token { index, text, logprob } => {
                // A frame a token, its text empty while its bytes end inside
                // a character (the token completing it carries the text): a
                // client sees the stream advance every round. Random-weight
                // models pick such tokens often; without their frames, a
                // stall probe read two rounds where the lane ran one.
                let choice = match self.endpoint {
                    Endpoint::Chat => json!({
                        "index": index,
                        "delta": {"content": text},
                        "logprobs": logprob.map(|t| self.chat_logprobs(&[t])),
                        "finish_reason": null,
                    }),
                    Endpoint::Completions => json!({
                        "index": index,
                        "text": text,
                        "logprobs": logprob.map(|t| self.completion_logprobs(&[t], 0)),
                        "finish_reason": null,
                    }),
                };
                out.push_back(sse(&self.envelope(json!([choice]), true)));
            }
            Update::Deltas { index, deltas, logprob } => {
                let mut logprob = logprob.map(|t| self.chat_logprobs(&[t]));
                if deltas.is_empty() && logprob.is_some() {
                    let choice = json!({"index": index, "delta": {"content": ""}, "logprobs": logprob, "finish_reason": null});
                    out.push_back(sse(&self.envelope(json!([choice]), true)));
                }
                for d in deltas {
                    let delta = match d {
                        Delta::Content(t) => json!({"content": t}),
                        Delta::Call { index: k, id, name } => {
                            json!({"tool_calls": [{"index": k, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]})
                        }
                        Delta::Args { index: k, text } => json!({"tool_calls": [{"index": k, "function": {"arguments": text}}]}),
                    };
                    let choice = json!({"index": index, "delta": delta, "logprobs": logprob.take(), "finish_reason": null});
                    out.push_back(sse(&self.envelope(json!([choice]), true)));
                }
            }
            Update::Finished { index, text, deltas, reason } => {
                if !text.is_empty() {
                    self.frames(Update::Token { index, text, logprob: None }, out);
                }
                if !deltas.is_empty() {
                    self.frames(Update::Deltas { index, deltas, logprob: None }, out);
                }
                let choice = match self.endpoint {
                    Endpoint::Chat => {
                        json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": reason})
                    }
                    Endpoint::Completions => {
                        json!({"index": index, "text": "", "logprobs": null, "finish_reason": reason})
                    }
                };
                out.push_back(sse(&self.envelope(json!([choice]), true)));
            }
        }
    }

    /// The first frames of a stream: chat announces the assistant role.
    pub(crate) fn opening(&self, out: &mut VecDeque<Bytes>) {
        if self.endpoint == Endpoint::Chat {
            for i in 0..self.choices.len() {
                let choice = json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
                out.push_back(sse(&self.envelope(json!([choice]), true)));
            }
        }
    }

    pub(crate) fn closing(&self, out: &mut VecDeque<Bytes>) {
        if self.include_usage {
            let mut v = self.envelope(json!([]), true);
            v["usage"] = self.usage();
            out.push_back(sse(&v));
        }
        out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }
}

impl Drop for Run {
    /// The request's log line and its totals, however it ended (finished,
    /// failed, or the client left).
    fn drop(&mut self) {
        let prompt: usize = self.prompt_lens.iter().sum();
        let generated: usize = self.choices.iter().map(|c| c.tokens).sum();
        let m = &self.app.metrics;
        m.add_tokens(prompt, generated);
        m.duration.observe(self.arrived.elapsed().as_secs_f64());
        let ms = |d: std::time::Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
        let ttft_ms = self.choices.iter().filter_map(|c| c.first).min().map(|t| ms(t - self.arrived));
        let queue_ms = self.choices.iter().filter_map(|c| c.queued).max().map(ms);
        let reasons: Vec<&str> = self.choices.iter().map(|c| c.finish_reason().unwrap_or("cancelled")).collect();
        for r in &reasons {
            m.finish(r);
        }
        let cached: usize = self.choices.iter().step_by(self.n.max(1)).map(|c| c.cached).sum();
        tracing::info!(
            request_id = %self.request_id,
            id = %self.id,
            endpoint = self.route,
            queue_ms = queue_ms.as_deref().unwrap_or("-"),
            cached_tokens = cached,
            prompt_tokens = prompt,
            completion_tokens = generated,
            ttft_ms = ttft_ms.as_deref().unwrap_or("-"),
            total_ms = ms(self.arrived.elapsed()),
            finish = reasons.join(","),
            user = %self.user.as_deref().map(crate::logsafe::clip).unwrap_or_else(|| "-".into()),
            "request done"
        );
    }
}

/// A whole chat choice's message: its text, or with tools the content
/// outside its calls (null when only calls came) and the calls.
fn message(c: &Choice) -> Value {
    if c.parser.is_none() {
        return json!({"role": "assistant", "content": c.text});
    }
    let content = c.content.trim();
    if c.calls.is_empty() {
        return json!({"role": "assistant", "content": c.content});
    }
    let calls: Vec<Value> =
        c.calls.iter().map(|k| json!({"id": k.id, "type": "function", "function": {"name": k.name, "arguments": k.arguments.trim()}})).collect();
    json!({"role": "assistant", "content": if content.is_empty() { Value::Null } else { Value::String(content.to_string()) }, "tool_calls": calls})
}

/// Resolves when the server decides to cancel every stream (shutdown);
/// never if that signal is gone.
pub(crate) async fn cancelled(cancel: &mut watch::Receiver<bool>) {
    if cancel.wait_for(|c| *c).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Waits for every choice of `run` to finish.
pub(crate) async fn whole(mut run: Run, mut rx: mpsc::UnboundedReceiver<(usize, Event)>, mut cancel: watch::Receiver<bool>) -> Result<Run, ApiError> {
    while !run.all_finished() {
        tokio::select! {
            ev = rx.recv() => match ev {
                Some((i, ev)) => {
                    if let Update::Error(e) = run.apply(i, ev) {
                        return Err(e);
                    }
                }
                None => return Err(ApiError::unavailable("The lane stopped before the request finished.")),
            },
            _ = cancelled(&mut cancel) => return Err(ApiError::unavailable("The server is shutting down.")),
        }
    }
    Ok(run)
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// 24 hex digits, unique enough for request ids (no RNG crate needed: the
/// std hasher is randomly keyed per instance).
pub(crate) fn random_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let a = h.finish();
    h.write_u64(a);
    format!("{:016x}{:08x}", a, h.finish() as u32)
}
