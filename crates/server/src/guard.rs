//! What keeps a web page in the user's browser from driving a server on
//! the user's machine. A page can send a "simple" cross-origin POST
//! (`text/plain`, no preflight) and, by DNS rebinding, make its own name
//! resolve to 127.0.0.1 and read the answers. So:
//!
//! * a POST body must be `application/json` (415 otherwise), which a
//!   page cannot send cross-origin without a CORS preflight;
//! * the `Host` must be an IP address, `localhost`, the bound name, or one
//!   of `allowed_hosts` (a rebound name is none of these): 421 otherwise;
//! * an `Origin` must be the server's own (`Host`) or one of
//!   `allowed_origins` (403 otherwise); those get CORS headers, from
//!   tower-http's CORS layer, preflights included.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::error::ApiError;
use crate::logsafe::clip;
use crate::App;

/// `Host`, `Origin` and `Content-Type` checks, in that order.
pub(crate) async fn check(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let cfg = &app.cfg;
    let host = req.headers().get(header::HOST).and_then(|v| v.to_str().ok());
    if let Some(h) = host {
        if !host_allowed(h, &cfg.host, &cfg.allowed_hosts) {
            let e = ApiError {
                status: StatusCode::MISDIRECTED_REQUEST,
                ..ApiError::invalid(format!("The host `{}` is not served here; start the server with --allowed-hosts to allow it.", clip(h)))
            };
            return e.with_code("host_not_allowed").into_response();
        }
    }
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        let ok = origin.to_str().is_ok_and(|o| origin_allowed(o, host, &cfg.allowed_origins));
        if !ok {
            let shown = clip(&String::from_utf8_lossy(origin.as_bytes()));
            let e = ApiError {
                status: StatusCode::FORBIDDEN,
                ..ApiError::invalid(format!("Requests from the origin `{shown}` are not allowed; start the server with --allowed-origins to allow it."))
            };
            return e.with_code("origin_not_allowed").into_response();
        }
    }
    if req.method() == Method::POST && !is_json(req.headers().get(header::CONTENT_TYPE)) {
        let e = ApiError { status: StatusCode::UNSUPPORTED_MEDIA_TYPE, ..ApiError::invalid("Send the body as JSON, with `Content-Type: application/json`.") };
        return e.with_code("unsupported_media_type").into_response();
    }
    next.run(req).await
}

/// `application/json`, with or without parameters (`; charset=utf-8`).
fn is_json(v: Option<&HeaderValue>) -> bool {
    let Some(v) = v.and_then(|v| v.to_str().ok()) else { return false };
    v.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// The name part of a `Host` value (`[::1]:8080` → `::1`, `a.b:80` → `a.b`).
fn host_name(h: &str) -> &str {
    let h = h.trim();
    if let Some(rest) = h.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("");
    }
    match h.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => h,
    }
}

/// Whether a request for `host` may be answered: an IP address (no name
/// to rebind), `localhost`, the name the server was bound to, or one of
/// `allowed` (`*` allows every name).
pub(crate) fn host_allowed(host: &str, bound: &str, allowed: &[String]) -> bool {
    let name = host_name(host).trim_end_matches('.');
    name.parse::<IpAddr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || name.eq_ignore_ascii_case(bound)
        || allowed.iter().any(|a| a == "*" || host_name(a).eq_ignore_ascii_case(name))
}

/// Whether a request with `Origin: origin` may be answered: the page is
/// the server's own (its host and port are the request's `Host`), or its
/// origin is allowed (`*` allows all; `null` only when listed).
pub(crate) fn origin_allowed(origin: &str, host: Option<&str>, allowed: &[String]) -> bool {
    let origin = origin.trim();
    if allowed.iter().any(|a| a == "*" || a.trim_end_matches('/').eq_ignore_ascii_case(origin)) {
        return true;
    }
    let own = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://"));
    matches!((own, host), (Some(o), Some(h)) if o.eq_ignore_ascii_case(h.trim()))
}

/// CORS headers for the allowed origins (none when none are allowed).
pub(crate) fn cors(allowed: &[String]) -> CorsLayer {
    let origins = allowed.to_vec();
    CorsLayer::new()
        .allow_origin(AllowOrigin::predicate(move |o: &HeaderValue, _| o.to_str().is_ok_and(|o| origin_allowed(o, None, &origins))))
        .allow_methods([Method::GET, Method::POST])
        .allow_headers([header::CONTENT_TYPE, header::AUTHORIZATION])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        let none: &[String] = &[];
        assert!(host_allowed("127.0.0.1:8080", "127.0.0.1", none));
        assert!(host_allowed("[::1]:8080", "127.0.0.1", none));
        assert!(host_allowed("localhost:8080", "127.0.0.1", none));
        assert!(!host_allowed("evil.example:8080", "127.0.0.1", none));
        assert!(host_allowed("box.lan:8080", "0.0.0.0", &["box.lan".into()]));
        assert!(host_allowed("anything", "0.0.0.0", &["*".into()]));
    }

    #[test]
    fn origins() {
        let none: &[String] = &[];
        assert!(origin_allowed("http://127.0.0.1:8080", Some("127.0.0.1:8080"), none));
        assert!(!origin_allowed("http://evil.example", Some("127.0.0.1:8080"), none));
        assert!(!origin_allowed("null", Some("127.0.0.1:8080"), none));
        assert!(origin_allowed("https://app.example", None, &["https://app.example/".into()]));
    }
}
