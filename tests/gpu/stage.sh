#!/usr/bin/env bash
# On the device, in the repo root of the carried tree:  bash tests/gpu/stage.sh N
# Copies .carry/partN (and .carry/model-qwen3moe, carried with part1) to $CARRY. Once every part is
# there: rebuilds the wheels (checksums), installs them into $SITE, writes the python3 kernelspec and
# runs the import check. Parts may come in any order; a part already staged is copied again.
set -uo pipefail
N="${1:?usage: stage.sh PART_NUMBER}"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
die() { echo "STAGE FAILED: $*" >&2; exit 1; }

src="$REPO/.carry/part$N"
[ -d "$src" ] || die "$src is not here: name .carry/part$N in the call's carry list"
rm -rf "$CARRY/part$N"; mkdir -p "$CARRY/part$N"
cp "$src"/* "$CARRY/part$N/" || die "copy of part $N"
(cd "$CARRY/part$N" && sha256sum -c --quiet SHA256SUMS.part) || die "part $N arrived damaged"
if [ -d "$REPO/.carry/model-qwen3moe" ]; then
  rm -rf "$CARRY/model-qwen3moe"; cp -r "$REPO/.carry/model-qwen3moe" "$CARRY/" || die "copy of the model dir"
fi
echo "part $N staged: $(ls "$CARRY/part$N" | wc -l) files, $(du -sh "$CARRY/part$N" | cut -f1)"

K="$(cat "$CARRY/part$N/NPARTS")"
missing=""
for i in $(seq 1 "$K"); do [ -f "$CARRY/part$i/SHA256SUMS.part" ] || missing="$missing part$i"; done
[ -f "$CARRY/model-qwen3moe/config.json" ] || missing="$missing model-qwen3moe(with-part1)"
if [ -n "$missing" ]; then echo "still missing:$missing (this machine keeps /tmp only while it is held)"; exit 0; fi

if [ -f "$SITE/.staged" ]; then
  echo "wheels already installed in $SITE"
else
  W="$CARRY/wheels"; rm -rf "$W"; mkdir -p "$W"
  cp "$CARRY"/part*/*.whl "$W/" || die "copy of whole wheels"
  for b in $(ls "$CARRY"/part*/*.whl.part[0-9][0-9] | sed -E 's#.*/##; s#\.part[0-9]{2}$##' | sort -u); do
    ls "$CARRY"/part*/"$b".part[0-9][0-9] | awk -F/ '{print $NF" "$0}' | sort | cut -d' ' -f2 | xargs cat > "$W/$b"
  done
  (cd "$W" && sha256sum -c --quiet "$CARRY/part$N/SHA256SUMS.wheels") || die "wheel checksums"
  want=$(wc -l < "$CARRY/part$N/SHA256SUMS.wheels"); have=$(ls "$W"/*.whl | wc -l)
  [ "$want" -eq "$have" ] || die "expected $want wheels, rebuilt $have"
  echo "checksums OK: $have wheels; installing into $SITE with $PY"
  mkdir -p "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$W"/*.whl \
    || die "pip install"
  rm -rf "$W"
  touch "$SITE/.staged"
fi
write_kernelspec
echo "kernelspec: $SITE/share/jupyter/kernels/python3/kernel.json (python $PY)"
"$PY" "$REPO/tests/gpu/check_imports.py" --smoke || die "import check"
