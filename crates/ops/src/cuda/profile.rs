//! The event profiler: CUDA events around every command run eagerly while
//! it is on (graphs off), summed per kernel name in a table.

use std::collections::HashMap;

use anyhow::Result;
use cudarc::driver::{result as drv, sys};

use super::Cuda;

/// Kernel names by function handle, and the profile being recorded.
#[derive(Default)]
pub(super) struct Profile {
    pub names: HashMap<usize, String>,
    on: bool,
    /// (name, start event, end event) per launch.
    events: Vec<(String, usize, usize)>,
}

impl Cuda {
    /// Kernel `f`'s name, for the profile.
    pub(super) fn kernel_name(&self, f: usize) -> String {
        self.st().prof.names.get(&f).cloned().unwrap_or_else(|| format!("kernel {f:x}"))
    }

    /// Start timing one command (profiling on, not inside a graph's
    /// capture): its start event.
    pub(super) fn prof_begin(&self) -> Option<usize> {
        {
            let st = self.st();
            if !st.prof.on || st.exec.capturing {
                return None;
            }
        }
        let ev = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ok()?;
        unsafe { drv::event::record(ev, self.stream() as sys::CUstream).ok()? };
        Some(ev as usize)
    }

    pub(super) fn prof_end(&self, start: usize, name: String) {
        if let Ok(ev) = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT) {
            if unsafe { drv::event::record(ev, self.stream() as sys::CUstream) }.is_ok() {
                self.st().prof.events.push((name, start, ev as usize));
            }
        }
    }

    /// Time every command run eagerly from now on (CUDA events around
    /// each), until [`Cuda::profile_report`].
    pub fn profile_start(&self) {
        self.st().prof.on = true;
    }

    /// Stop timing launches, keeping those timed so far (`profile_start`
    /// goes on).
    pub fn profile_pause(&self) {
        self.st().prof.on = false;
    }

    /// Stop profiling; a table of GPU time per kernel (total ms, launches,
    /// µs each), largest first, and the total.
    pub fn profile_report(&self) -> Result<String> {
        self.sync()?;
        let events = {
            let mut st = self.st();
            st.prof.on = false;
            std::mem::take(&mut st.prof.events)
        };
        let mut by: HashMap<String, (f64, usize)> = HashMap::new();
        let mut total = 0f64;
        for (name, a, b) in events {
            let ms = unsafe { drv::event::elapsed(a as sys::CUevent, b as sys::CUevent) }.unwrap_or(0.0) as f64;
            unsafe {
                let _ = drv::event::destroy(a as sys::CUevent);
                let _ = drv::event::destroy(b as sys::CUevent);
            }
            let e = by.entry(name).or_default();
            e.0 += ms;
            e.1 += 1;
            total += ms;
        }
        let mut rows: Vec<_> = by.into_iter().collect();
        rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        let mut s = String::from("| kernel | ms | launches | µs each |\n| --- | --- | --- | --- |\n");
        for (n, (ms, c)) in rows {
            s += &format!("| {n} | {ms:.3} | {c} | {:.1} |\n", 1e3 * ms / c as f64);
        }
        s += &format!("| total | {total:.3} | | |\n");
        Ok(s)
    }
}
