#!/usr/bin/env python3
"""Single-stream decode speed with and without a drafter, side by side.

Runs `braid run` greedy on the same prompts, alternating a plain run, a
run with `--draft-model` for each `--draft-tokens` value and (`--ngram`)
one with `--drafter ngram`, `--reps` times,
so drifting load hits both alike. Prints the median decode tokens/s of
each, the ratio to plain, the acceptance (tokens per decode round, drafts
accepted / proposed), and checks every drafted output equals the plain one.

  scripts/bench_draft.py --model ~/.cache/braid/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
      --draft ~/.cache/braid/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --tokens 2,4,6 --reps 3
  scripts/bench_draft.py --model ~/.cache/braid/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
      --ngram --prompts edit -n 256
  scripts/bench_draft.py --device cuda --braid .device-bin/braid --model .joined/1.5b.gguf \
      --draft .joined/0.5b.gguf --tokens 4,6 (on the GPU machine: scripts/gpu/slices.py)

`--prompts edit` asks for a given function back with one change (prompt
lookup's case: the reply copies its input); `write` (default) asks for new
code.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

WRITE = [
    "Write a Python function that checks whether a number is prime, with a docstring.",
    "Write a C function that reverses a singly linked list in place.",
]

CODE = """def merge_intervals(intervals):
    \"\"\"Merge overlapping [start, end] intervals and return them sorted.\"\"\"
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    \"\"\"The total length covered by the intervals, overlaps counted once.\"\"\"
    covered = 0
    for start, end in merge_intervals(intervals):
        covered += end - start
    return covered
"""

EDIT = [
    "Rename the variable `merged` to `result` everywhere in this code. Reply with the whole code only.\n\n" + CODE,
    "Add type hints (list[list[int]] and int) to both functions in this code. Reply with the whole code only.\n\n" + CODE,
]

RATE = re.compile(r"then ([0-9.]+) tokens/s")
DRAFTS = re.compile(r"\[drafts: (\d+) proposed, (\d+) accepted, ([0-9.]+) tokens per decode round\]")


def run(braid, args, prompt, extra):
    cmd = [braid, "run", "-m", args.model, "--device", args.device, "--chat", "--temperature", "0", "-n", str(args.n), *extra, prompt]
    if args.threads:
        cmd[2:2] = ["-t", str(args.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    rate = RATE.search(p.stderr)
    if not rate:
        sys.exit(f"no rate in the output of {' '.join(cmd)}:\n{p.stderr}")
    d = DRAFTS.search(p.stderr)
    return p.stdout, float(rate.group(1)), (int(d.group(1)), int(d.group(2)), float(d.group(3))) if d else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--braid", default=os.path.join(os.path.dirname(__file__), "..", "target", "release", "braid"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu", help="braid's --device (cuda: on the GPU machine, with --braid .device-bin/braid)")
    ap.add_argument("--draft", help="a draft model (GGUF) to run with --draft-model")
    ap.add_argument("--ngram", action="store_true", help="also run with --drafter ngram")
    ap.add_argument("--prompts", choices=["write", "edit"], default="write")
    ap.add_argument("--tokens", default="4", help="--draft-tokens values, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    ks = [int(k) for k in args.tokens.split(",")] if args.draft else []
    configs = [("plain", [])] + [(f"draft k={k}", ["--draft-model", args.draft, "--draft-tokens", str(k)]) for k in ks]
    if args.ngram:
        configs.append(("ngram", ["--drafter", "ngram"]))
    if len(configs) == 1:
        sys.exit("nothing to compare: give --draft or --ngram")
    prompts = EDIT if args.prompts == "edit" else WRITE
    rates = {name: [] for name, _ in configs}
    accept = {name: [] for name, _ in configs}
    for rep in range(args.reps):
        for pi, prompt in enumerate(prompts):
            plain_out = None
            for name, extra in configs:
                out, rate, drafts = run(args.braid, args, prompt, extra)
                if plain_out is None:
                    plain_out = out
                elif out != plain_out:
                    sys.exit(f"{name}: the output of prompt {pi} differs from the plain run's")
                rates[name].append(rate)
                if drafts:
                    accept[name].append(drafts)
                print(f"rep {rep} prompt {pi} {name}: {rate:.1f} tokens/s" + (f", {drafts[1]}/{drafts[0]} drafts accepted, {drafts[2]:.2f} tokens/round" if drafts else ""), file=sys.stderr)
    base = statistics.median(rates["plain"])
    print(f"| run | decode tokens/s (median of {len(rates['plain'])}) | vs plain | drafts accepted | tokens per decode round |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, _ in configs:
        med = statistics.median(rates[name])
        a = accept[name]
        acc = f"{sum(x[1] for x in a)}/{sum(x[0] for x in a)}" if a else "-"
        per = f"{statistics.median(x[2] for x in a):.2f}" if a else "1.00"
        print(f"| {name} | {med:.1f} | {med / base:.2f}x | {acc} | {per} |")
    print("outputs: every drafted run equal to the plain run, token for token")


if __name__ == "__main__":
    main()
