"""Host facts read from probe output on a node: sectioned output, /proc/meminfo, nvidia-smi memory and apps.

Parsers shared by 01 (cleanup's inventory) and 02 (diagnosis's node facts).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..values.errors import ProbeOutputError
from ..values.modelinfo import CUDA_UNSEEN_PER_GPU_BYTES, GIB, UNIFIED_UNSEEN_BYTES, NodeMemory

FANOUT_TIMEOUT_S = 25  # a node that has not answered by then is reported by name, not waited on
NO_GPU = "no GPU (nvidia-smi not present)"
END = "end"  # the last section of every sectioned probe (`echo ==end==`): without it the reply was cut


# `uname -m` -> the CPU architecture as Docker names it in an image (`docker image inspect .Architecture`)
GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm",
          "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64", "i686": "386"}


def goarch(machine: str) -> str:
    """A node's `uname -m` as Docker names the architecture (the machine itself where unknown)."""
    return GOARCH.get(machine, machine)


@dataclass(frozen=True)
class GpuApp:
    pid: int
    name: str
    used_mib: int | None


@dataclass(frozen=True)
class Memory:
    """System memory, and GPU memory where the GPU reports it (GB10's unified memory reports N/A)."""

    mem_total: int
    mem_available: int
    gpu_total: int | None = None
    gpu_used: int | None = None
    gpus: int = 0  # GPUs nvidia-smi lists, whether or not it reports their memory

    @property
    def unified(self) -> bool:
        """A GPU that reports no memory of its own: it allocates from system memory (GB10)."""
        return self.gpus > 0 and self.gpu_total is None

    @property
    def source(self) -> str:
        return "GPU" if self.gpu_total is not None else "MemTotal/MemAvailable"

    @property
    def free(self) -> int:
        """What 02's fit counts as free: the GPU's unused memory where it reports its own, else MemAvailable."""
        return self.gpu_total - (self.gpu_used or 0) if self.gpu_total is not None else self.mem_available

    def without(self, held: int) -> Memory:
        """This memory once a process holding `held` (in the terms of `free`) has stopped."""
        if self.gpu_total is not None:
            return dataclasses.replace(self, gpu_used=max(0, (self.gpu_used or 0) - held))
        return dataclasses.replace(self, mem_available=min(self.mem_total, self.mem_available + held))

    def taken_by(self, after: Memory) -> int:
        """What a process started between this sample and `after` holds, in the terms of `free` (0 where it rose)."""
        return max(0, self.free - after.free)

    def describe(self) -> str:
        text = f"MemTotal {self.mem_total / GIB:.2f} GiB, MemAvailable {self.mem_available / GIB:.2f} GiB"
        if self.gpu_total is not None:
            text += f"; GPU {self.gpu_used or 0:,} of {self.gpu_total:,} bytes used"
        return text

    def delta(self, after: Memory) -> dict[str, object]:
        rise = after.mem_available - self.mem_available
        row: dict[str, object] = {"MemAvailable before GiB": round(self.mem_available / GIB, 3),
                                  "after GiB": round(after.mem_available / GIB, 3),
                                  "rise MiB": round(rise / (1 << 20), 1)}
        if self.gpu_used is not None and after.gpu_used is not None:
            row["GPU freed MiB"] = round((self.gpu_used - after.gpu_used) / (1 << 20), 1)
        return row

    def for_fit(self, node: str) -> NodeMemory:
        """The node's memory for 02's fit, with what CUDA can allocate of it (modelinfo says where the figures
        come from): measured on a discrete GPU, MemTotal less a documented share on unified memory, MemAvailable
        without a GPU."""
        if self.gpu_total is not None:
            free = self.free
            return NodeMemory(node, self.gpu_total, free, "GPU", max(0, free - self.gpus * CUDA_UNSEEN_PER_GPU_BYTES),
                              f"measured: nvidia-smi memory.total - memory.used, less "
                              f"{CUDA_UNSEEN_PER_GPU_BYTES >> 20} MiB per GPU out of CUDA's reach")
        if self.unified:
            return NodeMemory(node, self.mem_total, self.mem_available, "MemTotal/MemAvailable",
                              min(self.mem_total - UNIFIED_UNSEEN_BYTES, self.mem_available),
                              f"unified memory (nvidia-smi reports none): MemTotal less "
                              f"{UNIFIED_UNSEEN_BYTES / GIB:.1f} GiB (GB10 headless), at most MemAvailable")
        return NodeMemory(node, self.mem_total, self.mem_available, "MemTotal/MemAvailable", self.mem_available,
                          "no GPU: MemAvailable")


def meminfo(lines: list[str]) -> dict[str, int]:
    """/proc/meminfo lines -> bytes per key."""
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _mib(value: str) -> int | None:
    value = value.strip()
    return int(float(value)) << 20 if value.replace(".", "", 1).isdigit() else None  # "[N/A]" on GB10


def memory_from(info: dict[str, int], gpu_csv: list[str]) -> Memory:
    """Memory from meminfo and `nvidia-smi --query-gpu=memory.total,memory.used` lines (none: no GPU)."""
    totals = [[_mib(v) for v in line.split(",")] for line in gpu_csv if line.count(",") == 1]
    known = [(total, used or 0) for total, used in totals if total is not None]
    return Memory(info["MemTotal"], info["MemAvailable"],
                  sum(total for total, _ in known) if known else None,
                  sum(used for _, used in known) if known else None, len(totals))


def gpu_apps(rc: int, lines: list[str]) -> tuple[str, list[GpuApp]]:
    """`nvidia-smi --query-compute-apps` output and exit status -> a fact about the GPU and its processes."""
    if rc == 127:
        return NO_GPU, []
    if rc != 0:
        return f"nvidia-smi failed: {' '.join(lines)[-200:]}", []
    apps = []
    for line in filter(None, lines):
        pid, name, used = (part.strip() for part in line.split(",", 2))
        apps.append(GpuApp(int(pid), name, int(used) if used.isdigit() else None))
    return f"{len(apps)} GPU compute process(es)", apps


def sections(text: str, node: str, probe: str, required: Sequence[str] = ()) -> dict[str, list[str]]:
    """A probe's `==name==`-delimited output -> stripped lines per section. The probe's last line is `echo ==end==`:
    output without that end section, or without a non-empty section named in `required`, is not whole and raises
    ProbeOutputError naming the node, the probe and what is missing."""
    out: dict[str, list[str]] = {}
    key = ""
    for line in text.splitlines():
        if line.startswith("==") and line.endswith("==") and len(line) > 4:
            key = line.strip("=")
            out[key] = []
        elif key:
            out[key].append(line.strip())
    missing = [f"{name} section" for name in required if not out.get(name)]
    if END not in out:
        missing.append("end marker")
    if missing:
        raise ProbeOutputError(node, probe, " or ".join(missing), len(text.encode()))
    return out
