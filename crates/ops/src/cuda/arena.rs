//! The upload arena: one device buffer the ops' small index arrays
//! (positions, slots, block tables, token ids) are copied into, at offsets
//! that stay put from one forward to the next, so CUDA graphs that bake the
//! addresses in stay valid. Identical arrays within a forward share one
//! copy; a forward prepared ahead gathers its uploads in a host mirror and
//! sends them in one copy ([`Cuda::forward_ahead`]).

use anyhow::{bail, ensure, Result};
use cudarc::driver::{result as drv, sys};

use super::rt::cu;
use super::Cuda;

/// The arena's size in u32 words.
pub(super) const ARENA_WORDS: usize = 4 << 20;

/// The smallest slot each of a forward's first [`WIDE_SLOTS`] uploads
/// takes, in u32 words.
const UPLOAD_SLOT_WORDS: usize = 16 << 10;

/// A forward's uploads that get wide slots: a dense forward's dozen. The
/// uploads past them (a mixture's row lists, three per expert run, some
/// thousands in a prefill over 128 experts) take slots of their own size
/// from [`SMALL_SLOT_WORDS`]: at 64 KiB each, 256 filled the arena and a
/// real-shape MoE failed inside its first forward. Their offsets move with
/// the routing anyway.
const WIDE_SLOTS: usize = 64;
const SMALL_SLOT_WORDS: usize = 64;

#[derive(Default)]
pub(super) struct Arena {
    /// Next free word, and this pass's recent uploads by call site
    /// (identical arrays from one site, such as every layer's positions,
    /// share one copy).
    pub off: usize,
    /// Uploads this pass.
    uploads: usize,
    recent: Vec<(Site, Vec<u32>, usize)>,
    /// A staged forward's token uploads.
    pub token_uploads: Vec<TokenUpload>,
    /// In a pass ahead, uploads gather in `mirror` (the arena's host
    /// image) and go in one copy at its end: between two rounds one copy
    /// rather than one per array.
    pub staging: bool,
    pub mirror: Vec<u32>,
}

impl Arena {
    /// A forward's recording starts: uploads from the arena's start again.
    pub fn begin_pass(&mut self) {
        self.off = 0;
        self.uploads = 0;
        self.recent.clear();
        self.token_uploads.clear();
    }

    /// A forward's recording ends: later uploads share nothing with it.
    pub fn end_pass(&mut self) {
        self.recent.clear();
    }
}

/// Where an upload was asked for. Arrays share a copy only when one call
/// site asks for both: two sites' arrays equal by chance (a stream's
/// positions and its slots, when its blocks come first in the pool) would
/// move every later upload's offset, and graphs bake offsets in.
type Site = &'static std::panic::Location<'static>;

/// A token upload: the ids' host address and count, and where they went.
pub(super) type TokenUpload = (usize, usize, u64);

impl Cuda {
    /// Put a small index array on the device (in the upload arena) and return
    /// its address. Identical arrays from one call site within a pass
    /// share one copy.
    #[track_caller]
    pub(super) fn put_u32(&self, data: &[u32]) -> Result<u64> {
        self.put_u32_as(data, Some(std::panic::Location::caller()))
    }

    /// [`Cuda::put_u32`] of f32 values (their bits).
    #[track_caller]
    pub(super) fn put_f32(&self, data: &[f32]) -> Result<u64> {
        let bits: Vec<u32> = data.iter().map(|v| v.to_bits()).collect();
        self.put_u32(&bits)
    }

    /// [`Cuda::put_u32`] of a forward's token ids: never shared, since a
    /// pass done ahead gets its real ids written over these.
    pub(super) fn put_tokens(&self, ids: &[u32]) -> Result<u64> {
        let ptr = self.put_u32_as(ids, None)?;
        let mut st = self.st();
        if st.arena.staging {
            st.arena.token_uploads.push((ids.as_ptr() as usize, ids.len(), ptr));
        }
        Ok(ptr)
    }

    /// Gather uploads in the host mirror (`on`), or stop and get the token
    /// uploads so gathered.
    pub(super) fn arena_staging(&self, on: bool) -> Vec<TokenUpload> {
        let mut st = self.st();
        st.arena.staging = on;
        if on {
            Vec::new()
        } else {
            std::mem::take(&mut st.arena.token_uploads)
        }
    }

    /// Send what the mirror gathered, in one copy behind the queued work.
    pub(super) fn arena_send_mirror(&self) -> Result<()> {
        let st = self.st();
        let end = st.arena.off;
        if end > 0 {
            unsafe { cu(drv::memcpy_htod_async(self.inner.arena.ptr, &st.arena.mirror[..end], self.stream() as sys::CUstream), "upload")? };
        }
        Ok(())
    }

    fn put_u32_as(&self, data: &[u32], share: Option<Site>) -> Result<u64> {
        let mut guard = self.st();
        let st = &mut *guard;
        let recording = st.exec.rec.is_some();
        if !st.arena.staging {
            // The arena may now hold other data than a forward prepared ahead put there.
            st.exec.ahead = None;
        }
        let a = &mut st.arena;
        if let Some((_, _, off)) = a.recent.iter().find(|(site, d, _)| share == Some(*site) && d.as_slice() == data) {
            return Ok(self.inner.arena.ptr + 4 * *off as u64);
        }
        // Room to grow (block tables lengthen as sequences do), so the
        // offsets of later uploads, which graphs bake in, stay put: a
        // forward's dozen uploads in slots of at least 64 KiB. (Slots of a
        // power of two from 256 bytes moved whenever a decode round's block
        // tables crossed one, and each move re-recorded its graph: 2–3 ms
        // gaps, ten times in a 4000-token run on the H200.)
        let slot = if a.uploads < WIDE_SLOTS { UPLOAD_SLOT_WORDS } else { SMALL_SLOT_WORDS };
        let n = data.len().max(slot).next_power_of_two();
        ensure!(n <= ARENA_WORDS, "upload of {} indices exceeds the {}-word arena", data.len(), ARENA_WORDS);
        if a.off + n > ARENA_WORDS {
            if recording {
                bail!("upload arena full inside a forward");
            }
            // Outside a forward: reuse from the start; earlier readers were
            // queued on the same stream, so they run before the overwrite.
            a.off = 0;
            a.uploads = 0;
            a.recent.clear();
        }
        let off = a.off;
        a.off += n;
        a.uploads += 1;
        if let Some(site) = share {
            if a.recent.len() >= 8 {
                a.recent.remove(0);
            }
            a.recent.push((site, data.to_vec(), off));
        }
        let ptr = self.inner.arena.ptr + 4 * off as u64;
        if a.staging {
            // A pass ahead: gathered here, sent in one copy at its end.
            if a.mirror.len() < ARENA_WORDS {
                a.mirror.resize(ARENA_WORDS, 0);
            }
            a.mirror[off..off + data.len()].copy_from_slice(data);
        } else if !data.is_empty() {
            unsafe { cu(drv::memcpy_htod_async(ptr, data, self.stream() as sys::CUstream), "upload")? };
        }
        Ok(ptr)
    }
}
