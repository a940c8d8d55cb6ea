//! Streamed answers: a run's updates as server-sent events, each writer
//! (chat and completions chunks here, `/v1/responses` events in
//! `responses`) framing them its own way.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use braid_engine::Event;
use serde_json::Value;
use tokio::sync::{mpsc, watch};

use crate::api::{cancelled, Run, Update};
use crate::error::ApiError;

/// How a stream's updates become SSE frames: chat and completions chunks
/// here, `/v1/responses` events in `responses`.
pub(crate) trait Writer: Send + 'static {
    fn opening(&mut self, run: &Run, out: &mut VecDeque<Bytes>);
    fn update(&mut self, run: &Run, update: Update, out: &mut VecDeque<Bytes>);
    /// Every choice finished.
    fn closing(&mut self, run: &Run, out: &mut VecDeque<Bytes>);
    /// The stream failed midway; nothing follows.
    fn failed(&mut self, run: &Run, error: ApiError, out: &mut VecDeque<Bytes>);
}

/// Chat and completions chunks, ending with `data: [DONE]`.
pub(crate) struct ChatWriter;

impl Writer for ChatWriter {
    fn opening(&mut self, run: &Run, out: &mut VecDeque<Bytes>) {
        run.opening(out);
    }

    fn update(&mut self, run: &Run, update: Update, out: &mut VecDeque<Bytes>) {
        run.frames(update, out);
    }

    fn closing(&mut self, run: &Run, out: &mut VecDeque<Bytes>) {
        run.closing(out);
    }

    fn failed(&mut self, _run: &Run, error: ApiError, out: &mut VecDeque<Bytes>) {
        out.push_back(sse(&error.body()));
        out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }
}

struct Streaming<W> {
    run: Run,
    rx: mpsc::UnboundedReceiver<(usize, Event)>,
    cancel: watch::Receiver<bool>,
    out: VecDeque<Bytes>,
    writer: W,
}

impl<W: Writer> Streaming<W> {
    /// Wait for the next event and turn it into frames.
    async fn step(&mut self) {
        tokio::select! {
            ev = self.rx.recv() => match ev {
                Some((i, ev)) => match self.run.apply(i, ev) {
                    Update::Error(e) => self.fail(e),
                    update => {
                        self.writer.update(&self.run, update, &mut self.out);
                        if self.run.all_finished() {
                            self.writer.closing(&self.run, &mut self.out);
                            self.run.done = true;
                        }
                    }
                },
                None => self.fail(ApiError::unavailable("The lane stopped before the request finished.")),
            },
            _ = cancelled(&mut self.cancel) => self.fail(ApiError::unavailable("The server is shutting down.")),
        }
    }

    fn fail(&mut self, e: ApiError) {
        self.writer.failed(&self.run, e, &mut self.out);
        self.run.done = true;
    }
}

pub(crate) fn stream_response<W: Writer>(run: Run, rx: mpsc::UnboundedReceiver<(usize, Event)>, cancel: watch::Receiver<bool>, mut writer: W) -> Response {
    let mut out = VecDeque::new();
    writer.opening(&run, &mut out);
    let state = Streaming { run, rx, cancel, out, writer };
    // When the client leaves, hyper drops this stream: `rx` goes with it,
    // and the lane side sees its sinks closed and cancels.
    let body = futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(b) = st.out.pop_front() {
                return Some((Ok::<_, Infallible>(b), st));
            }
            if st.run.done {
                return None;
            }
            st.step().await;
        }
    });
    let mut res = Response::new(Body::from_stream(body));
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    res
}

pub(crate) fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}
