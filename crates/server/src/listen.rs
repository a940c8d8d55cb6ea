//! Accepting connections. hyper's HTTP/1 server does the work; what is
//! set here: its header timeout (hyper also runs it while a kept-alive
//! connection waits for its next request, so it is the idle timeout too),
//! a cap on open connections, and a small reserve beyond the cap that
//! answers `/health` and turns the rest away, so a full server can still
//! say that it is alive. The body timeout is tower-http's (see `router`).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};

use crate::error::ApiError;

/// Connections served past the cap, one request each, to answer `/health`.
const RESERVE: usize = 16;
/// How long a connection over the cap may take to send its request.
const RESERVE_HEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// What a connection may cost.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Most time to send a request's headers, and most time a kept-alive
    /// connection may sit idle between requests.
    pub header_timeout: Duration,
    /// Most time between two pieces of a request body.
    pub body_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits { header_timeout: Duration::from_secs(10), body_timeout: Duration::from_secs(30), max_connections: 512 }
    }
}

/// Serves `router` on `listener` until `stop` fires; then stops accepting
/// and waits for the open connections to finish (in-flight requests run
/// to their end, idle connections close).
pub(crate) async fn serve(listener: TcpListener, router: Router, limits: ConnLimits, stop: oneshot::Receiver<()>) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let reserve = Arc::new(Semaphore::new(RESERVE));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    let mut over = hyper::server::conn::http1::Builder::new();
    over.timer(TokioTimer::new()).header_read_timeout(RESERVE_HEADER_TIMEOUT).keep_alive(false);
    let over_router = router.clone().layer(axum::middleware::from_fn(health_only));
    tokio::pin!(stop);
    loop {
        let tcp = tokio::select! {
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors, say: wait for some to return
                    // rather than spin.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let _ = tcp.set_nodelay(true);
        let io = TokioIo::new(tcp);
        if let Ok(permit) = slots.clone().try_acquire_owned() {
            let conn = graceful.watch(http.serve_connection(io, TowerToHyperService::new(router.clone())));
            tokio::spawn(async move {
                let _ = conn.await;
                drop(permit);
            });
        } else if let Ok(permit) = reserve.clone().try_acquire_owned() {
            let conn = graceful.watch(over.serve_connection(io, TowerToHyperService::new(over_router.clone())));
            tokio::spawn(async move {
                let _ = conn.await;
                drop(permit);
            });
        }
        // Past the reserve too: the connection closes as it is dropped.
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// On a connection over the cap: `/health` as usual, anything else 503.
async fn health_only(req: Request, next: Next) -> Response {
    if req.uri().path() == "/health" {
        return next.run(req).await;
    }
    ApiError::overloaded("The server has too many open connections. Retry later.").into_response()
}
