#!/usr/bin/env bash
# On the device (kind nvidia-h200 / nvidia-h100-x1, one GPU), the front door (serve.front: router) measured, one step
# per device call, back to back (the machine is released 30 s after a call, /tmp with it):
#   bash tests/gpu/front.sh router   the router's wheels (carried as .carry/router) into the controller's cache
#                                    ~/.cache/sparkbook/vllm-router/0.1.17-py<X.Y>-<machine>/ with its .complete marker
#                                    (the device has no network: router.download() finds them there), a trial
#                                    offline install; then probe-docker.sh (shared/gpu or .carry) -> $OUT/probe-docker.txt
#   then the staging calls (stage.sh 1..K, README.md), the last one followed by (T0 = the call's start, epoch s):
#   T0=$(date +%s) ...; bash tests/gpu/front.sh first
#                                    a whole run behind the front of a SMALL model that fits twice on the card:
#                                    /tmp/carry/model-qwen3moe-small (the carried Qwen3-30B-A3B config cut to
#                                    num_hidden_layers 4, dummy weights, ~6 GB), serve.gpu_memory_utilization 0.35,
#                                    hold_s $HOLD_S, a short benchmark; server left up
#   bash tests/gpu/front.sh second   the small plan with serve.max_num_seqs 64, --from 05 --to 05, confirm_replace,
#                                    under front_load.py (C=8, chat, stream, ignore_eos, 64..128 tokens), health_gap.py
#                                    and port_watch.py: it fits beside, so 05 goes blue-green; then what 05 recorded
#   bash tests/gpu/front.sh third    the big model (/tmp/carry/model-qwen3moe, utilization as params/h200-one.yaml):
#                                    first `--from 02 --to 02` (02's ModelFacts of the big model for 05's fit), then
#                                    --from 05 --to 05, confirm_replace, under the same load: it does not fit beside
#                                    the small server, so 05 stops it drained while the front holds requests
#   bash tests/gpu/front.sh places   after `first` or `firstwatch` (--from 04 takes 01-03's hand-offs of the newest
#                                    run; 06 not needed): the small plan with one var added to runtime.env (every node
#                                    place's recorded env differs, so keep.py refuses them and 04 replaces them),
#                                    `--from 04 --to 05 -p confirm_replace=true` under the same load and pollers: 04
#                                    drains the head's server (server_drained), sets its places aside, starts new ones;
#                                    05 starts the plan there behind the front standing in its own place
#                                    (sparkbook-CLUSTER-front), front_held "new node places behind the front"; the
#                                    front's PID (~/.sparkbook/NODE/logs/front.log.pid) before and after; its log
#                                    tail, place dirs and the load's jsonl in $OUT/places-extra.tar.gz
#   T0=$(date +%s) ...; bash tests/gpu/front.sh firstwatch   as `first` (the small model), but 01..05 only (--to 05)
#   bash tests/gpu/front.sh watch    a `watch` restart behind the front under load: `sparkbook watch` (params
#                                    + watch: interval 3 s, check_timeout 5 s, 2 failures, 1 restart) beside
#                                    front_load.py (C=8), health_gap.py and port_watch.py; after 15 s the engine
#                                    core's PID (its process title, read from /proc, checked against nvidia-smi) is
#                                    killed; the watch's `up` brings it back; 15 s more load; all of it in
#                                    $OUT/watch.tar.gz (watch.out, watch.jsonl, the load, pollers, the `up` run dir).
#                                    The call's end: T0 + CALL_S (default 580) - 15 s
#   bash tests/gpu/front.sh bench [ROUNDS]   `vllm bench serve` through the front and directly on the live server's
#                                    own port (read from the newest run's endpoint), alternating, C=1 and C=16; a
#                                    table of output tok/s and mean TTFT; then all stopped
# Run dirs come back as $OUT/run-h200-one-STEP.tar.gz, the load's records as $OUT/load-STEP.json(l), the backends'
# and GPU processes' changes as $OUT/ports-STEP.txt (at most 8 files come back per call).
set -uo pipefail
HERE="$(dirname "${BASH_SOURCE[0]}")"
source "$HERE/env.sh"
cd "$REPO"
OUT="${OUT:-/tmp/out_local}"; mkdir -p "$OUT"
STEP="${1:?router|first|firstwatch|second|third|places|watch|bench}"
BASE="${BASE:-params/h200-one.yaml}"
HOLD_S="${HOLD_S:-300}"
SMALL=/tmp/carry/model-qwen3moe-small
P=/tmp/front; mkdir -p "$P"
RUNS=/tmp/sparkbook-runs

small_model() {  # the carried config cut to 4 layers (tokenizer files linked): ~6 GB of dummy weights
  rm -rf "$SMALL"; mkdir -p "$SMALL"
  for f in /tmp/carry/model-qwen3moe/*; do [ "$(basename "$f")" = config.json ] || ln -s "$f" "$SMALL/"; done
  "$PY" - /tmp/carry/model-qwen3moe/config.json "$SMALL/config.json" <<'EOF1'
import json, sys
c = json.load(open(sys.argv[1]))
n = 4
c["num_hidden_layers"] = n
if "max_window_layers" in c:
    c["max_window_layers"] = min(c["max_window_layers"], n)
for k in ("mlp_only_layers", "layer_types"):
    if isinstance(c.get(k), list):
        c[k] = [x for x in c[k] if not isinstance(x, int) or x < n] if k == "mlp_only_layers" else c[k][:n]
json.dump(c, open(sys.argv[2], "w"), indent=2)
print("small model:", sys.argv[2], {k: c.get(k) for k in ("num_hidden_layers", "max_window_layers", "mlp_only_layers",
                                                          "num_experts", "hidden_size")})
EOF1
  ls -l "$SMALL"
}

params() {  # first (small, fits twice), second (small, max_num_seqs 64), third (the big model, utilization as BASE)
  "$PY" - "$P" "$BASE" "$HOLD_S" "$SMALL" <<'EOF2'
import copy, sys, yaml
base = yaml.safe_load(open(sys.argv[2]))
base["serve"].update(front="router", hold_s=float(sys.argv[3]))
base["benchmark"].update(num_prompts=32, concurrency=[1, 16], output_len=128)  # 06 in under a minute
first = copy.deepcopy(base)
first["model"]["path"] = sys.argv[4]
first["serve"]["gpu_memory_utilization"] = 0.35  # two of them fit on an 80 GB card
second = copy.deepcopy(first); second["serve"]["max_num_seqs"] = 64
third = copy.deepcopy(base)  # model.path /tmp/carry/model-qwen3moe, gpu_memory_utilization as BASE has it
places = copy.deepcopy(first)  # one env var more on every place: keep.py finds "another environment", 04 replaces them
places["runtime"]["env"]["SPARKBOOK_PLACES_PROBE"] = "1"
for name, data in (("first", first), ("second", second), ("third", third), ("places", places)):
    yaml.safe_dump(data, open(f"{sys.argv[1]}/{name}.yaml", "w"), sort_keys=False)
    print(name, "model", data["model"]["path"], "serve", {k: data["serve"].get(k) for k in (
        "front", "hold_s", "gpu_memory_utilization", "max_num_seqs", "max_model_len")})
EOF2
}

newest() {  # the newest run dir that recorded an endpoint
  for d in $(ls -td $RUNS/*/*/ 2>/dev/null); do
    "$PY" -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get("endpoint") else 1)' "${d}state.json" \
      2>/dev/null && { echo "$d"; return; }
  done
}

report() {  # what the newest run recorded
  "$PY" - "$(ls -td $RUNS/*/2*/ | head -1)" <<'EOF3'
import datetime, json, os, sys
d = sys.argv[1]
print("run dir", d)
ev = [json.loads(line) for line in open(d + "events.jsonl")] if os.path.exists(d + "events.jsonl") else []
keep = ("front_held", "fit_beside", "serve_replaced", "serve_rollback", "serve_args_checked", "router_installed",
        "memory_before_launch", "memory_held_by_server", "serve_attempts", "smoke_test", "server_drained",
        "containers_set_aside", "containers_dropped", "ray_join")
at = {}
for e in ev:
    if e.get("stage", "").startswith("05") or e["kind"] in keep:
        at.setdefault(e["kind"], e.get("at"))
    if e["kind"] in keep or "front" in e["kind"] or "router" in e["kind"]:
        print(e.get("at", ""), e["kind"], json.dumps(e["data"])[:900])
    elif e["kind"] == "decision" and e.get("stage", "")[:2] in ("04", "05"):
        x = e["data"]
        print(e.get("at", ""), "decision", x.get("question"), "->", x.get("choice"), "|", str(x.get("reason"))[:400])
def t(k):
    return datetime.datetime.fromisoformat(at[k]) if at.get(k) else None
if t("serve_args_checked") and t("memory_before_launch"):
    print("stop (args checked -> memory measured after the stop, 1 s resolution):",
          (t("memory_before_launch") - t("serve_args_checked")).total_seconds(), "s")
s = json.load(open(d + "state.json")) if os.path.exists(d + "state.json") else {}
e = s.get("endpoint") or {}
print("endpoint:", json.dumps({k: e.get(k) for k in ("base_url", "ready_s", "attempts", "reused",
      "seconds_without_service", "front_refused", "front_failed", "router", "replicas")}))
print("serve argv:", " ".join(next(iter((e.get("commands") or {}).values()), [])))
m = s.get("model") or {}
if m:
    print("ModelFacts:", {k: m.get(k) for k in ("num_layers", "weight_bytes", "dir_on_nodes")})
m = json.load(open(d + "manifest.json")) if os.path.exists(d + "manifest.json") else {}
print("manifest:", m.get("status"))
for n in m.get("notebooks", []):
    print(f"  {n['name']:24s} {n['status']:8s} {n['duration_s']} s", str((n.get('exception') or {}).get('evalue', ''))[:300])
EOF3
}

urls() {  # FRONT (the endpoint's base_url) and DIRECT (the live server's own port, from its argv), from the newest run
  local d; d=$(newest)
  read -r FRONT DIRECT < <("$PY" - "${d}state.json" <<'EOF5'
import json, sys
e = json.load(open(sys.argv[1]))["endpoint"]
argv = next(iter(e["commands"].values()))
front = e["base_url"].rstrip("/")
print(front, f"{front.rsplit(':', 1)[0]}:{argv[argv.index('--port') + 1]}")
EOF5
)
  echo "front $FRONT direct $DIRECT (from ${d}state.json)"
  for path in list_workers workers; do
    echo "GET $FRONT/$path: $(curl -s -m 3 "$FRONT/$path" | head -c 400)"
  done
}

front_pid() {  # LABEL: the front's PID file (the Python runtime maps PLACE_ROOT/logs to the node's state dir, shared by
  # every place there), whether that process lives (its start time checked as the runbook does), its place dir
  local f
  for f in "$HOME"/.sparkbook/*/logs/front.log.pid /tmp/sparkbook/logs/front.log.pid; do
    [ -f "$f" ] || continue
    read -r fp fs _ < "$f"
    st=$(cut -d')' -f2 "/proc/$fp/stat" 2>/dev/null | cut -d' ' -f21)
    echo "front $1: $f = pid $fp start $fs; /proc: $([ -n "$st" ] && echo "alive, start $st$([ "$st" = "$fs" ] && echo ' (same)' || echo ' (OTHER process)') $(tr '\0' ' ' < /proc/$fp/cmdline | cut -c1-120)" || echo gone)"
  done
  for f in "$HOME"/.sparkbook/*/sparkbook-*-front "$HOME"/.sparkbook/*/sparkbook-*-front.*; do
    [ -e "$f" ] && echo "front $1: place $f: $(ls "$f" | tr '\n' ' ') sids: $(tr '\n' ';' < "$f/sids" 2>/dev/null)"
  done
  return 0
}

replace() {  # replace TAG PARAMS [RUN ARGS]: (--from 05 --to 05) under the load, the pollers and the port watcher
  local tag=$1 params=$2 d
  shift 2; local args=("$@"); [ ${#args[@]} -gt 0 ] || args=(--from 05 --to 05)
  urls
  d=${DIRECT%:*}
  date -u +"load start %FT%T.%3NZ epoch %s"
  "$PY" "$HERE/front_load.py" "$FRONT" qwen3moe "$OUT/load-$tag" --concurrency 8 --hold-s "$HOLD_S" --max-s 540 \
    > "$OUT/load-$tag.txt" 2>&1 & LOAD=$!
  "$PY" "$HERE/health_gap.py" "$FRONT" > "$OUT/gap-$tag.txt" 2>&1 & GAP=$!
  "$PY" "$HERE/port_watch.py" "$d:8001" "$d:8002" > "$OUT/ports-$tag.txt" 2>&1 & PORTS=$!
  sleep 15
  date -u +"run start %FT%T.%3NZ epoch %s"
  KEEP=1 TAG=$tag BUDGET="${BUDGET:-400}" bash "$HERE/run_runbook.sh" "$params" "${args[@]}" \
    -p confirm_replace=true | grep -v "^  \|WARNING" | tail -14
  date -u +"run end %FT%T.%3NZ epoch %s"
  sleep 15
  kill -TERM $LOAD $GAP $PORTS
  for i in $(seq 1 90); do kill -0 $LOAD 2>/dev/null || break; sleep 1; done
  kill -0 $LOAD 2>/dev/null && { echo "load still running after 90 s: killed"; kill -KILL $LOAD; }
  echo "=== load"; grep -v "^ *[0-9.]* s worker" "$OUT/load-$tag.txt" | tail -5
  echo "non-ok requests: $(grep -c " s worker" "$OUT/load-$tag.txt")"; grep " s worker" "$OUT/load-$tag.txt" | head -5
  echo "=== health poller (/v1/models)"; cat "$OUT/gap-$tag.txt"
  echo "=== backends and GPU processes"; cat "$OUT/ports-$tag.txt"
  echo "=== 05 recorded"; report
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
  if [ -f "$PROBE" ]; then echo "=== probe-docker ($PROBE)"; bash "$PROBE" > "$OUT/probe-docker.txt" 2>&1
    cat "$OUT/probe-docker.txt"; else echo "no probe-docker.sh carried: skipped"; fi ;;
first)
  small_model; params
  # what is left of the call's 600 s (T0: the call's start, set in the command before stage.sh), less 40 s
  left=$(( 560 - ($(date +%s) - ${T0:-$(date +%s)}) ))
  BUDGET="${BUDGET:-$(( left < 420 ? left : 420 ))}"; echo "sparkbook run budget $BUDGET s"
  gap=/tmp/front/gap-first.pid
  "$PY" "$HERE/health_gap.py" http://127.0.0.1:8000 >"$OUT/gap-first.txt" 2>&1 & echo $! > $gap
  KEEP=1 TAG=first BUDGET="$BUDGET" bash "$HERE/run_runbook.sh" "$P/first.yaml" -p confirm_cleanup=true \
    | grep -v "^  \|WARNING" | tail -14
  kill -TERM "$(cat $gap)"; sleep 1; echo "health poller: $(tail -1 "$OUT/gap-first.txt")"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
  report ;;
firstwatch)
  small_model; params
  # the run gets at most 300 s and leaves the watch step 165 s of the call (T0 + CALL_S)
  left=$(( ${T0:-$(date +%s)} + ${CALL_S:-580} - 165 - $(date +%s) ))
  BUDGET="${BUDGET:-$(( left < 300 ? left : 300 ))}"; echo "sparkbook run budget $BUDGET s (01..05)"
  KEEP=1 TAG=firstwatch BUDGET="$BUDGET" bash "$HERE/run_runbook.sh" "$P/first.yaml" --to 05 -p confirm_cleanup=true \
    | grep -v "^  \|WARNING" | tail -10
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
  report | grep -v "^  " ;;
watch)
  END=$(( ${T0:-$(date +%s)} + ${CALL_S:-580} - 15 ))
  W=/tmp/front/watch; rm -rf "$W"; mkdir -p "$W"
  # the params the run ran with (run_runbook.sh's copy names this host's address), plus the watch's settings
  src=/tmp/run-first.yaml; [ -f "$src" ] || src="$P/first.yaml"
  "$PY" - "$src" "$W/watch.yaml" <<'EOF6'
import sys, yaml
data = yaml.safe_load(open(sys.argv[1]))
data["watch"] = {"interval_s": 3, "check_timeout_s": 5, "failures_to_restart": 2, "max_restarts": 1,
                 "backoff_s": 5, "backoff_max_s": 5}
yaml.safe_dump(data, open(sys.argv[2], "w"), sort_keys=False)
print("watch params", sys.argv[2], "from", sys.argv[1], data["watch"])
EOF6
  urls
  d=${DIRECT%:*}
  cluster_dir=$RUNS/$("$PY" -c 'import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))["cluster"])' "$W/watch.yaml")
  seen=$(cat "$cluster_dir/watch.jsonl" 2>/dev/null | wc -l)
  date -u +"watch start %FT%T.%3NZ epoch %s"
  "$PY" -m sparkbook.cli watch "$W/watch.yaml" --outputs "$RUNS" --for $(( END - $(date +%s) )) > "$W/watch.out" 2>&1 &
  WATCH=$!
  "$PY" "$HERE/front_load.py" "$FRONT" qwen3moe "$W/load-watch" --concurrency 8 --hold-s "$HOLD_S" --max-s 540 \
    > "$W/load-watch.txt" 2>&1 & LOAD=$!
  "$PY" "$HERE/health_gap.py" "$FRONT" > "$W/gap-watch.txt" 2>&1 & GAP=$!
  "$PY" "$HERE/port_watch.py" "$d:8001" "$d:8002" > "$W/ports-watch.txt" 2>&1 & PORTS=$!
  sleep 15
  # the engine core: the process whose title (vLLM sets it) or command line names EngineCore, read from /proc (never
  # looked up or killed by name); it must be the one GPU process of the server; exactly one PID is killed
  ENGINE=$("$PY" - "$W/engine.txt" <<'EOF7'
import os, subprocess, sys
rows = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        comm = open(f"/proc/{pid}/comm").read().strip()
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
        ppid = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]
    except OSError:
        continue
    rows.append((int(pid), int(ppid), comm, cmd))
try:
    gpu = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=10).stdout
except (OSError, subprocess.SubprocessError) as exc:
    gpu = ""
    print(f"nvidia-smi: {exc}", file=sys.stderr)
gpu_pids = {int(line.split(",")[0]) for line in gpu.splitlines() if line.strip()}
engines = [r for r in rows if "EngineCore" in r[2] + " " + r[3]]
with open(sys.argv[1], "w") as f:
    f.write(f"gpu processes: {gpu.strip()!r}\n")
    for r in rows:
        if "vllm" in r[3].lower() or "EngineCore" in r[2] + r[3] or "router" in r[3] or r[0] in gpu_pids:
            f.write(f"pid {r[0]} ppid {r[1]} comm {r[2]!r} cmd {r[3][:300]!r}{' GPU' if r[0] in gpu_pids else ''}\n")
    pick = [r for r in engines if r[0] in gpu_pids] or engines
    if len(pick) != 1:
        pick = [r for r in rows if r[0] in gpu_pids] if not engines else []
    f.write(f"engine candidates {[(r[0], r[2]) for r in engines]}; picked {[(r[0], r[2]) for r in pick]}\n")
print(pick[0][0] if len(pick) == 1 else "")
EOF7
)
  cat "$W/engine.txt"
  if [ -n "$ENGINE" ]; then
    KILLED=$(date +%s.%N); kill -KILL "$ENGINE"; echo "killed engine core pid $ENGINE at epoch $KILLED" | tee -a "$W/engine.txt"
    while [ "$(date +%s)" -lt $(( END - 35 )) ] && kill -0 $WATCH 2>/dev/null; do
      tail -n +$((seen + 1)) "$cluster_dir/watch.jsonl" 2>/dev/null | grep -q '"kind":"\(back\|gave_up\)"' && break
      sleep 1
    done
    echo "watch recorded back/gave_up (or the wait ended) $(( $(date +%s) - ${KILLED%.*} )) s after the kill"
    sleep 15
  else
    echo "NO ENGINE PID FOUND: nothing killed"
  fi
  kill -TERM $LOAD $GAP $PORTS $WATCH 2>/dev/null
  for i in $(seq 1 20); do kill -0 $LOAD 2>/dev/null || kill -0 $WATCH 2>/dev/null || break; sleep 1; done
  for p in $LOAD $WATCH; do kill -0 $p 2>/dev/null && { echo "pid $p still running after 20 s: killed"; kill -KILL $p; }; done
  echo "=== watch.out"; grep -v "^  " "$W/watch.out" | cut -c1-400 | tail -30
  echo "=== watch record (new lines)"; tail -n +$((seen + 1)) "$cluster_dir/watch.jsonl" | tee "$W/watch.jsonl" | cut -c1-700
  echo "=== load"; grep -v "^ *[0-9.]* s worker" "$W/load-watch.txt" | tail -3
  echo "non-ok requests: $(grep -c " s worker" "$W/load-watch.txt")"; grep " s worker" "$W/load-watch.txt" | head -10
  echo "=== health poller (/v1/models)"; tail -4 "$W/gap-watch.txt"
  echo "=== backends and GPU processes"; cat "$W/ports-watch.txt"
  echo "=== the newest run (the watch's up)"; report | grep -v "^  "
  up=$(ls -td "$cluster_dir"/2*/ | head -1); cp -r "${up%/}" "$W/"
  gzip -f "$W/load-watch.jsonl"
  tar czf "$OUT/watch.tar.gz" -C /tmp/front watch; ls -l "$OUT" ;;
second)
  [ -f "$SMALL/config.json" ] || small_model
  [ -f "$P/second.yaml" ] || params
  replace second "$P/second.yaml" ;;
third)
  [ -f "$P/third.yaml" ] || params
  echo "=== 02 of the big model (ModelFacts for 05's fit), the small server serving"
  KEEP=1 TAG=third02 BUDGET=90 bash "$HERE/run_runbook.sh" "$P/third.yaml" --from 02 --to 02 \
    | grep -v "WARNING" | tail -8; rm -f "$OUT"/run-*-third02.tar.gz
  "$PY" -c 'import json,sys; m=json.load(open(sys.argv[1])).get("model") or {}; print("02 ModelFacts:", {k: m.get(k) for k in ("num_layers", "weight_bytes", "dir_on_nodes")})' \
    "$(ls -td $RUNS/*/*/ | head -1)state.json"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
  replace third "$P/third.yaml" ;;
places)
  [ -f "$SMALL/config.json" ] || small_model
  [ -f "$P/places.yaml" ] || params
  X=/tmp/front/places; rm -rf "$X"; mkdir -p "$X"
  exec > >(tee -a "$X/step-console.txt") 2>&1
  echo "state dirs: $(ls -d "$HOME"/.sparkbook/*/* 2>/dev/null | tr '\n' ' ')"
  front_pid before | tee "$X/front-pid.txt"
  replace places "$P/places.yaml" --from 04 --to 05
  front_pid after | tee -a "$X/front-pid.txt"
  echo "=== places: what 04 and 05 recorded"
  "$PY" - "$(ls -td $RUNS/*/2*/ | head -1)" <<'EOF8' | tee "$X/places-summary.txt"
import json, os, sys
d = sys.argv[1]
ev = [json.loads(line) for line in open(d + "events.jsonl")] if os.path.exists(d + "events.jsonl") else []
for e in ev:
    if e["kind"] in ("server_drained", "containers_set_aside", "containers_dropped", "front_held", "serve_replaced",
                     "router_installed") or (e["kind"] == "decision" and e.get("stage", "")[:2] == "04"):
        print(e.get("at", ""), e.get("stage", ""), e["kind"], json.dumps(e["data"])[:1200])
s = json.load(open(d + "state.json")) if os.path.exists(d + "state.json") else {}
e = s.get("endpoint") or {}
print("endpoint:", json.dumps({k: e.get(k) for k in ("base_url", "ready_s", "seconds_without_service",
                                                     "front_refused", "front_failed")}))
m = json.load(open(d + "manifest.json")) if os.path.exists(d + "manifest.json") else {}
for n in m.get("notebooks", []):
    print(f"notebook {n['name']:24s} {n['status']:8s} {n['duration_s']} s",
          str((n.get('exception') or {}).get('evalue', ''))[:400])
EOF8
  [ -f "$OUT/load-places.json" ] && "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print("load:", json.dumps(d)[:800])' "$OUT/load-places.json"
  for f in "$HOME"/.sparkbook/*/logs/front.log; do [ -f "$f" ] && tail -c 60000 "$f" > "$X/front-log-tail.txt"; done
  ls -la "$HOME"/.sparkbook/*/ "$HOME"/.sparkbook/*/logs/ > "$X/state-dirs.txt" 2>&1
  cat "$HOME"/.sparkbook/*/sparkbook-*/place.json "$HOME"/.sparkbook/*/sparkbook-*/*.json > "$X/place-records.txt" 2>&1
  [ -f "$OUT/load-places.jsonl" ] && gzip -c "$OUT/load-places.jsonl" > "$X/load-places.jsonl.gz" && rm -f "$OUT/load-places.jsonl"
  tar czf "$OUT/places-extra.tar.gz" -C /tmp/front places; ls -l "$OUT" ;;
bench)
  urls
  eval "$("$PY" "$HERE/bench_pair.py" env "$P/third.yaml")"; export PYTHONPATH="$SITE:$REPO"
  B=/tmp/front/bench; rm -rf "$B"; mkdir -p "$B"
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
          --result-dir "$B" --result-filename "$label-r$r-c$c.json" > "$B/$label-r$r-c$c.log" 2>&1 \
          || { echo "bench $label r$r c$c failed"; tail -5 "$B/$label-r$r-c$c.log"; }
        "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], "tok/s %.1f" % d["output_throughput"], "mean TTFT %.1f ms" % d["mean_ttft_ms"], "median TTFT %.1f" % d["median_ttft_ms"], "mean TPOT %.2f" % d["mean_tpot_ms"], "failed", d.get("failed"))' \
          "$B/$label-r$r-c$c.json" "$label r$r c$c" 2>/dev/null
      done
    done
  done
  "$PY" - "$B" <<'EOF4' | tee "$OUT/bench-table.md"
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
  tar czf "$OUT/bench.tar.gz" -C /tmp/front bench
  # the Python runtime's places lie in the node's state dir (~/.sparkbook/NODE/...; before: /tmp/sparkbook/PLACE):
  # its `sids` lines are "SID START"; by session ID only, never by name
  sids=$(gpu_sessions)
  for s in $sids; do pkill -TERM -s "$s"; done; sleep 5; for s in $sids; do pkill -KILL -s "$s"; done
  echo "stopped sessions: ${sids:-none}" ;;
esac
