//! Few-row products (decode): the GEMV kernels that stream the weights
//! against up to 8 rows of x, the choice between them and cuBLAS, their
//! fused forms (gated: gate, up and the activation in one launch; the
//! residual add in the store; an RMSNorm of the input computed in the
//! launch), and the norm folded into the weights at load.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use anyhow::{ensure, Result};

use super::fuse::{TRef, WRef};
use super::lower::Input;
use super::rt;
use super::{Cuda, CudaWeight};

/// One GEMV kernel's builds: 4 or 8 loads in flight per lane (`deep`),
/// for any row count or (`lean`) for 1–2 rows.
#[derive(Clone, Copy)]
pub(super) struct GvFns {
    plain: usize,
    deep: usize,
    plain_lean: usize,
    deep_lean: usize,
}

impl GvFns {
    /// The four builds of GEMV `name` in `m`, each name into `names`.
    pub(super) fn load(m: &rt::Module, name: &str, names: &mut HashMap<usize, String>) -> Result<Self> {
        let mut get = |n: String| -> Result<usize> {
            let f = m.func(&n)?;
            names.insert(f, n);
            Ok(f)
        };
        Ok(Self {
            plain: get(name.to_string())?,
            deep: get(format!("{name}8"))?,
            plain_lean: get(format!("{name}_lean"))?,
            deep_lean: get(format!("{name}8_lean"))?,
        })
    }
}

impl Cuda {
    /// Most rows a GEMM runs as the GEMV kernels (0: never).
    pub fn gemv_max_rows(&self) -> usize {
        self.inner.tuning.gemv_max_rows
    }

    /// Whether an `[n, k]` input takes the GEMV kernels (16-byte chunks of k).
    pub(super) fn gemv_fits(&self, n: usize, k: usize) -> bool {
        (1..=self.inner.tuning.gemv_max_rows).contains(&n) && k > 0 && k.is_multiple_of(8)
    }

    /// Weight rows per GEMV block (a power of two up to `max_r`): the most
    /// that still gives every SM `gemv_blocks_per_sm` blocks; a block's 8 warps split the
    /// rest of the work along k.
    fn gemv_rows(&self, m: usize, max_r: usize) -> usize {
        let mut r = max_r;
        while r > 1 && m.div_ceil(r) < self.inner.tuning.gemv_blocks_per_sm * self.inner.sms {
            r /= 2;
        }
        r
    }

    /// The GEMV kernel for rows of `k8` chunks split over `slices` warps:
    /// 8 loads in flight per lane for long slices (see `gemv_deep_from`).
    /// The lean build for 1–2 rows (see `gemv_min_blocks`).
    pub(super) fn gemv_kernel(&self, n: usize, k8: usize, slices: usize, f: &GvFns) -> usize {
        let deep = k8.div_ceil(slices.max(1) * 32) >= self.inner.tuning.gemv_deep_from;
        match (deep, n <= 2 && self.inner.tuning.gemv_min_blocks > 0) {
            (true, true) => f.deep_lean,
            (true, false) => f.deep,
            (false, true) => f.plain_lean,
            (false, false) => f.plain,
        }
    }

    /// `y = x · wᵀ` (f32) for up to three `(weight, out rows, y)` sharing
    /// the input (its bf16 copy current, at most 8 rows), in one launch; or
    /// with `resid_bf` (one weight) the residual add `y += x · wᵀ`, the
    /// sum's bf16 copy into `resid_bf`. The input's RMSNorm computed in the
    /// launch when it carries one.
    pub(super) fn gemv_cmd(&self, input: Input, ws: &[(u64, usize, u64)], resid_bf: Option<u64>) -> Result<()> {
        ensure!(!ws.is_empty() && ws.len() <= 3, "gemv: {} weights in one launch", ws.len());
        ensure!(resid_bf.is_none() || ws.len() == 1, "gemv: a residual add takes one weight");
        let x = input.x;
        let total: usize = ws.iter().map(|w| w.1).sum();
        let r = self.gemv_rows(total, 8);
        let get = |i: usize| ws.get(i).copied().unwrap_or((0, 0, 0));
        let (a, b, c) = (get(0), get(1), get(2));
        let nb = [a.1.div_ceil(r), b.1.div_ceil(r), c.1.div_ceil(r)];
        let blocks = nb.iter().sum::<usize>();
        let f = self.gemv_kernel(x.rows, x.cols / 8, 8 / r, &self.inner.fns.gemv);
        let (xf, eps) = input.fold.unwrap_or((0, 0.0));
        self.launch(f)
            .blocks(blocks)
            .block(256)
            .ptr(x.b)
            .int(x.rows)
            .int(x.cols / 8)
            .int(r)
            .ptr(a.0)
            .ptr(b.0)
            .ptr(c.0)
            .ptr(a.2)
            .ptr(b.2)
            .ptr(c.2)
            .ptr(resid_bf.unwrap_or(0))
            .ptr(0)
            .ptr(0)
            .int(a.1)
            .int(b.1)
            .int(c.1)
            .int(nb[0])
            .int(nb[1])
            .ptr(xf)
            .f32(eps)
            .flag(resid_bf.is_some())
            .run()
    }

    /// `out = act(x · gateᵀ) * (x · upᵀ)` (f32 and bf16) as one GEMV
    /// launch, the input's RMSNorm computed in it when it carries one.
    pub(super) fn gemv_gated_cmd(&self, input: Input, w_gate: WRef, w_up: WRef, act: i32, out: TRef) -> Result<()> {
        let x = input.x;
        let (n, m, k) = (x.rows, w_gate.rows, x.cols);
        let r = self.gemv_rows(m, 4);
        let f = self.gemv_kernel(n, k / 8, 8 / (2 * r), &self.inner.fns.gemv_gated);
        let (xf, eps) = input.fold.unwrap_or((0, 0.0));
        self.launch(f)
            .blocks(m.div_ceil(r))
            .block(256)
            .ptr(x.b)
            .int(n)
            .int(k / 8)
            .int(r)
            .ptr(w_gate.ptr)
            .ptr(w_up.ptr)
            .int(m)
            .i32(act)
            .ptr(out.f)
            .ptr(out.b)
            .ptr(xf)
            .f32(eps)
            .run()
    }

    /// Fold RMSNorm weight `g` (its f32 buffer) into `w`'s columns, at
    /// load (`Device::prepare`): a product that computes the norm of its
    /// input itself then scales only its sums.
    pub(super) fn fold_norm(&self, w: &CudaWeight, g: u64) -> Result<()> {
        let f = w.folded.load(Ordering::Relaxed);
        ensure!(f == 0 || f == g, "a weight folded with one norm at load would be folded with another");
        if f == g {
            return Ok(());
        }
        let n = w.rows * w.cols;
        self.launch(self.inner.fns.scale_cols).elementwise(n).ptr(w.ptr()).ptr(g).u64(n as u64).int(w.cols).run()?;
        w.folded.store(g, Ordering::Relaxed);
        Ok(())
    }
}
