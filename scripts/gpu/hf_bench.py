#!/usr/bin/env python3
"""The peer for `gpu_bench`: Hugging Face transformers on the same GPU, same
shape (Llama-3.2-1B: hidden 2048, 16 layers, 32/8 heads of 64, MLP 8192,
vocab 128256, tied embeddings), random bf16 weights, greedy decode with the
default dynamic cache, and one 2048-token prefill. Writes JSON (--json)."""
import argparse, json, sys, time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                      rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    print(f"transformers model: {sum(p.numel() for p in model.parameters())/1e9:.3f} B params, "
          f"attn {model.config._attn_implementation}", file=sys.stderr)
    out = {"torch": torch.__version__, "decode": [], "attn_implementation": model.config._attn_implementation}
    import transformers
    out["transformers"] = transformers.__version__
    with torch.inference_mode():
        for b in [int(s) for s in a.streams.split(",")]:
            ids = torch.randint(0, cfg.vocab_size, (b, a.prompt), device="cuda")
            o = model(input_ids=ids, use_cache=True)
            past = o.past_key_values
            tok = o.logits[:, -1].argmax(-1, keepdim=True)
            for r in range(a.warmup + a.rounds):
                if r == a.warmup:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                o = model(input_ids=tok, past_key_values=past, use_cache=True)
                past = o.past_key_values
                tok = o.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            tps = b * a.rounds / dt
            print(f"hf decode {b} streams: {tps:.0f} tok/s ({1e3*dt/a.rounds:.2f} ms/round)", file=sys.stderr)
            out["decode"].append({"streams": b, "tok_s": tps})
            del past, o
            torch.cuda.empty_cache()
        if a.prefill:
            ids = torch.randint(0, cfg.vocab_size, (1, a.prefill), device="cuda")
            times = []
            for _ in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            t = sorted(times[1:])[1]
            out["prefill_tokens"] = a.prefill
            out["prefill_tok_s"] = a.prefill / t
            print(f"hf prefill {a.prefill}: {1e3*t:.2f} ms, {a.prefill/t:.0f} tok/s", file=sys.stderr)
    if a.json:
        json.dump(out, open(a.json, "w"))


if __name__ == "__main__":
    main()
