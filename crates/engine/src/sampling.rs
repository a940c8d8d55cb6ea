//! Token sampling: penalties, temperature, top-k / top-p / min-p, a seeded
//! RNG per stream, and logprobs.
//!
//! Built for large vocabularies (262k rows): greedy is one argmax pass;
//! plain temperature sampling is two linear passes; top-k selects its
//! candidates without sorting the vocabulary; top-p alone grows a partial
//! selection until it holds the nucleus, so no token pays for a full sort.

use std::collections::{HashMap, VecDeque};

use crate::backend::{Draw, Penalty};
use crate::guide::{Guide, TokenMask};
use crate::rng::Rng;

/// How a stream picks its tokens. The defaults sample the model's own
/// distribution (temperature 1, no filters, no penalties).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` (or less) means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` keeps all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`;
    /// `1` keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely; `0` keeps all.
    pub min_p: f32,
    /// llama.cpp's repetition penalty over the last `repetition_window`
    /// tokens of prompt + completion: a positive logit is divided by it, a
    /// negative one multiplied. `1` is off.
    pub repetition_penalty: f32,
    /// How many recent tokens (prompt + completion) the repetition penalty
    /// sees; `0` means all of them.
    pub repetition_window: usize,
    /// OpenAI's presence penalty: subtracted once from every token the
    /// completion already holds.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted once per occurrence in the
    /// completion.
    pub frequency_penalty: f32,
    /// Seed of the stream's RNG; the same seed gives the same tokens. `None`
    /// draws a fresh seed.
    pub seed: Option<u64>,
    /// A grammar the tokens must follow (structured outputs, tool calls):
    /// tokens it does not allow next are masked out before sampling, and
    /// the stream ends when it is complete.
    pub guide: Option<Guide>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repetition_window: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            guide: None,
        }
    }
}

impl SamplingParams {
    /// Always the most likely token.
    pub fn greedy() -> SamplingParams {
        SamplingParams { temperature: 0.0, ..SamplingParams::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Check the values are usable; the error says which one is not.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() {
            return Err(format!("temperature must be a finite number, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!("repetition_penalty must be positive, got {}", self.repetition_penalty));
        }
        if !self.presence_penalty.is_finite() {
            return Err(format!("presence_penalty must be finite, got {}", self.presence_penalty));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(format!("frequency_penalty must be finite, got {}", self.frequency_penalty));
        }
        Ok(())
    }
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Log-probability of `token` under the raw logits (log-softmax before
    /// penalties, temperature and filters), when logprobs were asked for.
    pub logprob: Option<f32>,
    /// The `n` most likely tokens under the raw logits, with their
    /// log-probabilities, most likely first (empty unless asked for).
    pub top: Vec<(u32, f32)>,
}

/// The tokens a stream's penalties read.
#[derive(Clone, Debug, Default)]
struct History {
    /// The last `repetition_window` tokens of prompt + completion, and how
    /// often each occurs in them.
    window: VecDeque<u32>,
    window_counts: HashMap<u32, u32>,
    /// How often each token occurs in the completion.
    completion_counts: HashMap<u32, u32>,
}

impl History {
    fn push_window(&mut self, token: u32, window: usize) {
        self.window.push_back(token);
        *self.window_counts.entry(token).or_insert(0) += 1;
        if window > 0 && self.window.len() > window {
            if let Some(old) = self.window.pop_front() {
                if let Some(c) = self.window_counts.get_mut(&old) {
                    *c -= 1;
                    if *c == 0 {
                        self.window_counts.remove(&old);
                    }
                }
            }
        }
    }

    fn accept(&mut self, token: u32, window: usize) {
        self.push_window(token, window);
        *self.completion_counts.entry(token).or_insert(0) += 1;
    }

    /// `p`'s penalties on this history, as token row `row`: one per token
    /// whose logit they change.
    fn penalties<'a>(&'a self, p: &'a SamplingParams, row: u32) -> impl Iterator<Item = Penalty> + 'a {
        let repeat = move |t: &u32| if self.window_counts.contains_key(t) { p.repetition_penalty } else { 1.0 };
        let sub = move |t: &u32| match self.completion_counts.get(t) {
            Some(&c) if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 => p.presence_penalty + c as f32 * p.frequency_penalty,
            _ => 0.0,
        };
        let window = self.window_counts.keys().filter(move |&t| p.repetition_penalty != 1.0 || sub(t) != 0.0);
        let completion_only = self.completion_counts.keys().filter(move |&t| !self.window_counts.contains_key(t) && sub(t) != 0.0);
        window.chain(completion_only).map(move |t| Penalty { row, token: *t, repeat: repeat(t), sub: sub(t) })
    }
}

/// One stream's sampler: its parameters, RNG and token history.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    history: History,
    /// Per-token weights of the last draw (reused to avoid an allocation
    /// per token).
    scratch: Vec<f32>,
    /// Sums of `scratch` by block of [`BLOCK`].
    blocks: Vec<f64>,
}

/// NaN logits (a broken model) are treated as impossible tokens rather than
/// poisoning comparisons.
fn key(x: f32) -> f32 {
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
fn row_max(logits: &[f32]) -> f32 {
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
const BLOCK: usize = 256;

/// Weights `exp((l - max) / T)` of a whole row into `w`, and the sum of
/// each block of [`BLOCK`] into `blocks`; returns the total. Each block is
/// summed in eight f32 lanes (32 terms each, exact enough), blocks in f64.
fn row_weights(logits: &[f32], max: f32, inv_t: f32, w: &mut Vec<f32>, blocks: &mut Vec<f64>) -> f64 {
    w.clear();
    // NaN - max stays NaN, fails `x >= -87` and comes out 0: no `key` needed.
    w.extend(logits.iter().map(|&l| exp_nonpositive((l - max) * inv_t)));
    blocks.clear();
    blocks.extend(w.chunks(BLOCK).map(lane_sum));
    blocks.iter().sum()
}

/// The first index where the running sum of `w` passes `target`: whole
/// blocks are skipped by their sums, then one block is walked.
fn walk(w: &[f32], blocks: &[f64], target: f64) -> usize {
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

/// `log(sum(exp(x)))` over a row, stably.
fn log_sum_exp(logits: &[f32]) -> f32 {
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

impl Sampler {
    /// A sampler for a stream whose prompt is `prompt` (the repetition
    /// penalty sees its tail).
    pub fn new(params: &SamplingParams, prompt: &[u32]) -> Sampler {
        let seed = params.seed.unwrap_or_else(Rng::fresh_seed);
        let mut s = Sampler { params: params.clone(), rng: Rng::new(seed), history: History::default(), scratch: Vec::new(), blocks: Vec::new() };
        let from = match s.params.repetition_window {
            0 => 0,
            w => prompt.len().saturating_sub(w),
        };
        for &t in &prompt[from..] {
            s.history.push_window(t, s.params.repetition_window);
        }
        s
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Record `token` as the completion's newest token (for penalties).
    pub fn accept(&mut self, token: u32) {
        self.history.accept(token, self.params.repetition_window);
    }

    /// Apply repetition / presence / frequency penalties in place; only the
    /// logits of tokens in the history change.
    pub fn apply_penalties(&self, logits: &mut [f32]) {
        for e in self.history.penalties(&self.params, 0) {
            if let Some(l) = logits.get_mut(e.token as usize) {
                *l = e.apply(*l);
            }
        }
    }

    /// The penalties of this stream's next row, as token row `row` of a
    /// round, into `out`: one per token whose logit they change (the
    /// repetition penalty over the window, presence and frequency over the
    /// completion).
    pub fn penalties(&self, row: u32, out: &mut Vec<Penalty>) {
        out.extend(self.history.penalties(&self.params, row));
    }

    /// [`Sampler::penalties`] of a decode row carrying `drafts`: its token
    /// rows from `row` on, each after the drafts before it, as if accepted
    /// (as verifying them accepts them).
    pub fn row_penalties(&self, drafts: &[u32], row: u32, out: &mut Vec<Penalty>) {
        self.penalties(row, out);
        if drafts.is_empty() {
            return;
        }
        let mut h = self.history.clone();
        for (j, &t) in drafts.iter().enumerate() {
            h.accept(t, self.params.repetition_window);
            out.extend(h.penalties(&self.params, row + 1 + j as u32));
        }
    }

    /// Penalties change this stream's logits.
    pub fn penalised(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    /// No penalty changes the logits and no guide masks them: the row's
    /// largest logits are the ones sampled from.
    fn unchanged_row(&self) -> bool {
        !self.penalised() && self.params.guide.is_none()
    }

    /// Pick the next token from one logits row (the row is used as scratch
    /// and left penalised). `logprobs` asks for the chosen token's
    /// log-probability and the `n` most likely alternatives. Does not
    /// record the token: call [`Sampler::accept`] for a token that is kept.
    /// Non-greedy sampling draws exactly one random number per call.
    pub fn sample(&mut self, logits: &mut [f32], logprobs: Option<usize>) -> Sampled {
        self.sample_masked(logits, logprobs, None)
    }

    /// [`Sampler::sample`] among the tokens `mask` allows (a guide's):
    /// the others' logits become -inf after penalties, so logprobs still
    /// describe the model's own distribution.
    pub fn sample_masked(&mut self, logits: &mut [f32], logprobs: Option<usize>, mask: Option<&TokenMask>) -> Sampled {
        if logits.is_empty() {
            return Sampled { token: 0, logprob: None, top: Vec::new() };
        }
        // Logprobs describe the model's own distribution, so they are read
        // off the raw row before penalties change it; only the penalised
        // tokens' raw values need saving (the rest of the row stays raw).
        let raw = logprobs.map(|n| {
            let touched: Vec<(u32, f32)> = self
                .history
                .window_counts
                .keys()
                .chain(self.history.completion_counts.keys())
                .filter_map(|&t| logits.get(t as usize).map(|&l| (t, l)))
                .collect();
            (log_sum_exp(logits), top_n(logits, n), touched)
        });
        self.apply_penalties(logits);
        if let Some(m) = mask {
            m.apply(logits);
        }
        let token = if self.params.is_greedy() { argmax(logits) } else { self.draw(logits, None) };
        // Every allowed logit -inf or NaN (a broken row): argmax fell on
        // token 0; take an allowed one instead.
        let token = mask.map_or(token, |m| m.allowed_or_first(token));
        match raw {
            None => Sampled { token, logprob: None, top: Vec::new() },
            Some((lse, top, touched)) => {
                let chosen = touched.iter().find(|&&(t, _)| t == token).map_or(logits[token as usize], |&(_, l)| l);
                Sampled { token, logprob: Some(key(chosen) - lse), top: top.into_iter().map(|(t, l)| (t, l - lse)).collect() }
            }
        }
    }

    /// The `top_k` candidates a backend may pick the token from, when
    /// [`Sampler::sample`] of a row would only look at that row's `top_k`
    /// largest logits: no penalty, no logprobs asked, and greedy (1) or a
    /// top-k filter (then top-p and min-p apply among those). `None`:
    /// the sampler needs the whole row.
    pub fn needs_only_top(&self) -> Option<usize> {
        let p = &self.params;
        if !self.unchanged_row() {
            None
        } else if p.is_greedy() {
            Some(1)
        } else {
            (p.top_k > 0).then_some(p.top_k)
        }
    }

    /// [`Sampler::sample`] of a row from its largest logits alone: `top`
    /// holds at least [`Sampler::needs_only_top`] of them, largest first
    /// (the lower token first on ties, NaN as -inf), as `top_n` lists
    /// them. Same token, same random draw as `sample` on the whole row.
    pub fn sample_top(&mut self, top: &[(u32, f32)]) -> u32 {
        let Some(&(first, max)) = top.first() else { return 0 };
        if self.params.is_greedy() || key(max) == f32::NEG_INFINITY {
            return first;
        }
        let k = self.params.top_k.min(top.len());
        self.pick(key(max), Some(top[..k].to_vec()), None, Some(first), None)
    }

    /// This stream's next `n` token rows' draws for a [`crate::Pick::Draw`]
    /// round, into `out`: its filters and the numbers its next `n` draws
    /// take (the generator is not advanced: [`Sampler::drawn`] does, per
    /// row kept, so rows a rejected draft leaves unsampled take nothing).
    pub fn draws(&self, n: usize, out: &mut Vec<Draw>) {
        let p = &self.params;
        let mut rng = self.rng.clone();
        for _ in 0..n {
            let (temperature, u) = if p.is_greedy() { (0.0, 0.0) } else { (p.temperature, rng.next_f64()) };
            out.push(Draw { temperature, top_k: p.top_k, top_p: p.top_p, min_p: p.min_p, u });
        }
    }

    /// A backend drew this stream's token from a row with the number
    /// [`Sampler::draws`] named first: the generator moves past it, as
    /// [`Sampler::sample`] of the row would have.
    pub fn drawn(&mut self) {
        if !self.params.is_greedy() {
            self.rng.next_f64();
        }
    }

    /// Temperature, then top-k, top-p and min-p, then one draw (with `u`,
    /// else the next number of the generator).
    fn draw(&mut self, logits: &[f32], u: Option<f64>) -> u32 {
        let p = &self.params;
        let v = logits.len();
        let max = row_max(logits);
        if max == f32::NEG_INFINITY {
            return argmax(logits);
        }
        // Candidates, most likely first, when top-k narrows the set.
        let cands = (p.top_k > 0 && p.top_k < v).then(|| top_n(logits, p.top_k));
        self.pick(max, cands, Some(logits), None, u)
    }

    /// The rest of [`Sampler::draw`] from the row's largest logit `max`
    /// and its top-k candidates (if top-k narrowed the set; then `logits`
    /// may be `None`): top-p, min-p, one draw. `fallback`: the row's
    /// argmax, should the filters leave nothing (`None`: find it in `logits`).
    /// `u`: the draw's number (`None`: the generator's next).
    fn pick(&mut self, max: f32, mut cands: Option<Vec<(u32, f32)>>, logits: Option<&[f32]>, fallback: Option<u32>, u: Option<f64>) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        // Unnormalised probability at temperature T; in (0, 1].
        let weight = |l: f32| exp_nonpositive((key(l) - max) * inv_t);
        // The whole row's weights, computed at most once per token (only
        // when no top-k candidates stand in for the row).
        let row = logits.unwrap_or(&[]);
        let v = row.len();
        let mut full: Option<f64> = None;
        let mut whole_row = |w: &mut Vec<f32>, blocks: &mut Vec<f64>| -> f64 { *full.get_or_insert_with(|| row_weights(row, max, inv_t, w, blocks)) };

        // Candidates, most likely first, when some filter narrows the set.
        if cands.is_none() && p.top_p < 1.0 {
            // Nucleus over the whole vocabulary: grow a sorted head until
            // it holds `top_p` of the mass.
            let total = whole_row(&mut self.scratch, &mut self.blocks);
            let mut m = 64usize.min(v);
            loop {
                let head = top_n(row, m);
                let mut cum = 0.0;
                let cut = head.iter().position(|&(_, l)| {
                    cum += weight(l) as f64;
                    cum >= p.top_p as f64 * total
                });
                if let Some(c) = cut {
                    cands = Some(head[..=c].to_vec());
                    break;
                }
                if m == v {
                    cands = Some(head);
                    break;
                }
                m = (m * 4).min(v);
            }
        }
        if let Some(c) = cands.as_mut() {
            if p.top_k > 0 && p.top_p < 1.0 {
                // top-p among the top-k survivors, renormalised.
                let total: f64 = c.iter().map(|&(_, l)| weight(l) as f64).sum();
                let mut cum = 0.0;
                let keep = c.iter().position(|&(_, l)| {
                    cum += weight(l) as f64;
                    cum >= p.top_p as f64 * total
                });
                c.truncate(keep.map_or(c.len(), |k| k + 1));
            }
        }
        if p.min_p > 0.0 {
            // p_i / p_max >= min_p  <=>  (l_i - l_max) / T >= ln(min_p)
            let floor = max as f64 + (p.min_p as f64).ln() * p.temperature as f64;
            match cands.as_mut() {
                Some(c) => c.retain(|&(_, l)| key(l) as f64 >= floor),
                None => cands = Some(row.iter().enumerate().filter(|&(_, &l)| key(l) as f64 >= floor).map(|(i, &l)| (i as u32, l)).collect()),
            }
        }

        let u = u.unwrap_or_else(|| self.rng.next_f64());
        match cands {
            Some(c) if !c.is_empty() => {
                let total: f64 = c.iter().map(|&(_, l)| weight(l) as f64).sum();
                let target = u * total;
                let mut cum = 0.0;
                for &(t, l) in &c {
                    cum += weight(l) as f64;
                    if cum > target {
                        return t;
                    }
                }
                c[c.len() - 1].0
            }
            Some(_) => fallback.unwrap_or_else(|| argmax(row)),
            None => {
                let total = whole_row(&mut self.scratch, &mut self.blocks);
                walk(&self.scratch, &self.blocks, u * total) as u32
            }
        }
    }
}

/// The token the host's [`Sampler`] draws from `logits` (left as they are)
/// under `d`'s filters with `d.u` as its number: what a [`crate::Pick::Draw`]
/// round returns where the host draws (the fake backend's).
pub fn draw_row(logits: &[f32], d: &Draw) -> u32 {
    if d.temperature <= 0.0 {
        return argmax(logits);
    }
    let params = SamplingParams { temperature: d.temperature, top_k: d.top_k, top_p: d.top_p, min_p: d.min_p, seed: Some(0), ..SamplingParams::default() };
    Sampler::new(&params, &[]).draw(logits, Some(d.u))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Logits whose softmax is exactly `probs`.
    fn from_probs(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|&p| p.ln() as f32).collect()
    }

    fn support(params: SamplingParams, logits: &[f32], draws: usize) -> HashSet<u32> {
        let mut s = Sampler::new(&SamplingParams { seed: Some(7), ..params }, &[]);
        (0..draws).map(|_| s.sample(&mut logits.to_vec(), None).token).collect()
    }

    fn pseudo_logits(n: usize, seed: u64) -> Vec<f32> {
        let mut r = Rng::new(seed);
        (0..n).map(|_| (r.next_f64() * 12.0 - 6.0) as f32).collect()
    }

    /// A backend's top-k candidates stand in for the whole row: the same
    /// tokens from the same seed, draw for draw, under every filter that
    /// applies among them; penalties and plain temperature need the row.
    #[test]
    fn sampling_from_the_top_candidates_equals_sampling_the_row() {
        let cases = [
            SamplingParams::greedy(),
            SamplingParams { top_k: 1, ..Default::default() },
            SamplingParams { top_k: 5, temperature: 0.7, ..Default::default() },
            SamplingParams { top_k: 40, top_p: 0.9, ..Default::default() },
            SamplingParams { top_k: 64, min_p: 0.05, temperature: 1.3, ..Default::default() },
            SamplingParams { top_k: 20, top_p: 0.5, min_p: 0.1, ..Default::default() },
        ];
        for (c, params) in cases.iter().enumerate() {
            let k = Sampler::new(params, &[]).needs_only_top().expect("top-k or greedy");
            let seeded = SamplingParams { seed: Some(9), ..params.clone() };
            let (mut whole, mut top) = (Sampler::new(&seeded, &[]), Sampler::new(&seeded, &[]));
            for round in 0..200 {
                let mut logits = pseudo_logits(3000, (c * 1000 + round) as u64);
                if round % 7 == 0 {
                    logits[round] = logits[(round + 1) % 3000]; // a tie
                    logits[2999] = f32::NAN;
                }
                let cands = top_n(&logits, k);
                let a = whole.sample(&mut logits.clone(), None).token;
                let b = top.sample_top(&cands);
                assert_eq!(a, b, "case {c} round {round}");
            }
        }
        for params in [
            SamplingParams { repetition_penalty: 1.1, ..SamplingParams::greedy() },
            SamplingParams { presence_penalty: 0.5, top_k: 5, ..Default::default() },
            SamplingParams { top_p: 0.9, ..Default::default() },
            SamplingParams::default(),
        ] {
            assert_eq!(Sampler::new(&params, &[]).needs_only_top(), None, "{params:?}");
        }
    }

    #[test]
    fn greedy_is_argmax_and_needs_no_seed() {
        for seed in 0..20 {
            let logits = pseudo_logits(1000, seed);
            let (best, _) = logits.iter().enumerate().fold((0, f32::MIN), |a, (i, &v)| if v > a.1 { (i, v) } else { a });
            let mut s = Sampler::new(&SamplingParams::greedy(), &[]);
            assert_eq!(s.sample(&mut logits.clone(), None).token, best as u32);
        }
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        let logits = pseudo_logits(500, 1);
        let run = |seed| {
            let mut s = Sampler::new(&SamplingParams { seed: Some(seed), temperature: 1.5, ..Default::default() }, &[1, 2, 3]);
            (0..64)
                .map(|_| {
                    let t = s.sample(&mut logits.clone(), None).token;
                    s.accept(t);
                    t
                })
                .collect::<Vec<u32>>()
        };
        assert_eq!(run(11), run(11));
        assert_ne!(run(11), run(12));
    }

    #[test]
    fn temperature_sampling_follows_the_softmax() {
        let probs = [0.5, 0.3, 0.15, 0.05];
        let logits = from_probs(&probs);
        let mut s = Sampler::new(&SamplingParams { seed: Some(3), ..Default::default() }, &[]);
        let mut counts = [0usize; 4];
        let n = 20_000;
        for _ in 0..n {
            counts[s.sample(&mut logits.clone(), None).token as usize] += 1;
        }
        for (c, p) in counts.iter().zip(probs) {
            let f = *c as f64 / n as f64;
            assert!((f - p).abs() < 0.015, "frequency {f} for probability {p}");
        }
    }

    #[test]
    fn top_k_restricts_the_support_to_the_k_best() {
        let logits = pseudo_logits(5000, 2);
        let mut order: Vec<u32> = (0..5000).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let best3: HashSet<u32> = order[..3].iter().copied().collect();
        // A high temperature flattens the distribution so all three show up.
        let got = support(SamplingParams { top_k: 3, temperature: 5.0, ..Default::default() }, &logits, 2000);
        assert_eq!(got, best3);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        let logits = from_probs(&[0.05, 0.5, 0.15, 0.3]);
        let got = support(SamplingParams { top_p: 0.7, ..Default::default() }, &logits, 2000);
        assert_eq!(got, HashSet::from([1, 3]));
        let got = support(SamplingParams { top_p: 0.9, ..Default::default() }, &logits, 2000);
        assert_eq!(got, HashSet::from([1, 3, 2]));
    }

    #[test]
    fn top_p_over_a_large_vocabulary_matches_a_full_sort() {
        let v = 262_144;
        let logits = pseudo_logits(v, 9);
        let mut order: Vec<u32> = (0..v as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let max = logits[order[0] as usize] as f64;
        let w: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut cum = 0.0;
        let mut nucleus = HashSet::new();
        for &t in &order {
            nucleus.insert(t);
            cum += w[t as usize];
            if cum >= 0.2 * total {
                break;
            }
        }
        let got = support(SamplingParams { top_p: 0.2, ..Default::default() }, &logits, 300);
        assert!(nucleus.len() > 64, "the nucleus should need more than one growth step");
        assert!(got.is_subset(&nucleus), "sampled outside the nucleus");
        assert!(got.len() > 10);
    }

    #[test]
    fn top_k_then_top_p_renormalises_over_the_survivors() {
        // Top-2 leaves {1: 0.5, 3: 0.3}; renormalised 0.625 / 0.375, so
        // top_p 0.6 keeps only token 1.
        let logits = from_probs(&[0.05, 0.5, 0.15, 0.3]);
        let got = support(SamplingParams { top_k: 2, top_p: 0.6, ..Default::default() }, &logits, 500);
        assert_eq!(got, HashSet::from([1]));
    }

    #[test]
    fn min_p_drops_tokens_below_a_fraction_of_the_best() {
        let logits = from_probs(&[0.5, 0.3, 0.15, 0.05]);
        // 0.25 * 0.5 = 0.125: tokens 0, 1, 2 stay.
        let got = support(SamplingParams { min_p: 0.25, ..Default::default() }, &logits, 3000);
        assert_eq!(got, HashSet::from([0, 1, 2]));
        // 0.7 * 0.5 = 0.35: only token 0 stays.
        let got = support(SamplingParams { min_p: 0.7, ..Default::default() }, &logits, 500);
        assert_eq!(got, HashSet::from([0]));
    }

    #[test]
    fn repetition_penalty_touches_only_the_window() {
        let params = SamplingParams { repetition_penalty: 2.0, repetition_window: 3, ..Default::default() };
        // Prompt tail within the window: 2, 3, 4 (token 1 falls outside).
        let s = Sampler::new(&params, &[1, 2, 3, 4]);
        let mut l = vec![1.0, 1.0, -1.0, 4.0, 0.5, 1.0];
        s.apply_penalties(&mut l);
        assert_eq!(l, vec![1.0, 1.0, -2.0, 2.0, 0.25, 1.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_see_only_the_completion() {
        let params = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
        let mut s = Sampler::new(&params, &[0, 1, 2]);
        s.accept(2);
        s.accept(2);
        s.accept(3);
        let mut l = vec![0.0; 5];
        s.apply_penalties(&mut l);
        // Token 2: 0.5 + 2 * 0.25; token 3: 0.5 + 0.25; prompt tokens 0, 1 untouched.
        assert_eq!(l, vec![0.0, 0.0, -1.0, -0.75, 0.0]);
    }

    #[test]
    fn penalties_steer_greedy_away_from_repeats() {
        let mut s = Sampler::new(&SamplingParams { repetition_penalty: 4.0, ..SamplingParams::greedy() }, &[0]);
        let logits = vec![3.0, 2.0, 1.0];
        assert_eq!(s.sample(&mut logits.clone(), None).token, 1);
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax() {
        let logits = pseudo_logits(300, 5);
        let lse = logits.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        let mut s = Sampler::new(&SamplingParams { seed: Some(1), temperature: 0.7, repetition_penalty: 1.5, ..Default::default() }, &[5, 6, 7]);
        let out = s.sample(&mut logits.clone(), Some(5));
        let want = logits[out.token as usize] as f64 - lse;
        assert!((out.logprob.unwrap() as f64 - want).abs() < 1e-4);
        assert_eq!(out.top.len(), 5);
        let mut order: Vec<usize> = (0..300).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        for (i, &(t, lp)) in out.top.iter().enumerate() {
            assert_eq!(t as usize, order[i]);
            assert!((lp as f64 - (logits[order[i]] as f64 - lse)).abs() < 1e-4);
        }
    }

    #[test]
    fn top_n_agrees_with_sorting_for_small_and_large_n() {
        let logits = pseudo_logits(4000, 4);
        let mut order: Vec<u32> = (0..4000).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        for n in [1, 7, 64, 65, 500, 4000, 5000] {
            let got: Vec<u32> = top_n(&logits, n).into_iter().map(|(t, _)| t).collect();
            assert_eq!(got, order[..n.min(4000)].to_vec(), "n = {n}");
        }
    }

    #[test]
    fn nan_logits_do_not_win_or_panic() {
        let mut s = Sampler::new(&SamplingParams::greedy(), &[]);
        assert_eq!(s.sample(&mut [f32::NAN, 1.0, f32::NAN], None).token, 1);
        let mut s = Sampler::new(&SamplingParams { seed: Some(1), top_k: 2, ..Default::default() }, &[]);
        for _ in 0..50 {
            let t = s.sample(&mut [f32::NAN, 1.0, 0.5, f32::NAN], None).token;
            assert!(t == 1 || t == 2);
        }
        let mut s = Sampler::new(&SamplingParams { seed: Some(1), ..Default::default() }, &[]);
        s.sample(&mut [f32::NAN; 4], Some(2));
    }

    #[test]
    fn the_fast_exp_matches_libm() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -80.0 {
            let got = exp_nonpositive(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max((got - want).abs() / want);
            x -= 0.001_3;
        }
        // The error grows with |x| (rounding of x * log2(e)); weights that
        // small hardly matter, and near the top it is float-exact.
        assert!(worst < 1e-5, "worst relative error {worst}");
        let near: f64 =
            (0..10_000).map(|i| -(i as f32) * 0.001).map(|x| ((exp_nonpositive(x) as f64) - (x as f64).exp()).abs() / (x as f64).exp()).fold(0.0, f64::max);
        assert!(near < 1e-6, "relative error near 0: {near}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn argmax_is_the_first_largest_whatever_the_row() {
        // The one-pass definition argmax must keep to.
        let naive = |l: &[f32]| l.iter().enumerate().fold((0usize, f32::NEG_INFINITY), |(b, bv), (i, &v)| if v > bv { (i, v) } else { (b, bv) }).0 as u32;
        for (n, seed) in [(0, 1), (1, 2), (15, 3), (16, 4), (17, 5), (1000, 6), (128_256, 7)] {
            let mut row = pseudo_logits(n, seed);
            assert_eq!(argmax(&row), naive(&row), "n {n}");
            if n > 3 {
                // Ties (the first wins), NaN and -inf, ±0.
                let (a, b) = (n / 3, 2 * n / 3);
                row[a] = 1e9;
                row[b] = 1e9;
                row[0] = f32::NAN;
                assert_eq!(argmax(&row), a as u32, "n {n}");
                row.iter_mut().for_each(|v| *v = if v.is_nan() { *v } else { f32::NEG_INFINITY });
                assert_eq!(argmax(&row), 0, "n {n}: no finite logit");
                row.iter_mut().for_each(|v| *v = -0.0);
                row[n - 1] = 0.0;
                assert_eq!(argmax(&row), naive(&row), "n {n}: signed zeros");
            }
        }
    }

    #[test]
    fn bad_parameters_are_named() {
        let e = SamplingParams { top_p: 0.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.contains("top_p"));
        let e = SamplingParams { repetition_penalty: -1.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.contains("repetition_penalty"));
        assert!(SamplingParams::default().validate().is_ok());
    }
}
