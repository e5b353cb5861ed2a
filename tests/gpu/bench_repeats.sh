#!/usr/bin/env bash
# On the device (kind nvidia-h200), after stage.sh installed everything (issue 18 item 5):
#   bash tests/gpu/bench_repeats.sh serve            `vllm serve` on one GPU (client_agreement.sh serve) with a fresh
#                                                    TRITON_CACHE_DIR, so every Triton kernel it compiles is listed
#   bash tests/gpu/bench_repeats.sh measure [ROUNDS]  bench_repeats.py drive (old sweep of c2073fa from
#                                                    .carry/old-sparkbook against this tree's), then the Triton cache
#                                                    entries with their mtimes, the serve log; stops the server
# Output in $OUT: before-r*.json, after-r*.json, repeats.json, repeats.md, triton-cache.txt, the serve log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"
OUT="${OUT:-/tmp/out_local}"; mkdir -p "$OUT"
export TRITON_CACHE_DIR=/tmp/triton-cache-bench
case "${1:-}" in
serve)
  rm -rf "$TRITON_CACHE_DIR"; mkdir -p "$TRITON_CACHE_DIR"
  bash tests/gpu/client_agreement.sh serve
  date +%s.%N > /tmp/bench-repeats-ready ;;
measure)
  [ -d .carry/old-sparkbook/sparkbook ] || { echo "carry .carry/old-sparkbook (git archive c2073fa sparkbook)"; exit 2; }
  rm -rf /tmp/old-sparkbook; cp -r .carry/old-sparkbook /tmp/old-sparkbook
  PYTHONPATH="$SITE:$REPO" KINDS="${KINDS:-after before}" timeout 540 "$PY" tests/gpu/bench_repeats.py drive "${2:-2}" http://127.0.0.1:8001 qwen3moe \
    /tmp/old-sparkbook "$OUT" | tee "$OUT/repeats.md"
  echo "server ready at: $(cat /tmp/bench-repeats-ready 2>/dev/null)" > "$OUT/triton-cache.txt"
  find "$TRITON_CACHE_DIR" -name '*.json' ! -name '__grp__*' -printf '%T@ %P\n' | sort -n >> "$OUT/triton-cache.txt"
  sid=$(cat /tmp/agreement-serve.pid); pkill -TERM -s "$sid"; sleep 5; pkill -KILL -s "$sid"
  cp /tmp/agreement-serve.log "$OUT/" ;;
*) echo "usage: bench_repeats.sh serve | measure [ROUNDS]"; exit 2 ;;
esac
