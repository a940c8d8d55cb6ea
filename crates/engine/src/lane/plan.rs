//! The scheduling policy as a pure function: from plain data about the
//! lane ([`LaneView`]: its decoding streams, the oldest prompt pass, the
//! pacer's budget, the batch and memory limits) to the round to run
//! ([`RoundPlan`]: decode rows with their drafts, at most one prompt chunk,
//! and what the backend returns per row). There is no prefill phase and no
//! decode phase: every round gives each decoding stream its next token and
//! lets one prompt catch up beside them.
//!
//! Rows go to, in order: one token per decoding stream (taking turns when
//! there are more than a round holds), the prompt chunk, then drafts. The
//! same order claims memory, so drafts are the first thing shed.

use super::pacer::Budget;
use crate::backend::{DecodeRow, Pick, Picks, StreamId};
use crate::pass::CutPlan;
use crate::sampling::Sampler;

/// What sampling a stream's token rows need from a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Need {
    /// The argmax alone (greedy, no logprobs; after its penalties).
    Argmax,
    /// The row's `k` largest logits (no logprobs; after its penalties).
    Top(usize),
    /// [`Need::Argmax`], [`Need::Top`] within the stream's mask (guided):
    /// picked where the backend picks (it asks for the masks then), else
    /// the row.
    MaskedArgmax,
    MaskedTop(usize),
    /// Sampled with no top-k filter (top-p, min-p or plain temperature,
    /// within its mask if guided): drawn where the backend draws, else the
    /// whole row.
    Draw,
    /// The whole row.
    Logits,
}

impl Need {
    /// `penalties_picked`: the backend applies the stream's penalties
    /// before it picks (`Picks::penalties`; a draft's rows with the drafts
    /// before each counted).
    pub fn of(sampler: &Sampler, logprobs: Option<usize>, penalties_picked: bool) -> Need {
        if logprobs.is_some() || (sampler.penalised() && !penalties_picked) {
            return Need::Logits;
        }
        match (sampler.params().is_greedy(), sampler.params().guide.is_some(), sampler.params().top_k) {
            (true, false, _) => Need::Argmax,
            (true, true, _) => Need::MaskedArgmax,
            (false, _, 0) => Need::Draw,
            (false, false, k) => Need::Top(k),
            (false, true, k) => Need::MaskedTop(k),
        }
    }
}

/// A decoding stream as the plan sees it.
#[derive(Clone, Debug)]
pub(super) struct Decoder<'a> {
    /// Where the lane keeps it (handed back in the plan).
    pub at: usize,
    pub id: StreamId,
    /// The token to feed.
    pub last: u32,
    /// Rows in its state.
    pub len: usize,
    /// Tokens it may still generate.
    pub room: usize,
    /// The drafter's proposal to follow `last`.
    pub draft: &'a [u32],
    /// Most draft tokens its rows may carry (its request's cap).
    pub max_draft: usize,
    pub need: Need,
}

/// The oldest prefilling stream's pass.
#[derive(Clone, Debug)]
pub(super) struct Prefill<'a> {
    pub at: usize,
    pub id: StreamId,
    pub cuts: &'a CutPlan,
    /// Rows run so far.
    pub pos: usize,
}

/// Free state memory, where the backend reports fill.
#[derive(Clone, Copy, Debug)]
pub(super) struct Memory {
    pub free_blocks: usize,
    pub block_tokens: usize,
}

impl Memory {
    /// Blocks that `rows` more rows add to a stream of `len` rows.
    fn blocks(&self, len: usize, rows: usize) -> usize {
        let b = self.block_tokens.max(1);
        (len + rows).div_ceil(b) - len.div_ceil(b)
    }
}

/// What the plan reads.
#[derive(Clone, Debug)]
pub(super) struct LaneView<'a> {
    /// Decoding streams, oldest first.
    pub decoding: Vec<Decoder<'a>>,
    pub prefill: Option<Prefill<'a>>,
    /// The pacer's budget for the prefill's next chunk.
    pub budget: Budget,
    /// Most token rows one round may carry.
    pub max_batch: usize,
    /// Most draft tokens per stream and round.
    pub max_draft: usize,
    /// Rounds of more decoding streams than this carry no drafts.
    pub draft_max_streams: usize,
    pub vocab: usize,
    pub picks: Picks,
    /// `None`: the backend reports no fill, so memory is not planned.
    pub memory: Option<Memory>,
    /// Where the turns over more decoding streams than `max_batch` stand.
    pub rotate: usize,
    /// The last round left the chunk out: it did not fit beside the
    /// decode rows.
    pub chunk_waited: bool,
}

/// The prompt chunk a round carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PlannedChunk {
    pub at: usize,
    pub stream: StreamId,
    pub start: usize,
    pub end: usize,
    /// The per-chunk cap that cuts it there (for `Pass::set_max_rows`).
    pub max_rows: Option<usize>,
}

/// What memory could not hold. The lane makes room (or gives up) and
/// plans again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Short {
    /// The decode rows alone do not fit; `newest` (an `at`) is the newest
    /// stream among them.
    Rows { newest: usize },
    /// The chunk of the pass at `at` needs `need` blocks more than are free
    /// beside the decode rows.
    Chunk { at: usize, need: usize },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct RoundPlan {
    /// Each decode row: the stream's last token, then its draft.
    pub rows: Vec<DecodeRow>,
    /// Each row's `Decoder::at`.
    pub at: Vec<usize>,
    pub chunk: Option<PlannedChunk>,
    pub pick: Pick,
    pub short: Option<Short>,
    /// The turn to plan the next round from.
    pub rotate: usize,
    /// The chunk was due but did not fit beside the decode rows; it runs
    /// alone in the next round, so neither side waits more than one round.
    pub chunk_left_out: bool,
}

impl RoundPlan {
    /// Nothing to run.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty() && self.chunk.is_none()
    }
}

/// The round to run next.
pub(super) fn plan(v: &LaneView<'_>) -> RoundPlan {
    let cap = v.max_batch.max(1);
    let mut out = RoundPlan { rows: Vec::new(), at: Vec::new(), chunk: None, pick: Pick::Logits, short: None, rotate: v.rotate, chunk_left_out: false };
    let mut batch: Vec<&Decoder<'_>> = v.decoding.iter().collect();
    if batch.len() > cap {
        let turn = v.rotate % batch.len();
        batch.rotate_left(turn);
        batch.truncate(cap);
        out.rotate = v.rotate.wrapping_add(cap);
    }
    let blocks = |len: usize, rows: usize| v.memory.map_or(0, |m| m.blocks(len, rows));
    let mut free = v.memory.map_or(usize::MAX, |m| m.free_blocks);
    let rows_need: usize = batch.iter().map(|d| blocks(d.len, 1)).sum();
    if let (true, Some(newest)) = (rows_need > free, batch.iter().map(|d| d.at).max()) {
        return RoundPlan { short: Some(Short::Rows { newest }), rotate: v.rotate, ..out };
    }
    free -= rows_need;

    if let (Some(p), Budget::Chunk(rows)) = (&v.prefill, v.budget) {
        let mut chunk = sized(p, rows, cap - batch.len());
        if chunk.is_none() && v.chunk_waited {
            // It waited a round for room beside the decode rows: alone,
            // the decode rows waiting this round, with their memory.
            if let Some(c) = sized(p, rows, cap) {
                let need = blocks(c.start, c.end - c.start);
                if need <= free + rows_need {
                    batch.clear();
                    free += rows_need;
                    out.rotate = v.rotate;
                    chunk = Some(c);
                } else {
                    out.short = Some(Short::Chunk { at: c.at, need });
                }
            }
        }
        out.chunk_left_out = chunk.is_none() && out.short.is_none();
        if let Some(c) = chunk {
            let need = blocks(c.start, c.end - c.start);
            if need > free {
                out.short = Some(Short::Chunk { at: c.at, need });
            } else {
                free -= need;
                out.chunk = Some(c);
            }
        }
    }

    let mut room = cap - batch.len() - out.chunk.map_or(0, |c| c.end - c.start);
    // A large batch drafts nothing (see `LaneConfig::draft_max_streams`).
    let max_draft = if v.decoding.len() > v.draft_max_streams { 0 } else { v.max_draft };
    for d in &batch {
        let usable = d.draft.iter().position(|&t| t as usize >= v.vocab).unwrap_or(d.draft.len());
        let mut n = usable.min(max_draft).min(d.max_draft).min(d.room.saturating_sub(1)).min(room);
        while n > 0 && blocks(d.len + 1, n) > free {
            n -= 1;
        }
        room -= n;
        free -= blocks(d.len + 1, n);
        let mut tokens = Vec::with_capacity(1 + n);
        tokens.push(d.last);
        tokens.extend_from_slice(&d.draft[..n]);
        out.rows.push(DecodeRow { stream: d.id, tokens });
        out.at.push(d.at);
    }
    out.pick = pick(batch.iter().map(|d| d.need), v.picks, v.vocab);
    out
}

/// The pass's next chunk under `rows` (the pacer's cap) within `room`
/// rows, or `None` if it does not fit there. A chunk-invariant pass may be
/// cut anywhere, so it is cut to the room; any other keeps its cuts.
fn sized(p: &Prefill<'_>, rows: Option<usize>, room: usize) -> Option<PlannedChunk> {
    if room == 0 {
        return None;
    }
    let c = p.cuts;
    let max_rows = if c.free_cuts { Some(rows.map_or(room, |r| r.min(room))) } else { rows };
    let end = c.chunk_end_capped(p.pos, max_rows);
    (end - p.pos <= room).then_some(PlannedChunk { at: p.at, stream: p.id, start: p.pos, end, max_rows })
}

/// What the backend returns per decode token row: the argmax when every
/// stream takes it (and the backend picks it), the top k when every stream
/// samples from its top k alone (k below the vocabulary and within what the
/// backend returns; a greedy guided row's top 1 is its masked argmax), the
/// drawn tokens where the backend draws and no stream needs its row (for
/// logprobs, or penalties the backend does not apply), else whole logits
/// rows.
fn pick(needs: impl Iterator<Item = Need> + Clone, picks: Picks, vocab: usize) -> Pick {
    if needs.clone().next().is_none() {
        return Pick::Logits;
    }
    if picks.argmax && needs.clone().all(|n| matches!(n, Need::Argmax | Need::MaskedArgmax)) {
        return Pick::Argmax;
    }
    let mut k = needs.clone().map(|n| match n {
        Need::Argmax | Need::MaskedArgmax => Some(1),
        Need::Top(n) | Need::MaskedTop(n) => Some(n),
        Need::Draw | Need::Logits => None,
    });
    match k.try_fold(1, |k, n| n.map(|n| k.max(n))) {
        Some(k) if k <= picks.top_k.min(vocab.saturating_sub(1)) => Pick::TopK(k),
        _ if picks.draw && needs.clone().all(|n| n != Need::Logits) => Pick::Draw,
        _ => Pick::Logits,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuts(prompt_len: usize, chunk_tokens: usize, free_cuts: bool) -> CutPlan {
        CutPlan { prompt_len, chunk_tokens, planned_start: 0, marks: Vec::new(), max_rows: None, free_cuts, images: Vec::new() }
    }

    /// Stream `at` (id `10 + at`), feeding token `at`, `len` rows in.
    fn dec(at: usize, len: usize, draft: &[u32]) -> Decoder<'_> {
        Decoder { at, id: 10 + at as u64, last: at as u32, len, room: 100, draft, max_draft: 8, need: Need::Logits }
    }

    fn pass(at: usize, cuts: &CutPlan, pos: usize) -> Option<Prefill<'_>> {
        Some(Prefill { at, id: 10 + at as u64, cuts, pos })
    }

    fn view<'a>(decoding: Vec<Decoder<'a>>, prefill: Option<Prefill<'a>>) -> LaneView<'a> {
        LaneView {
            decoding,
            prefill,
            budget: Budget::Chunk(None),
            max_batch: 64,
            max_draft: 8,
            draft_max_streams: 64,
            vocab: 64,
            picks: Picks::default(),
            memory: None,
            rotate: 0,
            chunk_waited: false,
        }
    }

    /// Three streams decoding and a prompt pass (stream 3) at its start,
    /// in a batch of 8: room for 5 chunk rows beside the decode rows.
    fn three_decoding_beside(c: &CutPlan) -> LaneView<'_> {
        LaneView { max_batch: 8, ..view((0..3).map(|i| dec(i, 3, &[])).collect(), pass(3, c, 0)) }
    }

    fn rows(p: &RoundPlan) -> Vec<(StreamId, Vec<u32>)> {
        p.rows.iter().map(|r| (r.stream, r.tokens.clone())).collect()
    }

    fn span(p: &RoundPlan) -> Option<(usize, usize)> {
        p.chunk.map(|c| (c.start, c.end))
    }

    #[test]
    fn nothing_to_do_plans_nothing() {
        let p = plan(&view(vec![], None));
        assert!(p.is_empty() && p.short.is_none() && !p.chunk_left_out);
    }

    #[test]
    fn without_decoders_the_chunk_runs_alone_on_its_cuts() {
        let c = cuts(20, 8, false);
        let p = plan(&view(vec![], pass(0, &c, 8)));
        assert!(p.rows.is_empty());
        assert_eq!(p.chunk, Some(PlannedChunk { at: 0, stream: 10, start: 8, end: 16, max_rows: None }));
        assert_eq!(p.pick, Pick::Logits);
    }

    #[test]
    fn decoders_and_a_chunk_share_the_round() {
        let c = cuts(20, 8, false);
        let p = plan(&view(vec![dec(0, 5, &[]), dec(2, 9, &[])], pass(1, &c, 0)));
        assert_eq!(rows(&p), vec![(10, vec![0]), (12, vec![2])]);
        assert_eq!(p.at, vec![0, 2]);
        assert_eq!(span(&p), Some((0, 8)));
        assert_eq!(p.chunk.unwrap().stream, 11);
    }

    #[test]
    fn the_pacer_decides_the_chunk() {
        let c = cuts(20, 8, true);
        let mut v = view(vec![dec(0, 5, &[])], pass(1, &c, 0));
        v.budget = Budget::Chunk(Some(3));
        assert_eq!(plan(&v).chunk.map(|c| (c.end, c.max_rows)), Some((3, Some(3))));
        v.budget = Budget::Measure;
        let p = plan(&v);
        assert!(p.chunk.is_none() && !p.chunk_left_out, "a measuring round carries no chunk");
        assert_eq!(rows(&p), vec![(10, vec![0])]);
    }

    #[test]
    fn streams_take_turns_when_over_max_batch() {
        let mut v = view((0..5).map(|i| dec(i, 3, &[])).collect(), None);
        v.max_batch = 2;
        let mut seen = Vec::new();
        for _ in 0..5 {
            let p = plan(&v);
            assert_eq!(p.rows.len(), 2);
            seen.extend(p.at.clone());
            v.rotate = p.rotate;
        }
        assert_eq!(seen, vec![0, 1, 2, 3, 4, 0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_chunk_invariant_pass_is_cut_to_the_room_beside_the_decode_rows() {
        let c = cuts(40, 16, true);
        let p = plan(&three_decoding_beside(&c));
        assert_eq!(p.rows.len(), 3);
        assert_eq!(p.chunk.map(|c| (c.start, c.end, c.max_rows)), Some((0, 5, Some(5))));
    }

    #[test]
    fn a_chunk_that_does_not_fit_beside_the_decode_rows_goes_alone_next() {
        let c = cuts(40, 8, false);
        let mut v = three_decoding_beside(&c);
        let first = plan(&v);
        assert_eq!(first.rows.len(), 3);
        assert!(first.chunk.is_none() && first.chunk_left_out);
        v.chunk_waited = true;
        let second = plan(&v);
        assert!(second.rows.is_empty(), "the decode rows wait one round");
        assert_eq!(span(&second), Some((0, 8)));
        assert!(!second.chunk_left_out);
    }

    #[test]
    fn a_chunk_that_must_go_alone_but_lacks_memory_keeps_the_decode_rows() {
        let c = cuts(40, 8, false);
        let mut v = three_decoding_beside(&c);
        v.chunk_waited = true;
        // The decode rows fit in their streams' blocks; the chunk needs two.
        v.memory = Some(Memory { free_blocks: 1, block_tokens: 4 });
        let p = plan(&v);
        assert_eq!(p.short, Some(Short::Chunk { at: 3, need: 2 }));
        assert_eq!(p.rows.len(), 3);
        assert!(p.chunk.is_none());
        v.memory = Some(Memory { free_blocks: 2, block_tokens: 4 });
        let p = plan(&v);
        assert_eq!((p.short, p.rows.len(), span(&p)), (None, 0, Some((0, 8))));
    }

    #[test]
    fn drafts_are_trimmed_to_max_draft_room_budget_and_vocabulary() {
        let long = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        let bad = [1, 2, 99, 4];
        let mut near_end = dec(1, 3, &long);
        near_end.room = 3;
        let mut v = view(vec![dec(0, 3, &long), near_end, dec(2, 3, &bad)], None);
        v.max_draft = 4;
        let p = plan(&v);
        assert_eq!(rows(&p), vec![(10, vec![0, 1, 2, 3, 4]), (11, vec![1, 1, 2]), (12, vec![2, 1, 2])]);
        // The batch budget: 2 decode rows and a 3-row chunk leave 3 of 8.
        let c = cuts(3, 8, false);
        let mut v = view(vec![dec(0, 3, &long), dec(1, 3, &long)], pass(2, &c, 0));
        v.max_batch = 8;
        let p = plan(&v);
        assert_eq!(span(&p), Some((0, 3)), "the chunk comes before drafts");
        assert_eq!(rows(&p), vec![(10, vec![0, 1, 2, 3]), (11, vec![1])]);
        // No drafter, no drafts.
        v.max_draft = 0;
        assert!(plan(&v).rows.iter().all(|r| r.tokens.len() == 1));
        // A stream's own cap (its request's), and a batch too large to draft.
        v.max_draft = 8;
        v.decoding[0].max_draft = 2;
        // (The room stream 10 leaves goes to stream 11.)
        assert_eq!(rows(&plan(&v)), vec![(10, vec![0, 1, 2]), (11, vec![1, 1])]);
        v.draft_max_streams = 1;
        assert!(plan(&v).rows.iter().all(|r| r.tokens.len() == 1), "two streams decode: past draft_max_streams");
        v.draft_max_streams = 2;
        assert_eq!(rows(&plan(&v))[0], (10, vec![0, 1, 2]));
    }

    #[test]
    fn memory_sheds_drafts_first() {
        let long = [1, 2, 3, 4, 5, 6, 7, 8];
        // Rows 4 and 8 start blocks of 4: each stream's row needs a block,
        // and three are free.
        let mut v = view(vec![dec(0, 4, &long), dec(1, 8, &long)], None);
        v.memory = Some(Memory { free_blocks: 3, block_tokens: 4 });
        let p = plan(&v);
        assert!(p.short.is_none());
        // Stream 0's row opens a block with room for 3 more and the spare
        // block holds 4: 7 drafts. Stream 1's row's block holds 3 more.
        assert_eq!(rows(&p), vec![(10, vec![0, 1, 2, 3, 4, 5, 6, 7]), (11, vec![1, 1, 2, 3])]);
        // No room for the rows themselves: the newest stream is named.
        v.memory = Some(Memory { free_blocks: 1, block_tokens: 4 });
        let p = plan(&v);
        assert_eq!(p.short, Some(Short::Rows { newest: 1 }));
        assert!(p.is_empty());
    }

    #[test]
    fn a_chunk_short_of_memory_is_named_and_the_decode_rows_still_run() {
        // The decode row fits in its stream's last block; its drafts need
        // one more block, the chunk two.
        let c = cuts(20, 8, false);
        let mut v = view(vec![dec(0, 7, &[5, 6])], pass(1, &c, 0));
        v.memory = Some(Memory { free_blocks: 1, block_tokens: 4 });
        let p = plan(&v);
        assert_eq!(p.short, Some(Short::Chunk { at: 1, need: 2 }));
        assert!(p.chunk.is_none());
        assert_eq!(rows(&p), vec![(10, vec![0, 5, 6])], "the drafts take what the chunk did not");
        v.memory = Some(Memory { free_blocks: 2, block_tokens: 4 });
        let p = plan(&v);
        assert_eq!((p.short, span(&p)), (None, Some((0, 8))));
        assert_eq!(rows(&p), vec![(10, vec![0])], "drafts are shed before the chunk");
    }

    #[test]
    fn the_pick_is_the_least_that_every_stream_allows() {
        let needs = |ns: &[Need]| -> Vec<Decoder<'static>> { ns.iter().enumerate().map(|(i, &n)| Decoder { need: n, ..dec(i, 3, &[]) }).collect() };
        let both = Picks { argmax: true, top_k: 16, ..Picks::default() };
        let pick_of = |ns: &[Need], picks: Picks| {
            let mut v = view(needs(ns), None);
            v.picks = picks;
            plan(&v).pick
        };
        use Need::*;
        assert_eq!(pick_of(&[Argmax, Argmax], both), Pick::Argmax);
        assert_eq!(pick_of(&[Argmax, Argmax], Picks { argmax: false, top_k: 16, ..Picks::default() }), Pick::TopK(1));
        assert_eq!(pick_of(&[Argmax, Top(5), Top(12)], both), Pick::TopK(12));
        assert_eq!(pick_of(&[Argmax, Top(17)], both), Pick::Logits, "k past what the backend returns");
        assert_eq!(pick_of(&[Argmax, Top(64)], Picks { argmax: true, top_k: 100, ..Picks::default() }), Pick::Logits, "k not below the vocabulary");
        assert_eq!((pick_of(&[Argmax, Logits], both), pick_of(&[Argmax], Picks::default())), (Pick::Logits, Pick::Logits));
        // Guided rows are picked where the backend picks (a greedy one's top 1 within its mask is its masked argmax).
        assert_eq!((pick_of(&[Argmax, MaskedArgmax], both), pick_of(&[MaskedArgmax, Top(5)], both)), (Pick::Argmax, Pick::TopK(5)));
        assert_eq!(
            (pick_of(&[MaskedArgmax], Picks { argmax: false, top_k: 16, ..Picks::default() }), pick_of(&[MaskedTop(12), Argmax], both)),
            (Pick::TopK(1), Pick::TopK(12))
        );
        assert_eq!((pick_of(&[MaskedTop(40)], both), pick_of(&[MaskedTop(3), Logits], both)), (Pick::Logits, Pick::Logits));
        // Drawn where the backend draws, unless a row must come back whole.
        let draws = Picks { draw: true, ..both };
        assert_eq!((pick_of(&[Argmax, Draw], both), pick_of(&[Argmax, Draw], draws)), (Pick::Logits, Pick::Draw));
        assert_eq!((pick_of(&[Top(5), Top(40), MaskedArgmax], draws), pick_of(&[Top(5), Draw, Logits], draws)), (Pick::Draw, Pick::Logits));
        assert_eq!((pick_of(&[Argmax, Top(5)], draws), pick_of(&[Argmax], draws)), (Pick::TopK(5), Pick::Argmax), "top k and argmax stay as they were");
        // Drafts and a chunk leave the pick as it is.
        let c = cuts(20, 8, false);
        let mut v = view(vec![Decoder { need: Argmax, ..dec(0, 3, &[1, 2]) }], pass(1, &c, 0));
        v.picks = both;
        let p = plan(&v);
        assert_eq!((p.pick, p.rows[0].tokens.len(), span(&p)), (Pick::Argmax, 3, Some((0, 8))));
    }
}
