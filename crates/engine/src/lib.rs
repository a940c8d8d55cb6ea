//! The host side of braid: lanes, streams, scheduling, cut planning,
//! sampling and stop rules. No device code lives here; everything is tested
//! against recording fake backends.

pub mod backend;
pub mod drafter;
pub mod pass;
pub mod prefix;
pub mod rng;
pub mod sampling;
pub mod stop;

pub use backend::{Backend, Capabilities, Chunk, DecodeRow, Fill, MarkId, StreamId};
pub use drafter::Drafter;
pub use pass::{chunk_end, prefill_whole, CutPlan, Pass, StepOutcome, WholePass};
pub use prefix::PrefixIndex;
pub use sampling::{Sampled, Sampler, SamplingParams};
pub use stop::{StopRules, TextStops, TokenText};
