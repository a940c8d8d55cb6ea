//! Lowering: a recorded forward's groups ([`fuse::plan`]) into device
//! commands, choosing each product's kernel by its shape (the few-row GEMV
//! kernels, the skinny GEMM or cuBLAS) and keeping track of which tensors' bf16 copies
//! (what the products read) are current.
//!
//! A group whose fused kernel does not take its shapes lowers as its ops
//! one by one; the results are the same.

use std::collections::HashSet;

use anyhow::{bail, Result};

use super::exec::{Cmd, Recording};
use super::fuse::{self, Group, OpRec, TRef, Tail, WRef};
use super::gemm::GemmOut;
use super::tensor::{adjacent, PACK_ROWS};
use super::Cuda;

/// The buffers whose bf16 copy is current, as lowering goes.
type Bf = HashSet<u64>;

/// A product's input: a tensor (its bf16 copy read), and when the product
/// computes its input's RMSNorm itself, x's f32 rows and eps (the norm's
/// weight folded into the product's weights at load).
#[derive(Clone, Copy)]
pub(super) struct Input {
    pub x: TRef,
    pub fold: Option<(u64, f32)>,
}

impl Input {
    fn plain(x: TRef) -> Input {
        Input { x, fold: None }
    }
}

/// Up to this many rows, the per-row kernels (norms, RoPE with the KV
/// write) run wide: 1024 threads a row, or a block per head, so each thread
/// takes fewer serial steps. A round's rows are then latency-bound, not
/// short of blocks: a decode round beside a 64-row chunk, at 256 threads a
/// row, spent 6 µs a norm against 3.4 for its decode rows alone, and 8 µs
/// a RoPE against 4 on the H200.
const WIDE_ROWS: usize = 256;

/// An error if any of `ws` had a norm folded into it at load: read without
/// that norm (here, over `rows` rows), the product would be another one.
fn refuse_folded(ws: &[WRef], rows: usize) -> Result<()> {
    match ws.iter().find(|w| w.folded != 0) {
        Some(w) => bail!("a {}x{} weight whose norm was folded in at load is read without that norm ({rows} rows)", w.rows, w.cols),
        None => Ok(()),
    }
}

impl Cuda {
    /// The commands of `rec`'s ops, fused where a kernel takes a group.
    pub(super) fn lower(&self, rec: &Recording, tail: Tail) -> Result<Vec<Cmd>> {
        let groups = fuse::plan(&rec.ops, tail);
        let outer = self.st().exec.sink.replace(Vec::new());
        let mut bf = Bf::new();
        let r = groups.iter().try_for_each(|g| self.lower_group(rec, g, &mut bf));
        let cmds = std::mem::replace(&mut self.st().exec.sink, outer).unwrap_or_default();
        r.map(|_| cmds)
    }

    fn lower_group(&self, rec: &Recording, g: &Group, bf: &mut Bf) -> Result<()> {
        let ops = &rec.ops;
        match *g {
            Group::Single(i) => self.lower_one(rec, i, bf),
            Group::Qkv { norm, mm, rope_q, rope_k, kv } => self.lower_qkv(ops, norm, mm, rope_q, rope_k, kv, bf),
            Group::RopeKv { rope_q, rope_k, kv } => self.lower_rope_kv(&ops[rope_q], &ops[rope_k], &ops[kv], bf),
            Group::GatedMm { norm, mm, gated } => self.lower_gated_mm(ops, norm, mm, gated, bf),
            Group::Resid { mm, add } => self.lower_resid(ops, mm, add, bf),
            Group::NormMm { norm, mm } => {
                let OpRec::Mm { x, ws, outs } = &ops[mm] else { bail!("a norm group without its product") };
                let input = self.norm_input(&ops[norm], self.gemv_fits(x.rows, x.cols), bf)?;
                self.lower_mm(input, ws, outs, true, bf)
            }
            Group::AddNorm { add, norm } => {
                let (OpRec::Add { x, y }, OpRec::Norm { w, eps, out, .. }) = (&ops[add], &ops[norm]) else { bail!("an add-norm group of other ops") };
                self.add_norm_cmd(*x, *y, *w, *eps, *out)?;
                bf.remove(&x.f);
                bf.insert(out.f);
                Ok(())
            }
        }
    }

    fn lower_one(&self, rec: &Recording, i: usize, bf: &mut Bf) -> Result<()> {
        match &rec.ops[i] {
            &OpRec::Norm { x, w, w_len, eps, out } => {
                self.norm_cmd(x, w, w_len, eps, out)?;
                bf.insert(out.f);
            }
            OpRec::Mm { x, ws, outs } => self.lower_mm(Input::plain(*x), ws, outs, false, bf)?,
            &OpRec::Add { x, y } => {
                let n = x.rows * x.cols;
                self.launch(self.inner.fns.add).elementwise(n).ptr(x.f).ptr(y.f).u64(n as u64).run()?;
                bf.remove(&x.f);
            }
            &OpRec::Gated { act, gate, up, out } => {
                self.gated_cmd(act, (0.0, 0.0), gate, up, out)?;
                bf.insert(out.f);
            }
            &OpRec::Rope { x, pos, head_dim, dims, theta, scale, neox } => {
                if x.rows > 0 {
                    self.launch(self.inner.fns.rope)
                        .blocks(x.rows)
                        .block(256)
                        .ptr(x.f)
                        .ptr(pos)
                        .int(x.cols)
                        .int(head_dim)
                        .int(dims.min(head_dim))
                        .f32(theta)
                        .f32(scale)
                        .flag(neox)
                        .run()?;
                }
                bf.remove(&x.f);
            }
            &OpRec::KvWrite { k, v, kc, vc, width, slots, nslots } => {
                if nslots > 0 {
                    self.launch(self.inner.fns.kv_write).blocks(nslots).block(128).ptr(k.f).ptr(v.f).ptr(slots).int(width).ptr(kc).ptr(vc).run()?;
                }
            }
            OpRec::Other { writes, cmds, .. } => {
                let l = &rec.others[*cmds];
                for c in &l.cmds {
                    self.emit(c.clone())?;
                }
                for w in writes {
                    if l.bf.contains(w) {
                        bf.insert(*w);
                    } else {
                        bf.remove(w);
                    }
                }
            }
        }
        Ok(())
    }

    /// Make `x`'s bf16 copy current.
    fn ensure_bf(&self, x: &TRef, bf: &mut Bf) -> Result<()> {
        if !bf.contains(&x.f) {
            let n = x.rows * x.cols;
            self.launch(self.inner.fns.to_bf16).elementwise(n).ptr(x.f).ptr(x.b).u64(n as u64).run()?;
            bf.insert(x.f);
        }
        Ok(())
    }

    /// The input of the products that read a folded norm: x itself when
    /// the GEMV computes the norm (few rows), else the norm's output made
    /// now with a unit weight (the weight is in the products').
    fn norm_input(&self, norm: &OpRec, gemv: bool, bf: &mut Bf) -> Result<Input> {
        let &OpRec::Norm { x, eps, out, .. } = norm else { bail!("a folded norm that is not a norm") };
        if gemv && x.rows <= self.inner.tuning.norm_fold_rows {
            self.ensure_bf(&x, bf)?;
            return Ok(Input { x, fold: Some((x.f, eps)) });
        }
        self.norm_cmd(x, 0, x.cols, eps, out)?;
        bf.insert(out.f);
        Ok(Input::plain(out))
    }

    /// Products of `input` by each of `ws` into `outs`: GEMV launches of up
    /// to three weights for few rows, skinny GEMM launches of up to three
    /// for a few dozen, else a cuBLAS GEMM each. `folded`: the
    /// input is the norm folded into the weights (else none may carry one).
    fn lower_mm(&self, input: Input, ws: &[WRef], outs: &[TRef], folded: bool, bf: &mut Bf) -> Result<()> {
        if !folded {
            refuse_folded(ws, input.x.rows)?;
        }
        let x = input.x;
        if x.rows > 0 {
            self.ensure_bf(&x, bf)?;
            let list: Vec<(u64, usize, u64)> = ws.iter().zip(outs).map(|(w, o)| (w.ptr, w.rows, o.f)).collect();
            if self.gemv_fits(x.rows, x.cols) {
                for c in list.chunks(3) {
                    self.gemv_cmd(input, c, None)?;
                }
            } else if self.skinny_fits(x.rows, x.cols) {
                for c in list.chunks(3) {
                    self.skinny_cmd(x.b, x.rows, x.cols, c, GemmOut::F32)?;
                }
            } else {
                // cuBLAS: each product side by side (q, k and v of a mixed
                // round are each too small to fill the GPU).
                let mut gemms: Vec<_> = ws.iter().zip(outs).map(|(w, o)| move || self.gemm(w.ptr, x.b, o.f, w.rows, x.rows, w.cols, GemmOut::F32)).collect();
                let mut parts: Vec<&mut dyn FnMut() -> Result<()>> = gemms.iter_mut().map(|g| g as &mut dyn FnMut() -> Result<()>).collect();
                self.branches(&mut parts)?;
            }
        }
        outs.iter().for_each(|o| {
            bf.remove(&o.f);
        });
        Ok(())
    }

    /// The product added into the residual stream in its store.
    fn lower_resid(&self, ops: &[OpRec], mm: usize, add: usize, bf: &mut Bf) -> Result<()> {
        let (OpRec::Mm { x, ws, .. }, &OpRec::Add { x: acc, .. }) = (&ops[mm], &ops[add]) else { bail!("a residual group of other ops") };
        let w = ws[0];
        if !self.inner.tuning.norm_fold || w.folded != 0 {
            let rec = Recording { ops: vec![ops[mm].clone(), ops[add].clone()], ..Recording::default() };
            self.lower_one(&rec, 0, bf)?;
            return self.lower_one(&rec, 1, bf);
        }
        if x.rows == 0 {
            return Ok(());
        }
        self.ensure_bf(x, bf)?;
        if self.gemv_fits(x.rows, x.cols) {
            self.gemv_cmd(Input::plain(*x), &[(w.ptr, w.rows, acc.f)], Some(acc.b))?;
            bf.insert(acc.f);
        } else {
            self.gemm(w.ptr, x.b, acc.f, w.rows, x.rows, w.cols, GemmOut::AddF32)?;
            bf.remove(&acc.f);
        }
        Ok(())
    }

    /// Gate and up and the activation: one GEMV or skinny launch for up to
    /// a few dozen rows (gate and up never written); else GEMMs writing bf16
    /// gate and up, which the activation reads (half the bytes of f32 both
    /// ways).
    fn lower_gated_mm(&self, ops: &[OpRec], norm: Option<usize>, mm: usize, gated: usize, bf: &mut Bf) -> Result<()> {
        let (OpRec::Mm { x, ws, outs }, &OpRec::Gated { act, gate, up, out }) = (&ops[mm], &ops[gated]) else { bail!("a gated group of other ops") };
        let (rows, k) = (x.rows, x.cols);
        let input = match norm {
            Some(n) => self.norm_input(&ops[n], self.gemv_fits(rows, k), bf)?,
            None => Input::plain(*x),
        };
        if !(act == 0 || act == 1) {
            self.lower_mm(input, ws, outs, norm.is_some(), bf)?;
            self.gated_cmd(act, (0.0, 0.0), gate, up, out)?;
            bf.insert(out.f);
            return Ok(());
        }
        if norm.is_none() {
            refuse_folded(ws, x.rows)?;
        }
        let (wg, wu) = (ws[0], ws[1]);
        let m = wg.rows;
        if rows > 0 && m > 0 {
            self.ensure_bf(&input.x, bf)?;
            if self.gemv_fits(rows, k) {
                self.gemv_gated_cmd(input, wg, wu, act, out)?;
            } else if self.skinny_fits(rows, k) {
                self.skinny_gated_cmd(input.x.b, rows, k, wg.ptr, wu.ptr, m, act, out)?;
            } else {
                // Gate and up as bf16 (half the bytes of f32 both ways): the
                // activation reads them eight values a thread where it can,
                // `(gate, up, units, row units, row stride)`.
                let (len, m8) = (rows * m, (m / 8) as u64);
                let eights = if m.is_multiple_of(8) && adjacent(&[wg, wu]) {
                    // Packed at prepare: one GEMM writes each row's gate
                    // then up values, [rows, 2m], into gate's f32 buffer (as
                    // many bytes, and dead after the group).
                    self.gemm(wg.ptr, input.x.b, gate.f, 2 * m, rows, k, GemmOut::Bf16)?;
                    Some((gate.f, gate.f + 2 * m as u64, len / 8, m8, 2 * m8))
                } else {
                    let xb = input.x.b;
                    self.branches(&mut [&mut || self.gemm(wg.ptr, xb, gate.b, m, rows, k, GemmOut::Bf16), &mut || {
                        self.gemm(wu.ptr, xb, up.b, m, rows, k, GemmOut::Bf16)
                    }])?;
                    // One row each (the buffers start 256-byte aligned).
                    let n8 = (len / 8) as u64;
                    len.is_multiple_of(8).then_some((gate.b, up.b, len / 8, n8, n8))
                };
                match eights {
                    Some((g, u, units, m8, ld8)) => self
                        .launch(self.inner.fns.act_mul_bf8)
                        .elementwise(units)
                        .ptr(g)
                        .ptr(u)
                        .ptr(out.f)
                        .ptr(out.b)
                        .u64(units as u64)
                        .i32(act)
                        .u64(m8)
                        .u64(ld8)
                        .run()?,
                    None => {
                        self.launch(self.inner.fns.act_mul_bf).elementwise(len).ptr(gate.b).ptr(up.b).ptr(out.f).ptr(out.b).u64(len as u64).i32(act).run()?
                    }
                }
            }
        }
        // Only gate's and up's bf16 halves, at most, hold values now.
        bf.remove(&gate.f);
        bf.remove(&up.f);
        bf.insert(out.f);
        Ok(())
    }

    /// q, k and v with RoPE and the KV write in the product's store (few
    /// rows, RoPE over whole heads); else the products, then `rope_kv`.
    #[allow(clippy::too_many_arguments)]
    fn lower_qkv(&self, ops: &[OpRec], norm: Option<usize>, mm: usize, rq: usize, rk: usize, kv: usize, bf: &mut Bf) -> Result<()> {
        let (OpRec::Mm { x, ws, outs }, &OpRec::Rope { pos, head_dim, theta, scale, neox, .. }, &OpRec::KvWrite { kc, vc, width, slots, nslots, .. }) =
            (&ops[mm], &ops[rq], &ops[kv])
        else {
            bail!("a q/k/v group of other ops")
        };
        let (wq, wk, wv) = (ws[0], ws[1], ws[2]);
        let gemv = self.inner.tuning.rope_fold
            && self.gemv_fits(x.rows, x.cols)
            && head_dim > 0
            && (head_dim / 2).is_multiple_of(4)
            && wq.rows.is_multiple_of(head_dim)
            && width == wk.rows
            && wv.rows == wk.rows
            && nslots <= x.rows;
        let input = match norm {
            Some(n) => self.norm_input(&ops[n], self.gemv_fits(x.rows, x.cols), bf)?,
            None => Input::plain(*x),
        };
        if !gemv {
            if let Some(src) = self.packed_qkv(input, ws, norm.is_some(), bf)? {
                return self.lower_rope_kv_from(&ops[rq], &ops[rk], &ops[kv], src, bf);
            }
            self.lower_mm(input, ws, outs, norm.is_some(), bf)?;
            return self.lower_rope_kv(&ops[rq], &ops[rk], &ops[kv], bf);
        }
        if norm.is_none() {
            refuse_folded(ws, x.rows)?;
        }
        if x.rows > 0 {
            self.ensure_bf(&input.x, bf)?;
            let (xf, eps) = input.fold.unwrap_or((0, 0.0));
            // 4 RoPE pairs (8 rows) a block for q and k, 8 rows for v.
            let (nbq, nbk, nbv) = (wq.rows / 8, wk.rows / 8, wv.rows.div_ceil(8));
            let f = self.gemv_kernel(x.rows, x.cols / 8, 1, &self.inner.fns.gemv_rope);
            self.launch(f)
                .blocks(nbq + nbk + nbv)
                .block(256)
                .ptr(input.x.b)
                .int(x.rows)
                .int(x.cols / 8)
                .ptr(wq.ptr)
                .ptr(wk.ptr)
                .ptr(wv.ptr)
                .ptr(outs[0].f)
                .ptr(outs[1].f)
                .ptr(outs[2].f)
                .int(wq.rows)
                .int(wk.rows)
                .int(nbq)
                .int(nbk)
                .int(head_dim)
                .flag(neox)
                .f32(theta)
                .f32(scale)
                .ptr(pos)
                .ptr(if nslots == 0 { 0 } else { slots })
                .int(nslots)
                .ptr(kc)
                .ptr(vc)
                .ptr(xf)
                .f32(eps)
                .run()?;
        }
        outs.iter().for_each(|o| {
            bf.remove(&o.f);
        });
        Ok(())
    }

    /// q, k and v as one cuBLAS GEMM over their packed weights, into the
    /// device's `pack_out` buffer (f32, a row's q, k and v side by side),
    /// where cuBLAS would run anyway and the rows fit: the buffer's address
    /// and row width. None where they do not: the caller runs a GEMM each.
    fn packed_qkv(&self, input: Input, ws: &[WRef], folded: bool, bf: &mut Bf) -> Result<Option<(u64, usize)>> {
        let x = input.x;
        let width: usize = ws.iter().map(|w| w.rows).sum();
        let fits = x.rows > 0 && x.rows <= PACK_ROWS && !self.gemv_fits(x.rows, x.cols) && !self.skinny_fits(x.rows, x.cols) && adjacent(ws);
        let Some(out) = self.st().pack_out.last().map(|b| (b.ptr, b.bytes)).filter(|&(_, bytes)| fits && bytes >= PACK_ROWS * width * 4) else {
            return Ok(None);
        };
        if !folded {
            refuse_folded(ws, x.rows)?;
        }
        self.ensure_bf(&x, bf)?;
        self.gemm(ws[0].ptr, x.b, out.0, width, x.rows, x.cols, GemmOut::F32)?;
        Ok(Some((out.0, width)))
    }

    /// RoPE of q and k and the KV write in one kernel.
    fn lower_rope_kv(&self, rope_q: &OpRec, rope_k: &OpRec, kv: &OpRec, bf: &mut Bf) -> Result<()> {
        self.lower_rope_kv_from(rope_q, rope_k, kv, (0, 0), bf)
    }

    /// As [`Self::lower_rope_kv`], q, k and v first copied in from `src`
    /// (its address and row width; address 0: none), where one GEMM wrote
    /// them side by side ([`Self::packed_qkv`]).
    fn lower_rope_kv_from(&self, rope_q: &OpRec, rope_k: &OpRec, kv: &OpRec, src: (u64, usize), bf: &mut Bf) -> Result<()> {
        let (
            &OpRec::Rope { x: q, pos, head_dim, dims, theta, scale, neox },
            &OpRec::Rope { x: k, .. },
            &OpRec::KvWrite { v, kc, vc, width, slots, nslots, .. },
        ) = (rope_q, rope_k, kv)
        else {
            bail!("a rope/kv group of other ops")
        };
        if q.rows > 0 {
            let heads = q.cols / head_dim + width / head_dim;
            let (f, grid, threads) = if q.rows <= WIDE_ROWS {
                (self.inner.fns.rope_kv, (q.rows as u32, heads as u32, 1), head_dim.next_power_of_two().clamp(32, 256) as u32)
            } else {
                (self.inner.fns.rope_kv_rows, (q.rows as u32, 1, 1), 256)
            };
            self.launch(f)
                .grid(grid)
                .block(threads)
                .ptr(q.f)
                .ptr(k.f)
                .ptr(v.f)
                .ptr(pos)
                .ptr(if nslots == 0 { 0 } else { slots })
                .int(nslots)
                .int(q.cols)
                .int(width)
                .int(head_dim)
                .int(dims.min(head_dim))
                .f32(theta)
                .f32(scale)
                .flag(neox)
                .ptr(kc)
                .ptr(vc)
                .ptr(src.0)
                .int(src.1)
                .run()?;
        }
        bf.remove(&q.f);
        bf.remove(&k.f);
        if src.0 != 0 {
            bf.remove(&v.f);
        }
        Ok(())
    }

    /// RMSNorm of `x` over groups of `g` times the weight at `w` (0: a unit
    /// weight over whole rows), into `out` and its bf16 copy.
    pub(super) fn norm_cmd(&self, x: TRef, w: u64, g: usize, eps: f32, out: TRef) -> Result<()> {
        let groups = (x.rows * x.cols).checked_div(g).unwrap_or(0);
        if groups == 0 {
            return Ok(());
        }
        if g <= 256 {
            self.launch(self.inner.fns.rms_norm_warp)
                .blocks(groups.div_ceil(8))
                .block(256)
                .ptr(x.f)
                .ptr(w)
                .ptr(out.f)
                .ptr(out.b)
                .int(groups)
                .int(g)
                .f32(eps)
                .run()
        } else {
            self.launch(self.inner.fns.rms_norm_block)
                .blocks(groups)
                .block(if groups <= WIDE_ROWS { 1024 } else { 256 })
                .ptr(x.f)
                .ptr(w)
                .ptr(out.f)
                .ptr(out.b)
                .int(g)
                .f32(eps)
                .run()
        }
    }

    /// `x += y`, then the RMSNorm of whole rows of x into `out`: one kernel.
    fn add_norm_cmd(&self, x: TRef, y: TRef, w: u64, eps: f32, out: TRef) -> Result<()> {
        if x.rows == 0 {
            return Ok(());
        }
        let threads = if x.rows <= WIDE_ROWS { 1024 } else { 256 };
        self.launch(self.inner.fns.add_rms_norm).blocks(x.rows).block(threads).ptr(x.f).ptr(y.f).ptr(w).ptr(out.f).ptr(out.b).int(x.cols).f32(eps).run()
    }

    /// `out = act(gate) * up` (the `gated` kernel's activation codes).
    pub(super) fn gated_cmd(&self, act: i32, (limit, alpha): (f32, f32), gate: TRef, up: TRef, out: TRef) -> Result<()> {
        let n = gate.rows * gate.cols;
        if n == 0 {
            return Ok(());
        }
        self.launch(self.inner.fns.gated).elementwise(n).ptr(gate.f).ptr(up.f).ptr(out.f).ptr(out.b).u64(n as u64).i32(act).f32(limit).f32(alpha).run()
    }
}
