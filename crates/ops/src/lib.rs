//! Device ops: the few kernels LLM inference needs, behind one trait.
//!
//! Models are written once against [`Device`]; each device (the CPU here,
//! CUDA behind a feature) implements the ops for its own tensor and weight
//! types. The engine never sees any of this.

use anyhow::Result;
use braid_formats::TensorView;

pub mod cpu;

/// Rotary position embedding settings for one attention layer kind.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f32,
    /// Dimensions rotated (the head dim unless partial rotary).
    pub dims: usize,
    /// NEOX style rotates (i, i + dims/2) pairs; the other style rotates
    /// adjacent (2i, 2i+1) pairs (llama GGUFs, whose q/k rows are permuted).
    pub neox: bool,
    /// Linear position scaling (1.0 = none).
    pub scale: f32,
}

/// Shape of one layer's attention KV, as stored in the paged pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Geometry of a paged KV pool: `blocks` blocks of `block_tokens` token
/// slots, one [`KvShape`] per attention layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPoolSpec {
    pub blocks: usize,
    pub block_tokens: usize,
    pub layers: Vec<KvShape>,
}

/// One sequence's part of a batched attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<'a> {
    /// First row of this sequence in the batch's q / out.
    pub q_start: usize,
    /// Rows of this sequence in the batch (its newest positions).
    pub q_len: usize,
    /// KV rows the sequence holds, this batch's rows included; row i of the
    /// sequence sits at position `kv_len - q_len + i`.
    pub kv_len: usize,
    /// The sequence's block table: block ids in position order.
    pub blocks: &'a [u32],
    /// Sliding window: a query at p sees keys in (p - window, p].
    pub window: Option<usize>,
}

/// Everything a model needs from a device.
///
/// Tensors are 2-D, row-major `[rows, cols]`: one row per token in a
/// batch. Weights are 2-D `[out, in]`; `matmul` computes `x · Wᵀ`.
pub trait Device: Send + Sync + 'static {
    type Tensor: Send + Sync;
    type Weight: Send + Sync;
    type Kv: Send + Sync;

    fn name(&self) -> String;

    // ---- memory ----
    /// A tensor of the given shape (contents unspecified).
    fn tensor(&self, rows: usize, cols: usize) -> Self::Tensor;
    /// Reshape in place, reusing memory when it suffices.
    fn resize(&self, t: &mut Self::Tensor, rows: usize, cols: usize);
    fn shape(&self, t: &Self::Tensor) -> (usize, usize);
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor>;
    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    /// A 2-D weight `[out, in]` as the file stores it.
    fn weight(&self, view: &TensorView) -> Result<Self::Weight>;
    fn weight_shape(&self, w: &Self::Weight) -> (usize, usize);
    /// A 1-D parameter (norm weight, bias) as one row, in f32 precision.
    /// `offset` is added to every element (Gemma's norms scale by 1 + w).
    fn vector(&self, view: &TensorView, offset: f32) -> Result<Self::Tensor>;
    fn kv_pool(&self, spec: &KvPoolSpec) -> Result<Self::Kv>;

    // ---- ops ----
    /// `out[i] = table[ids[i]] * scale`.
    fn embed(&self, table: &Self::Weight, ids: &[u32], scale: f32, out: &mut Self::Tensor);
    /// `out = x · wᵀ` (out is resized to `[x.rows, w.out]`).
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight, out: &mut Self::Tensor);
    /// Copy the given rows of `x` into `out` (resized).
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize], out: &mut Self::Tensor);
    /// RMSNorm over groups of `w.cols` elements of each row (a whole row, or
    /// each head when `w` is one head wide).
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f32, out: &mut Self::Tensor);
    /// `x += y`.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor);
    /// `out = silu(gate) * up`.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor, out: &mut Self::Tensor);
    /// `out = gelu_tanh(gate) * up`.
    fn gelu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor, out: &mut Self::Tensor);
    /// Rotate every head of `x` (`heads × head_dim` wide) at `positions`.
    fn rope(&self, x: &mut Self::Tensor, positions: &[u32], head_dim: usize, rope: &Rope);
    /// Store each row's k and v at the pool slot `slots[i]`
    /// (`block * block_tokens + offset`).
    fn kv_write(&self, kv: &mut Self::Kv, layer: usize, k: &Self::Tensor, v: &Self::Tensor, slots: &[u32]);
    /// Copy whole KV blocks (all layers) from `src[i]` to `dst[i]`.
    fn kv_copy_blocks(&self, kv: &mut Self::Kv, src: &[u32], dst: &[u32]);
    /// Causal attention of q rows over each sequence's paged KV; `q` is
    /// `heads × head_dim` wide, `out` likewise.
    fn attention(&self, q: &Self::Tensor, kv: &Self::Kv, layer: usize, seqs: &[AttnSeq<'_>], scale: f32, softcap: Option<f32>, out: &mut Self::Tensor);
    /// `x *= s` elementwise (final logit scaling and the like).
    fn scale(&self, x: &mut Self::Tensor, s: f32);
    /// `x = cap * tanh(x / cap)`.
    fn softcap(&self, x: &mut Self::Tensor, cap: f32);

    // ---- per-stream recurrent state (conv, SSM, linear attention) ----
    // Such state lives in one tensor of `[slots, elems]`: a row per stream
    // (and per kept mark). Models index it by the slot of each sequence.
    /// Copy whole rows `src[i]` to `dst[i]` (marks: snapshot and restore).
    fn copy_rows(&self, t: &mut Self::Tensor, src: &[u32], dst: &[u32]);
    /// Set the given rows to zero (a fresh stream's state).
    fn zero_rows(&self, t: &mut Self::Tensor, rows: &[u32]);

    // ---- ops some models need; a device without them says so ----
    /// RoPE from an explicit frequency table: in every head of `x`, the pair
    /// `(i, i + inv_freq.len())` turns by `position * inv_freq[i]` (NeoX
    /// pairing); dimensions past `2 * inv_freq.len()` pass unchanged. For
    /// variants [`Device::rope`] cannot express, such as Gemma 4's
    /// "proportional" RoPE (zero frequencies past the rotated part).
    fn rope_freqs(&self, x: &mut Self::Tensor, positions: &[u32], head_dim: usize, inv_freq: &[f32]) -> Result<()> {
        let _ = (x, positions, head_dim, inv_freq);
        anyhow::bail!("rope_freqs is not implemented on {}", self.name())
    }
    /// `out[rows[i]] += weights[i] * y[i]` for each row `i` of `y`, in order
    /// (a mixture of experts adding one expert's outputs to its tokens).
    fn scatter_add_rows(&self, out: &mut Self::Tensor, y: &Self::Tensor, rows: &[u32], weights: &[f32]) -> Result<()> {
        let _ = (out, y, rows, weights);
        anyhow::bail!("scatter_add_rows is not implemented on {}", self.name())
    }
}
