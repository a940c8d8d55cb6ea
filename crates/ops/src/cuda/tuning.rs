//! The CUDA device's tuning knobs, in one place, fixed when the device opens.
//!
//! [`Tuning::default`] is what the production binary runs with: the values
//! measured best on the H200 (docs/dev/cuda-sessions.md). Dev tools pass others through
//! [`super::Cuda::with_tuning`]; built with the `cuda-tuning` feature,
//! [`super::Cuda::new`] reads them from the `BRAID_CUDA_*` variables
//! ([`Tuning::from_env`]), which a build without it never looks at.

/// Settings that change how fast the device runs, never what it computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Blocks per SM the lean (1–2-row) GEMV kernels are built for (at
    /// most 8; 0: the lean kernels are not used). 3 fits where the full
    /// kernels fit 2, so more weight loads stay in flight.
    pub gemv_min_blocks: usize,
    /// From how many 16-byte chunks per lane a GEMV keeps 8 loads in flight
    /// instead of 4: 8 measured 888 -> 940 tok/s at 1 stream, 2553 -> 2767
    /// at 4 on the H200.
    pub gemv_deep_from: usize,
    /// GEMV blocks wanted per SM before a block takes more weight rows
    /// (1–64): fewer, longer blocks measured faster (800 against 780 tok/s
    /// at 1 stream).
    pub gemv_blocks_per_sm: usize,
    /// Up to this many rows (at most 8; 0: always cuBLAS) a GEMM runs as
    /// the GEMV kernels: at 8 rows the GEMV measured slower than cuBLAS.
    pub gemv_max_rows: usize,
    /// Up to this many rows (0: never; at most 32), a product the GEMV
    /// kernels do not take runs as the skinny tensor-core GEMM instead of
    /// cuBLAS. On the H100 (Llama-1B shape, decode rounds as graphs) with
    /// `skinny_pdl_per_sm` 1: 16 streams 9,647 -> 11,214 tok/s and 32
    /// streams 18,401 -> 19,044 against 8 rows; SmolLM2's shape 13,241 ->
    /// 20,070 and 25,268 -> 31,507.
    pub skinny_max_rows: usize,
    /// A skinny GEMM of at most this many blocks an SM launches with
    /// programmatic dependent launch (where `pdl` is on); a larger one
    /// starts once the kernel before it has finished, so its blocks (half
    /// an SM's registers each) do not sit on SMs that kernel still needs.
    /// On the H100, Llama-1B shape: 8 streams 5,353 -> 6,137 tok/s against
    /// every skinny launch with it; without it for SmolLM2's small products
    /// 6 streams lost 12% (7,916 -> 6,884).
    pub skinny_pdl_per_sm: usize,
    /// Most key splits of the decode attention (1–64): enough to fill the
    /// GPU at one stream.
    pub attn_max_splits: usize,
    /// Warps a block of the decode attention that reads keys straight
    /// into registers, a few lanes a key (`attn_decode_lanes`; 1–8, 0: the
    /// tiled kernel `attn_decode` everywhere). Head dims 16–256 a power of
    /// two, at most 8 query heads a KV head; other shapes take the tiled one.
    /// H100, six SmolLM2 rows a round: 1.131 -> 0.992 ms at 250 tokens,
    /// 1.305 -> 1.136 at 2,000, 1.659 -> 1.304 at 4,000 (4 warps: 0.988,
    /// 1.207, 1.445).
    pub attn_decode_warps: usize,
    /// Up to how many (query row, KV head) pairs a decode launch takes the
    /// lanes kernel (0: none): a launch of few pairs waits on memory one
    /// step after another, which the lanes kernel shortens; with more, the
    /// tiled kernel's copies keep more bytes in flight an SM (H100,
    /// SmolLM2: 32 rows 1.98 -> 2.12 ms a round with lanes). Off: at 32,
    /// six SmolLM2 rows' plain rounds were 11-14% shorter at 2,000-4,000
    /// keys, but a round beside an 8-32-row chunk (its rows in the tiled
    /// kernel, the single rows in the lanes kernel beside it) 0.1-0.25 ms
    /// longer, and an 1800-token arrival's newcomer waited 124-213 ms
    /// instead of 41-71 (docs/dev/cuda-sessions.md, stop 54).
    pub attn_decode_lanes_pairs: usize,
    /// From how many query rows a sequence runs the tensor-core prefill
    /// attention (at least 2); fewer take the split-KV decode kernel, a
    /// row per work item: on the H200 a 5-row chunk at ~1000 keys cost
    /// 1.3 ms more a round in the prefill kernel (32 blocks, each walking
    /// every key alone). Models with few KV heads keep more rows in the
    /// decode kernel (`attention.rs`).
    pub attn_prefill_from: usize,
    /// The most rows a sequence keeps in the decode kernel where few KV
    /// heads let it keep more than `attn_prefill_from` allows (128 rows x
    /// KV heads; at most 32). At 32, SmolLM2's 17-32-row chunks take the
    /// decode kernel, and on the H100 beside six streams at 2,000 / 4,000
    /// keys a 32-row chunk added more than a 64-row one in the prefill
    /// kernel (+0.69 / +1.04 ms against +0.54 / +0.46; stop 54): a knob
    /// to weigh 16 against it.
    pub attn_decode_max_rows: usize,
    /// Most key splits of the prefill attention (1: none), used when its
    /// tiles alone leave most SMs idle (a short chunk at a long context).
    pub attn_prefill_splits: usize,
    /// The blocks an SM the prefill attention's key splits aim at (1–16).
    /// ncu (H100, a 24-row chunk at ~1000 keys, 2 an SM): 4–8 warps an SM,
    /// each issuing its instructions one after another; more blocks (with
    /// `attn_prefill_splits` past 8, so no cluster merge) is the experiment.
    pub attn_prefill_blocks_per_sm: usize,
    /// The decode attention merges its key splits inside a thread-block
    /// cluster (Hopper on): no combine launch.
    pub attn_cluster: bool,
    /// Most blocks in such a cluster (2–16): past 8, the portable size,
    /// the decode kernel asks for Hopper's non-portable cluster sizes. A
    /// prompt chunk's clusters keep to 8 (its merge's registers). H100,
    /// six SmolLM2 rows: 16 made rounds at 2,000 tokens 1.345 -> 1.225 ms,
    /// but when it sized the chunk kernel's merge too, served passes ran
    /// small chunks (TTFT 114-149 ms against 49-55).
    pub attn_cluster_max: usize,
    /// Programmatic dependent launch (Hopper on): a kernel's blocks start
    /// while the one before it finishes.
    pub pdl: bool,
    /// Kernels let their successor launch before their own wait (off:
    /// after it, one kernel ahead), so its first weight loads go out early.
    pub pdl_early: bool,
    /// Few-row products fold in the RMSNorm of their input and the
    /// residual add of their output: fewer launches in a decode round.
    pub norm_fold: bool,
    /// Most rows whose norm a GEMV computes itself (each block reads every
    /// row's f32 values once): past 2, the norm kernel then the GEMV
    /// measured faster (3 streams 2401 against 2496 tok/s).
    pub norm_fold_rows: usize,
    /// Few-row q/k/v products apply RoPE and write the KV pool in their
    /// store: no separate `rope_kv` launch.
    pub rope_fold: bool,
    /// Decode rounds do the next round's graph pass 1 while the GPU runs
    /// (`Device::replay_ahead`): the host work leaves the GPU's critical path.
    pub ahead: bool,
    /// Greedy rounds launch the round prepared ahead before returning
    /// (`Device::argmax_rows_launch_ahead`): the GPU does not wait for the
    /// host to handle the tokens.
    pub launch_ahead: bool,
    /// Independent products and attentions of a round run side by side on
    /// streams of their own (`branch.rs`): the products of one input past
    /// the skinny GEMM's rows, and a prompt chunk's attention beside the
    /// decode rows'.
    pub branches: bool,
    /// Decode rounds replay as CUDA graphs ([`super::Cuda::graph`]): one
    /// launch for a whole forward (`Cuda::set_graphs` changes it later).
    pub graphs: bool,
    /// Sampled rows (top-p, min-p, plain temperature) are drawn here
    /// (`RowPick::Draw`) instead of coming back whole.
    pub draw: bool,
    /// The weights one product reads together (q, k and v; gate and up)
    /// share one buffer after `Device::prepare`, so that past the skinny
    /// GEMM's rows one cuBLAS GEMM computes them all (`Cuda::pack_weights`).
    /// On the H100, SmolLM2's shape, six streams at 2,000 keys: a round
    /// with a 64-row chunk 1.767 -> 1.603 ms, 128 rows 2.029 -> 1.843; the
    /// arrival ran 128-row chunks where it ran 96 (TTFT 40 -> 32 ms).
    pub pack: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            gemv_min_blocks: 3,
            gemv_deep_from: 8,
            gemv_blocks_per_sm: 1,
            gemv_max_rows: 4,
            skinny_max_rows: 32,
            skinny_pdl_per_sm: 1,
            attn_max_splits: 16,
            attn_decode_warps: 8,
            attn_decode_lanes_pairs: 0,
            attn_prefill_from: 17,
            attn_decode_max_rows: 32,
            attn_prefill_splits: 8,
            attn_prefill_blocks_per_sm: 2,
            attn_cluster: true,
            attn_cluster_max: 8,
            pdl: true,
            pdl_early: true,
            norm_fold: true,
            norm_fold_rows: 2,
            rope_fold: true,
            ahead: true,
            launch_ahead: true,
            branches: true,
            graphs: true,
            draw: true,
            pack: true,
        }
    }
}

impl Tuning {
    /// What [`super::Cuda::new`] opens with: the defaults (a build with
    /// the `cuda-tuning` feature reads the environment instead).
    #[cfg(not(feature = "cuda-tuning"))]
    pub fn initial() -> Tuning {
        Tuning::default()
    }

    /// What [`super::Cuda::new`] opens with: the environment's settings
    /// (this is the `cuda-tuning` build).
    #[cfg(feature = "cuda-tuning")]
    pub fn initial() -> Tuning {
        Tuning::from_env()
    }

    /// The values brought into the ranges the kernels are built for.
    pub(super) fn limited(self) -> Tuning {
        Tuning {
            gemv_min_blocks: self.gemv_min_blocks.min(8),
            gemv_blocks_per_sm: self.gemv_blocks_per_sm.clamp(1, 64),
            gemv_max_rows: self.gemv_max_rows.min(8),
            attn_max_splits: self.attn_max_splits.clamp(1, 64),
            attn_decode_warps: self.attn_decode_warps.min(8),
            attn_prefill_from: self.attn_prefill_from.max(2),
            attn_decode_max_rows: self.attn_decode_max_rows.min(32),
            attn_prefill_splits: self.attn_prefill_splits.clamp(1, 64),
            attn_prefill_blocks_per_sm: self.attn_prefill_blocks_per_sm.clamp(1, 16),
            attn_cluster_max: self.attn_cluster_max.clamp(2, 16),
            ..self
        }
    }

    /// The defaults, each overridden by its `BRAID_CUDA_*` variable: a
    /// number, or for a switch `0` to turn it off (`BRAID_CUDA_GEMV_MINB`,
    /// `_GEMV_DEEP`, `_GEMV_BLOCKS`, `_GEMV_ROWS`, `_SKINNY_ROWS`, `_SKINNY_PDL_PER_SM`, `_ATTN_SPLITS`, `_ATTN_DEC_WARPS`, `_ATTN_DEC_PAIRS`,
    /// `_ATTN_PREFILL_FROM`, `_ATTN_DEC_ROWS`, `_ATTN_PREFILL_SPLITS`, `_ATTN_PREFILL_BLOCKS`,
    /// `_ATTN_CLUSTER`, `_ATTN_CLUSTER_MAX`, `_PDL`, `_PDL_EARLY`, `_NORM_FOLD`,
    /// `_NORM_FOLD_ROWS`, `_ROPE_FOLD`, `_AHEAD`, `_LAUNCH_AHEAD`,
    /// `_BRANCHES`, `_GRAPHS`, `_DRAW`, `_PACK`).
    #[cfg(feature = "cuda-tuning")]
    pub fn from_env() -> Tuning {
        let d = Tuning::default();
        let num = |name: &str, default: usize| std::env::var(format!("BRAID_CUDA_{name}")).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
        let on = |name: &str, default: bool| std::env::var(format!("BRAID_CUDA_{name}")).map(|v| v != "0").unwrap_or(default);
        Tuning {
            gemv_min_blocks: num("GEMV_MINB", d.gemv_min_blocks),
            gemv_deep_from: num("GEMV_DEEP", d.gemv_deep_from),
            gemv_blocks_per_sm: num("GEMV_BLOCKS", d.gemv_blocks_per_sm),
            gemv_max_rows: num("GEMV_ROWS", d.gemv_max_rows),
            skinny_max_rows: num("SKINNY_ROWS", d.skinny_max_rows),
            skinny_pdl_per_sm: num("SKINNY_PDL_PER_SM", d.skinny_pdl_per_sm),
            attn_max_splits: num("ATTN_SPLITS", d.attn_max_splits),
            attn_decode_warps: num("ATTN_DEC_WARPS", d.attn_decode_warps),
            attn_decode_lanes_pairs: num("ATTN_DEC_PAIRS", d.attn_decode_lanes_pairs),
            attn_prefill_from: num("ATTN_PREFILL_FROM", d.attn_prefill_from),
            attn_decode_max_rows: num("ATTN_DEC_ROWS", d.attn_decode_max_rows),
            attn_prefill_splits: num("ATTN_PREFILL_SPLITS", d.attn_prefill_splits),
            attn_prefill_blocks_per_sm: num("ATTN_PREFILL_BLOCKS", d.attn_prefill_blocks_per_sm),
            attn_cluster: on("ATTN_CLUSTER", d.attn_cluster),
            attn_cluster_max: num("ATTN_CLUSTER_MAX", d.attn_cluster_max),
            pdl: on("PDL", d.pdl),
            pdl_early: on("PDL_EARLY", d.pdl_early),
            norm_fold: on("NORM_FOLD", d.norm_fold),
            norm_fold_rows: num("NORM_FOLD_ROWS", d.norm_fold_rows),
            rope_fold: on("ROPE_FOLD", d.rope_fold),
            ahead: on("AHEAD", d.ahead),
            launch_ahead: on("LAUNCH_AHEAD", d.launch_ahead),
            branches: on("BRANCHES", d.branches),
            graphs: on("GRAPHS", d.graphs),
            draw: on("DRAW", d.draw),
            pack: on("PACK", d.pack),
        }
    }

    /// `BRAID_CUDA_SKIP=name,...`: kernels (name prefixes) not launched at
    /// all, a diagnostic that times a round without them. Results are wrong
    /// while it is set, so only the `cuda-tuning` build reads it.
    #[cfg(feature = "cuda-tuning")]
    pub(super) fn skip_from_env() -> Vec<String> {
        std::env::var("BRAID_CUDA_SKIP").map(|v| v.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect()).unwrap_or_default()
    }
}
