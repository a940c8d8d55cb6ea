//! Model architectures, each written once against [`braid_ops::Device`],
//! and [`ModelBackend`], which serves any of them to the engine.

pub mod backend;
pub mod blocks;
pub mod config;
pub mod dflash;
pub mod gemma3;
pub mod gemma4;
#[cfg(feature = "cuda")]
pub mod gpubench;
pub mod granite;
pub mod lfm2;
pub mod llama;
pub mod mamba2;
pub mod minimax;
pub mod minimax_m2;
pub mod moe;
pub mod nemotron_h;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_next;
pub mod random;
pub mod recurrent;
pub mod siglip;
pub mod source;

use std::path::Path;

use anyhow::{bail, Result};
use braid_ops::{AllOps, AttnSeq, Device, KvShape, Map};

pub use backend::{device_draw, BackendConfig, ModelBackend, REPLAY_CHUNK_ROWS};
pub use siglip::Mmproj;
pub use source::Source;

/// What one layer keeps per stream, so the backend knows what a mark must
/// hold and whether a stream can be rewound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerState {
    /// Attention KV over the whole context.
    Kv,
    /// Attention KV of which only the last `window` positions are read.
    SlidingKv { window: usize },
    /// A short-convolution tail (LFM2, Mamba2's conv): fixed size, cannot be rewound.
    Conv,
    /// A selective-scan state (Mamba2): fixed size, cannot be rewound.
    Ssm,
    /// A linear-attention state matrix: fixed size, cannot be rewound.
    LinearAttention,
    /// A gated DeltaNet's conv tail and state matrices: fixed size, cannot be rewound.
    DeltaNet,
    /// No per-stream state (an MLP-only layer).
    None,
}

impl LayerState {
    /// Whether the state can be cut back to an earlier position.
    pub fn rewindable(&self) -> bool {
        matches!(self, LayerState::Kv | LayerState::SlidingKv { .. } | LayerState::None)
    }
}

/// A stream's memory on the device: the paged KV pool, and a row of fixed
/// state per stream slot (and per kept mark) for recurrent layers.
pub struct Memory<D: Device> {
    pub kv: D::Kv,
    /// `[slots, Model::state_size()]`.
    pub state: D::Tensor,
}

/// One forward's rows, flattened across sequences.
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    /// Position of each row in its sequence.
    pub positions: &'a [u32],
    /// KV pool slot each row's k/v is written to.
    pub slots: &'a [u32],
    pub seqs: Vec<AttnSeq<'a>>,
    /// The same over the window group's blocks (layers in
    /// [`Model::kv_groups`]' group 1: sliding-window layers, which keep only
    /// their window): where a window layer writes its rows' k/v and which
    /// blocks it attends over. Empty for a model without window layers;
    /// `slots` and `seqs` themselves where the backend keeps full KV in
    /// every layer.
    pub window_slots: &'a [u32],
    pub window_seqs: Vec<AttnSeq<'a>>,
    /// Rows whose logits the caller wants, in order.
    pub logit_rows: &'a [usize],
    /// Each sequence's row in `Memory::state`.
    pub state_slots: &'a [u32],
    /// Rows that are an image's rows, not token embeddings.
    pub images: Vec<ImageAt>,
}

/// Image rows in a forward: batch rows `row .. row + len` are rows
/// `offset ..` of the image rows `Scratch::images[tensor]`. The image ends
/// in this forward (a chunk never ends inside an image): its last row is
/// batch row `row + len - 1`; `offset > 0` when its first rows are cached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ImageAt {
    pub row: usize,
    pub len: usize,
    pub offset: usize,
    pub tensor: usize,
}

impl<'a> Batch<'a> {
    /// One row, token 0 at position 0 in slot 0 and state row 0, over the
    /// KV blocks `blocks` (of both groups): the forward a device sees once before serving
    /// (`Device::prepare`), on memory no stream holds yet.
    pub fn warm_up(blocks: &'a [u32]) -> Batch<'a> {
        Batch {
            tokens: &[0],
            positions: &[0],
            slots: &[0],
            seqs: vec![AttnSeq { q_start: 0, q_len: 1, kv_len: 1, blocks, window: None }],
            window_slots: &[0],
            window_seqs: vec![AttnSeq { q_start: 0, q_len: 1, kv_len: 1, blocks, window: None }],
            logit_rows: &[0],
            state_slots: &[0],
            images: Vec::new(),
        }
    }

    /// A hash of everything a forward reads from the batch but its token
    /// ids' values: two batches with equal keys run the same ops on the
    /// same memory (`Forward::key`).
    pub fn key(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (self.tokens.len(), self.positions, self.slots, self.window_slots, self.logit_rows, self.state_slots).hash(&mut h);
        for s in self.seqs.iter().chain(&self.window_seqs) {
            (s.q_start, s.q_len, s.kv_len, s.blocks, s.window).hash(&mut h);
        }
        self.images.hash(&mut h);
        h.finish()
    }
}

/// Activation buffers reused across forwards (no allocation per token once
/// they have grown to the largest batch). Each keeps one meaning in every
/// family.
pub struct Scratch<D: Device> {
    /// The residual stream.
    pub x: D::Tensor,
    /// A sublayer's normed input.
    pub h: D::Tensor,
    /// Attention's queries, keys and values (after their norms and RoPE).
    pub q: D::Tensor,
    pub k: D::Tensor,
    pub v: D::Tensor,
    /// q and k as projected, before a per-head norm (families with q/k norms).
    pub q_raw: D::Tensor,
    pub k_raw: D::Tensor,
    /// Attention's output, before its output projection.
    pub att: D::Tensor,
    /// A sublayer's output, added to the residual stream.
    pub out: D::Tensor,
    /// A sublayer's output after its post-norm (Gemma's sandwich norms).
    pub post: D::Tensor,
    /// The MLP's gate and up projections and their gated product.
    pub gate: D::Tensor,
    pub up: D::Tensor,
    pub act: D::Tensor,
    /// The rows whose logits are wanted, gathered from `x`.
    pub last: D::Tensor,
    /// Output: one row per `Batch::logit_rows` entry.
    pub logits: D::Tensor,
    /// More buffers for models that need them (created on first use).
    pub extra: Vec<D::Tensor>,
    /// Feature taps: the layers whose output rows a drafter reads, in the
    /// drafter's order, and each one's copy of the residual stream after
    /// that layer (every row of the forward). Empty: nothing is tapped.
    pub taps: Vec<usize>,
    pub tapped: Vec<D::Tensor>,
    /// The image rows a forward's `Batch::images` name (each an image's
    /// rows and a zero row last, as `Model::encode_image` makes them),
    /// lent by the backend for the forward.
    pub images: Vec<D::Tensor>,
}

impl<D: Device> Scratch<D> {
    pub fn new(dev: &D) -> Scratch<D> {
        let t = || dev.tensor(0, 0);
        Scratch {
            x: t(),
            h: t(),
            q: t(),
            k: t(),
            v: t(),
            q_raw: t(),
            k_raw: t(),
            att: t(),
            out: t(),
            post: t(),
            gate: t(),
            up: t(),
            act: t(),
            last: t(),
            logits: t(),
            extra: Vec::new(),
            taps: Vec::new(),
            tapped: Vec::new(),
            images: Vec::new(),
        }
    }

    /// Layer `layer` has written its output to `x`: copy it to the taps
    /// that name it. Every family calls this after each layer, so a drafter
    /// can read any of them; with no taps it costs nothing.
    pub fn tap(&mut self, dev: &D, layer: usize) {
        tap_rows(dev, &self.taps, &self.x, &mut self.tapped, layer);
    }

    /// The extra buffer `i`, made when first asked for.
    pub fn extra(&mut self, dev: &D, i: usize) -> &mut D::Tensor {
        while self.extra.len() <= i {
            self.extra.push(dev.tensor(0, 0));
        }
        &mut self.extra[i]
    }
}

/// [`Scratch::tap`] over the fields it reads, for a forward that holds
/// other parts of its scratch borrowed.
pub fn tap_rows<D: Device>(dev: &D, taps: &[usize], x: &D::Tensor, tapped: &mut Vec<D::Tensor>, layer: usize) {
    if !taps.contains(&layer) {
        return;
    }
    let rows: Vec<usize> = (0..dev.shape(x).0).collect();
    while tapped.len() < taps.len() {
        tapped.push(dev.tensor(0, 0));
    }
    for (i, _) in taps.iter().enumerate().filter(|&(_, &t)| t == layer) {
        dev.gather_rows(x, &rows, &mut tapped[i]);
    }
}

/// The language-model head, as every family ends: the rows whose logits are
/// wanted (`s.x` → `s.last`), the final RMSNorm (→ `s.h`), the output
/// matrix (→ `s.logits`), then an optional softcap.
pub fn lm_head<D: Device>(dev: &D, s: &mut Scratch<D>, logit_rows: &[usize], norm: &D::Tensor, eps: f32, head: &D::Weight, softcap: Option<f32>) {
    dev.gather_rows(&s.x, logit_rows, &mut s.last);
    dev.rms_norm(&s.last, norm, eps, &mut s.h);
    dev.matmul(&s.h, &[head], &mut [&mut s.logits]);
    if let Some(cap) = softcap {
        dev.map(&mut s.logits, Map::Softcap(cap));
    }
}

/// Put the batch's image rows in place of those rows' embeddings in `s.x`
/// (the rows zeroed, then each image's rows added, gathered with its zero
/// row everywhere else).
pub fn place_images<D: Device>(dev: &D, s: &mut Scratch<D>, images: &[ImageAt]) {
    if images.is_empty() {
        return;
    }
    let rows = dev.shape(&s.x).0;
    let image_rows: Vec<u32> = images.iter().flat_map(|m| (m.row..m.row + m.len).map(|r| r as u32)).collect();
    dev.zero_rows(&mut s.x, &image_rows);
    for m in images {
        let zero = dev.shape(&s.images[m.tensor]).0 - 1;
        let from: Vec<usize> = (0..rows).map(|r| if (m.row..m.row + m.len).contains(&r) { m.offset + r - m.row } else { zero }).collect();
        dev.gather_rows(&s.images[m.tensor], &from, &mut s.post);
        dev.add(&mut s.x, &s.post);
    }
}

/// The attention sequences of a batch whose images attend to themselves
/// both ways (Gemma 3): an image's every row becomes a query of its own
/// that sees the whole image, and a sliding window is widened by the rows
/// to the image's end, so it still starts `window` keys before the row.
/// Text rows stay causal. Without images: `seqs` as they are.
pub fn image_seqs<'a>(seqs: &[AttnSeq<'a>], images: &[ImageAt]) -> Vec<AttnSeq<'a>> {
    if images.is_empty() {
        return seqs.to_vec();
    }
    let mut out = Vec::new();
    for q in seqs {
        let pos = |r: usize| q.kv_len - q.q_len + (r - q.q_start);
        let end = q.q_start + q.q_len;
        let mut r = q.q_start;
        while r < end {
            if let Some(m) = images.iter().find(|m| (m.row..m.row + m.len).contains(&r)) {
                let last = pos(m.row + m.len - 1);
                out.push(AttnSeq { q_start: r, q_len: 1, kv_len: last + 1, window: q.window.map(|w| w + (last - pos(r))), ..*q });
                r += 1;
            } else {
                let text_end = images.iter().filter(|m| m.row > r).map(|m| m.row).min().unwrap_or(end).min(end);
                out.push(AttnSeq { q_start: r, q_len: text_end - r, kv_len: pos(text_end - 1) + 1, ..*q });
                r = text_end;
            }
        }
    }
    out
}

/// What every architecture offers the backend.
pub trait Model<D: Device>: Send + Sync {
    /// One entry per attention layer: the shape its KV needs.
    fn kv_layers(&self) -> Vec<KvShape>;
    /// The group of each `kv_layers` entry: 0 for a layer that attends
    /// over the whole context, 1 for a sliding-window layer, which reads
    /// `Batch::window_slots` and `Batch::window_seqs` (so the backend can
    /// keep only its window). Every layer in group 0 unless a family says.
    fn kv_groups(&self) -> Vec<usize> {
        vec![0; self.kv_layers().len()]
    }
    /// What each layer keeps per stream.
    fn layer_states(&self) -> Vec<LayerState>;
    /// f32 elements of fixed (non-KV) state per stream, all layers together.
    fn state_size(&self) -> usize {
        0
    }
    fn vocab(&self) -> usize;
    /// The context length the model was trained for.
    fn context(&self) -> usize;
    /// Run the batch; leaves logits for `batch.logit_rows` in `s.logits`.
    fn forward(&self, dev: &D, batch: &Batch<'_>, mem: &mut Memory<D>, s: &mut Scratch<D>) -> Result<()>;
    /// Bit-identical results under any chunking of a prompt.
    fn chunk_invariant(&self) -> bool {
        true
    }
    /// The images the model takes, if it takes any.
    fn vision(&self) -> Option<&siglip::VisionConfig> {
        None
    }
    /// One image's rows from its preprocessed pixels: `vision().tokens`
    /// rows, `hidden` wide, and a zero row last (see [`place_images`]).
    fn encode_image(&self, dev: &D, pixels: &[f32]) -> Result<D::Tensor> {
        let mut at = 0;
        loop {
            if let Some(rows) = self.encode_image_step(dev, pixels, &mut at, None)?.rows {
                return Ok(rows);
            }
        }
    }
    /// A step of [`Model::encode_image`] from `*at` (0 for a new image;
    /// steps run in order, one image at a time), which it moves on: about
    /// `budget` multiply-adds of the vision tower (at least a row of it;
    /// `None`: one pass of it over the patches), `Some(rows)` from the
    /// last, with the multiply-adds done and the next step's kind. A
    /// server runs them between rounds, sized by time; the rows do not
    /// depend on the steps.
    fn encode_image_step(&self, _dev: &D, _pixels: &[f32], _at: &mut usize, _budget: Option<u64>) -> Result<siglip::VisionStep<D::Tensor>> {
        bail!("this model takes no images")
    }
}

/// Load the model at `path` (a GGUF file or an HF folder) on `dev`.
pub fn load<D: AllOps>(dev: &D, src: &Source, progress: &dyn Fn(usize, usize)) -> Result<Box<dyn Model<D>>> {
    load_with(dev, src, None, progress)
}

/// Whether a model of `arch` (GGUF's `general.architecture` or the HF
/// `model_type`) takes its vision tower from an mmproj file.
pub fn takes_mmproj(arch: &str) -> bool {
    matches!(arch, "gemma3" | "gemma3_text")
}

/// [`load`], with the vision tower and projector of `mmproj` (llama.cpp's
/// mmproj GGUF) where given.
pub fn load_with<D: AllOps>(dev: &D, src: &Source, mmproj: Option<&Mmproj>, progress: &dyn Fn(usize, usize)) -> Result<Box<dyn Model<D>>> {
    config::check_tensors(src)?;
    let arch = src.architecture()?;
    if let Some(m) = mmproj.filter(|_| !takes_mmproj(&arch)) {
        bail!(
            "{}: an mmproj ({}) was given, but architecture '{arch}' takes no images (braid reads an mmproj for Gemma 3 only)",
            src.path().display(),
            m.path().display()
        );
    }
    match arch.as_str() {
        "llama" => Ok(Box::new(llama::Llama::load(dev, src, progress)?)),
        "gemma3" | "gemma3_text" => Ok(Box::new(gemma3::Gemma3::load_with(dev, src, mmproj, progress)?)),
        "qwen2" => Ok(Box::new(qwen2::load(dev, src, progress)?)),
        "qwen3" => Ok(Box::new(qwen3::load(dev, src, progress)?)),
        "gemma4_text" => Ok(Box::new(gemma4::Gemma4::load(dev, src, progress)?)),
        "lfm2" | "lfm2_moe" | "lfm2moe" => Ok(Box::new(lfm2::Lfm2::load(dev, src, progress)?)),
        "nemotron_h" | "nemotron_h_moe" => Ok(Box::new(nemotron_h::NemotronH::load(dev, src, progress)?)),
        "minimax" => Ok(Box::new(minimax::MiniMax::load(dev, src, progress)?)),
        "minimax_m2" | "minimax-m2" | "minimax_m3_vl_text" => Ok(Box::new(minimax_m2::MiniMaxM2::load(dev, src, progress)?)),
        "granitemoehybrid" | "granitehybrid" => Ok(Box::new(granite::GraniteHybrid::load(dev, src, progress)?)),
        "qwen3_next" | "qwen3next" => Ok(Box::new(qwen3_next::Qwen3Next::load(dev, src, progress)?)),
        other => bail!(
            "{}: architecture '{other}' is not supported yet (supported: llama, qwen2, qwen3, gemma3, gemma3_text, gemma4_text, lfm2, lfm2_moe, nemotron_h, minimax, minimax_m2, minimax_m3_vl_text, granitemoehybrid, qwen3_next)",
            src.path().display()
        ),
    }
}

/// Open a model file or folder and load it (convenience for tools/tests).
pub fn open<D: AllOps>(dev: &D, path: &Path) -> Result<(Source, Box<dyn Model<D>>)> {
    open_with(dev, path, None)
}

/// [`open`], with the vision tower of the mmproj file `mmproj` where given.
pub fn open_with<D: AllOps>(dev: &D, path: &Path, mmproj: Option<&Path>) -> Result<(Source, Box<dyn Model<D>>)> {
    let src = Source::open(path)?;
    let mmproj = mmproj.map(Mmproj::open).transpose()?;
    let m = load_with(dev, &src, mmproj.as_ref(), &|_, _| {})?;
    Ok((src, m))
}
