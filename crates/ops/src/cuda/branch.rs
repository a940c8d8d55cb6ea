//! Branches: independent commands that run side by side, each on a stream
//! of its own, forked from the device's stream and joined back to it.
//!
//! A mixed round's small pieces leave most of the GPU idle: on the H100
//! (Llama-1B's shape, six decode rows beside a 64-row chunk) cuBLAS took
//! 22 µs a layer for q, k and v one after another (k and v, 512 wide, ~9 µs
//! each) and the chunk's attention 18.5 µs after the decode rows' 15. Run
//! side by side they overlap. Under graph capture the fork and join are
//! edges of the graph, so a replayed round pays nothing for them.

use anyhow::{anyhow, ensure, Result};
use cudarc::driver::{result as drv, sys};

use super::exec::Cmd;
use super::gemm;
use super::rt::{cu, DevBuf};
use super::Cuda;

/// Streams besides the device's own: a branch of three (q, k and v) at most.
pub(super) const SIDES: usize = 2;

/// A side stream, its cuBLAS handle (a workspace of its own: two handles
/// sharing one would race) and the event its branch's end records.
pub(super) struct Side {
    pub stream: usize,
    pub cublas: usize,
    _ws: DevBuf,
    done: usize,
}

/// The side streams and the event a fork records on the device's stream.
pub(super) struct Sides {
    pub sides: Vec<Side>,
    fork: usize,
}

impl Sides {
    /// `SIDES` side streams in context `ctx` (what was made before an
    /// error is freed).
    pub fn new(ctx: usize) -> Result<Sides> {
        let event = || drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map(|e| e as usize).map_err(|e| anyhow!("cuEventCreate: {e:?}"));
        let mut s = Sides { sides: Vec::with_capacity(SIDES), fork: event()? };
        for _ in 0..SIDES {
            let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking).map_err(|e| anyhow!("cuStreamCreate: {e:?}"))? as usize;
            let made = gemm::create(ctx, stream).and_then(|(cublas, ws)| match event() {
                Ok(done) => Ok(Side { stream, cublas, _ws: ws, done }),
                Err(e) => {
                    unsafe { gemm::destroy(cublas) };
                    Err(e)
                }
            });
            match made {
                Ok(side) => s.sides.push(side),
                Err(e) => {
                    unsafe {
                        let _ = drv::stream::destroy(stream as sys::CUstream);
                    }
                    return Err(e);
                }
            }
        }
        Ok(s)
    }

    /// None: branches run one after another.
    pub fn none() -> Sides {
        Sides { sides: Vec::new(), fork: 0 }
    }
}

impl Drop for Sides {
    fn drop(&mut self) {
        // The context is current (the device's drop makes it so) and its
        // stream synchronized; a side's work was joined to that stream.
        unsafe {
            for s in self.sides.drain(..) {
                let _ = drv::stream::synchronize(s.stream as sys::CUstream);
                gemm::destroy(s.cublas);
                let _ = drv::stream::destroy(s.stream as sys::CUstream);
                let _ = drv::event::destroy(s.done as sys::CUevent);
            }
            if self.fork != 0 {
                let _ = drv::event::destroy(self.fork as sys::CUevent);
            }
        }
    }
}

impl Cuda {
    /// The commands each of `parts` issues, as branches that run side by
    /// side (the first on the device's stream); what comes after waits for
    /// all of them. With fewer than two parts that issue anything, or no
    /// side streams, the commands go one after another as issued.
    ///
    /// The parts must not write what another reads or writes.
    pub(super) fn branches(&self, parts: &mut [&mut dyn FnMut() -> Result<()>]) -> Result<()> {
        let room = self.inner.sides.sides.len() + 1;
        if parts.len() < 2 || room < 2 {
            return parts.iter_mut().try_for_each(|p| p());
        }
        let mut branches = Vec::with_capacity(parts.len());
        for p in parts.iter_mut() {
            let outer = self.st().exec.sink.replace(Vec::new());
            let r = p();
            let cmds = std::mem::replace(&mut self.st().exec.sink, outer).unwrap_or_default();
            r?;
            branches.push(cmds);
        }
        branches.retain(|b| !b.is_empty());
        // More parts than streams: the last ones share the last stream.
        while branches.len() > room {
            let last = branches.pop().expect("more than room");
            branches.last_mut().expect("room ≥ 2").extend(last);
        }
        if branches.len() < 2 {
            return branches.into_iter().flatten().try_for_each(|c| self.emit(c));
        }
        self.emit(Cmd::Branch(branches))
    }

    /// Run a [`Cmd::Branch`] (built by [`Cuda::branches`]: at most one
    /// branch a side stream besides the first): the side streams wait for
    /// the device's stream, each runs its branch while the device's stream
    /// runs the first, and the device's stream then waits for every side.
    pub(super) fn run_branches(&self, branches: &[Vec<Cmd>]) -> Result<()> {
        let main = self.stream() as sys::CUstream;
        let sides = &self.inner.sides;
        let n = branches.len().saturating_sub(1);
        ensure!(n <= sides.sides.len(), "{} branches for {} side streams", branches.len(), sides.sides.len());
        unsafe { cu(drv::event::record(sides.fork as sys::CUevent, main), "fork event")? };
        for (b, s) in branches.iter().skip(1).zip(&sides.sides) {
            unsafe {
                cu(drv::stream::wait_event(s.stream as sys::CUstream, sides.fork as sys::CUevent, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT), "fork wait")?
            };
            b.iter().try_for_each(|c| self.execute_on(c, Some(s)))?;
            unsafe { cu(drv::event::record(s.done as sys::CUevent, s.stream as sys::CUstream), "join event")? };
        }
        branches.first().into_iter().flatten().try_for_each(|c| self.execute_on(c, None))?;
        for s in &sides.sides[..n] {
            unsafe { cu(drv::stream::wait_event(main, s.done as sys::CUevent, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT), "join wait")? };
        }
        Ok(())
    }
}
