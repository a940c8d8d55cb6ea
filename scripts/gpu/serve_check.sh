# On the GPU machine: serve SmolLM2 (staged at /root/braid-stage) on the
# device, send three seeded top-k requests and a greedy one at once, then
# print their texts and the lane's device-sampled round counters.
set -u
B=.device-bin
. scripts/gpu/unpack.sh
$B/braid serve --device cuda --model /root/braid-stage/SmolLM2-135M-Instruct.Q4_1.gguf --port 8088 > /tmp/serve.log 2>&1 &
SP=$!
for i in $(seq 1 60); do curl -sf http://127.0.0.1:8088/health > /dev/null && break; sleep 0.5; done
req() { curl -s http://127.0.0.1:8088/v1/completions -H 'Content-Type: application/json' -d "{\"prompt\":\"The capital of France is\",\"max_tokens\":48,$1}"; }
pids=""
for s in 1 2 3; do req "\"temperature\":0.8,\"top_k\":40,\"seed\":$s" > /tmp/r$s.json & pids="$pids $!"; done
req "\"temperature\":0" > /tmp/g.json & pids="$pids $!"
wait $pids
# The same seeded request again, alone (its text may differ: the GPU
# declares no batch invariance, and its prompt ran beside the others).
req "\"temperature\":0.8,\"top_k\":40,\"seed\":1" > /tmp/r1b.json
for f in /tmp/r1.json /tmp/r1b.json /tmp/r2.json /tmp/g.json; do python3 -c "import json,sys; d=json.load(open('$f')); print('$f', repr(d['choices'][0]['text'][:90]))"; done
curl -s http://127.0.0.1:8088/metrics | grep -E "^braid_(greedy|top_k|decode)_rounds_total"
kill $SP; wait $SP 2>/dev/null; tail -3 /tmp/serve.log
