//! A cheap, shareable view of bytes inside a memory-mapped file (or an owned buffer).

use std::ops::Deref;
use std::sync::Arc;

/// Shared bytes: a range of a mapped file or of an owned vector. Cloning is cheap.
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl Bytes {
    pub fn from_vec(v: Vec<u8>) -> Bytes {
        let len = v.len();
        Bytes { owner: Arc::new(v), start: 0, len }
    }

    pub fn from_mmap(m: Arc<memmap2::Mmap>) -> Bytes {
        let len = m.len();
        Bytes { owner: Arc::new(MmapOwner(m)), start: 0, len }
    }

    /// A sub-range; None when it does not lie inside these bytes.
    pub fn slice(&self, start: usize, len: usize) -> Option<Bytes> {
        let end = start.checked_add(len)?;
        if end > self.len {
            return None;
        }
        Some(Bytes { owner: self.owner.clone(), start: self.start + start, len })
    }
}

struct MmapOwner(Arc<memmap2::Mmap>);
impl AsRef<[u8]> for MmapOwner {
    fn as_ref(&self) -> &[u8] {
        &self.0[..]
    }
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} bytes)", self.len)
    }
}
