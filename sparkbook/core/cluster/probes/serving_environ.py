"""The environment variable NAMES (never values) of every serving process in this container: `vllm serve` and its
workers, and the Ray actors vLLM runs its workers in (`ray::RayWorkerWrapper...`), which the raylet forks with the
container's env. Ray's own agents (`ray::DashboardAgent`, ...) are not serving and run with an env of Ray's making;
vllm-router (serve.layout replicas) serves no model, and its setproctitle rewrites the memory /proc shows as its env.

usage: python3 -c SOURCE   (SOURCE = probes.source("serving_environ")) -> its document, as probes/__init__.py says
Values stay on the node: they may hold secrets, and the check needs only the names.
"""
import os

MARKS = ("vllm", "ray::RayWorkerWrapper")
ROUTER = ("vllm_router", "vllm::router")  # the router before the replicas: not a process that loads the model
SELF = "SPARKBOOK-" + "JSON"  # in this probe's own command line (and its wrappers'): not a serving process


def process(pid):
    """(command line, sorted env names) of one process, or None where it is not a serving one or is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        if not cmd or SELF in cmd or not any(m in cmd for m in MARKS) or any(r in cmd for r in ROUTER):
            return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read().split(b"\0")
    except OSError:
        return None
    return cmd, sorted({item.split(b"=", 1)[0].decode(errors="replace") for item in raw if b"=" in item})


def main():
    found = []
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
        seen = process(pid)
        if seen is not None:
            found.append({"pid": int(pid), "cmd": seen[0][:160], "names": seen[1]})
    return {"processes": found}
