//! The KV pool a [`ModelBackend`](super::ModelBackend) makes: its groups
//! and their sizes.

use anyhow::{ensure, Result};
use braid_engine::BlockPool;
use braid_ops::{Device, KvPoolSpec};

use super::{BackendConfig, REWIND_ROWS};
use crate::{LayerState, Model};

/// The window group: the block ids of the KV of sliding-window layers,
/// which read only the last `window` keys before a row. A stream's table
/// there has an entry for each of its rows' blocks, as the full table, but
/// holds only those from the window of its last forward's first row, less
/// [`REWIND_ROWS`]: after each forward, the blocks all of whose rows lie
/// before that are let go (they stay cached, idle, like any block a stream
/// lets go), and their entries name the first block still held. Every
/// attention kernel starts a query's keys at its window's first row
/// (CPU `attention`; CUDA's decode and prefill
/// kernels, whose tiles begin at the first row's window), so none reads a
/// block let go; the stand-ins keep even a masked read in valid memory.
pub(super) struct WindowGroup {
    pub pool: BlockPool,
    pub window: usize,
}

/// How many blocks the window group holds, for `window` keys over a full
/// group of `full` blocks, with `marks` marks kept at most. Between
/// forwards a stream holds the blocks of rows `window + REWIND_ROWS` before
/// its last forward's start through its length: `ceil((window +
/// REWIND_ROWS) / bt) + 2` at most, besides the rows of its last and its
/// next round (each round's at most `max_batch` over all streams); a mark
/// holds as many. Every stream and every mark at once fits (and a stream
/// per slot more: those a round launched ahead keeps a round after they
/// left), and an eighth of the full group more keeps cached windows (a
/// prefix is reused only where its window is cached), so the room grows
/// with `kv_tokens`. Never more than the full group: a stream or mark holds
/// no more window blocks than full ones, so the window group cannot fill
/// before the full one, and admission by the full group is sound. The
/// group is smaller where streams are long: with a full group of
/// `max_streams` whole contexts (`braid serve` on a GPU), by about the
/// window's share of the context.
fn window_blocks(cfg: &BackendConfig, window: usize, marks: usize, full: usize) -> usize {
    let bt = cfg.block_tokens;
    let per = (window + REWIND_ROWS).div_ceil(bt) + 2;
    let held = (2 * cfg.max_streams + marks) * per + 2 * cfg.max_batch.div_ceil(bt);
    (held + full.div_ceil(8)).min(full)
}

/// The KV pool `ModelBackend::new` makes for a model under a config.
pub struct KvLayout {
    pub spec: KvPoolSpec,
    /// The window of the window group's layers, when they have one.
    pub window: Option<usize>,
    /// The model has window layers, kept over the full group's blocks.
    pub over_full: bool,
}

impl KvLayout {
    pub fn of<D: Device>(model: &dyn Model<D>, cfg: &BackendConfig) -> Result<KvLayout> {
        let blocks_total = cfg.kv_tokens.div_ceil(cfg.block_tokens.max(1)).max(1);
        let (layers, groups) = (model.kv_layers(), model.kv_groups());
        ensure!(groups.len() == layers.len() && groups.iter().all(|&g| g < 2), "the model names KV groups {groups:?} for {} KV layers", layers.len());
        let states = model.layer_states();
        let window = states.iter().filter_map(|l| if let LayerState::SlidingKv { window } = l { Some(*window) } else { None }).max();
        let window = window.filter(|_| groups.contains(&1));
        // A lane keeps no marks for a backend that caches blocks (attention only).
        let caches_blocks = states.iter().all(|l| l.rewindable()) && model.state_size() == 0;
        let marks = if caches_blocks { 0 } else { cfg.max_marks };
        Ok(match window.filter(|_| cfg.window_kv) {
            Some(w) => {
                let group_blocks = vec![blocks_total, window_blocks(cfg, w, marks, blocks_total)];
                KvLayout { spec: KvPoolSpec { block_tokens: cfg.block_tokens, layers, layer_groups: groups, group_blocks }, window: Some(w), over_full: false }
            }
            None => KvLayout { spec: KvPoolSpec::new(blocks_total, cfg.block_tokens, layers), window: None, over_full: window.is_some() },
        })
    }

    /// The pool's bytes at `elem` bytes an element (keys and values), or
    /// `None` past `usize`.
    pub fn bytes(&self, elem: usize) -> Option<usize> {
        let s = &self.spec;
        s.layers.iter().enumerate().try_fold(0usize, |sum, (i, l)| {
            let n = s.layer_blocks(i).checked_mul(s.block_tokens)?.checked_mul(2 * elem * l.kv_heads * l.head_dim)?;
            sum.checked_add(n)
        })
    }
}
