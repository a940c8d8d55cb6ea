//! `GET /props`: what is served, in the spirit of llama.cpp's `/props` —
//! the model, its context, its chat template and where it came from, the
//! device, the KV pool (live), and the sampling defaults.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::App;

/// What the caller knows of the loaded model beyond [`crate::ModelInfo`]
/// (set with [`crate::Server::set_about`]); empty fields are reported as null.
#[derive(Clone, Debug, Default)]
pub struct About {
    /// The model file or folder.
    pub path: String,
    /// `llama`, `qwen3`, ... as the file names it.
    pub architecture: String,
    /// Weights, counted from the file's tensors (0: unknown).
    pub parameters: u64,
    /// The device, in words.
    pub device: String,
    /// Where the chat template came from: `model`, `file PATH`,
    /// `builtin NAME`, or `none`.
    pub template: String,
}

pub(crate) async fn props(State(app): State<Arc<App>>) -> Response {
    let about = app.about.read().unwrap_or_else(|e| e.into_inner()).clone();
    let text = |s: &str| if s.is_empty() { serde_json::Value::Null } else { json!(s) };
    let loaded = app.loaded().ok();
    let kv = loaded.as_ref().map(|l| {
        let s = l.gen.stats();
        let f = &s.fill;
        json!({
            "tokens": f.blocks_total * f.block_tokens,
            "block_tokens": f.block_tokens,
            "blocks_total": f.blocks_total,
            "blocks_used": f.blocks_used,
            "blocks_cached": f.blocks_cached,
            "slots_total": f.slots_total,
            "slots_used": f.slots_used,
            "window_blocks_total": f.window_blocks_total,
            "window_blocks_used": f.window_blocks_used,
            "window_blocks_cached": f.window_blocks_cached,
        })
    });
    let info = loaded.as_ref().map(|l| l.info.clone());
    Json(json!({
        "model": app.cfg.model_name,
        "loaded": loaded.is_some(),
        "model_path": text(&about.path),
        "architecture": text(&about.architecture),
        "parameters": (about.parameters > 0).then_some(about.parameters),
        "context": info.as_ref().map(|i| i.context),
        "chat_template": info.as_ref().and_then(|i| i.template.as_ref().map(|t| t.source().to_string())),
        "chat_template_source": text(&about.template),
        "device": text(&about.device),
        "kv_pool": kv,
        "default_generation_settings": app.cfg.sampling.to_json(),
        "build_info": format!("braid {}", env!("CARGO_PKG_VERSION")),
    }))
    .into_response()
}
