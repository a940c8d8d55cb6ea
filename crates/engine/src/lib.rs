//! The host side of braid: lanes, streams, scheduling, cut planning,
//! sampling and stop rules. No device code lives here; everything is tested
//! against recording fake backends (see [`fake`]).
//!
//! Start with [`Lane`]: spawn one per device over a [`Backend`], submit
//! [`Request`]s, read [`Event`]s from each [`StreamHandle`].

pub mod backend;
pub mod drafter;
pub mod fake;
pub mod lane;
pub mod pass;
pub mod prefix;
pub mod rng;
pub mod sampling;
pub mod stop;

pub use backend::{Backend, Capabilities, Chunk, DecodeRow, Fill, MarkId, StreamId};
pub use drafter::Drafter;
pub use lane::{Event, EventSink, FinishReason, FnSink, Lane, LaneConfig, LaneStats, Request, StreamControl, StreamHandle, SubmitError, Timing, Usage};
pub use pass::{chunk_end, prefill_whole, CutPlan, Pass, StepOutcome, WholePass};
pub use prefix::PrefixIndex;
pub use sampling::{Sampled, Sampler, SamplingParams};
pub use stop::{StopRules, TextStops, TokenText};
