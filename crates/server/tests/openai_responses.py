"""/v1/responses (and the routes beside it) through the official OpenAI client.

Usage: openai_responses.py BASE_URL MODEL
* basic: `input` as text with `instructions`, and as a message list;
* streamed: the typed events in order, the deltas adding up to the final
  text, `client.responses.stream()`'s accumulated final response;
* `text.format` json_schema: the reply validates (jsonschema), whole and
  streamed;
* tools: a named `tool_choice` gives a `function_call` item; its output
  sent back as `function_call_output` gets an answer; `required`, streamed,
  gives `function_call_arguments` events;
* `x-request-id` echoed; `/props`; `/v1/embeddings` a 400.
Prints one `ok: ...` line per check; any failure raises.
"""

import json
import sys
import urllib.request

import jsonschema
import openai

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"], "additionalProperties": False},
}

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}


def basic(client, model):
    r = client.responses.create(model=model, instructions="Answer in one short sentence.", input="What is the capital of France?", max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_"), r
    assert r.status in ("completed", "incomplete"), r.status
    assert r.output_text.strip(), r
    assert r.output[0].type == "message" and r.output[0].role == "assistant", r.output
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage
    print(f"ok: basic response {r.output_text!r} ({r.usage.input_tokens} in, {r.usage.output_tokens} out, {r.status})")

    r = client.responses.create(model=model, max_output_tokens=4, temperature=0, input=[
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Count: one, two,"}]},
    ])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    assert r.usage.output_tokens == 4, r.usage
    print(f"ok: message-list input, cut at max_output_tokens: {r.output_text!r}")


def streamed(client, model):
    kinds, deltas, seqs, final = [], [], [], None
    for ev in client.responses.create(model=model, input="Say hello.", max_output_tokens=16, temperature=0, stream=True):
        kinds.append(ev.type)
        seqs.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"], kinds
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"], kinds
    assert final is not None and kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert seqs == list(range(len(seqs))), seqs
    assert "".join(deltas) == final.output_text and final.output_text.strip(), (deltas, final.output_text)
    assert final.usage.output_tokens > 0, final.usage
    print(f"ok: streamed response, {len(deltas)} deltas add up to {final.output_text!r}")

    # The same greedy request whole gives the same text.
    whole = client.responses.create(model=model, input="Say hello.", max_output_tokens=16, temperature=0)
    assert whole.output_text == final.output_text, (whole.output_text, final.output_text)
    print("ok: streamed equals whole")

    # The helper needs `response.completed`: a schema makes the reply end.
    color = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "color", "schema": color, "strict": True}}
    with client.responses.stream(model=model, input="Name a color.", text=fmt, max_output_tokens=40, temperature=0) as s:
        text = "".join(ev.delta for ev in s if ev.type == "response.output_text.delta")
        got = s.get_final_response()
    assert got.output_text == text and text, (got.output_text, text)
    print(f"ok: responses.stream() helper accumulates {text!r}")


def structured(client, model):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    r = client.responses.create(model=model, input="Invent a person.", text=fmt, max_output_tokens=60, temperature=0)
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema", r.text
    print(f"ok: text.format json_schema {r.output_text}")
    text = "".join(ev.delta for ev in client.responses.create(model=model, input="Invent another person.", text=fmt, max_output_tokens=60, temperature=0, stream=True) if ev.type == "response.output_text.delta")
    jsonschema.validate(json.loads(text), PERSON)
    print(f"ok: streamed json_schema {text}")


def tools(client, model):
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(model=model, input=history, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id, r.output
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    print(f"ok: named tool_choice -> function_call {calls[0].name}({calls[0].arguments})")

    history += [
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name, "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"city": args["city"], "sky": "sunny", "celsius": 21})},
    ]
    r = client.responses.create(model=model, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=40, temperature=0)
    assert r.output_text.strip() and not [o for o in r.output if o.type == "function_call"], r.output
    print(f"ok: answer after function_call_output: {r.output_text!r}")

    kinds, args_deltas, done, final = [], {}, {}, None
    stream = client.responses.create(
        model=model, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_output_tokens=60, temperature=0, stream=True)
    for ev in stream:
        kinds.append(ev.type)
        if ev.type == "response.function_call_arguments.delta":
            args_deltas[ev.item_id] = args_deltas.get(ev.item_id, "") + ev.delta
        if ev.type == "response.function_call_arguments.done":
            done[ev.item_id] = ev.arguments
        if ev.type == "response.completed":
            final = ev.response
    assert final is not None and kinds.count("response.output_item.added") == 1 and len(done) == 1, kinds
    (item_id, args), = done.items()
    assert args_deltas[item_id].strip() == args, (args_deltas, done)
    jsonschema.validate(json.loads(args), WEATHER["parameters"])
    items = [o for o in final.output if o.type == "function_call"]
    assert len(items) == 1 and items[0].id == item_id and items[0].arguments == args and items[0].status == "completed", final.output
    print(f"ok: streamed required function_call get_weather({args})")


def surface(client, model, base_url):
    raw = client.responses.with_raw_response.create(model=model, input="Hi", max_output_tokens=2, extra_headers={"x-request-id": "test-rid-42"})
    assert raw.headers.get("x-request-id") == "test-rid-42", dict(raw.headers)
    assert raw.parse().usage.output_tokens <= 2
    print("ok: x-request-id echoed")
    root = base_url.rsplit("/v1", 1)[0]
    with urllib.request.urlopen(root + "/props") as f:
        props = json.load(f)
    assert props["model"] == model and props["context"] > 0 and props["chat_template"], props
    assert props["kv_pool"]["tokens"] > 0 and props["default_generation_settings"]["temperature"] >= 0, props
    print(f"ok: props context {props['context']}, kv pool {props['kv_pool']['tokens']} tokens, template from {props['chat_template_source']}")
    try:
        client.embeddings.create(model=model, input="hello")
        raise AssertionError("embeddings answered")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "embedding" in str(e), e
    print("ok: embeddings refused with a 400")
    try:
        client.responses.create(model=model, input="x", previous_response_id="resp_123")
        raise AssertionError("previous_response_id accepted")
    except openai.BadRequestError as e:
        assert "previous_response_id" in str(e), e
    print("ok: previous_response_id refused (stateless)")


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    basic(client, model)
    streamed(client, model)
    structured(client, model)
    tools(client, model)
    surface(client, model, base_url)


if __name__ == "__main__":
    main()
