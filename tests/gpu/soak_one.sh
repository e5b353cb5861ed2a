#!/usr/bin/env bash
# On the device (kind nvidia-h200), right after `KEEP_SERVING=1 bash tests/gpu/mp_one.sh` left
# params/h200-one-mp.yaml's server up: issue 41's check in one call, a new run of 06 alone (`--from 06`, which starts
# from the deployment's hand-offs): a one-point sweep, then the params' 5-minute soak at c=16 near the window
# and 05's answer checks asked again. Prints the soak's verdict, its windows (throughput over time, the worst against
# the median), the last node and server samples and the answers after it; the run dir comes back as a tarball.
#   bash tests/gpu/soak_one.sh [BUDGET seconds for the run, default 560]
set -uo pipefail
HERE="$(dirname "${BASH_SOURCE[0]}")"
source "$HERE/env.sh"
cd "$REPO"
# The params' own sweep (4 points of 64 prompts, the depth axis) took 441 s of a 540 s call on an H100 (its c=1
# point 239 s) and left the soak 70 s: here 06 sweeps one point (c=16) and skips the depths, the same cluster.
"$PY" - <<'EOF2'
import yaml
data = yaml.safe_load(open("params/h200-one-mp.yaml"))
data["benchmark"].update({"concurrency": [16], "num_prompts": 32, "depths": []})
yaml.safe_dump(data, open("/tmp/h200-one-mp-soak.yaml", "w"), sort_keys=False)
EOF2
BUDGET="${1:-560}" TAG=soak bash "$HERE/run_runbook.sh" /tmp/h200-one-mp-soak.yaml --from 06 \
  | grep -v "^  \|WARNING" | tail -8
"$PY" - <<'EOF2'
import glob, json, os
d = max(glob.glob("/tmp/sparkbook-runs/h200-one-mp/*/"), key=os.path.getmtime)
soak = json.load(open(d + "state.json")).get("soak")
print("run", d, "\nsoak report:", json.dumps(soak, indent=1) if soak else "none (06 stopped before the soak)")
path = d + "bench/soak.json"
if os.path.exists(path):
    s = json.load(open(path))
    for k in ("windows",):
        for w in s.get(k, []):
            print("window", w)
    print("last server sample", (s.get("server") or [None])[-1])
    print("last node sample", (s.get("nodes") or [None])[-1])
EOF2
