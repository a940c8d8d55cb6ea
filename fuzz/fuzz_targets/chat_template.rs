#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| braid_formats::fuzz::chat_template(data));
