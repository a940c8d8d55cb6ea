//! A routed mixture of experts: the building block every MoE family shares
//! (Gemma 4, LFM2-MoE, Nemotron-H, MiniMax).
//!
//! Routing runs on the host: the router logits (`[rows, experts]`, a few
//! numbers per token) are downloaded, each row picks its top-k experts, and
//! then every expert runs once over the rows that chose it (gather, expert
//! MLP, `scatter_add_rows` weighted into the output). Experts are visited in
//! index order, so each row's sum has the same order whatever else is in the
//! batch: results do not depend on chunking.
//!
//! # How to call it
//!
//! ```ignore
//! // Load: the router's rule, and the experts (one tensor per expert, or fused).
//! let router = Router { scoring: Scoring::Softmax, top_k: 2, ..Router::default() };
//! let experts = Experts::load_split(dev, src, n_experts, Activation::Gated(Act::Silu), |e| {
//!     (Some(format!("{p}experts.{e}.w1.weight")), format!("{p}experts.{e}.w3.weight"), format!("{p}experts.{e}.w2.weight"))
//! })?;
//! let moe = Moe { router, experts };
//!
//! // Forward: the model computes the router logits itself (families feed
//! // the router different inputs), then:
//! dev.matmul(&x_router, &[&gate_weight], &mut [&mut logits]);
//! moe.forward(dev, &x, &logits, &mut out, [&mut t0, &mut t1, &mut t2, &mut t3, &mut t4])?;
//! // `out` is [rows, hidden]: the weighted sum of the chosen experts' outputs
//! // (overwritten, not accumulated). t0..t4 are scratch tensors.
//! ```

use anyhow::{bail, ensure, Context, Result};
use braid_formats::TensorView;
use braid_ops::{Act, Device, Map, MoeOps};

use crate::recurrent::extras;
use crate::source::Source;
use crate::Scratch;

/// How router logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// `softmax(logits)` over all experts (Mixtral, MiniMax, Gemma 4).
    Softmax,
    /// `sigmoid(logits)` per expert (DeepSeek-V3 style: LFM2-MoE, Nemotron-H, MiniMax-M2).
    Sigmoid,
}

/// The routing rule: which experts a row uses, and with what weights.
#[derive(Clone, Debug)]
pub struct Router {
    pub scoring: Scoring,
    pub top_k: usize,
    /// Added to the scores only to choose the experts; the weights are the
    /// unbiased scores (`e_score_correction_bias`, `expert_bias`).
    pub choice_bias: Option<Vec<f32>>,
    /// Divide the chosen weights by their sum (plus `norm_eps`).
    pub normalize: bool,
    pub norm_eps: f32,
    /// Multiplies every weight (`routed_scaling_factor`).
    pub scale: f32,
    /// Multiplies the weight of each expert (Gemma 4's `per_expert_scale`).
    pub per_expert_scale: Option<Vec<f32>>,
}

impl Default for Router {
    fn default() -> Self {
        Router { scoring: Scoring::Softmax, top_k: 2, choice_bias: None, normalize: true, norm_eps: 0.0, scale: 1.0, per_expert_scale: None }
    }
}

/// Each expert's rows and their weights, for one batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    /// `rows[e]`: the rows that chose expert `e`, ascending.
    pub rows: Vec<Vec<u32>>,
    /// `weights[e][i]`: the weight of expert `e` for row `rows[e][i]`.
    pub weights: Vec<Vec<f32>>,
}

impl Router {
    /// Route `logits` (`rows × experts`, row-major).
    pub fn route(&self, logits: &[f32], experts: usize) -> Result<Routing> {
        ensure!(experts > 0 && logits.len().is_multiple_of(experts), "router logits of {} values are not rows of {experts} experts", logits.len());
        ensure!(self.top_k >= 1 && self.top_k <= experts, "top-{} routing over {experts} experts", self.top_k);
        for (what, v) in [("choice bias", &self.choice_bias), ("per-expert scale", &self.per_expert_scale)] {
            if let Some(v) = v {
                ensure!(v.len() == experts, "router {what} has {} values for {experts} experts", v.len());
            }
        }
        let mut out = Routing { rows: vec![Vec::new(); experts], weights: vec![Vec::new(); experts] };
        let mut scores = vec![0f32; experts];
        let mut order: Vec<usize> = Vec::with_capacity(experts);
        for (r, row) in logits.chunks_exact(experts).enumerate() {
            match self.scoring {
                Scoring::Softmax => {
                    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for (s, &l) in scores.iter_mut().zip(row) {
                        *s = (l - m).exp();
                        sum += *s;
                    }
                    scores.iter_mut().for_each(|s| *s /= sum);
                }
                Scoring::Sigmoid => {
                    for (s, &l) in scores.iter_mut().zip(row) {
                        *s = 1.0 / (1.0 + (-l).exp());
                    }
                }
            }
            let choice = |e: usize| scores[e] + self.choice_bias.as_ref().map_or(0.0, |b| b[e]);
            order.clear();
            order.extend(0..experts);
            // Highest first; ties (and NaN) go to the lower index, as a stable sort would.
            order.sort_by(|&a, &b| choice(b).partial_cmp(&choice(a)).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
            let chosen = &order[..self.top_k];
            let total: f32 = chosen.iter().map(|&e| scores[e]).sum();
            let norm = if self.normalize { 1.0 / (total + self.norm_eps) } else { 1.0 };
            for &e in chosen {
                let w = scores[e] * norm * self.scale * self.per_expert_scale.as_ref().map_or(1.0, |p| p[e]);
                out.rows[e].push(r as u32);
                out.weights[e].push(w);
            }
        }
        Ok(out)
    }
}

/// The expert MLP's activation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// `down(act(gate(x)) * up(x))`.
    Gated(Act),
    /// `down(f(up(x)))`, no gate projection (Nemotron-H's relu²).
    Plain(Map),
}

pub struct Expert<D: Device> {
    /// None for non-gated experts (`down(act(up(x)))`).
    pub gate: Option<D::Weight>,
    pub up: D::Weight,
    pub down: D::Weight,
}

pub struct Experts<D: Device> {
    pub experts: Vec<Expert<D>>,
    pub act: Activation,
}

/// Rows `first..first + rows` of `view` taken as a matrix `[view.rows(), view.cols()]`
/// (so a `[E, n, in]` tensor gives expert e's `[n, in]` block at `first = e * n`).
pub fn slice_rows(view: &TensorView, first: usize, rows: usize) -> Result<TensorView> {
    let cols = view.cols();
    let row_bytes = view.dtype.bytes_for(cols).with_context(|| format!("tensor {}: rows of {cols} are not whole {} blocks", view.name, view.dtype))?;
    ensure!(first + rows <= view.rows(), "tensor {}: rows {first}..{} asked of {:?}", view.name, first + rows, view.shape);
    let data = view.data.slice(first * row_bytes, rows * row_bytes).with_context(|| format!("tensor {}: data shorter than its shape", view.name))?;
    Ok(TensorView { name: format!("{}[{first}..{}]", view.name, first + rows), dtype: view.dtype, shape: vec![rows, cols], data })
}

/// The rows of `view` in `ranges` (`(first, rows)` each), in that order, as
/// one matrix: a fused projection's parts regrouped.
pub fn join_rows(view: &TensorView, ranges: &[(usize, usize)]) -> Result<TensorView> {
    let mut data = Vec::new();
    let mut rows = 0;
    for &(first, n) in ranges {
        data.extend_from_slice(&slice_rows(view, first, n)?.data);
        rows += n;
    }
    Ok(TensorView {
        name: format!("{}[{} rows picked]", view.name, rows),
        dtype: view.dtype,
        shape: vec![rows, view.cols()],
        data: braid_formats::Bytes::from_vec(data),
    })
}

impl<D: Device> Experts<D> {
    /// One tensor per expert: `names(e)` gives (gate, up, down) of expert `e`
    /// (gate None for non-gated experts).
    pub fn load_split(dev: &D, src: &Source, n: usize, act: Activation, names: impl Fn(usize) -> (Option<String>, String, String)) -> Result<Experts<D>> {
        let w = |name: &str| dev.weight(&src.tensor(name)?);
        let mut experts = Vec::with_capacity(n);
        for e in 0..n {
            let (g, u, d) = names(e);
            experts.push(Expert { gate: g.map(|g| w(&g)).transpose()?, up: w(&u)?, down: w(&d)? });
        }
        Ok(Experts { experts, act })
    }

    /// By the GGUF names of the stacked tensors (`blk.{i}.ffn_{gate,up,down}_exps.weight`;
    /// gate None for non-gated experts): a GGUF's are sliced per expert, an
    /// HF folder's per-expert tensors are read by their own names
    /// ([`Source::expert`]).
    pub fn load_stacked(dev: &D, src: &Source, n: usize, act: Activation, gate: Option<&str>, up: &str, down: &str) -> Result<Experts<D>> {
        let w = |name: &str, e: usize| dev.weight(&src.expert(name, e, n)?);
        let mut experts = Vec::with_capacity(n);
        for e in 0..n {
            experts.push(Expert { gate: gate.map(|g| w(g, e)).transpose()?, up: w(up, e)?, down: w(down, e)? });
        }
        Ok(Experts { experts, act })
    }

    /// Fused tensors: `gate_up` `[E, 2I, H]` (gate rows first, then up rows,
    /// not interleaved) and `down` `[E, H, I]`.
    pub fn load_fused(dev: &D, gate_up: &TensorView, down: &TensorView, act: Activation) -> Result<Experts<D>> {
        let (&[e, i2, h], &[e2, h2, i]) = (gate_up.shape.as_slice(), down.shape.as_slice()) else {
            bail!("fused experts {} {:?} and {} {:?}: expected [E, 2I, H] and [E, H, I]", gate_up.name, gate_up.shape, down.name, down.shape)
        };
        ensure!(e == e2 && h == h2 && i2 == 2 * i, "fused experts {} {:?} and {} {:?} disagree", gate_up.name, gate_up.shape, down.name, down.shape);
        let mut experts = Vec::with_capacity(e);
        for x in 0..e {
            experts.push(Expert {
                gate: Some(dev.weight(&slice_rows(gate_up, x * 2 * i, i)?)?),
                up: dev.weight(&slice_rows(gate_up, x * 2 * i + i, i)?)?,
                down: dev.weight(&slice_rows(down, x * h, h)?)?,
            });
        }
        Ok(Experts { experts, act })
    }

    /// `out = down(act(gate(x), up(x)))` over the rows of `x`.
    fn run(&self, dev: &D, e: &Expert<D>, x: &D::Tensor, out: &mut D::Tensor, t: [&mut D::Tensor; 3]) -> Result<()> {
        let [gate, up, act] = t;
        match (self.act, &e.gate) {
            (Activation::Gated(f), Some(g)) => {
                dev.matmul(x, &[g, &e.up], &mut [&mut *gate, &mut *up]);
                dev.gated(f, gate, up, act);
                dev.matmul(act, &[&e.down], &mut [out]);
            }
            (Activation::Plain(f), None) => {
                dev.matmul(x, &[&e.up], &mut [&mut *up]);
                dev.map(up, f);
                dev.matmul(up, &[&e.down], &mut [out]);
            }
            (Activation::Gated(_), None) => bail!("a gated expert without a gate projection"),
            (Activation::Plain(_), Some(_)) => bail!("an expert with a gate projection and an ungated activation"),
        }
        Ok(())
    }
}

/// A router and its experts.
pub struct Moe<D: Device> {
    pub router: Router,
    pub experts: Experts<D>,
}

impl<D: MoeOps> Moe<D> {
    /// The mixture over the normed rows `s.h` into `s.out`, routed by the
    /// `gate` projection of those same rows (the families whose router
    /// reads the block's input); scratch from `s.extra`.
    pub fn routed(&self, dev: &D, gate: &D::Weight, s: &mut Scratch<D>) -> Result<()> {
        let [logits, t0, t1, t2, t3, t4] = extras(dev, &mut s.extra);
        dev.matmul(&s.h, &[gate], &mut [&mut *logits]);
        self.forward(dev, &s.h, logits, &mut s.out, [t0, t1, t2, t3, t4])
    }

    /// `out = Σ_chosen w · expert(x)` per row of `x`, the experts chosen from
    /// `router_logits` (`[rows, experts]`). `out` is overwritten (resized to
    /// `[rows, hidden]`); `t` are scratch tensors.
    pub fn forward(&self, dev: &D, x: &D::Tensor, router_logits: &D::Tensor, out: &mut D::Tensor, t: [&mut D::Tensor; 5]) -> Result<()> {
        let n = self.experts.experts.len();
        let (rows, _) = dev.shape(x);
        let (lr, lc) = dev.shape(router_logits);
        ensure!(lr == rows && lc == n, "router logits are {lr}x{lc}, expected {rows} rows of {n} experts");
        let routing = self.router.route(&dev.download(router_logits)?, n)?;
        let hidden = match self.experts.experts.first() {
            Some(e) => dev.weight_shape(&e.down).0,
            None => bail!("a mixture of no experts"),
        };
        dev.resize(out, rows, hidden);
        let all: Vec<u32> = (0..rows as u32).collect();
        dev.zero_rows(out, &all);
        let [xe, ye, gate, up, act] = t;
        for (e, expert) in self.experts.experts.iter().enumerate() {
            let ids = &routing.rows[e];
            if ids.is_empty() {
                continue;
            }
            let idx: Vec<usize> = ids.iter().map(|&r| r as usize).collect();
            dev.gather_rows(x, &idx, xe);
            self.experts.run(dev, expert, xe, ye, [&mut *gate, &mut *up, &mut *act])?;
            dev.scatter_add_rows(out, ye, ids, &routing.weights[e])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_top2_renormalised_with_expert_scale() {
        let r = Router { scoring: Scoring::Softmax, top_k: 2, per_expert_scale: Some(vec![1.0, 2.0, 1.0, 1.0]), ..Router::default() };
        // Row 0 prefers experts 1 then 3; row 1 prefers 0 then 2.
        let logits = [0.0, 2.0, -1.0, 1.0, 3.0, 0.0, 1.0, -2.0];
        let rt = r.route(&logits, 4).unwrap();
        assert_eq!(rt.rows, vec![vec![1], vec![0], vec![1], vec![0]]);
        let (a, b) = (2f32.exp(), 1f32.exp());
        assert!((rt.weights[1][0] - 2.0 * a / (a + b)).abs() < 1e-6);
        assert!((rt.weights[3][0] - b / (a + b)).abs() < 1e-6);
        let (a, b) = (3f32.exp(), 1f32.exp());
        assert!((rt.weights[0][0] - a / (a + b)).abs() < 1e-6);
    }

    #[test]
    fn sigmoid_choice_bias_picks_but_does_not_weigh() {
        // The bias makes expert 2 win the choice, but its weight is its raw score.
        let r = Router { scoring: Scoring::Sigmoid, top_k: 1, choice_bias: Some(vec![0.0, 0.0, 1.0]), normalize: false, scale: 1.5, ..Router::default() };
        let rt = r.route(&[2.0, 0.0, 0.0], 3).unwrap();
        assert_eq!(rt.rows, vec![vec![], vec![], vec![0]]);
        assert!((rt.weights[2][0] - 1.5 * 0.5).abs() < 1e-6);
    }

    #[test]
    fn bad_shapes_are_errors() {
        let r = Router::default();
        assert!(r.route(&[1.0, 2.0, 3.0], 2).is_err());
        assert!(Router { top_k: 3, ..Router::default() }.route(&[1.0, 2.0], 2).is_err());
        assert!(Router { choice_bias: Some(vec![0.0]), ..Router::default() }.route(&[1.0, 2.0], 2).is_err());
    }
}
