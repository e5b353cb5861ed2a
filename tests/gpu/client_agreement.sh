#!/usr/bin/env bash
# On the device, after stage.sh installed everything (issue 6 on a machine whose speed holds still):
#   bash tests/gpu/client_agreement.sh serve [PARAMS]    starts `vllm serve MODEL -tp $TP` (default 1, one H200 holds it)
#                                                        (dummy weights, port 8001, the params' env), waits for /health
#   bash tests/gpu/client_agreement.sh compare [ROUNDS]  sparkbook's client and `vllm bench serve` alternating on it at
#                                                        C=1 and C=8 (bench_pair.py agree), then stops the server
# Output lands in $OUT (serve log, the vllm bench JSON files, agreement-runs.json, the table on stdout).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"
OUT="${OUT:-/tmp/out_local}"; mkdir -p "$OUT"
PORT=8001; PIDFILE=/tmp/agreement-serve.pid
MODEL=/tmp/carry/model-qwen3moe; NAME=qwen3moe
case "${1:-}" in
serve)
  eval "$("$PY" tests/gpu/bench_pair.py env "${2:-params/h200-duo-mp.yaml}")"
  export PYTHONPATH="$SITE:$REPO"
  T0=$SECONDS
  setsid "$PY" -m vllm.entrypoints.cli.main serve "$MODEL" -tp "${TP:-1}" \
    --gpu-memory-utilization 0.8 --load-format dummy --max-model-len 8192 --served-model-name "$NAME" \
    --port "$PORT" > /tmp/agreement-serve.log 2>&1 < /dev/null &
  echo $! > "$PIDFILE"
  while [ $((SECONDS - T0)) -lt 500 ]; do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then echo "/health after $((SECONDS - T0)) s"; exit 0; fi
    kill -0 "$(cat "$PIDFILE")" 2>/dev/null || { echo "server exited"; tail -40 /tmp/agreement-serve.log; exit 4; }
    sleep 2
  done
  echo "not ready in 500 s"; tail -40 /tmp/agreement-serve.log; exit 5 ;;
compare)
  PYTHONPATH="$SITE:$REPO" timeout 560 "$PY" tests/gpu/bench_pair.py agree "http://127.0.0.1:$PORT" "$NAME" "$MODEL" \
    "$OUT" "${2:-3}" | tee "$OUT/agreement.md"
  sid=$(cat "$PIDFILE"); pkill -TERM -s "$sid"; sleep 5; pkill -KILL -s "$sid"
  cp /tmp/agreement-serve.log "$OUT/" ;;
*) echo "usage: client_agreement.sh serve [PARAMS] | compare [ROUNDS]"; exit 2 ;;
esac
