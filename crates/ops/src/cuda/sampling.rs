//! Sampling on the device: greedy argmax (its token ids back through
//! pinned memory, so the next round can launch before the host waits) and
//! top-k.

use anyhow::{anyhow, bail, ensure, Result};
use cudarc::driver::{result as drv, sys};

use super::rt::{cu, DevBuf};
use super::{Cuda, CudaTensor};
use crate::{DrawRow, Penalty};

/// Threads of a `draw_rows` block (its `DRAW_THREADS`).
const DRAW_THREADS: u32 = 512;

/// Most candidates `top_k` finds per row, and the keys one block sorts.
pub(super) const TOPK_MAX: usize = 64;
const TOPK_N: usize = 4096;

/// Pinned host memory the greedy token ids come back to (an asynchronous
/// copy, which a launch may follow), and the event after that copy.
struct IdsBack {
    host: usize,
    bytes: usize,
    event: usize,
}

/// The sampling kernels' device buffers and the pinned ids-back buffer.
pub(super) struct Scratch {
    /// `argmax_rows`'s keys (`argmax_cap` rows; zero between calls), its
    /// finish count, then the token ids.
    argmax_buf: DevBuf,
    argmax_cap: usize,
    /// The allowed-column bits of a masked argmax (grown as needed).
    allow_buf: DevBuf,
    /// `top_k`'s chunk candidates and each row's k best.
    topk_part: DevBuf,
    topk_out: DevBuf,
    /// The penalties of a pick (grown as needed).
    penalty_buf: DevBuf,
    /// A draw's rows (`DrawRow`s), then its token ids (grown as needed).
    draw_buf: DevBuf,
    ids_back: Option<IdsBack>,
}

impl Scratch {
    pub fn new(ctx: usize) -> Scratch {
        Scratch {
            argmax_buf: DevBuf::empty(ctx),
            argmax_cap: 0,
            allow_buf: DevBuf::empty(ctx),
            topk_part: DevBuf::empty(ctx),
            topk_out: DevBuf::empty(ctx),
            penalty_buf: DevBuf::empty(ctx),
            draw_buf: DevBuf::empty(ctx),
            ids_back: None,
        }
    }

    /// Free the pinned buffer and its event.
    pub fn free_ids_back(&mut self) {
        if let Some(k) = self.ids_back.take() {
            unsafe {
                let _ = drv::free_host(k.host as *mut std::ffi::c_void);
                let _ = drv::event::destroy(k.event as sys::CUevent);
            }
        }
    }
}

impl Cuda {
    /// Greedy tokens: the index of each row's largest value (the first, on ties).
    pub fn argmax(&self, t: &CudaTensor) -> Result<Vec<u32>> {
        self.argmax_then(t, None, false)
    }

    /// Pinned host room for `bytes` (grown as needed) and the event after
    /// the copy into it. (Each use waits for its copy, so none is in
    /// flight when it grows.)
    fn ids_back(&self, bytes: usize) -> Result<(usize, usize)> {
        let mut st = self.st();
        let s = &mut st.sampling;
        if s.ids_back.as_ref().is_none_or(|k| k.bytes < bytes) {
            s.free_ids_back();
            let bytes = bytes.max(8192);
            let host = unsafe { drv::malloc_host(bytes, 0) }.map_err(|e| anyhow!("pinned host memory: {e:?}"))? as usize;
            let event = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| anyhow!("cuEventCreate: {e:?}"))? as usize;
            s.ids_back = Some(IdsBack { host, bytes, event });
        }
        let k = s.ids_back.as_ref().expect("just made");
        Ok((k.host, k.event))
    }

    /// [`Cuda::argmax`]; with `launch_ahead`, then the forward prepared
    /// ahead (`Cuda::forward_ahead`) launched at once with these tokens,
    /// which the argmax writes where its embed reads them, so it runs while
    /// the caller handles them: `Device::forward` of it with these tokens
    /// then finds it running. When another forward comes instead, it has
    /// run for nothing (see `Device::pick`).
    pub(super) fn argmax_then(&self, t: &CudaTensor, allowed: Option<&[u32]>, launch_ahead: bool) -> Result<Vec<u32>> {
        if !self.ready() {
            self.sync()?;
        }
        let rows = t.rows;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let stream = self.stream() as sys::CUstream;
        let words = t.cols.div_ceil(32);
        let allow = self.put_allowed(t, allowed)?;
        let (keys, done, ids) = {
            let mut st = self.st();
            let st = &mut st.sampling;
            if st.argmax_cap < rows {
                let cap = rows.max(1024);
                let bytes = cap * 12 + 16;
                st.argmax_buf = DevBuf::new(self.ctx(), bytes)?;
                st.argmax_cap = cap;
                // Zero once; each call leaves it zeroed again.
                unsafe { cu(drv::memset_d8_async(st.argmax_buf.ptr, 0, bytes, stream), "argmax clear")? };
            }
            let (p, cap) = (st.argmax_buf.ptr, st.argmax_cap as u64);
            (p, p + cap * 8, p + cap * 8 + 16)
        };
        let go = if launch_ahead && self.inner.tuning.launch_ahead { self.ahead_graph(rows)? } else { None };
        let dst = go.map_or(0, |g| g.1);
        // Enough blocks per row to spread a long row over the GPU.
        let split = (t.cols / 1024).clamp(1, (4 * self.inner.sms).div_ceil(rows).max(1)) as u32;
        self.launch(self.inner.fns.argmax_rows)
            .grid((rows as u32, split, 1))
            .block(256)
            .ptr(t.fptr())
            .int(t.cols)
            .ptr(keys)
            .ptr(done)
            .ptr(ids)
            .ptr(dst)
            .ptr(allow)
            .int(words)
            .run()?;
        // The ids come back through pinned memory: the copy is queued,
        // the next round may launch behind it, and only then the host waits.
        let (host, event) = self.ids_back(rows * 4)?;
        unsafe {
            cu(sys::cuMemcpyDtoHAsync_v2(host as *mut std::ffi::c_void, ids, rows * 4, stream).result(), "argmax download")?;
            cu(drv::event::record(event as sys::CUevent, stream), "cuEventRecord")?;
        }
        if let Some((exec, _)) = go {
            self.launch_graph(exec)?;
        }
        unsafe { cu(drv::event::synchronize(event as sys::CUevent), "argmax download")? };
        if let Some(e) = &self.st().error {
            bail!("CUDA device error: {e}");
        }
        let out = unsafe { std::slice::from_raw_parts(host as *const u32, rows) }.to_vec();
        if go.is_some() {
            if let Some(a) = self.st().exec.ahead.as_mut() {
                a.running = Some(out.iter().chain(&a.ids[rows..]).copied().collect());
            }
        }
        Ok(out)
    }

    /// `Device::pick`'s penalties, applied in place to `t`'s values (one
    /// thread an entry) before the pick's kernels read them.
    pub(super) fn penalize(&self, t: &CudaTensor, penalties: &[Penalty]) -> Result<()> {
        if penalties.is_empty() {
            return Ok(());
        }
        crate::checks::penalties(penalties, t.rows, t.cols)?;
        // `Penalty` is `repr(C)`: four 4-byte fields, as the kernel reads them.
        let words: Vec<u32> = penalties.iter().flat_map(|p| [p.row, p.col, p.repeat.to_bits(), p.sub.to_bits()]).collect();
        let buf = {
            let mut st = self.st();
            let buf = &mut st.sampling.penalty_buf;
            if buf.bytes < words.len() * 4 {
                *buf = DevBuf::new(self.ctx(), (words.len() * 4).max(1 << 14))?;
            }
            buf.ptr
        };
        unsafe { cu(drv::memcpy_htod_async(buf, &words, self.stream() as sys::CUstream), "penalty upload")? };
        let n = penalties.len();
        self.launch(self.inner.fns.penalize).blocks(n.div_ceil(256)).block(256).ptr(t.fptr()).int(t.cols).ptr(buf).int(n).run()
    }

    /// A masked pick's allowed-column bits on the device (0: none), in a
    /// buffer kept from call to call.
    fn put_allowed(&self, t: &CudaTensor, allowed: Option<&[u32]>) -> Result<u64> {
        let Some(bits) = allowed else { return Ok(0) };
        let words = crate::checks::allowed_bits(bits, t.rows, t.cols)?;
        let mut st = self.st();
        let buf = &mut st.sampling.allow_buf;
        if buf.bytes < bits.len() * 4 {
            // Room for a wide batch at once: growing re-records graphs.
            *buf = DevBuf::new(self.ctx(), (bits.len() * 4).max(64 * words * 4))?;
        }
        unsafe { cu(drv::memcpy_htod_async(buf.ptr, bits, self.stream() as sys::CUstream), "mask upload")? };
        Ok(buf.ptr)
    }

    /// Each row's `k` (at most `TOPK_MAX`) largest values and their
    /// columns, as `RowPick::TopK` describes (`RowPick::TopKAllowed` with
    /// `allowed`): each chunk of a row sorted in shared memory (bitonic,
    /// 2048 or 4096 keys), its best k kept, then those sorted per row; k
    /// keys a row come back.
    pub fn top_k(&self, t: &CudaTensor, k: usize, allowed: Option<&[u32]>) -> Result<Vec<Vec<(u32, f32)>>> {
        if !self.ready() {
            self.sync()?;
        }
        let (rows, cols) = (t.rows, t.cols);
        let k = k.min(cols);
        ensure!(k <= TOPK_MAX, "top_k: k = {k} past the {TOPK_MAX} this device finds");
        // Chunks small enough that their kept keys fit one sort.
        let per = TOPK_N / k.max(1).next_power_of_two();
        let n = cols.div_ceil(per).next_power_of_two().max(k.next_power_of_two()).max(2);
        if rows == 0 || k == 0 || n > TOPK_N {
            let data = self.download_f32(t)?;
            return match allowed {
                None => Ok(crate::top_k_host(&data, cols, k)),
                Some(bits) => crate::top_k_allowed_host(data, cols, k, bits),
            };
        }
        let allow = self.put_allowed(t, allowed)?;
        let chunks = cols.div_ceil(n);
        let m = chunks * k;
        let (part, out) = {
            let mut guard = self.st();
            let st = &mut guard.sampling;
            for (buf, bytes) in [(&mut st.topk_part, rows * m * 8), (&mut st.topk_out, rows * k * 8)] {
                if buf.bytes < bytes {
                    *buf = DevBuf::new(self.ctx(), bytes.max(1 << 16))?;
                }
            }
            (st.topk_part.ptr, st.topk_out.ptr)
        };
        let threads = (n / 2).clamp(32, 1024) as u32;
        self.launch(self.inner.fns.topk_chunks)
            .grid((chunks as u32, rows as u32, 1))
            .block(threads)
            .ptr(t.fptr())
            .int(cols)
            .int(n)
            .int(k)
            .ptr(part)
            .ptr(allow)
            .int(cols.div_ceil(32))
            .run()?;
        let n2 = m.next_power_of_two().max(2);
        let threads = (n2 / 2).clamp(32, 1024) as u32;
        self.launch(self.inner.fns.topk_merge).blocks(rows).block(threads).ptr(part).int(m).int(n2).int(k).ptr(out).run()?;
        let mut keys = vec![0u64; rows * k];
        self.read_back(&mut keys, out, "top_k download")?;
        Ok(keys
            .chunks(k)
            .map(|row| {
                row.iter()
                    .map(|&key| {
                        let ord = (key >> 32) as u32;
                        let bits = if ord & 0x8000_0000 != 0 { ord & 0x7fff_ffff } else { !ord };
                        (0xffff_ffff - (key & 0xffff_ffff) as u32, f32::from_bits(bits))
                    })
                    .collect()
            })
            .collect())
    }

    /// Each row's token drawn as its `DrawRow` says (`RowPick::Draw`;
    /// `draw_host` finds the same on the host, to rounding): one block a
    /// row, the row read a few times over, only the ids back.
    pub fn draw(&self, t: &CudaTensor, draws: &[DrawRow], allowed: Option<&[u32]>) -> Result<Vec<u32>> {
        if !self.ready() {
            self.sync()?;
        }
        let rows = t.rows;
        ensure!(draws.len() == rows, "{} draws for {rows} rows", draws.len());
        if rows == 0 {
            return Ok(Vec::new());
        }
        for d in draws {
            ensure!((0.0..1.0).contains(&d.u) && d.top_p > 0.0 && d.top_p <= 1.0 && (0.0..=1.0).contains(&d.min_p), "a draw out of range: {d:?}");
        }
        let allow = self.put_allowed(t, allowed)?;
        // `DrawRow` is `repr(C)`: five 4-byte fields, as the kernel reads them.
        let words: Vec<u32> = draws.iter().flat_map(|d| [d.temperature.to_bits(), d.top_k, d.top_p.to_bits(), d.min_p.to_bits(), d.u.to_bits()]).collect();
        let buf = {
            let mut st = self.st();
            let buf = &mut st.sampling.draw_buf;
            let bytes = words.len() * 4 + rows * 4;
            if buf.bytes < bytes {
                *buf = DevBuf::new(self.ctx(), bytes.max(1 << 14))?;
            }
            buf.ptr
        };
        let ids = buf + words.len() as u64 * 4;
        unsafe { cu(drv::memcpy_htod_async(buf, &words, self.stream() as sys::CUstream), "draw upload")? };
        self.launch(self.inner.fns.draw_rows)
            .blocks(rows)
            .block(DRAW_THREADS)
            .ptr(t.fptr())
            .int(t.cols)
            .ptr(buf)
            .ptr(allow)
            .int(t.cols.div_ceil(32))
            .ptr(ids)
            .run()?;
        let mut out = vec![0u32; rows];
        self.read_back(&mut out, ids, "draw download")?;
        Ok(out)
    }
}
