#!/usr/bin/env python3
"""A random-weight Gemma 3 with the real vision tower's shape, for the image stall runs.

SigLIP so400m as Gemma 3 ships it (27 layers, hidden 1152, MLP 4304, 16 heads, 896 px in
14 px patches: 4096 patches, pooled to 256 soft tokens) and a small text model (Gemma 3
270M's shape, with the fixture's 256-token byte vocabulary so `braid serve` can tokenize
text). Random weights: only the costs are real. Written to an ignored folder (about 2 GB):

    /work/venv-fixtures/bin/python scripts/bench/make_vision_stall_model.py [OUT]

OUT defaults to target/vision-stall-model. Serve it with `--chat-template gemma`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "fixtures"))
from make_vision import BOI, EOI, IMAGE, write_processor_files  # noqa: E402

SIDE, PATCH, TOKENS = 896, 14, 256


def config() -> Gemma3Config:
    text = dict(
        model_type="gemma3_text", vocab_size=256, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32768,
        rope_theta=1_000_000.0, query_pre_attn_scalar=256, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    vision = dict(
        model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
        num_attention_heads=16, num_channels=3, image_size=SIDE, patch_size=PATCH, layer_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh", vision_use_head=False,
    )
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS,
                        boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE)


@torch.no_grad()
def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "target" / "vision-stall-model"
    torch.manual_seed(1)
    model = Gemma3ForConditionalGeneration(config()).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    write_processor_files(out, SIDE, TOKENS)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: {size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
