//! `/tokenize` and `/detokenize`, in llama.cpp's shapes:
//!
//! * `POST /tokenize {"content", "add_special": false, "parse_special":
//!   true, "with_pieces": false}` → `{"tokens": [ids]}`, or with pieces
//!   `{"tokens": [{"id", "piece"}]}` (a piece that is not UTF-8 on its own
//!   is its list of bytes);
//! * `POST /detokenize {"tokens": [ids]}` → `{"content"}`, control tokens
//!   written as their text.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use braid_formats::tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::{params, App};

pub(crate) async fn tokenize(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    run(app, body, tokenize_body).await
}

pub(crate) async fn detokenize(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    run(app, body, detokenize_body).await
}

async fn run(
    app: Arc<App>,
    body: Result<Bytes, BytesRejection>,
    f: fn(&crate::ModelInfo, &serde_json::Map<String, Value>) -> Result<Value, ApiError>,
) -> Response {
    let answer = async {
        let body = body.map_err(crate::api::rejected)?;
        let map = params::parse_object(&body)?;
        let info = app.loaded()?.info;
        tokio::task::spawn_blocking(move || f(&info, &map)).await.map_err(|e| ApiError::internal_logged(&format!("tokenizing failed: {e}")))?
    };
    match answer.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn flag(map: &serde_json::Map<String, Value>, name: &str, default: bool) -> Result<bool, ApiError> {
    match map.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::param(name, format!("`{name}` must be a boolean."))),
    }
}

fn tokenize_body(info: &crate::ModelInfo, map: &serde_json::Map<String, Value>) -> Result<Value, ApiError> {
    let content = match map.get("content") {
        Some(Value::String(s)) => s.as_str(),
        _ => return Err(ApiError::param("content", "`content` must be a string.")),
    };
    let add_special = flag(map, "add_special", false)?;
    let parse_special = flag(map, "parse_special", true)?;
    let with_pieces = flag(map, "with_pieces", false)?;
    let tok = &info.tokenizer;
    let encode = if parse_special { Tokenizer::encode } else { Tokenizer::encode_text };
    let ids = encode(tok, content, add_special).map_err(|e| ApiError::param("content", format!("Could not tokenize: {e:#}")))?;
    let tokens: Vec<Value> = if with_pieces {
        ids.iter()
            .map(|&id| {
                let bytes = if tok.is_control(id) { tok.token_text(id).unwrap_or("").as_bytes().to_vec() } else { tok.token_bytes(id).to_vec() };
                let piece = match String::from_utf8(bytes) {
                    Ok(s) => Value::String(s),
                    Err(e) => json!(e.into_bytes()),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(json!({ "tokens": tokens }))
}

fn detokenize_body(info: &crate::ModelInfo, map: &serde_json::Map<String, Value>) -> Result<Value, ApiError> {
    let Some(Value::Array(items)) = map.get("tokens") else {
        return Err(ApiError::param("tokens", "`tokens` must be an array of token ids."));
    };
    let vocab = info.tokenizer.vocab_size();
    let ids = items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .filter(|&id| id < vocab as u64)
                .map(|id| id as u32)
                .ok_or_else(|| ApiError::param("tokens", format!("`tokens[{i}]` must be a token id below {vocab}, got {v}.")))
        })
        .collect::<Result<Vec<u32>, _>>()?;
    Ok(json!({ "content": info.tokenizer.decode_with_special(&ids) }))
}
