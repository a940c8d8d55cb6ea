//! The bf16 copies the products read.

use super::*;

/// `t`'s bf16 copy made current inside a forward (a product reads it), then
/// `op` writes `t`, then a product reads `t` again: it must read what `op`
/// wrote (a stale copy fails), against f64 over t's own f32 values rounded
/// to bf16. `host`: the CPU's result, which t's values must match first.
pub(super) fn check_bf16_copy(d: &Cuda, r: &mut Rng, what: &str, t: &mut T, host: &[f32], op: &mut dyn FnMut(&mut T)) {
    let cols = d.shape(t).1;
    let m = 48;
    let w0 = d.weight_from_f32(&vec![0.5; 8 * cols], 8, cols).unwrap();
    let w = r.vec(m * cols, 0.1);
    let gw = d.weight_from_f32(&w, m, cols).unwrap();
    let (mut junk, mut out) = (poisoned(d, 1, 1), poisoned(d, 1, 1));
    in_forward(d, None, &mut || {
        d.matmul(t, &[&w0], &mut [&mut junk]);
        op(t);
        d.matmul(t, &[&gw], &mut [&mut out]);
    })
    .unwrap();
    let own = d.download(t).unwrap();
    let rows = d.shape(t).0;
    assert_eq!(d.shape(t).1, cols, "{what}: the op changed the width");
    let e = rel(&own, host);
    assert!(e < 1e-3, "{what}: f32 values off the CPU's (rel err {e})");
    let want = f32s(&mm_ref(&own, &w, rows, cols, m));
    let e = rel(&d.download(&out).unwrap(), &want);
    assert!(e < 1e-4, "{what}: the bf16 copy read by a product is stale (rel err {e})");
    eprintln!("op {what}: the next product reads its output");
}

/// Every op that writes a tensor a product may read next leaves that
/// product reading its values (the op's own bf16 copy, or a fresh one),
/// inside a forward where copies are tracked: the elementwise maps, the
/// gated activations (fused and not), biases, RoPE, norms, row copies,
/// gathers, embeddings, attention, and a residual add.
#[test]
fn every_op_leaves_the_bf16_copy_a_product_reads_current() {
    let Some(d) = gpu() else { return };
    let cpu = Cpu::new(Some(1));
    let mut r = Rng(seed());
    for rows in [3usize, 40] {
        let cols = 256;
        let (x, y) = (r.vec(rows * cols, 2.0), r.vec(rows * cols, 2.0));
        let (gx, gy) = (d.upload(&x, rows, cols).unwrap(), d.upload(&y, rows, cols).unwrap());
        let (cx, cy) = (cpu.upload(&x, rows, cols).unwrap(), cpu.upload(&y, rows, cols).unwrap());
        let bias = r.vec(cols, 1.0);
        let (gb, cb) = (d.upload(&bias, 1, cols).unwrap(), cpu.upload(&bias, 1, cols).unwrap());
        // In place.
        let maps = [Map::Scale(0.3), Map::Softcap(1.5), Map::Silu, Map::Relu2];
        for f in maps {
            let (mut g, mut c) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
            cpu.map(&mut c, f);
            check_bf16_copy(&d, &mut r, &format!("map {f:?}, {rows} rows"), &mut g, &c.data, &mut |t| d.map(t, f));
        }
        let (mut g, mut c) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
        cpu.add(&mut c, &cb);
        check_bf16_copy(&d, &mut r, &format!("a bias, {rows} rows"), &mut g, &c.data, &mut |t| d.add(t, &gb));
        let (mut g, mut c) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
        cpu.add(&mut c, &cy);
        check_bf16_copy(&d, &mut r, &format!("add, {rows} rows"), &mut g, &c.data, &mut |t| d.add(t, &gy));
        let pos: Vec<u32> = (0..rows as u32).map(|i| 5 * i + 1).collect();
        for rope in [Rope::new(10000.0, 64, true), Rope::table((0..16).map(|i| 0.5f32.powi(i)).collect())] {
            let (mut g, mut c) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
            cpu.rope(&mut c, &pos, 64, &rope);
            check_bf16_copy(&d, &mut r, &format!("rope (table: {}), {rows} rows", rope.freqs.is_some()), &mut g, &c.data, &mut |t| d.rope(t, &pos, 64, &rope));
        }
        let (mut g, mut c) = (d.upload(&x, rows, cols).unwrap(), cx.clone());
        cpu.copy_rows(&mut c, &[0, 2], &[1, 0]);
        cpu.zero_rows(&mut c, &[2]);
        check_bf16_copy(&d, &mut r, &format!("copy_rows / zero_rows, {rows} rows"), &mut g, &c.data, &mut |t| {
            d.copy_rows(t, &[0, 2], &[1, 0]);
            d.zero_rows(t, &[2]);
        });
        // Into an output (whose copy a product made current before).
        for act in [Act::Silu, Act::GeluTanh, Act::Identity, Act::Sigmoid, Act::SwiGluClamped { limit: 2.0, alpha: 1.702 }] {
            let mut c = cpu.tensor(0, 0);
            cpu.gated(act, &cx, &cy, &mut c);
            let mut g = d.upload(&y, rows, cols).unwrap();
            check_bf16_copy(&d, &mut r, &format!("gated {act:?}, {rows} rows"), &mut g, &c.data, &mut |t| d.gated(act, &gx, &gy, t));
        }
        for group in [cols, 64] {
            let w = r.vec(group, 1.0);
            let (gw, cw) = (d.upload(&w, 1, group).unwrap(), cpu.upload(&w, 1, group).unwrap());
            let mut c = cpu.tensor(0, 0);
            cpu.rms_norm(&cx, &cw, 1e-5, &mut c);
            let mut g = d.upload(&y, rows, cols).unwrap();
            check_bf16_copy(&d, &mut r, &format!("rms_norm over {group}, {rows} rows"), &mut g, &c.data, &mut |t| d.rms_norm(&gx, &gw, 1e-5, t));
        }
        let idx: Vec<usize> = (0..rows).rev().collect();
        let mut c = cpu.tensor(0, 0);
        cpu.gather_rows(&cx, &idx, &mut c);
        let mut g = d.upload(&y, rows, cols).unwrap();
        check_bf16_copy(&d, &mut r, &format!("gather_rows, {rows} rows"), &mut g, &c.data, &mut |t| d.gather_rows(&gx, &idx, t));
        let table = r.vec(100 * cols, 1.0);
        let (gt, ct) = (d.weight_from_f32(&table, 100, cols).unwrap(), cpu.upload(&table.iter().map(|&v| rbf(v)).collect::<Vec<_>>(), 100, cols).unwrap());
        let ids: Vec<u32> = (0..rows as u32).map(|i| (i * 37) % 100).collect();
        let want: Vec<f32> = ids.iter().flat_map(|&i| ct.row(i as usize).iter().map(|v| v * 0.5).collect::<Vec<_>>()).collect();
        let mut g = d.upload(&y, rows, cols).unwrap();
        check_bf16_copy(&d, &mut r, &format!("embed, {rows} rows"), &mut g, &want, &mut |t| d.embed(&gt, &ids, 0.5, t));
        // Attention's output, against the CPU over the same bf16 KV values.
        let spec = KvPoolSpec::new(4, 16, vec![KvShape { kv_heads: 1, head_dim: 64 }]);
        let (mut gp, mut cp) = (d.kv_pool(&spec, KvDtype::F16).unwrap(), cpu.kv_pool(&spec, KvDtype::F32).unwrap());
        let kv: Vec<f32> = r.vec(40 * 64, 1.0).into_iter().map(rbf).collect();
        let kslots: Vec<u32> = (0..40).collect();
        d.kv_write(&mut gp, 0, &d.upload(&kv, 40, 64).unwrap(), &d.upload(&kv, 40, 64).unwrap(), &kslots);
        cpu.kv_write(&mut cp, 0, &cpu.upload(&kv, 40, 64).unwrap(), &cpu.upload(&kv, 40, 64).unwrap(), &kslots);
        let seqs: Vec<AttnSeq> = (0..rows).map(|i| AttnSeq { q_start: i, q_len: 1, kv_len: 1 + i % 40, blocks: &[0, 1, 2], window: None }).collect();
        let mut c = cpu.tensor(0, 0);
        cpu.attention(&cx, &cp, 0, &seqs, 0.125, None, &mut c);
        let mut g = d.upload(&y, rows, cols).unwrap();
        check_bf16_copy(&d, &mut r, &format!("attention, {rows} rows"), &mut g, &c.data, &mut |t| d.attention(&gx, &gp, 0, &seqs, 0.125, None, t));
    }
}
