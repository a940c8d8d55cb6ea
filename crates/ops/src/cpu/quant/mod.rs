//! GGML quantized blocks on the CPU: dequantization and matmul.
//!
//! Weights stay in their GGUF blocks. A matmul quantizes the activations
//! once to 8-bit blocks (Q8_0-like for the 32-element types, Q8_K-like for
//! the 256-element K-quants) and then does integer dot products block by
//! block, as llama.cpp does. Float weights (F32/F16/BF16) take f32
//! activations directly.
//!
//! Kernels: scalar everywhere; AVX2+FMA+F16C tiles (and VNNI dots, AVX-VNNI
//! or AVX512-VNNI) picked at run time ([`Isa::best`]). Q2_K, Q3_K and
//! Q8_K weights run the scalar kernels. The tests hold each ISA against
//! the scalar one.
//!
//! Shapes: a task owns a range of weight rows (and, when rows are few, of
//! activation rows) and runs register tiles of a few weight rows x a few
//! activation rows. Matvecs (decode, and up to 15 activation rows) stream
//! each weight row once, with software prefetch of the next tile; with
//! AVX-512 up to 16 activation rows share one tile, so each weight block
//! is unpacked once for all of them. With 16+
//! activation rows (prefill)
//! a task first unpacks an L2-sized block of its weight rows into plain
//! bytes + scales, then runs every activation tile over it. The quantized
//! types keep one f32 lane per output row in groups of eight
//! rows, and prefill packs those groups transposed, so each integer
//! `dpbusd` serves eight rows with no horizontal sums.
//!
//! Every output element is computed by the same operations in the same
//! order whatever `m`, the tile shape or the thread count, so results are
//! bit-identical between decode and prefill and across chunkings.

mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod blocks;
mod dequant;
mod matmul;
mod scalar;

use anyhow::{bail, Result};
use braid_formats::DType;

pub use blocks::{f16_to_f32, f32_to_f16};
pub use matmul::{matmul, matmul_isa, matmul_many, matmul_rows};

/// A weight matrix as the file stores it: `rows` output features, each a
/// row of `cols` input features in `dtype`'s blocks, rows back to back.
#[derive(Clone, Copy, Debug)]
pub struct QMatRef<'a> {
    pub dtype: DType,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// `rows * dtype.bytes_for(cols)` bytes.
    pub data: &'a [u8],
}

impl QMatRef<'_> {
    /// Bytes of one row, or an error when `cols` is not whole blocks.
    pub fn row_bytes(&self) -> Result<usize> {
        match self.dtype.bytes_for(self.cols) {
            Some(b) => Ok(b),
            None => bail!("{} rows hold whole blocks of {} elements; {} columns is not a multiple", self.dtype, self.dtype.block_size(), self.cols),
        }
    }

    /// Checks that the data has exactly the bytes the shape needs.
    pub fn validate(&self) -> Result<()> {
        let rb = self.row_bytes()?;
        let need = rb.checked_mul(self.rows);
        if need != Some(self.data.len()) {
            bail!("a {} matrix of {}x{} needs {:?} bytes, got {}", self.dtype, self.rows, self.cols, need, self.data.len());
        }
        Ok(())
    }
}

/// Which kernels run: the portable scalar ones, AVX2+FMA+F16C, or those
/// plus one `vpdpbusd` for each u8 x i8 dot of 32 bytes: AVX-VNNI's, or
/// AVX512-VNNI's, whose decode tiles stay on 256-bit registers and whose
/// float and long-prompt tiles take 512 bits. The kinds give bit-identical
/// results.
/// Ordered narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    Avx2,
    AvxVnni,
    Avx512Vnni,
}

impl Isa {
    /// The best kernels this CPU runs: AVX-512 VNNI's where the CPU has
    /// it, also beside AVX-VNNI, since only those run float weights and
    /// long prompts as packed 512-bit tiles (on a 2-core AMD EPYC with
    /// both, an 896-px image's tower 77 -> 50 s, Qwen2.5-Coder-0.5B pp512
    /// ~1.09x: docs/CPU.md). `BRAID_CPU_ISA` caps the choice ([`Isa::cap`]),
    /// for debugging and comparisons.
    pub fn best() -> Isa {
        use std::sync::atomic::{AtomicU8, Ordering};
        static BEST: AtomicU8 = AtomicU8::new(0);
        const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni];
        match BEST.load(Ordering::Relaxed) {
            0 => {}
            i => return ALL[i as usize - 1],
        }
        let cap = Isa::cap();
        let i = [3, 2, 1, 0].into_iter().filter(|&i| ALL[i] <= cap).find(|&i| ALL[i].available()).unwrap_or(0);
        BEST.store(i as u8 + 1, Ordering::Relaxed);
        ALL[i]
    }

    /// The widest kernels `BRAID_CPU_ISA` (`scalar`, `avx2` or `avxvnni`)
    /// allows, the matmuls' and the other kernels' alike.
    pub(crate) fn cap() -> Isa {
        match std::env::var("BRAID_CPU_ISA").as_deref() {
            Ok("scalar") => Isa::Scalar,
            Ok("avx2") => Isa::Avx2,
            Ok("avxvnni") => Isa::AvxVnni,
            _ => Isa::Avx512Vnni,
        }
    }

    /// How logs and `braid bench` name these kernels.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avx-vnni",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }

    /// Whether this CPU can run these kernels.
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"),
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => Isa::Avx2.available() && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                // Every CPU with AVX-512 VNNI has BW too; the matvec tiles use its byte masks.
                Isa::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::AvxVnni | Isa::Avx512Vnni => false,
        }
    }
}

/// Dequantize `dst.len()` elements of `dtype` from `src`, which must hold
/// exactly those elements' blocks.
pub fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let Some(need) = dtype.bytes_for(dst.len()) else {
        bail!("cannot dequantize {} elements of {dtype}: not a whole number of {}-element blocks", dst.len(), dtype.block_size());
    };
    if need != src.len() {
        bail!("{} elements of {dtype} take {need} bytes, but {} bytes were given", dst.len(), src.len());
    }
    dequant::dequantize_blocks(dtype, src, dst);
    Ok(())
}
