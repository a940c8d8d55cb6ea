#!/usr/bin/env python3
"""A random-weight Gemma 3 with the real vision tower's shape, for the image stall runs.

SigLIP so400m as Gemma 3 ships it (27 layers, hidden 1152, MLP 4304, 16 heads, 896 px in
14 px patches: 4096 patches, pooled to 256 soft tokens) and a small text model (Gemma 3
270M's shape, with the fixture's 256-token byte vocabulary so `braid serve` can tokenize
text). Random weights: only the costs are real. NumPy only (no torch): the config, the
processor files and the tensor names are the committed vision fixture's
(testdata/fixtures/gemma3_vision, made by transformers), at these sizes. Written to an
ignored folder (about 2 GB):

    python3 scripts/bench/make_vision_stall_model.py [OUT]

OUT defaults to target/vision-stall-model. Serve it with `--chat-template gemma`.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "testdata" / "fixtures" / "gemma3_vision"
SIDE, PATCH, TOKENS = 896, 14, 256
VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
              image_size=SIDE, patch_size=PATCH)
TEXT = dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32768,
            query_pre_attn_scalar=256)


def shapes() -> dict[str, list[int]]:
    vh, vi, th, ti, hd = VISION["hidden_size"], VISION["intermediate_size"], TEXT["hidden_size"], TEXT["intermediate_size"], TEXT["head_dim"]
    q = TEXT["num_attention_heads"] * hd
    s = {"language_model.model.embed_tokens.weight": [256, th], "language_model.model.norm.weight": [th],
         "multi_modal_projector.mm_input_projection_weight": [vh, th], "multi_modal_projector.mm_soft_emb_norm.weight": [vh],
         "vision_tower.embeddings.patch_embedding.weight": [vh, 3, PATCH, PATCH], "vision_tower.embeddings.patch_embedding.bias": [vh],
         "vision_tower.embeddings.position_embedding.weight": [(SIDE // PATCH) ** 2, vh],
         "vision_tower.post_layernorm.weight": [vh], "vision_tower.post_layernorm.bias": [vh]}
    for i in range(TEXT["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        for n in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]:
            s[p + n + ".weight"] = [th]
        s |= {p + "mlp.gate_proj.weight": [ti, th], p + "mlp.up_proj.weight": [ti, th], p + "mlp.down_proj.weight": [th, ti],
              p + "self_attn.q_proj.weight": [q, th], p + "self_attn.k_proj.weight": [hd, th], p + "self_attn.v_proj.weight": [hd, th],
              p + "self_attn.o_proj.weight": [th, q], p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]}
    for i in range(VISION["num_hidden_layers"]):
        p = f"vision_tower.encoder.layers.{i}."
        for n in ["layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc2"]:
            s[p + n + ".bias"] = [vh]
        for n in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"]:
            s[p + n + ".weight"] = [vh, vh]
        s |= {p + "layer_norm1.weight": [vh], p + "layer_norm2.weight": [vh], p + "mlp.fc1.weight": [vi, vh],
              p + "mlp.fc1.bias": [vi], p + "mlp.fc2.weight": [vh, vi]}
    return s


def value(name: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    # Gemma's RMS norms scale by 1 + w (zeros: none); SigLIP's layer norms by w.
    if name.startswith("vision_tower") and "norm" in name and name.endswith(".weight"):
        return np.ones(shape, np.float32)
    if "norm" in name or name.endswith(".bias"):
        return np.zeros(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "target" / "vision-stall-model"
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((FIXTURE / "config.json").read_text())
    config["vision_config"] |= VISION
    config["text_config"] |= TEXT
    config["text_config"]["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(TEXT["num_hidden_layers"])]
    config["mm_tokens_per_image"] = TOKENS
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    pre = json.loads((FIXTURE / "preprocessor_config.json").read_text())
    pre |= {"size": {"height": SIDE, "width": SIDE}, "image_seq_length": TOKENS}
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    shutil.copy(FIXTURE / "tokenizer.json", out / "tokenizer.json")

    s = shapes()
    # The fixture's tensors, layer numbers aside, are exactly these.
    with open(FIXTURE / "model.safetensors", "rb") as f:
        fixture = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    kinds = lambda names: {re.sub(r"\.\d+\.", ".N.", n) for n in names if n != "__metadata__"}  # noqa: E731
    assert kinds(fixture) == kinds(s), kinds(fixture) ^ kinds(s)

    header, offset = {}, 0
    for name, shape in s.items():
        size = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    rng = np.random.default_rng(1)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, shape in s.items():
            f.write(value(name, shape, rng).tobytes())
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out}: {size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
