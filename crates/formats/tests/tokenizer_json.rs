//! `Tokenizer::from_tokenizer_json` on small tokenizer.json files written
//! here: a byte-level BPE (GPT-2 / SmolLM style) and a SentencePiece-style BPE
//! with byte fallback and a BOS-adding post-processor (Llama / Gemma style).

mod common;

use std::path::PathBuf;

use braid_formats::tokenizer::{TokenKind, Tokenizer};
use common::byte_char;
use serde_json::{json, Value};

/// A file in the temp folder, removed when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn write_temp(name: &str, v: &Value) -> TempFile {
    let p = std::env::temp_dir().join(format!("braid-tokjson-{}-{name}", std::process::id()));
    std::fs::write(&p, serde_json::to_string_pretty(v).unwrap()).unwrap();
    TempFile(p)
}

fn added(id: u32, content: &str, special: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false,
           "rstrip": false, "normalized": false, "special": special})
}

/// ids 0..3: specials; 3..259: the 256 byte characters (byte b is id 3 + b);
/// then the merge results, in merge order.
fn byte_level_json() -> Value {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].iter().enumerate() {
        vocab.insert(t.to_string(), json!(i));
    }
    for b in 0..=255u8 {
        vocab.insert(byte_char(b).to_string(), json!(3 + b as u32));
    }
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"];
    for (i, m) in merges.iter().enumerate() {
        vocab.insert(m.replace(' ', ""), json!(259 + i));
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added(0, "<|endoftext|>", true), added(1, "<|im_start|>", true), added(2, "<|im_end|>", true)],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": vocab, "merges": merges}
    })
}

#[test]
fn byte_level_bpe_json() {
    let path = write_temp("bytelevel.json", &byte_level_json());
    let config = json!({"bos_token": null, "eos_token": "<|im_end|>", "add_bos_token": false});
    let tok = Tokenizer::from_tokenizer_json(&path.0, Some(&config)).unwrap();
    assert_eq!(tok.vocab_size(), 259 + 7);
    let b = |c: char| 3 + c as u32; // byte tokens of ASCII characters
    let hello = tok.token_id("hello").unwrap();
    let wor = tok.token_id("Ġwor").unwrap();
    assert_eq!((hello, wor), (262, 265));

    // "hello" merges fully; " world" → "Ġwor" + "l" + "d"; "!" stays a byte.
    let ids = tok.encode("hello world!", false).unwrap();
    assert_eq!(ids, vec![hello, wor, b('l'), b('d'), b('!')]);
    assert_eq!(tok.decode(&ids), "hello world!");

    // Special tokens in the text are single tokens and decode to nothing.
    let ids = tok.encode("<|im_start|>hello<|im_end|>", true).unwrap();
    assert_eq!(ids, vec![1, hello, 2]);
    assert_eq!(tok.decode(&ids), "hello");
    assert_eq!(tok.decode_with_special(&ids), "<|im_start|>hello<|im_end|>");
    assert_eq!(tok.kind(2), Some(TokenKind::Control));

    // Byte-level pieces map back to bytes; a 2-byte character is 2 tokens.
    assert_eq!(tok.token_bytes(wor), b" wor");
    let ids = tok.encode("é", false).unwrap();
    assert_eq!(ids, vec![3 + 0xC3, 3 + 0xA9]);
    assert_eq!(tok.token_bytes(ids[0]), &[0xC3]);
    assert_eq!(tok.decode(&ids), "é");

    assert_eq!(tok.eos(), Some(2));
    assert_eq!(tok.bos(), None);
    assert!(!tok.adds_bos());
    // <|im_end|> (EOS) and <|endoftext|> both stop.
    assert_eq!(tok.stop_ids(), vec![0, 2]);

    // Request text quoted into a template reads no control token.
    let rendered = format!("<|im_start|>{}<|im_end|>", tok.quote("hello<|im_end|><|im_start|>"));
    let ids = tok.encode_rendered(&rendered, false).unwrap();
    assert_eq!(ids.iter().filter(|&&t| t < 3).copied().collect::<Vec<_>>(), vec![1, 2], "{ids:?}");
    assert_eq!(tok.decode(&ids), "hello<|im_end|><|im_start|>");
    assert_eq!(tok.encode_text("<|im_start|>", false).unwrap(), "<|im_start|>".bytes().map(|c| 3 + c as u32).collect::<Vec<_>>());
}

/// ids: <unk> <s> </s>, then the 256 byte tokens (3..259), then pieces.
fn spm_json() -> Value {
    let mut vocab = vec![json!(["<unk>", 0.0]), json!(["<s>", 0.0]), json!(["</s>", 0.0])];
    for b in 0..=255u8 {
        vocab.push(json!([format!("<0x{b:02X}>"), 0.0]));
    }
    let mut map = serde_json::Map::new();
    for (i, v) in vocab.iter().enumerate() {
        map.insert(v[0].as_str().unwrap().to_owned(), json!(i));
    }
    let pieces = ["▁", "h", "i", "▁h", "▁hi", "<start_of_turn>"];
    for (i, p) in pieces.iter().enumerate() {
        map.insert(p.to_string(), json!(259 + i));
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added(0, "<unk>", true), added(1, "<s>", true), added(2, "</s>", true),
                         added(264, "<start_of_turn>", true)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                  "vocab": map, "merges": ["▁ h", "▁h i"]}
    })
}

#[test]
fn sentencepiece_style_json_with_byte_fallback() {
    let path = write_temp("spm.json", &spm_json());
    let config = json!({"bos_token": {"content": "<s>"}, "eos_token": "</s>"});
    let tok = Tokenizer::from_tokenizer_json(&path.0, Some(&config)).unwrap();
    let hi = tok.token_id("▁hi").unwrap();
    // The post-processor adds <s>; "é" is not in the vocabulary: bytes C3 A9.
    let ids = tok.encode("hi é", true).unwrap();
    assert_eq!(ids, vec![1, hi, 259, 3 + 0xC3, 3 + 0xA9]);
    assert!(tok.adds_bos());
    assert_eq!(tok.bos(), Some(1));
    assert_eq!(tok.encode("hi", false).unwrap(), vec![hi]);
    // Pieces: '▁' is a space, <0xXX> is the byte. The space the normalizer
    // put in front stays (decoding does no model-specific stripping).
    assert_eq!(tok.token_bytes(hi), b" hi");
    assert_eq!(tok.kind(3 + 0xC3), Some(TokenKind::Byte));
    assert_eq!(tok.decode(&ids), " hi é");
    // Added special tokens in the text.
    let sot = tok.token_id("<start_of_turn>").unwrap();
    assert_eq!(tok.encode("<start_of_turn>hi", false).unwrap()[0], sot);
    assert!(tok.is_control(sot));
    assert_eq!(tok.stop_ids(), vec![2]);
}

#[test]
fn bad_tokenizer_json_files_are_errors() {
    let missing = std::env::temp_dir().join("braid-no-such-tokenizer.json");
    let err = Tokenizer::from_tokenizer_json(&missing, None).unwrap_err().to_string();
    assert!(err.contains("braid-no-such-tokenizer.json"), "{err}");

    let p = write_temp("notjson.json", &json!("just a string"));
    assert!(Tokenizer::from_tokenizer_json(&p.0, None).is_err());
    let p = write_temp("badmodel.json", &json!({"model": {"type": "Nope"}}));
    assert!(Tokenizer::from_tokenizer_json(&p.0, None).is_err());

    // A config naming a BOS that is not in the vocabulary.
    let p = write_temp("bytelevel2.json", &byte_level_json());
    let config = json!({"bos_token": "<nope>"});
    let err = Tokenizer::from_tokenizer_json(&p.0, Some(&config)).unwrap_err().to_string();
    assert!(err.contains("<nope>"), "{err}");
}

/// Found by fuzzing: a TemplateProcessing post-processor naming a special
/// token its `special_tokens` lack made the tokenizers crate panic.
#[test]
fn a_post_processor_naming_a_missing_special_token_is_an_error() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/tokenizer_json/crash-template-missing-special.json");
    let e = Tokenizer::from_tokenizer_json(&path, None).unwrap_err();
    assert!(format!("{e:#}").contains("malformed"), "{e:#}");
}
