#!/usr/bin/env python3
"""Print braid's GPU benchmark beside transformers' (JSON files from
gpu_bench --json and hf_bench.py --json) with the ratios."""
import json, sys

b = json.load(open(sys.argv[1]))
h = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {"decode": []}
hf = {d["streams"]: d["tok_s"] for d in h["decode"]}
print(f"| streams | braid tok/s (graphs) | braid tok/s (eager) | of HBM bound | transformers tok/s | braid / transformers |")
print("| --- | --- | --- | --- | --- | --- |")
for n in sorted({d["streams"] for d in b["decode"]}):
    g = [d for d in b["decode"] if d["streams"] == n and d["graphs"]]
    e = [d for d in b["decode"] if d["streams"] == n and not d["graphs"]]
    best = g[0] if g else e[0]
    t = hf.get(n)
    print(f"| {n} | {g[0]['tok_s']:.0f} | " if g else f"| {n} | - | ", end="")
    print(f"{e[0]['tok_s']:.0f} | " if e else "- | ", end="")
    print(f"{100*best['tok_s']/max(best['hbm_bound_tok_s'],1e-9):.0f}% | {t:.0f} | {best['tok_s']/t:.1f}x |" if t else
          f"{100*best['tok_s']/max(best['hbm_bound_tok_s'],1e-9):.0f}% | - | - |")
if b.get("prefill_tokens"):
    line = f"\nprefill {b['prefill_tokens']} tokens: braid {b['prefill_tok_s']:.0f} tok/s ({b['prefill_tflops']:.0f} TFLOP/s, {100*b['prefill_tflops']/max(b['gemm_tflops'],1e-9):.0f}% of {b['gemm_tflops']:.0f})"
    if h.get("prefill_tok_s"):
        line += f"; transformers {h['prefill_tok_s']:.0f} tok/s; ratio {b['prefill_tok_s']/h['prefill_tok_s']:.2f}x"
    print(line)
