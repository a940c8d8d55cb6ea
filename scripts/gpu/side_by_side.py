#!/usr/bin/env python3
"""The table of scripts/gpu/side_by_side.sh: braid's figure, llama.cpp's and
the ratio for decode at 1/8/32/64 streams, a 2048-token prefill and the
stall scenario (largest gap during the arrival over the usual gap, and the
newcomer's TTFT; the range over seeds). Missing runs print as '-'."""
import json
import os
import statistics
import sys

out = sys.argv[1]


def load(name, default):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


braid = {r["test"]: r["tokens_per_s"]["median"] for r in load("braid-bench.json", {}).get("results", [])}
lc_bench = {("pp" if r.get("n_gen") == 0 else "tg"): r["avg_ts"] for r in load("llamacpp-bench.json", [])}
# llama-batched-bench's table: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
lc_batched = {}
try:
    for line in open(os.path.join(out, "llamacpp-batched.md")):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2].isdigit():
            lc_batched[int(cells[2])] = float(cells[7])
except OSError:
    pass


def row(what, b, l, unit="tok/s"):
    ratio = f"{b / l:.2f}x" if b and l else "-"
    fmt = (lambda v: f"{v:,.0f}") if unit == "tok/s" else (lambda v: v)
    print(f"| {what} | {fmt(b) if b else '-'} | {fmt(l) if l else '-'} | {ratio} |")


print("| measure (Llama-1B shape unless named) | braid | llama.cpp | braid / llama.cpp |")
print("| --- | ---: | ---: | ---: |")
row("decode, 1 stream (tg128), tok/s", braid.get("tg128"), lc_bench.get("tg"))
for n in (8, 32, 64):
    row(f"decode, {n} streams (aggregate), tok/s", braid.get(f"decode x{n} streams (aggregate)"), lc_batched.get(n))
row("prefill 2048, tok/s", braid.get("pp2048"), lc_bench.get("pp"))

runs = []
try:
    runs = [json.loads(l) for l in open(os.path.join(out, "stall.jsonl")) if l.strip()]
except (OSError, ValueError):
    pass


def span(vals, fmt):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-", None
    lo, hi = min(vals), max(vals)
    return (fmt(lo) if lo == hi else f"{fmt(lo)}–{fmt(hi)}"), statistics.median(vals)


print()
print("| stall scenario | engine | ratio | largest gap / usual gap (ms) | newcomer TTFT (ms) | seeds |")
print("| --- | --- | ---: | --- | ---: | ---: |")
medians = {}
for mod in ("smollm2", "llama1b"):
    for engine in ("braid", "llama.cpp"):
        rs = [r for r in runs if r.get("label") == f"{engine} {mod}"]
        ratio, med = span([r.get("stall_ratio") for r in rs], lambda v: f"{v:.1f}")
        gap, _ = span([r.get("max_gap_in_prefill_ms") for r in rs], lambda v: f"{v:.1f}")
        usual, _ = span([r.get("baseline_median_gap_ms") for r in rs], lambda v: f"{v:.2f}")
        ttft, ttft_med = span([r.get("newcomer_ttft_ms") for r in rs], lambda v: f"{v:.0f}")
        medians[(engine, mod)] = (med, ttft_med)
        print(f"| {mod} shape | {engine} | {ratio} | {gap} / {usual} | {ttft} | {len(rs)} |")
for mod in ("smollm2", "llama1b"):
    (br, bt), (lr, lt) = medians[("braid", mod)], medians[("llama.cpp", mod)]
    if br and lr:
        print(f"\n{mod}: median stall ratio braid {br:.1f} vs llama.cpp {lr:.1f}; median TTFT braid {bt:.0f} ms vs llama.cpp {lt:.0f} ms")
