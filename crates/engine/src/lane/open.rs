//! A stream's start: its backend slot at admission; then, when its pass
//! begins, the longest cached prefix of its prompt and the cuts of its
//! pass, with the marks worth keeping on the way.

use std::time::Instant;

use super::run::Core;
use super::stream::{Phase, Stream};
use super::{Event, FinishReason};
use crate::pass::{CutPlan, Pass};

impl Core {
    /// Open an admitted stream: it takes a backend slot and joins `running`
    /// (which holds only open streams) to wait for its pass to begin. A
    /// stream that cannot be opened fails here.
    pub(super) fn start(&mut self, mut s: Stream) {
        s.admitted = Some(Instant::now());
        if let Err(e) = self.backend.open(s.id) {
            s.fail(format!("the backend could not open a stream: {e:#}"));
            s.count_end(&mut self.stats);
            return;
        }
        self.stats.admitted += 1;
        s.phase = Phase::Admitted;
        self.running.push(s);
    }

    /// Begin the pass of the oldest admitted stream once no pass admitted
    /// before it is under way. Passes run one after another anyway; begun
    /// only now, a pass finds what the ones before it cached (a document
    /// sent with several questions at once is prefilled once).
    pub(super) fn begin_pass(&mut self) {
        while let Some(at) = self.running.iter().position(Stream::prefilling) {
            if !matches!(self.running[at].phase, Phase::Admitted) {
                return;
            }
            let mut running = std::mem::take(&mut self.running);
            self.begin(&mut running[at]);
            self.running = running;
            if self.running[at].prefilling() {
                return;
            }
        }
    }

    /// Restore the longest cached prefix of `s`'s prompt and plan its pass;
    /// a warm feed found whole in the cache is done at once.
    fn begin(&mut self, s: &mut Stream) {
        let n = s.prompt.len();
        // A normal pass runs at least its last row, for its logits.
        let max_len = if s.warm { n } else { n - 1 };
        let Some(planned) = self.cached_prefix(s, max_len) else { return };
        let plan = CutPlan {
            prompt_len: n,
            chunk_tokens: self.cfg.chunk_tokens,
            planned_start: planned,
            marks: self.marks_to_keep(s, planned),
            max_rows: self.cfg.max_rows,
            free_cuts: self.caps.free_cuts(),
            images: s.images.iter().map(|m| (m.start, m.end())).collect(),
        };
        if let Some(d) = self.drafter.as_mut().filter(|_| s.draft_tokens > 0) {
            d.open(s.id, &s.prompt[..planned]);
            d.cap(s.id, s.draft_tokens);
        }
        s.len = planned;
        s.cached = planned;
        self.stats.cached_tokens += planned as u64;
        s.phase = Phase::Prefilling { pass: Pass::new(s.id, s.prompt.clone(), plan, !s.warm).with_images(s.images.clone()), paused: false };
        s.send(Event::Started { cached_tokens: planned });
        if s.warm && planned == n {
            s.finish(FinishReason::Warmed, String::new());
        }
    }

    /// Whether the backend's own block cache serves prefixes (else marks do).
    pub(super) fn caches_blocks(&self) -> bool {
        self.cfg.prefix_marks > 0 && self.caps.prefix_blocks
    }

    /// Whether the lane keeps marks for the prefix cache.
    pub(super) fn keeps_marks(&self) -> bool {
        self.cfg.prefix_marks > 0 && !self.caps.prefix_blocks
    }

    /// Put the longest cached prefix of `s`'s prompt (at most `max_len`
    /// rows) into its open, empty state: the rows it holds then, or `None`
    /// when the stream failed.
    fn cached_prefix(&mut self, s: &mut Stream, max_len: usize) -> Option<usize> {
        if self.cfg.prefix_marks == 0 {
            return Some(0);
        }
        self.stats.prefix_query_tokens += s.prompt.len() as u64;
        if self.caches_blocks() {
            return match self.backend.attach_prefix(s.id, &s.prompt, s.cache_salt, max_len) {
                Ok(rows) if rows <= max_len => Some(rows),
                // The state is not what the cache promised: start clean.
                _ => self.reopen(s),
            };
        }
        // A backend that rewinds can use a mark at the prompt's very end
        // and cut it back to `max_len`.
        let limit = if self.caps.supports_rewind { s.prompt.len() } else { max_len };
        let Some((mark, len)) = self.prefix.lookup(&s.prompt, s.cache_salt, limit) else { return Some(0) };
        let restored = self.backend.restore_mark(s.id, mark);
        if matches!(restored, Ok(l) if l == len) {
            if len <= max_len {
                return Some(len);
            }
            if self.backend.rewind(s.id, max_len).is_ok() {
                return Some(max_len);
            }
            return self.reopen(s);
        }
        self.prefix.remove(mark);
        self.backend.drop_mark(mark);
        self.stats.marks_dropped += 1;
        if restored.is_ok() {
            // The mark did not hold what the index says.
            return self.reopen(s);
        }
        Some(0)
    }

    /// Give `s` a clean slot again: `Some(0)`, or `None` when it failed.
    fn reopen(&mut self, s: &mut Stream) -> Option<usize> {
        self.backend.forget(s.id);
        match self.backend.open(s.id) {
            Ok(()) => Some(0),
            Err(e) => {
                s.fail(format!("the backend could not open a stream: {e:#}"));
                None
            }
        }
    }

    /// Where `s`'s pass keeps marks, less those cached already: every
    /// `mark_every` tokens past the restored prefix; the prompt's end (one
    /// row short of it where the backend cannot rewind, so that the same
    /// prompt again can restore it and run only its last row); the hint
    /// the request gave (a system turn's end); and the end of the longest
    /// block-aligned prefix another recent prompt shared, where the next
    /// one sharing it will start.
    fn marks_to_keep(&self, s: &Stream, planned: usize) -> Vec<usize> {
        if !self.keeps_marks() {
            return Vec::new();
        }
        let n = s.prompt.len();
        let end = if s.warm || self.caps.supports_rewind { n } else { n - 1 };
        let mut marks = Vec::new();
        if self.cfg.mark_every > 0 {
            let every = self.cfg.mark_every;
            marks.extend((planned / every + 1..).map(|k| k * every).take_while(|&p| p <= n));
        }
        let end_mark = (self.cfg.mark_prompt_end || s.warm) && end > planned;
        if end_mark {
            marks.push(end);
        }
        marks.extend(s.prefix_hint.filter(|&h| h > planned && h <= end));
        let shared = self.seen.shared(&s.prompt, s.cache_salt, end);
        // One ending within a block of the end mark adds little to it.
        if shared > planned && !(end_mark && end - shared < self.seen.block_tokens()) {
            marks.push(shared);
        }
        marks.sort_unstable();
        marks.dedup();
        self.prefix.missing(&s.prompt, s.cache_salt, &marks)
    }
}
