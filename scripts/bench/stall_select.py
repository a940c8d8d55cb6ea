#!/usr/bin/env python3
"""The stall scenario with one client thread: background streams decode, a
long prompt arrives, and every stream's token events are timed as they
come off its socket.

The scenario and the figures are those of ../shared/bench/stall_probe.py
(same JSON keys): N background /v1/completions streams with short prompts,
then, --arrival-after seconds after all of them decode, one newcomer with a
long prompt; the background's largest gap overlapping the newcomer's
prefill over the median gap before it, the p99 gap, the newcomer's TTFT.
That probe reads each stream in a thread of its own, and Python's threads
share the GIL: a token read by one can wait up to the switch interval (5 ms)
for another to finish parsing, which shows as a gap the server never made.
Here one thread waits on all the sockets at once (selectors) and stamps
each wake of it, every socket ready then taking that time, so a gap is the
server's and the network's only.

Usage: stall_select.py URL [--streams 6] [--gen 4000] [--long-tokens 1800]
[--ignore-eos] [--seed S] [--label TEXT]. Only a loopback URL is accepted.
The last line printed is the JSON object.
"""

import argparse
import http.client
import json
import random
import selectors
import socket
import statistics
import time
import urllib.parse

WORDS = ("river stone lamp garden paper window engine bridge music winter summer orange silver "
         "market harbor letter candle forest meadow castle valley island kitchen teacher doctor "
         "pilot sailor basket ladder compass anchor blanket morning evening village station").split()


def text(words, seed):
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) for _ in range(words))


class Stream:
    """One streamed completion on a non-blocking socket: its token times."""

    def __init__(self, host, port, payload):
        body = json.dumps(payload).encode()
        self.req = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                    f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
        self.sock = socket.create_connection((host, port))
        self.sock.setblocking(False)
        self.raw = b""          # bytes not parsed yet
        self.head = None        # response headers, once read
        self.chunked = False
        self.body = b""         # de-chunked body not split into events yet
        self.times = []
        self.done = False
        self.t_sent = None

    def send(self):
        self.t_sent = time.perf_counter()
        self.sock.sendall(self.req)

    def feed(self, data, now):
        self.raw += data
        if self.head is None:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head = self.raw[:end].decode("latin-1").lower()
            self.chunked = "transfer-encoding: chunked" in self.head
            self.raw = self.raw[end + 4:]
            if not self.head.split("\r\n")[0].split()[1].startswith("2"):
                raise RuntimeError(f"server answered {self.head.splitlines()[0]}")
        if self.chunked:
            while True:
                nl = self.raw.find(b"\r\n")
                if nl < 0:
                    break
                size = int(self.raw[:nl].split(b";")[0], 16)
                if len(self.raw) < nl + 2 + size + 2:
                    break
                self.body += self.raw[nl + 2:nl + 2 + size]
                self.raw = self.raw[nl + 2 + size + 2:]
                if size == 0:
                    self.done = True
                    break
        else:
            self.body += self.raw
            self.raw = b""
        self.body = self.body.replace(b"\r\n", b"\n")
        while b"\n\n" in self.body:
            event, self.body = self.body.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    self.done = True
                    continue
                try:
                    ev = json.loads(data)
                except ValueError:
                    continue
                ch = (ev.get("choices") or [{}])[0]
                if ch and (ch.get("text") or ch.get("finish_reason") is None):
                    self.times.append(now)


def pump(streams, until):
    """Read every open stream until `until()` or all are done."""
    sel = selectors.DefaultSelector()
    for s in streams:
        if not s.done:
            sel.register(s.sock, selectors.EVENT_READ, s)
    while sel.get_map() and not until():
        ready = sel.select(timeout=0.05)
        # One stamp for every stream ready at this wake: stamped after each
        # one's recv and parse, the last of six tokens of one round read
        # ~0.2 ms later than the first, and by a different amount each round.
        now = time.perf_counter()
        for key, _ in ready:
            s = key.data
            data = s.sock.recv(65536)
            if data:
                s.feed(data, now)
            if not data or s.done:
                sel.unregister(s.sock)
                s.done = True
    sel.close()


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(round((len(v) - 1) * p / 100)))] if v else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("url")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--gen", type=int, default=4000)
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=1800)
    ap.add_argument("--newcomer-max-tokens", type=int, default=16)
    ap.add_argument("--arrival-after", type=float, default=2.0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args()
    u = urllib.parse.urlparse(a.url)
    host, port = u.hostname or "", u.port or 80
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        raise SystemExit(f"refusing non-loopback host {host!r}")

    def payload(prompt, max_tokens, stream=True):
        p = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        if a.ignore_eos:
            p["ignore_eos"] = True
        return p

    # Words per token, from one request's usage (a seed never used again).
    c = http.client.HTTPConnection(host, port, timeout=a.timeout)
    c.request("POST", "/v1/completions", json.dumps(payload(text(400, a.seed + 99991), 1, False)), {"Content-Type": "application/json"})
    used = json.loads(c.getresponse().read()).get("usage", {}).get("prompt_tokens") or 400
    c.close()
    per_token = 400 / used

    deadline = time.perf_counter() + a.timeout
    bg = [Stream(host, port, payload(text(max(1, round(a.short_tokens * per_token)), a.seed * 31 + i), a.gen)) for i in range(a.streams)]
    for s in bg:
        s.send()
    pump(bg, lambda: all(s.times for s in bg) or time.perf_counter() > deadline)
    start = time.perf_counter()
    pump(bg, lambda: time.perf_counter() > start + a.arrival_after)
    nc = Stream(host, port, payload(text(max(1, round(a.long_tokens * per_token)), a.seed * 31 + 500), a.newcomer_max_tokens))
    nc.send()
    pump(bg + [nc], lambda: time.perf_counter() > deadline)
    t_arr, t_first = nc.t_sent, (nc.times[0] if nc.times else None)

    base, during, gaps = [], [], []
    for s in bg:
        for t0, t1 in zip(s.times, s.times[1:]):
            g = (t1 - t0) * 1e3
            gaps.append(g)
            if t1 <= t_arr:
                base.append(g)
            elif t_first is not None and t0 < t_first:
                during.append(g)
    usual = statistics.median(base) if base else None
    worst = max(during) if during else None
    out = {
        "label": a.label,
        "seed": a.seed,
        "probe": "select",
        "streams": a.streams,
        "baseline_median_gap_ms": usual and round(usual, 3),
        "max_gap_in_prefill_ms": worst and round(worst, 3),
        "stall_ratio": round(worst / usual, 3) if worst and usual else None,
        "p99_gap_ms": gaps and round(pct(gaps, 99), 3),
        "newcomer_ttft_ms": t_first and round((t_first - t_arr) * 1e3, 3),
        "bg_tokens": [len(s.times) for s in bg],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
