//! The CUDA C sources (`kernels/*.cu`), put together into the texts NVRTC
//! compiles at run time for the device's arch, and the base module's
//! kernels.
//!
//! Each NVRTC module is compiled on its own: the `#define`s the tuning asks
//! for, then `prelude.cuh`, then the module's files. No CUDA headers are
//! needed (see `prelude.cuh`), so no CUDA toolkit is needed at build time.

use std::collections::HashMap;

use anyhow::Result;

use super::gemv::GvFns;
use super::rt;
use super::Tuning;

const PRELUDE: &str = include_str!("kernels/prelude.cuh");
/// The base module's files, in the order they are compiled (each uses the
/// prelude and the files before it: the skinny GEMM takes the GEMV's
/// streaming load and activation).
const BASE: [&str; 4] =
    [include_str!("kernels/base.cu"), include_str!("kernels/sampling.cu"), include_str!("kernels/gemv.cu"), include_str!("kernels/skinny.cu")];
const ATTENTION: &str = include_str!("kernels/attention.cu");
const RECURRENT: &str = include_str!("kernels/recurrent.cu");

/// `PDL_LATE` unless `pdl_early`: kernels then let their successor launch
/// only after their own wait.
fn pdl_define(t: &Tuning) -> &'static str {
    if t.pdl_early {
        ""
    } else {
        "#define PDL_LATE\n"
    }
}

/// The `#define`s of the base and hybrid modules: `PDL_LATE` and
/// `GV_MINB`, the blocks per SM the 1–2-row GEMV kernels are built for.
fn defines(t: &Tuning) -> String {
    format!("{}#define GV_MINB {}\n", pdl_define(t), t.gemv_min_blocks.max(1))
}

/// The base module: elementwise, norm, RoPE, KV, gather, sampling, GEMV
/// and skinny GEMM kernels.
pub fn base_source(t: &Tuning) -> String {
    format!("{}{PRELUDE}{}", defines(t), BASE.concat())
}

/// The hybrid families' module (`recurrent.rs`).
pub fn recurrent_source(t: &Tuning) -> String {
    format!("{}{PRELUDE}{RECURRENT}", defines(t))
}

/// The attention module for head dim `hd` and `g` query heads per KV head.
pub fn attention_source(t: &Tuning, hd: usize, g: usize) -> String {
    format!(
        "{}#define HD {hd}\n#define G {g}\n#define CL_MAX {}\n#define PF_CL_MAX {}\n#define DL_WARPS {}\n{PRELUDE}{ATTENTION}",
        pdl_define(t),
        t.attn_cluster_max,
        super::attention::PF_CL_MAX,
        t.attn_decode_warps.max(1)
    )
}

/// One kernel's handle, its name kept for the profile.
fn named(m: &rt::Module, name: &str, names: &mut HashMap<usize, String>) -> Result<usize> {
    let f = m.func(name)?;
    names.insert(f, name.to_string());
    Ok(f)
}

macro_rules! base_kernels {
    (plain: $($f:ident),* ; gemv: $($g:ident),* $(,)?) => {
        /// Function handles of the base module's kernels (each GEMV in its
        /// four builds).
        pub(super) struct Fns {
            $(pub $f: usize,)*
            $(pub $g: GvFns,)*
        }

        impl Fns {
            /// Every kernel of `m`, each name into `names`.
            pub(super) fn load(m: &rt::Module, names: &mut HashMap<usize, String>) -> Result<Fns> {
                Ok(Fns {
                    $($f: named(m, stringify!($f), names)?,)*
                    $($g: GvFns::load(m, stringify!($g), names)?,)*
                })
            }
        }
    };
}

base_kernels!(
    plain: to_bf16,
    embed,
    rms_norm_block,
    rms_norm_warp,
    add_rms_norm,
    add,
    scale,
    softcap,
    gated,
    add_row,
    rope,
    kv_write,
    gather_rows,
    argmax_rows,
    fill_random_bf16,
    fill_f32,
    act_mul_bf,
    act_mul_bf8,
    rope_kv,
    rope_kv_rows,
    topk_chunks,
    scale_cols,
    topk_merge,
    penalize,
    draw_rows,
    gemm_skinny,
    gemm_skinny_gated;
    gemv: gemv,
    gemv_gated,
    gemv_rope,
);
