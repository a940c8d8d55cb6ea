#![no_main]

// The tokenizers crate panics on some malformed files, and braid catches
// those panics; libfuzzer-sys's panic hook would abort on them anyway, so
// this target keeps the default (unwinding) behaviour: only a panic that
// escapes braid is a crash.
libfuzzer_sys::fuzz_target!(init: { std::panic::set_hook(Box::new(|_| {})); }, |data: &[u8]| braid_formats::fuzz::tokenizer_json(data));
