#!/usr/bin/env bash
# On the device, after stage.sh installed everything:
#   bash tests/gpu/run_runbook.sh [PARAMS] [extra `sparkbook run` args, e.g. -p confirm_cleanup=true]
# Runs the whole runbook headless (`python3 -m sparkbook.cli run`), then packs the run dir
# (notebooks, manifest, index, state, logs) into $OUT/run-CLUSTER.tar.gz and stops what the run left
# running (the sessions PythonNodes.spawn recorded), unless KEEP=1.
# The env of the served processes comes from the params (runtime.env, ray.env, serve.env); this script
# sets only what papermill and the kernel need (env.sh), plus the multicast-off variables everywhere.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"
PARAMS="${1:-params/h200-duo.yaml}"; shift || true
OUT="${OUT:-/tmp/out_local}"; mkdir -p "$OUT"
BUDGET="${BUDGET:-540}"            # seconds for `sparkbook run`; the call's limit is 600
RUNS=/tmp/sparkbook-runs
exec > >(tee -a "$OUT/console.txt") 2>&1
[ -f "$SITE/.staged" ] || { echo "nothing installed in $SITE: run stage.sh for every part first"; exit 3; }
write_kernelspec

# the params name an interpreter; if it is not the one that holds torch here, run with a copy that does
copy="/tmp/run-$(basename "$PARAMS")"; cp "$PARAMS" "$copy"
want=$("$PY" -c 'import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))["runtime"]["python"])' "$PARAMS")
if ! "$want" -c 'import torch' 2>/dev/null; then
  echo "WARNING: runtime.python $want cannot import torch here; using a copy of $PARAMS with $PY"
  sed -i "s#^\(  python: \).*#\1$PY#" "$copy"
fi
# Ray never reports a loopback node IP (it resolves 127.0.0.1 to the host's address) and vLLM's placement group
# asks for node:<VLLM_HOST_IP>: a single box must name its own address. Params that say 127.0.0.1 get this host's
# (the default route's device and its IPv4 address, read without `ip`).
if grep -q "fabric_ip: 127.0.0.1" "$copy"; then
  DEV=$(awk 'NR>1 && $2=="00000000" {print $1; exit}' /proc/net/route)
  IP=$("$PY" - "$DEV" <<'EOF2'
import fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
print(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", sys.argv[1].encode()[:15]))[20:24]))
EOF2
)
  echo "WARNING: $PARAMS names 127.0.0.1; running with this host's address $IP on $DEV"
  sed -i "s/fabric_ip: 127.0.0.1/fabric_ip: $IP/; s/fabric_netdev: lo\b/fabric_netdev: $DEV/" "$copy"
fi
cmp -s "$PARAMS" "$copy" && PARAMS_RUN="$PARAMS" || { PARAMS_RUN="$copy"; diff "$PARAMS" "$copy"; }
PARAMS="$PARAMS_RUN"
"$PY" -m sparkbook.cli check "$PARAMS" || exit 2
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
cluster=$("$PY" -c 'import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))["cluster"])' "$PARAMS")

echo "=== sparkbook run $PARAMS (up to ${BUDGET} s) $(date -u +%FT%TZ)"
T0=$SECONDS
timeout -k 10 "$BUDGET" "$PY" -m sparkbook.cli run "$PARAMS" --outputs "$RUNS" "$@"; rc=$?
echo "=== sparkbook run rc=$rc after $((SECONDS - T0)) s"

run_dir=$(ls -td "$RUNS/$cluster"/*/ 2>/dev/null | head -1)
if [ -n "$run_dir" ]; then
  run_dir=${run_dir%/}; tgz="$OUT/run-$cluster${TAG:+-$TAG}.tar.gz"
  tar czf "$tgz" -C "$(dirname "$run_dir")" "$(basename "$run_dir")"
  if [ "$(stat -c %s "$tgz")" -gt $((15 * 1024 * 1024)) ]; then   # 16 MiB per file comes back
    echo "run tarball too big; logs cut to their last 2 MB"
    t=$(mktemp -d); cp -r "$run_dir" "$t/"
    find "$t" -type f -size +2M -name '*.log' -exec sh -c 'tail -c 2000000 "$1" > "$1.t" && mv "$1.t" "$1"' _ {} \;
    tar czf "$tgz" -C "$t" "$(basename "$run_dir")"; rm -rf "$t"
  fi
  echo "run dir $run_dir -> $tgz ($(du -h "$tgz" | cut -f1))"
  "$PY" - "$run_dir/manifest.json" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
print("manifest:", m["status"])
for n in m["notebooks"]:
    e = n["exception"] or {}
    print(f"  {n['name']:24s} {n['status']:8s} {n['duration_s']} s", e.get("ename", ""), str(e.get("evalue", ""))[:300])
EOF
else
  echo "no run dir under $RUNS/$cluster"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

# stop what the run spawned, by the session ids it recorded (never by name)
if [ "${KEEP:-0}" != 1 ]; then
  sids=$(gpu_sessions)
  for s in $sids; do pkill -TERM -s "$s"; done
  [ -n "$sids" ] && sleep 5
  for s in $sids; do pkill -KILL -s "$s"; done
  echo "stopped sessions: ${sids:-none}; GPU memory now: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' ')"
fi
exit $rc
