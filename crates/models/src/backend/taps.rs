//! Feature rows kept on the backend's device for a drafter on the same
//! device ([`ModelBackend::share_taps`]): the lane hands drafters host
//! floats, which on a GPU would copy every tapped row to the host and back
//! each round (a 512-row chunk of three 2048-wide taps is 12 MB). Instead
//! the backend keeps each forward's tapped rows where they are, and the
//! drafter reads a stream's rows by its id: the rows the lane keeps of a
//! stream (its fed token and the drafts accepted, or a prompt chunk) are
//! always the first of the rows that stream fed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use braid_engine::StreamId;
use braid_ops::Device;

use super::ModelBackend;

/// The tapped rows a backend keeps for a drafter, shared with it.
pub type SharedTaps<D> = Arc<Mutex<DeviceTaps<D>>>;

/// One forward's tapped rows, one tensor per tap (`seq` 0: free).
struct Kept<T> {
    seq: u64,
    taps: Vec<T>,
}

/// Forwards' tapped rows, and where each stream's last rows are in them.
pub struct DeviceTaps<D: Device> {
    kept: Vec<Kept<D::Tensor>>,
    /// Per stream: the forward (`seq`), its first row there, and how many.
    streams: HashMap<StreamId, (u64, usize, usize)>,
    seq: u64,
}

/// Free forwards kept for reuse beyond those streams point at: a held
/// stream (its mask late) points at an older forward than the others.
const SPARE: usize = 2;

impl<D: Device> DeviceTaps<D> {
    fn new() -> DeviceTaps<D> {
        DeviceTaps { kept: Vec::new(), streams: HashMap::new(), seq: 0 }
    }

    /// Keep the rows `tapped` holds (`rows` each, one tensor per tap) and
    /// point each stream of `parts` (stream, first row, rows) at its rows.
    fn keep(&mut self, dev: &D, tapped: &[D::Tensor], rows: usize, parts: &[(StreamId, usize, usize)]) {
        if parts.is_empty() || tapped.is_empty() {
            return;
        }
        self.seq += 1;
        let seq = self.seq;
        for &(s, first, n) in parts {
            self.streams.insert(s, (seq, first, n));
        }
        self.free_unused();
        let at = match self.kept.iter().position(|k| k.seq == 0) {
            Some(i) => i,
            None => {
                self.kept.push(Kept { seq: 0, taps: Vec::new() });
                self.kept.len() - 1
            }
        };
        let k = &mut self.kept[at];
        k.seq = seq;
        k.taps.resize_with(tapped.len(), || dev.tensor(0, 0));
        let all: Vec<usize> = (0..rows).collect();
        for (t, out) in tapped.iter().zip(&mut k.taps) {
            dev.gather_rows(t, &all, out);
        }
    }

    /// Mark free the forwards no stream points at, and drop all but
    /// [`SPARE`] of the free ones.
    fn free_unused(&mut self) {
        for k in &mut self.kept {
            if k.seq != 0 && !self.streams.values().any(|e| e.0 == k.seq) {
                k.seq = 0;
            }
        }
        let mut spare = 0;
        self.kept.retain(|k| {
            spare += (k.seq == 0) as usize;
            k.seq != 0 || spare <= SPARE
        });
    }

    /// The first `n` rows `stream` fed in its last forward, one tensor per
    /// tap and the first row in each, and forget them (a stream's rows are
    /// taken once). `None` if it fed fewer.
    pub fn take(&mut self, stream: StreamId, n: usize) -> Option<(&[D::Tensor], usize)> {
        let (seq, first, rows) = self.streams.remove(&stream)?;
        if n > rows {
            return None;
        }
        self.kept.iter().find(|k| k.seq == seq).map(|k| (&k.taps[..], first))
    }

    /// The stream is gone.
    fn forget(&mut self, stream: StreamId) {
        self.streams.remove(&stream);
    }
}

impl<D: Device> ModelBackend<D> {
    /// Keep the tapped rows of every forward from now on on the device for
    /// a drafter there (see the module's doc) instead of copying them to
    /// the host: `features()` then gives none, and the drafter reads them
    /// through the returned handle.
    pub fn share_taps(&mut self) -> SharedTaps<D> {
        let shared = Arc::new(Mutex::new(DeviceTaps::new()));
        self.shared_taps = Some(shared.clone());
        self.features.clear();
        shared
    }

    /// After a forward over `parts` (each stream's rows in order): keep its
    /// tapped rows for the streams `keep` accepts.
    pub(super) fn keep_taps(&mut self, parts: &[(StreamId, &[u32])], keep: impl Fn(StreamId) -> bool) {
        let Some(shared) = &self.shared_taps else { return };
        let mut first = 0;
        let mut at = Vec::with_capacity(parts.len());
        for &(s, toks) in parts {
            if keep(s) {
                at.push((s, first, toks.len()));
            }
            first += toks.len();
        }
        let taps = self.scratch.taps.len();
        let mut store = shared.lock().unwrap_or_else(|e| e.into_inner());
        store.keep(&self.dev, &self.scratch.tapped[..taps.min(self.scratch.tapped.len())], first, &at);
    }

    /// `stream` is gone: its kept rows are not read.
    pub(super) fn forget_taps(&mut self, stream: StreamId) {
        if let Some(shared) = &self.shared_taps {
            shared.lock().unwrap_or_else(|e| e.into_inner()).forget(stream);
        }
    }
}
