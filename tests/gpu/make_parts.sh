#!/usr/bin/env bash
# HERE, not on the device: group the wheels of .carry/wheels/ (and the model dir) into parts that each
# fit one device call (64 MiB per call, the repo's own files included).
#   bash tests/gpu/make_parts.sh            (after the wheels are in .carry/wheels/, see README.md)
# Writes .carry/part1 .. .carry/partK; every part holds SHA256SUMS.wheels (all whole wheels),
# SHA256SUMS.part (its own files) and NPARTS, so any call can tell what is still missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
C=.carry
PIECE_MIB=${PIECE_MIB:-44}             # split size of big wheels (MiB): lower it with CAP as the tree grows
CAP=${CAP:-$((45 * 1024 * 1024))}      # bytes of wheels per part: 64 MiB less the working tree (~11 MB with outputs/)
MODEL_DIR="$C/model-qwen3moe"          # travels with part1 (carry it beside .carry/part1)
[ -d "$C/wheels" ] && [ -d "$MODEL_DIR" ] || { echo "need $C/wheels/ and $MODEL_DIR/" >&2; exit 1; }
rm -rf "$C"/part[0-9]* "$C/pieces"; mkdir -p "$C/pieces"
(cd "$C/wheels" && sha256sum ./*.whl | sed 's#  \./#  #' | sort -k2) > "$C/SHA256SUMS.wheels"

# whole small wheels and the pieces of big ones, as one list of files
for w in "$C"/wheels/*.whl; do
  if [ "$(stat -c %s "$w")" -gt $(((PIECE_MIB + 1) * 1024 * 1024)) ]; then
    split -b "${PIECE_MIB}M" -d "$w" "$C/pieces/$(basename "$w").part"
  else
    ln "$w" "$C/pieces/"
  fi
done

# first-fit decreasing; part1 leaves room for the model dir
model=$(du -sb "$MODEL_DIR" | cut -f1)
python3 - "$C" "$CAP" "$model" <<'EOF'
import os, sys
c, cap, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
files = sorted(((os.path.getsize(os.path.join(c, "pieces", f)), f) for f in os.listdir(os.path.join(c, "pieces"))), reverse=True)
bins = []                                   # [free bytes, [names]]
for size, name in files:
    for b in bins:
        if b[0] >= size:
            b[0] -= size; b[1].append(name); break
    else:
        bins.append([cap - size - (model if not bins else 0), [name]])
# part1 = the bin with the most room, since it also carries the model (re-check it fits)
bins.sort(key=lambda b: -b[0])
assert bins[0][0] >= model or len(bins) == 1, "no part has room for the model"
for i, (_, names) in enumerate(bins, 1):
    d = os.path.join(c, f"part{i}"); os.makedirs(d)
    for n in names:
        os.link(os.path.join(c, "pieces", n), os.path.join(d, n))
print(len(bins))
EOF
K=$(ls -d "$C"/part[0-9]* | wc -l)
for d in "$C"/part[0-9]*; do
  sums=$(cd "$d" && sha256sum ./* | sed 's#  \./#  #'); echo "$sums" > "$d/SHA256SUMS.part"
  cp "$C/SHA256SUMS.wheels" "$d/"; echo "$K" > "$d/NPARTS"
done
rm -rf "$C/pieces"
echo "parts (bytes of wheels; limit per call 67108864 incl. the repo):"
repo=$(git ls-files -z | xargs -0 cat | wc -c); other=$(git ls-files -z -o --exclude-standard | xargs -0 -r cat | wc -c)
for d in "$C"/part[0-9]*; do
  s=$(du -sb "$d" | cut -f1); [ "$(basename "$d")" = part1 ] && s=$((s + model))
  printf '  %s  %9d  + repo %d (+ untracked %d) = %d\n' "$(basename "$d")" "$s" "$repo" "$other" $((s + repo + other))
done
