//! Depthwise causal short convolution (LFM2's gated conv, Mamba2's conv)
//! over each sequence's rows, continuing from the inputs kept in its state.
//!
//! Every output is the same fixed-order sum of `kernel` taps whatever rows
//! came before it in the batch, so results do not depend on chunking.

use anyhow::{ensure, Result};

use super::pointwise::silu1;
use super::{par_rows, CpuTensor, SendPtr};
use crate::StateSeq;

/// Longest filter handled (Mamba2 uses 4, LFM2 3).
const MAX_KERNEL: usize = 16;

#[allow(clippy::too_many_arguments)]
pub fn short_conv(
    x: &CpuTensor,
    weight: &CpuTensor,
    bias: Option<&CpuTensor>,
    kernel: usize,
    silu: bool,
    state: &mut CpuTensor,
    state_offset: usize,
    seqs: &[StateSeq],
    out: &mut CpuTensor,
) -> Result<()> {
    let c = x.cols;
    ensure!((1..=MAX_KERNEL).contains(&kernel), "short_conv: kernel of {kernel} taps (1..={MAX_KERNEL} supported)");
    ensure!(weight.data.len() == c * kernel, "short_conv: weight holds {} values, not {c} channels x {kernel} taps", weight.data.len());
    if let Some(b) = bias {
        ensure!(b.data.len() == c, "short_conv: bias holds {} values for {c} channels", b.data.len());
    }
    let tail = kernel - 1;
    ensure!(state_offset + c * tail <= state.cols, "short_conv: state rows of {} cannot hold {} values at {state_offset}", state.cols, c * tail);
    check_seqs(seqs, x.rows, state.rows)?;
    out.data.resize(x.data.len(), 0.0);
    (out.rows, out.cols) = (x.rows, c);

    let optr = SendPtr(out.data.as_mut_ptr());
    let sptr = SendPtr(state.data.as_mut_ptr());
    let scols = state.cols;
    // Channels are independent: split them over the pool, each task
    // walking every sequence in time order.
    par_rows(c, &|chans| {
        let mut win = [0f32; MAX_KERNEL];
        for s in seqs {
            let st = s.slot as usize * scols + state_offset;
            for ch in chans.clone() {
                let w = &weight.data[ch * kernel..(ch + 1) * kernel];
                // Safety: each task owns its channels' state values.
                let keep = unsafe { sptr.slice(st + ch * tail, tail) };
                win[..tail].copy_from_slice(keep);
                let b = bias.map_or(0.0, |b| b.data[ch]);
                for t in s.start..s.start + s.len {
                    win[tail] = x.data[t * c + ch];
                    let mut acc = b;
                    for k in 0..kernel {
                        acc += w[k] * win[k];
                    }
                    unsafe { optr.slice(t * c + ch, 1)[0] = if silu { silu1(acc) } else { acc } };
                    win.copy_within(1..kernel, 0);
                }
                keep.copy_from_slice(&win[..tail]);
            }
        }
    });
    Ok(())
}

/// Sequences must lie inside the batch, not overlap, and name distinct
/// state rows (two sequences updating one row would race).
pub(crate) fn check_seqs(seqs: &[StateSeq], rows: usize, slots: usize) -> Result<()> {
    let mut seen_rows = vec![false; rows];
    let mut seen_slots = std::collections::HashSet::new();
    for s in seqs {
        ensure!(s.start + s.len <= rows, "sequence rows {}..{} past the batch of {rows}", s.start, s.start + s.len);
        ensure!((s.slot as usize) < slots, "state row {} past the {slots} rows of the state", s.slot);
        ensure!(seen_slots.insert(s.slot), "two sequences share state row {}", s.slot);
        for r in &mut seen_rows[s.start..s.start + s.len] {
            ensure!(!*r, "sequences overlap in the batch");
            *r = true;
        }
    }
    Ok(())
}
