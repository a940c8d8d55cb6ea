//! The attention families on the tiny random fixtures, against transformers:
//! Llama, Qwen3, Gemma 3 and Gemma 4 (dense and MoE) from HF folders.
//!
//! Every family: layer states as meta.json declares them; logits of one
//! whole-sequence prefill and of incremental decode within `TOL` of the
//! reference; chunk caps 1, 3, 7 and whole bit-identical; marks restored
//! into new streams; several streams batched bit-identical to each alone.

mod fixtures_common;
use fixtures_common::*;

/// Absolute logit tolerance (logits here reach |60| with std ≈ 8).
const TOL: f32 = 1e-4;

macro_rules! family {
    ($m:ident, $name:literal) => {
        mod $m {
            use super::*;

            #[test]
            fn layer_states_match_meta() {
                Fixture::load($name).check_states();
            }

            #[test]
            fn full_forward() {
                Fixture::load($name).check_full(TOL);
            }

            #[test]
            fn incremental_decode() {
                Fixture::load($name).check_incremental(TOL);
            }

            #[test]
            fn stepped_prefill() {
                Fixture::load($name).check_stepped(TOL);
            }

            #[test]
            fn marks() {
                Fixture::load($name).check_marks(TOL);
            }

            #[test]
            fn multi_stream() {
                Fixture::load($name).check_multi_stream();
            }
        }
    };
}

family!(llama, "llama");
family!(qwen3, "qwen3");
family!(gemma3, "gemma3_text");
