//! Device ops: the few kernels LLM inference needs, behind one small trait.
//!
//! Models are written once against [`Device`]: memory, about a dozen
//! primitive ops, picking tokens where the logits are, and running a
//! forward. Ops only some families need live in extension traits
//! ([`RecurrentOps`], [`MoeOps`], [`SparseAttentionOps`]), so a model that
//! needs them says so in its bounds. Fusions are the device's business: the
//! CUDA device records a forward's primitive ops and matches fusable
//! sequences in them (`cuda/fuse.rs`), so every family gets every fusion.
//! The engine never sees any of this.

use std::sync::Arc;

use anyhow::{ensure, Result};
use braid_formats::TensorView;

mod checks;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

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
    /// An explicit frequency table, for variants `theta` cannot express
    /// (Gemma 4's "proportional" RoPE): in every head the pair
    /// `(i, i + freqs.len())` turns by `position * freqs[i]` (NeoX pairing)
    /// and dimensions past `2 * freqs.len()` pass unchanged; `theta`,
    /// `dims`, `neox` and `scale` are then not used.
    pub freqs: Option<Arc<[f32]>>,
}

impl Rope {
    /// RoPE over `dims` dimensions with base `theta`, unscaled.
    pub fn new(theta: f32, dims: usize, neox: bool) -> Rope {
        Rope { theta, dims, neox, scale: 1.0, freqs: None }
    }

    /// RoPE from an explicit frequency table (see [`Rope::freqs`]).
    pub fn table(freqs: Vec<f32>) -> Rope {
        let dims = 2 * freqs.len();
        Rope { theta: 0.0, dims, neox: true, scale: 1.0, freqs: Some(freqs.into()) }
    }
}

/// Shape of one layer's attention KV, as stored in the paged pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Geometry of a paged KV pool: one [`KvShape`] per attention layer, and
/// the layers in groups (vLLM's KV-cache groups), each group with block
/// ids of its own: a layer's buffers hold its group's count of blocks of
/// `block_tokens` token slots. Sliding-window layers that keep only their
/// window form a group of fewer blocks than the layers that keep all rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPoolSpec {
    pub block_tokens: usize,
    pub layers: Vec<KvShape>,
    /// The group of each layer (as many as `layers`).
    pub layer_groups: Vec<usize>,
    /// How many blocks each group holds.
    pub group_blocks: Vec<usize>,
}

impl KvPoolSpec {
    /// One group: every layer holds `blocks` blocks.
    pub fn new(blocks: usize, block_tokens: usize, layers: Vec<KvShape>) -> KvPoolSpec {
        KvPoolSpec { block_tokens, layer_groups: vec![0; layers.len()], layers, group_blocks: vec![blocks] }
    }

    /// Blocks of layer `layer`'s group.
    pub fn layer_blocks(&self, layer: usize) -> usize {
        self.group_blocks[self.layer_groups[layer]]
    }

    /// The layers of group `group`, in pool order.
    pub fn group_layers(&self, group: usize) -> impl Iterator<Item = usize> + '_ {
        self.layer_groups.iter().enumerate().filter(move |&(_, &g)| g == group).map(|(l, _)| l)
    }

    /// Every layer names a group and every group a block count.
    pub fn check(&self) -> Result<()> {
        anyhow::ensure!(self.layer_groups.len() == self.layers.len(), "KV pool: {} layer groups for {} layers", self.layer_groups.len(), self.layers.len());
        if let Some(g) = self.layer_groups.iter().find(|&&g| g >= self.group_blocks.len()) {
            anyhow::bail!("KV pool: a layer in group {g} of {}", self.group_blocks.len());
        }
        Ok(())
    }
}

/// One sequence's rows in a recurrent op (short conv, SSM scan, linear
/// attention): rows `start .. start + len` of the batch, in time order,
/// continuing the state held in row `slot` of the state tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateSeq {
    pub start: usize,
    pub len: usize,
    pub slot: u32,
}

/// Shape and limits of a Mamba2 selective scan ([`RecurrentOps::ssm_scan`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SsmShape {
    pub heads: usize,
    pub head_dim: usize,
    /// N: the state size per head and channel.
    pub state_dim: usize,
    /// B and C are shared by `heads / groups` heads.
    pub groups: usize,
    /// `dt` is clamped to `[dt_min, dt_max]` after the softplus.
    pub dt_min: f32,
    pub dt_max: f32,
}

/// Shape of a gated delta rule ([`RecurrentOps::gated_delta_rule`]): value
/// heads of `value_dim` over key heads of `key_dim`, each key head read by
/// `value_heads / key_heads` value heads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaShape {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    /// The epsilon of q's and k's L2 norms, inside the square root.
    pub l2_eps: f32,
    /// Multiplies q after its norm (`1/√key_dim` in Gated DeltaNet).
    pub scale: f32,
}

impl DeltaShape {
    /// q and k of every key head, then v of every value head: the width
    /// of the op's input.
    pub fn qkv_width(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// Block selection of a block-sparse attention layer (MiniMax-M3): an
/// indexer scores key blocks per query and each query attends only to the
/// chosen blocks ([`SparseAttentionOps::block_sparse_attention`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSparse {
    /// Positions per key block.
    pub block: usize,
    /// The query's own block and the `local - 1` before it are always kept.
    pub local: usize,
    /// Blocks kept per query and indexer head, the local ones included.
    pub topk: usize,
    pub index_heads: usize,
    pub index_dim: usize,
}

impl BlockSparse {
    /// The checks every device makes of a [`SparseAttentionOps::block_sparse_attention`]
    /// call, whatever its own limits: the layers, the shapes of `q`
    /// (`[rows, cols]`) and `iq`, and the sequences. Returns the attended
    /// layer's KV shape, the query heads and the query rows.
    pub fn check_call(
        &self,
        q: (usize, usize),
        iq: (usize, usize),
        spec: &KvPoolSpec,
        layer: usize,
        index_layer: usize,
        seqs: &[AttnSeq<'_>],
    ) -> Result<(KvShape, usize, usize)> {
        use anyhow::ensure;
        let n_layers = spec.layers.len();
        ensure!(layer < n_layers && index_layer < n_layers, "block_sparse_attention: KV layers {layer} / {index_layer} of {n_layers}");
        let (shape, ishape) = (spec.layers[layer], spec.layers[index_layer]);
        let (hd, idim, ih) = (shape.head_dim, self.index_dim, self.index_heads);
        ensure!(
            ishape.kv_heads == 1 && ishape.head_dim == idim,
            "block_sparse_attention: index layer holds {}x{}, expected 1x{idim}",
            ishape.kv_heads,
            ishape.head_dim
        );
        ensure!(hd > 0 && q.1.is_multiple_of(hd), "block_sparse_attention: q rows of {} in heads of {hd}", q.1);
        let heads = q.1 / hd;
        ensure!(shape.kv_heads > 0 && heads.is_multiple_of(shape.kv_heads), "block_sparse_attention: {heads} heads over {} kv heads", shape.kv_heads);
        ensure!(ih > 0 && heads.is_multiple_of(ih), "block_sparse_attention: {heads} heads over {ih} indexer heads");
        ensure!(iq.1 == ih * idim && iq.0 == q.0, "block_sparse_attention: iq is {}x{}, expected {}x{}", iq.0, iq.1, q.0, ih * idim);
        ensure!(self.block > 0 && self.topk > 0, "block_sparse_attention: blocks of {} positions, {} kept", self.block, self.topk);
        let rows: usize = seqs.iter().map(|s| s.q_len).sum();
        ensure!(rows == q.0, "block_sparse_attention: sequences cover {rows} rows of {}", q.0);
        let bt = spec.block_tokens;
        for s in seqs {
            ensure!(
                s.q_len <= s.kv_len && s.kv_len <= s.blocks.len() * bt,
                "block_sparse_attention: sequence of {} rows over {} keys in {} blocks",
                s.q_len,
                s.kv_len,
                s.blocks.len()
            );
            ensure!(s.q_start + s.q_len <= q.0, "block_sparse_attention: sequence rows past the batch");
            let blocks = spec.layer_blocks(layer).min(spec.layer_blocks(index_layer));
            ensure!(s.blocks.iter().all(|&b| (b as usize) < blocks), "block_sparse_attention: block past the pool's {blocks}");
        }
        Ok((shape, heads, rows))
    }
}

/// The activation of a gated product ([`Device::gated`]):
/// `out = act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Act {
    /// `gate * up`.
    Identity,
    /// `silu(gate) * up` (Llama, Qwen).
    Silu,
    /// `gelu_tanh(gate) * up` (Gemma).
    GeluTanh,
    /// `sigmoid(gate) * up` (an output gate).
    Sigmoid,
    /// MiniMax-M3's clamped SwiGLU: `g = min(gate, limit)`,
    /// `u = clamp(up, -limit, limit)`, `out = (u + 1) · g · sigmoid(alpha · g)`.
    SwiGluClamped { limit: f32, alpha: f32 },
}

/// An elementwise op in place ([`Device::map`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Map {
    /// `x *= s`.
    Scale(f32),
    /// `x = cap * tanh(x / cap)`.
    Softcap(f32),
    /// `x = silu(x)`.
    Silu,
    /// `x = relu(x)²` (Nemotron-H's MLP activation).
    Relu2,
}

/// A change [`Device::pick`] makes to one value before it picks (a
/// sampler's penalties): llama.cpp's repetition penalty first (a positive
/// value divided by `repeat`, any other multiplied; 1: none), then `sub`
/// subtracted (OpenAI's presence and frequency penalties). Laid out as the
/// CUDA kernel reads it.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct Penalty {
    pub row: u32,
    pub col: u32,
    pub repeat: f32,
    pub sub: f32,
}

impl Penalty {
    pub fn apply(&self, x: f32) -> f32 {
        let x = if self.repeat == 1.0 {
            x
        } else if x > 0.0 {
            x / self.repeat
        } else {
            x * self.repeat
        };
        x - self.sub
    }
}

/// What [`Device::pick`] finds in each row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowPick<'a> {
    /// The index of the row's largest value (the first on ties; NaN never wins).
    Argmax,
    /// [`RowPick::Argmax`] among the columns each row allows: `cols.div_ceil(32)`
    /// words a row, bit `c % 32` of word `c / 32` for column `c` (a guided
    /// stream's mask; an unguided row's words are all ones). A row that
    /// allows nothing comes back as 0.
    ArgmaxAllowed(&'a [u32]),
    /// The `k` largest values with their columns, largest first, the lower
    /// column first on ties, NaN counting (and coming back) as -inf.
    TopK(usize),
    /// [`RowPick::TopK`] of the rows with every column a row does not
    /// allow counting (and coming back) as -inf: bits as
    /// [`RowPick::ArgmaxAllowed`] takes them. A guided stream sampling at
    /// a temperature among its top k gets the candidates the host would
    /// find in its masked row.
    TopKAllowed(usize, &'a [u32]),
    /// Each row's token drawn as its [`DrawRow`] says (one per row),
    /// within the columns the bits allow if any (as
    /// [`RowPick::ArgmaxAllowed`] takes them): see [`draw_host`].
    Draw(&'a [DrawRow], Option<&'a [u32]>),
}

/// How [`RowPick::Draw`] draws one row's token: at `temperature` (0: the
/// row's argmax, as [`RowPick::ArgmaxAllowed`] finds it), among its `top_k`
/// largest values (0: all), then the fewest largest that hold `top_p` of
/// what is left, then those at least `min_p` times as likely as the
/// largest; `u` in [0, 1) picks among them (see [`draw_host`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrawRow {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub u: f32,
}

/// What [`Device::pick`] found, one entry per row.
#[derive(Clone, Debug, PartialEq)]
pub enum RowPicked {
    Argmax(Vec<u32>),
    /// [`RowPick::Draw`]'s tokens.
    Drawn(Vec<u32>),
    TopK(Vec<Vec<(u32, f32)>>),
}

/// What a device declares about itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCaps {
    /// A row's result is bit-identical whatever else shares its batch (how
    /// many rows a matmul sees, how a prompt is chunked). The CPU kernels
    /// are written so; cuBLAS picks kernels by shape, so CUDA is not.
    pub batch_invariant: bool,
    /// [`RowPick::Argmax`] runs where the values are (greedy sampling there
    /// saves moving whole rows to the host).
    pub argmax: bool,
    /// The largest `k` of [`RowPick::TopK`] found where the values are (0:
    /// the rows are downloaded).
    pub top_k: usize,
    /// [`RowPick::Draw`] runs where the values are.
    pub draw: bool,
    /// [`Device::forward_ahead`] does something here.
    pub ahead: bool,
    /// Keyed forwards replay a recording (CUDA graphs): a shape that recurs
    /// costs less than one run afresh.
    pub replays: bool,
}

/// A forward as the device sees it: the rows' token ids and, when its
/// shape recurs (decode rounds), a key for recording and replaying it.
#[derive(Clone, Copy, Debug)]
pub struct Forward<'a> {
    /// A hash of everything the forward reads but its token ids' values:
    /// two forwards with equal keys run the same ops on the same memory.
    /// `None`: a shape that rarely recurs (a long prompt chunk).
    pub key: Option<u64>,
    pub tokens: &'a [u32],
}

/// How a KV pool stores its rows. F16 halves the memory; F32 keeps k and v
/// exactly as computed (an f32 model checked against its reference to 1e-4
/// needs it: f16 rounding of k/v alone moves logits by ~1e-3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvDtype {
    #[default]
    F16,
    F32,
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
/// batch. Weights are 2-D `[out, in]`; `matmul` computes `x · Wᵀ`. Ops
/// resize their outputs. Ops return nothing: a device that can fail inside
/// one keeps the error and returns it from the next call that returns a
/// `Result` (`download`, `pick`, `forward`).
pub trait Device: Send + Sync + 'static {
    type Tensor: Send + Sync;
    type Weight: Send + Sync;
    type Kv: Send + Sync;

    fn name(&self) -> String;
    fn caps(&self) -> DeviceCaps;

    // ---- memory ----
    /// Bytes the device can still allocate, where it has memory of its own
    /// (`None`: it shares the host's).
    fn memory_free(&self) -> Option<usize> {
        None
    }
    /// Why this device can run nothing more, once that is so (the CUDA
    /// device keeps its first error and refuses every op after it, as a
    /// faulted CUDA context would). `None`, the default: errors are the
    /// ops' own.
    fn lost(&self) -> Option<String> {
        None
    }
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
    /// A paged KV pool storing its rows as `dtype`.
    fn kv_pool(&self, spec: &KvPoolSpec, dtype: KvDtype) -> Result<Self::Kv>;

    // ---- ops ----
    /// `out[i] = table[ids[i]] * scale`.
    fn embed(&self, table: &Self::Weight, ids: &[u32], scale: f32, out: &mut Self::Tensor);
    /// `outs[i] = x · ws[i]ᵀ` for each weight: one input, several products
    /// (q, k and v; gate and up).
    fn matmul(&self, x: &Self::Tensor, ws: &[&Self::Weight], outs: &mut [&mut Self::Tensor]);
    /// Copy the given rows of `x` into `out`.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize], out: &mut Self::Tensor);
    /// RMSNorm over groups of `w.cols` elements of each row (a whole row, or
    /// each head when `w` is one head wide), times `w`.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f32, out: &mut Self::Tensor);
    /// `x += y`; a `y` of one row is added to every row of `x` (a bias).
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor);
    /// An elementwise op in place.
    fn map(&self, x: &mut Self::Tensor, f: Map);
    /// `out = act(gate) * up`, elementwise.
    fn gated(&self, act: Act, gate: &Self::Tensor, up: &Self::Tensor, out: &mut Self::Tensor);
    /// Rotate every head of `x` (`heads × head_dim` wide) at `positions`.
    fn rope(&self, x: &mut Self::Tensor, positions: &[u32], head_dim: usize, rope: &Rope);
    /// Store each row's k and v at the pool slot `slots[i]`
    /// (`block * block_tokens + offset`).
    fn kv_write(&self, kv: &mut Self::Kv, layer: usize, k: &Self::Tensor, v: &Self::Tensor, slots: &[u32]);
    /// Copy whole KV blocks of group `group` (every layer of that group;
    /// block ids are the group's own) from `src[i]` to `dst[i]`.
    fn kv_copy_blocks(&self, kv: &mut Self::Kv, group: usize, src: &[u32], dst: &[u32]);
    /// Causal attention of q rows over each sequence's paged KV; `q` is
    /// `heads × head_dim` wide, `out` likewise.
    #[allow(clippy::too_many_arguments)]
    fn attention(&self, q: &Self::Tensor, kv: &Self::Kv, layer: usize, seqs: &[AttnSeq<'_>], scale: f32, softcap: Option<f32>, out: &mut Self::Tensor);

    // ---- per-stream recurrent state (conv, SSM, linear attention) ----
    // Such state lives in one tensor of `[slots, elems]`: a row per stream
    // (and per kept mark). Models index it by the slot of each sequence.
    /// Copy whole rows `src[i]` to `dst[i]` (marks: snapshot and restore).
    fn copy_rows(&self, t: &mut Self::Tensor, src: &[u32], dst: &[u32]);
    /// Set the given rows to zero (a fresh stream's state).
    fn zero_rows(&self, t: &mut Self::Tensor, rows: &[u32]);

    // ---- sampling where the logits are ----
    /// Each row's argmax or top-k (see [`RowPick`]) after `penalties`
    /// change the values they name (a device may change them in place: the
    /// rows are then left penalised). The default downloads the rows;
    /// `DeviceCaps` says what a device finds where they are.
    /// `launch_ahead`: after an argmax, launch at once (with these tokens,
    /// on the device) the forward [`Device::forward_ahead`] prepared, so it
    /// runs while the caller handles them; [`Device::forward`] of it then
    /// finds it running. The picked tokens take its first token rows; any
    /// after them (a prompt chunk's) stay as prepared. Use it only where
    /// such a forward, when another comes instead, leaves nothing that
    /// matters (attention KV past each stream's length; no recurrent state).
    fn pick(&self, x: &Self::Tensor, pick: RowPick<'_>, penalties: &[Penalty], launch_ahead: bool) -> Result<RowPicked> {
        let _ = launch_ahead;
        let (rows, cols) = self.shape(x);
        let mut data = self.download(x)?;
        checks::penalties(penalties, rows, cols)?;
        for p in penalties {
            let v = &mut data[p.row as usize * cols + p.col as usize];
            *v = p.apply(*v);
        }
        Ok(match pick {
            RowPick::Argmax => RowPicked::Argmax((0..rows).map(|r| argmax_host(&data[r * cols..(r + 1) * cols])).collect()),
            RowPick::ArgmaxAllowed(bits) => {
                let words = checks::allowed_bits(bits, rows, cols)?;
                let row = |r: usize| argmax_allowed_host(&data[r * cols..(r + 1) * cols], &bits[r * words..(r + 1) * words]);
                RowPicked::Argmax((0..rows).map(row).collect())
            }
            RowPick::TopK(k) => RowPicked::TopK(top_k_host(&data, cols, k)),
            RowPick::TopKAllowed(k, bits) => RowPicked::TopK(top_k_allowed_host(data, cols, k, bits)?),
            RowPick::Draw(draws, bits) => {
                ensure!(draws.len() == rows, "{} draws for {rows} rows", draws.len());
                let words = bits.map(|b| checks::allowed_bits(b, rows, cols)).transpose()?.unwrap_or(0);
                let row = |r: usize| draw_host(&data[r * cols..(r + 1) * cols], &draws[r], bits.map(|b| &b[r * words..(r + 1) * words]));
                RowPicked::Drawn((0..rows).map(row).collect())
            }
        })
    }

    // ---- running a forward ----
    /// Run `run`, a forward made of this device's ops, the way that costs
    /// the least: the CUDA device records its ops, fuses what it can, and
    /// for a keyed forward records a graph it replays when the key comes
    /// back. The default runs it.
    fn forward(&self, fw: Forward<'_>, run: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = fw;
        run()
    }

    /// Do now, while the device still runs the last forward, the host work
    /// of `run`, the keyed forward expected next, so that [`Device::forward`]
    /// of it launches at once. A forward that never comes costs only that
    /// host work. The default does nothing.
    fn forward_ahead(&self, fw: Forward<'_>, run: &mut dyn FnMut() -> Result<()>) {
        let _ = (fw, run);
    }

    /// See one representative forward before serving (at load): a device
    /// may fold weights (a norm's scale into the products that alone read
    /// it) and build kernels. Weights do not change after. The default
    /// does nothing.
    fn prepare(&self, run: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = run;
        Ok(())
    }
}

/// Ops of the recurrent families (LFM2, Nemotron-H, MiniMax linear, Qwen3-Next).
pub trait RecurrentOps: Device {
    /// RMSNorm over each group of `group` elements of a row, times `w`,
    /// which is a whole row wide (Mamba2's gated norm over channel groups).
    fn group_rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, group: usize, eps: f32, out: &mut Self::Tensor) -> Result<()>;
    /// Depthwise causal convolution over time with a `kernel`-tap filter per
    /// channel, continuing each sequence from its state. `x` is `[rows, C]`;
    /// `weight` is one row of `C × kernel` (channel-major, as HF's conv1d
    /// `[C, 1, K]`); `bias` one row of `C`. The state row `seq.slot` holds, at
    /// `state_offset`, the last `kernel - 1` inputs of each channel (`[C,
    /// kernel - 1]`, oldest first, zeros for a fresh stream) and is updated.
    /// `out[t, c] = bias[c] + Σ_k weight[c, k] · x[t - kernel + 1 + k, c]`,
    /// then SiLU when `silu`.
    #[allow(clippy::too_many_arguments)]
    fn short_conv(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        kernel: usize,
        silu: bool,
        state: &mut Self::Tensor,
        state_offset: usize,
        seqs: &[StateSeq],
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// Mamba2 selective scan. `xbc` is `[rows, heads·head_dim + 2·groups·N]`
    /// holding x, B, C (after the conv); `dt` is `[rows, heads]` before the
    /// softplus; `dt_bias`, `a` (= -exp(A_log)) and `d` are one row of `heads`.
    /// Per head h (group g): `dt = clamp(softplus(dt + dt_bias))`,
    /// `S = exp(dt·a)·S + dt·x_hᵀB_g`, `y_h = S·C_g + d·x_h`. The state row
    /// holds `S` (`[heads, head_dim, N]`) at `state_offset`. `out` is
    /// `[rows, heads·head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn ssm_scan(
        &self,
        xbc: &Self::Tensor,
        dt: &Self::Tensor,
        dt_bias: &Self::Tensor,
        a: &Self::Tensor,
        d: &Self::Tensor,
        shape: &SsmShape,
        state: &mut Self::Tensor,
        state_offset: usize,
        seqs: &[StateSeq],
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// The gated delta rule (Gated DeltaNet, Qwen3-Next). `qkv` is `[rows,
    /// shape.qkv_width()]`: q of every key head, k of every key head, v of
    /// every value head. `a` and `b` are `[rows, value_heads]`; `dt_bias`
    /// and `decay` (= -exp(A_log)) one row of `value_heads`. Per value head
    /// h, reading key head `h / (value_heads / key_heads)`: q and k
    /// L2-normalised (`x / √(Σx² + l2_eps)`), q times `scale`;
    /// `g = decay·softplus(a + dt_bias)`, `β = sigmoid(b)`; `S = e^g·S`,
    /// `S += k ⊗ β(v − Sᵀk)`, `o = Sᵀq`. The state row holds `S`
    /// (`[value_heads, key_dim, value_dim]`) at `state_offset`. `out` is
    /// `[rows, value_heads·value_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &self,
        qkv: &Self::Tensor,
        a: &Self::Tensor,
        b: &Self::Tensor,
        dt_bias: &Self::Tensor,
        decay: &Self::Tensor,
        shape: &DeltaShape,
        state: &mut Self::Tensor,
        state_offset: usize,
        seqs: &[StateSeq],
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// Linear ("lightning") attention with a per-head decay: `qkv` is `[rows,
    /// heads·3·head_dim]`, each head's q, k, v side by side; `slopes` one row
    /// of `heads`. Per head: `S = exp(-slope)·S + kᵀv`, `o = q·S`. The state
    /// row holds `S` (`[heads, head_dim, head_dim]`) at `state_offset`.
    /// `out` is `[rows, heads·head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn linear_attention(
        &self,
        qkv: &Self::Tensor,
        slopes: &Self::Tensor,
        heads: usize,
        head_dim: usize,
        state: &mut Self::Tensor,
        state_offset: usize,
        seqs: &[StateSeq],
        out: &mut Self::Tensor,
    ) -> Result<()>;
}

/// Ops of the mixture-of-experts families.
pub trait MoeOps: Device {
    /// `out[rows[i]] += weights[i] * y[i]` for each row `i` of `y`, in order
    /// (one expert's outputs added to its tokens).
    fn scatter_add_rows(&self, out: &mut Self::Tensor, y: &Self::Tensor, rows: &[u32], weights: &[f32]) -> Result<()>;
}

/// Block-sparse attention (MiniMax-M3).
pub trait SparseAttentionOps: Device {
    /// Block-sparse causal attention. The indexer keys of every position sit
    /// in KV layer `index_layer` (as k, one head of `sel.index_dim`). For
    /// each query row and indexer head, blocks of `sel.block` positions are
    /// scored by the largest `iq · key` over their visible keys; the local
    /// blocks and the best others up to `sel.topk` are kept, and query head
    /// `h` (indexer head `h / (heads / index_heads)`) attends causally to
    /// the keys of its kept blocks only. `iq` is `[rows, index_heads·index_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn block_sparse_attention(
        &self,
        q: &Self::Tensor,
        iq: &Self::Tensor,
        kv: &Self::Kv,
        layer: usize,
        index_layer: usize,
        seqs: &[AttnSeq<'_>],
        scale: f32,
        sel: &BlockSparse,
        out: &mut Self::Tensor,
    ) -> Result<()>;
}

/// A device with every family's ops (both of braid's devices): what
/// loading any architecture asks for.
pub trait AllOps: Device + RecurrentOps + MoeOps + SparseAttentionOps {}
impl<D: Device + RecurrentOps + MoeOps + SparseAttentionOps> AllOps for D {}

/// The index of the row's largest value on the host (the first on ties;
/// NaN never wins).
pub fn argmax_host(row: &[f32]) -> u32 {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0 as u32
}

/// [`argmax_host`] among the columns whose bit is set in `bits` (see
/// [`RowPick::ArgmaxAllowed`]), NaN counting as -inf: the first allowed
/// column when none is larger; 0 when none is allowed.
pub fn argmax_allowed_host(row: &[f32], bits: &[u32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (w, chunk) in row.chunks(32).enumerate() {
        let word = bits.get(w).copied().unwrap_or(0);
        if word == 0 {
            continue;
        }
        for (i, &v) in chunk.iter().enumerate() {
            let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
            if word >> i & 1 == 1 && best.is_none_or(|b| v > b.1) {
                best = Some((w * 32 + i, v));
            }
        }
    }
    best.map_or(0, |b| b.0 as u32)
}

/// [`RowPick::Draw`] of one row on the host. A column's weight is
/// `exp((x - max) / temperature)` in f32 (0 where NaN or not allowed), so
/// the largest weighs 1. The kept columns are those whose weight is at
/// least a floor: the `top_k`-th largest weight, then the smallest weight
/// whose column and every larger one hold `top_p` of the mass above that,
/// then `min_p`; ties at a floor are kept. The token is the first kept
/// column, in column order, where the running mass passes `u` times the
/// kept mass (masses summed in f64 here; a device may sum in another
/// order, so a draw within rounding of a boundary may differ).
pub fn draw_host(row: &[f32], d: &DrawRow, bits: Option<&[u32]>) -> u32 {
    let all = vec![u32::MAX; row.len().div_ceil(32)];
    let bits = bits.unwrap_or(&all);
    let first = argmax_allowed_host(row, bits);
    let allowed = |c: usize| bits.get(c / 32).is_some_and(|w| w >> (c % 32) & 1 == 1);
    let max = if allowed(first as usize) { row.get(first as usize).copied().filter(|v| !v.is_nan()).unwrap_or(f32::NEG_INFINITY) } else { f32::NEG_INFINITY };
    if d.temperature <= 0.0 || max == f32::NEG_INFINITY {
        return first;
    }
    let inv_t = 1.0 / d.temperature;
    let w: Vec<f32> = row.iter().enumerate().map(|(c, &x)| if allowed(c) && !x.is_nan() { ((x - max) * inv_t).exp() } else { 0.0 }).collect();
    let mut sorted = w.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let mut floor = 0f32;
    let k = d.top_k as usize;
    if k > 0 && k < w.len() {
        floor = sorted[k - 1];
    }
    if d.top_p < 1.0 {
        let above: Vec<f32> = sorted.iter().copied().take_while(|&x| x >= floor).collect();
        let goal = d.top_p as f64 * above.iter().map(|&x| x as f64).sum::<f64>();
        let mut cum = 0.0;
        if let Some(&x) = above.iter().find(|&&x| {
            cum += x as f64;
            cum >= goal
        }) {
            floor = floor.max(x);
        }
    }
    if d.min_p > 0.0 {
        floor = floor.max(d.min_p);
    }
    let kept = |x: f32| x >= floor && x > 0.0;
    let target = d.u as f64 * w.iter().filter(|&&x| kept(x)).map(|&x| x as f64).sum::<f64>();
    let mut cum = 0.0;
    let mut last = first;
    for (c, &x) in w.iter().enumerate() {
        if kept(x) {
            cum += x as f64;
            last = c as u32;
            if cum > target {
                return last;
            }
        }
    }
    last
}

/// [`RowPick::TopKAllowed`] of rows of `cols` values on the host: the
/// disallowed columns set to -inf, then [`top_k_host`].
pub fn top_k_allowed_host(mut data: Vec<f32>, cols: usize, k: usize, bits: &[u32]) -> Result<Vec<Vec<(u32, f32)>>> {
    let rows = data.len() / cols.max(1);
    let words = checks::allowed_bits(bits, rows, cols)?;
    for (row, b) in data.chunks_mut(cols.max(1)).zip(bits.chunks(words.max(1))) {
        for (c, v) in row.iter_mut().enumerate() {
            if b[c / 32] >> (c % 32) & 1 == 0 {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    Ok(top_k_host(&data, cols, k))
}

/// [`RowPick::TopK`] of rows of `cols` values on the host.
pub fn top_k_host(data: &[f32], cols: usize, k: usize) -> Vec<Vec<(u32, f32)>> {
    data.chunks(cols.max(1))
        .map(|r| {
            let mut row: Vec<(u32, f32)> = r.iter().enumerate().map(|(i, &v)| (i as u32, if v.is_nan() { f32::NEG_INFINITY } else { v })).collect();
            row.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            row.truncate(k);
            row
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `draw_host` over evenly spread numbers lands on each token as often
    /// as the filtered, renormalised softmax says (computed here by
    /// sorting), under each filter; greedy and masked rows take the argmax.
    #[test]
    fn draws_follow_the_filtered_softmax() {
        // No ties: at a floor `draw_host` keeps every tie, which a sorted cut would not.
        let row: Vec<f32> = (0..40).map(|i| (i as f32 * 1.37).sin() * 3.0 + i as f32 * 1e-3).collect();
        let cases = [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 10, 0.9, 0.0), (1.0, 0, 1.0, 0.2), (2.0, 5, 1.0, 0.0), (1.0, 0, 0.3, 0.05)];
        for (t, k, p, min_p) in cases {
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut order: Vec<(usize, f64)> = row.iter().enumerate().map(|(i, &x)| (i, (((x - max) / t) as f64).exp())).collect();
            order.sort_by(|a, b| b.1.total_cmp(&a.1));
            if k > 0 {
                order.truncate(k);
            }
            let goal = p * order.iter().map(|o| o.1).sum::<f64>();
            let mut cum = 0.0;
            let keep = order.iter().position(|o| {
                cum += o.1;
                cum >= goal
            });
            order.truncate(keep.map_or(order.len(), |c| c + 1));
            order.retain(|o| o.1 >= min_p);
            let total: f64 = order.iter().map(|o| o.1).sum();
            let n = 20_000;
            let mut count = vec![0usize; row.len()];
            for j in 0..n {
                let d = DrawRow { temperature: t, top_k: k as u32, top_p: p as f32, min_p: min_p as f32, u: ((j as f64 + 0.5) / n as f64) as f32 };
                count[draw_host(&row, &d, None) as usize] += 1;
            }
            for (i, &c) in count.iter().enumerate() {
                let want = order.iter().find(|o| o.0 == i).map_or(0.0, |o| o.1 / total);
                assert!((c as f64 / n as f64 - want).abs() <= 2.0 / n as f64, "case {t} {k} {p} {min_p}: token {i} drawn {c} of {n}, want {want}");
            }
        }
        let greedy = DrawRow { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, u: 0.5 };
        assert_eq!(draw_host(&row, &greedy, None), argmax_host(&row));
        let bits = [1u32 << 7, 0];
        let d = DrawRow { temperature: 1.0, u: 0.9, ..greedy };
        assert_eq!(draw_host(&row, &d, Some(&bits)), 7, "the one column allowed");
    }

    /// Broken rows and edge numbers draw a token in the row, never panic:
    /// every value NaN or -inf (the first allowed column), nothing allowed
    /// (0), a number just below 1 (the last kept), a tiny temperature (the
    /// argmax), top-p and min-p at their ends.
    #[test]
    fn draws_of_broken_rows_and_edge_numbers() {
        let d = DrawRow { temperature: 1.0, top_k: 0, top_p: 0.9, min_p: 0.0, u: 0.5 };
        assert_eq!(draw_host(&[f32::NAN, f32::NEG_INFINITY, f32::NAN], &d, None), 0);
        assert_eq!(draw_host(&[f32::NAN, f32::NEG_INFINITY, 1.0], &d, Some(&[0b011])), 0, "first allowed of a row all NaN or -inf");
        assert_eq!(draw_host(&[1.0, 2.0, 3.0], &d, Some(&[0])), 0, "nothing allowed");
        let row = [0.5f32, 0.1, 0.4, 0.3];
        let last = DrawRow { top_p: 1.0, u: 1.0 - f32::EPSILON / 2.0, ..d };
        assert_eq!(draw_host(&row, &last, None), 3, "a number just below 1: the last kept column");
        assert_eq!(draw_host(&row, &DrawRow { temperature: 1e-6, u: 0.99, ..d }, None), 0, "a tiny temperature: the argmax");
        assert_eq!(draw_host(&row, &DrawRow { top_p: 1e-6, u: 0.99, ..d }, None), 0, "top-p near 0 keeps the largest");
        assert_eq!(draw_host(&row, &DrawRow { top_p: 1.0, min_p: 1.0, u: 0.99, ..d }, None), 0, "min-p 1 keeps the largest");
        assert_eq!(draw_host(&row, &DrawRow { top_k: 1, top_p: 1.0, u: 0.99, ..d }, None), 0, "top-k 1 keeps the largest");
    }

    #[test]
    fn argmax_allowed_is_the_argmax_of_the_masked_row() {
        let mut rng = 7u64;
        let mut next = || {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (rng >> 33) as u32
        };
        for cols in [1usize, 31, 32, 33, 100, 1000] {
            for _ in 0..50 {
                // Few distinct values: ties; some NaN and -inf.
                let row: Vec<f32> = (0..cols)
                    .map(|_| match next() % 10 {
                        0 => f32::NAN,
                        1 => f32::NEG_INFINITY,
                        v => (v % 4) as f32,
                    })
                    .collect();
                let bits: Vec<u32> = (0..cols.div_ceil(32)).map(|_| if next() % 5 == 0 { 0 } else { next() | next() }).collect();
                let allowed = |c: usize| bits[c / 32] >> (c % 32) & 1 == 1;
                // The definition: the lowest allowed column of the largest
                // allowed value, NaN as -inf.
                let key = |c: usize| if row[c].is_nan() { f32::NEG_INFINITY } else { row[c] };
                let want = (0..cols).filter(|&c| allowed(c)).fold(None, |b: Option<usize>, c| match b {
                    Some(b) if key(b) >= key(c) => Some(b),
                    _ => Some(c),
                });
                assert_eq!(argmax_allowed_host(&row, &bits), want.unwrap_or(0) as u32, "{row:?} {bits:x?}");
                // All allowed: the plain argmax, wherever a finite value is.
                if row.iter().any(|v| v.is_finite()) {
                    assert_eq!(argmax_allowed_host(&row, &vec![u32::MAX; bits.len()]), argmax_host(&row));
                }
            }
        }
    }

    #[test]
    fn top_k_allowed_is_the_top_k_of_the_allowed_columns() {
        let mut x = 0x2545_f491u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let cols = 70usize;
        for round in 0..200 {
            let row: Vec<f32> = (0..cols).map(|_| if next() % 11 == 0 { f32::NAN } else { (next() % 9) as f32 - 4.0 }).collect();
            let bits: Vec<u32> = (0..cols.div_ceil(32)).map(|_| (next() as u32) & (next() as u32)).collect();
            let allowed = |c: usize| bits[c / 32] >> (c % 32) & 1 == 1;
            let k = 1 + round % 12;
            let got = top_k_allowed_host(row.clone(), cols, k, &bits).unwrap().remove(0);
            assert_eq!(got.len(), k);
            // The finite allowed values, largest first, lower column on ties.
            let mut finite: Vec<(u32, f32)> = (0..cols).filter(|&c| allowed(c) && row[c].is_finite()).map(|c| (c as u32, row[c])).collect();
            finite.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let n = finite.len().min(k);
            assert_eq!(got[..n], finite[..n], "row {row:?} bits {bits:x?} k {k}");
            // The rest are -inf, in column order, whatever their bits.
            assert!(got[n..].iter().all(|&(_, v)| v == f32::NEG_INFINITY));
            assert!(got[n..].windows(2).all(|w| w[0].0 < w[1].0));
            if n > 0 {
                assert_eq!(got[0].0, argmax_allowed_host(&row, &bits));
            }
        }
        assert!(top_k_allowed_host(vec![0.0; 64], 32, 1, &[u32::MAX]).is_err(), "one mask word for two rows");
    }
}
