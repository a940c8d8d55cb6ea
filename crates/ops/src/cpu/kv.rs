//! The paged KV pool in f16 or f32 (see [`CpuKv`]).

use anyhow::Result;
use half::f16;

use super::{CpuKv, CpuTensor};
use crate::{KvDtype, KvPoolSpec};

pub fn kv_pool(spec: &KvPoolSpec, dtype: KvDtype) -> Result<CpuKv> {
    spec.check()?;
    // A layer holds its group's blocks.
    let sizes = spec.layers.iter().enumerate().map(|(i, l)| spec.layer_blocks(i) * spec.block_tokens * l.kv_heads * l.head_dim);
    let (mut k, mut v, mut k32, mut v32) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for n in sizes {
        match dtype {
            KvDtype::F16 => {
                k.push(vec![f16::ZERO; n]);
                v.push(vec![f16::ZERO; n]);
            }
            KvDtype::F32 => {
                k32.push(vec![0f32; n]);
                v32.push(vec![0f32; n]);
            }
        }
    }
    Ok(CpuKv { spec: spec.clone(), dtype, k, v, k32, v32 })
}

pub fn kv_write(kv: &mut CpuKv, layer: usize, k: &CpuTensor, v: &CpuTensor, slots: &[u32]) {
    let w = kv.row_width(layer);
    assert_eq!(k.cols, w, "kv_write: k is {} wide, the pool holds {w}", k.cols);
    assert_eq!(v.cols, w, "kv_write: v is {} wide, the pool holds {w}", v.cols);
    for (i, &slot) in slots.iter().enumerate() {
        let s = slot as usize * w;
        match kv.dtype {
            KvDtype::F16 => {
                for (d, x) in kv.k[layer][s..s + w].iter_mut().zip(k.row(i)) {
                    *d = f16::from_f32(*x);
                }
                for (d, x) in kv.v[layer][s..s + w].iter_mut().zip(v.row(i)) {
                    *d = f16::from_f32(*x);
                }
            }
            KvDtype::F32 => {
                kv.k32[layer][s..s + w].copy_from_slice(k.row(i));
                kv.v32[layer][s..s + w].copy_from_slice(v.row(i));
            }
        }
    }
}

pub fn kv_copy_blocks(kv: &mut CpuKv, group: usize, src: &[u32], dst: &[u32]) {
    let bt = kv.spec.block_tokens;
    let layers: Vec<usize> = kv.spec.group_layers(group).collect();
    for layer in layers {
        let n = bt * kv.row_width(layer);
        for (&s, &d) in src.iter().zip(dst) {
            let (s, d) = (s as usize * n, d as usize * n);
            match kv.dtype {
                KvDtype::F16 => {
                    kv.k[layer].copy_within(s..s + n, d);
                    kv.v[layer].copy_within(s..s + n, d);
                }
                KvDtype::F32 => {
                    kv.k32[layer].copy_within(s..s + n, d);
                    kv.v32[layer].copy_within(s..s + n, d);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::cpu::Cpu;
    use crate::{AttnSeq, Device, KvDtype, KvPoolSpec, KvShape};

    /// The f32 pool attends like the f16 one on values f16 holds exactly,
    /// keeps values f16 would round, and copies blocks.
    #[test]
    fn f32_pool_matches_f16_pool_and_keeps_precision() {
        let dev = Cpu::new(Some(2));
        let (hd, kvh, heads, bt, n) = (16, 2, 4, 4, 11);
        let spec = KvPoolSpec::new(8, bt, vec![KvShape { kv_heads: kvh, head_dim: hd }]);
        // Multiples of 1/64 in [-2, 2]: exact in f16.
        let val = |i: usize| ((i * 37 % 257) as f32 - 128.0) / 64.0;
        let k = dev.upload(&(0..n * kvh * hd).map(val).collect::<Vec<_>>(), n, kvh * hd).unwrap();
        let v = dev.upload(&(0..n * kvh * hd).map(|i| val(i + 5)).collect::<Vec<_>>(), n, kvh * hd).unwrap();
        let q = dev.upload(&(0..n * heads * hd).map(|i| val(i + 11) / 4.0).collect::<Vec<_>>(), n, heads * hd).unwrap();
        let blocks = [5u32, 1, 6];
        let slots: Vec<u32> = (0..n).map(|p| blocks[p / bt] * bt as u32 + (p % bt) as u32).collect();
        let seqs = [AttnSeq { q_start: 0, q_len: n, kv_len: n, blocks: &blocks, window: Some(6) }];
        let mut outs = Vec::new();
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let mut kv = dev.kv_pool(&spec, dtype).unwrap();
            dev.kv_write(&mut kv, 0, &k, &v, &slots);
            let mut out = dev.tensor(0, 0);
            dev.attention(&q, &kv, 0, &seqs, 0.25, None, &mut out);
            outs.push(out.data);
        }
        let d = outs[0].iter().zip(&outs[1]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(d < 1e-5, "f16 and f32 pools differ by {d}");

        let mut kv = dev.kv_pool(&spec, KvDtype::F32).unwrap();
        let fine = dev.upload(&vec![1.0 + 1e-6; kvh * hd], 1, kvh * hd).unwrap();
        dev.kv_write(&mut kv, 0, &fine, &fine, &[2]);
        dev.kv_copy_blocks(&mut kv, 0, &[0], &[3]);
        assert_eq!(kv.k32[0][(3 * bt + 2) * kvh * hd], 1.0 + 1e-6);
        assert_eq!(kv.v32[0][(3 * bt + 2) * kvh * hd], 1.0 + 1e-6);
        assert!(kv.k.is_empty() && kv.v.is_empty());
    }

    /// Each layer holds its group's blocks; a copy within a group moves
    /// that group's layers only, and the spec refuses a layer without a group.
    #[test]
    fn layers_hold_their_groups_blocks_and_copies_stay_in_a_group() {
        let dev = Cpu::new(Some(2));
        let (bt, kvh, hd) = (4, 1, 8);
        let shape = KvShape { kv_heads: kvh, head_dim: hd };
        // Layers 0 and 2 keep all rows (8 blocks), 1 and 3 a window (3 blocks).
        let spec = KvPoolSpec { block_tokens: bt, layers: vec![shape; 4], layer_groups: vec![0, 1, 0, 1], group_blocks: vec![8, 3] };
        assert_eq!(spec.group_layers(1).collect::<Vec<_>>(), vec![1, 3]);
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let mut kv = dev.kv_pool(&spec, dtype).unwrap();
            let len = |l: usize| if dtype == KvDtype::F16 { kv.k[l].len() } else { kv.k32[l].len() };
            assert_eq!((0..4).map(len).collect::<Vec<_>>(), vec![8 * bt * hd, 3 * bt * hd, 8 * bt * hd, 3 * bt * hd]);
            let one = dev.upload(&vec![1.0; hd], 1, hd).unwrap();
            let two = dev.upload(&vec![2.0; hd], 1, hd).unwrap();
            // Slot 1 (block 0) of every layer; group 1's layers hold 2s.
            for l in 0..4 {
                dev.kv_write(&mut kv, l, if l % 2 == 0 { &one } else { &two }, &one, &[1]);
            }
            dev.kv_copy_blocks(&mut kv, 1, &[0], &[2]);
            let at = |kv: &crate::cpu::CpuKv, l: usize, slot: usize| {
                if dtype == KvDtype::F16 {
                    kv.k[l][slot * hd].to_f32()
                } else {
                    kv.k32[l][slot * hd]
                }
            };
            assert_eq!((at(&kv, 1, 2 * bt + 1), at(&kv, 3, 2 * bt + 1)), (2.0, 2.0), "group 1's layers copied");
            assert_eq!((at(&kv, 0, 2 * bt + 1), at(&kv, 2, 2 * bt + 1)), (0.0, 0.0), "group 0's layers untouched");
            dev.kv_copy_blocks(&mut kv, 0, &[0], &[7]);
            assert_eq!((at(&kv, 0, 7 * bt + 1), at(&kv, 2, 7 * bt + 1)), (1.0, 1.0));
        }
        let bad = KvPoolSpec { layer_groups: vec![0, 2, 0, 1], ..spec.clone() };
        assert!(dev.kv_pool(&bad, KvDtype::F32).is_err(), "a layer in a group with no block count");
        let short = KvPoolSpec { layer_groups: vec![0], ..spec };
        assert!(dev.kv_pool(&short, KvDtype::F32).is_err(), "fewer groups named than layers");
    }
}
