//! The argument checks both devices make for the recurrent ops (short
//! convolution, selective scan, linear attention), so they accept and
//! refuse the same calls with the same words; each device adds its own
//! limits beside them.

use std::collections::HashSet;

use anyhow::{ensure, Result};

use crate::{DeltaShape, SsmShape, StateSeq};

/// Most taps a short convolution takes (Mamba2 uses 4, LFM2 3).
pub(crate) const MAX_CONV_KERNEL: usize = 16;

/// Each sequence's rows lie in a batch of `rows` and no two overlap; each
/// continues its own one of the state's `slots` rows (two sequences
/// updating one row would race).
pub(crate) fn state_seqs(seqs: &[StateSeq], rows: usize, slots: usize) -> Result<()> {
    let mut seen_rows = vec![false; rows];
    let mut seen_slots = HashSet::new();
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

/// The state row holds `need` values from `offset`.
fn state_room(op: &str, state_cols: usize, offset: usize, need: usize) -> Result<()> {
    ensure!(offset + need <= state_cols, "{op}: state rows of {state_cols} cannot hold {need} values at {offset}");
    Ok(())
}

/// `short_conv` over `channels` channels: the weight's and bias's lengths
/// and the state row's room.
pub(crate) fn short_conv(channels: usize, kernel: usize, weight_len: usize, bias_len: Option<usize>, state_cols: usize, state_offset: usize) -> Result<()> {
    let c = channels;
    ensure!((1..=MAX_CONV_KERNEL).contains(&kernel), "short_conv: kernel of {kernel} taps (1..={MAX_CONV_KERNEL} supported)");
    ensure!(weight_len == c * kernel, "short_conv: weight holds {weight_len} values, not {c} channels x {kernel} taps");
    if let Some(b) = bias_len {
        ensure!(b == c, "short_conv: bias holds {b} values for {c} channels");
    }
    state_room("short_conv", state_cols, state_offset, c * (kernel - 1))
}

/// `ssm_scan`'s shape against xbc's and dt's `(rows, cols)`, the lengths
/// of its per-head vectors, and the state row's room.
pub(crate) fn ssm_scan(
    sh: &SsmShape,
    xbc: (usize, usize),
    dt: (usize, usize),
    per_head: [(&str, usize); 3],
    state_cols: usize,
    state_offset: usize,
) -> Result<()> {
    let (nh, hd, n, g) = (sh.heads, sh.head_dim, sh.state_dim, sh.groups);
    // (Written so that a NaN limit fails too.)
    ensure!(sh.dt_min <= sh.dt_max, "ssm_scan: dt limits {} > {}", sh.dt_min, sh.dt_max);
    ensure!(g > 0 && nh.is_multiple_of(g), "ssm_scan: {nh} heads in {g} groups");
    let inner = nh * hd;
    ensure!(xbc.1 == inner + 2 * g * n, "ssm_scan: xbc rows of {}, expected {inner} + 2 x {g} x {n}", xbc.1);
    ensure!(dt.1 == nh && dt.0 == xbc.0, "ssm_scan: dt is {}x{}, expected {}x{nh}", dt.0, dt.1, xbc.0);
    for (name, len) in per_head {
        ensure!(len == nh, "ssm_scan: {name} holds {len} values for {nh} heads");
    }
    state_room("ssm_scan", state_cols, state_offset, nh * hd * n)
}

/// `linear_attention`'s q/k/v width and slopes against its heads, and the
/// state row's room.
pub(crate) fn linear_attention(qkv_cols: usize, slopes: usize, heads: usize, hd: usize, state_cols: usize, state_offset: usize) -> Result<()> {
    ensure!(qkv_cols == heads * 3 * hd, "linear_attention: qkv rows of {qkv_cols}, expected {heads} x 3 x {hd}");
    ensure!(slopes == heads, "linear_attention: {slopes} slopes for {heads} heads");
    state_room("linear_attention", state_cols, state_offset, heads * hd * hd)
}

/// `gated_delta_rule`'s shape against qkv's, a's and b's `(rows, cols)`,
/// the lengths of its per-head vectors, and the state row's room.
pub(crate) fn gated_delta_rule(
    sh: &DeltaShape,
    qkv: (usize, usize),
    ab: [(&str, (usize, usize)); 2],
    per_head: [(&str, usize); 2],
    state_cols: usize,
    state_offset: usize,
) -> Result<()> {
    let (nk, nv) = (sh.key_heads, sh.value_heads);
    ensure!(nk > 0 && nv.is_multiple_of(nk), "gated_delta_rule: {nv} value heads over {nk} key heads");
    ensure!(qkv.1 == sh.qkv_width(), "gated_delta_rule: qkv rows of {}, expected 2 x {nk} x {} + {nv} x {}", qkv.1, sh.key_dim, sh.value_dim);
    for (name, (rows, cols)) in ab {
        ensure!(rows == qkv.0 && cols == nv, "gated_delta_rule: {name} is {rows}x{cols}, expected {}x{nv}", qkv.0);
    }
    for (name, len) in per_head {
        ensure!(len == nv, "gated_delta_rule: {name} holds {len} values for {nv} value heads");
    }
    // (Written so that a NaN epsilon fails too.)
    ensure!(sh.l2_eps >= 0.0, "gated_delta_rule: L2 norm epsilon {}", sh.l2_eps);
    state_room("gated_delta_rule", state_cols, state_offset, nv * sh.key_dim * sh.value_dim)
}

/// `RowPick::ArgmaxAllowed`'s bits against `rows` rows of `cols` columns;
/// the words a row.
pub(crate) fn allowed_bits(bits: &[u32], rows: usize, cols: usize) -> Result<usize> {
    let words = cols.div_ceil(32);
    ensure!(bits.len() == rows * words, "{} mask words for {rows} rows of {cols} columns", bits.len());
    Ok(words)
}

/// `Device::pick`'s penalties against `rows` rows of `cols` columns: each
/// names a value of them, and one value at most once (applied twice, a
/// device's order would matter).
pub(crate) fn penalties(penalties: &[crate::Penalty], rows: usize, cols: usize) -> Result<()> {
    ensure!(penalties.iter().all(|p| (p.row as usize) < rows && (p.col as usize) < cols), "a penalty outside {rows} rows of {cols} columns");
    let mut seen: Vec<(u32, u32)> = penalties.iter().map(|p| (p.row, p.col)).collect();
    seen.sort_unstable();
    ensure!(seen.windows(2).all(|w| w[0] != w[1]), "two penalties on one value");
    Ok(())
}
