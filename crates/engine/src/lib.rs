//! The host side of braid: lanes, streams, scheduling, cut planning,
//! sampling and stop rules. No device code lives here; everything is tested
//! against recording fake backends.

pub mod backend;

pub use backend::{Backend, Capabilities, Chunk, DecodeRow, Fill, MarkId, StreamId};
