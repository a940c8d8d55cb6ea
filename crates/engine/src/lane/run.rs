//! The lane loop: intake → cancels → sweep → admit → plan → round → emit,
//! on the thread that owns the backend.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::masks::MaskWorkers;
use super::pacer::Pacer;
use super::stream::{Phase, Stream};
use super::{Command, FinishReason, LaneConfig, LaneShared, LaneStats};
use crate::backend::{Backend, Capabilities, StreamId};
use crate::drafter::Drafter;
use crate::prefix::{PrefixIndex, SeenPrefixes};
use crate::stop::TokenText;

/// How long a lane with waiting work but no progress sleeps before looking
/// again (it wakes at once on any command).
const IDLE_POLL: Duration = Duration::from_millis(20);

/// Block prefixes of recent prompts remembered (per generation), to find
/// where prompts share one: a few bytes each, about a million prompt
/// tokens at 16 per block.
const SEEN_PREFIXES: usize = 1 << 16;

/// A panic payload's message.
pub(super) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "a panic".into())
}

pub(super) struct Core {
    pub(super) backend: Box<dyn Backend>,
    pub(super) drafter: Option<Box<dyn Drafter>>,
    pub(super) text: Arc<dyn TokenText>,
    pub(super) caps: Capabilities,
    /// The configuration in effect (clamped to the backend).
    pub(super) cfg: LaneConfig,
    pub(super) shared: Arc<LaneShared>,
    pub(super) queue: VecDeque<Stream>,
    /// Admitted streams, each holding a backend slot, oldest first.
    pub(super) running: Vec<Stream>,
    pub(super) prefix: PrefixIndex,
    /// Prefixes recent prompts shared (where marks pay).
    pub(super) seen: SeenPrefixes,
    pub(super) stats: LaneStats,
    pub(super) pacer: Pacer,
    pub(super) mask_workers: MaskWorkers,
    rx: Receiver<Command>,
    shutdown: bool,
    /// The plan's turns over more decoding streams than a round holds.
    pub(super) rotate: usize,
    /// The last round left a due chunk out for lack of batch room.
    pub(super) chunk_waited: bool,
    /// When the last backend call ended: the loop's own time since is part
    /// of every decoding stream's gap (the pacer sets it aside).
    pub(super) round_end: Option<Instant>,
    /// The chunk the last round named as the next one's (its stream, start
    /// and end): the next round runs it if it can (see `Step::next_chunk`).
    pub(super) announced: Option<(StreamId, usize, usize)>,
    /// The prefill chunk (its stream and start) a round ran without, so a
    /// round ahead could be started with it: it waits no second round.
    pub(super) held: Option<(StreamId, usize)>,
}

impl Core {
    pub(super) fn new(
        backend: Box<dyn Backend>,
        drafter: Option<Box<dyn Drafter>>,
        text: Arc<dyn TokenText>,
        cfg: LaneConfig,
        rx: Receiver<Command>,
        wake: Sender<Command>,
        shared: Arc<LaneShared>,
    ) -> Core {
        let caps = backend.capabilities();
        // Marks fall on block boundaries, so they share whole KV blocks.
        let block_tokens = match backend.fill().block_tokens {
            0 => 16,
            b => b,
        };
        let mut pacer = Pacer::new(cfg.itl_target, cfg.prefill_share, cfg.max_rows, caps.free_cuts()).replaying(caps.replayed_chunk_rows, caps.pads_chunks);
        pacer.learn(&cfg.round_costs);
        Core {
            mask_workers: MaskWorkers::new(cfg.mask_threads, wake),
            pacer,
            prefix: PrefixIndex::new(cfg.prefix_marks),
            seen: SeenPrefixes::new(block_tokens, SEEN_PREFIXES),
            backend,
            drafter,
            text,
            caps,
            cfg,
            shared,
            queue: VecDeque::new(),
            running: Vec::new(),
            stats: LaneStats::default(),
            rx,
            shutdown: false,
            rotate: 0,
            announced: None,
            held: None,
            chunk_waited: false,
            round_end: None,
        }
    }

    pub(super) fn run(mut self) {
        // A panic (in a backend, say) fails the streams it may have hit,
        // the running ones, whose slots and memory return, and the lane
        // serves on: one stream's failure never stops the others' service.
        // Only when failing them panics too does the lane give up: every
        // stream gets an error, the lane says it is dead (`Lane::alive`),
        // and later submissions see `SubmitError::Closed`.
        loop {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_loop()));
            let Err(p) = r else { return };
            let msg = format!("the lane failed: {}", panic_text(&*p));
            tracing::error!("{msg}; failing the running streams");
            self.stats.lane_failures += 1;
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.fail_running(&msg))).is_err() {
                self.give_up(&msg);
                return;
            }
        }
    }

    /// After a panic: the running streams end with `msg` and are forgotten
    /// (or, when none ran, the stream being admitted, first in the queue).
    fn fail_running(&mut self, msg: &str) {
        if self.running.is_empty() {
            if let Some(s) = self.queue.front_mut() {
                s.fail(msg.to_string());
            }
        }
        for s in self.running.iter_mut() {
            s.fail(msg.to_string());
        }
        self.chunk_waited = false;
        self.sweep();
        self.publish();
    }

    /// The lane is dead: every stream, queued, running or in the channel,
    /// ends with `msg`.
    fn give_up(&mut self, msg: &str) {
        tracing::error!("{msg}; the lane has stopped");
        self.shared.dead.store(true, Ordering::SeqCst);
        self.drain_submissions();
        for s in self.queue.iter_mut().chain(self.running.iter_mut()) {
            s.fail(msg.to_string());
        }
        self.shared.queued.fetch_sub(self.queue.len(), Ordering::SeqCst);
        for s in self.queue.drain(..).chain(self.running.drain(..)) {
            s.count_end(&mut self.stats);
        }
        *self.shared.stats.lock().unwrap_or_else(|e| e.into_inner()) = self.stats.clone();
    }

    fn run_loop(&mut self) {
        let mut progress = true;
        let mut failed = 0;
        loop {
            let idle = self.queue.is_empty() && self.running.is_empty();
            self.intake(idle, !progress);
            if self.shutdown {
                break;
            }
            self.check_cancels();
            self.sweep();
            progress = self.admit();
            self.pace_drafter();
            self.send_positions();
            progress |= self.settle();
            progress |= self.turn();
            self.sweep();
            self.stats.rounds += 1;
            // A stream failed: if the backend can run nothing more, no
            // stream can be served (and the next would fail the same way).
            if self.stats.errors > failed {
                failed = self.stats.errors;
                if let Some(why) = self.backend.lost() {
                    return self.give_up(&format!("the backend failed for good: {why}"));
                }
            }
            self.publish();
        }
        self.close();
    }

    /// Tell the drafter whether the lane drafts now, the streams admitted
    /// or prefilling counted as decoding (see `Drafter::pace`).
    fn pace_drafter(&mut self) {
        let prefilling = self.running.iter().filter(|s| matches!(s.phase, Phase::Admitted | Phase::Prefilling { .. })).count();
        let drafting = self.proposing(prefilling);
        if let Some(d) = self.drafter.as_mut() {
            d.pace(drafting);
        }
    }

    /// Take commands: block while there is nothing to do, wait briefly when
    /// the last round made no progress, else just drain.
    fn intake(&mut self, idle: bool, stalled: bool) {
        let t = self.backend.now();
        let first = if idle {
            self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
        } else if stalled {
            self.rx.recv_timeout(IDLE_POLL)
        } else {
            Err(RecvTimeoutError::Timeout)
        };
        // A wait is not the loop's own time: after an idle one the next
        // round has no previous to measure from (counted, the wait read as
        // the cap and a start-up target was said to be unholdable), and a
        // stalled one is set aside as an image encoding step is.
        if idle {
            self.round_end = None;
        } else if stalled {
            self.round_end = self.round_end.map(|e| e + self.backend.now().saturating_duration_since(t));
        }
        match first {
            Ok(c) => self.command(c),
            Err(RecvTimeoutError::Disconnected) => self.shutdown = true,
            Err(RecvTimeoutError::Timeout) => {}
        }
        loop {
            match self.rx.try_recv() {
                Ok(c) => self.command(c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.shutdown = true;
                    break;
                }
            }
        }
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Submit(p) => {
                let mut s = Stream::new(*p, self.cfg.max_context, self.cfg.decode_reserve, self.caps.vocab_size, self.max_draft());
                self.start_guide(&mut s);
                if self.keeps_marks() {
                    // Counted on arrival, so prompts sent together find
                    // what they share before the first pass begins.
                    self.seen.note(&s.prompt, s.cache_salt);
                }
                self.queue.push_back(s);
            }
            Command::Wake => {}
            Command::Shutdown => self.shutdown = true,
        }
    }

    /// Queue the submissions still in the channel (the lane is ending).
    fn drain_submissions(&mut self) {
        while let Ok(c) = self.rx.try_recv() {
            if let Command::Submit(_) = c {
                self.command(c);
            }
        }
    }

    /// Streams whose caller cancelled or left end now.
    fn check_cancels(&mut self) {
        for s in self.queue.iter_mut().chain(self.running.iter_mut()) {
            if !s.ended() && (s.shared.cancelled.load(Ordering::SeqCst) || s.sink.is_closed()) {
                s.finish(FinishReason::Cancelled, String::new());
            }
        }
    }

    /// Remove ended streams; admitted ones are forgotten by the backend
    /// (their slot and memory return) and the drafter.
    pub(super) fn sweep(&mut self) {
        let before = self.queue.len();
        let stats = &mut self.stats;
        self.queue.retain(|s| {
            if s.ended() {
                s.count_end(stats);
                s.shared.position.store(usize::MAX, Ordering::SeqCst);
            }
            !s.ended()
        });
        self.shared.queued.fetch_sub(before - self.queue.len(), Ordering::SeqCst);
        if self.running.iter().any(Stream::ended) {
            let (gone, keep): (Vec<Stream>, Vec<Stream>) = std::mem::take(&mut self.running).into_iter().partition(Stream::ended);
            self.running = keep;
            for s in gone {
                s.count_end(&mut self.stats);
                self.backend.forget(s.id);
                if let Some(d) = self.drafter.as_mut() {
                    d.forget(s.id);
                }
            }
        }
    }

    fn send_positions(&mut self) {
        for (i, s) in self.queue.iter_mut().enumerate() {
            if s.sent_position != Some(i) && !s.ended() {
                s.sent_position = Some(i);
                s.shared.position.store(i, Ordering::SeqCst);
                s.send(super::Event::Queued { position: i });
            }
        }
    }

    fn publish(&mut self) {
        let mut st = self.stats.clone();
        st.prefilling = self.running.iter().filter(|s| s.prefilling()).count();
        st.decoding = self.running.iter().filter(|s| s.decoding()).count();
        st.fill = self.backend.fill();
        st.marks = self.prefix.len();
        st.itl_target_misses = self.pacer.target_misses();
        *self.shared.stats.lock().unwrap_or_else(|e| e.into_inner()) = st;
    }

    /// Shutdown: every stream, queued, running or still in the channel,
    /// ends with `Cancelled`; marks are dropped.
    fn close(&mut self) {
        self.drain_submissions();
        for s in self.queue.iter_mut().chain(self.running.iter_mut()) {
            s.finish(FinishReason::Cancelled, String::new());
        }
        self.sweep();
        for m in self.prefix.marks() {
            self.prefix.remove(m);
            self.backend.drop_mark(m);
        }
        self.publish();
    }
}
