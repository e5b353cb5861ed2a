# Sourced by stage.sh and run_runbook.sh: where things live on the device, and the Jupyter kernelspec.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY="${CARRY:-/tmp/carry}"          # parts and the model dir, copied here on arrival
SITE="${SITE:-/tmp/site}"             # the carried wheels, installed with pip --target
# the interpreter that holds torch (on the device `python3` is /opt/torch/.venv/bin/python3;
# /usr/bin/python3 may be the bare system Python). Never resolve symlinks: that would leave the venv.
if [ -z "${PY:-}" ]; then
  PY="$(command -v python3)"
  if ! "$PY" -c 'import torch' 2>/dev/null && [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3; fi
fi
export JUPYTER_PATH="$SITE/share/jupyter"
export PYTHONPATH="$SITE:$REPO"
export PYTHONUNBUFFERED=1
# this workplace keeps NVLink multicast off in every process, whatever else sets the env
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# The kernel papermill starts by name (runbook.py: kernel_name="python3"). jupyter_client looks in
# $JUPYTER_PATH/kernels first, so this spec wins over any other python3 spec on the machine.
write_kernelspec() {
  local d="$SITE/share/jupyter/kernels/python3"
  mkdir -p "$d"
  cat > "$d/kernel.json" <<EOF
{
  "argv": ["$PY", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
  "display_name": "Python 3 (sparkbook, carried wheels)",
  "language": "python",
  "env": {"PYTHONPATH": "$SITE:$REPO"},
  "metadata": {"debugger": false}
}
EOF
}

# The session IDs the runbook's places recorded (runtime_python: `~/.sparkbook/<node>/<place>/sids`, "SID START" a
# line; before the node state dir moved there, `/tmp/sparkbook/<place>/sids`), one a line: what a step stops, by
# session ID only, never by name.
gpu_sessions() {
  cat /tmp/sparkbook/*/sids "$HOME"/.sparkbook/*/*/sids 2>/dev/null | cut -d' ' -f1 | sort -u
}
