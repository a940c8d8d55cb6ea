//! Fuzz targets, shared by the `cargo fuzz` targets under `fuzz/` and the
//! seeded-mutation tests that run on stable Rust (see [`run`]). Each
//! target takes arbitrary bytes and must return, never panic or hang:
//! a bad input is an error, not a crash.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::bytes::Bytes;
use crate::gguf::Gguf;
use crate::template::ChatTemplate;
use crate::tokenizer::{GgufTokenizerSpec, Tokenizer};

/// GGUF parsing: header, metadata, tensor infos; then every tensor's view,
/// the tokenizer and the chat template, when the file has them.
pub fn gguf(data: &[u8]) {
    let Ok(g) = Gguf::from_bytes("fuzz.gguf", Bytes::from_vec(data.to_vec())) else { return };
    let names: Vec<String> = g.tensor_names().map(str::to_string).collect();
    for n in names {
        let _ = g.tensor(&n);
    }
    if let Ok(tok) = Tokenizer::from_gguf(&g) {
        let _ = ChatTemplate::from_gguf(&g, &tok);
        let _ = tok.encode("Hello <|im_start|> world", true);
    }
}

/// A safetensors file's header.
pub fn safetensors_header(data: &[u8]) {
    let _ = crate::safetensors::header_entries(Path::new("fuzz.safetensors"), &Bytes::from_vec(data.to_vec()));
}

/// `tokenizer.json` loading, then a round of encoding and decoding.
pub fn tokenizer_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(tok) = Tokenizer::from_tokenizer_json_str(text, "fuzz/tokenizer.json", None) {
        exercise(&tok, "Hi <|im_start|>there\n  é 😀");
    }
}

/// A GGUF tokenizer built from arbitrary fields, on arbitrary text. The
/// bytes: a model selector, then NUL-separated tokens up to a 0xFF 0xFF
/// mark, then the text to encode; token types and merges derive from them.
pub fn gguf_tokenizer(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else { return };
    let (vocab, text) = match rest.windows(2).position(|w| w == [0xFF, 0xFF]) {
        Some(i) => (&rest[..i], &rest[i + 2..]),
        None => (rest, &b""[..]),
    };
    let tokens: Vec<String> = vocab.split(|&b| b == 0).take(4096).map(|t| String::from_utf8_lossy(t).into_owned()).collect();
    let n = tokens.len();
    let types: Vec<i32> = tokens.iter().map(|t| (t.len() % 7) as i32).collect();
    // Merges of neighbouring tokens, as "left right" pairs.
    let merges: Vec<String> = tokens.windows(2).filter(|w| !w[0].contains(' ') && !w[1].contains(' ')).map(|w| format!("{} {}", w[0], w[1])).collect();
    let id = |k: u8| Some(u32::from(k) % (n as u32 + 2));
    let spec = GgufTokenizerSpec {
        model: if kind & 1 == 0 { "gpt2".into() } else { "llama".into() },
        pre: [None, Some("default".to_string()), Some("smollm".to_string()), Some("llama3".to_string())][(kind as usize >> 1) % 4].clone(),
        tokens,
        scores: (kind & 8 != 0).then(|| (0..n).map(|i| -(i as f32)).collect()),
        token_types: (kind & 16 != 0).then_some(types),
        merges: Some(merges),
        bos: id(kind.wrapping_mul(3)).filter(|_| kind & 32 != 0),
        eos: id(kind.wrapping_mul(5)),
        unk: id(kind.wrapping_mul(7)).filter(|_| kind & 64 != 0),
        add_bos: Some(kind & 128 != 0),
        ..GgufTokenizerSpec::default()
    };
    let Ok(tok) = Tokenizer::from_spec(spec) else { return };
    exercise(&tok, &String::from_utf8_lossy(text));
}

/// Encodes `text` every way the server does and decodes the ids back.
fn exercise(tok: &Tokenizer, text: &str) {
    for add in [false, true] {
        let _ = tok.encode(text, add);
        let _ = tok.encode_text(text, add);
        let rendered = format!("<|im_start|>user\n{}<|im_end|>", tok.quote(text));
        if let Ok(ids) = tok.encode_rendered(&rendered, add) {
            let _ = tok.decode(&ids);
            let _ = tok.decode_with_special(&ids);
            let mut d = tok.stream_decoder();
            for &i in &ids {
                let _ = d.push(i);
            }
        }
    }
    let _ = tok.decode(&[0, 1, u32::MAX, tok.vocab_size() as u32]);
}

/// Chat templates as models ship them (ChatML with tools, Gemma's turns,
/// Llama 3's headers), rendered with hostile messages: the bytes as a JSON
/// messages array when they parse, else split into roles and contents.
pub fn chat_template(data: &[u8]) {
    const TEMPLATES: &[&str] = &[
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = m['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}",
        "{% for m in messages %}{% if '</think>' in m.content %}{{ m.content.split('</think>')[-1].lstrip('\\n') }}{% endif %}<|start_header_id|>{{ m.role }}<|end_header_id|>\\n\\n{{ m.content | trim }}<|eot_id|>{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{% endfor %}",
    ];
    let messages: Vec<serde_json::Value> = match serde_json::from_slice::<serde_json::Value>(data) {
        Ok(serde_json::Value::Array(a)) => a,
        Ok(other) => vec![serde_json::json!({"role": "user", "content": other})],
        Err(_) => data
            .split(|&b| b == b'\n')
            .map(|l| {
                let l = String::from_utf8_lossy(l);
                let (role, content) = l.split_once(':').unwrap_or(("user", &l));
                serde_json::json!({"role": role, "content": content})
            })
            .collect(),
    };
    let tok = byte_tokenizer();
    let quoted: Vec<serde_json::Value> = messages.iter().map(|m| quote_all(&tok, m)).collect();
    let mut vars = serde_json::Map::new();
    vars.insert("tools".into(), serde_json::json!([{"type": "function", "function": {"name": "f", "description": String::from_utf8_lossy(data)}}]));
    for src in TEMPLATES {
        let Ok(t) = ChatTemplate::new(src, "<s>", "</s>") else { continue };
        for gen in [false, true] {
            if let Ok(text) = t.render_with(&quoted, gen, &vars) {
                let _ = tok.encode_rendered(&text, true);
            }
        }
    }
}

fn quote_all(tok: &Tokenizer, v: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::String(s) => Value::String(tok.quote(s).into_owned()),
        Value::Array(a) => Value::Array(a.iter().map(|x| quote_all(tok, x)).collect()),
        Value::Object(o) => Value::Object(o.iter().map(|(k, x)| (tok.quote(k).into_owned(), quote_all(tok, x))).collect()),
        other => other.clone(),
    }
}

/// One token per byte and the ChatML control tokens.
fn byte_tokenizer() -> Tokenizer {
    let byte_char = |b: u8| {
        let printable = |x: u8| (33..=126).contains(&x) || (161..=172).contains(&x) || (174..=255).contains(&x);
        if printable(b) {
            return b as char;
        }
        char::from_u32(256 + (0..b).filter(|&x| !printable(x)).count() as u32).unwrap_or('?')
    };
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let mut types = vec![1; 256];
    for t in ["<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<|eot_id|>", "<s>", "</s>"] {
        tokens.push(t.into());
        types.push(3);
    }
    let spec =
        GgufTokenizerSpec { model: "gpt2".into(), tokens, token_types: Some(types), merges: Some(Vec::new()), add_bos: Some(false), ..Default::default() };
    Tokenizer::from_spec(spec).unwrap_or_else(|e| unreachable!("the byte tokenizer is valid: {e}"))
}

/// What a seeded run did.
#[derive(Debug, Clone, Copy)]
pub struct Report {
    pub executions: u64,
    pub corpus: usize,
}

/// Seeded mutation fuzzing on stable Rust: starting from the files in
/// `corpus` (and an empty input), mutate (flip bits, set interesting
/// bytes, insert, delete, duplicate and splice ranges) and run `target`
/// until `budget` passes. A panic saves the input under `crashes` and is
/// returned as the error, with the file's path. The seed is fixed, so a
/// run is reproducible.
pub fn run(corpus: &Path, crashes: &Path, budget: Duration, target: fn(&[u8])) -> Result<Report, String> {
    let mut seeds: Vec<Vec<u8>> = vec![Vec::new()];
    if let Ok(dir) = std::fs::read_dir(corpus) {
        let mut files: Vec<_> = dir.flatten().map(|e| e.path()).collect();
        files.sort();
        seeds.extend(files.iter().filter_map(|p| std::fs::read(p).ok()));
    }
    let corpus_size = seeds.len() - 1;
    // Panics that the code under test catches itself (the tokenizers
    // crate's, say) would print a backtrace each: quiet while fuzzing.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = run_quiet(seeds, corpus_size, crashes, budget, target);
    std::panic::set_hook(hook);
    r
}

fn run_quiet(seeds: Vec<Vec<u8>>, corpus_size: usize, crashes: &Path, budget: Duration, target: fn(&[u8])) -> Result<Report, String> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let start = Instant::now();
    let mut executions = 0u64;
    let mut input: Vec<u8>;
    loop {
        // Seeds first as they are, then mutants.
        input = if (executions as usize) < seeds.len() { seeds[executions as usize].clone() } else { mutate(&mut rng, &seeds) };
        let r = std::panic::catch_unwind(|| target(&input));
        executions += 1;
        if r.is_err() {
            let _ = std::fs::create_dir_all(crashes);
            let path = crashes.join(format!("crash-{:016x}", fnv(&input)));
            let _ = std::fs::write(&path, &input);
            return Err(format!("the target panicked on input saved as {} (after {executions} executions)", path.display()));
        }
        if executions as usize >= seeds.len() && start.elapsed() >= budget {
            return Ok(Report { executions, corpus: corpus_size });
        }
    }
}

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut v = seeds[rng.below(seeds.len())].clone();
    for _ in 0..1 + rng.below(8) {
        let len = v.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                v[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                const INTERESTING: [u8; 8] = [0, 1, 0x7F, 0x80, 0xFF, b'{', b'"', b'<'];
                let i = rng.below(len);
                v[i] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(i..i, bytes);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                v.drain(i..i + n);
            }
            4 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                let chunk = v[i..i + n].to_vec();
                let at = rng.below(len + 1);
                v.splice(at..at, chunk);
            }
            5 => {
                let other = &seeds[rng.below(seeds.len())];
                if !other.is_empty() {
                    let i = rng.below(other.len());
                    let cut = rng.below(v.len() + 1);
                    v.truncate(cut);
                    v.extend_from_slice(&other[i..]);
                }
            }
            6 if len >= 8 => {
                // A little-endian length or count set to an extreme.
                let i = rng.below(len - 7);
                let x: u64 = [0, 1, 0xFF, 0xFFFF, u32::MAX as u64, u64::MAX, 1 << 40][rng.below(7)];
                v[i..i + 8].copy_from_slice(&x.to_le_bytes());
            }
            _ => {}
        }
    }
    v.truncate(1 << 20);
    v
}

/// xorshift64*: small, fixed, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}
