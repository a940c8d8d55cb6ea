//! The host side of braid: lanes, streams, scheduling, cut planning,
//! sampling, stop rules, and the prefix cache's indexes (marks, and the KV
//! block pool a backend keeps its cached blocks in). No device code lives
//! here; everything is tested against recording fake backends (see
//! [`fake`]).
//!
//! Start with [`Lane`]: spawn one per device over a [`Backend`], submit
//! [`Request`]s, read [`Event`]s from each [`StreamHandle`] (or hand the
//! lane an [`EventSink`], e.g. an async channel, with [`Lane::submit_with`]).
//!
//! ```
//! use std::sync::Arc;
//! use braid_engine::fake::{CallLog, FakeBackend, FakeConfig, FakeText};
//! use braid_engine::{Event, FinishReason, Lane, LaneConfig, Request, SamplingParams, StopRules};
//!
//! let backend = FakeBackend::new(FakeConfig::default(), CallLog::default());
//! let lane = Lane::spawn(Box::new(backend), Arc::new(FakeText::default()), LaneConfig::default());
//! let req = Request {
//!     prompt: vec![1, 2, 3],
//!     sampling: SamplingParams::greedy(),
//!     stop: StopRules { max_tokens: Some(4), ..StopRules::default() },
//!     ..Request::default()
//! };
//! let mut text = String::new();
//! for event in lane.submit(req).unwrap() {
//!     match event {
//!         Event::Token { text: t, .. } => text.push_str(&t),
//!         Event::Finished { reason, usage, tail, .. } => {
//!             text.push_str(&tail);
//!             assert_eq!(reason, FinishReason::Length);
//!             assert_eq!(usage.completion_tokens, 4);
//!         }
//!         _ => {}
//!     }
//! }
//! assert_eq!(text.len(), 4);
//! lane.shutdown();
//! ```

pub mod backend;
pub mod blocks;
pub mod draft_model;
pub mod drafter;
pub mod fake;
pub mod guide;
pub mod lane;
pub mod ngram;
pub mod pass;
pub mod prefix;
pub mod rng;
pub mod sampling;
pub mod stop;

pub use backend::{
    image_token_ids, replayed_size, replayed_size_up, replayed_sizes, Backend, Capabilities, Chunk, DecodeRow, Draw, Encoded, Fill, MarkId, Penalty, Pick,
    Picked, Picks, PromptImage, RoundMasks, RoundOut, Step, StreamId, IMAGE_IDS,
};
pub use blocks::{window_start, Attached, BlockId, BlockPool, BlockTable};
pub use draft_model::{DraftModel, DraftModelConfig};
pub use drafter::{Drafter, Gate};
pub use guide::{Constraint, Grammar, Guide, TokenMask};
pub use lane::{
    Event, EventSink, FinishReason, FnSink, Lane, LaneConfig, LaneStats, Request, RoundCost, StreamControl, StreamHandle, SubmitError, Timing, Usage,
};
pub use ngram::{NgramConfig, PromptLookup};
pub use pass::{chunk_end, prefill_whole, whole_images, CutPlan, Pass, StepOutcome, WholePass};
pub use prefix::{PrefixIndex, SeenPrefixes};
pub use sampling::{draw_row, Sampled, Sampler, SamplingParams};
pub use stop::{StopRules, TextStops, TokenText};
