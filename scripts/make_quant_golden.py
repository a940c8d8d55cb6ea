#!/usr/bin/env python3
"""Golden data for braid-ops' dequantization tests.

For every GGML type the `gguf` package (gguf-py, llama.cpp's own Python
reference) can dequantize, write crates/ops/tests/data/<TYPE>.bin holding
random blocks and gguf's dequantized floats. Blocks come from two sources:
random floats quantized by gguf where it can quantize that type, and random
bytes whose f16 scale fields are replaced by sane values (so every bit
pattern of the packed values is exercised, and no scale is inf/NaN).

File layout (little-endian): b"BQG1", u32 type id (GGML), u32 elements,
u32 bytes, the raw blocks, then the f32 values.

    pip install gguf numpy && python3 scripts/make_quant_golden.py
"""

import os
import struct

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "ops", "tests", "data")

# Byte offsets of f16 scale fields inside each block type.
SCALES = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16}


def random_blocks(rng, qtype, n_blocks):
    bs, ts = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for off in SCALES[qtype]:
        scale = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def main():
    rng = np.random.default_rng(20250611)
    os.makedirs(OUT, exist_ok=True)
    for qtype in [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                  T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]:
        bs, ts = quants.GGML_QUANT_SIZES[qtype]
        n_blocks = 8 if bs == 256 else (16 if bs == 32 else 256)
        n = n_blocks * bs
        if qtype == T.F32:
            raw = rng.normal(0, 2, size=n).astype(np.float32).view(np.uint8)
            values = raw.view(np.float32)
        elif qtype == T.F16:
            x = rng.normal(0, 2, size=n).astype(np.float16)
            # Zeros, subnormals, the largest normal, infinities and a NaN.
            x[:8] = np.array([0.0, -0.0, 6e-8, -3e-5, 65504, np.inf, -np.inf, np.nan], np.float16)
            raw = x.view(np.uint8)
            values = x.astype(np.float32)
        else:
            parts = []
            # Half quantized floats (all of it for BF16), half random bytes.
            n_q = 0 if qtype not in QUANTIZABLE else (n if qtype not in SCALES else n // 2)
            if n_q:
                x = rng.normal(0, 1, size=n_q).astype(np.float32)
                x[: bs] *= 0.0  # an all-zero block
                parts.append(quants.quantize(x, qtype).reshape(-1))
            if qtype in SCALES:
                parts.append(random_blocks(rng, qtype, (n - n_q) // bs))
            raw = np.concatenate(parts).astype(np.uint8)
            values = quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
        assert values.size == n and raw.size == n // bs * ts, (qtype, values.size, raw.size)
        path = os.path.join(OUT, f"{qtype.name}.bin")
        with open(path, "wb") as f:
            f.write(b"BQG1")
            f.write(struct.pack("<III", int(qtype), n, raw.size))
            f.write(raw.tobytes())
            f.write(values.astype("<f4").tobytes())
        print(f"{path}: {n} elements, {raw.size} bytes")


if __name__ == "__main__":
    main()
