//! Gemma 3's vision path: a SigLIP vision tower (patch embedding, a
//! pre-norm transformer encoder with bidirectional attention, a final
//! LayerNorm), average pooling of the patch grid to the image's soft
//! tokens, and the multimodal projector (a Gemma RMSNorm, then a matrix
//! into the text model's width). Its output rows replace the image tokens'
//! embeddings.
//!
//! Written with the device's primitive ops only: LayerNorm is an RMSNorm
//! of the rows less their mean (the mean subtracted by a centring matrix),
//! attention over all patches runs each patch as a query of its own that
//! sees every key, and pooling sums gathered rows.

use std::sync::Mutex;

use anyhow::{bail, ensure, Context, Result};
use braid_formats::{Bytes, DType, TensorView};
use braid_ops::{Act, AttnSeq, Device, KvDtype, KvPoolSpec, KvShape, Map, MoeOps};

use crate::config::HfConfig;
use crate::source::Source;

/// The vision tower's and projector's sizes, from `vision_config` and the
/// top level of a `Gemma3ForConditionalGeneration` config.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub ffn: usize,
    pub channels: usize,
    /// Image side in pixels (square images).
    pub image_size: usize,
    pub patch: usize,
    pub eps: f32,
    /// Soft tokens per image (a square number).
    pub tokens: usize,
    /// The text model's width: the projector's output.
    pub text_hidden: usize,
    /// The prompt's image placeholder, begin- and end-of-image tokens.
    pub image_token: u32,
    pub boi_token: Option<u32>,
    pub eoi_token: Option<u32>,
}

impl VisionConfig {
    /// Patches per image side.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch.max(1)
    }

    /// The vision config of the HF folder, if the model has a vision tower.
    pub fn from_source(src: &Source) -> Result<Option<VisionConfig>> {
        let Source::Hf(h) = src else { return Ok(None) };
        let Some(v) = h.config().get("vision_config").filter(|v| v.is_object()) else { return Ok(None) };
        let top = HfConfig::top(h.config(), h.dir());
        let c = HfConfig::top(v, h.dir());
        let text = HfConfig::new(h.config(), h.dir());
        let token = |k: &str| -> Result<Option<u32>> { Ok(top.opt_usize(k)?.map(|t| t as u32)) };
        let cfg = VisionConfig {
            hidden: c.usize("hidden_size")?,
            layers: c.usize("num_hidden_layers")?,
            heads: c.usize("num_attention_heads")?,
            ffn: c.usize("intermediate_size")?,
            channels: c.opt_usize("num_channels")?.unwrap_or(3),
            image_size: c.usize("image_size")?,
            patch: c.usize("patch_size")?,
            eps: c.opt_f32("layer_norm_eps")?.unwrap_or(1e-6),
            tokens: top.opt_usize("mm_tokens_per_image")?.unwrap_or(256),
            text_hidden: text.usize("hidden_size")?,
            image_token: token("image_token_index")?.or(token("image_token_id")?).context("config.json: no image_token_index")?,
            boi_token: token("boi_token_index")?,
            eoi_token: token("eoi_token_index")?,
        };
        cfg.check(&h.dir().join("config.json").display().to_string())?;
        Ok(Some(cfg))
    }

    fn check(&self, file: &str) -> Result<()> {
        let c = self;
        ensure!(c.hidden > 0 && c.layers > 0 && c.heads > 0 && c.ffn > 0 && c.channels > 0, "{file}: the vision_config sizes must be positive");
        ensure!(c.hidden.is_multiple_of(c.heads), "{file}: vision hidden_size {} is not a multiple of num_attention_heads {}", c.hidden, c.heads);
        ensure!(
            c.patch > 0 && c.image_size.is_multiple_of(c.patch) && c.image_size > 0,
            "{file}: image_size {} is not a multiple of patch_size {}",
            c.image_size,
            c.patch
        );
        let side = (c.tokens as f64).sqrt() as usize;
        ensure!(side > 0 && side * side == c.tokens, "{file}: mm_tokens_per_image {} is not a square", c.tokens);
        ensure!(c.grid().is_multiple_of(side), "{file}: {} patches per side do not pool evenly to {side} tokens per side", c.grid());
        ensure!(c.eps > 0.0 && c.eps.is_finite(), "{file}: vision layer_norm_eps {} must be positive", c.eps);
        Ok(())
    }
}

/// A LayerNorm's weight and bias.
struct LayerNorm<D: Device> {
    w: D::Tensor,
    b: D::Tensor,
}

struct Layer<D: Device> {
    norm1: LayerNorm<D>,
    wq: D::Weight,
    wk: D::Weight,
    wv: D::Weight,
    bq: D::Tensor,
    bk: D::Tensor,
    bv: D::Tensor,
    wo: D::Weight,
    bo: D::Tensor,
    norm2: LayerNorm<D>,
    fc1: D::Weight,
    b1: D::Tensor,
    fc2: D::Weight,
    b2: D::Tensor,
}

/// Buffers and the one-layer KV pool an encoding uses (one image at a
/// time: the lane thread encodes them in turn).
struct Work<D: Device> {
    kv: D::Kv,
    blocks: Vec<u32>,
    x: D::Tensor,
    h: D::Tensor,
    c: D::Tensor,
    q: D::Tensor,
    k: D::Tensor,
    v: D::Tensor,
    att: D::Tensor,
    out: D::Tensor,
    /// The rows a step runs, gathered from `x`.
    xr: D::Tensor,
    /// The final norm's rows, for the pooling.
    post: D::Tensor,
    /// Rows of `ones`, as many as a step runs.
    unit: D::Tensor,
    up: D::Tensor,
    ones: D::Tensor,
    act: D::Tensor,
    pooled: D::Tensor,
    part: D::Tensor,
}

pub struct Gemma3Vision<D: Device> {
    pub cfg: VisionConfig,
    /// The patch convolution as a matrix over each patch's pixels in
    /// (channel, row, column) order.
    patch_w: D::Weight,
    patch_b: D::Tensor,
    positions: D::Weight,
    layers: Vec<Layer<D>>,
    post_norm: LayerNorm<D>,
    /// `I - 1/n`: rows times it lose their mean.
    centre: D::Weight,
    proj_norm: D::Tensor,
    /// `[text_hidden, hidden]` (the checkpoint stores its transpose).
    proj: D::Weight,
    work: Mutex<Work<D>>,
}

/// A weight made on the host (`[rows, cols]`, f32).
fn host_weight<D: Device>(dev: &D, name: &str, data: Vec<f32>, rows: usize, cols: usize) -> Result<D::Weight> {
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    dev.weight(&TensorView { name: name.to_string(), dtype: DType::F32, shape: vec![rows, cols], data: Bytes::from_vec(bytes) })
}

impl<D: MoeOps> Gemma3Vision<D> {
    /// The vision path of the HF folder, or `None` for a text-only model.
    pub fn load(dev: &D, src: &Source) -> Result<Option<Gemma3Vision<D>>> {
        let Some(cfg) = VisionConfig::from_source(src)? else { return Ok(None) };
        let Source::Hf(h) = src else { return Ok(None) };
        // transformers 5 saves `vision_tower.*`; Hub checkpoints nest it in `vision_model`.
        let root = if h.has_tensor("vision_tower.vision_model.post_layernorm.weight") { "vision_tower.vision_model." } else { "vision_tower." };
        let t = |n: &str| h.tensor(&format!("{root}{n}"));
        let w = |n: &str| dev.weight(&t(n)?);
        let v = |n: &str| dev.vector(&t(n)?, 0.0);
        let ln = |n: &str| -> Result<LayerNorm<D>> { Ok(LayerNorm { w: v(&format!("{n}.weight"))?, b: v(&format!("{n}.bias"))? }) };
        let (hd, p, ch) = (cfg.hidden, cfg.patch, cfg.channels);

        let conv = t("embeddings.patch_embedding.weight")?;
        ensure!(conv.shape == [hd, ch, p, p], "{}: `{}` has shape {:?}, expected [{hd}, {ch}, {p}, {p}]", h.dir().display(), conv.name, conv.shape);
        let patch_w = dev.weight(&TensorView { shape: vec![hd, ch * p * p], ..conv })?;
        let positions = w("embeddings.position_embedding.weight")?;
        let n = cfg.grid() * cfg.grid();
        ensure!(dev.weight_shape(&positions) == (n, hd), "{}: the position embedding is not [{n}, {hd}]", h.dir().display());
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let l = |n: &str| format!("encoder.layers.{i}.{n}");
            layers.push(Layer {
                norm1: ln(&l("layer_norm1"))?,
                wq: w(&l("self_attn.q_proj.weight"))?,
                wk: w(&l("self_attn.k_proj.weight"))?,
                wv: w(&l("self_attn.v_proj.weight"))?,
                bq: v(&l("self_attn.q_proj.bias"))?,
                bk: v(&l("self_attn.k_proj.bias"))?,
                bv: v(&l("self_attn.v_proj.bias"))?,
                wo: w(&l("self_attn.out_proj.weight"))?,
                bo: v(&l("self_attn.out_proj.bias"))?,
                norm2: ln(&l("layer_norm2"))?,
                fc1: w(&l("mlp.fc1.weight"))?,
                b1: v(&l("mlp.fc1.bias"))?,
                fc2: w(&l("mlp.fc2.weight"))?,
                b2: v(&l("mlp.fc2.bias"))?,
            });
        }
        let post_norm = ln("post_layernorm")?;
        let centre: Vec<f32> = (0..hd * hd).map(|i| if i / hd == i % hd { 1.0 } else { 0.0 } - 1.0 / hd as f32).collect();
        let centre = host_weight(dev, "vision centring", centre, hd, hd)?;
        // Gemma's RMSNorm scales by 1 + w.
        let proj_norm = dev.vector(&h.tensor("multi_modal_projector.mm_soft_emb_norm.weight")?, 1.0)?;
        let pw = h.tensor("multi_modal_projector.mm_input_projection_weight")?;
        let th = cfg.text_hidden;
        ensure!(pw.shape == [hd, th], "{}: `{}` has shape {:?}, expected [{hd}, {th}]", h.dir().display(), pw.name, pw.shape);
        let stored = pw.to_f32()?;
        let transposed: Vec<f32> = (0..th * hd).map(|i| stored[(i % hd) * th + i / hd]).collect();
        let proj = host_weight(dev, &pw.name, transposed, th, hd)?;

        // One layer of KV at a time, in blocks of 16 patches.
        let bt = 16;
        let blocks = n.div_ceil(bt);
        let spec = KvPoolSpec { blocks, block_tokens: bt, layers: vec![KvShape { kv_heads: cfg.heads, head_dim: hd / cfg.heads }] };
        let t0 = || dev.tensor(0, 0);
        let work = Work {
            // f32 where the device stores it (the CPU: the tower keeps to
            // transformers' f32); CUDA's pools store bf16 only.
            kv: dev.kv_pool(&spec, KvDtype::F32).or_else(|_| dev.kv_pool(&spec, KvDtype::F16))?,
            blocks: (0..blocks as u32).collect(),
            x: t0(),
            h: t0(),
            c: t0(),
            q: t0(),
            k: t0(),
            v: t0(),
            att: t0(),
            out: t0(),
            xr: t0(),
            post: t0(),
            unit: t0(),
            up: t0(),
            ones: dev.upload(&vec![1.0; n * cfg.ffn], n, cfg.ffn)?,
            act: t0(),
            pooled: t0(),
            part: t0(),
        };
        Ok(Some(Gemma3Vision {
            patch_w,
            patch_b: v("embeddings.patch_embedding.bias")?,
            positions,
            layers,
            post_norm,
            centre,
            proj_norm,
            proj,
            cfg,
            work: Mutex::new(work),
        }))
    }

    /// Pixels in (channel, row, column) order, as many as the model takes.
    pub fn pixels_len(&self) -> usize {
        self.cfg.channels * self.cfg.image_size * self.cfg.image_size
    }

    /// Where an encoding ends: [`Gemma3Vision::encode_step`]'s cursor runs
    /// from 0 to this (a row of each stage, then the pooling).
    fn encode_end(&self) -> usize {
        Stage::count(self.cfg.layers) * self.patches() + 1
    }

    fn patches(&self) -> usize {
        self.cfg.grid() * self.cfg.grid()
    }

    /// The multiply-adds of one row of `stage` (what a step's budget
    /// counts; attention's part, over every patch, included).
    fn row_work(&self, stage: Stage) -> u64 {
        let c = &self.cfg;
        let (hd, n) = (c.hidden as u64, self.patches() as u64);
        let norm = hd * hd; // the centring matrix
        match stage {
            Stage::Embed => hd * (c.channels * c.patch * c.patch) as u64,
            Stage::Keys(_) => norm + 2 * hd * hd,
            Stage::Attn(_) => norm + 2 * hd * hd + 2 * n * hd,
            Stage::Mlp(_) => norm + 2 * hd * c.ffn as u64,
            Stage::Post => norm,
        }
    }

    /// A step of making an image's soft-token rows (`[tokens,
    /// text_hidden]`, plus one zero row last: placing rows adds a gather of
    /// it where there is no image) from its preprocessed pixels
    /// (`[channels, side, side]`), from `*at` (0 for a new image), which it
    /// moves on. The work is cut in rows: the patch embedding, then per
    /// encoder layer its keys (norm, k and v: the rows' keys and values
    /// written), once every patch's are its attention (the norm again, q,
    /// attention over all keys, output projection), then its MLP, then
    /// the final norm: each a pass over the patches, any range of rows at
    /// a time, since all but attention is row by row.
    /// A step runs rows until about `budget` multiply-adds are done (at
    /// least one row; `None`: to the end of the stage it starts in), never
    /// past its stage's end; the pooling and projection, once every row
    /// is made, are a step of their own: `Some(rows)`. A server runs steps between
    /// rounds, sized to fit its decoding streams' rounds. Steps run in
    /// order, one image at a time (the hidden rows stay in the tower's
    /// work buffers between them); results do not depend on the cuts.
    pub fn encode_step(&self, dev: &D, pixels: &[f32], at: &mut usize, budget: Option<u64>) -> Result<VisionStep<D::Tensor>> {
        let c = &self.cfg;
        if pixels.len() != self.pixels_len() {
            bail!("an image of {} values; this model takes {} ({}x{}x{})", pixels.len(), self.pixels_len(), c.channels, c.image_size, c.image_size);
        }
        let n = self.patches();
        ensure!(*at < self.encode_end(), "an image's encoding past its end ({} of {})", *at, self.encode_end());
        let mut guard = self.work.lock().unwrap_or_else(|e| e.into_inner());
        let w = &mut *guard;
        let mut work = 0u64;
        while *at < self.encode_end() - 1 {
            let stage = Stage::nth(*at / n, c.layers);
            let (a, per_row) = (*at % n, self.row_work(stage));
            let left = (n - a) as u64;
            let rows = match budget {
                None => left,
                Some(b) if work == 0 => (b / per_row.max(1)).clamp(1, left),
                Some(b) => (b.saturating_sub(work) / per_row.max(1)).min(left),
            } as usize;
            if rows == 0 {
                break;
            }
            self.run_rows(dev, w, pixels, stage, a..a + rows)?;
            work += per_row * rows as u64;
            *at += rows;
            // A step ends with its stage (at least): the next may cost otherwise.
            if budget.is_none() || budget.is_some_and(|b| work >= b) || at.is_multiple_of(n) {
                break;
            }
        }
        if *at + 1 < self.encode_end() || work > 0 {
            let next = if *at + 1 == self.encode_end() { POOL_KIND } else { Stage::nth(*at / n, c.layers).kind() };
            return Ok(VisionStep { rows: None, work, next });
        }
        *at += 1;
        let work = (c.tokens + 1) as u64 * (c.hidden * c.text_hidden) as u64;
        Ok(VisionStep { rows: Some(self.pool_and_project(dev, w)), work, next: Stage::Embed.kind() })
    }

    /// Rows `rows` of `stage`.
    fn run_rows(&self, dev: &D, w: &mut Work<D>, pixels: &[f32], stage: Stage, rows: std::ops::Range<usize>) -> Result<()> {
        let c = &self.cfg;
        let (g, p, hd) = (c.grid(), c.patch, c.hidden);
        let ids: Vec<usize> = rows.clone().collect();
        let ones = vec![1.0; ids.len()];
        let targets: Vec<u32> = rows.clone().map(|r| r as u32).collect();
        match stage {
            Stage::Embed => {
                // The patches, each row one patch's pixels as the convolution reads them.
                if rows.start == 0 {
                    w.x = dev.upload(&vec![0.0; g * g * hd], g * g, hd)?;
                }
                let side = c.image_size;
                let mut patches = Vec::with_capacity(ids.len() * c.channels * p * p);
                for (py, px) in ids.iter().map(|&i| (i / g, i % g)) {
                    for ch in 0..c.channels {
                        for ky in 0..p {
                            let row = (ch * side + py * p + ky) * side + px * p;
                            patches.extend_from_slice(&pixels[row..row + p]);
                        }
                    }
                }
                let patches = dev.upload(&patches, ids.len(), c.channels * p * p)?;
                dev.matmul(&patches, &[&self.patch_w], &mut [&mut w.out]);
                dev.add(&mut w.out, &self.patch_b);
                let pos: Vec<u32> = targets.clone();
                dev.embed(&self.positions, &pos, 1.0, &mut w.h);
                dev.add(&mut w.out, &w.h);
                dev.scatter_add_rows(&mut w.x, &w.out, &targets, &ones)?;
            }
            Stage::Keys(l) => {
                let l = &self.layers[l];
                dev.gather_rows(&w.x, &ids, &mut w.xr);
                self.layer_norm(dev, &w.xr, &l.norm1, &mut w.c, &mut w.h);
                dev.matmul(&w.h, &[&l.wk, &l.wv], &mut [&mut w.k, &mut w.v]);
                dev.add(&mut w.k, &l.bk);
                dev.add(&mut w.v, &l.bv);
                dev.kv_write(&mut w.kv, 0, &w.k, &w.v, &targets);
            }
            Stage::Attn(l) => {
                let l = &self.layers[l];
                let head_dim = hd / c.heads;
                let scale = (head_dim as f32).powf(-0.5);
                dev.gather_rows(&w.x, &ids, &mut w.xr);
                // The rows' queries (their norm again: the keys' stage kept none).
                self.layer_norm(dev, &w.xr, &l.norm1, &mut w.c, &mut w.h);
                dev.matmul(&w.h, &[&l.wq], &mut [&mut w.q]);
                dev.add(&mut w.q, &l.bq);
                // Every patch a query of its own that sees all n keys: bidirectional attention.
                let seqs: Vec<AttnSeq<'_>> = (0..ids.len()).map(|i| AttnSeq { q_start: i, q_len: 1, kv_len: g * g, blocks: &w.blocks, window: None }).collect();
                dev.attention(&w.q, &w.kv, 0, &seqs, scale, None, &mut w.att);
                dev.matmul(&w.att, &[&l.wo], &mut [&mut w.out]);
                dev.add(&mut w.out, &l.bo);
                dev.scatter_add_rows(&mut w.x, &w.out, &targets, &ones)?;
            }
            Stage::Mlp(l) => {
                let l = &self.layers[l];
                // fc2(gelu_tanh(fc1(x))), the GELU as a gated op over ones.
                dev.gather_rows(&w.x, &ids, &mut w.xr);
                self.layer_norm(dev, &w.xr, &l.norm2, &mut w.c, &mut w.h);
                dev.matmul(&w.h, &[&l.fc1], &mut [&mut w.up]);
                dev.add(&mut w.up, &l.b1);
                dev.gather_rows(&w.ones, &ids, &mut w.unit);
                dev.gated(Act::GeluTanh, &w.up, &w.unit, &mut w.act);
                dev.matmul(&w.act, &[&l.fc2], &mut [&mut w.out]);
                dev.add(&mut w.out, &l.b2);
                dev.scatter_add_rows(&mut w.x, &w.out, &targets, &ones)?;
            }
            Stage::Post => {
                if rows.start == 0 {
                    w.post = dev.upload(&vec![0.0; g * g * hd], g * g, hd)?;
                }
                dev.gather_rows(&w.x, &ids, &mut w.xr);
                self.layer_norm(dev, &w.xr, &self.post_norm, &mut w.c, &mut w.h);
                dev.scatter_add_rows(&mut w.post, &w.h, &targets, &ones)?;
            }
        }
        Ok(())
    }

    /// The image's rows from the final norm's: average pooling, the projector.
    fn pool_and_project(&self, dev: &D, w: &mut Work<D>) -> D::Tensor {
        let c = &self.cfg;
        let g = c.grid();
        // Average pooling: the k x k patches of each soft token summed, then scaled.
        let t = (c.tokens as f64).sqrt() as usize;
        let k = g / t;
        for (dy, dx) in (0..k).flat_map(|y| (0..k).map(move |x| (y, x))) {
            // One more row, zeroed below: the trailing zero row.
            let rows: Vec<usize> = (0..t * t).map(|o| (o / t * k + dy) * g + o % t * k + dx).chain([0]).collect();
            if dy == 0 && dx == 0 {
                dev.gather_rows(&w.post, &rows, &mut w.pooled);
            } else {
                dev.gather_rows(&w.post, &rows, &mut w.part);
                dev.add(&mut w.pooled, &w.part);
            }
        }
        dev.map(&mut w.pooled, Map::Scale(1.0 / (k * k) as f32));
        dev.zero_rows(&mut w.pooled, &[c.tokens as u32]);
        // The projector: a Gemma RMSNorm (a zero row stays zero), then into the text width.
        dev.rms_norm(&w.pooled, &self.proj_norm, c.eps, &mut w.part);
        let mut out = dev.tensor(c.tokens + 1, c.text_hidden);
        dev.matmul(&w.part, &[&self.proj], &mut [&mut out]);
        out
    }

    /// `out = LayerNorm(x)`: the RMSNorm of `x` less each row's mean (`c`).
    fn layer_norm(&self, dev: &D, x: &D::Tensor, n: &LayerNorm<D>, c: &mut D::Tensor, out: &mut D::Tensor) {
        dev.matmul(x, &[&self.centre], &mut [c]);
        dev.rms_norm(c, &n.w, self.cfg.eps, out);
        dev.add(out, &n.b);
    }
}

/// A step of [`Gemma3Vision::encode_step`]: the image's rows from its
/// last, the multiply-adds it did, and the kind of the step after it (one
/// of a few; steps of one kind cost alike per multiply-add).
pub struct VisionStep<T> {
    pub rows: Option<T>,
    pub work: u64,
    pub next: u32,
}

/// The kind of the last step, the pooling and projection.
const POOL_KIND: u32 = 5;

/// The passes over an image's patches, in order.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stage {
    /// Patches into the tower's width, plus their positions.
    Embed,
    /// Encoder layer `l`'s keys and values.
    Keys(usize),
    /// Layer `l`'s attention and output projection, once every patch's
    /// keys are made.
    Attn(usize),
    /// Layer `l`'s MLP.
    Mlp(usize),
    /// The final LayerNorm.
    Post,
}

impl Stage {
    fn count(layers: usize) -> usize {
        3 * layers + 2
    }

    /// The `i`th stage of a tower of `layers` layers.
    fn nth(i: usize, layers: usize) -> Stage {
        match i {
            0 => Stage::Embed,
            i if i <= 3 * layers => [Stage::Keys((i - 1) / 3), Stage::Attn((i - 1) / 3), Stage::Mlp((i - 1) / 3)][(i - 1) % 3],
            _ => Stage::Post,
        }
    }

    /// The stage's kind (the pooling after [`Stage::Post`] is [`POOL_KIND`]).
    fn kind(self) -> u32 {
        match self {
            Stage::Embed => 0,
            Stage::Keys(_) => 1,
            Stage::Attn(_) => 2,
            Stage::Mlp(_) => 3,
            Stage::Post => 4,
        }
    }
}
