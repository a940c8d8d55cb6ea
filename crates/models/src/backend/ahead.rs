//! Rounds started before they are asked for: whether the round after
//! this one (with the chunk named for it) may start now, its host work
//! prepared while the device runs this one, and a step served by the round
//! the device is already running (whole, in part, or not at all).

use anyhow::Result;
use braid_engine::{replayed_size, Chunk, DecodeRow, Pick, Step, StreamId};
use braid_ops::{Device, Forward};

use super::rows::RowArrays;
use super::{pad, ModelBackend, StreamState, REPLAY_CHUNK_ROWS};

/// What a step says of the round after it (`Step::next_chunk`,
/// `Step::next_plain`, `Step::next_drafts`).
#[derive(Clone, Copy)]
pub(super) struct NextRound<'c> {
    chunk: Option<(StreamId, Chunk<'c>)>,
    plain: bool,
    drafts: bool,
}

impl<'c> NextRound<'c> {
    pub(super) fn of(step: &Step<'c>) -> NextRound<'c> {
        NextRound { chunk: step.next_chunk, plain: step.next_plain, drafts: step.next_drafts }
    }
}

/// A round the device was told to start before it was asked for: each
/// stream fed one token (the one the last round picked) at its current
/// length. Its logits land in `Scratch::logits`.
pub(super) struct Launched {
    pub(super) rows: Vec<(StreamId, u32)>,
    /// Started with a prompt chunk: it serves only the very step named,
    /// whose forward the device then finds running.
    pub(super) with_chunk: bool,
    /// Streams it feeds that were forgotten since: their blocks and length
    /// are kept until the round after, so that the forward the device is
    /// running still serves the others (a stream ending would otherwise
    /// make the next round another forward, run after the launched one:
    /// twice a round's time on the H200). Their slots are free already
    /// (attention-only models, the only ones launched ahead, read none).
    pub(super) gone: Vec<(StreamId, StreamState)>,
}

impl<D: Device> ModelBackend<D> {
    /// Whether the round after `rows` (just run: the same streams, one
    /// token further) may be started before it is asked for: the device
    /// can, a stray round leaves nothing that matters (no recurrent
    /// state), and each stream's blocks hold its next row, a block given
    /// now to a stream whose blocks are full. (Not launched past a block's
    /// end, one round in 16 of each stream lost its head start: on the
    /// H100, six streams' rounds took 1.7 ms instead of 1.4 in a third of
    /// them.)
    fn may_launch_ahead(&mut self, rows: &[DecodeRow]) -> bool {
        self.dev.caps().ahead
            && self.rewindable
            && !rows.is_empty()
            && rows.iter().all(|r| r.tokens.len() == 1 && self.streams.contains_key(&r.stream))
            && rows.iter().all(|r| {
                let next = self.streams[&r.stream].len + 1;
                self.reserve(r.stream, next).is_ok()
            })
    }

    /// Whether the chunk named for the next round can start with it after
    /// `rows`: its stream is where the chunk starts, the chunk is a size
    /// that replays (a forward run afresh would not find it started), it
    /// holds no image rows, and its blocks can be given now. A chunk that
    /// wants logits adds a logits row: only where `scratch.logits` already
    /// holds it, since a grown buffer would lose this round's logits before
    /// its pick reads them.
    fn ahead_chunk_ready(&mut self, rows: &[DecodeRow], (stream, c): (StreamId, Chunk<'_>)) -> bool {
        let vocab = self.model.vocab();
        let n = self.chunk_rows(stream, &c, rows.len());
        let ok = self.streams.get(&stream).is_some_and(|s| s.len == c.start)
            && replayed_size(n)
            && n <= REPLAY_CHUNK_ROWS
            && !self.images.contains_key(&stream)
            && (!c.want_logits || rows.len() < self.logit_rows_held)
            && c.tokens.iter().all(|&t| (t as usize) < vocab);
        ok && self.reserve(stream, c.start + n).is_ok()
    }

    /// Prepare (the host work of) the round after `rows`: the same streams,
    /// one token further, and the chunk named for it. This round's tokens
    /// stand in for the ones the launch will feed.
    pub(super) fn prepare_ahead(&mut self, rows: &[DecodeRow], next: Option<(StreamId, Chunk<'_>)>) {
        let mut parts: Vec<(StreamId, &[u32])> = rows.iter().map(|r| (r.stream, r.tokens.as_slice())).collect();
        let mut logit_rows: Vec<usize> = (0..parts.len()).collect();
        let padded;
        if let Some((stream, c)) = next {
            // Padded as the step will run it (`run`), so it finds this launch.
            padded = pad(c.tokens, self.chunk_rows(stream, &c, rows.len()));
            parts.push((stream, &padded));
            if c.want_logits {
                logit_rows.push(rows.len() + c.tokens.len() - 1);
            }
        }
        let arrays = RowArrays::new(&self.streams, self.cfg.block_tokens, &parts, self.win.is_some());
        let batch = arrays.batch(&self.streams, &parts, &logit_rows, self.window_over_full);
        let (dev, model, mem, scratch) = (&self.dev, &self.model, &mut self.mem, &mut self.scratch);
        dev.forward_ahead(Forward { key: Some(batch.key()), tokens: batch.tokens }, &mut || model.forward(dev, &batch, mem, scratch));
    }

    /// What to start ahead after a round of `rows` (with a chunk or not):
    /// `Some(next)` to launch the round after with the chunk named for it,
    /// or with decode rows alone where the step says so or no pass is
    /// under way (during one, the next round will likely carry a chunk, and
    /// one started without it would serve only part of it). Nothing where
    /// the next round will likely carry drafts: one token a stream would
    /// serve only part of it.
    pub(super) fn ahead<'c>(&mut self, rows: &[DecodeRow], chunk: bool, pick: Pick, next: NextRound<'c>) -> Option<Option<(StreamId, Chunk<'c>)>> {
        if pick != Pick::Argmax || next.drafts || !self.may_launch_ahead(rows) || self.sitting_out(rows) {
            return None;
        }
        match next {
            NextRound { chunk: Some(n), .. } => self.ahead_chunk_ready(rows, n).then_some(Some(n)),
            NextRound { chunk: None, plain, .. } => (plain || (!chunk && !self.chunk_last)).then_some(None),
        }
    }

    /// The round launched ahead, if `step` asks for any of its rows again
    /// (the same stream fed the same token): it is taken (the device finds
    /// it running), and the pairs (index in `step.rows`, index in the
    /// launched round) of the rows it serves are returned. Streams it fed
    /// that `step` does not ask for stay where they were: it wrote only
    /// their KV past their length.
    pub(super) fn take_launched(&mut self, step: &Step<'_>) -> Result<Vec<(usize, usize)>> {
        let Some(mut l) = self.launched.take() else { return Ok(Vec::new()) };
        // Started with a chunk, it serves only the very step named, which
        // runs as usual (its forward finds itself running on the device). A
        // stream that left and was opened again is not the launched round's.
        if l.with_chunk || l.gone.iter().any(|g| self.streams.contains_key(&g.0)) {
            self.release(l.gone);
            return Ok(Vec::new());
        }
        // The streams that left since the launch rejoin it for its forward
        // alone (it is the one running), then go.
        let gone: Vec<StreamId> = l.gone.iter().map(|g| g.0).collect();
        self.streams.extend(std::mem::take(&mut l.gone));
        let served = self.serve_launched(step, &l);
        let gone = gone.into_iter().filter_map(|id| self.streams.remove(&id).map(|st| (id, st))).collect();
        self.release(gone);
        served
    }

    /// The pairs of [`ModelBackend::take_launched`] for the round `l`
    /// launched (its streams all open), its forward run where it serves any.
    fn serve_launched(&mut self, step: &Step<'_>, l: &Launched) -> Result<Vec<(usize, usize)>> {
        let served: Vec<(usize, usize)> = step
            .rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| (r.tokens.len() == 1).then(|| l.rows.iter().position(|&(s, t)| s == r.stream && t == r.tokens[0]).map(|j| (i, j))).flatten())
            .collect();
        if served.is_empty() {
            return Ok(served);
        }
        let toks: Vec<[u32; 1]> = l.rows.iter().map(|&(_, t)| [t]).collect();
        let parts: Vec<(StreamId, &[u32])> = l.rows.iter().zip(&toks).map(|(&(s, _), t)| (s, &t[..])).collect();
        let logit_rows: Vec<usize> = (0..parts.len()).collect();
        let lens: Vec<usize> = l.rows.iter().map(|(s, _)| self.streams[s].len).collect();
        self.forward(&parts, &logit_rows, false)?;
        // Only the served streams fed these rows, as far as the lane knows.
        self.keep_taps(&parts, |s| step.rows.iter().zip(0..).any(|(r, i)| r.stream == s && served.iter().any(|&(k, _)| k == i)));
        for (j, &(s, _)) in l.rows.iter().enumerate() {
            if !served.iter().any(|&(_, k)| k == j) {
                self.streams.get_mut(&s).expect("a launched stream is open").len = lens[j];
            }
        }
        Ok(served)
    }

    /// Forget the round launched ahead (it wrote only KV past its streams'
    /// lengths), freeing what the streams that left kept for it.
    pub(super) fn drop_launched(&mut self) {
        if let Some(l) = self.launched.take() {
            self.release(l.gone);
        }
    }

    /// Whether a stream of the last round, still open, sits this one out
    /// (a guided stream waiting for its mask): it will likely be back in
    /// the next, which a round launched ahead without it would serve only
    /// in part, running the rest as a second forward — twice a round.
    fn sitting_out(&self, rows: &[DecodeRow]) -> bool {
        self.last_rows.iter().any(|s| self.streams.contains_key(s) && !rows.iter().any(|r| r.stream == *s))
    }

    /// Whether a round launched ahead is running (for tests).
    pub fn launched_ahead(&self) -> bool {
        self.launched.is_some()
    }
}
