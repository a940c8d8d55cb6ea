//! Chat templates: SmolLM2's and Qwen2.5's GGUF templates against llama.cpp's rendering
//! (golden `template` entries), Jinja2 behaviors that model templates rely on
//! (trim_blocks/lstrip_blocks, Python string methods, tojson), and errors.

mod common;

use braid_formats::gguf::Gguf;
use braid_formats::template::{ChatMessage, ChatTemplate};
use braid_formats::tokenizer::Tokenizer;
use common::{golden, model_path};
use serde_json::json;

fn msgs(v: &[(&str, &str)]) -> Vec<ChatMessage> {
    v.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect()
}

/// The GGUF's own ChatML template renders every golden case as llama.cpp
/// did, and its special-token text tokenizes to the special tokens.
fn chatml_template_matches_llama_cpp(file: &str, golden_file: &str) {
    let (Some(path), Some(g)) = (model_path(file), golden(golden_file)) else {
        return;
    };
    let gguf = Gguf::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let tmpl = ChatTemplate::from_gguf(&gguf, &tok).unwrap().expect("the model ships a template");
    let cases = g["template"].as_array().unwrap();
    assert!(!cases.is_empty());
    for c in cases {
        let messages: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let want = c["prompt"].as_str().unwrap();
        assert_eq!(tmpl.render(&messages, true).unwrap(), want);
        // Without the generation prompt the assistant header is not there.
        let bare = tmpl.render(&messages, false).unwrap();
        assert_eq!(want.strip_suffix("<|im_start|>assistant\n"), Some(bare.as_str()));
        let ids = tok.encode(want, true).unwrap();
        assert_eq!(ids[0], tok.token_id("<|im_start|>").unwrap());
        assert_eq!(tok.decode_with_special(&ids), want);
    }
}

#[test]
fn smollm2_gguf_template_matches_llama_cpp() {
    chatml_template_matches_llama_cpp("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-public.json");
}

#[test]
fn qwen25_gguf_template_matches_llama_cpp() {
    chatml_template_matches_llama_cpp("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen25coder05-public.json");
}

#[test]
fn gemma3_gguf_has_no_template() {
    let Some(path) = model_path("gemma-3-270m-q4_k_m.gguf") else {
        return;
    };
    let gguf = Gguf::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    assert!(ChatTemplate::from_gguf(&gguf, &tok).unwrap().is_none());
}

#[test]
fn raise_exception_gives_the_templates_message() {
    let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user message') }}{% endif %}ok";
    let t = ChatTemplate::new(src, "", "").unwrap();
    assert_eq!(t.render(&msgs(&[("user", "hi")]), false).unwrap(), "ok");
    let err = t.render(&msgs(&[("assistant", "hi")]), false).unwrap_err().to_string();
    eprintln!("{err}");
    assert!(err.contains("Conversations must start with a user message"), "{err}");
    assert!(err.contains("raised"), "{err}");
}

#[test]
fn syntax_errors_are_errors_with_a_line() {
    for src in ["{% for m in messages %}{{ m.content }}", "line one\n{{ messages[0].content }\n", "{% if %}x{% endif %}", "{{ 'unclosed }}"] {
        let err = ChatTemplate::new(src, "", "").unwrap_err().to_string();
        eprintln!("{err}");
        assert!(err.contains("chat template"), "{err}");
        assert!(err.contains("syntax error"), "{src:?}: {err}");
        assert!(err.contains("line "), "{src:?}: {err}");
    }
    // A runtime error (unknown filter, bad call) is also an error, not a panic.
    let t = ChatTemplate::new("{{ messages | no_such_filter }}", "", "");
    let err = match t {
        Err(e) => e.to_string(),
        Ok(t) => t.render(&msgs(&[("user", "x")]), false).unwrap_err().to_string(),
    };
    assert!(err.contains("no_such_filter") || err.contains("unknown filter"), "{err}");
    let t = ChatTemplate::new("{{ messages[0].content.no_such_method() }}", "", "").unwrap();
    assert!(t.render(&msgs(&[("user", "x")]), false).is_err());
}

/// Expected outputs below were rendered by Python Jinja2 3.1 with
/// trim_blocks=True and lstrip_blocks=True, as transformers does.
#[test]
fn renders_like_transformers_jinja() {
    // Block tags on their own lines leave no blank lines; Python string methods work.
    let src = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role == 'system' %}\n[SYS] {{ m.content.strip() }}\n    {% elif m.content.startswith('!') %}\n[CMD] {{ m.content[1:] | upper }}\n    {% else %}\n[{{ m.role | capitalize }}] {{ m.content | trim }}{{ eos_token }}\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\n[Assistant]\n{% endif %}";
    let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
    let m = msgs(&[("system", "  be brief \n"), ("user", "!go"), ("user", " hello ")]);
    assert_eq!(t.render(&m, true).unwrap(), "<s>\n[SYS] be brief\n[CMD] GO\n[User] hello</s>\n[Assistant]\n");
    assert_eq!(t.render(&m, false).unwrap(), "<s>\n[SYS] be brief\n[CMD] GO\n[User] hello</s>\n");

    // loop helpers, namespace, slicing, dict methods.
    let src = "{% set ns = namespace(n=0) %}{% for m in messages[1:] %}{% set ns.n = ns.n + 1 %}{{ loop.index0 }}:{{ m['role'] }}{{ ',' if not loop.last }}{% endfor %}|{{ ns.n }}|{{ messages[0].get('content') }}|{{ messages[0].items() | list | length }}";
    let t = ChatTemplate::new(src, "", "").unwrap();
    let m = msgs(&[("system", "S"), ("user", "a"), ("assistant", "b")]);
    assert_eq!(t.render(&m, false).unwrap(), "0:user,1:assistant|2|S|2");
}

/// `tojson` as transformers writes it (Python json.dumps, ensure_ascii=False).
#[test]
fn tojson_matches_python_json_dumps() {
    let t = ChatTemplate::new("{{ tools | tojson }}", "", "").unwrap();
    let mut extra = serde_json::Map::new();
    extra.insert("tools".into(), json!([{"name": "get_weather", "args": {"city": "Zürich", "unit": null, "n": 2, "x": 1.5, "ok": true, "q": "a\"b<c>\n"}}]));
    let out = t.render_with(&msgs(&[]), false, &extra).unwrap();
    // json.dumps([...], ensure_ascii=False)
    assert_eq!(out, r#"[{"name": "get_weather", "args": {"city": "Zürich", "unit": null, "n": 2, "x": 1.5, "ok": true, "q": "a\"b<c>\n"}}]"#);
    let t = ChatTemplate::new("{{ tools[0].args | tojson(indent=2, sort_keys=true) }}", "", "").unwrap();
    let mut extra = serde_json::Map::new();
    extra.insert("tools".into(), json!([{"args": {"b": [1, 2], "a": {}, "c": []}}]));
    let out = t.render_with(&msgs(&[]), false, &extra).unwrap();
    // json.dumps(..., indent=2, sort_keys=True)
    assert_eq!(out, "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2\n  ],\n  \"c\": []\n}");
}

#[test]
fn messages_of_any_shape_and_strftime() {
    let t = ChatTemplate::new(
        "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}{% else %}{{ m.content }}{% endif %};{% endfor %}{{ strftime_now('%Y') }}",
        "",
        "",
    )
    .unwrap();
    let messages = vec![
        json!({"role": "user", "content": "weather?"}),
        json!({"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "get_weather", "arguments": "{}"}}]}),
    ];
    let out = t.render_with(&messages, false, &serde_json::Map::new()).unwrap();
    let (msgs_part, year) = out.rsplit_once(';').unwrap();
    assert_eq!(msgs_part, "user:weather?;assistant:get_weather");
    let year: i32 = year.parse().expect("strftime_now('%Y') is a year");
    assert!((2024..3000).contains(&year));
}

#[test]
fn chat_message_deserializes_openai_content() {
    let m: ChatMessage = serde_json::from_value(json!({"role": "user", "content": "hi"})).unwrap();
    assert_eq!(m, ChatMessage::new("user", "hi"));
    let m: ChatMessage = serde_json::from_value(json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})).unwrap();
    assert_eq!(m.content, "ab");
    let m: ChatMessage = serde_json::from_value(json!({"role": "assistant", "content": null})).unwrap();
    assert_eq!(m.content, "");
    let m: ChatMessage = serde_json::from_value(json!({"role": "assistant"})).unwrap();
    assert_eq!(m.content, "");
    assert!(serde_json::from_value::<ChatMessage>(json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})).is_err());
}
