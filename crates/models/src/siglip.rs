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

use std::path::Path;
use std::sync::Mutex;

use anyhow::{bail, ensure, Context, Result};
use braid_formats::gguf::Gguf;
use braid_formats::safetensors::HfFolder;
use braid_formats::{Bytes, DType, TensorView};
use braid_ops::{Act, AttnSeq, Device, KvDtype, KvPoolSpec, KvShape, Map, MoeOps};

use crate::config::HfConfig;
use crate::source::Source;

/// An mmproj GGUF: llama.cpp's file of a model's vision tower and
/// projector (`convert_hf_to_gguf.py --mmproj`), given beside the text
/// model's GGUF (`--mmproj`).
pub struct Mmproj {
    gguf: Gguf,
}

impl Mmproj {
    /// Open `path`, refusing a GGUF that is not an mmproj with a vision encoder.
    pub fn open(path: &Path) -> Result<Mmproj> {
        let gguf = Gguf::open(path).with_context(|| format!("the mmproj {}", path.display()))?;
        let arch = gguf.architecture().unwrap_or("none");
        ensure!(arch == "clip", "{}: not an mmproj file (its general.architecture is '{arch}', an mmproj's is 'clip')", path.display());
        ensure!(gguf.opt_bool("clip.has_vision_encoder")?.unwrap_or(false), "{}: this mmproj has no vision encoder", path.display());
        Ok(Mmproj { gguf })
    }

    pub fn path(&self) -> &Path {
        self.gguf.path()
    }

    /// `clip.projector_type` (`gemma3` for Gemma 3's).
    pub fn projector(&self) -> &str {
        self.gguf.opt_str("clip.projector_type").ok().flatten().unwrap_or("none")
    }

    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }
}

/// The vision tower's and projector's sizes, from `vision_config` and the
/// top level of a `Gemma3ForConditionalGeneration` config, or from an mmproj.
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
    /// The prompt's image placeholder, begin- and end-of-image tokens
    /// (an mmproj names none: they are the text model's, found in its
    /// vocabulary where it has one).
    pub image_token: Option<u32>,
    pub boi_token: Option<u32>,
    pub eoi_token: Option<u32>,
    /// The pixels' normalisation where the weights' file states it (an
    /// mmproj's `clip.vision.image_mean/std`); an HF folder's is in its
    /// `preprocessor_config.json`.
    pub image_mean: Option<[f32; 3]>,
    pub image_std: Option<[f32; 3]>,
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
            image_token: Some(token("image_token_index")?.or(token("image_token_id")?).context("config.json: no image_token_index")?),
            boi_token: token("boi_token_index")?,
            eoi_token: token("eoi_token_index")?,
            image_mean: None,
            image_std: None,
        };
        cfg.check(&h.dir().join("config.json").display().to_string())?;
        Ok(Some(cfg))
    }

    /// The vision config of an mmproj, for the text model `text` (whose
    /// vocabulary, if it has one, names the image tokens).
    pub fn from_mmproj(m: &Mmproj, text: &Source) -> Result<VisionConfig> {
        let g = &m.gguf;
        let file = m.path().display().to_string();
        ensure!(m.projector() == "gemma3", "{file}: the mmproj's projector is '{}'; braid reads Gemma 3's ('gemma3') only", m.projector());
        let key = |k: &str| -> Result<usize> { g.get_usize(&format!("clip.vision.{k}")) };
        let (image_size, patch) = (key("image_size")?, key("patch_size")?);
        // Patches per side pooled by this factor (llama.cpp's default 4, as
        // the released Gemma 3 towers: 64 patches a side to 16).
        let merge = g.opt_u64("clip.vision.projector.scale_factor")?.unwrap_or(4) as usize;
        ensure!(merge > 0, "{file}: clip.vision.projector.scale_factor is 0");
        let side = image_size / patch.max(1) / merge;
        let channels = g.tensor_info("v.patch_embd.weight").and_then(|t| t.shape.get(1).copied()).unwrap_or(3);
        let triple = |k: &str| -> Result<Option<[f32; 3]>> {
            match g.get(k) {
                None => Ok(None),
                Some(_) => {
                    let v = g.get_f32_array(k)?;
                    ensure!(v.len() == 3, "{file}: {k} has {} values, expected 3", v.len());
                    Ok(Some([v[0], v[1], v[2]]))
                }
            }
        };
        let vocab = match text {
            Source::Gguf(t) if t.get("tokenizer.ggml.tokens").is_some() => t.get_str_array("tokenizer.ggml.tokens")?,
            _ => Vec::new(),
        };
        let token = |text: &str| vocab.iter().position(|&t| t == text).map(|i| i as u32);
        let cfg = VisionConfig {
            hidden: key("embedding_length")?,
            layers: key("block_count")?,
            heads: key("attention.head_count")?,
            ffn: key("feed_forward_length")?,
            channels,
            image_size,
            patch,
            eps: g.opt_f32("clip.vision.attention.layer_norm_epsilon")?.unwrap_or(1e-6),
            tokens: side * side,
            text_hidden: key("projection_dim")?,
            // Gemma 3's tokenizer's names for them.
            image_token: token("<image_soft_token>"),
            boi_token: token("<start_of_image>"),
            eoi_token: token("<end_of_image>"),
            image_mean: triple("clip.vision.image_mean")?,
            image_std: triple("clip.vision.image_std")?,
        };
        cfg.check(&file)?;
        Ok(cfg)
    }

    fn check(&self, file: &str) -> Result<()> {
        let c = self;
        ensure!(c.hidden > 0 && c.layers > 0 && c.heads > 0 && c.ffn > 0 && c.channels > 0, "{file}: the vision tower's sizes must be positive");
        ensure!(c.hidden.is_multiple_of(c.heads), "{file}: vision hidden size {} is not a multiple of its {} heads", c.hidden, c.heads);
        ensure!(
            c.patch > 0 && c.image_size.is_multiple_of(c.patch) && c.image_size > 0,
            "{file}: image size {} is not a multiple of patch size {}",
            c.image_size,
            c.patch
        );
        let side = (c.tokens as f64).sqrt() as usize;
        ensure!(side > 0 && side * side == c.tokens, "{file}: {} tokens per image is not a positive square", c.tokens);
        ensure!(c.grid().is_multiple_of(side), "{file}: {} patches per side do not pool evenly to {side} tokens per side", c.grid());
        ensure!(c.eps > 0.0 && c.eps.is_finite(), "{file}: vision layer norm eps {} must be positive", c.eps);
        Ok(())
    }
}

/// Where the tower's tensors come from: an HF folder (under `root`) or an
/// mmproj, asked for by their HF names.
enum Weights<'a> {
    Hf { h: &'a HfFolder, root: &'static str },
    Mmproj(&'a Mmproj),
}

impl Weights<'_> {
    /// A tower tensor by its HF name under the tower (`encoder.layers.0.mlp.fc1.weight`).
    fn tower(&self, n: &str) -> Result<TensorView> {
        match self {
            Weights::Hf { h, root } => h.tensor(&format!("{root}{n}")),
            Weights::Mmproj(m) => m.gguf.tensor(&mmproj_name(n)),
        }
    }

    /// A projector tensor by its HF name (`multi_modal_projector.*`).
    fn projector(&self, n: &str) -> Result<TensorView> {
        match self {
            Weights::Hf { h, .. } => h.tensor(n),
            Weights::Mmproj(m) => m.gguf.tensor(&mmproj_name(n)),
        }
    }

    /// Added to the projector's norm weight: HF stores Gemma's `1 + w` as
    /// `w`; the mmproj converter folded the 1 in (the tower's LayerNorms
    /// are stored alike in both).
    fn proj_norm_offset(&self) -> f32 {
        match self {
            Weights::Hf { .. } => 1.0,
            Weights::Mmproj(_) => 0.0,
        }
    }

    fn origin(&self) -> String {
        match self {
            Weights::Hf { h, .. } => h.dir().display().to_string(),
            Weights::Mmproj(m) => m.path().display().to_string(),
        }
    }
}

/// The mmproj name of a vision tensor's HF name (llama.cpp's
/// `gguf-py` tensor map for `MODEL_ARCH.MMPROJ`: `v.*`, `mm.*`); a name it
/// does not know is kept, so the file's error names it.
fn mmproj_name(hf: &str) -> String {
    const TOP: [(&str, &str); 5] = [
        ("embeddings.patch_embedding.", "v.patch_embd."),
        ("embeddings.position_embedding.", "v.position_embd."),
        ("post_layernorm.", "v.post_ln."),
        ("multi_modal_projector.mm_soft_emb_norm.", "mm.soft_emb_norm."),
        ("multi_modal_projector.mm_input_projection_weight", "mm.input_projection.weight"),
    ];
    const LAYER: [(&str, &str); 8] = [
        ("layer_norm1.", "ln1."),
        ("layer_norm2.", "ln2."),
        ("self_attn.q_proj.", "attn_q."),
        ("self_attn.k_proj.", "attn_k."),
        ("self_attn.v_proj.", "attn_v."),
        ("self_attn.out_proj.", "attn_out."),
        ("mlp.fc1.", "ffn_up."),
        ("mlp.fc2.", "ffn_down."),
    ];
    let swap = |table: &[(&str, &str)], n: &str| table.iter().find_map(|(h, g)| n.strip_prefix(h).map(|rest| format!("{g}{rest}")));
    if let Some(n) = swap(&TOP, hf) {
        return n;
    }
    if let Some((i, rest)) = hf.strip_prefix("encoder.layers.").and_then(|r| r.split_once('.')) {
        if let Some(n) = swap(&LAYER, rest) {
            return format!("v.blk.{i}.{n}");
        }
    }
    hf.to_string()
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
    /// The vision path: the mmproj's where one is given, else the HF
    /// folder's; `None` for a text-only model. Its rows must be
    /// `text_hidden` wide (the text model's width).
    pub fn load(dev: &D, src: &Source, mmproj: Option<&Mmproj>, text_hidden: usize) -> Result<Option<Gemma3Vision<D>>> {
        let (cfg, t) = match (mmproj, src) {
            (Some(m), _) => {
                if let Source::Hf(h) = src {
                    ensure!(
                        VisionConfig::from_source(src)?.is_none(),
                        "{} has a vision tower of its own; the mmproj {} would replace it (give one or the other)",
                        h.dir().display(),
                        m.path().display()
                    );
                }
                (VisionConfig::from_mmproj(m, src)?, Weights::Mmproj(m))
            }
            (None, Source::Hf(h)) => {
                let Some(cfg) = VisionConfig::from_source(src)? else { return Ok(None) };
                // transformers 5 saves `vision_tower.*`; Hub checkpoints nest it in `vision_model`.
                let root = if h.has_tensor("vision_tower.vision_model.post_layernorm.weight") { "vision_tower.vision_model." } else { "vision_tower." };
                (cfg, Weights::Hf { h, root })
            }
            (None, Source::Gguf(_)) => return Ok(None),
        };
        let origin = t.origin();
        // Before any tensor: a tower made for another text model is named as such.
        ensure!(
            cfg.text_hidden == text_hidden,
            "{origin}: the projector's width {} is not the text model's {} ({}): the vision tower is another model's",
            cfg.text_hidden,
            text_hidden,
            src.path().display()
        );
        let w = |n: &str| dev.weight(&t.tower(n)?);
        let v = |n: &str| dev.vector(&t.tower(n)?, 0.0);
        let ln = |n: &str| -> Result<LayerNorm<D>> { Ok(LayerNorm { w: v(&format!("{n}.weight"))?, b: v(&format!("{n}.bias"))? }) };
        let (hd, p, ch) = (cfg.hidden, cfg.patch, cfg.channels);

        let conv = t.tower("embeddings.patch_embedding.weight")?;
        ensure!(conv.shape == [hd, ch, p, p], "{origin}: `{}` has shape {:?}, expected [{hd}, {ch}, {p}, {p}]", conv.name, conv.shape);
        let patch_w = dev.weight(&TensorView { shape: vec![hd, ch * p * p], ..conv })?;
        let positions = w("embeddings.position_embedding.weight")?;
        let n = cfg.grid() * cfg.grid();
        ensure!(dev.weight_shape(&positions) == (n, hd), "{origin}: the position embedding is not [{n}, {hd}]");
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
        let proj_norm = dev.vector(&t.projector("multi_modal_projector.mm_soft_emb_norm.weight")?, t.proj_norm_offset())?;
        // Stored (in, out) in both files: the converter keeps the HF tensor as it is.
        let pw = t.projector("multi_modal_projector.mm_input_projection_weight")?;
        let th = cfg.text_hidden;
        ensure!(pw.shape == [hd, th], "{origin}: `{}` has shape {:?}, expected [{hd}, {th}]", pw.name, pw.shape);
        let stored = pw.to_f32()?;
        let transposed: Vec<f32> = (0..th * hd).map(|i| stored[(i % hd) * th + i / hd]).collect();
        let proj = host_weight(dev, &pw.name, transposed, th, hd)?;

        // One layer of KV at a time, in blocks of 16 patches.
        let bt = 16;
        let blocks = n.div_ceil(bt);
        let spec = KvPoolSpec::new(blocks, bt, vec![KvShape { kv_heads: cfg.heads, head_dim: hd / cfg.heads }]);
        let t0 = || dev.tensor(0, 0);
        let work = Work {
            // f32 where the device stores it (the CPU: the tower keeps to
            // transformers' f32); CUDA's pools store bf16 only.
            kv: dev.kv_pool(&spec, KvDtype::F32).or_else(|_| dev.kv_pool(&spec, KvDtype::F16))?,
            blocks: (0..blocks as u32).collect(),
            x: dev.tensor(n, cfg.hidden),
            h: t0(),
            c: t0(),
            q: t0(),
            k: t0(),
            v: t0(),
            att: t0(),
            out: t0(),
            xr: t0(),
            post: dev.tensor(n, cfg.hidden),
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
                // The patches, each row one patch's pixels as the convolution
                // reads them. `x` is made once, with the tower: its rows are
                // zeroed as their step comes (a whole new `x` per image cost
                // 16-18 ms in the image's first step, beside the streams
                // decoding).
                dev.zero_rows(&mut w.x, &targets);
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
                dev.zero_rows(&mut w.post, &targets);
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
