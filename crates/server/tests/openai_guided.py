"""Structured outputs and tool calls through the official OpenAI client.

Usage: openai_guided.py BASE_URL MODEL
* 20 `json_schema` requests (nested objects, enums, arrays, refs, strict
  and not, streamed and not): every reply parses and validates;
* `json_object`, and a schema the grammar compiler refuses (a 400);
* a tool-call round trip, with a named `tool_choice` (whole) and
  `required` (streamed): the call's shape, the result sent back, the
  model's answer;
* `/tokenize` -> `/detokenize`.
With a tiny model the grammar forces the shapes; nothing checks wisdom.
"""

import json
import sys
import urllib.request

import jsonschema
import openai

S = {"type": "string", "maxLength": 24}

SCHEMAS = [
    ("a person", True, {"type": "object", "properties": {"name": S, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}),
    ("a color", True, {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False}),
    ("three fruits", True, {"type": "object", "properties": {"fruits": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}, "required": ["fruits"], "additionalProperties": False}),
    ("an address", True, {
        "type": "object",
        "properties": {"name": S, "address": {"type": "object", "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}),
    ("feature flags", True, {"type": "object", "properties": {"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"}}, "required": ["dark_mode", "beta"], "additionalProperties": False}),
    ("a temperature", False, {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}}, "required": ["celsius"]}),
    ("two books", True, {
        "type": "object",
        "properties": {"books": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {"title": S, "year": {"type": "integer"}}, "required": ["title", "year"], "additionalProperties": False}}},
        "required": ["books"], "additionalProperties": False}),
    ("a small matrix", False, {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 3, "items": {"type": "integer"}}}}, "required": ["rows"]}),
    ("an id", False, {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"}, S]}}, "required": ["id"]}),
    ("a version", True, {"type": "object", "properties": {"kind": {"const": "release"}, "major": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["kind", "major"], "additionalProperties": False}),
    ("a profile", False, {"type": "object", "properties": {"nick": S, "bio": S}, "additionalProperties": False}),
    ("a priority", True, {"type": "object", "properties": {"priority": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["priority"], "additionalProperties": False}),
    ("a task", True, {
        "type": "object",
        "properties": {"title": S, "status": {"enum": ["todo", "doing", "done"]}, "tags": {"type": "array", "items": {"enum": ["home", "work"]}, "maxItems": 2}},
        "required": ["title", "status", "tags"], "additionalProperties": False}),
    ("a date", True, {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"], "additionalProperties": False}),
    ("a middle name", True, {"type": "object", "properties": {"middle": {"type": ["string", "null"], "maxLength": 16}}, "required": ["middle"], "additionalProperties": False}),
    ("a line segment", True, {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}, "required": ["start", "end"], "additionalProperties": False}),
    ("some scores", False, {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 4}}, "required": ["scores"]}),
    ("a company", True, {
        "type": "object",
        "properties": {"company": {"type": "object", "properties": {"name": S, "ceo": {"type": "object", "properties": {"name": S, "since": {"type": "integer"}}, "required": ["name", "since"], "additionalProperties": False}}, "required": ["name", "ceo"], "additionalProperties": False}},
        "required": ["company"], "additionalProperties": False}),
    ("a product", True, {
        "type": "object",
        "properties": {"sku": S, "price": {"type": "number"}, "in_stock": {"type": "boolean"}, "qty": {"type": "integer"}, "unit": {"enum": ["kg", "pcs"]}},
        "required": ["sku", "price", "in_stock", "qty", "unit"], "additionalProperties": False}),
    ("an airport", True, {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "city": S}, "required": ["code", "city"], "additionalProperties": False}),
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}


def structured(client, model):
    for i, (what, strict, schema) in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": strict}}
        messages = [{"role": "user", "content": f"Give me {what} as JSON."}]
        if i % 4 == 3:
            stream = client.chat.completions.create(model=model, messages=messages, response_format=fmt, max_tokens=200, temperature=0, stream=True)
            parts, finish = [], None
            for chunk in stream:
                for c in chunk.choices:
                    parts.append(c.delta.content or "")
                    finish = c.finish_reason or finish
            text = "".join(parts)
        else:
            r = client.chat.completions.create(model=model, messages=messages, response_format=fmt, max_tokens=200, temperature=0.7, seed=i)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", f"schema {i} ({what}) ended with {finish}: {text!r}"
        value = json.loads(text)
        jsonschema.validate(value, schema)
        print(f"ok: schema {i:2} ({what}) -> {text}")

    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a cat as JSON."}], response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    print(f"ok: json_object -> {text}")

    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}, "required": ["a"]}, "strict": True}}
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], response_format=bad, max_tokens=5)
    except openai.BadRequestError as e:
        assert e.body["param"] == "response_format", e.body
        print(f"ok: a refused schema -> {e.status_code}: {e.body['message'][:100]}")
    else:
        raise AssertionError("a schema with a dangling $ref was accepted")


def check_call(call, name):
    assert call.id and call.type == "function", call
    assert call.function.name == name, call
    args = json.loads(call.function.arguments)
    schema = WEATHER["function"]["parameters"] if name == "get_weather" else TIME["function"]["parameters"]
    jsonschema.validate(args, schema)
    return args


def answer(client, model, messages, call, stream):
    """Send the tool's result back; the model answers in words."""
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    if not stream:
        r = client.chat.completions.create(model=model, messages=history, tools=[WEATHER, TIME], max_tokens=40, temperature=0)
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length"), c.finish_reason
        text = c.message.content or ""
    else:
        parts = []
        for chunk in client.chat.completions.create(model=model, messages=history, tools=[WEATHER, TIME], tool_choice="none", max_tokens=40, temperature=0, stream=True):
            for c in chunk.choices:
                parts.append(c.delta.content or "")
        text = "".join(parts)
    assert text.strip(), "no answer after the tool result"
    return text


def tools(client, model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", (c.finish_reason, c.message)
    assert len(c.message.tool_calls) == 1, c.message.tool_calls
    call = c.message.tool_calls[0]
    args = check_call(call, "get_weather")
    print(f"ok: named tool_choice -> {call.function.name}({args}) id {call.id}")
    text = answer(client, model, messages, {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}, stream=False)
    print(f"ok: answer after the tool result: {text!r}")

    stream = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True)
    calls, finish, chunks = {}, None, 0
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                chunks += 1
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert entry["id"] in (None, d.id), "a call's id changed mid-stream"
                    entry["id"] = d.id
                if d.function and d.function.name:
                    entry["name"] = d.function.name
                if d.function and d.function.arguments:
                    entry["arguments"] += d.function.arguments
    assert finish == "tool_calls", finish
    assert list(calls) == [0], calls
    call = calls[0]
    assert call["id"] and call["name"] in ("get_weather", "get_time"), call
    args = json.loads(call["arguments"])
    jsonschema.validate(args, (WEATHER if call["name"] == "get_weather" else TIME)["function"]["parameters"])
    assert chunks > 2, f"the arguments came in {chunks - 1} piece(s)"
    print(f"ok: streamed required tool call -> {call['name']}({args}) in {chunks} deltas")
    text = answer(client, model, messages, call, stream=True)
    print(f"ok: streamed answer after the tool result: {text!r}")


def tokenize(base_url):
    root = base_url.rsplit("/v1", 1)[0]

    def post(path, body):
        req = urllib.request.Request(root + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    text = "Hello, wörld! <|im_start|>user"
    ids = post("/tokenize", {"content": text})["tokens"]
    assert all(isinstance(t, int) for t in ids) and ids, ids
    pieces = post("/tokenize", {"content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == ids and "<|im_start|>" in [p["piece"] for p in pieces], pieces
    back = post("/detokenize", {"tokens": ids})["content"]
    assert back == text, (back, text)
    print(f"ok: tokenize -> {len(ids)} tokens -> detokenize {back!r}")


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    tokenize(base_url)
    structured(client, model)
    tools(client, model)


if __name__ == "__main__":
    main()
