//! A forward's host arrays: each row's token, position and KV slots, the
//! attention sequences over the streams' tables, and where images go.

use std::collections::HashMap;

use braid_engine::{BlockTable, StreamId, IMAGE_IDS};
use braid_ops::AttnSeq;

use super::StreamState;
use crate::{Batch, ImageAt};

/// The image rows of a chunk of prompt rows `start .. end` that begins at
/// batch row `first`, from the pass's image spans (index = image rows).
pub(super) fn image_rows(spans: &[(usize, usize)], start: usize, end: usize, first: usize) -> Vec<ImageAt> {
    spans
        .iter()
        .enumerate()
        .filter(|(_, &(a, b))| a < end && b > start)
        .map(|(tensor, &(a, b))| {
            let from = a.max(start);
            ImageAt { row: first + from - start, len: b.min(end) - from, offset: from - a, tensor }
        })
        .collect()
}

/// A forward's host arrays over `(stream, tokens)` parts, each stream's
/// rows starting at its current length.
pub(super) struct RowArrays {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    /// Each row's slot in the window group (empty without one).
    window_slots: Vec<u32>,
    /// Each part's (first row, rows, KV rows after it).
    ranges: Vec<(usize, usize, usize)>,
    state_slots: Vec<u32>,
}

impl RowArrays {
    /// `windowed`: the streams have window-group tables.
    pub fn new(streams: &HashMap<StreamId, StreamState>, bt: usize, parts: &[(StreamId, &[u32])], windowed: bool) -> RowArrays {
        let mut r = RowArrays {
            tokens: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            window_slots: Vec::new(),
            ranges: Vec::new(),
            state_slots: Vec::with_capacity(parts.len()),
        };
        for &(id, toks) in parts {
            let st = &streams[&id];
            let start = st.len;
            r.state_slots.push(st.slot);
            r.ranges.push((r.tokens.len(), toks.len(), start + toks.len()));
            for (i, &t) in toks.iter().enumerate() {
                let pos = start + i;
                // An image row's id names its image for the prefix cache; the
                // model embeds it as any token and puts the image's row there.
                r.tokens.push(if t >= IMAGE_IDS { 0 } else { t });
                r.positions.push(pos as u32);
                r.slots.push(st.table.blocks[pos / bt] * bt as u32 + (pos % bt) as u32);
                if windowed {
                    r.window_slots.push(st.win.blocks[pos / bt] * bt as u32 + (pos % bt) as u32);
                }
            }
        }
        r
    }

    /// `over_full`: window layers read the full group's rows (there is no
    /// window group, yet the model has window layers).
    pub fn batch<'a>(
        &'a self,
        streams: &'a HashMap<StreamId, StreamState>,
        parts: &[(StreamId, &[u32])],
        logit_rows: &'a [usize],
        over_full: bool,
    ) -> Batch<'a> {
        let seqs_over = |table: fn(&StreamState) -> &BlockTable| -> Vec<AttnSeq<'a>> {
            parts
                .iter()
                .zip(&self.ranges)
                .map(|(&(id, _), &(q_start, q_len, kv_len))| AttnSeq { q_start, q_len, kv_len, blocks: &table(&streams[&id]).blocks, window: None })
                .collect()
        };
        let seqs = seqs_over(|st| &st.table);
        let (window_slots, window_seqs) = if over_full {
            (&self.slots[..], seqs.clone())
        } else if self.window_slots.is_empty() {
            (&[][..], Vec::new())
        } else {
            (&self.window_slots[..], seqs_over(|st| &st.win))
        };
        Batch {
            tokens: &self.tokens,
            positions: &self.positions,
            slots: &self.slots,
            seqs,
            window_slots,
            window_seqs,
            logit_rows,
            state_slots: &self.state_slots,
            images: Vec::new(),
        }
    }
}
