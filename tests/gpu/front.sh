#!/usr/bin/env bash
# On the device (kind nvidia-h200 / nvidia-h100-x1, one GPU), the front door (serve.front: router) measured, one step
# per device call, back to back (the machine is released 30 s after a call, /tmp with it):
#   bash tests/gpu/front.sh router   the router's wheels (carried as .carry/router) into the controller's cache
#                                    ~/.cache/sparkbook/vllm-router/0.1.17-py<X.Y>-<machine>/ with its .complete marker
#                                    (the device has no network: router.download() finds them there), a trial
#                                    offline install; then probe-docker.sh (shared/gpu or .carry) -> $OUT/probe-docker.txt
#   then the staging calls (stage.sh 1..K, README.md), the last one followed by:
#   bash tests/gpu/front.sh first    a whole run of params/h200-one.yaml with serve.front: router (hold_s $HOLD_S, a
#                                    short benchmark), server left up
#   bash tests/gpu/front.sh second   --from 05 --to 05 with serve.max_num_seqs changed, confirm_replace, while
#                                    front_load.py (C=8, chat, stream, ignore_eos, 64..128 tokens) and health_gap.py
#                                    run through the front; then what 05 recorded
#   bash tests/gpu/front.sh bench [ROUNDS]   `vllm bench serve` through the front and directly on replica_port,
#                                    alternating, C=1 and C=16; a table of output tok/s and mean TTFT; then all stopped
# Run dirs come back as $OUT/run-h200-one-STEP.tar.gz, the load's records as $OUT/load-second.json(l).
set -uo pipefail
HERE="$(dirname "${BASH_SOURCE[0]}")"
source "$HERE/env.sh"
cd "$REPO"
OUT="${OUT:-/tmp/out_local}"; mkdir -p "$OUT"
STEP="${1:?router|first|second|bench}"
BASE="${BASE:-params/h200-one.yaml}"
HOLD_S="${HOLD_S:-300}"
P=/tmp/front; mkdir -p "$P"
RUNS=/tmp/sparkbook-runs

params() {
  "$PY" - "$P" "$BASE" "$HOLD_S" <<'EOF2'
import copy, sys, yaml
base = yaml.safe_load(open(sys.argv[2]))
base["serve"].update(front="router", hold_s=float(sys.argv[3]))
base["benchmark"].update(num_prompts=32, concurrency=[1, 16], output_len=128)  # 06 in under a minute
second = copy.deepcopy(base); second["serve"]["max_num_seqs"] = 64
for name, data in (("first", base), ("second", second)):
    yaml.safe_dump(data, open(f"{sys.argv[1]}/{name}.yaml", "w"), sort_keys=False)
EOF2
}

report() {  # what the newest run recorded
  "$PY" - "$(ls -td $RUNS/*/*/ | head -1)" <<'EOF3'
import json, os, sys
d = sys.argv[1]
ev = [json.loads(line) for line in open(d + "events.jsonl")] if os.path.exists(d + "events.jsonl") else []
for e in ev:
    if e["kind"] in ("front_held", "serve_replaced", "serve_rollback", "serve_args_checked", "router_installed",
                     "memory_fit", "memory_held_by_server") or "front" in e["kind"] or "router" in e["kind"]:
        print(e.get("ts", e.get("time", "")), e["kind"], json.dumps(e["data"])[:700])
s = json.load(open(d + "state.json")) if os.path.exists(d + "state.json") else {}
e = s.get("endpoint") or {}
print("endpoint:", json.dumps({k: e.get(k) for k in ("base_url", "ready_s", "attempts", "reused",
      "seconds_without_service", "front_refused", "front_failed", "router", "replicas")}))
print("serve argv:", " ".join(next(iter((e.get("commands") or {}).values()), [])))
m = json.load(open(d + "manifest.json")) if os.path.exists(d + "manifest.json") else {}
for n in m.get("notebooks", []):
    print(f"  {n['name']:24s} {n['status']:8s} {n['duration_s']} s")
EOF3
}

urls() {  # FRONT and DIRECT from the newest run's endpoint (the head's fabric address; replica_port 8001)
  FRONT=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["endpoint"]["base_url"])' \
    "$(ls -td $RUNS/*/*/ | head -1)state.json")
  DIRECT="${FRONT%:*}:8001"
  echo "front $FRONT direct $DIRECT"
}

case "$STEP" in
router)
  read -r PV MACH < <("$PY" -c 'import platform, sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}", platform.machine())')
  D="$HOME/.cache/sparkbook/vllm-router/0.1.17-py$PV-$MACH"
  rm -rf "$D"; mkdir -p "$D"; cp "$REPO"/.carry/router/*.whl "$D/" && touch "$D/.complete"
  echo "router wheels: $(ls "$D"/*.whl | wc -l) in $D; sha256 $(sha256sum "$D"/vllm_router-*.whl | cut -c1-16)"
  rm -rf /tmp/router-trial && "$PY" -m pip install -q --no-index --find-links "$D" --target /tmp/router-trial \
    vllm-router==0.1.17 && PYTHONPATH=/tmp/router-trial "$PY" -m vllm_router.launch_router --help 2>&1 \
    | grep -E -- "--retry-max-retries|--worker-startup-timeout|--disable-circuit" | head -3
  echo "trial install rc=$?"; rm -rf /tmp/router-trial
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  PROBE=shared/gpu/probe-docker.sh; [ -f "$PROBE" ] || PROBE=.carry/probe-docker.sh
  echo "=== probe-docker ($PROBE)"; bash "$PROBE" > "$OUT/probe-docker.txt" 2>&1; cat "$OUT/probe-docker.txt" ;;
first)
  params
  gap=/tmp/front/gap-first.pid
  "$PY" "$HERE/health_gap.py" http://127.0.0.1:8000 >"$OUT/gap-first.txt" 2>&1 & echo $! > $gap
  KEEP=1 TAG=first BUDGET="${BUDGET:-420}" bash "$HERE/run_runbook.sh" "$P/first.yaml" -p confirm_cleanup=true \
    | grep -v "^  \|WARNING" | tail -14
  kill -TERM "$(cat $gap)"; sleep 1; echo "health poller: $(tail -1 "$OUT/gap-first.txt")"
  report ;;
second)
  [ -f "$P/second.yaml" ] || params
  urls
  date -u +"load start %FT%T.%3NZ epoch %s"
  "$PY" "$HERE/front_load.py" "$FRONT" qwen3moe "$OUT/load-second" --concurrency 8 --hold-s "$HOLD_S" --max-s 540 \
    > "$OUT/load-second.txt" 2>&1 & LOAD=$!
  "$PY" "$HERE/health_gap.py" "$FRONT" > "$OUT/gap-second.txt" 2>&1 & GAP=$!
  sleep 15
  date -u +"run start %FT%T.%3NZ epoch %s"
  KEEP=1 TAG=second BUDGET="${BUDGET:-420}" bash "$HERE/run_runbook.sh" "$P/second.yaml" --from 05 --to 05 \
    -p confirm_replace=true | grep -v "^  \|WARNING" | tail -14
  date -u +"run end %FT%T.%3NZ epoch %s"
  sleep 15
  kill -TERM $LOAD $GAP
  for i in $(seq 1 90); do kill -0 $LOAD 2>/dev/null || break; sleep 1; done
  kill -0 $LOAD 2>/dev/null && { echo "load still running after 90 s: killed"; kill -KILL $LOAD; }
  echo "=== load"; grep -v "^ *[0-9.]* s worker" "$OUT/load-second.txt" | tail -5
  echo "non-ok requests: $(grep -c " s worker" "$OUT/load-second.txt")"; grep " s worker" "$OUT/load-second.txt" | head -5
  echo "=== health poller (/v1/models)"; cat "$OUT/gap-second.txt"
  echo "=== 05 recorded"; report ;;
bench)
  urls
  eval "$("$PY" "$HERE/bench_pair.py" env "$P/second.yaml")"; export PYTHONPATH="$SITE:$REPO"
  mkdir -p "$OUT/bench"
  for r in $(seq 1 "${2:-2}"); do
    if [ $((r % 2)) = 1 ]; then order="front direct"; else order="direct front"; fi
    for label in $order; do
      [ "$label" = front ] && url=$FRONT || url=$DIRECT
      for c in 1 16; do
        n=$([ "$c" = 1 ] && echo 16 || echo 64)
        timeout 150 "$PY" -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url "$url" \
          --model qwen3moe --tokenizer /tmp/carry/model-qwen3moe --dataset-name random --random-input-len 64 \
          --random-output-len 128 --ignore-eos --max-concurrency $c --num-prompts $n --num-warmups 2 \
          --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result \
          --result-dir "$OUT/bench" --result-filename "$label-r$r-c$c.json" > "$OUT/bench/$label-r$r-c$c.log" 2>&1 \
          || { echo "bench $label r$r c$c failed"; tail -5 "$OUT/bench/$label-r$r-c$c.log"; }
        "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], "tok/s %.1f" % d["output_throughput"], "mean TTFT %.1f ms" % d["mean_ttft_ms"], "median TTFT %.1f" % d["median_ttft_ms"], "mean TPOT %.2f" % d["mean_tpot_ms"], "failed", d.get("failed"))' \
          "$OUT/bench/$label-r$r-c$c.json" "$label r$r c$c" 2>/dev/null
      done
    done
  done
  "$PY" - "$OUT/bench" <<'EOF4' | tee "$OUT/bench/table.md"
import glob, json, os, statistics, sys
rows = {}
for f in glob.glob(sys.argv[1] + "/*-r*-c*.json"):
    label, r, c = os.path.basename(f)[:-5].split("-")
    d = json.load(open(f)); rows.setdefault((int(c[1:]), label), []).append((d["output_throughput"], d["mean_ttft_ms"]))
print("| C | path | output tok/s (runs) | mean TTFT ms (runs) | median of runs tok/s | median of runs TTFT ms |")
print("|---|---|---|---|---|---|")
for (c, label), v in sorted(rows.items()):
    print(f"| {c} | {label} | {', '.join(f'{x[0]:.1f}' for x in v)} | {', '.join(f'{x[1]:.1f}' for x in v)} | "
          f"{statistics.median(x[0] for x in v):.1f} | {statistics.median(x[1] for x in v):.1f} |")
EOF4
  sids=$(cat /tmp/sparkbook/*/sids 2>/dev/null | sort -u)
  for s in $sids; do pkill -TERM -s "$s"; done; sleep 5; for s in $sids; do pkill -KILL -s "$s"; done
  echo "stopped sessions: ${sids:-none}" ;;
esac
