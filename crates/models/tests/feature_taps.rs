//! Feature taps: the hidden rows a drafter reads through `features()`,
//! checked against the rows transformers returns (`output_hidden_states`)
//! for the gemma3_text fixture (made by `scripts/fixtures/make_dflash.py`),
//! and the same rows whichever way the forwards are cut.

mod fixtures_common;

use braid_engine::{Backend, Chunk, DecodeRow, Pick, Step};
use braid_models::ModelBackend;
use braid_ops::cpu::Cpu;
use fixtures_common::*;

/// The drafter fixture's taps: the outputs of layers 0 and 2 of 4.
const TAPS: [usize; 2] = [0, 2];
const HIDDEN: usize = 64;
const WIDTH: usize = TAPS.len() * HIDDEN;

fn tapped() -> (Fixture, ModelBackend<Cpu>) {
    let fx = Fixture::load("gemma3_text");
    let mut be = fx.backend();
    be.set_feature_layers(&TAPS, HIDDEN).unwrap();
    assert_eq!(be.capabilities().feature_dim, WIDTH);
    (fx, be)
}

fn features(be: &ModelBackend<Cpu>) -> Vec<f32> {
    be.features().expect("a tapping backend has features").to_vec()
}

/// `tokens` fed to a new stream in chunks of `cap`; every row's features.
fn stepped_features(be: &mut ModelBackend<Cpu>, stream: u64, tokens: &[u32], cap: usize) -> Vec<f32> {
    be.open(stream).unwrap();
    let mut out = Vec::new();
    for c in tokens.chunks(cap) {
        run_rows(be, stream, c);
        out.extend(features(be));
    }
    out
}

#[test]
fn features_are_the_hidden_states_transformers_returns() {
    let (fx, mut be) = tapped();
    let reference = read_safetensors(&fixtures_dir().join("dflash_gemma3/reference.safetensors"));
    let want = &reference["features"];
    assert_eq!(want.shape, vec![fx.tokens.len(), WIDTH]);
    be.open(1).unwrap();
    run_rows(&mut be, 1, &fx.tokens);
    assert_close("features", &features(&be), &want.data, WIDTH, 1e-4);
    // They are the layers' rows, not something near them: layer 1's rows differ.
    let mut other = fx.backend();
    other.set_feature_layers(&[1, 2], HIDDEN).unwrap();
    other.open(1).unwrap();
    run_rows(&mut other, 1, &fx.tokens);
    assert!(diff(&features(&other), &want.data, WIDTH).max > 1e-2);
}

#[test]
fn stepped_features_equal_whole() {
    let (fx, mut be) = tapped();
    let whole = stepped_features(&mut be, 1, &fx.tokens, fx.tokens.len());
    assert_eq!(whole.len(), fx.tokens.len() * WIDTH);
    for cap in [1, 3, 7, 16] {
        let got = stepped_features(&mut be, 10 + cap as u64, &fx.tokens, cap);
        // The CPU is batch invariant: the same rows, bit for bit.
        assert_bit_identical(&format!("features in chunks of {cap}"), &got, &whole, WIDTH);
    }
}

#[test]
fn a_shared_round_lists_decode_rows_then_the_chunk() {
    let (fx, mut be) = tapped();
    let (a, b) = (&fx.tokens[..20], &fx.tokens[20..]);
    // Each stream alone.
    let alone_a = stepped_features(&mut be, 1, &fx.tokens[..21], 20);
    let alone_b = stepped_features(&mut be, 2, b, b.len());
    // Stream 3 decodes token 20 after a's 20 rows while stream 4 prefills b.
    be.open(3).unwrap();
    run_rows(&mut be, 3, a);
    be.open(4).unwrap();
    let rows = [DecodeRow { stream: 3, tokens: vec![fx.tokens[20]] }];
    be.round(Step::new(&rows, Some((4, Chunk { start: 0, tokens: b, want_logits: true })), Pick::Argmax)).unwrap();
    let got = features(&be);
    assert_eq!(got.len(), (1 + b.len()) * WIDTH);
    assert_bit_identical("the decode row", &got[..WIDTH], &alone_a[20 * WIDTH..], WIDTH);
    assert_bit_identical("the chunk", &got[WIDTH..], &alone_b, WIDTH);
}

#[test]
fn taps_that_cannot_be_served_are_refused() {
    let fx = Fixture::load("gemma3_text");
    let mut be = fx.backend();
    let past = be.set_feature_layers(&[0, 4], HIDDEN).unwrap_err().to_string();
    assert!(past.contains("layer 4 does not exist"), "{past}");
    let last = be.set_feature_layers(&[3], HIDDEN).unwrap_err().to_string();
    assert!(last.contains("last"), "{last}");
    assert_eq!(be.capabilities().feature_dim, 0);
    assert!(be.features().is_none());
    // A width that is not the model's is caught at the first forward.
    be.set_feature_layers(&[0], HIDDEN + 1).unwrap();
    be.open(1).unwrap();
    let err = be.decode_logits(&[DecodeRow { stream: 1, tokens: fx.tokens[..4].to_vec() }]).unwrap_err().to_string();
    assert!(err.contains("feature tap"), "{err}");
}
