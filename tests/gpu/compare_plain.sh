#!/usr/bin/env bash
# On the device, right after `KEEP=1 bash tests/gpu/run_runbook.sh PARAMS` left the runbook's server up:
#   bash tests/gpu/compare_plain.sh [PARAMS]
# 1. benchmarks the runbook's server (C=1, C=16; bench_pair.py), 2. stops every session the run recorded
# (by session ID), 3. starts the anchors' plain command on the same model
#    vllm serve MODEL -tp 2 --distributed-executor-backend ray --gpu-memory-utilization 0.8
# (+ only what this machine needs: --load-format dummy, since the weights are not here; the served name and port
# so the same client reaches it; the params' runtime.env), 4. waits for /health, benchmarks it with the same load,
# 5. prints both side by side with the ratio, and stops it. Everything lands in $OUT.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"
PARAMS="${1:-params/h200-duo.yaml}"
[ -f "/tmp/run-$(basename "$PARAMS")" ] && PARAMS="/tmp/run-$(basename "$PARAMS")"   # run_runbook.sh's copy
OUT="${OUT:-/tmp/out_local}"; mkdir -p "$OUT"
exec > >(tee -a "$OUT/compare.txt") 2>&1
q() { "$PY" -c 'import sys,yaml; d=yaml.safe_load(open(sys.argv[1])); [d:=d[int(k) if k.isdigit() else k] for k in sys.argv[2].split(".")]; print(d)' "$PARAMS" "$1"; }
MODEL=$(q model.path); NAME=$(q model.served_name); PORT=$(q serve.port); HOST=$(q nodes.0.fabric_ip)   # vllm serve --host is the head's fabric IP
IN=$(q benchmark.input_len); OUTLEN=$(q benchmark.output_len); N="${PAIR_PROMPTS:-32}"
echo "=== 1. runbook's server at $HOST:$PORT $(date -u +%T)"
if curl -sf "http://$HOST:$PORT/health" >/dev/null; then
  "$PY" tests/gpu/bench_pair.py bench runbook "http://$HOST:$PORT" "$NAME" "$OUT/pair-runbook.json" "$N" "$IN" "$OUTLEN"
else
  echo "the runbook's server does not answer /health: nothing to compare"; exit 3
fi
echo "=== 2. stop the runbook's sessions"
sids=$(gpu_sessions)
for s in $sids; do pkill -TERM -s "$s"; done; sleep 8; for s in $sids; do pkill -KILL -s "$s"; done
sleep 3; nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
PLAIN_PORT=$((PORT + 1))
echo "=== 3. plain command on port $PLAIN_PORT $(date -u +%T)"
eval "$("$PY" tests/gpu/bench_pair.py env "$PARAMS")"
export PYTHONPATH="$SITE:$REPO"
argv=("$PY" -m vllm.entrypoints.cli.main serve "$MODEL" -tp 2 --distributed-executor-backend ray
      --gpu-memory-utilization 0.8 --load-format dummy --served-model-name "$NAME" --port "$PLAIN_PORT")
echo "${argv[*]}"
T0=$SECONDS
setsid "${argv[@]}" > "$OUT/plain-serve.log" 2>&1 < /dev/null &
PID=$!
ready=""
while [ $((SECONDS - T0)) -lt "${PLAIN_READY_S:-420}" ]; do
  if curl -sf "http://127.0.0.1:$PLAIN_PORT/health" >/dev/null; then ready=$((SECONDS - T0)); break; fi
  kill -0 $PID 2>/dev/null || { echo "plain server exited"; tail -40 "$OUT/plain-serve.log"; exit 4; }
  sleep 2
done
[ -n "$ready" ] || { echo "plain server not ready in time"; tail -40 "$OUT/plain-serve.log"; pkill -KILL -s $PID; exit 5; }
echo "plain: /health after $ready s"
echo "=== 4. plain benchmark $(date -u +%T)"
"$PY" tests/gpu/bench_pair.py bench plain "http://127.0.0.1:$PLAIN_PORT" "$NAME" "$OUT/pair-plain.json" "$N" "$IN" "$OUTLEN"
echo "=== 5. side by side (plain ready in $ready s)"
"$PY" tests/gpu/bench_pair.py table "$OUT" | tee "$OUT/pair-table.md"
pkill -TERM -s $PID; sleep 5; pkill -KILL -s $PID
echo "plain stopped; GPU memory: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' ')"
