#!/usr/bin/env bash
# The stall scenario on this machine's CPU, against `braid serve` (a fresh
# server per run, SmolLM2): background streams decode, a long prompt
# arrives, and ../shared/bench/stall_probe.py reports the background's
# largest gap during the arrival against its usual one, p99 gap and the
# newcomer's TTFT. One row per (setting, seed):
#   scripts/stall_cpu.sh [STREAMS] [GEN] [LONG] [SEEDS] -- [SERVE FLAGS...] [-- SERVE FLAGS...]
# e.g. scripts/stall_cpu.sh 6 600 1800 "1 2 3" -- --prefill-share 0.15 -- --itl-target 30
# PROBE=rust runs the server crate's stall_probe example instead (build it
# first: cargo build --release -p braid-server --example stall_probe).
# NICE=10 runs the server behind the probe, which shares these two cores
# (else the probe's threads, waiting for a core, add gaps the lane never made).
set -uo pipefail
cd "$(dirname "$0")/.."
PROBE=${PROBE:-../shared/bench/stall_probe.py}
streams=${1:-6}; gen=${2:-600}; long=${3:-1800}; seeds=${4:-"1 2 3"}
shift 4 || true
[ "${1:-}" = "--" ] && shift
port=${PORT:-8133}
braid=${BRAID:-./target/release/braid}
echo "| serve flags | seed | usual gap ms | largest gap ms | ratio | p99 gap ms | TTFT ms | largest before ms |"
echo "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
run_setting() {
  local flags=("$@")
  for s in $seeds; do
    nice -n "${NICE:-0}" "$braid" serve --device cpu --port "$port" "${flags[@]}" >/tmp/braid-stall-serve.log 2>&1 &
    local pid=$!
    for _ in $(seq 100); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 0.2; done
    local j
    if [ "$PROBE" = rust ]; then
      j=$(./target/release/examples/stall_probe "http://127.0.0.1:$port" --streams "$streams" --gen "$gen" --long-tokens "$long" --ignore-eos --seed "$s" 2>/dev/null | tail -1)
    else
      j=$(python3 "$PROBE" "http://127.0.0.1:$port" --streams "$streams" --gen "$gen" --long-tokens "$long" --ignore-eos on --seed "$s" 2>/dev/null | tail -1)
    fi
    kill "$pid"; wait "$pid" 2>/dev/null
    python3 - "$j" "${flags[*]:-defaults}" "$s" <<'PY'
import json, sys
j = json.loads(sys.argv[1])
# The largest gap of a quiet window as long as the arrival, just before it
# (the Rust probe's; the machine's own spread): '-' from the Python probe.
# A field the probe could not fill (the streams ended before the
# arrival: no gap during it) reads '-'.
def f(key, fmt):
    v = j.get(key)
    return format(v, fmt) if v is not None else "-"
print(f"| {sys.argv[2]} | {sys.argv[3]} | {f('baseline_median_gap_ms', '.1f')} | {f('max_gap_in_prefill_ms', '.1f')} | {f('stall_ratio', '.2f')} | "
      f"{f('p99_gap_ms', '.1f')} | {f('newcomer_ttft_ms', '.0f')} | {f('max_gap_before_ms', '.1f')} |")
PY
  done
}
setting=()
for a in "$@"; do
  if [ "$a" = "--" ]; then run_setting "${setting[@]}"; setting=(); else setting+=("$a"); fi
done
run_setting "${setting[@]}"
