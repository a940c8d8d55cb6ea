//! Passes over one logits row, built for large vocabularies: its largest
//! value and index, its largest `n`, its weights at a temperature and the
//! walk to a drawn token, and its order by logit without a sort
//! ([`Ordered`], for a wide nucleus).

/// NaN logits (a broken model) are treated as impossible tokens rather than
/// poisoning comparisons.
pub(super) fn key(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// Index of the largest logit (the first one on ties); 0 for an empty or
/// all-NaN row.
pub fn argmax(logits: &[f32]) -> u32 {
    // Two passes the compiler vectorises (a largest value per lane, then
    // the first index holding the largest) instead of one compare-and-
    // branch chain: a 128k-token row in a fraction of the time, which a
    // GPU's guided rounds wait for on the host. NaN never compares larger.
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            if v > *m {
                *m = v;
            }
        }
    }
    let best = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    if best == f32::NEG_INFINITY {
        return 0;
    }
    logits.iter().position(|&v| v == best).unwrap_or(0) as u32
}

/// The `n` largest logits with their indices, largest first. Small `n` keeps
/// a short sorted list and scans once; large `n` partitions an index array
/// (`select_nth_unstable`) and sorts only the selected part.
pub fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    let desc = |a: &(u32, f32), b: &(u32, f32)| key(b.1).total_cmp(&key(a.1)).then(a.0.cmp(&b.0));
    if n <= 64 {
        let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
        for (i, &v) in logits.iter().enumerate() {
            let v = key(v);
            if best.len() == n && v <= best[n - 1].1 {
                continue;
            }
            let at = best.partition_point(|&(_, b)| b >= v);
            best.insert(at, (i as u32, v));
            best.truncate(n);
        }
        best
    } else {
        let mut all: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &v)| (i as u32, key(v))).collect();
        if n < all.len() {
            all.select_nth_unstable_by(n - 1, desc);
            all.truncate(n);
        }
        all.sort_unstable_by(desc);
        all
    }
}

/// `exp(x)` for `x <= 0` (NaN counts as -inf), to about 1e-6 relative
/// error near 0 and 1e-5 near -87: `2^n * 2^f` with `n` the nearest
/// integer and a degree-6 series for `2^f` on [-0.5, 0.5]. Branch-free so
/// that a pass over a 262k-row vocabulary vectorises; libm's `expf` is
/// several times slower there.
#[inline]
pub fn exp_nonpositive(x: f32) -> f32 {
    // Below -87 the result leaves f32's normal range: it is 0 (masked at
    // the end). Every step is a select or integer op, so loops vectorise.
    let keep = 0u32.wrapping_sub((x >= -87.0) as u32);
    let x = if x < -87.0 { -87.0 } else { x };
    let x = if x > 0.0 { 0.0 } else { x };
    let t = x * std::f32::consts::LOG2_E;
    // Round to nearest by adding 1.5 * 2^23: the integer lands in the low
    // mantissa bits (exact for |t| < 2^22).
    const MAGIC: f32 = 12_582_912.0;
    let big = t + MAGIC;
    let n = big - MAGIC;
    let ni = (big.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let f = (t - n) * std::f32::consts::LN_2;
    let p = 1.0 + f * (1.0 + f * (0.5 + f * (1.0 / 6.0 + f * (1.0 / 24.0 + f * (1.0 / 120.0 + f * (1.0 / 720.0))))));
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    f32::from_bits((p * scale).to_bits() & keep)
}

/// Largest value of a row (NaN ignored), in eight independent lanes so the
/// pass vectorises.
pub(super) fn row_max(logits: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 8];
    let chunks = logits.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            m[i] = if c[i] > m[i] { c[i] } else { m[i] };
        }
    }
    m.iter().chain(rest).fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

/// Block size of the two-level walk in [`walk`].
pub(super) const BLOCK: usize = 256;

/// Weights `exp((l - max) / T)` of a whole row into `w`, and the sum of
/// each block of [`BLOCK`] into `blocks`; returns the total. Each block is
/// summed in eight f32 lanes (32 terms each, exact enough), blocks in f64.
pub(super) fn row_weights(logits: &[f32], max: f32, inv_t: f32, w: &mut Vec<f32>, blocks: &mut Vec<f64>) -> f64 {
    w.clear();
    // NaN - max stays NaN, fails `x >= -87` and comes out 0: no `key` needed.
    w.extend(logits.iter().map(|&l| exp_nonpositive((l - max) * inv_t)));
    blocks.clear();
    blocks.extend(w.chunks(BLOCK).map(lane_sum));
    blocks.iter().sum()
}

/// The first index where the running sum of `w` passes `target`: whole
/// blocks are skipped by their sums, then one block is walked.
pub(super) fn walk(w: &[f32], blocks: &[f64], target: f64) -> usize {
    let mut cum = 0.0;
    for (b, &s) in blocks.iter().enumerate() {
        if cum + s > target {
            let base = b * BLOCK;
            let mut last = None;
            for (i, &x) in w[base..(base + BLOCK).min(w.len())].iter().enumerate() {
                if x > 0.0 {
                    cum += x as f64;
                    last = Some(base + i);
                    if cum > target {
                        return base + i;
                    }
                }
            }
            // Rounding between the block sum and the walk: the target is
            // at this block's end.
            if let Some(l) = last {
                return l;
            }
        }
        cum += s;
    }
    w.iter().rposition(|&x| x > 0.0).unwrap_or(0)
}

/// A row's tokens in the order a sort would give them (largest logit
/// first, the lower index first on ties, NaN as -inf) without sorting:
/// where in that order the running sum of their weights passes a mass is
/// found from sums by the key's bits, 11, 11 and then 10 of them, each a
/// pass over the row that adds only the tokens still in question.
pub(super) struct Ordered<'a> {
    row: &'a [f32],
    /// Each token's weight (0 for the impossible).
    w: &'a [f32],
    /// Each token's [`order`].
    places: Vec<u32>,
    /// The weights summed by the top 11 bits of their places.
    top: Vec<f64>,
}

/// A token's place in the order: `order(a) < order(b)` when `a`'s logit is
/// the larger (NaN as -inf); equal logits, equal places.
fn order(l: f32) -> u32 {
    let b = key(l).to_bits();
    if b & 0x8000_0000 != 0 {
        b
    } else {
        !b & 0x7fff_ffff
    }
}

impl<'a> Ordered<'a> {
    pub(super) fn new(row: &'a [f32], w: &'a [f32]) -> Ordered<'a> {
        // Four sums by bucket, a token to each in turn: a flat row's tokens
        // fall in a few buckets, and one running sum each waited on the add
        // before.
        let places: Vec<u32> = row.iter().map(|&l| order(l)).collect();
        let mut four = vec![0f64; 4 << 11];
        for (i, (&o, &x)) in places.iter().zip(w).enumerate() {
            four[(i & 3) << 11 | (o >> 21) as usize] += x as f64;
        }
        let top = (0..1 << 11).map(|b| (0..4).map(|k| four[k << 11 | b]).sum()).collect();
        Ordered { row, w, places, top }
    }

    /// The first token, in the order, at which the running sum of the
    /// weights reaches `goal` (passes it, if `strict`), and that sum;
    /// `None` where rounding leaves the whole row short of it.
    pub(super) fn crossing(&self, goal: f64, strict: bool) -> Option<(usize, f64)> {
        let passes = |s: f64| if strict { s > goal } else { s >= goal };
        // The first bucket whose mass takes the sum from `below` past the
        // goal, and the sum before it.
        let scan = |h: &[f64], below: f64| -> Option<(u32, f64)> {
            let mut cum = below;
            for (b, &m) in h.iter().enumerate() {
                if m > 0.0 && passes(cum + m) {
                    return Some((b as u32, cum));
                }
                cum += m;
            }
            None
        };
        let (mut prefix, mut below) = scan(&self.top, 0.0)?;
        // The tokens still in question (place, index, weight), in index order.
        let mut left: Vec<(u32, u32, f32)> =
            (self.places.iter().zip(self.w).enumerate()).filter_map(|(i, (&o, &x))| (x > 0.0 && o >> 21 == prefix).then_some((o, i as u32, x))).collect();
        for (shift, bits) in [(10u32, 11u32), (0, 10)] {
            let mut h = vec![0f64; 1 << bits];
            for &(o, _, x) in &left {
                h[((o >> shift) & ((1 << bits) - 1)) as usize] += x as f64;
            }
            let (b, cum) = scan(&h, below)?;
            prefix = prefix << bits | b;
            below = cum;
            left.retain(|&(o, _, _)| o >> shift == prefix);
        }
        // The tokens of that logit, in index order.
        let mut cum = below;
        for &(_, i, x) in &left {
            cum += x as f64;
            if passes(cum) {
                return Some((i as usize, cum));
            }
        }
        None
    }

    /// Whether token `a` comes after token `b` in the order.
    fn after(&self, a: usize, b: usize) -> bool {
        (self.places[a], a) > (self.places[b], b)
    }

    /// The last token in the order of those `keep` keeps (0 if none).
    pub(super) fn last_of(&self, keep: impl Fn(usize) -> bool) -> usize {
        (0..self.row.len()).filter(|&i| keep(i)).reduce(|a, i| if self.after(i, a) { i } else { a }).unwrap_or(0)
    }

    /// The token drawn with number `u` from the nucleus of mass `goal`
    /// (the first tokens in the order whose weights reach it), less the
    /// tokens whose logit is under `floor` (min-p): the token at which the
    /// running sum passes `u` times the kept mass, as a walk over the
    /// sorted nucleus would find.
    pub(super) fn draw_nucleus(&self, goal: f64, floor: Option<f64>, u: f64) -> usize {
        // Rounding short of the goal keeps every possible token.
        let (mut last, mut mass) = self.crossing(goal, false).unwrap_or_else(|| (self.last_of(|i| self.w[i] > 0.0), self.w.iter().map(|&x| x as f64).sum()));
        if let Some(f) = floor.filter(|&f| (key(self.row[last]) as f64) < f) {
            // min-p ends the kept tokens before the nucleus does.
            let kept = |i: usize| self.w[i] > 0.0 && key(self.row[i]) as f64 >= f;
            mass = (0..self.row.len()).filter(|&i| kept(i)).map(|i| self.w[i] as f64).sum();
            last = self.last_of(kept);
        }
        match self.crossing(u * mass, true) {
            Some((i, _)) if !self.after(i, last) => i,
            _ => last,
        }
    }
}

/// `log(sum(exp(x)))` over a row, stably.
pub(super) fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = row_max(logits);
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let mut buf = [0f32; BLOCK];
    let sum: f64 = logits
        .chunks(BLOCK)
        .map(|c| {
            let b = &mut buf[..c.len()];
            for (o, &x) in b.iter_mut().zip(c) {
                *o = exp_nonpositive(x - max);
            }
            lane_sum(b)
        })
        .sum();
    max + sum.ln() as f32
}

/// Sum of a short run (a block) in eight f32 lanes, so it vectorises.
fn lane_sum(xs: &[f32]) -> f64 {
    let mut acc = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    (acc.iter().sum::<f32>() + rest) as f64
}
