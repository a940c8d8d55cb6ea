//! The real lane behind the server's [`Generator`] trait: requests become
//! `braid_engine::Request`s, lane events go straight into the request's
//! async channel (no bridging thread), and a closed channel or a dropped
//! ticket cancels the stream at the lane's next round.

use std::sync::{Arc, RwLock};

use braid_engine::{Event, EventSink, FinishReason, Lane, Request, SamplingParams, StopRules, SubmitError, TokenText};
use braid_formats::tokenizer::Tokenizer;

use crate::generate::{Finish, GenEvent, GenRequest, Generator, LaneNumbers, Refusal, Sink, Ticket};

/// A [`Tokenizer`] as the lane's [`TokenText`] (for `Lane::spawn`).
pub struct TokenizerText(pub Arc<Tokenizer>);

impl TokenText for TokenizerText {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.0.token_bytes(id).to_vec()
    }
}

/// A [`Lane`] serving the HTTP layer.
pub struct LaneGenerator {
    /// Taken out at shutdown (`Lane::shutdown` consumes the lane).
    lane: RwLock<Option<Lane>>,
    /// Stop ids sent with every request that does not ignore EOS; only used
    /// when the lane was given no `eos_ids` of its own.
    stop_ids: Vec<u32>,
}

impl LaneGenerator {
    /// `stop_ids` backs up the lane's own `LaneConfig::eos_ids` when those
    /// are empty.
    pub fn new(lane: Lane, stop_ids: &[u32]) -> LaneGenerator {
        let stop_ids = if lane.config().eos_ids.is_empty() { stop_ids.to_vec() } else { Vec::new() };
        LaneGenerator { lane: RwLock::new(Some(lane)), stop_ids }
    }

    /// Longest stream the lane accepts (its context, capped by its memory).
    pub fn max_context(&self) -> Option<usize> {
        self.lane.read().unwrap_or_else(|e| e.into_inner()).as_ref().map(Lane::max_context)
    }
}

struct LaneSink(Sink);

impl EventSink for LaneSink {
    fn send(&mut self, event: Event) -> bool {
        let ev = match event {
            Event::Queued { position } => GenEvent::Queued { position },
            Event::Started { cached_tokens } => GenEvent::Started { cached_tokens },
            Event::Token { id, text, logprob, top } => GenEvent::Token { id, text, logprob, top },
            Event::Finished { reason, usage, tail, .. } => GenEvent::Finished {
                reason: match reason {
                    FinishReason::Stop | FinishReason::Warmed => Finish::Stop,
                    FinishReason::Length => Finish::Length,
                    FinishReason::Cancelled => Finish::Cancelled,
                },
                text: tail,
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                cached_tokens: usage.cached_tokens,
            },
            Event::Error(m) => GenEvent::Error(m),
        };
        self.0.send(ev)
    }

    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

impl Generator for LaneGenerator {
    fn submit(&self, req: GenRequest, sink: Sink) -> Result<Ticket, Refusal> {
        let guard = self.lane.read().unwrap_or_else(|e| e.into_inner());
        let Some(lane) = guard.as_ref() else {
            return Err(Refusal::Closed("The server is shutting down.".into()));
        };
        let s = req.sampling;
        let request = Request {
            prompt: req.prompt,
            sampling: SamplingParams {
                temperature: s.temperature,
                top_k: s.top_k,
                top_p: s.top_p,
                min_p: s.min_p,
                repetition_penalty: s.repetition_penalty,
                presence_penalty: s.presence_penalty,
                frequency_penalty: s.frequency_penalty,
                seed: s.seed,
                ..SamplingParams::default()
            },
            stop: StopRules {
                max_tokens: Some(req.max_tokens),
                stop_ids: if req.ignore_eos { req.stop_ids } else { [req.stop_ids, self.stop_ids.clone()].concat() },
                stop_strings: req.stop_strings,
                ignore_eos: req.ignore_eos,
            },
            logprobs: req.logprobs,
        };
        match lane.submit_with(request, Box::new(LaneSink(sink))) {
            // Dropping the control cancels the stream.
            Ok(control) => Ok(Ticket::new(control)),
            Err(SubmitError::QueueFull { capacity }) => {
                Err(Refusal::Overloaded(format!("The server is busy: all {capacity} queue places are taken. Retry later.")))
            }
            Err(SubmitError::TooLong { prompt_tokens, max_tokens, max_context }) => {
                Err(Refusal::TooLong { prompt: prompt_tokens, max_tokens: max_tokens.unwrap_or(0), context: max_context })
            }
            Err(SubmitError::Invalid(m)) | Err(SubmitError::Unsupported(m)) => Err(Refusal::Invalid(m)),
            Err(SubmitError::Closed) => Err(Refusal::Closed("The lane has shut down.".into())),
        }
    }

    fn numbers(&self) -> LaneNumbers {
        let guard = self.lane.read().unwrap_or_else(|e| e.into_inner());
        let Some(lane) = guard.as_ref() else {
            return LaneNumbers::default();
        };
        let s = lane.stats();
        LaneNumbers {
            queued: s.queued,
            running: s.prefilling + s.decoding,
            fill_used: s.fill.blocks_used,
            fill_total: s.fill.blocks_total,
            prefill_chunks: s.prefill_chunks,
            prefill_tokens: s.prefill_tokens,
            cached_tokens: s.cached_tokens,
            decode_rounds: s.decode_rounds,
            decode_streams: s.decode_streams,
            max_decode_batch: s.max_decode_batch,
            greedy_rounds: s.greedy_rounds,
            top_rounds: s.top_rounds,
            cancelled: s.cancelled,
            rejected: s.rejected,
        }
    }

    fn shutdown(&self) {
        let lane = self.lane.write().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(lane) = lane {
            lane.shutdown();
        }
    }
}
