//! The pacer: how many prompt rows a round may take.
//!
//! A prompt chunk that shares a round with decode rows adds its rows' cost
//! to every decoding stream's inter-token gap. The pacer sizes each chunk
//! one of two ways:
//! * **An inter-token-latency target** (`LaneConfig::itl_target`): the
//!   largest chunk whose round the cost model predicts within the target,
//!   at least one row (the newcomer always advances). The model is linear —
//!   a fixed cost per forward, a cost per decode row and per decoding
//!   context token, per prompt row and per prompt row and context token —
//!   fitted as the lane runs by non-negative least squares ([`CostModel`]), so
//!   it follows the device (CPU or GPU) and the streams' growing contexts;
//!   chunks grow by half at most past the largest it has seen.
//!   A round the target cannot hold (the decode rows alone exceed it) is
//!   counted and said once in the log.
//! * **A share of a plain round** (`LaneConfig::prefill_share`):
//!   * on a backend that replays a few chunk sizes (a GPU's graphs), the
//!     largest size whose round adds at most that fraction to a plain
//!     round, read from what each size has added ([`Pacer::sized`]): the
//!     warm-up's timed rounds, then the pass's own rounds as its chunks
//!     move on (attention grows with the position). A chunk's cost there
//!     steps where kernels change (on the H100, Llama-1B's shape beside six
//!     streams: 16 rows +0.3 ms, 24 rows +0.59, 32 rows +0.62), which a
//!     steering that scales the last chunk by its cost overshot and
//!     undershot by turns;
//!   * elsewhere (the CPU) each chunk's rows add about that fraction: the
//!     most rows whose round the cost model predicts within the share of
//!     the plain round it predicts beside them, once it has seen a few
//!     chunks; before that, steered by the last chunk's measured cost. A
//!     fixed cost of sharing a round at all is paid by any chunk, so it is
//!     told apart (the model's term for it; while steering, from the pass's
//!     first chunk and its last) and not counted against the share:
//!     counted, it held every chunk to one row and an 1800-token prompt to
//!     1800 rounds.
//!
//! Only where the cut sizes are free (see `Capabilities`: a chunk-invariant
//! backend, or one whose results depend on the batch anyway) does the
//! pacer choose; otherwise the pass keeps its own cuts.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::backend::{replayed_size_up, replayed_sizes, StreamId};

/// Rows of a pass's first chunk under `prefill_share`, before any cost is
/// known: small, since in a shared forward each row adds its full cost to
/// the others' round (the steering grows it by half at most per chunk).
const FIRST_STEP_ROWS: usize = 1;

/// Under `prefill_share` on a backend that replays no chunk sizes, a plain
/// round every this many shared ones: the plain round's time grows with the
/// decoding streams' contexts.
const REMEASURE_EVERY: usize = 8;

/// Rounds with a chunk the cost model needs before a target trusts it;
/// until then chunks probe, doubling while rounds stay within the target.
const TRUSTED_AFTER: usize = 6;

/// The same for a share on a backend that replays no chunk sizes, whose
/// chunks are steered until then: its rounds are noisy against what a
/// chunk adds (on two cores a row ~0.75 ms beside a 10 ms round that
/// varies by one or two), and a model of six such rounds ran 4- and
/// 7-row chunks where two were due.
const SHARE_TRUSTED_AFTER: usize = 12;

/// `budget` kept to the chunk sizes a backend replays ([`replayed_size`](crate::replayed_size)
/// up to `replayed`; see `Capabilities::replayed_chunk_rows`) where the
/// chunk shares its round with decode rows: the largest size within the
/// budget and the `left` rows before the pass's next cut, so its last
/// chunks too (a remainder of 37 rows runs as 32, 4 and 1), unless the
/// backend pads a chunk to the next size (`pads`), which takes the `left`
/// rows at once where that size is within the budget. A larger budget
/// is held to `replayed`: a chunk run afresh cost more than its rows (on
/// the H200, 11–23 ms for 48–322 rows beside six decoding streams, against
/// ~3 ms for a replayed 64).
pub(super) fn to_replayed(budget: Budget, left: usize, decoding: bool, replayed: usize, pads: bool) -> Budget {
    match budget {
        Budget::Chunk(Some(rows)) if decoding && replayed > 0 => match rows.min(left).min(replayed) {
            0 => budget,
            _ if pads && replayed_size_up(left) <= rows.min(replayed) => Budget::Chunk(Some(left)),
            r => Budget::Chunk(replayed_sizes(r).next()),
        },
        b => b,
    }
}

/// The next replayed size past `rows`.
fn size_up(rows: usize) -> usize {
    replayed_size_up(rows + 1)
}

/// How many prompt rows the next round may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Budget {
    /// A chunk of at most this many rows (`None`: the pass's own cuts).
    Chunk(Option<usize>),
    /// No chunk: the next round runs the decode rows alone, to measure them.
    Measure,
    /// No chunk: the next round runs the decode rows alone and names the
    /// chunk for the round after, which a backend that launches rounds
    /// ahead starts with it (`Capabilities::launches_ahead`).
    Name,
}

/// What a round holds, as the cost model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Shape {
    /// Decode token rows (drafts included).
    pub decode_rows: usize,
    /// The decoding streams' context tokens, summed.
    pub decode_ctx: usize,
    /// The chunk's rows and the position it starts at.
    pub chunk_rows: usize,
    pub chunk_start: usize,
}

/// A round timed before the lane ran (a replaying backend's warm-up): what
/// it held and how long the backend call took. The pacer's cost model
/// starts from these, so the first arrival's chunks are sized by what the
/// device costs instead of probing up from a few rows (on the H200 the
/// probe took ~20 rounds of an 1800-token prompt's ~30).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoundCost {
    pub decode_rows: usize,
    /// The decoding streams' context tokens, summed.
    pub decode_ctx: usize,
    pub chunk_rows: usize,
    pub chunk_start: usize,
    pub secs: f64,
}

/// What one round ran, as the pacer is told it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Ran {
    pub shape: Shape,
    /// The prompt chunk's stream, if the round carried one.
    pub chunk: Option<StreamId>,
    /// The backend call's wall time.
    pub secs: f64,
    /// The loop's own time around it (planning, sampling, emitting) since
    /// the last round: part of every decoding stream's gap.
    pub overhead: f64,
}

/// Features of a round: the fixed cost, decode rows, decoding context (in
/// thousands of tokens), prompt rows, prompt rows times their mean
/// position (in thousands), and whether it carries a chunk at all.
const FEATURES: usize = 6;

fn features(s: &Shape) -> [f64; FEATURES] {
    let r = s.chunk_rows as f64;
    [1.0, s.decode_rows as f64, s.decode_ctx as f64 / 1e3, r, r * (s.chunk_start as f64 + r / 2.0) / 1e3, (s.chunk_rows > 0) as u8 as f64]
}

/// A round's seconds as a linear function of its [`features`] with
/// non-negative coefficients (every part of a round costs time, so a fit
/// that noise would tilt cannot promise a free row), fitted as least
/// squares over the rounds seen, recent ones weighing most (the device's
/// speed drifts with clocks and load). Refitted when next asked, not per
/// round: under a share no prediction is asked for between passes, and a
/// refit on every plain round took 13% of the lane thread.
#[derive(Clone, Debug)]
pub(super) struct CostModel {
    /// The weighted normal equations: Σ w·x·xᵀ and Σ w·x·secs.
    gram: [[f64; FEATURES]; FEATURES],
    rhs: [f64; FEATURES],
    /// The last fit, and whether rounds came in since.
    theta: Cell<[f64; FEATURES]>,
    stale: Cell<bool>,
    /// Rounds with a chunk taken in.
    pub chunk_rounds: usize,
    pub rounds: usize,
    /// The largest chunk seen: a prediction far past what was seen is a
    /// guess, so a budget grows to at most half again as much.
    pub max_seen: usize,
}

/// Forgetting factors: a round's weight halves after ~70 later rounds
/// with a chunk, or ~700 plain ones. Plain rounds forget slowly: an
/// arrival may come after thousands of them, and what chunks cost (the
/// warm-up's timed rounds, the last arrival's) must still be known then.
const FORGET: f64 = 0.99;
const FORGET_PLAIN: f64 = 0.999;

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            gram: [[0.0; FEATURES]; FEATURES],
            rhs: [0.0; FEATURES],
            theta: Cell::new([0.0; FEATURES]),
            stale: Cell::new(false),
            chunk_rounds: 0,
            rounds: 0,
            max_seen: 0,
        }
    }
}

impl CostModel {
    /// Take in one round that took `secs`.
    pub fn observe(&mut self, s: &Shape, secs: f64) {
        let x = features(s);
        let forget = if s.chunk_rows > 0 { FORGET } else { FORGET_PLAIN };
        for (i, row) in self.gram.iter_mut().enumerate() {
            for (j, g) in row.iter_mut().enumerate() {
                *g = forget * *g + x[i] * x[j];
            }
            self.rhs[i] = forget * self.rhs[i] + x[i] * secs;
        }
        self.rounds += 1;
        if s.chunk_rows > 0 {
            self.chunk_rounds += 1;
            self.max_seen = self.max_seen.max(s.chunk_rows);
        }
        self.stale.set(true);
    }

    /// Non-negative least squares by coordinate descent on the normal
    /// equations, from the last fit, until a sweep moves no coefficient by
    /// more than a billionth of the largest (six unknowns: usually a few
    /// dozen sweeps).
    fn fit(&self) -> [f64; FEATURES] {
        let mut theta = self.theta.get();
        if self.stale.replace(false) {
            for _ in 0..4096 {
                let mut moved = 0f64;
                for j in 0..FEATURES {
                    // A touch of ridge keeps a feature never seen at zero.
                    let d = self.gram[j][j] + 1e-12;
                    let r: f64 = self.rhs[j] - (0..FEATURES).map(|k| self.gram[j][k] * theta[k]).sum::<f64>();
                    let t = (theta[j] + r / d).max(0.0);
                    moved = moved.max((t - theta[j]).abs());
                    theta[j] = t;
                }
                if moved <= 1e-9 * theta.iter().fold(0f64, |m, &t| m.max(t)) {
                    break;
                }
            }
            self.theta.set(theta);
        }
        theta
    }

    /// The predicted seconds of a round of shape `s`.
    pub fn predict(&self, s: &Shape) -> f64 {
        features(s).iter().zip(&self.fit()).map(|(x, t)| x * t).sum()
    }

    /// What carrying a chunk at all adds to a round, whatever its rows.
    pub fn chunk_fixed(&self) -> f64 {
        self.fit()[FEATURES - 1]
    }
}

#[derive(Clone, Debug)]
pub(super) struct Pacer {
    /// The target inter-token gap in seconds, if one is set.
    target: Option<f64>,
    /// The fraction of a plain round a chunk may add (`None`: no pacing).
    share: Option<f64>,
    /// The configured per-chunk cap, which every budget honours.
    max_rows: Option<usize>,
    model: CostModel,
    /// Moving average of a plain round's seconds (0: none measured yet).
    plain_secs: f64,
    /// The same by the round's decode rows: what a size adds is read
    /// against a plain round of as many rows (streams come and go).
    plain_by_rows: HashMap<usize, f64>,
    /// Moving average of the loop's own time per round.
    overhead: f64,
    /// Moving average of how far rounds with a chunk ran past the model's
    /// prediction (0 when they ran short): set aside as well, so a noisy
    /// device or a fit still settling errs on the short side.
    under: f64,
    /// The last chunk: its stream, rows, the seconds it added, and its whole round's.
    last: Option<(StreamId, usize, f64, f64)>,
    /// The pass's first chunk: its stream, rows and the seconds it added.
    first: Option<(StreamId, usize, f64)>,
    /// Rounds shared with a chunk since the last plain one.
    shared_since_plain: usize,
    /// The backend's largest replayed chunk (0: it replays none), which a
    /// share reads as sizes to choose from ([`Pacer::sized`]).
    replayed: usize,
    /// The backend pads a chunk to the next replayed size
    /// (`Capabilities::pads_chunks`): a pass's last rows, however many,
    /// are one size.
    pads: bool,
    /// The least a chunk of each size has added beside each count of
    /// decode rows, in seconds (the warm-up's rounds and those run), keyed
    /// (decode rows, chunk rows). Read as a fraction of the plain round
    /// at the time: the warm-up times short contexts, whose plain rounds
    /// are shorter than an arrival's (kept as fractions, its figures read
    /// SmolLM2's sizes 1.3-2x dear on the H200).
    added: Added,
    /// What the current pass's chunks have shown (see [`PassCosts`]).
    pass: Option<PassCosts>,
    /// The chunk of the round about to run, its stream and rows, until
    /// that round's cost comes (see [`Pacer::starting`]).
    in_flight: Option<(StreamId, usize)>,
    /// Rounds whose decode rows alone the model predicted past the target.
    target_misses: Cell<u64>,
    /// Image-encoding steps beside decoding streams, by kind: the last
    /// two of different work, each its work and seconds (the last first).
    encoded: HashMap<u32, [Option<(u64, f64)>; 2]>,
    /// The kind of the next image-encoding step (see `Encoded::next`).
    next_kind: u32,
    /// `target` and `share` for image-encoding steps, which are paced
    /// whatever the backend's cuts (their rows never depend on the steps).
    encode_pacing: (Option<f64>, Option<f64>),
}

/// A shared round whose chunk added more than `.0` times what its size was
/// expected to, and more than `.1` of a plain round over it, is set aside
/// once: a round not replayed, or the machine's hiccup (on the H100 one
/// 24-row round of SmolLM2's shape took 3.9 ms against 1.4; read as the
/// size's cost, it held the rest of the pass to one-row chunks).
const SPIKE: (f64, f64) = (2.0, 0.25);

/// How much dearer than before the pass a pass's chunk shows its sizes to
/// run is read as (added + this) / (before + this), in plain rounds: a
/// one-row chunk's share is small and noisy, and its ratio alone (0.2
/// against 0.05) scaled every size by four. (Cheaper is read as it is:
/// sizes are then expected cheaper only up to one past those run.)
const GROWTH_FLOOR: f64 = 0.1;

/// How much dearer than a larger size the warm-up may read a size and
/// still be taken to cost no more than it ([`PassCosts::expected`]): it
/// times each size once. A kernel change between sizes reads more (on the
/// H100 SmolLM2's 32 rows against its 48 and 64: 1.15-1.9x).
const ALIKE: f64 = 0.1;

/// What a pass's shared chunks have added, kept from its first to its last.
#[derive(Clone, Debug)]
struct PassCosts {
    stream: StreamId,
    /// What each size added in its last round of this pass (a pass's first
    /// chunk aside: it can be dearer once).
    seen: HashMap<usize, f64>,
    /// What each size had added at the pass's start (`Pacer::added` then),
    /// and how much dearer or cheaper the pass's last chunk was than that
    /// (`growth`) and each size's last (`grown`): a size not run in this
    /// pass is expected to differ as the last chunk or the nearest size
    /// below it did, whichever grew more. The warm-up times each size once,
    /// at short contexts: on the H100 its figures for SmolLM2's shape read
    /// twice what a pass's 16-row chunks cost, and held every chunk to 16
    /// rows while 24 would have done. They are not off alike for every size
    /// either (in a SmolLM2 pass 48 rows cost 0.56 of the warm-up's figure,
    /// 112 rows 0.91): read as a 48-row chunk a cut left had grown, 112 rows
    /// were expected at 0.38 of a plain round and added 0.62.
    base: Added,
    growth: f64,
    grown: BTreeMap<usize, f64>,
    /// The last shared round was set aside as a spike (see [`SPIKE`]); a
    /// second in a row is believed.
    spiked: bool,
}

impl PassCosts {
    /// What a chunk of `rows` beside `decode` decode rows is expected to
    /// add, as a fraction of a plain round of `plain` seconds: its last
    /// round in this pass, else its figure before the pass times `scale`.
    /// A size not run in the pass costs no more than a larger one did in
    /// it where the warm-up read the two alike ([`ALIKE`]): on the H100 a
    /// pass's 63-row remainder after 80-row chunks within the share, read
    /// as the warm-up's 64 rows (4% dearer than its 80) grown as 8-row
    /// chunks had, ran as eight rounds of 8 rows.
    fn expected(&self, decode: usize, rows: usize, scale: f64, plain: f64) -> Option<f64> {
        if let Some(&f) = self.seen.get(&rows) {
            return Some(f);
        }
        let base = self.base.least(decode, rows)?;
        let alike = |m: usize| self.base.least(decode, m).is_some_and(|b| base <= b * (1.0 + ALIKE));
        let bound = self.seen.iter().filter(|&(&m, _)| m > rows && alike(m)).map(|(_, &f)| f).fold(f64::INFINITY, f64::min);
        Some((base / plain * scale).min(bound))
    }

    /// How much dearer than before the pass a size not run in it is
    /// expected: as the last chunk, or as the largest size below it that
    /// ran, whichever grew more (a 32-row remainder after 80-row chunks,
    /// read as 16 rows had grown, came out within the share and was not).
    fn growth_for(&self, rows: usize) -> f64 {
        self.grown.range(..rows).next_back().map_or(self.growth, |(_, &g)| g.max(self.growth))
    }
}

/// The least a chunk of each size has added beside each count of decode
/// rows: by size, then decode rows, so the nearest count is a range lookup.
/// (A scan of every entry per lookup, with the ~400 a 32-stream warm-up
/// times, made the pacer's sizing ~60 µs, which the lane spent between
/// the rounds of every pass.)
#[derive(Clone, Debug, Default)]
struct Added(HashMap<usize, BTreeMap<usize, f64>>);

impl Added {
    fn saw(&mut self, decode: usize, rows: usize, secs: f64) {
        self.0.entry(rows).or_default().entry(decode).and_modify(|a| *a = a.min(secs)).or_insert(secs);
    }

    /// What a chunk of `rows` added beside `decode` decode rows, or beside
    /// the nearest count seen with it (the warm-up times a few); ties to
    /// the fewer rows.
    fn least(&self, decode: usize, rows: usize) -> Option<f64> {
        let by = self.0.get(&rows)?;
        match (by.range(..=decode).next_back(), by.range(decode + 1..).next()) {
            (Some((&d0, &a0)), Some((&d1, &a1))) => Some(if decode - d0 <= d1 - decode { a0 } else { a1 }),
            (Some((_, &a)), None) | (None, Some((_, &a))) => Some(a),
            (None, None) => None,
        }
    }

    /// ((decode rows, chunk rows), seconds added), in no order.
    fn iter(&self) -> impl Iterator<Item = ((usize, usize), f64)> + '_ {
        self.0.iter().flat_map(|(&n, by)| by.iter().map(move |(&d, &a)| ((d, n), a)))
    }
}

/// Moving average that follows changes within a few samples.
fn ema(old: f64, new: f64) -> f64 {
    if old == 0.0 {
        new
    } else {
        0.7 * old + 0.3 * new
    }
}

impl Pacer {
    /// `target`: `LaneConfig::itl_target`; `share`: `LaneConfig::prefill_share`
    /// (a target, when set, takes its place); both honoured only when
    /// `free_cuts`. `max_rows`: `LaneConfig::max_rows`.
    pub fn new(target: Option<Duration>, share: Option<f32>, max_rows: Option<usize>, free_cuts: bool) -> Pacer {
        let target = target.map(|d| d.as_secs_f64());
        let share = share.filter(|_| target.is_none()).map(f64::from);
        let encode_pacing = (target, share);
        let (target, share) = (target.filter(|_| free_cuts), share.filter(|_| free_cuts));
        Pacer {
            target,
            share,
            max_rows,
            model: CostModel::default(),
            plain_secs: 0.0,
            plain_by_rows: HashMap::new(),
            overhead: 0.0,
            under: 0.0,
            last: None,
            first: None,
            shared_since_plain: 0,
            replayed: 0,
            pads: false,
            added: Added::default(),
            pass: None,
            in_flight: None,
            target_misses: Cell::new(0),
            encoded: HashMap::new(),
            next_kind: 0,
            encode_pacing,
        }
    }

    /// Start the cost model, and what each chunk size adds, from rounds
    /// timed before serving.
    /// A chunk's round is read against the last plain round of as many
    /// decode rows before it (the warm-up times a plain round, then the
    /// chunks beside it, once or more).
    pub fn learn(&mut self, rounds: &[RoundCost]) {
        let mut plain: HashMap<usize, f64> = HashMap::new();
        for r in rounds {
            let shape = Shape { decode_rows: r.decode_rows, decode_ctx: r.decode_ctx, chunk_rows: r.chunk_rows, chunk_start: r.chunk_start };
            self.model.observe(&shape, r.secs);
            if r.chunk_rows == 0 {
                plain.insert(r.decode_rows, r.secs);
                continue;
            }
            if let Some(&p) = plain.get(&r.decode_rows).filter(|_| r.decode_rows > 0) {
                self.saw_added(r.decode_rows, r.chunk_rows, r.secs - p);
            }
        }
        // What a pass's first sizes start from: read against what its
        // chunks then add (the "round with a prompt chunk" lines).
        let mut added: Vec<_> = self.added.iter().filter_map(|((d, n), a)| plain.get(&d).map(|&p| (d, n, (a / p.max(1e-9) * 1e3).round() / 1e3))).collect();
        added.sort_unstable_by_key(|a| (a.0, a.1));
        tracing::debug!(?added, "what each chunk size added to a plain round in the warm-up (decode rows, chunk rows, fraction)");
        // The plain rounds those fractions are of (the warm-up's contexts
        // are short; an arrival's plain rounds run at longer ones).
        let mut plain: Vec<_> = plain.into_iter().map(|(d, s)| (d, (s * 1e6).round() / 1e3)).collect();
        plain.sort_unstable_by_key(|p| p.0);
        tracing::debug!(?plain, "the warm-up's plain rounds (decode rows, ms)");
    }

    /// A chunk of `rows` beside `decode` decode rows added `secs` to its
    /// round: the least seen counts (a step shows in every round, a spike
    /// in one, and must not bar a size for good).
    fn saw_added(&mut self, decode: usize, rows: usize, secs: f64) {
        self.added.saw(decode, rows, secs);
    }

    /// The plain round a chunk beside `decode` decode rows is read against:
    /// the last of as many rows, else the last of any (none yet: 0).
    fn plain_of(&self, decode: usize) -> f64 {
        self.plain_by_rows.get(&decode).copied().filter(|&p| p > 0.0).unwrap_or(self.plain_secs)
    }

    /// The backend replays chunks of up to `rows` rows
    /// (`Capabilities::replayed_chunk_rows`; 0: none), and pads others to
    /// the next replayed size or not (`Capabilities::pads_chunks`).
    pub fn replaying(mut self, rows: usize, pads: bool) -> Pacer {
        self.replayed = rows;
        self.pads = pads;
        self
    }

    /// Whether a share picks among replayed sizes ([`Pacer::sized`]).
    fn picks_sizes(&self) -> bool {
        self.share.is_some() && self.replayed > 0
    }

    /// Under a share on a replaying backend: the largest replayed size
    /// expected to add at most the share to a plain round.
    ///
    /// A size's expectation is what it added in its last round of
    /// `stream`'s pass; not run in this pass, its least seen before the pass,
    /// scaled as the last chunk or the nearest size below it run in the pass
    /// was, whichever grew more (see [`PassCosts::base`]), but scaled down
    /// (cheaper than seen) only up to one size past the largest the pass has
    /// run: the warm-up's figures are not off alike for every size (on the H100 they
    /// read SmolLM2's 16-row chunks at twice their cost, and scaled down by
    /// that, sizes up to 256 rows were tried one after another, each past
    /// the share). So a pass climbs a size at a time where the warm-up read
    /// dear, and past one size that ran over the share (on the H100
    /// SmolLM2's 32 rows cost more than its 48: counted from the largest
    /// size within, a pass tried 32 once and stayed at 24, 77 rounds for
    /// 1800 rows), but not past two (where sizes grow dearer as they
    /// should, the second over-share round is the last). The lane sizes a
    /// chunk a round ahead, while the one before it runs: that one counts
    /// as run within the share if it was expected to, until a size runs
    /// over (else each size ran twice on the way up).
    ///
    /// A pass's first chunk keeps to half the share: nothing of the pass is
    /// known yet (the warm-up timed short contexts), and its round was not
    /// started ahead. Past the largest size within, the next one up when
    /// nothing is known of it (a backend not timed before serving probes up
    /// from one row); none within, one row. Sizes past `left` (the rows
    /// before the pass's next cut) are not asked for: a pass's last rows run
    /// as the sizes within (on the H100 a 32-row remainder of an arrival,
    /// which SmolLM2's shape runs in the decode attention, cost more than 64
    /// rows did).
    pub fn sized(&self, stream: StreamId, share: f64, decode: usize, left: usize) -> usize {
        let this_pass = self.pass.as_ref().filter(|p| p.stream == stream);
        let share = if this_pass.is_some() { share } else { share / 2.0 };
        let most = self.replayed.min(if self.pads { replayed_size_up(left) } else { left });
        // A size that has added more than a larger one (SmolLM2's 32 rows
        // against its 48 on the H100: past 32 rows in all the products
        // take another kernel) is passed over: the larger serves better,
        // and a climb through it ran one round past the share each pass.
        // Not for a larger size this pass ran over the share: it serves
        // no better (sixteen SmolLM2 streams on the H100: 64 rows, read
        // cheaper than 16-48 before the pass, ran over in it, and the pass
        // ran 8-row chunks for 200 rounds).
        let over_in_pass = |m: usize| this_pass.is_some_and(|p| p.seen.get(&m).is_some_and(|&f| f > share));
        let dominated = |n: usize| {
            self.added
                .least(decode, n)
                .is_some_and(|a| replayed_sizes(most).any(|m| m > n && !over_in_pass(m) && self.added.least(decode, m).is_some_and(|b| b <= a)))
        };
        let up = |n: usize| {
            let mut m = size_up(n);
            while m < most && dominated(m) {
                m = size_up(m);
            }
            m
        };
        // What sizes added before, read against the plain round now.
        let plain = self.plain_of(decode).max(1e-9);
        // Climbed from the largest size run within the share, or past one
        // that ran over it while no second size above that has.
        let next_up = this_pass.map_or(up(0), |p| {
            let within = p.seen.iter().filter(|(_, &f)| f <= share).map(|(&n, _)| n).max().unwrap_or(0);
            let over: Vec<usize> = p.seen.iter().filter(|(&n, &f)| f > share && n > within).map(|(&n, _)| n).collect();
            // The size running now, new to the pass and expected within
            // the share, counts as within while no size above those has
            // run over it: a chunk is sized a round ahead, before the one
            // running has shown its cost, so without it each size ran
            // twice before the next was tried.
            let running = self
                .in_flight
                .filter(|&(s, n)| s == stream && n > within && over.is_empty() && !p.seen.contains_key(&n))
                .map(|(_, n)| n)
                .filter(|&n| p.expected(decode, n, p.growth_for(n), plain).is_some_and(|f| f <= share));
            up(match (over.len(), running) {
                (1, _) => over[0],
                (_, Some(n)) => n,
                _ => within,
            })
        });
        let expected = |n: usize| match this_pass {
            Some(p) => p.expected(decode, n, if n <= next_up { p.growth_for(n) } else { p.growth_for(n).max(1.0) }, plain),
            None => self.added.least(decode, n).map(|a| a / plain),
        };
        let within = replayed_sizes(most).find(|&n| !dominated(n) && expected(n).is_some_and(|f| f <= share));
        let probe = up(within.unwrap_or(0));
        if probe <= most && expected(probe).is_none() {
            probe
        } else {
            within.unwrap_or(1)
        }
    }

    /// Rounds whose decode rows alone the model predicted past the target
    /// (the newcomer then took one row).
    pub fn target_misses(&self) -> u64 {
        self.target_misses.get()
    }

    /// The budget for the next chunk of `stream`'s pass, which would start
    /// at `start` beside the decode rows of `next` (none: it runs alone).
    /// `timed`: a round of the decode rows alone runs before it (it times
    /// them, so no [`Budget::Measure`] is asked for again). `left`: the
    /// rows before the pass's next cut.
    pub fn budget(&self, stream: StreamId, start: usize, next: Shape, timed: bool, left: usize) -> Budget {
        let decoding = next.decode_rows > 0;
        if let (Some(target), true) = (self.target, decoding) {
            return Budget::Chunk(Some(self.cap(self.target_rows(stream, start, next, target))));
        }
        let Some(share) = self.share.filter(|_| decoding) else { return Budget::Chunk(self.max_rows) };
        if self.picks_sizes() {
            // A plain round of as many decode rows timed before serves the
            // pass whole: its rounds grow with the streams' contexts, so it
            // errs short.
            if !timed && !self.plain_by_rows.contains_key(&next.decode_rows) {
                return Budget::Measure;
            }
            return Budget::Chunk(Some(self.cap(self.sized(stream, share, next.decode_rows, left))));
        }
        // Timed in the round before, the plain round's time is the last
        // one known until then (none yet: the steering's least).
        if !timed && (self.plain_secs == 0.0 || self.shared_since_plain >= REMEASURE_EVERY) {
            return Budget::Measure;
        }
        // Once the cost model has seen a few chunks it sizes them: the most
        // rows whose round it predicts within the share of the plain round
        // it predicts beside them, its fixed cost of carrying a chunk at
        // all set aside (see the module doc). Steered by the last chunk
        // alone, a size followed the noise of single rounds: on two cores,
        // where a row adds ~0.75 ms to a 10 ms round and rounds vary by a
        // millisecond or two, a 0.15 share ran chunks of 1-9 rows and
        // rounds of up to 1.8 plain ones.
        if self.model.chunk_rounds >= SHARE_TRUSTED_AFTER {
            let plain = self.model.predict(&Shape { chunk_rows: 0, ..next });
            let room = plain * (1.0 + share) + self.model.chunk_fixed();
            let mut rows = self.rows_within(start, next, room);
            if let Some((_, last, ..)) = self.last.filter(|l| l.0 == stream && rows > l.1) {
                // A row past the last size a round: while chunks keep one
                // size the model cannot split its fixed cost from the rows',
                // and where it read most as fixed every size above looked
                // nearly free (a pass ran 3-8 rows where 2 were due). A
                // size one up that runs over shows the split.
                rows = rows.min(last + 1);
            }
            return Budget::Chunk(Some(self.cap(rows)));
        }
        // Before that, a chunk costs a fixed part plus a part per row, both
        // unknown and changing with the position, so the size is steered by
        // the last chunk: scaled by budget / time taken.
        let rows = match self.last {
            Some((id, rows, secs, _)) if id == stream => {
                let scaled = self.scaled(id, rows, secs, share);
                // Grow by half at most: one overshoot is one long gap.
                let next = scaled.clamp(1, rows + rows / 2 + 1);
                // The same size as the first chunk again would tell the
                // fixed part no better: one row more does.
                match self.first {
                    Some((id, first_rows, _)) if id == stream && first_rows == rows && next == rows => rows + 1,
                    _ => next,
                }
            }
            // A new pass starts from what the last one was steered to: half
            // of it, and no more than its last chunk (costs depend on the
            // position). Probing from one row each time cost an 1800-token
            // prompt on the H200 ~8 rounds before its chunks reached 64 rows.
            Some((id, rows, secs, _)) => (self.scaled(id, rows, secs, share) / 2).clamp(FIRST_STEP_ROWS, rows.max(FIRST_STEP_ROWS)),
            None => FIRST_STEP_ROWS,
        };
        Budget::Chunk(Some(self.cap(rows)))
    }

    /// The rows whose added cost would be `share` of a plain round, from a
    /// chunk of `rows` rows of `stream` that added `secs` (less the fixed
    /// part of sharing a round).
    fn scaled(&self, stream: StreamId, rows: usize, secs: f64, share: f64) -> usize {
        let fixed = self.fixed_cost(stream, rows, secs);
        (rows as f64 * share * self.plain_secs / (secs - fixed).max(1e-6)) as usize
    }

    /// The part of the last chunk's `secs` (of `rows` rows) that any chunk
    /// adds, from the line through the pass's first chunk and it: 0 while
    /// they are the same size, or where the smaller cost clearly more
    /// (the position's cost grew: no fixed part to tell); all of it where
    /// they cost about the same (rows too cheap to see yet).
    fn fixed_cost(&self, stream: StreamId, rows: usize, secs: f64) -> f64 {
        let Some((_, first_rows, first_secs)) = self.first.filter(|f| f.0 == stream && f.1 != rows) else { return 0.0 };
        let per_row = (secs - first_secs) / (rows as f64 - first_rows as f64);
        if per_row > 0.0 {
            (secs - per_row * rows as f64).clamp(0.0, secs)
        } else if (secs - first_secs).abs() <= 0.25 * secs.max(first_secs) {
            secs
        } else {
            0.0
        }
    }

    fn cap(&self, rows: usize) -> usize {
        self.max_rows.map_or(rows, |m| m.min(rows)).max(1)
    }

    /// Under a target: the most prompt rows whose round the model holds
    /// within it (the loop's own time and its recent underestimates set
    /// aside), at least one, at most twice the largest chunk it has seen;
    /// while the model is young, a probe that doubles while rounds stay
    /// within it.
    fn target_rows(&self, stream: StreamId, start: usize, next: Shape, target: f64) -> usize {
        let room = target - self.overhead - self.under;
        let with = |rows: usize| Shape { chunk_rows: rows, chunk_start: start, ..next };
        if self.model.chunk_rounds < TRUSTED_AFTER {
            return match self.last {
                Some((id, rows, _, secs)) if id == stream && secs + self.overhead <= target => rows * 2,
                Some((id, rows, _, _)) if id == stream => (rows / 2).max(1),
                _ => FIRST_STEP_ROWS,
            };
        }
        if self.model.predict(&with(1)) > room {
            self.target_misses.set(self.target_misses.get() + 1);
            if self.target_misses.get() == 1 {
                // Say which part does not fit: on a CPU the decode rows
                // alone may fit while sharing a round with even one prompt
                // row does not.
                tracing::warn!(
                    target_ms = target * 1e3,
                    decode_alone_ms = self.model.predict(&with(0)) * 1e3,
                    with_one_prompt_row_ms = self.model.predict(&with(1)) * 1e3,
                    set_aside_ms = (self.overhead + self.under) * 1e3,
                    "the inter-token-latency target cannot be held: a round of the decode rows and one prompt row is predicted past it \
                     (with the loop's own time and recent underestimates set aside); prompts advance one row a round"
                );
            }
            return 1;
        }
        self.rows_within(start, next, room)
    }

    /// The most prompt rows (at least one) whose round beside `next`,
    /// from position `start`, the model predicts within `room` seconds:
    /// the prediction grows with rows. No more than twice what the model
    /// has seen (half again, rounded down to a replayed size, could stay
    /// where it is).
    fn rows_within(&self, start: usize, next: Shape, room: f64) -> usize {
        let with = |rows: usize| Shape { chunk_rows: rows, chunk_start: start, ..next };
        let seen = self.model.max_seen.max(1);
        let (mut lo, mut hi) = (1usize, self.max_rows.unwrap_or(usize::MAX).min(2 * seen + 1));
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.model.predict(&with(mid)) <= room {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// The work an image-encoding step may do between rounds whose decode
    /// rows have shape `next` (none: `None`, a step of the backend's
    /// choosing). The step adds its time to every decoding stream's gap, so
    /// it gets what a chunk would: the room under the target, or the share
    /// of a plain round; its work's time is told from the last steps of its
    /// kind (a kind not seen yet starts from one unit: the least the
    /// backend does), and grows to at most twice the last step's work.
    /// Without pacing, `None`.
    pub fn encode_budget(&self, next: Shape) -> Option<u64> {
        if next.decode_rows == 0 {
            return None;
        }
        let room = match self.encode_pacing {
            (Some(t), _) => t - self.overhead - self.under - self.model.predict(&next),
            (None, Some(share)) if self.plain_secs > 0.0 => share * self.plain_secs,
            (None, Some(_)) => return Some(1),
            (None, None) => return None,
        };
        let Some([Some((work, secs)), before]) = self.encoded.get(&self.next_kind).copied() else { return Some(1) };
        let room = room.max(0.0);
        // A step's time is a fixed part (on a CPU, streaming its weights
        // once) and a part per unit: the line through the last two of its
        // kind, where it rises; otherwise in proportion to the last.
        let line = before.map(|(w0, s0)| ((secs - s0) / (work as f64 - w0 as f64), (w0, s0))).filter(|(per, _)| *per > 0.0);
        let fits = match line {
            Some((per, (w0, s0))) => ((room - (s0 - per * w0 as f64)).max(0.0) / per) as u64,
            None => (room * work as f64 / secs.max(1e-9)) as u64,
        };
        Some(fits.clamp(1, work.saturating_mul(2).max(1)))
    }

    /// Take in an image-encoding step that did `work` in `secs` (`paced`:
    /// beside decoding streams, as budgeted) and said the kind of the next.
    pub fn encoded(&mut self, work: u64, secs: f64, next: u32, paced: bool) {
        let kind = std::mem::replace(&mut self.next_kind, next);
        if !paced || work == 0 {
            return;
        }
        let seen = self.encoded.entry(kind).or_insert([None, None]);
        match seen[0] {
            Some((w, _)) if w == work => seen[0] = Some((work, secs)),
            last => *seen = [Some((work, secs)), last],
        }
    }

    /// The round about to run carries this chunk (stream, rows), or none:
    /// [`Pacer::sized`] climbs past it before its cost comes.
    pub fn starting(&mut self, chunk: Option<(StreamId, usize)>) {
        self.in_flight = chunk;
    }

    /// Take in what a round ran.
    pub fn ran(&mut self, r: Ran) {
        self.in_flight = None;
        if r.shape.chunk_rows > 0 {
            tracing::debug!(
                decode_rows = r.shape.decode_rows,
                chunk_rows = r.shape.chunk_rows,
                chunk_start = r.shape.chunk_start,
                predicted_ms = self.model.predict(&r.shape) * 1e3,
                took_ms = r.secs * 1e3,
                overhead_ms = r.overhead * 1e3,
                "round with a prompt chunk"
            );
        }
        // A pass's first chunk beside decode rows can be dearer once (on
        // the H200 4.5 and 3 ms where 2 were due, when its round was not
        // started ahead: a backend that cannot start it so still pays it):
        // told to the model or the underestimate, it shrank the next
        // hundred chunks. Each underestimate counts at most a tenth
        // of the target.
        let first = r.shape.decode_rows > 0 && r.chunk.is_some_and(|id| self.last.is_none_or(|l| l.0 != id));
        if !first {
            if let (Some(target), true) = (self.target, r.shape.chunk_rows > 0 && self.model.chunk_rounds >= TRUSTED_AFTER) {
                self.under = ema(self.under, (r.secs - self.model.predict(&r.shape)).clamp(0.0, 0.1 * target));
            }
            self.model.observe(&r.shape, r.secs);
        }
        // After a stretch of the loop's own work well past its usual (a
        // prompt's admission), a round launched ahead has run through part
        // of it before its call: its time reads short (on the H100 0.86 ms
        // against 1.18, after 0.5 ms), and as the plain round it made the
        // pass's chunks read dear (sixteen streams: 92 rounds of 16 rows).
        let ran_ahead = self.overhead > 0.0 && r.overhead > (3.0 * self.overhead).max(self.overhead + 5e-5);
        self.overhead = ema(self.overhead, r.overhead);
        let (decode, rows) = (r.shape.decode_rows, r.shape.chunk_rows);
        match r.chunk {
            None if decode > 0 => {
                if !ran_ahead {
                    self.plain_secs = ema(self.plain_secs, r.secs);
                    let p = self.plain_by_rows.entry(decode).or_insert(0.0);
                    *p = ema(*p, r.secs);
                }
                self.shared_since_plain = 0;
            }
            None => {}
            // A chunk alone costs all of its round.
            Some(id) if decode == 0 => self.last = Some((id, rows, r.secs, r.secs)),
            // A shared chunk's own cost: the round less a plain one's.
            Some(id) => {
                let added = (r.secs - self.plain_secs).max(0.1 * r.secs);
                if self.last.is_none_or(|l| l.0 != id) {
                    self.first = Some((id, rows, added));
                }
                self.last = Some((id, rows, added, r.secs));
                self.shared_since_plain += 1;
                if self.pass.as_ref().is_none_or(|p| p.stream != id) {
                    self.pass =
                        Some(PassCosts { stream: id, seen: HashMap::new(), base: self.added.clone(), growth: 1.0, grown: BTreeMap::new(), spiked: false });
                }
                // Not a pass's first chunk: it can be dearer once.
                if self.plain_secs > 0.0 && !first {
                    // Against a plain round of as many rows, where one ran.
                    let (f, plain) = match self.plain_by_rows.get(&decode).filter(|_| self.picks_sizes()) {
                        Some(&p) => ((r.secs - p).max(0.1 * r.secs) / p, p),
                        None => (added / self.plain_secs, self.plain_secs),
                    };
                    let picks_sizes = self.picks_sizes();
                    let pass = self.pass.as_mut().expect("a pass was just opened");
                    let spike = pass.expected(decode, rows, pass.growth_for(rows), plain).is_some_and(|e| f > SPIKE.0 * e && f > e + SPIKE.1);
                    if picks_sizes && !pass.spiked && spike {
                        pass.spiked = true;
                        return;
                    }
                    pass.spiked = false;
                    if let Some(b) = pass.base.least(decode, rows).map(|a| a / plain) {
                        let ratio = if f > b { (f + GROWTH_FLOOR) / (b + GROWTH_FLOOR) } else { f / b.max(1e-6) };
                        pass.growth = ratio.clamp(0.25, 4.0);
                        pass.grown.insert(rows, pass.growth);
                    }
                    pass.seen.insert(rows, f);
                    self.saw_added(decode, rows, f * plain);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
