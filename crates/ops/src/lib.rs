//! Device ops: the few kernels LLM inference needs, behind one trait.
//!
//! Models are written once against [`Device`]; each device (the CPU here,
//! CUDA behind a feature) implements the ops for its own tensor and weight
//! types. The engine never sees any of this.

use anyhow::Result;
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

/// One sequence's rows in a recurrent op (short conv, SSM scan, linear
/// attention): rows `start .. start + len` of the batch, in time order,
/// continuing the state held in row `slot` of the state tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateSeq {
    pub start: usize,
    pub len: usize,
    pub slot: u32,
}

/// Shape and limits of a Mamba2 selective scan ([`Device::ssm_scan`]).
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

/// Block selection of a block-sparse attention layer (MiniMax-M3): an
/// indexer scores key blocks per query and each query attends only to the
/// chosen blocks ([`Device::block_sparse_attention`]).
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
    /// The checks every device makes of a [`Device::block_sparse_attention`]
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
            ensure!(s.blocks.iter().all(|&b| (b as usize) < spec.blocks), "block_sparse_attention: block past the pool's {}", spec.blocks);
        }
        Ok((shape, heads, rows))
    }
}

/// The activation of a gated MLP ([`Device::gated_matmul`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateAct {
    /// `silu(gate) * up` (Llama, Qwen).
    Silu,
    /// `gelu_tanh(gate) * up` (Gemma).
    GeluTanh,
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
/// batch. Weights are 2-D `[out, in]`; `matmul` computes `x · Wᵀ`.
pub trait Device: Send + Sync + 'static {
    type Tensor: Send + Sync;
    type Weight: Send + Sync;
    type Kv: Send + Sync;

    fn name(&self) -> String;

    /// Whether a row's result is bit-identical whatever else shares its
    /// batch (how many rows a matmul sees, how a prompt is chunked). The
    /// CPU kernels are written so; cuBLAS picks kernels by shape, so CUDA
    /// is not.
    fn batch_invariant(&self) -> bool {
        true
    }

    /// Each row's index of its largest value (the first on ties; NaN never
    /// wins on the host), for greedy sampling. The default downloads.
    fn argmax_rows(&self, x: &Self::Tensor) -> Result<Vec<u32>> {
        let (rows, cols) = self.shape(x);
        let data = self.download(x)?;
        Ok((0..rows)
            .map(|r| {
                let row = &data[r * cols..(r + 1) * cols];
                let mut best = (0usize, f32::NEG_INFINITY);
                for (i, &v) in row.iter().enumerate() {
                    if v > best.1 {
                        best = (i, v);
                    }
                }
                best.0 as u32
            })
            .collect())
    }

    /// [`Device::argmax_rows`], then the round [`Device::replay_ahead`]
    /// prepared launched at once with these tokens (fed on the device),
    /// so it runs while the caller handles them: the caller's
    /// [`Device::replay_keyed`] of that round with these tokens finds it
    /// running. When another forward comes instead, that round has run for
    /// nothing, so use it only where such a round leaves nothing that
    /// matters (attention KV past each stream's length; no recurrent
    /// state). The default is `argmax_rows`.
    fn argmax_rows_launch_ahead(&self, x: &Self::Tensor) -> Result<Vec<u32>> {
        self.argmax_rows(x)
    }

    /// Whether `argmax_rows` runs where the values are (so greedy
    /// sampling there saves moving whole logits rows to the host).
    fn argmax_on_device(&self) -> bool {
        false
    }

    /// Each row's `k` largest values with their columns, largest first,
    /// the lower column first on ties, NaN counting as -inf (NaN values
    /// come back as -inf): the candidates of top-k sampling. The default
    /// downloads.
    fn top_k_rows(&self, x: &Self::Tensor, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        let cols = self.shape(x).1;
        Ok(top_k_host(&self.download(x)?, cols, k))
    }

    /// The largest `k` that `top_k_rows` finds where the values are (0:
    /// it downloads the rows).
    fn top_k_on_device(&self) -> usize {
        0
    }

    /// Run `f`, a forward made of this device's ops, the way that costs
    /// the least to repeat: the CUDA device records it as a graph keyed by
    /// everything it launches and replays it when the same shape comes
    /// back (a decode round of the same streams). The default runs it.
    fn replay(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        f()
    }

    /// Whether [`Device::replay_ahead`] does anything here.
    fn replays_ahead(&self) -> bool {
        false
    }

    /// Do now, while the device still runs the forward just replayed, the
    /// host work of `f`, the forward expected next, so that
    /// [`Device::replay_keyed`] of it launches at once: `key` hashes
    /// everything `f` reads but its token ids, which `tokens` stand in
    /// for. A forward that never comes costs only that host work. The
    /// default does nothing.
    fn replay_ahead(&self, _key: u64, _tokens: &[u32], _f: &mut dyn FnMut() -> Result<()>) {}

    /// [`Device::replay`] of the forward `f` that `key` describes (as in
    /// [`Device::replay_ahead`]), whose token ids are `tokens`.
    fn replay_keyed(&self, _key: u64, _tokens: &[u32], f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.replay(f)
    }

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
    /// A KV pool storing its rows as `dtype` (`kv_pool` is the F16 one).
    fn kv_pool_as(&self, spec: &KvPoolSpec, dtype: KvDtype) -> Result<Self::Kv> {
        match dtype {
            KvDtype::F16 => self.kv_pool(spec),
            other => anyhow::bail!("{other:?} KV is not implemented on {}", self.name()),
        }
    }

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

    // ---- fused ops: the defaults compose the ops above (same results);
    // a device overrides them to save launches and memory passes ----
    /// `x += y`, then `out = rms_norm(x)` (see [`Device::rms_norm`]).
    fn add_rms_norm(&self, x: &mut Self::Tensor, y: &Self::Tensor, w: &Self::Tensor, eps: f32, out: &mut Self::Tensor) {
        self.add(x, y);
        self.rms_norm(x, w, eps, out);
    }
    /// `outs[i] = x · ws[i]ᵀ` for each pair (q, k and v from one input).
    fn matmul_many(&self, x: &Self::Tensor, ws: &[&Self::Weight], outs: &mut [&mut Self::Tensor]) {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(x, w, out);
        }
    }
    /// The gated MLP's first half: `out = act(x · gateᵀ) * (x · upᵀ)`.
    /// `gate` and `up` are scratch: their contents afterwards are
    /// unspecified (a device may never write them).
    #[allow(clippy::too_many_arguments)]
    fn gated_matmul(
        &self,
        x: &Self::Tensor,
        w_gate: &Self::Weight,
        w_up: &Self::Weight,
        act: GateAct,
        gate: &mut Self::Tensor,
        up: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) {
        self.matmul(x, w_gate, gate);
        self.matmul(x, w_up, up);
        match act {
            GateAct::Silu => self.silu_mul(gate, up, out),
            GateAct::GeluTanh => self.gelu_mul(gate, up, out),
        }
    }
    /// `q, k, v = h · wqᵀ, h · wkᵀ, h · wvᵀ` with `h = rms_norm(x)` (norm
    /// weight and eps; `normed` is scratch for it, which a device that
    /// folds the norm into the products may never write) or `h = x`, then
    /// [`Device::rope_kv_write`]: a layer's attention input in one call.
    #[allow(clippy::too_many_arguments)]
    fn qkv_rope_kv(
        &self,
        x: &Self::Tensor,
        norm: Option<(&Self::Tensor, f32)>,
        normed: &mut Self::Tensor,
        ws: [&Self::Weight; 3],
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &mut Self::Tensor,
        kv: &mut Self::Kv,
        layer: usize,
        positions: &[u32],
        slots: &[u32],
        head_dim: usize,
        rope: &Rope,
    ) {
        let h = match norm {
            Some((w, eps)) => {
                self.rms_norm(x, w, eps, normed);
                &*normed
            }
            None => x,
        };
        self.matmul_many(h, &ws, &mut [&mut *q, &mut *k, &mut *v]);
        self.rope_kv_write(q, k, v, kv, layer, positions, slots, head_dim, rope);
    }
    /// [`Device::gated_matmul`] of `rms_norm(x)`; `normed` is scratch as in
    /// [`Device::qkv_rope_kv`].
    #[allow(clippy::too_many_arguments)]
    fn norm_gated_matmul(
        &self,
        x: &Self::Tensor,
        w_norm: &Self::Tensor,
        eps: f32,
        normed: &mut Self::Tensor,
        w_gate: &Self::Weight,
        w_up: &Self::Weight,
        act: GateAct,
        gate: &mut Self::Tensor,
        up: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) {
        self.rms_norm(x, w_norm, eps, normed);
        self.gated_matmul(normed, w_gate, w_up, act, gate, up, out);
    }
    /// `acc += x · wᵀ` (a residual add); `tmp` is scratch.
    fn matmul_add(&self, x: &Self::Tensor, w: &Self::Weight, tmp: &mut Self::Tensor, acc: &mut Self::Tensor) {
        self.matmul(x, w, tmp);
        self.add(acc, tmp);
    }
    /// `rope(q)`, `rope(k)`, then `kv_write(k, v)` at `slots`.
    #[allow(clippy::too_many_arguments)]
    fn rope_kv_write(
        &self,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &Self::Tensor,
        kv: &mut Self::Kv,
        layer: usize,
        positions: &[u32],
        slots: &[u32],
        head_dim: usize,
        rope: &Rope,
    ) {
        self.rope(q, positions, head_dim, rope);
        self.rope(k, positions, head_dim, rope);
        self.kv_write(kv, layer, k, v, slots);
    }

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

    // ---- ops of the hybrid families (LFM2, Nemotron-H, MiniMax) ----
    /// `x = silu(x)`.
    fn silu(&self, x: &mut Self::Tensor) -> Result<()> {
        let _ = x;
        anyhow::bail!("silu is not implemented on {}", self.name())
    }
    /// `out = relu(x)²` (Nemotron-H's MLP activation).
    fn relu2(&self, x: &Self::Tensor, out: &mut Self::Tensor) -> Result<()> {
        let _ = (x, out);
        anyhow::bail!("relu2 is not implemented on {}", self.name())
    }
    /// `x *= y` elementwise.
    fn mul(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()> {
        let _ = (x, y);
        anyhow::bail!("mul is not implemented on {}", self.name())
    }
    /// `x *= sigmoid(gate)` elementwise (an output gate).
    fn sigmoid_mul(&self, x: &mut Self::Tensor, gate: &Self::Tensor) -> Result<()> {
        let _ = (x, gate);
        anyhow::bail!("sigmoid_mul is not implemented on {}", self.name())
    }
    /// RMSNorm over each group of `group` elements of a row, times `w`,
    /// which is a whole row wide (Mamba2's gated norm over channel groups).
    fn group_rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, group: usize, eps: f32, out: &mut Self::Tensor) -> Result<()> {
        let _ = (x, w, group, eps, out);
        anyhow::bail!("group_rms_norm is not implemented on {}", self.name())
    }
    /// Clamped SwiGLU (MiniMax-M3): `g = min(gate, limit)`, `u = clamp(up,
    /// -limit, limit)`, `out = (u + 1) · g · sigmoid(alpha · g)`.
    fn swiglu_clamped(&self, gate: &Self::Tensor, up: &Self::Tensor, limit: f32, alpha: f32, out: &mut Self::Tensor) -> Result<()> {
        let _ = (gate, up, limit, alpha, out);
        anyhow::bail!("swiglu_clamped is not implemented on {}", self.name())
    }
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
    ) -> Result<()> {
        let _ = (x, weight, bias, kernel, silu, state, state_offset, seqs, out);
        anyhow::bail!("short_conv is not implemented on {}", self.name())
    }
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
    ) -> Result<()> {
        let _ = (xbc, dt, dt_bias, a, d, shape, state, state_offset, seqs, out);
        anyhow::bail!("ssm_scan is not implemented on {}", self.name())
    }
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
    ) -> Result<()> {
        let _ = (qkv, slopes, heads, head_dim, state, state_offset, seqs, out);
        anyhow::bail!("linear_attention is not implemented on {}", self.name())
    }
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
    ) -> Result<()> {
        let _ = (q, iq, kv, layer, index_layer, seqs, scale, sel, out);
        anyhow::bail!("block_sparse_attention is not implemented on {}", self.name())
    }
}

/// [`Device::top_k_rows`] of rows of `cols` values on the host.
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
