//! The hybrid families on the tiny random fixtures, against transformers:
//! LFM2, LFM2-MoE, Nemotron-H, MiniMax (linear attention), MiniMax-M2 and
//! the MiniMax-M3 text tower (block-sparse attention), from HF folders.
//!
//! Every family: declared state kinds; logits of one full forward and of
//! incremental decode within 1e-4 of transformers; chunk caps 1, 3, 7 and
//! whole bit-identical (each family declares chunk invariance: its scans run
//! step by step); marks restored into a fresh stream continue bit-identically;
//! several streams in one round bit-identical to each alone.

mod fixtures_common;
use fixtures_common::*;

const TOL: f32 = 1e-4;

/// One test per check, so a failure names the family and the check.
macro_rules! family {
    ($name:ident, $fixture:literal, incremental = $inc:literal) => {
        mod $name {
            use super::*;

            #[test]
            fn states() {
                let fx = Fixture::load($fixture);
                fx.check_states();
                assert!(fx.backend().model().chunk_invariant(), "{} should declare chunk invariance", $fixture);
            }

            #[test]
            fn full() {
                Fixture::load($fixture).check_full(TOL);
            }

            #[test]
            fn incremental() {
                let fx = Fixture::load($fixture);
                let mut be = fx.backend();
                let got = fixtures_common::incremental(&mut be, 1, &fx.tokens, PREFILL);
                assert_close(&format!("{} incremental vs {}", $fixture, $inc), &got, fx.logits($inc), fx.vocab, TOL);
            }

            #[test]
            fn stepped() {
                Fixture::load($fixture).check_stepped(TOL);
            }

            #[test]
            fn marks() {
                Fixture::load($fixture).check_marks(TOL);
            }

            #[test]
            fn multi_stream() {
                Fixture::load($fixture).check_multi_stream();
            }
        }
    };
}

family!(lfm2, "lfm2", incremental = "logits_incremental");
family!(lfm2_moe, "lfm2_moe", incremental = "logits_incremental");
