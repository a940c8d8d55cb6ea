#!/usr/bin/env python3
"""bench_guided.py - what a JSON schema costs a stream's decode, and whether
guided streams hold back the others.

Usage: bench_guided.py BASE_URL [--tokens N] [--runs R] [--temperature T]
       [--schema words|record]
(a loopback OpenAI-compatible server, e.g. `braid serve --model smollm2`).

1. Alone, one stream at a time, R runs each: a free stream (max_tokens N,
   ignore_eos) and a guided one (a schema asking for an array of N/4 short
   strings, 3 to 8 characters each, so it decodes about N tokens; or with
   --schema record, records of a free string, an integer and an enum). Decode tok/s of a stream is
   (tokens - 1) / (last token - first token), from the streamed chunks and
   usage.completion_tokens; the median run is reported.
2. Mixed: 2 free streams beside 2 guided ones, against 4 free streams:
   the free streams' largest inter-token gap and median gap.

Both kinds sample at --temperature (0, greedy, by default; at a
temperature the server's other defaults apply: top_k 40 and the like).
Standard library only; the last line is one JSON object.
"""

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse


def schema(n):
    if SCHEMA == "record":
        # Records with free strings, an integer and an enum: a string body
        # takes llguidance's sliced masks (fast); bounded strings do not.
        rec = {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "colour": {"enum": ["red", "green", "blue"]}},
            "required": ["name", "age", "colour"],
            "additionalProperties": False,
        }
        return {"type": "object", "properties": {"people": {"type": "array", "minItems": max(1, n // 4), "items": rec}}, "required": ["people"], "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": n, "maxItems": n, "items": {"type": "string", "minLength": 3, "maxLength": 8}}},
        "required": ["items"],
        "additionalProperties": False,
    }


TEMPERATURE = 0.0
SCHEMA = "words"


def stream(url, guided, tokens):
    """One streamed chat; returns (arrival times of content chunks, completion tokens)."""
    u = urllib.parse.urlparse(url)
    assert u.hostname in ("127.0.0.1", "localhost", "::1"), "loopback servers only"
    body = {
        "messages": [{"role": "user", "content": "List some words, as JSON." if guided else "Tell me a long story."}],
        "max_tokens": tokens * 2 if guided else tokens,
        "temperature": TEMPERATURE,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if guided:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "words", "schema": schema(tokens // 4)}}
    else:
        body["ignore_eos"] = True
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    times, used = [], 0
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            used = ev["usage"]["completion_tokens"]
        for ch in ev.get("choices", []):
            if ch["delta"].get("content"):
                times.append(time.perf_counter())
    return times, used


def rate(times, used):
    return (used - 1) / (times[-1] - times[0])


def mixed(url, kinds, tokens):
    out = [None] * len(kinds)

    def run(i, g):
        out[i] = stream(url, g, tokens)

    ts = [threading.Thread(target=run, args=(i, g)) for i, g in enumerate(kinds)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    # The free streams' gaps while every stream runs (up to the end of
    # the shortest).
    end = min(o[0][-1] for o in out)
    inside = [b - a for i, g in enumerate(kinds) if not g for a, b in zip(out[i][0], out[i][0][1:]) if b <= end]
    return {"max_gap_ms": round(max(inside) * 1e3, 1), "median_gap_ms": round(statistics.median(inside) * 1e3, 1), "gaps": len(inside)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--schema", choices=["words", "record"], default="words")
    a = ap.parse_args()
    global TEMPERATURE, SCHEMA
    TEMPERATURE, SCHEMA = a.temperature, a.schema
    stream(a.url, True, 16)  # warm up (and build the vocabulary's trie)
    free, guided = [], []
    for _ in range(a.runs):
        free.append(rate(*stream(a.url, False, a.tokens)))
        t, used = stream(a.url, True, a.tokens)
        guided.append(rate(t, used))
    f, g = statistics.median(free), statistics.median(guided)
    print(f"alone: free {f:.1f} tok/s, guided {g:.1f} tok/s ({(1 - g / f) * 100:+.1f}% slower)")
    base = mixed(a.url, [False] * 4, a.tokens)
    mix = mixed(a.url, [False, False, True, True], a.tokens)
    print(f"4 free streams: free gaps max {base['max_gap_ms']} ms, median {base['median_gap_ms']} ms")
    print(f"2 free + 2 guided: free gaps max {mix['max_gap_ms']} ms, median {mix['median_gap_ms']} ms")
    print(json.dumps({"free_tok_s": round(f, 1), "guided_tok_s": round(g, 1), "slowdown": round(1 - g / f, 3), "four_free": base, "two_free_two_guided": mix}))


if __name__ == "__main__":
    main()
