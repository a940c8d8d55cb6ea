//! Depthwise causal short convolution (LFM2's gated conv, Mamba2's conv)
//! over each sequence's rows, continuing from the inputs kept in its state.
//!
//! Every output is the same fixed-order sum of `kernel` taps whatever rows
//! came before it in the batch, so results do not depend on chunking.

use anyhow::Result;

use super::pointwise::silu1;
use super::{par_rows, CpuTensor, SendPtr};
use crate::{checks, StateSeq};

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
    checks::short_conv(c, kernel, weight.data.len(), bias.map(|b| b.data.len()), state.cols, state_offset)?;
    let tail = kernel - 1;
    checks::state_seqs(seqs, x.rows, state.rows)?;
    out.resize(x.rows, c);

    let optr = SendPtr(out.data.as_mut_ptr());
    let sptr = SendPtr(state.data.as_mut_ptr());
    let scols = state.cols;
    // Channels are independent: split them over the pool, each task
    // walking every sequence in time order.
    par_rows(c, &|chans| {
        let mut win = [0f32; checks::MAX_CONV_KERNEL];
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
