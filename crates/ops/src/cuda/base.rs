//! The primitive ops as a forward records them: the fusable ones (RMSNorm,
//! products, the residual add, gated activations, RoPE, KV writes) as
//! [`OpRec`]s for `fuse.rs` and `lower.rs`, the rest (embedding, gathers,
//! elementwise maps, biases, copies) as the commands they issue.
//!
//! Each `try_*` is the `Device` op of that name, run through `Cuda::op`:
//! it checks its arguments, sizes its outputs and uploads its index arrays
//! now; the kernels run when the forward does.

use anyhow::{anyhow, ensure, Result};

use super::exec::{Cmd, Io};
use super::fuse::OpRec;
use super::{Cuda, CudaKv, CudaTensor, CudaWeight};
use crate::{Act, Map, Rope};

/// The `gated` kernel's activation code and its parameters.
fn act_code(act: Act) -> (i32, (f32, f32)) {
    match act {
        Act::Silu => (0, (0.0, 0.0)),
        Act::GeluTanh => (1, (0.0, 0.0)),
        Act::Identity => (2, (0.0, 0.0)),
        Act::Sigmoid => (3, (0.0, 0.0)),
        Act::SwiGluClamped { limit, alpha } => (4, (limit, alpha)),
    }
}

impl Cuda {
    pub(super) fn try_embed(&self, table: &CudaWeight, ids: &[u32], scale: f32, out: &mut CudaTensor) -> Result<()> {
        self.note_weight(table, true);
        self.other(|| {
            self.grow(out, ids.len(), table.cols)?;
            if !ids.is_empty() {
                let p = self.put_tokens(ids)?;
                self.launch(self.inner.fns.embed)
                    .blocks(ids.len())
                    .block(256)
                    .ptr(table.ptr())
                    .ptr(p)
                    .int(table.cols)
                    .int(table.rows)
                    .f32(scale)
                    .ptr(out.fptr())
                    .ptr(out.bptr())
                    .run()?;
            }
            Ok(Io { writes: vec![out.fptr()], bf: vec![out.fptr()], ..Io::default() })
        })
    }

    pub(super) fn try_matmul(&self, x: &CudaTensor, ws: &[&CudaWeight], outs: &mut [&mut CudaTensor]) -> Result<()> {
        ensure!(ws.len() == outs.len(), "matmul: {} weights for {} outputs", ws.len(), outs.len());
        for w in ws {
            ensure!(x.cols == w.cols, "matmul: x has {} columns, weight takes {}", x.cols, w.cols);
            self.note_weight(w, false);
        }
        for (w, o) in ws.iter().zip(outs.iter_mut()) {
            self.grow(o, x.rows, w.rows)?;
        }
        if ws.is_empty() {
            return Ok(());
        }
        self.fusable(OpRec::Mm { x: x.tref(), ws: ws.iter().map(|w| w.wref()).collect(), outs: outs.iter().map(|o| o.tref()).collect() })
    }

    pub(super) fn try_gather_rows(&self, x: &CudaTensor, rows: &[usize], out: &mut CudaTensor) -> Result<()> {
        ensure!(rows.iter().all(|&r| r < x.rows), "gather_rows: row out of range ({} rows)", x.rows);
        self.other(|| {
            self.grow(out, rows.len(), x.cols)?;
            if !rows.is_empty() {
                let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                let p = self.put_u32(&idx)?;
                self.launch(self.inner.fns.gather_rows)
                    .grid((rows.len() as u32, x.cols.div_ceil(2048).clamp(1, 64) as u32, 1))
                    .block(256)
                    .ptr(x.fptr())
                    .ptr(p)
                    .int(x.cols)
                    .ptr(out.fptr())
                    .ptr(out.bptr())
                    .run()?;
            }
            Ok(Io { reads: vec![x.fptr()], writes: vec![out.fptr()], bf: vec![out.fptr()] })
        })
    }

    pub(super) fn try_rms_norm(&self, x: &CudaTensor, w: &CudaTensor, eps: f32, out: &mut CudaTensor) -> Result<()> {
        let g = w.len();
        ensure!(g > 0 && x.cols.is_multiple_of(g), "rms_norm: weight of {g} does not divide rows of {}", x.cols);
        self.grow(out, x.rows, x.cols)?;
        self.fusable(OpRec::Norm { x: x.tref(), w: w.fptr(), w_len: g, eps, out: out.tref() })
    }

    pub(super) fn try_add(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        if y.rows == 1 && x.rows != 1 {
            // A bias: one row added to every row.
            ensure!(x.cols == y.cols, "add: rows of {} plus a row of {}", x.cols, y.cols);
            return self.other(|| {
                let n = x.len();
                if n > 0 {
                    self.launch(self.inner.fns.add_row).elementwise(n).ptr(x.fptr()).ptr(y.fptr()).u64(n as u64).int(x.cols).run()?;
                }
                Ok(Io { reads: vec![x.fptr(), y.fptr()], writes: vec![x.fptr()], bf: Vec::new() })
            });
        }
        ensure!(x.rows == y.rows && x.cols == y.cols, "add: {}x{} += {}x{}", x.rows, x.cols, y.rows, y.cols);
        self.fusable(OpRec::Add { x: x.tref(), y: y.tref() })
    }

    pub(super) fn try_map(&self, x: &mut CudaTensor, f: Map) -> Result<()> {
        let n = x.len();
        let fns = &self.inner.fns;
        match f {
            Map::Scale(s) => self.other(|| {
                self.launch(fns.scale).elementwise(n).ptr(x.fptr()).f32(s).u64(n as u64).run()?;
                Ok(Io { reads: vec![x.fptr()], writes: vec![x.fptr()], bf: Vec::new() })
            }),
            Map::Softcap(cap) => self.other(|| {
                self.launch(fns.softcap).elementwise(n).ptr(x.fptr()).f32(cap).u64(n as u64).run()?;
                Ok(Io { reads: vec![x.fptr()], writes: vec![x.fptr()], bf: Vec::new() })
            }),
            Map::Silu => self.try_silu(x),
            Map::Relu2 => self.try_relu2(x),
        }
    }

    pub(super) fn try_gated(&self, act: Act, gate: &CudaTensor, up: &CudaTensor, out: &mut CudaTensor) -> Result<()> {
        ensure!(gate.rows == up.rows && gate.cols == up.cols, "gated: gate {}x{}, up {}x{}", gate.rows, gate.cols, up.rows, up.cols);
        self.grow(out, gate.rows, gate.cols)?;
        let (code, params) = act_code(act);
        if code <= 1 {
            // The activations the gated GEMV computes in its store.
            return self.fusable(OpRec::Gated { act: code, gate: gate.tref(), up: up.tref(), out: out.tref() });
        }
        self.other(|| {
            self.gated_cmd(code, params, gate.tref(), up.tref(), out.tref())?;
            Ok(Io { reads: vec![gate.fptr(), up.fptr()], writes: vec![out.fptr()], bf: vec![out.fptr()] })
        })
    }

    pub(super) fn try_rope(&self, x: &mut CudaTensor, positions: &[u32], head_dim: usize, rope: &Rope) -> Result<()> {
        ensure!(positions.len() == x.rows, "rope: {} positions for {} rows", positions.len(), x.rows);
        ensure!(head_dim > 0 && x.cols.is_multiple_of(head_dim), "rope: head dim {head_dim} does not divide {}", x.cols);
        if let Some(freqs) = &rope.freqs {
            return self.try_rope_freqs(x, positions, head_dim, freqs);
        }
        let pos = if x.rows == 0 { 0 } else { self.put_u32(positions)? };
        self.fusable(OpRec::Rope { x: x.tref(), pos, head_dim, dims: rope.dims.min(head_dim), theta: rope.theta, scale: rope.scale, neox: rope.neox })
    }

    pub(super) fn try_kv_write(&self, kv: &mut CudaKv, layer: usize, k: &CudaTensor, v: &CudaTensor, slots: &[u32]) -> Result<()> {
        let s = *kv.spec.layers.get(layer).ok_or_else(|| anyhow!("kv_write: no layer {layer}"))?;
        let w = s.kv_heads * s.head_dim;
        ensure!(k.cols == w && v.cols == w, "kv_write: k is {} wide, v {}, the pool holds {w}", k.cols, v.cols);
        ensure!(slots.len() <= k.rows && slots.len() <= v.rows, "kv_write: {} slots for {} rows", slots.len(), k.rows);
        let total = (kv.spec.layer_blocks(layer) * kv.spec.block_tokens) as u32;
        ensure!(slots.iter().all(|&s| s < total), "kv_write: slot past the pool's {total}");
        let p = if slots.is_empty() { 0 } else { self.put_u32(slots)? };
        self.fusable(OpRec::KvWrite { k: k.tref(), v: v.tref(), kc: kv.k[layer].ptr, vc: kv.v[layer].ptr, width: w, slots: p, nslots: slots.len() })
    }

    pub(super) fn try_kv_copy_blocks(&self, kv: &mut CudaKv, group: usize, src: &[u32], dst: &[u32]) -> Result<()> {
        let bt = kv.spec.block_tokens;
        let blocks = *kv.spec.group_blocks.get(group).ok_or_else(|| anyhow!("kv_copy_blocks: no group {group}"))?;
        ensure!(src.iter().chain(dst).all(|&b| (b as usize) < blocks), "kv_copy_blocks: block past group {group}'s {blocks}");
        self.other(|| {
            for l in kv.spec.group_layers(group) {
                let shape = kv.spec.layers[l];
                let n = bt * shape.kv_heads * shape.head_dim * 2;
                for (&s, &d) in src.iter().zip(dst) {
                    for buf in [&kv.k[l], &kv.v[l]] {
                        self.emit(Cmd::Copy { dst: buf.ptr + d as u64 * n as u64, src: buf.ptr + s as u64 * n as u64, bytes: n })?;
                    }
                }
            }
            Ok(Io::default())
        })
    }

    pub(super) fn try_copy_rows(&self, t: &mut CudaTensor, src: &[u32], dst: &[u32]) -> Result<()> {
        ensure!(src.iter().chain(dst).all(|&r| (r as usize) < t.rows), "copy_rows: row past {}", t.rows);
        self.other(|| {
            let n = t.cols * 4;
            for (&s, &d) in src.iter().zip(dst) {
                if n > 0 && s != d {
                    self.emit(Cmd::Copy { dst: t.fptr() + (d as usize * n) as u64, src: t.fptr() + (s as usize * n) as u64, bytes: n })?;
                }
            }
            Ok(Io { reads: vec![t.fptr()], writes: vec![t.fptr()], bf: Vec::new() })
        })
    }

    pub(super) fn try_zero_rows(&self, t: &mut CudaTensor, rows: &[u32]) -> Result<()> {
        ensure!(rows.iter().all(|&r| (r as usize) < t.rows), "zero_rows: row past {}", t.rows);
        self.other(|| {
            let n = t.cols * 4;
            for &row in rows {
                if n > 0 {
                    self.emit(Cmd::Zero { dst: t.fptr() + (row as usize * n) as u64, bytes: n })?;
                }
            }
            Ok(Io { reads: vec![t.fptr()], writes: vec![t.fptr()], bf: Vec::new() })
        })
    }
}
