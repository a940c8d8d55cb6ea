//! Prompt passes: cut planning and the one chunk body that both the whole
//! pass and the stepped pass run.
//!
//! Cuts are a pure function of the pass's fixed inputs and the current
//! position, so a pass run back to back, one chunk per round, or cancelled
//! and resumed, cuts at the same places and hands the backend the same rows.

use std::sync::Arc;

use anyhow::{ensure, Result};

use crate::backend::{Backend, Chunk, Encoded, MarkId, PromptImage, StreamId};
use crate::drafter::Drafter;

/// The fixed inputs that decide a pass's cuts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CutPlan {
    /// Rows in the prompt.
    pub prompt_len: usize,
    /// The prompt chunk cap: where cuts are not free, they fall every
    /// `chunk_tokens` rows counted from `planned_start`; where they are, a
    /// chunk takes at most `chunk_tokens` rows.
    pub chunk_tokens: usize,
    /// Where the pass begins (after a restored prefix; 0 without one).
    pub planned_start: usize,
    /// Positions where a mark is to be kept, ascending; a chunk must end at
    /// each of them.
    pub marks: Vec<usize>,
    /// Per-step row cap, for fairness.
    pub max_rows: Option<usize>,
    /// The engine may choose cut sizes (`Capabilities::free_cuts`); only
    /// then does `max_rows` apply.
    pub free_cuts: bool,
    /// The prompt's images as row spans `(start, end)`, ascending: no cut
    /// falls inside one (an image's rows attend to each other both ways,
    /// so they run in one chunk).
    pub images: Vec<(usize, usize)>,
}

impl CutPlan {
    /// Where the chunk starting at `pos` ends. See [`chunk_end`].
    pub fn chunk_end(&self, pos: usize) -> usize {
        self.chunk_end_capped(pos, self.max_rows)
    }

    /// Where the chunk starting at `pos` ends under the cap `max_rows`.
    pub fn chunk_end_capped(&self, pos: usize, max_rows: Option<usize>) -> usize {
        whole_images(pos, chunk_end(pos, self.prompt_len, self.chunk_tokens, self.planned_start, &self.marks, max_rows, self.free_cuts), &self.images)
    }

    /// Every cut of the pass from `from` on, in order (for tests and tools).
    pub fn cuts_from(&self, from: usize) -> Vec<usize> {
        let mut cuts = Vec::new();
        let mut pos = from;
        while pos < self.prompt_len {
            pos = self.chunk_end(pos);
            cuts.push(pos);
        }
        cuts
    }
}

/// The scheduling policy's one place for cuts: the end of the chunk that
/// starts at `pos`, the nearest of
/// * the prompt end,
/// * where cuts are not free, the next multiple of `chunk_tokens` past
///   `planned_start` (the grid is anchored at the planned start, so a
///   resumed pass stays on it and cuts where the whole pass would); where
///   they are, `pos + chunk_tokens`,
/// * the next kept mark after `pos`,
/// * `pos + max_rows`, only where cuts are free (see
///   `Capabilities::free_cuts`; a backend whose results depend on them
///   keeps the whole pass's cuts, always).
///
/// Free cuts keep no grid: paced chunks off it ended in a remainder at
/// each grid line, run as a round or two of a few rows (on the H100, an
/// 1800-token arrival beside six streams: 64, 8 and 2 rows at the first
/// line, ~6 rounds in all).
///
/// Always returns more than `pos` while `pos < prompt_len`.
pub fn chunk_end(pos: usize, prompt_len: usize, chunk_tokens: usize, planned_start: usize, marks: &[usize], max_rows: Option<usize>, free_cuts: bool) -> usize {
    if pos >= prompt_len {
        return prompt_len;
    }
    let chunk = chunk_tokens.max(1);
    let mut end = prompt_len;
    let capped = if free_cuts {
        pos + chunk
    } else if pos < planned_start {
        planned_start
    } else {
        planned_start + ((pos - planned_start) / chunk + 1) * chunk
    };
    end = end.min(capped);
    if let Some(&m) = marks.iter().find(|&&m| m > pos) {
        end = end.min(m);
    }
    if free_cuts {
        if let Some(cap) = max_rows {
            end = end.min(pos + cap.max(1));
        }
    }
    end
}

/// `end`, the end of the chunk from `pos`, moved out of any image it falls
/// inside: back to the image's start, or, when the chunk begins at or in
/// the image, on to its end. A mark or cap inside an image gives way.
pub fn whole_images(pos: usize, end: usize, images: &[(usize, usize)]) -> usize {
    match images.iter().find(|&&(s, e)| s < end && end < e) {
        Some(&(s, _)) if s > pos => s,
        Some(&(_, e)) => e,
        None => end,
    }
}

/// What one chunk did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutcome {
    pub start: usize,
    pub end: usize,
    /// The last row's logits, on the pass's last chunk when asked for.
    pub logits: Option<Vec<f32>>,
    /// A mark kept at `end`, if `end` is one of the plan's marks.
    pub mark: Option<MarkId>,
    /// The pass is complete.
    pub done: bool,
    /// Images whose rows this chunk made first (the pass's first chunk),
    /// and how long that took.
    pub images: Option<(usize, std::time::Duration)>,
}

/// One stream's prompt pass in progress.
#[derive(Clone, Debug)]
pub struct Pass {
    stream: StreamId,
    prompt: Arc<[u32]>,
    plan: CutPlan,
    pos: usize,
    want_logits: bool,
    images: Arc<[PromptImage]>,
    /// The backend holds this pass's image rows (made at its first chunk).
    encoded: bool,
}

impl Pass {
    /// A pass over `prompt` whose state already holds `plan.planned_start`
    /// rows. `want_logits`: return the last row's logits at the end.
    pub fn new(stream: StreamId, prompt: Arc<[u32]>, plan: CutPlan, want_logits: bool) -> Pass {
        let pos = plan.planned_start.min(prompt.len());
        Pass { stream, prompt, plan, pos, want_logits, images: Arc::from([]), encoded: false }
    }

    /// The pass with the prompt's images (which `plan.images` must span).
    pub fn with_images(mut self, images: Arc<[PromptImage]>) -> Pass {
        self.images = images;
        self
    }

    pub fn images(&self) -> &[PromptImage] {
        &self.images
    }

    pub fn stream(&self) -> StreamId {
        self.stream
    }

    pub fn plan(&self) -> &CutPlan {
        &self.plan
    }

    pub fn prompt(&self) -> &Arc<[u32]> {
        &self.prompt
    }

    /// Rows run so far (the stream's state length).
    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn done(&self) -> bool {
        self.pos >= self.prompt.len()
    }

    /// Change the per-step row cap (honoured only for chunk-invariant
    /// backends; see [`chunk_end`]). The lane tightens it while others decode.
    pub fn set_max_rows(&mut self, max_rows: Option<usize>) {
        self.plan.max_rows = max_rows;
    }

    /// The chunk the next step will run.
    pub fn next_chunk(&self) -> (usize, usize) {
        (self.pos, self.plan.chunk_end(self.pos))
    }

    /// Whether a chunk ending at `end` asks for its last row's logits: it
    /// ends the pass, and the pass wants them.
    pub fn wants_logits_at(&self, end: usize) -> bool {
        end == self.prompt.len() && self.want_logits
    }

    /// Image rows the pass has still to run are not made yet.
    pub fn images_pending(&self) -> bool {
        !self.encoded && self.images.iter().any(|i| i.end() > self.pos)
    }

    /// The images the pass has still to run.
    fn wanted_images(&self) -> Vec<PromptImage> {
        self.images.iter().filter(|i| i.end() > self.pos).cloned().collect()
    }

    /// Make about `budget` of the image rows the pass has still to run
    /// ([`Backend::encode_images_step`]): the images once they are all
    /// made (the next chunk then runs without making them), and what the
    /// step did.
    pub fn encode_step(&mut self, backend: &mut dyn Backend, budget: Option<u64>) -> Result<(Option<usize>, Encoded)> {
        let wanted = self.wanted_images();
        let step = backend.encode_images_step(self.stream, &wanted, budget)?;
        if !step.done {
            return Ok((None, step));
        }
        self.encoded = true;
        Ok((Some(wanted.len()), step))
    }

    /// The chunk body: run the next chunk, let the drafter absorb its
    /// features, then keep a mark if the chunk ends on one (only after
    /// every consumer has absorbed the chunk). On error the position stays
    /// where it was.
    pub fn step(&mut self, backend: &mut dyn Backend, drafter: Option<&mut (dyn Drafter + '_)>) -> Result<StepOutcome> {
        self.step_via(backend, drafter, 0, |b, stream, chunk| b.prefill_step(stream, chunk))
    }

    /// [`Pass::step`], with the chunk run by `run` (the lane runs it in a
    /// [`Backend::round`] beside decode rows). `rows_before`: token rows the
    /// same forward ran ahead of the chunk, whose feature rows come first.
    pub fn step_via(
        &mut self,
        backend: &mut dyn Backend,
        drafter: Option<&mut (dyn Drafter + '_)>,
        rows_before: usize,
        run: impl FnOnce(&mut dyn Backend, StreamId, Chunk<'_>) -> Result<Option<Vec<f32>>>,
    ) -> Result<StepOutcome> {
        ensure!(!self.done(), "the prompt pass of stream {} is already complete", self.stream);
        let (start, end) = self.next_chunk();
        let last = end == self.prompt.len();
        // Image rows are made once per pass, by its first chunk (the lane
        // makes them ahead, a step a round: `encode_step`): only for the
        // images it has still to run (a cached prefix may hold some).
        let mut images = None;
        if self.images_pending() {
            let wanted = self.wanted_images();
            let t = std::time::Instant::now();
            backend.encode_images(self.stream, &wanted)?;
            self.encoded = true;
            images = Some((wanted.len(), t.elapsed()));
        }
        let chunk = Chunk { start, tokens: &self.prompt[start..end], want_logits: self.wants_logits_at(end) };
        let logits = run(&mut *backend, self.stream, chunk)?;
        if last && self.encoded {
            backend.drop_images(self.stream);
            self.encoded = false;
        }
        ensure!(!chunk.want_logits || logits.is_some(), "the backend returned no logits for the last chunk of stream {}", self.stream);
        self.pos = end;
        if let Some(d) = drafter {
            let rows = end - start;
            let features = backend.features().unwrap_or(&[]);
            let width = features.len() / (rows_before + rows);
            d.absorb(self.stream, &self.prompt[start..end], features.get(rows_before * width..).unwrap_or(&[]));
        }
        // A failed mark only costs a future cache hit; the pass goes on.
        let mark = if self.plan.marks.binary_search(&end).is_ok() { backend.keep_mark(self.stream).ok() } else { None };
        Ok(StepOutcome { start, end, logits, mark, done: last, images })
    }

    /// Stop between chunks: the backend keeps the state at the last chunk's
    /// end, and the next `step` resumes exactly where an uninterrupted pass
    /// would have gone on.
    pub fn cancel(&mut self, backend: &mut dyn Backend) {
        backend.cancel_prefill(self.stream);
    }
}

/// What a whole pass produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WholePass {
    /// The last row's logits, when the pass wanted them.
    pub logits: Option<Vec<f32>>,
    /// Marks kept, with their positions.
    pub marks: Vec<(usize, MarkId)>,
    /// `(start, end)` of each chunk run.
    pub chunks: Vec<(usize, usize)>,
}

/// The whole pass: every remaining chunk back to back, through the same
/// chunk body as the stepped pass.
pub fn prefill_whole(backend: &mut dyn Backend, mut drafter: Option<&mut (dyn Drafter + '_)>, pass: &mut Pass) -> Result<WholePass> {
    let mut out = WholePass::default();
    while !pass.done() {
        let step = pass.step(backend, drafter.as_deref_mut())?;
        out.chunks.push((step.start, step.end));
        if let Some(m) = step.mark {
            out.marks.push((step.end, m));
        }
        if step.logits.is_some() {
            out.logits = step.logits;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(len: usize, chunk: usize, start: usize, marks: &[usize], max_rows: Option<usize>, inv: bool) -> CutPlan {
        CutPlan { prompt_len: len, chunk_tokens: chunk, planned_start: start, marks: marks.to_vec(), max_rows, free_cuts: inv, images: Vec::new() }
    }

    #[test]
    fn no_cut_falls_inside_an_image() {
        let mut p = plan(40, 8, 0, &[10], Some(3), true);
        p.images = vec![(6, 14), (20, 36)];
        // Before an image the cut moves back to its start; at it, on to its end,
        // whatever the cap, the grid or a mark inside it say.
        assert_eq!(p.cuts_from(0), vec![3, 6, 14, 17, 20, 36, 39, 40]);
        p.free_cuts = false;
        assert_eq!(p.cuts_from(0), vec![6, 14, 16, 20, 36, 40]);
        // A pass that starts inside an image (its first rows cached) runs the rest of it first.
        p.planned_start = 25;
        assert_eq!(p.cuts_from(25), vec![36, 40]);
    }

    #[test]
    fn chunks_follow_the_cap_from_the_planned_start() {
        assert_eq!(plan(10, 4, 0, &[], None, false).cuts_from(0), vec![4, 8, 10]);
        assert_eq!(plan(10, 4, 3, &[], None, false).cuts_from(3), vec![7, 10]);
    }

    #[test]
    fn marks_add_cuts_without_moving_the_grid() {
        assert_eq!(plan(12, 4, 0, &[6], None, false).cuts_from(0), vec![4, 6, 8, 12]);
    }

    #[test]
    fn max_rows_applies_only_where_cuts_are_free() {
        assert_eq!(plan(10, 8, 0, &[], Some(3), false).cuts_from(0), vec![8, 10]);
        // Free cuts keep no grid: capped steps leave no remainder at 8.
        assert_eq!(plan(10, 8, 0, &[], Some(3), true).cuts_from(0), vec![3, 6, 9, 10]);
        // Marks still cut, and chunk_tokens caps a chunk from where it starts.
        assert_eq!(plan(20, 8, 0, &[5], Some(6), true).cuts_from(0), vec![5, 11, 17, 20]);
        assert_eq!(plan(20, 8, 0, &[5], None, true).cuts_from(0), vec![5, 13, 20]);
    }

    #[test]
    fn every_cut_moves_forward() {
        for len in 1..30 {
            for chunk in 0..6 {
                let p = plan(len, chunk, len / 3, &[len / 2, len - 1], Some(0), true);
                let mut pos = p.planned_start;
                while pos < len {
                    let end = p.chunk_end(pos);
                    assert!(end > pos && end <= len);
                    pos = end;
                }
            }
        }
    }
}
