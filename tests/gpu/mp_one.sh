#!/usr/bin/env bash
# On the device (kind nvidia-h200), after stage.sh installed everything: issue 45's check on one H200 at TP=1 in one
# call, for a short lease: params/h200-one-mp.yaml (serve.executor mp) through 05, then `sparkbook status`, the Ray
# processes on the host (none expected: 04 forms no Ray on this path) and 04's and 05's decisions.
#   [KEEP_SERVING=1] bash tests/gpu/mp_one.sh [BUDGET seconds for the run, default 330]
# KEEP_SERVING=1 leaves the server up for tests/gpu/soak_one.sh (issue 41's soak) in the next call.
set -uo pipefail
HERE="$(dirname "${BASH_SOURCE[0]}")"
source "$HERE/env.sh"
cd "$REPO"
KEEP=1 BUDGET="${1:-330}" bash "$HERE/run_runbook.sh" params/h200-one-mp.yaml -p confirm_cleanup=true --to 05 \
  | grep -v "^  \|WARNING" | tail -14
echo "ray processes on the host: $(grep -laE '[r]aylet|[g]cs_server|[r]ay::' /proc/[0-9]*/cmdline 2>/dev/null | wc -l)"
echo "=== sparkbook status"
timeout 90 "$PY" -m sparkbook.cli status /tmp/run-h200-one-mp.yaml --outputs /tmp/sparkbook-runs 2>&1 | tail -12
"$PY" - <<'EOF2'
import glob, json, os
d = max(glob.glob("/tmp/sparkbook-runs/h200-one-mp/*/"), key=os.path.getmtime)
for line in open(d + "events.jsonl"):
    e = json.loads(line)
    if e["kind"] == "decision" and e["data"].get("key") in ("ray", "executor", "fabric_test"):
        print("decision", e["data"]["key"], "->", e["data"].get("choice"), "|", str(e["data"].get("reason"))[:240])
s = json.load(open(d + "state.json")).get("endpoint") or {}
print("endpoint: ready_s", s.get("ready_s"), "argv", " ".join(s.get("commands", {}).get("h200", []))[:400])
EOF2
[ "${KEEP_SERVING:-0}" = 1 ] && { echo "left serving (KEEP_SERVING=1): tests/gpu/soak_one.sh next"; exit 0; }
sids=$(gpu_sessions)
for s in $sids; do pkill -TERM -s "$s"; done; sleep 3; for s in $sids; do pkill -KILL -s "$s"; done
