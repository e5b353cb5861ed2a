#!/usr/bin/env bash
# On the device (kind nvidia-h200), right after `KEEP=1 bash tests/gpu/run_runbook.sh params/h200-one.yaml
# -p confirm_cleanup=true` left the runbook's server up (issue 33 item 5):
#   bash tests/gpu/startup_pair.sh [RUNS_DIR]
# Reads the run's 05 hand-off (state.json "endpoint": the head's exact argv and env, its time to ready), stops the
# run's sessions (by session ID), then starts a bare `vllm serve` with the same argv and env on port+1, with its own
# empty compile caches (as the runbook's start had on a fresh machine), and times /health and /v1/models the way
# 05 does. Prints both and the ratio; the target is within 5 %. Everything lands in $OUT/startup.txt.
# Start-up times differ between machines of one kind (gpu-facts.md): compare only within one call.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"
RUNS="${1:-/tmp/sparkbook-runs}"
OUT="${OUT:-/tmp/out_local}"; mkdir -p "$OUT"
exec > >(tee -a "$OUT/startup.txt") 2>&1
state=$(ls -td "$RUNS"/*/*/state.json 2>/dev/null | head -1)
[ -n "$state" ] || { echo "no run state under $RUNS: run run_runbook.sh first"; exit 3; }
echo "=== the runbook's 05 ($state)"
"$PY" - "$state" > /tmp/startup-plain.sh <<'EOF2'
import json, shlex, sys
e = json.load(open(sys.argv[1]))["endpoint"]
node = next(iter(e["commands"]))
argv, env = list(e["commands"][node]), e["env"][node]
port = argv.index("--port") + 1
argv[port] = str(int(argv[port]) + 1)
print(f"# runbook: executor {e['executor']}, ready in {e['ready_s']} s after {e['attempts']} attempt(s)",
      file=sys.stderr)
print(f"RUNBOOK_READY={e['ready_s']}; MODEL={shlex.quote(e['model'])}; PORT={argv[port]}")
print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) if env else ":")
print("ARGV=(" + " ".join(shlex.quote(a) for a in argv) + ")")
EOF2
source /tmp/startup-plain.sh
echo "=== stop the runbook's sessions"
sids=$(gpu_sessions)
for s in $sids; do pkill -TERM -s "$s"; done; sleep 8; for s in $sids; do pkill -KILL -s "$s"; done
sleep 3; nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
# CACHES=DIR: start with the compile caches the runbook's 05 wrote (runtime.cache_dir): the second-start figure
caches="${CACHES:-$(mktemp -d /tmp/plain-caches.XXXX)}"
echo "=== compile caches: ${CACHES:+from the runbook run, }$caches ($(du -sh "$caches" 2>/dev/null | cut -f1))"
export VLLM_CACHE_ROOT="$caches/vllm" TRITON_CACHE_DIR="$caches/triton" TORCHINDUCTOR_CACHE_DIR="$caches/inductor" \
  FLASHINFER_WORKSPACE_BASE="$caches/flashinfer"
eval "$("$PY" tests/gpu/bench_pair.py env /tmp/run-h200-one.yaml 2>/dev/null || "$PY" tests/gpu/bench_pair.py env params/h200-one.yaml)"
export PYTHONPATH="$SITE:$REPO"
ARGV[0]="$PY"; ARGV=("${ARGV[0]}" -m vllm.entrypoints.cli.main "${ARGV[@]:1}")   # `vllm` as the carried module
echo "=== bare: ${ARGV[*]}"
T0=$SECONDS; ready=""
setsid "${ARGV[@]}" > "$OUT/plain-startup.log" 2>&1 < /dev/null &
PID=$!
while [ $((SECONDS - T0)) -lt "${PLAIN_READY_S:-480}" ]; do
  if curl -sf "http://127.0.0.1:$PORT/v1/models" | grep -q "\"$MODEL\""; then ready=$((SECONDS - T0)); break; fi
  kill -0 $PID 2>/dev/null || { echo "bare server exited"; tail -40 "$OUT/plain-startup.log"; exit 4; }
  sleep 1
done
pkill -TERM -s $PID; sleep 5; pkill -KILL -s $PID; [ -n "${CACHES:-}" ] || rm -rf "$caches"
[ -n "$ready" ] || { echo "bare server not ready in time"; tail -40 "$OUT/plain-startup.log"; exit 5; }
if [ -n "${CACHES:-}" ]; then
  "$PY" -c "import sys; r, b = float(sys.argv[1]), float(sys.argv[2]); print(f'first start (runbook 05, empty caches) {r:.1f} s, second start with the caches it wrote {b:.1f} s: {b / r:.2f} x')" "$RUNBOOK_READY" "$ready"
else
  "$PY" -c "import sys; r, b = float(sys.argv[1]), float(sys.argv[2]); print(f'runbook 05 ready in {r:.1f} s, bare vllm serve in {b:.1f} s: {100 * (r - b) / b:+.1f} % (target within 5 %)')" "$RUNBOOK_READY" "$ready"
fi
