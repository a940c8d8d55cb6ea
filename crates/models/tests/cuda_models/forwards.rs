//! A model's forwards without `ModelBackend`: fused and folded, eagerly and
//! as replayed graphs, and unfused outside any forward, in agreement; the
//! forwards that read their MoE routing back mid-way.

use super::*;

/// How a model's forwards run in [`direct`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    /// `Model::forward` called outside any `Device::forward`, on weights no
    /// `prepare` saw: every op runs at once, unfused.
    Unfused,
    /// Inside `Device::forward` without a key (eager), after `prepare`.
    Eager,
    /// Inside keyed forwards (CUDA graphs, replayed when a shape recurs),
    /// after `prepare`.
    Graphs,
}

/// Forwards of `model` over one stream, without `ModelBackend`: the prompt
/// `toks[..24]` whole, then one token a forward; the logits of every row.
/// With `prepare`, the device first sees one row at position 0 (as
/// `ModelBackend::new` shows it).
fn direct(dev: &Cuda, model: &dyn Model<Cuda>, how: How, prepare: bool, toks: &[u32]) -> Vec<f32> {
    let bt = 16;
    let spec = KvPoolSpec::new(toks.len().div_ceil(bt) + 1, bt, model.kv_layers());
    let mut state = dev.tensor(1, model.state_size());
    if model.state_size() > 0 {
        dev.zero_rows(&mut state, &[0]);
    }
    let mut mem = Memory { kv: dev.kv_pool(&spec, KvDtype::F16).unwrap(), state };
    let mut s = Scratch::new(dev);
    let table: Vec<u32> = (0..spec.group_blocks[0] as u32).collect();
    if prepare {
        let one = Batch::warm_up(&table);
        dev.prepare(&mut || model.forward(dev, &one, &mut mem, &mut s)).unwrap();
    }
    let mut out = Vec::new();
    let mut start = 0;
    let mut parts: Vec<&[u32]> = vec![&toks[..24]];
    parts.extend(toks[24..].chunks(1));
    for part in parts {
        let n = part.len();
        let positions: Vec<u32> = (start as u32..(start + n) as u32).collect();
        let rows: Vec<usize> = (0..n).collect();
        let batch = Batch {
            tokens: part,
            positions: &positions,
            slots: &positions,
            seqs: vec![AttnSeq { q_start: 0, q_len: n, kv_len: start + n, blocks: &table, window: None }],
            window_slots: &positions,
            window_seqs: vec![AttnSeq { q_start: 0, q_len: n, kv_len: start + n, blocks: &table, window: None }],
            logit_rows: &rows,
            state_slots: &[0],
            images: Vec::new(),
        };
        match how {
            How::Unfused => model.forward(dev, &batch, &mut mem, &mut s).unwrap(),
            How::Eager | How::Graphs => {
                let key = (how == How::Graphs).then(|| batch.key());
                dev.forward(Forward { key, tokens: part }, &mut || model.forward(dev, &batch, &mut mem, &mut s)).unwrap()
            }
        }
        out.extend(dev.download(&s.logits).unwrap());
        start += n;
    }
    out
}

/// A fixture's forwards (prompt whole, then a token a forward) fused and
/// folded, eagerly and as replayed graphs, and unfused outside any forward
/// on weights never prepared: graphs give the eager bits, unfused agrees
/// within bf16 rounding, and all three match transformers' incremental
/// table. The MoE fixtures read their routing back mid-forward (such
/// forwards run eagerly, and so do all after them on the device).
fn check_direct(name: &str, incremental_key: &str, tol: f64) {
    let Some(dev) = gpu() else { return };
    let r = reference(name);
    let toks: Vec<u32> = r["tokens"].1.iter().map(|&t| t as u32).collect();
    let vocab = r["logits_full"].0[1];
    let want = &r[incremental_key].1;
    let (_, unprepared) = braid_models::open(&dev, &fixture_dir(name)).unwrap();
    let (_, prepared) = braid_models::open(&dev, &fixture_dir(name)).unwrap();
    let unfused = direct(&dev, unprepared.as_ref(), How::Unfused, false, &toks);
    let eager = direct(&dev, prepared.as_ref(), How::Eager, true, &toks);
    let before = dev.graph_stats();
    let graphs = direct(&dev, prepared.as_ref(), How::Graphs, false, &toks);
    let (replays, captures) = (dev.graph_stats().0 - before.0, dev.graph_stats().1 - before.1);
    eprintln!("{name}: keyed forwards: {replays} graph replays, {captures} captures");
    assert!(graphs.iter().zip(&eager).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: forwards as graphs differ from eager ones");
    for (what, got) in [("unfused", &unfused), ("fused and folded", &eager)] {
        let (rel, agree, rows) = compare(got, want, vocab);
        eprintln!("{name} {what}: incremental logits rel err {rel:.2e}, top-1 {agree}/{rows}");
        assert!(rel < BF16_REL, "{name} {what}: incremental logits rel err {rel} over {BF16_REL}");
        assert!(agree * 10 >= rows * 9, "{name} {what}: top-1 agreement {agree}/{rows}");
    }
    let (rel, agree, rows) = compare(&eager, &unfused, vocab);
    eprintln!("{name}: fused and folded vs unfused: rel err {rel:.2e}, top-1 {agree}/{rows}");
    assert!(rel < tol, "{name}: fused and folded vs unfused: rel err {rel} over {tol}");
}

#[test]
fn llama_fixture_graphs_eager_and_unfused_agree() {
    check_direct("llama", "logits_incremental", 1e-2);
}

#[test]
fn qwen3_fixture_graphs_eager_and_unfused_agree() {
    check_direct("qwen3", "logits_incremental", 1e-2);
}

/// Forwards that read their MoE routing back mid-way (LFM2-MoE, Gemma 4's
/// MoE, whose router reads a norm of its own right before the read, and the
/// MiniMax families) equal the same ops unfused and the reference (at the
/// bf16 tolerance: rounding may move a near-tie of the routing).
#[test]
fn moe_fixtures_reading_back_midway_agree() {
    for name in ["lfm2_moe", "gemma4_text_moe", "minimax", "minimax_m2", "minimax_m3_vl_text"] {
        check_direct(name, "logits_incremental", BF16_REL);
    }
}

/// Every family's fixture with forwards as graphs, eager, and unfused: the
/// families without MoE (the read-back ones are above).
#[test]
fn other_fixtures_graphs_eager_and_unfused_agree() {
    for (name, key) in [
        ("qwen2", "logits_incremental"),
        ("gemma3_text", "logits_incremental"),
        ("gemma4_text", "logits_incremental"),
        ("lfm2", "logits_incremental"),
        ("nemotron_h", "logits_incremental_clamped"),
    ] {
        check_direct(name, key, 1e-2);
    }
}
