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
    /// Forwards a reader took rows of and has not read yet, and how many
    /// takes each: kept until it has.
    pins: HashMap<u64, usize>,
    seq: u64,
}

/// Free forwards kept for reuse beyond those streams point at: a held
/// stream (its mask late) points at an older forward than the others.
const SPARE: usize = 2;

impl<D: Device> DeviceTaps<D> {
    fn new() -> DeviceTaps<D> {
        DeviceTaps { kept: Vec::new(), streams: HashMap::new(), pins: HashMap::new(), seq: 0 }
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

    /// Mark free the forwards no stream points at and none has pinned,
    /// and drop all but [`SPARE`] of the free ones.
    fn free_unused(&mut self) {
        for k in &mut self.kept {
            if k.seq != 0 && !self.streams.values().any(|e| e.0 == k.seq) && !self.pins.contains_key(&k.seq) {
                k.seq = 0;
            }
        }
        let mut spare = 0;
        self.kept.retain(|k| {
            spare += (k.seq == 0) as usize;
            k.seq != 0 || spare <= SPARE
        });
    }

    /// Where the first `n` rows `stream` fed in its last forward are: the
    /// forward and the first row. A stream's rows are taken once; the
    /// forward stays until [`DeviceTaps::read`] gives it back. `None` if
    /// it fed fewer.
    pub fn take(&mut self, stream: StreamId, n: usize) -> Option<(u64, usize)> {
        let (seq, first, rows) = self.streams.remove(&stream)?;
        if n > rows || !self.kept.iter().any(|k| k.seq == seq) {
            return None;
        }
        *self.pins.entry(seq).or_insert(0) += 1;
        Some((seq, first))
    }

    /// Forward `seq`'s rows, one tensor per tap, for the `takes` takes of
    /// it now read: after this call they may go.
    pub fn read(&mut self, seq: u64, takes: usize) -> Option<&[D::Tensor]> {
        if let Some(p) = self.pins.get_mut(&seq) {
            *p = p.saturating_sub(takes);
            if *p == 0 {
                self.pins.remove(&seq);
            }
        }
        self.kept.iter().find(|k| k.seq == seq).map(|k| &k.taps[..])
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

#[cfg(test)]
mod tests {
    use braid_ops::cpu::Cpu;
    use braid_ops::Device;

    use super::DeviceTaps;

    /// One tap of `rows` rows, row `r` holding `base + r`.
    fn tap(dev: &Cpu, rows: usize, base: f32) -> Vec<<Cpu as Device>::Tensor> {
        let data: Vec<f32> = (0..rows).map(|r| base + r as f32).collect();
        vec![dev.upload(&data, rows, 1).unwrap()]
    }

    #[test]
    fn a_taken_forward_stays_until_read_and_each_stream_finds_its_rows() {
        let dev = Cpu::new(None);
        let mut t = DeviceTaps::<Cpu>::new();
        // Forward 1: stream 1's two rows, then stream 2's three.
        t.keep(&dev, &tap(&dev, 5, 100.0), 5, &[(1, 0, 2), (2, 2, 3)]);
        let (seq1, first) = t.take(2, 2).expect("stream 2 fed three rows");
        assert_eq!(first, 2);
        assert!(t.take(2, 1).is_none(), "a stream's rows are taken once");
        assert!(t.take(1, 3).is_none(), "stream 1 fed two rows, not three");
        // Later forwards without streams 1 and 2 (it took its rows; 1 took
        // nothing and was forgotten): forward 1 is pinned by the take.
        t.forget(1);
        for f in 0..4 {
            t.keep(&dev, &tap(&dev, 1, f as f32), 1, &[(3, 0, 1)]);
        }
        let rows = t.read(seq1, 1).expect("a taken forward stays until read");
        assert_eq!(dev.download(&rows[0]).unwrap(), vec![100.0, 101.0, 102.0, 103.0, 104.0]);
        // Read, it goes at the next forward, and no more than SPARE free
        // forwards are kept beside the one stream 3 points at.
        t.keep(&dev, &tap(&dev, 1, 9.0), 1, &[(3, 0, 1)]);
        assert!(t.read(seq1, 0).is_none(), "read and unpinned, forward 1 was reused or dropped");
        assert!(t.kept.len() <= 1 + super::SPARE, "{} forwards kept", t.kept.len());
        let (seq, first) = t.take(3, 1).unwrap();
        assert_eq!(dev.download(&t.read(seq, 1).unwrap()[0]).unwrap()[first], 9.0);
    }
}
