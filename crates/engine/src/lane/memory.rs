//! Memory: admission by fill, and making room when a round does not fit.
//!
//! A stream is admitted when its prompt plus its decode reserve fits
//! beside what the running streams already claimed; cached marks give way
//! when that makes room. A stream may grow past its reserve while memory
//! lasts. When a planned round does not fit, drafts go first (the plan
//! sheds them), then the least recently used marks, then the newest
//! decoding streams end with `length`; a pass whose next chunk does not
//! fit is stopped between chunks until memory frees, and fails when no
//! stream decodes (nothing would free it). The backend's fill is the only
//! measure; nothing is guessed.

use std::sync::atomic::Ordering;

use super::plan::Short;
use super::run::Core;
use super::stream::{Phase, Stream};
use super::FinishReason;
use crate::backend::Fill;

/// Whether the queue's first stream may start now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Admission {
    Admit,
    /// Dropping cached marks could make room: drop the oldest and ask again.
    DropMark,
    /// Wait for running streams to end.
    Wait,
    /// Nothing runs and no mark is held, yet it does not fit: it never will.
    Never,
}

/// Admission of a stream claiming `claim` tokens (prompt + reserve), given
/// each running stream's `(claim, rows)` and whether marks are held.
pub(super) fn admission(fill: &Fill, running: &[(usize, usize)], claim: usize, marks: bool) -> Admission {
    // Blocks claimed by running streams but not yet in use.
    let outstanding: usize = running.iter().map(|&(c, len)| fill.blocks_for(c).saturating_sub(fill.blocks_for(len))).sum();
    if (Fill { blocks_used: fill.blocks_used + outstanding, ..*fill }).fits(claim) {
        return Admission::Admit;
    }
    let streams: usize = running.iter().map(|&(_, len)| fill.blocks_for(len)).sum();
    let without_marks = fill.slots_used < fill.slots_total && streams + outstanding + fill.blocks_for(claim) <= fill.blocks_total;
    if without_marks && marks {
        Admission::DropMark
    } else if running.is_empty() && !marks {
        Admission::Never
    } else {
        Admission::Wait
    }
}

impl Core {
    /// Admit queued streams, in order, while they fit.
    pub(super) fn admit(&mut self) -> bool {
        let mut progress = false;
        while let Some(claim) = self.queue.front().map(|s| s.claim) {
            if self.running.len() >= self.cfg.max_running {
                break;
            }
            if self.caps.reports_fill {
                let fill = self.backend.fill();
                let running: Vec<(usize, usize)> = self.running.iter().map(|s| (s.claim, s.len)).collect();
                match admission(&fill, &running, claim, !self.prefix.is_empty()) {
                    Admission::Admit => {}
                    Admission::DropMark => {
                        progress |= self.drop_lru_mark();
                        continue;
                    }
                    Admission::Wait => break,
                    Admission::Never => {
                        let Some(mut s) = self.unqueue() else { break };
                        s.fail(format!(
                            "the stream needs {} KV blocks and a free slot, but the backend reports {} of {} blocks and {} of {} slots in use with nothing running",
                            fill.blocks_for(claim),
                            fill.blocks_used,
                            fill.blocks_total,
                            fill.slots_used,
                            fill.slots_total
                        ));
                        s.count_end(&mut self.stats);
                        progress = true;
                        continue;
                    }
                }
            }
            let Some(s) = self.unqueue() else { break };
            self.start(s);
            progress = true;
        }
        progress
    }

    /// Take the queue's first stream out of it.
    fn unqueue(&mut self) -> Option<Stream> {
        let s = self.queue.pop_front()?;
        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
        s.shared.position.store(usize::MAX, Ordering::SeqCst);
        Some(s)
    }

    /// Drop the prefix cache's least recently used mark; false if none.
    pub(super) fn drop_lru_mark(&mut self) -> bool {
        match self.prefix.pop_lru() {
            Some(m) => {
                self.backend.drop_mark(m);
                self.stats.marks_dropped += 1;
                true
            }
            None => false,
        }
    }

    /// Make room for what a plan found short: drop a mark, or else end the
    /// newest stream of the round with `length`, or stop the pass between
    /// chunks (failing it when no stream decodes). True when the lane
    /// should plan again.
    pub(super) fn make_room(&mut self, short: Short) -> bool {
        if self.drop_lru_mark() {
            return true;
        }
        match short {
            Short::Rows { newest } => {
                let s = &mut self.running[newest];
                let tail = s.text.finish();
                s.finish(FinishReason::Length, tail);
                // Its memory returns now, for the plan to see.
                self.sweep();
                true
            }
            Short::Chunk { at, need } => {
                let decoding = self.running.iter().any(Stream::decoding);
                let fill = self.backend.fill();
                let s = &mut self.running[at];
                if let Phase::Prefilling { pass, paused: paused @ false } = &mut s.phase {
                    // Resume when memory frees: the state stays at the last chunk's end.
                    pass.cancel(&mut *self.backend);
                    *paused = true;
                    self.stats.prefill_pauses += 1;
                }
                if !decoding {
                    s.fail(format!("KV memory is full: the next chunk needs {need} blocks, {} of {} are in use", fill.blocks_used, fill.blocks_total));
                }
                !decoding
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(used: usize, total: usize) -> Fill {
        Fill { blocks_used: used, blocks_total: total, block_tokens: 4, slots_used: 1, slots_total: 4, ..Fill::default() }
    }

    #[test]
    fn a_stream_is_admitted_beside_what_others_claimed() {
        // One stream of 8 rows claiming 24 tokens (6 blocks, 2 in use).
        let running = [(24, 8)];
        assert_eq!(admission(&fill(2, 10), &running, 16, false), Admission::Admit);
        assert_eq!(admission(&fill(2, 10), &running, 20, false), Admission::Wait, "5 blocks beside 6 claimed");
        assert_eq!(admission(&fill(2, 11), &running, 20, false), Admission::Admit);
    }

    #[test]
    fn marks_give_way_only_when_that_makes_room() {
        let running = [(24, 8)];
        // 4 blocks in use, 2 of them marks': dropping them leaves room.
        assert_eq!(admission(&fill(4, 10), &running, 16, true), Admission::DropMark);
        // Even without marks it would not fit.
        assert_eq!(admission(&fill(4, 10), &running, 24, true), Admission::Wait);
    }

    #[test]
    fn a_stream_that_cannot_fit_even_alone_is_refused() {
        assert_eq!(admission(&fill(0, 4), &[], 20, false), Admission::Never);
        assert_eq!(admission(&fill(2, 4), &[], 16, true), Admission::DropMark);
        let full = Fill { slots_used: 4, ..fill(0, 10) };
        assert_eq!(admission(&full, &[(4, 4)], 4, false), Admission::Wait, "a slot frees when a stream ends");
    }
}
