#!/usr/bin/env bash
# On the device (kind nvidia-h200), after stage.sh installed everything: issue 40's second deploy on one H200,
# one step per device call (each under the call's 600 s), back to back:
#   bash tests/gpu/redeploy.sh first      a whole run of $BASE (params/h200-one.yaml unless BASE names another;
#                                         a shorter benchmark), server left up
#   bash tests/gpu/redeploy.sh second     a whole second run, serve.max_num_seqs changed, confirm_replace
#   bash tests/gpu/redeploy.sh from05     a new run --from 05 (the second's plan: kept) and one with a planted
#                                         argument vLLM refuses (05 ends before the stop: 0 s without service)
#   bash tests/gpu/redeploy.sh rollback   --from 05 with a max_model_len the model refuses only at engine start
#                                         (after the stop): rolled back; then `sparkbook status`; then all stopped
# Every step polls /v1/models each 0.5 s (health_gap.py) while it runs and prints the longest time without an
# answer beside what the runbook recorded; run dirs come back as $OUT/run-h200-one-STEP.tar.gz.
set -uo pipefail
HERE="$(dirname "${BASH_SOURCE[0]}")"
source "$HERE/env.sh"
cd "$REPO"
OUT="${OUT:-/tmp/out_local}"; mkdir -p "$OUT"
STEP="${1:?first|second|from05|rollback}"
BASE="${BASE:-params/h200-one.yaml}"   # params/h200-one-mp.yaml: the same sequence with vLLM's own launch, no Ray
P=/tmp/redeploy; mkdir -p "$P"
CLUSTER=$("$PY" -c 'import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))["cluster"])' "$BASE")
"$PY" - "$P" "$BASE" <<'EOF2'
import copy, sys, yaml
base = yaml.safe_load(open(sys.argv[2]))
base["benchmark"].update(num_prompts=32, concurrency=[1, 16], output_len=128)  # 06 in under a minute
second = copy.deepcopy(base); second["serve"]["max_num_seqs"] = 64
planted = copy.deepcopy(second); planted["serve"]["extra_args"] = [*second["serve"]["extra_args"], "--planted-flag"]
too_long = copy.deepcopy(second); too_long["serve"]["max_model_len"] = 1_000_000  # Qwen3-30B-A3B: 40960 at most
for name, data in (("first", base), ("second", second), ("planted", planted), ("too-long", too_long)):
    yaml.safe_dump(data, open(f"{sys.argv[1]}/{name}.yaml", "w"), sort_keys=False)
EOF2
gap() {  # gap START|STOP NAME: the /v1/models poller
  if [ "$1" = start ]; then "$PY" "$HERE/health_gap.py" http://127.0.0.1:8000 >"$OUT/gap-$2.txt" 2>&1 & echo $! >/tmp/gap.pid
  else kill -TERM "$(cat /tmp/gap.pid)"; sleep 1; echo "health poller ($2): $(tail -1 "$OUT/gap-$2.txt")"; fi
}
run() {  # run TAG PARAMS [args]: the runbook, server kept up
  local tag=$1 params=$2; shift 2
  gap start "$tag"
  KEEP=1 TAG="$tag" BUDGET="${BUDGET:-500}" bash "$HERE/run_runbook.sh" "$params" "$@" | grep -v "^  \|WARNING" | tail -12
  gap stop "$tag"
  echo "ray processes on the host: $(grep -laE '[r]aylet|[g]cs_server|[r]ay::' /proc/[0-9]*/cmdline 2>/dev/null | wc -l)"
  "$PY" - "$CLUSTER" <<'EOF3'
import glob, json, os, sys
d = max(glob.glob(f"/tmp/sparkbook-runs/{sys.argv[1]}/*/"), key=os.path.getmtime)
ev = [json.loads(line) for line in open(d + "events.jsonl")] if os.path.exists(d + "events.jsonl") else []
for e in ev:
    if e["kind"] in ("serve_replaced", "serve_rollback", "serve_args_checked", "memory_held_by_server", "memory_fit"):
        print(e["kind"], json.dumps(e["data"])[:600])
for e in ev:  # the decisions that tell the path: Ray formed or not (04), the executor 05 chose
    if e["kind"] == "decision" and e["data"].get("key") in ("ray", "executor"):
        print("decision", e["data"]["key"], "->", e["data"].get("choice"), "|", str(e["data"].get("reason"))[:200])
s = json.load(open(d + "state.json")) if os.path.exists(d + "state.json") else {}
e = s.get("endpoint") or {}
print("endpoint: ready_s", e.get("ready_s"), "seconds_without_service", e.get("seconds_without_service"),
      "reused", e.get("reused"))
EOF3
}
case "$STEP" in
  first) run first "$P/first.yaml" -p confirm_cleanup=true ;;
  second) run second "$P/second.yaml" -p confirm_cleanup=true -p confirm_replace=true ;;
  from05) BUDGET=300 run from05 "$P/second.yaml" --from 05
          BUDGET=200 run planted "$P/planted.yaml" --from 05 -p confirm_replace=true ;;
  rollback) BUDGET=480 run rollback "$P/too-long.yaml" --from 05 -p confirm_replace=true
            echo "=== sparkbook status"; timeout 120 "$PY" -m sparkbook.cli status /tmp/run-too-long.yaml \
              --outputs /tmp/sparkbook-runs 2>&1 | tail -25
            sids=$(gpu_sessions)
            for s in $sids; do pkill -TERM -s "$s"; done; sleep 5; for s in $sids; do pkill -KILL -s "$s"; done ;;
esac
