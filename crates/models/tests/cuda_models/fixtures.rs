//! Every family's tiny transformers fixture on the GPU at bf16 tolerance:
//! the base fixtures, the other families (recurrent ops, the MoE scatter,
//! RoPE from a table, block-sparse attention), Gemma 3's window-only KV, and
//! the fixtures that vary each family's configuration.

use super::*;

/// Full-pass logits against transformers' (f32) at bf16 tolerance: relative
/// error of the whole table, and top-1 agreement row by row; then prefill
/// 24 and one token a round against the incremental table.
fn check_fixture(name: &str) {
    let Some(dev) = gpu() else { return };
    let r = reference(name);
    let toks: Vec<u32> = r["tokens"].1.iter().map(|&t| t as u32).collect();
    let (shape, want) = &r["logits_full"];
    let vocab = shape[1];
    let mut be = backend(&dev, &fixture_dir(name));
    be.open(1).unwrap();
    let got = feed(&mut be, 1, &toks);
    let (rel, agree, rows) = compare(&got, want, vocab);
    eprintln!("{name} on {}: full-pass logits rel err {rel:.2e}, top-1 agreement {agree}/{rows}", dev.name());
    assert!(rel < BF16_REL, "{name}: logits rel err {rel} over the bf16 tolerance {BF16_REL}");
    assert!(agree * 10 >= rows * 9, "{name}: top-1 agreement {agree}/{rows}");

    be.open(2).unwrap();
    let mut got = feed(&mut be, 2, &toks[..24]);
    for &t in &toks[24..] {
        got.extend(feed(&mut be, 2, &[t]));
    }
    let (rel, _, _) = compare(&got, &r["logits_incremental"].1, vocab);
    eprintln!("{name}: incremental logits rel err {rel:.2e}");
    assert!(rel < BF16_REL, "{name}: incremental logits rel err {rel}");
}

#[test]
fn llama_fixture_bf16() {
    check_fixture("llama");
}

#[test]
fn qwen3_fixture_bf16() {
    check_fixture("qwen3");
}

/// Qwen2's q/k/v biases and untied (or tied) head on the GPU.
#[test]
fn qwen2_fixtures_bf16() {
    check_fixture("qwen2");
    check_fixture("qwen2_tied");
}

// ---- the other families on CUDA: the recurrent ops, the MoE scatter,
// RoPE from a table and block-sparse attention in a model ----

/// One fixture on the GPU against its transformers tables (full pass,
/// transformers' chunks of 16/11/13, prefill 24 then one token a round),
/// each within the bf16 tolerance with top-1 agreement on 90% of rows; and
/// the state slots: a stream restored from a mark continues exactly as the
/// marked stream does (same shapes, so bit for bit), and streams decoding
/// in one round match each decoding alone.
fn check_hybrid(name: &str, incremental_key: &str) {
    let Some(dev) = gpu() else { return };
    let r = reference(name);
    let toks: Vec<u32> = r["tokens"].1.iter().map(|&t| t as u32).collect();
    let vocab = r["logits_full"].0[1];
    let mut be = backend(&dev, &fixture_dir(name));
    // A fixture whose discrete choices (MoE or block top-k) are closer
    // than bf16 resolves takes other branches on the GPU than in f32
    // wherever rounding flips one, so its whole table is not a bf16
    // tolerance test; its top-1 agreement still is.
    let margin = discrete_margin(name);
    let exact_choices = margin.is_none_or(|m| m >= BF16_MARGIN);
    let check = |what: &str, got: &[f32], key: &str| {
        let (rel, agree, rows) = compare(got, &r[key].1, vocab);
        eprintln!("{name} on {}: {what} logits rel err {rel:.2e}, top-1 agreement {agree}/{rows}", dev.name());
        if exact_choices {
            assert!(rel < BF16_REL, "{name} {what}: logits rel err {rel} over the bf16 tolerance {BF16_REL}");
        } else {
            eprintln!("{name}: its smallest top-k margin {margin:?} is under bf16's {BF16_MARGIN}: top-1 checked, not the table");
        }
        assert!(agree * 10 >= rows * 9, "{name} {what}: top-1 agreement {agree}/{rows}");
    };

    be.open(1).unwrap();
    check("full-pass", &feed(&mut be, 1, &toks), "logits_full");

    be.open(2).unwrap();
    let mut got = Vec::new();
    for part in [&toks[..16], &toks[16..27], &toks[27..]] {
        got.extend(feed(&mut be, 2, part));
    }
    check("chunked (16, 11, 13)", &got, "logits_chunked");

    be.open(3).unwrap();
    let mut got = feed(&mut be, 3, &toks[..24]);
    for &t in &toks[24..] {
        got.extend(feed(&mut be, 3, &[t]));
    }
    check("incremental", &got, incremental_key);
    for s in 1..=3 {
        be.forget(s);
    }

    // A mark mid-prompt, restored into a fresh stream after the marked one
    // and the mark are gone.
    let m = 13;
    be.open(4).unwrap();
    feed(&mut be, 4, &toks[..m]);
    let mark = be.keep_mark(4).unwrap();
    let rest_a = feed(&mut be, 4, &toks[m..]);
    be.forget(4);
    be.open(5).unwrap();
    assert_eq!(be.restore_mark(5, mark).unwrap(), m, "{name}: restored length");
    be.drop_mark(mark);
    let rest_b = feed(&mut be, 5, &toks[m..]);
    be.forget(5);
    assert!(rest_a.iter().zip(&rest_b).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: the restored stream differs from the marked one");
    eprintln!("{name}: stream restored from a mark at {m} == the marked stream, bit-identical");

    // Three streams (different prompts, each prefilled alone), decoding
    // together, against each decoding alone in a fresh backend.
    let n = toks.len();
    let prompts: Vec<Vec<u32>> =
        [(0usize, 9usize), (11, 17), (30, 23)].iter().map(|&(at, len)| toks.iter().cycle().skip(at).take(len).cloned().collect()).collect();
    let step = |s: usize, round: usize| toks[(7 * s + 5 * round) % n];
    let rounds = 4;
    let mut together: Vec<Vec<f32>> = vec![Vec::new(); 3];
    for (s, p) in prompts.iter().enumerate() {
        be.open(10 + s as u64).unwrap();
        feed(&mut be, 10 + s as u64, p);
    }
    for round in 0..rounds {
        let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: 10 + s as u64, tokens: vec![step(s, round)] }).collect();
        let l = be.decode_logits(&rows).unwrap();
        for (s, t) in together.iter_mut().enumerate() {
            t.extend_from_slice(&l[s * vocab..(s + 1) * vocab]);
        }
    }
    let cpu = braid_ops::cpu::Cpu::new(None);
    for (s, p) in prompts.iter().enumerate() {
        let mut alone_be = backend(&dev, &fixture_dir(name));
        alone_be.open(0).unwrap();
        feed(&mut alone_be, 0, p);
        let mut alone = Vec::new();
        for round in 0..rounds {
            alone.extend(feed(&mut alone_be, 0, &[step(s, round)]));
        }
        // The same stream alone on the CPU, in f32: the truth both GPU runs
        // are within bf16 tolerance of.
        let mut cpu_be = backend(&cpu, &fixture_dir(name));
        cpu_be.open(0).unwrap();
        feed(&mut cpu_be, 0, p);
        let mut truth = Vec::new();
        for round in 0..rounds {
            truth.extend(feed(&mut cpu_be, 0, &[step(s, round)]));
        }
        let (rel, agree, rows) = compare(&together[s], &alone, vocab);
        let (rel_b, agree_b, _) = compare(&together[s], &truth, vocab);
        let (rel_a, _, _) = compare(&alone, &truth, vocab);
        eprintln!(
            "{name}: stream {s} decoding beside two others vs alone: rel err {rel:.2e}, top-1 {agree}/{rows}; against the CPU's f32: beside {rel_b:.2e} (top-1 {agree_b}/{rows}), alone {rel_a:.2e}"
        );
        // A state row mixed up between streams moves logits by O(1). bf16
        // puts a stream at ~1e-2 of itself alone, and a family with a
        // discrete choice on the logits' path (MiniMax-M3's block top-k)
        // further where a near-tie flips; against the f32 truth the batched
        // stream keeps to the tolerance its transformers checks keep to.
        assert!(
            rel_b < BF16_REL || !exact_choices && rel_b < 2.0 * rel_a.max(BF16_REL),
            "{name}: stream {s} batched is {rel_b:.2e} from the f32 result (alone: {rel_a:.2e}; batched vs alone {rel})"
        );
        // Where a flipped choice moved the GPU off the f32 path alone too,
        // the batched pick follows the GPU's own path.
        for (i, row) in together[s].chunks(vocab).enumerate() {
            let pick = argmax(row) as u32;
            let at = i * vocab..(i + 1) * vocab;
            assert!(
                near_best(&truth[at.clone()], pick) || !exact_choices && near_best(&alone[at], pick),
                "{name}: stream {s} round {i} batched picks {pick}, not a near-tie of the f32 best (nor of its own alone)"
            );
        }
    }
}

#[test]
fn gemma3_fixture_bf16() {
    check_hybrid("gemma3_text", "logits_incremental");
}

#[test]
fn lfm2_fixture_bf16() {
    check_hybrid("lfm2", "logits_incremental");
}

#[test]
fn lfm2_moe_fixture_bf16() {
    check_hybrid("lfm2_moe", "logits_incremental");
}

#[test]
fn nemotron_h_fixture_bf16() {
    // transformers' own decode does not clamp dt; braid does, as its prefill.
    check_hybrid("nemotron_h", "logits_incremental_clamped");
}

#[test]
fn minimax_fixture_bf16() {
    check_hybrid("minimax", "logits_incremental");
}

#[test]
fn minimax_m2_fixture_bf16() {
    check_hybrid("minimax_m2", "logits_incremental");
}

#[test]
fn minimax_m3_fixture_bf16() {
    check_hybrid("minimax_m3_vl_text", "logits_incremental");
}

/// Gemma 3 with window-only KV on CUDA (blocks of 16, a window of 8: a
/// 200-token stream holds a few window blocks of its 13): greedy tokens and
/// logits equal those of full KV in every layer (`window_kv` off) whole and
/// in chunks of 48, and, fed the CPU's greedy continuation, every row's
/// top-1 agrees with the CPU's (f32, window-only too) at bf16 tolerance.
#[test]
fn gemma3_window_kv_matches_full_kv_and_the_cpu() {
    let Some(dev) = gpu() else { return };
    let dir = fixture_dir("gemma3_text");
    let greedy = |be: &mut ModelBackend<Cuda>, prompt: &[u32], cap: usize, n: usize| -> (Vec<f32>, Vec<u32>) {
        be.open(1).unwrap();
        let mut out = Vec::new();
        for c in prompt.chunks(cap) {
            out.extend(feed(be, 1, c));
        }
        let vocab = be.model().vocab();
        let mut toks = Vec::new();
        for _ in 0..n {
            let t = argmax(&out[out.len() - vocab..]) as u32;
            toks.push(t);
            out.extend(feed(be, 1, &[t]));
        }
        be.forget(1);
        (out, toks)
    };
    let (_src, m) = braid_models::open(&dev, &dir).unwrap();
    let vocab = m.vocab();
    let prompt: Vec<u32> = (0..200).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    for cap in [usize::MAX, 48] {
        let mut window = backend(&dev, &dir);
        assert!(window.fill().window_blocks_total > 0, "a window group");
        let (_src, m) = braid_models::open(&dev, &dir).unwrap();
        let mut full = ModelBackend::new(dev.clone(), m, BackendConfig { window_kv: false, ..gpu_config() }).unwrap();
        let (w, wt) = greedy(&mut window, &prompt, cap, 40);
        let (f, ft) = greedy(&mut full, &prompt, cap, 40);
        let (rel, _, _) = compare(&w, &f, vocab);
        let bits = w.iter().zip(&f).all(|(a, b)| a.to_bits() == b.to_bits());
        eprintln!("gemma3 window-only KV on CUDA (chunks of {cap}): rel err {rel:.2e} against full KV, bit-identical {bits}");
        assert_eq!(wt, ft, "greedy tokens, window-only against full KV (chunks of {cap})");
        assert!(rel < 1e-5, "window-only KV moved the logits by {rel} (chunks of {cap})");
    }
    // The CPU's greedy continuation, teacher-forced on CUDA.
    let cpu = braid_ops::cpu::Cpu::new(None);
    let (_src, m) = braid_models::open(&cpu, &dir).unwrap();
    let mut cb = ModelBackend::new(cpu, m, BackendConfig { kv_dtype: KvDtype::F32, ..gpu_config() }).unwrap();
    cb.open(1).unwrap();
    let mut want = feed(&mut cb, 1, &prompt);
    let mut seq = prompt.clone();
    for _ in 0..40 {
        let t = argmax(&want[want.len() - vocab..]) as u32;
        seq.push(t);
        want.extend(feed(&mut cb, 1, &[t]));
    }
    let mut gb = backend(&dev, &dir);
    gb.open(1).unwrap();
    let mut got = feed(&mut gb, 1, &prompt);
    for &t in &seq[200..] {
        got.extend(feed(&mut gb, 1, &[t]));
    }
    let (rel, agree, rows) = compare(&got, &want, vocab);
    eprintln!("gemma3 window-only KV, CUDA against the CPU: rel err {rel:.2e}, top-1 agreement {agree}/{rows}");
    assert!(rel < BF16_REL, "rel err {rel} over the bf16 tolerance");
    assert!(agree * 10 >= rows * 9, "top-1 agreement {agree}/{rows}");
    let decode = (199..rows).filter(|&i| argmax(&got[i * vocab..(i + 1) * vocab]) == argmax(&want[i * vocab..(i + 1) * vocab])).count();
    assert!(decode * 10 >= (rows - 199) * 9, "the decode rows' tokens: {decode}/{} agree with the CPU's", rows - 199);
}

#[test]
fn gemma4_fixtures_bf16() {
    check_hybrid("gemma4_text", "logits_incremental");
    check_hybrid("gemma4_text_moe", "logits_incremental");
}

/// The fixtures that vary each family's configuration (head and rotary
/// dims, soft-caps, tied heads, MoE scaling, grouped Mamba2 norms, the
/// M3 index width, …) on the GPU, as the base fixtures are above.
macro_rules! variant_bf16 {
    ($($test:ident: $name:literal, $key:literal;)*) => {$(
        #[test]
        fn $test() {
            check_hybrid($name, $key);
        }
    )*};
}

variant_bf16! {
    gemma3_softcap_bf16: "gemma3_softcap", "logits_incremental";
    gemma3_text_six_bf16: "gemma3_text_six", "logits_incremental";
    gemma4_text_k_eq_v_bf16: "gemma4_text_k_eq_v", "logits_incremental";
    granitemoehybrid_bf16: "granitemoehybrid", "logits_incremental";
    granitemoehybrid_rope_dense_bf16: "granitemoehybrid_rope_dense", "logits_incremental";
    lfm2_conv4_bf16: "lfm2_conv4", "logits_incremental";
    lfm2_moe_scaled_bf16: "lfm2_moe_scaled", "logits_incremental";
    llama_attention_bias_bf16: "llama_attention_bias", "logits_incremental";
    llama_linear_rope_bf16: "llama_linear_rope", "logits_incremental";
    minimax_m2_quarter_rope_bf16: "minimax_m2_quarter_rope", "logits_incremental";
    minimax_m3_wide_index_bf16: "minimax_m3_vl_text_wide_index", "logits_incremental";
    minimax_plain_bf16: "minimax_plain", "logits_incremental";
    nemotron_h_grouped_bf16: "nemotron_h_grouped", "logits_incremental_clamped";
    qwen3_tied_bf16: "qwen3_tied", "logits_incremental";
    qwen3_next_bf16: "qwen3_next", "logits_incremental";
    qwen3_next_dense_wide_keys_bf16: "qwen3_next_dense_wide_keys", "logits_incremental";
}
