#!/usr/bin/env python3
"""Random-weight models of every family braid serves, at the shapes of real
released checkpoints (a few trimmed in layers or experts so that each is made
and saved in seconds), for `braid bench` on the GPU: the per-family figures.

Each model starts from its tiny fixture's config (testdata/fixtures/*, which
braid's tests hold to transformers) with the shape fields replaced, so the
same loader paths run. transformers makes the weights (its own init, bf16)
and saves an HF folder; no tokenizer (braid bench then feeds distinct ids).

    python3 scripts/gpu/family_models.py OUT_DIR [--tiny] [--only a,b] [--device cuda]

Prints one JSON line per model: its folder, parameters, and the bytes one
decode step of one stream reads (every weight but the input embeddings and
the experts not routed to; a tied head reads the embedding table once).
"""
import argparse, json, sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "testdata" / "fixtures"


def pattern(n, every, last_full=True, a="sliding_attention", b="full_attention"):
    """n layer types, every `every`-th a `b` (Gemma's 5 local : 1 global)."""
    return [b if (i + 1) % every == 0 else a for i in range(n)]


def lfm2_types(n, attn):
    return ["full_attention" if i in attn else "conv" for i in range(n)]


# name: (fixture, what replaces the fixture's shape, active-expert fraction key)
FAMILIES = {
    # Llama-3.2-1B
    "llama": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                            max_position_embeddings=8192)),
    # Qwen2.5-0.5B
    "qwen2": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                            num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                            layer_types=["full_attention"] * 24, max_position_embeddings=8192)),
    # Qwen3-0.6B
    "qwen3": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                            layer_types=["full_attention"] * 28, max_position_embeddings=8192)),
    # Gemma-3-1B
    "gemma3": ("gemma3_text", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, vocab_size=262144,
                                   sliding_window=512, layer_types=pattern(26, 6), max_position_embeddings=8192)),
    # Gemma-4 E2B-like: per-layer inputs, KV shared by the last 20 of 35 layers
    "gemma4": ("gemma4_text", dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                                   num_key_value_heads=1, head_dim=256, hidden_size_per_layer_input=256,
                                   vocab_size=262144, vocab_size_per_layer_input=262144, num_kv_shared_layers=20,
                                   global_head_dim=512, sliding_window=512, layer_types=pattern(35, 5),
                                   max_position_embeddings=8192)),
    # Gemma-4 26B-A4B-like MoE, 4 of its 30 layers
    "gemma4_moe": ("gemma4_text_moe", dict(hidden_size=2816, intermediate_size=2112, moe_intermediate_size=704,
                                           num_experts=128, top_k_experts=8, num_hidden_layers=4, num_attention_heads=16,
                                           num_key_value_heads=8, head_dim=256, global_head_dim=512,
                                           num_global_key_value_heads=2, vocab_size=262144, sliding_window=1024,
                                           layer_types=pattern(4, 4), max_position_embeddings=8192)),
    # LFM2-350M
    "lfm2": ("lfm2", dict(hidden_size=1024, intermediate_size=6656, num_hidden_layers=16, num_attention_heads=16,
                          num_key_value_heads=8, vocab_size=65536, layer_types=lfm2_types(16, {2, 5, 8, 10, 12, 14}),
                          max_position_embeddings=8192)),
    # LFM2-8B-A1B, 8 of its 24 layers
    "lfm2_moe": ("lfm2_moe", dict(hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792, num_experts=32,
                                  num_experts_per_tok=4, num_dense_layers=2, num_hidden_layers=8, num_attention_heads=32,
                                  num_key_value_heads=8, vocab_size=65536, layer_types=lfm2_types(8, {2, 6}),
                                  max_position_embeddings=8192)),
    # Nemotron-3-Nano-like (Mamba2 + MoE + attention), 7 layers, 64 of its 128 experts
    "nemotron_h": ("nemotron_h", dict(hidden_size=2688, intermediate_size=1856, moe_intermediate_size=1856,
                                      moe_shared_expert_intermediate_size=3712, n_routed_experts=64, num_experts_per_tok=6,
                                      mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                                      num_attention_heads=32, num_key_value_heads=2, head_dim=128, vocab_size=131072,
                                      layers_block_type=["linear_attention", "moe", "linear_attention", "full_attention",
                                                         "moe", "linear_attention", "moe"], max_position_embeddings=8192)),
    # Granite-4.0-H-Tiny-like (Mamba2 + MoE + attention), 16 layers
    "granite": ("granitemoehybrid", dict(hidden_size=1536, intermediate_size=512, shared_intermediate_size=1024,
                                         num_local_experts=64, num_experts_per_tok=6, mamba_n_heads=48, mamba_d_head=64,
                                         mamba_d_state=128, mamba_n_groups=1, num_attention_heads=12, num_key_value_heads=4,
                                         vocab_size=100352, layer_types=(["linear_attention"] * 5 + ["full_attention"]) * 2
                                         + ["linear_attention"] * 4, num_hidden_layers=16, max_position_embeddings=8192)),
    # Qwen3-Next-80B-A3B-like, 8 of its 48 layers, 64 of its 512 experts
    "qwen3_next": ("qwen3_next", dict(hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512,
                                      shared_expert_intermediate_size=512, num_experts=64, num_experts_per_tok=10,
                                      num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                      linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                      linear_value_head_dim=128, vocab_size=151936,
                                      layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                                      max_position_embeddings=8192)),
    # MiniMax-Text-01-like (lightning attention + MoE), 8 layers, 8 experts
    "minimax": ("minimax", dict(hidden_size=2048, intermediate_size=4096, num_local_experts=8, num_experts_per_tok=2,
                                num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                vocab_size=200064, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                                max_position_embeddings=8192)),
    # MiniMax-M2-like, 4 of its 62 layers, 32 of its 256 experts
    "minimax_m2": ("minimax_m2", dict(hidden_size=3072, intermediate_size=1536, num_local_experts=32, num_experts_per_tok=8,
                                      num_hidden_layers=4, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                                      rotary_dim=64, vocab_size=200064, max_position_embeddings=8192)),
}

# The tiny variant (--tiny): the same families at a size this 2-core CPU
# makes and braid loads in a second, to check the script before a GPU call.
TINY = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, vocab_size=512, num_experts=8,
            n_routed_experts=8, num_local_experts=8, shared_expert_intermediate_size=64,
            moe_shared_expert_intermediate_size=64, shared_intermediate_size=64, vocab_size_per_layer_input=512,
            hidden_size_per_layer_input=16, mamba_num_heads=8, mamba_n_heads=8, mamba_head_dim=32, mamba_d_head=32,
            ssm_state_size=16, mamba_d_state=16, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            global_head_dim=64, num_global_key_value_heads=1, num_experts_per_tok=2, top_k_experts=2,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
            rotary_dim=16)


def active_fraction(cfg):
    """Of an expert tensor, the share one token reads."""
    n = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    k = cfg.get("num_experts_per_tok") or cfg.get("top_k_experts")
    return (k / n) if n and k else 1.0


def decode_bytes(model, cfg):
    frac = active_fraction(cfg)
    total = 0
    # named_parameters names a tied head's table once (as the embeddings).
    for n, p in model.named_parameters():
        b = p.numel() * p.element_size()
        if "embed_tokens_per_layer" in n:
            continue  # one row per token
        if "embed_tokens" in n and not cfg.get("tie_word_embeddings"):
            continue  # a row per token; the head is its own tensor
        if "experts" in n and "shared" not in n:
            b *= frac  # routed experts: k of n per token
        total += b
    return int(total)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--only")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    names = a.only.split(",") if a.only else list(FAMILIES)
    for name in names:
        fixture, shape = FAMILIES[name]
        # Infinity is written {"__float__": "Infinity"}; per_layer_config is
        # what transformers derives from global_head_dim and the like.
        inf = lambda d: float(d["__float__"]) if set(d) == {"__float__"} else d
        cfg = json.loads((FIXTURES / fixture / "config.json").read_text(), object_hook=inf)
        cfg.pop("per_layer_config", None)
        cfg.update(shape)
        if a.tiny:
            cfg.update({k: v for k, v in TINY.items() if k in cfg})
            cfg["num_hidden_layers"] = len(cfg.get("layer_types") or cfg.get("layers_block_type") or [0] * 4)
        if "layers_block_type" in cfg:
            cfg["num_hidden_layers"] = len(cfg["layers_block_type"])
        for k in ("transformers_version", "architectures_version"):
            cfg.pop(k, None)
        cfg["dtype"] = "bfloat16"
        dst = Path(a.out) / name
        try:
            c = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
            c.architectures = cfg.get("architectures")
            with torch.device(a.device):
                model = AutoModelForCausalLM.from_config(c, dtype=torch.bfloat16)
            model.save_pretrained(dst)
            params = sum(p.numel() for p in model.parameters())
            print(json.dumps({"family": name, "dir": str(dst), "params": params, "decode_bytes": decode_bytes(model, cfg),
                              "transformers": transformers.__version__}), flush=True)
            del model
            if a.device == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # one family's failure must not hide the others'
            print(json.dumps({"family": name, "error": f"{type(e).__name__}: {e}"[:400]}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
