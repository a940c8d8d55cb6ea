"""Drives braid's server with the official OpenAI Python client: a chat
with a base64 image content part, streamed, then the same image again,
whose rows the prefix cache serves.

Usage: openai_images.py BASE_URL MODEL DATA_URL
"""

import sys

import openai


def chat(client, model, image, stream):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Describe the image."},
            {"type": "image_url", "image_url": {"url": image}},
        ]}],
        max_tokens=5,
        temperature=0,
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )


def main() -> None:
    base_url, model, image = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    parts, usage = [], None
    for chunk in chat(client, model, image, True):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
    assert parts, "no streamed content"
    assert usage is not None and usage.completion_tokens == 5, usage
    print(f"ok: streamed chat with an image ({usage.prompt_tokens} prompt tokens)")

    again = chat(client, model, image, False)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached and cached > 16, again.usage
    assert again.choices[0].message.content == "".join(parts), (again.choices[0].message.content, parts)
    print(f"ok: the same image again is cached ({cached} of {again.usage.prompt_tokens} tokens)")


if __name__ == "__main__":
    main()
