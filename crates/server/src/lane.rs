//! The one seam between HTTP and the engine: what the server asks of a
//! lane, in the engine's own types. [`Lane`] is the lane that serves; tests
//! plug in fakes that script the events and record the requests.

use std::sync::Arc;

use braid_engine::{EventSink, Lane, LaneStats, Request, StreamControl, SubmitError, TokenText};
use braid_formats::tokenizer::Tokenizer;

/// A lane as the server drives it. The server stops it by dropping its
/// last handle (a [`Lane`] joins its thread when dropped).
pub trait Generator: Send + Sync + 'static {
    /// Queue a stream whose events go to `sink` until its last one. The
    /// stream is cancelled when the ticket is dropped or the sink closes.
    fn submit(&self, req: Request, sink: Box<dyn EventSink>) -> Result<Ticket, SubmitError>;
    /// Feed `req.prompt` into the prefix cache with no completion (see
    /// `Lane::warm_with`); its events go to `sink`.
    fn warm(&self, _req: Request, _sink: Box<dyn EventSink>) -> Result<Ticket, SubmitError> {
        Err(SubmitError::Unsupported("this lane keeps no prefix cache".into()))
    }
    /// The numbers `/metrics` reports.
    fn stats(&self) -> LaneStats;
    /// False once the lane has stopped for good after a failure: `/health`
    /// then answers 503, and `braid serve` exits (or restarts the lane).
    fn alive(&self) -> bool {
        true
    }
    /// Most streams the lane runs at once (`None`: unknown); a request's
    /// choices get a share of them.
    fn max_running(&self) -> Option<usize> {
        None
    }
}

/// Keeps a submitted stream alive; dropping it cancels the stream. A lane's
/// holds its [`StreamControl`]; a fake may hold none and cancel when its
/// sink closes.
#[derive(Default)]
pub struct Ticket {
    _control: Option<StreamControl>,
}

impl Generator for Lane {
    fn submit(&self, req: Request, sink: Box<dyn EventSink>) -> Result<Ticket, SubmitError> {
        self.submit_with(req, sink).map(|control| Ticket { _control: Some(control) })
    }

    fn warm(&self, req: Request, sink: Box<dyn EventSink>) -> Result<Ticket, SubmitError> {
        self.warm_with(req, sink).map(|control| Ticket { _control: Some(control) })
    }

    fn stats(&self) -> LaneStats {
        Lane::stats(self)
    }

    fn alive(&self) -> bool {
        Lane::alive(self)
    }

    fn max_running(&self) -> Option<usize> {
        Some(self.config().max_running)
    }
}

/// A [`Tokenizer`] as the lane's [`TokenText`] (for `Lane::spawn`).
pub struct TokenizerText(pub Arc<Tokenizer>);

impl TokenText for TokenizerText {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.0.token_bytes(id).to_vec()
    }
}
