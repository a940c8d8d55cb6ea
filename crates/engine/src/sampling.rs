//! Token sampling: penalties, temperature, top-k / top-p / min-p, a seeded
//! RNG per stream, and logprobs.
//!
//! Built for large vocabularies (262k rows): greedy is one argmax pass;
//! plain temperature sampling is two linear passes; top-k selects its
//! candidates without sorting the vocabulary; top-p alone takes a sorted
//! head of 64 and, past it, finds the nucleus and the drawn token by the
//! mass in the row's order (`Ordered`), so no token pays for a sort
//! (262,144 flat logits: 10.1 ms a token sorting a growing head, 1.8 ms
//! so: `cargo bench -p braid-engine --bench sampling`).

use std::collections::{HashMap, VecDeque};

use crate::backend::{Draw, Penalty};
use crate::guide::{Guide, TokenMask};
use crate::rng::Rng;

mod row;

pub use row::{argmax, exp_nonpositive, top_n};
use row::{key, log_sum_exp, row_max, row_weights, walk, Ordered};

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
    /// Sums of `scratch` by block of [`row::BLOCK`].
    blocks: Vec<f64>,
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
        // Top-k narrowed the set (top-p then applies among its survivors).
        let from_top_k = cands.is_some();
        let mut full: Option<f64> = None;
        let mut whole_row = |w: &mut Vec<f32>, blocks: &mut Vec<f64>| -> f64 { *full.get_or_insert_with(|| row_weights(row, max, inv_t, w, blocks)) };

        // Candidates, most likely first, when some filter narrows the set.
        if cands.is_none() && p.top_p < 1.0 {
            // Nucleus over the whole vocabulary: a model's is a few dozen
            // tokens, so a sorted head of 64 first; past it, found by the
            // mass in the row's order without sorting it (a flat row's
            // nucleus is most of the vocabulary).
            let total = whole_row(&mut self.scratch, &mut self.blocks);
            let goal = p.top_p as f64 * total;
            let head = top_n(row, 64.min(v));
            let mut cum = 0.0;
            match head.iter().position(|&(_, l)| {
                cum += weight(l) as f64;
                cum >= goal
            }) {
                Some(c) => cands = Some(head[..=c].to_vec()),
                None if head.len() == v => cands = Some(head),
                None => {
                    let floor = (p.min_p > 0.0).then(|| max as f64 + (p.min_p as f64).ln() * p.temperature as f64);
                    let u = u.unwrap_or_else(|| self.rng.next_f64());
                    return Ordered::new(row, &self.scratch).draw_nucleus(goal, floor, u) as u32;
                }
            }
        }
        if let Some(c) = cands.as_mut() {
            if from_top_k && p.top_p < 1.0 {
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
mod tests;
