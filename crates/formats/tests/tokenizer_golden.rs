//! GGUF tokenizers against llama.cpp: the `tokenize` and `greedy` entries of
//! /work/shared/golden/{smollm2,gemma3}-public.json (text → ids, prompt ids
//! with BOS, ids → text), plus round trips and special-token parsing on the
//! real vocabularies. Skipped, with a notice, when the model files are absent.

mod common;

use std::time::Instant;

use braid_formats::gguf::Gguf;
use braid_formats::tokenizer::{TokenKind, Tokenizer};
use common::{golden, model_path};
use serde_json::Value;

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

fn load(file: &str) -> Option<Tokenizer> {
    let path = model_path(file)?;
    let g = Gguf::open(&path).expect("open gguf");
    let t0 = Instant::now();
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer from gguf");
    eprintln!("{file}: tokenizer of {} tokens built in {:?}", tok.vocab_size(), t0.elapsed());
    Some(tok)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The golden file's `key` entries, of which there must be some.
fn entries<'a>(g: &'a Value, key: &str) -> &'a [Value] {
    let cases = g[key].as_array().unwrap();
    assert!(!cases.is_empty(), "no {key} entries");
    cases
}

/// Every `tokenize` entry: text → ids without BOS; and the ids decode back to the text.
fn check_tokenize(tok: &Tokenizer, g: &Value) {
    for c in entries(g, "tokenize") {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        let got = tok.encode(text, false).unwrap();
        assert_eq!(got, want, "encode({text:?})");
        assert_eq!(tok.decode(&want), text, "decode of {text:?}");
    }
}

/// Every `greedy` entry: the prompt with BOS (where the model adds one) gives
/// `prompt_ids`, and the generated `tokens` decode to `text`, whole and streamed.
fn check_greedy(tok: &Tokenizer, g: &Value) {
    for c in entries(g, "greedy") {
        let prompt = c["prompt"].as_str().unwrap();
        let want = ids(&c["prompt_ids"]);
        assert_eq!(tok.encode(prompt, true).unwrap(), want, "encode({prompt:?}, add_special)");
        let gen = ids(&c["tokens"]);
        let text = c["text"].as_str().unwrap();
        assert_eq!(tok.decode(&gen), text);
        let mut sd = tok.stream_decoder();
        let mut streamed: String = gen.iter().map(|&id| sd.push(id)).collect();
        streamed.push_str(&sd.flush());
        assert_eq!(streamed, text);
    }
}

/// The model's tokenizer, checked against the golden file's `tokenize` and
/// `greedy` entries; `None` (skipped) when either file is absent.
fn matches_golden(file: &str, golden_file: &str) -> Option<Tokenizer> {
    let (Some(tok), Some(g)) = (load(file), golden(golden_file)) else {
        return None;
    };
    check_tokenize(&tok, &g);
    check_greedy(&tok, &g);
    Some(tok)
}

#[test]
fn smollm2_matches_llama_cpp() {
    let Some(tok) = matches_golden(SMOLLM2, "smollm2-public.json") else {
        return;
    };
    // SmolLM2 adds no BOS: its greedy prompts start with the text itself.
    assert!(!tok.adds_bos());
}

#[test]
fn gemma3_matches_llama_cpp() {
    let Some(tok) = matches_golden(GEMMA3, "gemma3-public.json") else {
        return;
    };
    assert!(tok.adds_bos());
    assert_eq!(tok.bos(), tok.token_id("<bos>"));
}

#[test]
fn smollm2_specials_and_stops() {
    let Some(tok) = load(SMOLLM2) else { return };
    let im_start = tok.token_id("<|im_start|>").unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let nl = tok.encode("\n", false).unwrap();
    let user = tok.encode("user", false).unwrap();
    let hi = tok.encode("Hi", false).unwrap();
    // Special-token text is one token; the text around it is tokenized alone.
    let got = tok.encode("<|im_start|>user\nHi<|im_end|>\n", false).unwrap();
    let want: Vec<u32> = [vec![im_start], user, nl.clone(), hi, vec![im_end], nl].concat();
    assert_eq!(got, want);
    // Control tokens decode to nothing, or to their text when asked.
    assert_eq!(tok.decode(&got), "user\nHi\n");
    assert_eq!(tok.decode_with_special(&got), "<|im_start|>user\nHi<|im_end|>\n");
    assert!(tok.token_bytes(im_end).is_empty());
    assert_eq!(tok.kind(im_end), Some(TokenKind::Control));
    // Stops: EOS (<|im_end|> in this file) and <|endoftext|>.
    let stops = tok.stop_ids();
    assert!(stops.contains(&im_end));
    assert!(stops.contains(&tok.token_id("<|endoftext|>").unwrap()));
    assert!(stops.contains(&tok.eos().unwrap()));
    // A piece of a special token's text is plain text.
    assert_ne!(tok.encode("<|im_start", false).unwrap()[0], im_start);
    // Byte-level pieces: "Ġworld" is " world".
    let w = tok.token_id("Ġworld").unwrap();
    assert_eq!(tok.token_bytes(w), b" world");
    assert_eq!(tok.token_text(w), Some("Ġworld"));
}

#[test]
fn gemma3_specials_and_stops() {
    let Some(tok) = load(GEMMA3) else { return };
    let sot = tok.token_id("<start_of_turn>").unwrap();
    let eot = tok.token_id("<end_of_turn>").unwrap();
    let got = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n", true).unwrap();
    assert_eq!(got[0], tok.bos().unwrap());
    assert_eq!(got[1], sot);
    assert!(got.contains(&eot));
    assert_eq!(tok.decode(&got), "user\nHi\n");
    assert!(tok.stop_ids().contains(&eot));
    assert!(tok.stop_ids().contains(&tok.eos().unwrap()));
    // Byte fallback: a character missing from the vocabulary becomes <0xXX> tokens.
    let nl = tok.token_id("<0x0A>").unwrap();
    assert_eq!(tok.kind(nl), Some(TokenKind::Byte));
    assert_eq!(tok.token_bytes(nl), b"\n");
    // '▁' is a space.
    assert_eq!(tok.token_bytes(tok.token_id("▁world").unwrap()), b" world");
}

/// Text round-trips through encode/decode, including characters that need
/// byte fallback, and long inputs tokenize in reasonable time.
#[test]
fn round_trips_on_both_models() {
    let texts = [
        "Plain English text, with punctuation!",
        "  multiple   spaces\tand\ttabs\n\n\nnewlines  ",
        "日本語のテキスト、中文文本，한국어 텍스트",
        "emoji: 👩‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 and rare: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 𓀀",
        "code: fn main() { println!(\"{}\", 1 + 2); } // done",
        "",
    ];
    for file in [SMOLLM2, GEMMA3] {
        let Some(tok) = load(file) else { continue };
        for t in texts {
            let ids = tok.encode(t, false).unwrap();
            assert_eq!(tok.decode(&ids), t, "{file}: round trip of {t:?}");
        }
        let long: String = texts.iter().cycle().take(2000).copied().collect::<Vec<_>>().join(" ");
        let t0 = Instant::now();
        let ids = tok.encode(&long, false).unwrap();
        eprintln!("{file}: {} bytes → {} tokens in {:?}", long.len(), ids.len(), t0.elapsed());
        assert_eq!(tok.decode(&ids), long);
    }
}
