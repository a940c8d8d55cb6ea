//! StreamDecoder: characters split over tokens come out whole, never as
//! U+FFFD, and the chunks joined equal `decode` of all ids. Runs on small
//! hand-made vocabularies (always) and on the real models (when present).

mod common;

use std::sync::Arc;

use braid_formats::gguf::Gguf;
use braid_formats::tokenizer::{GgufTokenizerSpec, StreamDecoder, Tokenizer};
use common::byte_char;

const TEXT: &str = "Hi 👋🏽 你好，世界! ∑∫√ 🇯🇵 naïve — 𝔘𝔫𝔦 ok";

/// A byte-level vocabulary with no merges: every byte is its own token, so
/// every multi-byte character is split over tokens.
fn bytes_only_bpe() -> Tokenizer {
    let mut tokens = vec!["<|endoftext|>".to_owned()];
    tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
    let mut types = vec![3];
    types.extend(std::iter::repeat_n(1, 256));
    Tokenizer::from_spec(GgufTokenizerSpec {
        model: "gpt2".into(),
        pre: Some("gpt-2".into()),
        tokens,
        token_types: Some(types),
        merges: Some(vec![]),
        eos: Some(0),
        ..Default::default()
    })
    .unwrap()
}

/// A SentencePiece vocabulary of ASCII letters, '▁' and the 256 byte tokens:
/// everything else goes through byte fallback.
fn byte_fallback_spm() -> Tokenizer {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into(), "▁".into()];
    let mut types = vec![2, 3, 3, 1];
    for c in ('a'..='z').chain('A'..='Z') {
        tokens.push(c.to_string());
        types.push(1);
    }
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let scores = vec![0.0; tokens.len()];
    Tokenizer::from_spec(GgufTokenizerSpec {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        bos: Some(1),
        eos: Some(2),
        unk: Some(0),
        add_space_prefix: Some(false),
        ..Default::default()
    })
    .unwrap()
}

/// Streams `ids` one by one and checks every chunk.
fn check_stream(tok: &Tokenizer, ids: &[u32], text: &str) {
    let whole = tok.decode(ids);
    assert_eq!(whole, text);
    let mut sd = StreamDecoder::new(tok);
    let mut chunks = Vec::new();
    let mut held_back = 0;
    for &id in ids {
        let c = sd.push(id);
        assert!(!c.contains('\u{FFFD}'), "chunk {c:?} has a replacement character");
        if sd.pending_len() > 0 {
            held_back += 1;
        }
        chunks.push(c);
    }
    chunks.push(sd.flush());
    assert_eq!(chunks.concat(), whole);
    // Each chunk is whole characters of the text, in order.
    let mut at = 0;
    for c in &chunks {
        assert!(text.is_char_boundary(at + c.len()));
        assert_eq!(&text[at..at + c.len()], c);
        at += c.len();
    }
    // The text has multi-byte characters, so something had to wait.
    let multibyte_split = ids.iter().any(|&id| std::str::from_utf8(tok.token_bytes(id)).is_err());
    assert_eq!(held_back > 0, multibyte_split);
}

#[test]
fn byte_level_split_characters_come_out_whole() {
    let tok = bytes_only_bpe();
    let ids = tok.encode(TEXT, false).unwrap();
    // No merges: one token per byte.
    assert_eq!(ids.len(), TEXT.len());
    check_stream(&tok, &ids, TEXT);
}

#[test]
fn byte_fallback_split_characters_come_out_whole() {
    let tok = byte_fallback_spm();
    let ids = tok.encode(TEXT, false).unwrap();
    let byte_tokens = ids.iter().filter(|&&id| tok.token_text(id).unwrap().starts_with("<0x")).count();
    assert!(byte_tokens > 20, "expected byte fallback, got {byte_tokens} byte tokens");
    check_stream(&tok, &ids, TEXT);
}

#[test]
fn invalid_bytes_become_replacement_characters() {
    let tok = byte_fallback_spm();
    let byte = |b: u8| tok.token_id(&format!("<0x{b:02X}>")).unwrap();
    let a = tok.token_id("a").unwrap();
    // A lone continuation byte is invalid at once; a truncated 3-byte
    // sequence before 'a' is invalid once 'a' arrives.
    let ids = [byte(0x80), a, byte(0xE2), byte(0x82), a, byte(0xF0), byte(0x9F)];
    let mut sd = StreamDecoder::new(&tok);
    let chunks: Vec<String> = ids.iter().map(|&id| sd.push(id)).collect();
    assert_eq!(chunks, vec!["\u{FFFD}", "a", "", "", "\u{FFFD}a", "", ""]);
    // The stream ends inside a character: flush gives U+FFFD.
    assert_eq!(sd.flush(), "\u{FFFD}");
    assert_eq!(sd.pending_len(), 0);
    assert_eq!(tok.decode(&ids), "\u{FFFD}a\u{FFFD}a\u{FFFD}");
}

#[test]
fn control_tokens_stream_as_nothing() {
    let tok = bytes_only_bpe();
    let mut ids = tok.encode("ok", false).unwrap();
    ids.push(tok.eos().unwrap());
    let mut sd = StreamDecoder::new(Arc::new(tok));
    let out: String = ids.iter().map(|&id| sd.push(id)).collect();
    assert_eq!(out, "ok");
    assert!(sd.tokenizer().is_stop(*ids.last().unwrap()));
}

#[test]
fn real_models_stream_emoji_and_cjk() {
    let dir = common::model_dir();
    for file in ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"] {
        let path = dir.join(file);
        if !path.exists() {
            eprintln!("SKIP: {} not found", path.display());
            continue;
        }
        let tok = Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap();
        let text = "emoji 🎉🚀👩‍💻 and 東京 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 𓀀 done";
        let ids = tok.encode(text, false).unwrap();
        check_stream(&tok, &ids, text);
        // These vocabularies split at least one of these characters over tokens.
        assert!(ids.iter().any(|&id| std::str::from_utf8(tok.token_bytes(id)).is_err()), "{file}");
    }
}

#[test]
fn tokenizer_and_template_are_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
    check::<StreamDecoder<Arc<Tokenizer>>>();
    check::<braid_formats::template::ChatTemplate>();
}
