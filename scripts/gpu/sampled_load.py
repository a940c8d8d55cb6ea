#!/usr/bin/env python3
"""N concurrent streamed completions sampled as asked (top-p 0.95, no top-k by default), against a
server on 127.0.0.1:PORT; prints one JSON line with the aggregate decode tok/s (from the last
stream's second token to the first stream's end). Used by scripts/gpu/pending.sh."""
import http.client, json, sys, threading, time, argparse
ap = argparse.ArgumentParser()
ap.add_argument("port", type=int)
ap.add_argument("--streams", type=int, default=8)
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--top-p", type=float, default=0.95)
ap.add_argument("--top-k", type=int, default=0)
ap.add_argument("--temperature", type=float, default=1.0)
ap.add_argument("--label", default="")
a = ap.parse_args()
times = [[] for _ in range(a.streams)]
errs = []
def run(i):
    c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=120)
    body = {"prompt": f"Story number {i}: once upon a time", "max_tokens": a.tokens, "stream": True, "temperature": a.temperature,
            "top_p": a.top_p, "top_k": a.top_k, "min_p": 0.0, "ignore_eos": True, "seed": i + 1}
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        errs.append(f"{r.status} {r.read()[:200]!r}"); return
    while line := r.readline():
        if line.startswith(b"data:") and b"[DONE]" not in line:
            times[i].append(time.perf_counter())
ts = [threading.Thread(target=run, args=(i,)) for i in range(a.streams)]
[t.start() for t in ts]; [t.join() for t in ts]
if errs:
    print(json.dumps({"label": a.label, "errors": errs[:3]})); sys.exit(1)
# window: from the last stream's 2nd token to the first stream's end
start = max(t[1] for t in times); end = min(t[-1] for t in times)
n = sum(sum(1 for x in t if start <= x <= end) for t in times)
print(json.dumps({"label": a.label, "streams": a.streams, "tok_s": round(n / (end - start), 1), "tokens": [len(t) for t in times][:4]}))
