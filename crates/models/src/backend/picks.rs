//! A round's picks: guided rows' masks as bits, and picks split between
//! a round launched ahead and the rest, and merged back in row order.

use braid_engine::{DecodeRow, Pick, Picked, RoundMasks, StreamId};

/// The pick of an argmax, top-k or draw round with guided rows, once their masks
/// are asked for: the same pick within each row's mask (the bits of every
/// row, an unguided one's all set), or the rows themselves when a mask is
/// late.
pub(super) fn resolve(pick: Pick, masks: Option<&dyn RoundMasks>, rows: usize, vocab: usize) -> (Pick, Option<Vec<u32>>) {
    let Some(masks) = masks.filter(|_| pick != Pick::Logits) else { return (pick, None) };
    let Some(masks) = masks.masks().filter(|m| m.len() == rows) else { return (Pick::Logits, None) };
    let words = vocab.div_ceil(32);
    let mut bits = vec![u32::MAX; rows * words];
    for (row, m) in bits.chunks_mut(words).zip(masks) {
        if let Some(m) = m {
            let w = m.words();
            row.iter_mut().enumerate().for_each(|(i, b)| *b = w.get(i).copied().unwrap_or(0));
        }
    }
    (pick, Some(bits))
}

/// No rows, in the shape `pick` asks for.
pub(super) fn empty(pick: Pick) -> Picked {
    match pick {
        Pick::Logits => Picked::Logits(Vec::new()),
        Pick::Argmax | Pick::Draw => Picked::Tokens(Vec::new()),
        Pick::TopK(_) => Picked::Top(Vec::new()),
    }
}

/// The rows a launched round feeds: each stream the token just picked for it.
pub(super) fn launched_rows(rows: &[DecodeRow], picked: &Picked) -> Vec<(StreamId, u32)> {
    match picked {
        Picked::Tokens(t) => rows.iter().zip(t).map(|(r, &t)| (r.stream, t)).collect(),
        _ => Vec::new(),
    }
}

/// The picks of rows `idx` (one token row each) of `all`, in that order.
pub(super) fn select(all: &Picked, idx: impl Iterator<Item = usize>, vocab: usize) -> Picked {
    match all {
        Picked::Logits(v) => Picked::Logits(select_rows(v, idx, vocab)),
        Picked::Tokens(t) => Picked::Tokens(idx.map(|i| t[i]).collect()),
        Picked::Top(t) => Picked::Top(idx.map(|i| t[i].clone()).collect()),
    }
}

/// Rows `idx` of `v` (rows of `width`), in that order.
pub(super) fn select_rows(v: &[f32], idx: impl Iterator<Item = usize>, width: usize) -> Vec<f32> {
    idx.flat_map(|i| v[i * width..(i + 1) * width].iter().copied()).collect()
}

/// The picks of `rows` in order: the `served` rows' from `first`, the
/// others' from `second` (both in row order).
pub(super) fn merge(rows: &[DecodeRow], served: &[usize], first: Picked, second: Picked, vocab: usize) -> Picked {
    match (first, second) {
        (Picked::Logits(a), Picked::Logits(b)) => Picked::Logits(merge_rows(rows, served, a, b, vocab)),
        (Picked::Tokens(a), Picked::Tokens(b)) => Picked::Tokens(merge_rows(rows, served, a, b, 1)),
        (Picked::Top(a), Picked::Top(b)) => Picked::Top(merge_rows(rows, served, a, b, 1)),
        (a, _) => a,
    }
}

/// The token rows of `rows` in order, each `width` wide: the `served`
/// rows' from `first`, the others' from `second` (both in row order; a
/// decode row may hold several token rows: drafts). What `second` holds
/// past them (a chunk's rows) is dropped.
pub(super) fn merge_rows<T>(rows: &[DecodeRow], served: &[usize], first: Vec<T>, second: Vec<T>, width: usize) -> Vec<T> {
    let (mut a, mut b) = (first.into_iter(), second.into_iter());
    let mut out = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let from = if served.contains(&i) { &mut a } else { &mut b };
        out.extend(from.take(r.tokens.len() * width));
    }
    out
}
