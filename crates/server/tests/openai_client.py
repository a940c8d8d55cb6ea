"""Drives braid's server with the official OpenAI Python client.

Usage: openai_client.py BASE_URL MODEL
A streamed chat and a non-streamed completion; both must name Paris.
"""

import sys

import openai


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}],
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    answer = "".join(parts)
    assert "Paris" in answer, f"chat answer without Paris: {answer!r}"
    assert finish in ("stop", "length"), finish
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 0, usage
    print(f"ok: streamed chat {answer!r}")

    completion = client.completions.create(
        model=model,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
    )
    text = completion.choices[0].text
    assert "Paris" in text, f"completion without Paris: {text!r}"
    assert completion.usage.prompt_tokens == 5, completion.usage
    assert completion.id.startswith("cmpl-")
    print(f"ok: completion {text!r}")

    models = client.models.list()
    assert [m.id for m in models.data] == [model], models

    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    except openai.NotFoundError as e:
        print(f"ok: unknown model -> {e.status_code}")
    else:
        raise AssertionError("an unknown model was accepted")


if __name__ == "__main__":
    main()
