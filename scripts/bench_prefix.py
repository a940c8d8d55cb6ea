#!/usr/bin/env python3
"""Time to first token with and without the prefix cache, through `braid serve`.

Starts `braid serve`, then for each repeat sends a new shared prefix
(--prefix token ids) followed by a question (--question ids):

* cold: the prefix has never been seen;
* warm: a second question behind the same prefix, which the first one cached;
* warmed: a third prefix fed by POST /v1/warm first, then a question.

Each TTFT is measured by the client: from sending the request to the first
streamed frame (max_tokens 1, so the frame follows the prefill). Prints a
markdown table of medians over --reps. Needs only the standard library.

    scripts/bench_prefix.py --braid target/release/braid --model smollm2
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request


def ids(seed, n):
    """Deterministic, varied token ids (an LCG over ordinary ids)."""
    x, out = seed * 2654435761 % (1 << 32) or 1, []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(200 + x % 30000)
    return out


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def ttft(url, prompt):
    """Seconds to the first streamed frame, and the cached prompt tokens."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.perf_counter()
    first, cached = None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if first is None:
                first = time.perf_counter() - t
            data = line[6:]
            if data == b"[DONE]":
                break
            usage = json.loads(data).get("usage")
            if usage:
                cached = usage["prompt_tokens_details"]["cached_tokens"]
    return first, cached


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--braid", default="target/release/braid")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--question", type=int, default=50)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("serve_args", nargs="*", help="more `braid serve` flags (after --)")
    a = ap.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    server = subprocess.Popen([a.braid, "serve", "-m", a.model, "--port", str(a.port), *a.serve_args], stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None:
                sys.exit("braid serve exited")
            time.sleep(0.5)
        rows = {"cold": [], "warm": [], "warmed": []}
        cached = {"cold": [], "warm": [], "warmed": []}
        # One throw-away request first, so no figure pays one-time costs.
        ttft(url, ids(999, 64))
        for r in range(a.reps):
            prefix = ids(3 * r + 1, a.prefix)
            for name, q in (("cold", 1), ("warm", 2)):
                s, c = ttft(url, prefix + ids(100 * r + q, a.question))
                rows[name].append(s)
                cached[name].append(c)
            fed = ids(3 * r + 2, a.prefix)
            post(url + "/v1/warm", {"prompt": fed})
            s, c = ttft(url, fed + ids(100 * r + 3, a.question))
            rows["warmed"].append(s)
            cached["warmed"].append(c)
        total = a.prefix + a.question
        print(f"| {a.prefix}-token prefix + {a.question}-token question | TTFT median (s) | min | max | cached tokens |")
        print("| --- | ---: | ---: | ---: | ---: |")
        labels = {"cold": "cold (prefix never seen)", "warm": "warm (a question before it)", "warmed": "after POST /v1/warm"}
        for name, times in rows.items():
            print(f"| {labels[name]} | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} | {statistics.median(cached[name]):.0f} of {total} |")
        cold, warm = statistics.median(rows["cold"]), statistics.median(rows["warm"])
        print(f"\nwarm / cold: {warm / cold:.3f}")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
