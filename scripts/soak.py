#!/usr/bin/env python3
"""Soak test: many requests against `braid serve`, with clients that leave.

Starts `braid serve` (SmolLM2 by default; or drives --url), warms it up,
then sends N requests from C client threads: chat and completions,
streamed and whole, short and long prompts, n > 1, and about a third of
them leave early: while queued, during the prompt's prefill, or in the
middle of the stream. Then it checks what a leak would break:

* running streams, queued streams, slots and KV blocks in use return to
  their idle values (read from /metrics);
* the server's RSS after the run stays within a bound of its RSS after
  the warm-up;
* every reply that completed is well-formed (every choice, a finish
  reason, [DONE] last), and no request failed other than by overload (503);
* the server shuts down cleanly on SIGTERM.

Only the standard library. Exit status 0 when every check holds.

    python3 scripts/soak.py --requests 2000 --concurrency 12     # long
    python3 scripts/soak.py --requests 60 --concurrency 6        # CI
"""

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

WORDS = ("river stone quiet lamp orbit garden copper thread window signal harbor "
         "meadow lantern paper bridge winter silver engine candle forest").split()


def log(msg):
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Server:
    """A `braid serve` child process on a free port."""

    def __init__(self, braid, model, extra):
        args = [braid, "serve", "--model", model, "--port", "0", "--device", "cpu",
                "--max-running", "6", "--queue", "24", "--ctx", "2048", "--kv-tokens", "12288"] + extra
        env = dict(os.environ, BRAID_LOG="info")
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
        self.log_lines = []
        self.port = None
        found = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log_lines.append(line.rstrip("\n"))
                m = re.search(r"listening on http://[^:]+:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(120) or self.port is None:
            raise SystemExit("braid serve did not start:\n" + "\n".join(self.log_lines[-20:]))

    def rss_mb(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self, grace=30):
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "killed"


def get(host, port, path, timeout=30):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    c.request("GET", path)
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body


def metrics(host, port):
    _, body = get(host, port, "/metrics")
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            # Every series carries the model's name; key them without it.
            name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


IDLE_KEYS = ("braid_running_streams", "braid_queue_depth", "braid_slots_used", "braid_fill_used")


def idle_state(host, port):
    m = metrics(host, port)
    return {k: m.get(k, float("nan")) for k in IDLE_KEYS}


def wait_idle(host, port, baseline, within=60):
    """Polls until the gauges are back at `baseline` (or `within` passes)."""
    end = time.time() + within
    while True:
        s = idle_state(host, port)
        if all(s[k] <= baseline[k] for k in IDLE_KEYS) or time.time() > end:
            return s
        time.sleep(0.25)


def prompt_text(rng, long):
    n = rng.randint(350, 700) if long else rng.randint(3, 12)
    return " ".join(rng.choice(WORDS) for _ in range(n))


SCHEMA = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 8}}, "n": {"type": "integer"}},
    "required": ["words", "n"],
    "additionalProperties": False,
}


def plan(rng, disconnects):
    """One request: its body and how its client behaves."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    long = rng.random() < 0.25
    n = rng.choice([1, 1, 1, 2, 3])
    body = {"max_tokens": rng.randint(1, 40), "temperature": rng.choice([0, 0.7, 1.0]), "n": n, "stream": stream, "seed": rng.randint(0, 1 << 30)}
    text = prompt_text(rng, long)
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    # A quarter under a grammar: greedy ones check their tokens on the
    # lane's thread, sampled ones take masks from the workers; both must
    # let go of what they hold when their client leaves.
    if rng.random() < 0.25:
        if chat:
            body["response_format"] = rng.choice([{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}])
        else:
            body["regex"] = "[a-z]{2,8}( [a-z]{2,8}){0,6}"
    leave = None
    if disconnects and rng.random() < 0.33:
        leave = rng.choice(["queue", "prefill", "stream"])
        if leave == "prefill":
            body["messages" if chat else "prompt"] = ([{"role": "user", "content": prompt_text(rng, True)}] if chat else prompt_text(rng, True))
        if leave == "stream":
            body["stream"] = True
            body["max_tokens"] = max(body["max_tokens"], 20)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, leave


def check_whole(v, n, chat):
    choices = v.get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        return f"{n} choices expected, got {choices!r:.200}"
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length"):
            return f"bad finish_reason {c.get('finish_reason')!r}"
        content = c["message"]["content"] if chat else c.get("text")
        if not isinstance(content, str):
            return f"no text in {c!r:.200}"
    u = v.get("usage", {})
    if not (u.get("completion_tokens", -1) >= 0 and u.get("prompt_tokens", 0) > 0):
        return f"bad usage {u!r}"
    return None


def read_sse(resp, stop_after=None):
    """Events up to [DONE] (or the first `stop_after`); (events, saw_done)."""
    events, buf = [], b""
    while True:
        chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(1024)
        if not chunk:
            return events, False
        buf += chunk
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            for line in raw.decode().splitlines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return events, True
                events.append(json.loads(data))
                if stop_after is not None and len(events) >= stop_after:
                    return events, False


def check_stream(events, n):
    finishes = {}
    for e in events:
        if "error" in e:
            return f"error event {e['error']!r:.200}"
        for c in e.get("choices", []):
            if c.get("finish_reason"):
                if c["index"] in finishes:
                    return f"two finish reasons for choice {c['index']}"
                finishes[c["index"]] = c["finish_reason"]
    if sorted(finishes) != list(range(n)):
        return f"finish reasons for {sorted(finishes)} of {n} choices"
    return None


def one(host, port, path, body, leave, rng, tally):
    data = json.dumps(body).encode()
    n = body["n"]
    conn = http.client.HTTPConnection(host, port, timeout=300)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        if leave == "queue":
            # Gone before the server could answer: queued, or not yet admitted.
            time.sleep(rng.uniform(0, 0.02))
            conn.sock.shutdown(socket.SHUT_RDWR)
            tally["disconnect:queue"] += 1
            return
        if leave == "prefill":
            # A long prompt: leave while it is being prefilled.
            time.sleep(rng.uniform(0.05, 0.3))
            conn.sock.shutdown(socket.SHUT_RDWR)
            tally["disconnect:prefill"] += 1
            return
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            tally["overloaded" if resp.status == 503 else f"error:{resp.status}"] += 1
            return
        if body["stream"]:
            if leave == "stream":
                read_sse(resp, stop_after=rng.randint(1, 6))
                conn.sock.shutdown(socket.SHUT_RDWR)
                tally["disconnect:stream"] += 1
                return
            events, done = read_sse(resp)
            why = None if done else "no [DONE]"
            why = why or check_stream(events, n)
        else:
            why = check_whole(json.loads(resp.read()), n, path.endswith("chat/completions"))
        if why:
            tally["malformed"] += 1
            log(f"malformed reply to {path}: {why}")
        else:
            tally["completed"] += 1
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        if leave:
            tally[f"disconnect:{leave}"] += 1
        else:
            tally[f"error:{type(e).__name__}"] += 1
            log(f"request failed: {e!r}")
    finally:
        conn.close()


def run_batch(host, port, count, concurrency, rng, disconnects, tally, deadline):
    plans = [plan(rng, disconnects) + (random.Random(rng.random()),) for _ in range(count)]
    lock = threading.Lock()

    def worker():
        while time.time() < deadline:
            with lock:
                if not plans:
                    return
                path, body, leave, r = plans.pop()
            one(host, port, path, body, leave, r, tally)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(plans)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--braid", default="target/release/braid")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-seconds", type=float, default=1800, help="stop sending after this long")
    ap.add_argument("--rss-slack-mb", type=float, default=96, help="RSS growth allowed after warm-up")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `braid serve` argument (repeatable)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    started = time.time()
    server = Server(a.braid, a.model, a.serve_arg)
    host, port = "127.0.0.1", server.port
    for _ in range(600):
        try:
            if get(host, port, "/health", timeout=2)[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.2)
    else:
        raise SystemExit("the server never became healthy")
    failures = []
    try:
        idle0 = idle_state(host, port)
        warm = Counter()
        run_batch(host, port, max(5, a.requests // 10), a.concurrency, rng, False, warm, time.time() + a.max_seconds)
        base = wait_idle(host, port, idle0)
        rss_base = server.rss_mb()
        log(f"warm-up: {dict(warm)}; idle {base}; RSS {rss_base:.0f} MB")
        tally = Counter()
        t0 = time.time()
        left = run_batch(host, port, a.requests, a.concurrency, rng, True, tally, t0 + a.max_seconds)
        secs = time.time() - t0
        after = wait_idle(host, port, base)
        rss_after = server.rss_mb()
        m = metrics(host, port)
        sent = a.requests - left
        disconnects = sum(v for k, v in tally.items() if k.startswith("disconnect"))
        errors = {k: v for k, v in tally.items() if k.startswith("error") or k == "malformed"}
        log(f"{sent} requests in {secs:.0f} s: {tally['completed']} completed, {disconnects} disconnects "
            f"(queue {tally['disconnect:queue']}, prefill {tally['disconnect:prefill']}, stream {tally['disconnect:stream']}), "
            f"{tally['overloaded']} overloaded (503), errors {errors or 'none'}")
        for k in IDLE_KEYS:
            log(f"  {k}: baseline {base[k]:g}, after {after[k]:g}")
        log(f"  RSS: baseline {rss_base:.0f} MB, after {rss_after:.0f} MB")
        log(f"  lane: cancelled {m.get('braid_cancelled_streams_total', 0):g}, lane failures {m.get('braid_lane_failures_total', 0):g}")
        guided = m.get("braid_guided_checks_total", 0) + m.get("braid_guided_masks_total", 0)
        log(f"  guided: {m.get('braid_guided_checks_total', 0):g} tokens checked, {m.get('braid_guided_masks_total', 0):g} masks")
        for k in IDLE_KEYS:
            if not after[k] <= base[k]:
                failures.append(f"{k} is {after[k]:g} after the run, {base[k]:g} at idle before it")
        if rss_after - rss_base > max(a.rss_slack_mb, 0.25 * rss_base):
            failures.append(f"RSS grew from {rss_base:.0f} MB to {rss_after:.0f} MB")
        if errors:
            failures.append(f"requests failed: {errors}")
        if tally["completed"] == 0:
            failures.append("no request completed")
        if guided == 0 and sent >= 20:
            failures.append("no request ran under a grammar")
        if m.get("braid_lane_failures_total", 0) > 0:
            failures.append("the lane caught a panic")
    finally:
        code = server.stop()
        log(f"server exit status {code} ({time.time() - started:.0f} s in all)")
        if code != 0:
            failures.append(f"braid serve exited with {code} on SIGTERM")
            print("\n".join(server.log_lines[-30:]))
    if failures:
        for f in failures:
            log(f"FAIL: {f}")
        sys.exit(1)
    log("OK")


if __name__ == "__main__":
    main()
