//! Real model chat templates (Gemma 3 and Qwen2.5, as published in their
//! tokenizer_config.json) rendered as transformers renders them. The expected
//! prompts were produced by Python Jinja2 3.1 with transformers' settings
//! (trim_blocks, lstrip_blocks, tojson = json.dumps(ensure_ascii=False)).

use braid_formats::template::{ChatMessage, ChatTemplate};
use serde_json::json;

const GEMMA3: &str = r##"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"##;

const QWEN25: &str = r##"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"##;

#[test]
fn gemma3_template() {
    let t = ChatTemplate::new(GEMMA3, "<bos>", "<eos>").unwrap();
    let m = vec![
        ChatMessage::new("system", "Be terse."),
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", " Hello! "),
        ChatMessage::new("user", "Again?"),
    ];
    assert_eq!(
        t.render(&m, true).unwrap(),
        "<bos><start_of_turn>user\nBe terse.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nAgain?<end_of_turn>\n<start_of_turn>model\n"
    );
    // Structured content parts.
    let parts = vec![json!({"role": "user", "content": [
        {"type": "text", "text": " part one "}, {"type": "image"}, {"type": "text", "text": "two"}]})];
    assert_eq!(t.render_with(&parts, false, &serde_json::Map::new()).unwrap(), "<bos><start_of_turn>user\npart one<start_of_image>two<end_of_turn>\n");
    // Two user turns in a row: the template raises.
    let bad = vec![ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
    let err = t.render(&bad, true).unwrap_err().to_string();
    assert!(err.contains("Conversation roles must alternate"), "{err}");
}

#[test]
fn qwen25_template_with_tools() {
    let t = ChatTemplate::new(QWEN25, "", "<|im_end|>").unwrap();
    let messages = vec![
        json!({"role": "user", "content": "weather in Zürich?"}),
        json!({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}}]}),
        json!({"role": "tool", "content": "{\"temp\": 3}"}),
        json!({"role": "tool", "content": "sunny"}),
    ];
    let mut extra = serde_json::Map::new();
    extra.insert(
        "tools".into(),
        json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Get weather \"now\"",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]),
    );
    let want = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get weather \\\"now\\\"\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nweather in Zürich?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"days\": [1, 2]}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 3}\n</tool_response>\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(t.render_with(&messages, true, &extra).unwrap(), want);
    // Without tools: the default system prompt.
    let m = vec![ChatMessage::new("user", "  Hello there \n")];
    assert_eq!(
        t.render(&m, true).unwrap(),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\n  Hello there \n<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn template_from_tokenizer_config() {
    let config = json!({"bos_token": {"content": "<bos>"}, "eos_token": "<eos>", "chat_template": GEMMA3});
    let t = ChatTemplate::from_tokenizer_config(&config).unwrap().unwrap();
    let m = vec![ChatMessage::new("user", "x")];
    assert_eq!(t.render(&m, false).unwrap(), "<bos><start_of_turn>user\nx<end_of_turn>\n");
    // A list of named templates: "default" is taken.
    let config = json!({"eos_token": "E", "chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ eos_token }}!"}]});
    let t = ChatTemplate::from_tokenizer_config(&config).unwrap().unwrap();
    assert_eq!(t.render(&m, false).unwrap(), "E!");
    assert!(ChatTemplate::from_tokenizer_config(&json!({"eos_token": "E"})).unwrap().is_none());
    assert!(ChatTemplate::from_tokenizer_config(&json!({"chat_template": 3})).is_err());
    assert!(ChatTemplate::from_tokenizer_config(&json!({"chat_template": "{% if %}"})).is_err());
}
