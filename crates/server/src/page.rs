//! `GET /`: a small chat page, embedded in the binary.

use axum::http::header;
use axum::response::{IntoResponse, Response};

const PAGE: &str = include_str!("page/index.html");

pub(crate) async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-cache")], PAGE).into_response()
}
