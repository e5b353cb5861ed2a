"""Each node sampled through 06's soak: memory (MemAvailable, swap, the kernel's memory pressure), the GPUs where
nvidia-smi exists, the kernel log's new lines classified (an Xid, an OOM kill), and whether its serving process
still runs. One shell probe per node per sample, under its own timeout; what a node cannot tell is said, not an error.

Why these: a GB10's GPU shares its 128 GB with the CPU, so the engine's pressure shows as falling MemAvailable,
swap and PSI before a freeze (vllm#46307); an Xid or an OOM kill is the kernel's word for what killed an engine.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from ...core.analysis.hostfacts import meminfo
from ...core.cluster.nodes import Node, NodeError
from .clocks import QUERY, GpuSample, parse

KERNEL_TAIL = 200  # the last kernel log lines read at each sample: more than a few seconds of an ordinary kernel writes
PROBE = ("cat /proc/meminfo; echo @@psi; cat /proc/pressure/memory 2>&1; echo @@kernel; "
         f"if out=$(dmesg --time-format iso 2>&1); then printf '%s\\n' \"$out\" | tail -n {KERNEL_TAIL}; "
         f"elif j=$(journalctl -k -n {KERNEL_TAIL} -o short-iso --no-pager -q 2>&1); then printf '%s\\n' \"$j\"; "
         "else echo \"@@unreadable dmesg: $out; journalctl: $j\"; fi")
GPU_PROBE = "; echo @@gpu; " + " ".join(QUERY) + " 2>&1"
NO_GPUS = "no GPUs listed in params (nodes[].gpus): clocks, temperature and power not sampled"
# Only the kernel's own words, at the start of a line's message, count: a process's name (15 characters at most) is
# also printed by the kernel (`NAME[PID]: segfault at ...`), so a user process named `NVRM: Xid (): 7` must read as
# nothing. An Xid names its GPU's PCI address, which no process name holds room for; an OOM line is long or fixed.
STAMP = re.compile(r"^\S+ (?:\S+ kernel: )?")  # dmesg --time-format iso's stamp; journalctl -k short-iso's and host
XID = re.compile(r"^NVRM: Xid \((?:PCI:)?[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?\): (\d+),")
OOM = re.compile(r"^(?:Out of memory: Killed process|oom-kill:constraint=|.{1,15} invoked oom-killer: gfp_mask="
                 r"|Memory cgroup out of memory: Killed process)")
PSI = re.compile(r"^(some|full) avg10=([\d.]+)")


@dataclass(frozen=True)
class KernelEvent:
    """A kernel log line that ends an engine: an NVIDIA Xid (with its code) or an OOM kill."""

    kind: str  # "Xid" | "OOM kill"
    line: str
    xid: int | None = None


def kernel_event(line: str) -> KernelEvent | None:
    """What a kernel log line (dmesg's or journalctl's, with its stamp) says, where it is an Xid or an OOM kill in
    the kernel's own words; None for every other line."""
    message = STAMP.sub("", line.strip(), count=1)
    if found := XID.match(message):
        return KernelEvent("Xid", line.strip(), int(found.group(1)))
    if OOM.match(message):
        return KernelEvent("OOM kill", line.strip())
    return None


def psi(text: str) -> dict[str, float]:
    """/proc/pressure/memory's avg10 per line kind: {"some": %, "full": %}; empty where the kernel has no PSI."""
    return {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := PSI.match(line.strip()))}


def sections(text: str) -> dict[str, str]:
    """The probe's output split at its @@ markers: "meminfo" first, then psi, kernel, gpu."""
    parts: dict[str, list[str]] = {"meminfo": []}
    name = "meminfo"
    for line in text.splitlines():
        if line in ("@@psi", "@@kernel", "@@gpu"):
            name = line[2:]
            parts[name] = []
        else:
            parts[name].append(line)
    return {k: "\n".join(v) for k, v in parts.items()}


@dataclass(frozen=True)
class NodeSample:
    """One node at one instant of the soak (wall clock `at`); None where the node could not tell."""

    node: str
    at: float
    mem_available_gib: float | None = None
    swap_used_gib: float | None = None
    psi_some: float | None = None  # memory PSI avg10, % of time some task stalled on memory
    psi_full: float | None = None  # ... every task
    gpus: list[GpuSample] = field(default_factory=list)
    kernel_lines: list[str] = field(default_factory=list)  # the tail read, for the next sample's "new" lines
    kernel_events: list[KernelEvent] = field(default_factory=list)  # in the lines new since the sample before
    serving: bool | None = None  # its serving process runs (None: it serves nothing, or was not asked)
    unreachable: str | None = None  # the probe failed: why
    notes: list[str] = field(default_factory=list)  # what it cannot tell (no PSI, kernel log unreadable, no GPUs)

    @property
    def time(self) -> str:
        return datetime.fromtimestamp(self.at, UTC).isoformat(timespec="seconds")


def read_sample(node: str, at: float, text: str, before: list[str] | None, gpus_listed: bool) -> NodeSample:
    """The probe's output as a sample; kernel events only in lines not in `before` (the previous sample's tail;
    None: this is the first sample, the baseline, whose lines are not judged)."""
    part = sections(text)
    info, notes = meminfo(part["meminfo"].splitlines()), []
    gib = 1 << 30
    avail = info.get("MemAvailable")
    swap = info["SwapTotal"] - info["SwapFree"] if "SwapTotal" in info and "SwapFree" in info else None
    pressure = psi(part.get("psi", ""))
    if not pressure:
        notes.append(f"no memory PSI: {part.get('psi', '').strip()[:120] or '/proc/pressure/memory is empty'}")
    kernel = part.get("kernel", "").splitlines()
    if kernel and kernel[0].startswith("@@unreadable"):
        notes.append(f"kernel log not readable ({kernel[0][len('@@unreadable '):][:200]}): Xid and OOM kills unseen")
        kernel = []
    seen = set(before or ())
    events = [e for line in kernel if line not in seen and (e := kernel_event(line))] if before is not None else []
    samples = parse(part["gpu"], node) if "gpu" in part else []
    if not gpus_listed:
        notes.append(NO_GPUS)
    elif not samples:
        notes.append(f"nvidia-smi gave no GPU: {part.get('gpu', '').strip()[:160]}")
    return NodeSample(node, at, round(avail / gib, 2) if avail is not None else None,
                      round(swap / gib, 2) if swap is not None else None, pressure.get("some"), pressure.get("full"),
                      samples, kernel, events, notes=notes)


def sample(node: Node, before: list[str] | None, serving: Callable[[], bool] | None, timeout_s: float) -> NodeSample:
    """One sample of `node` (the probe under `timeout_s`), and whether its serving process runs where `serving`
    asks it; a node that does not answer is a sample saying why."""
    at, gpus = datetime.now(UTC).timestamp(), bool(node.spec.gpus)
    try:
        result = node.run(["sh", "-c", PROBE + (GPU_PROBE if gpus else "")], timeout=timeout_s)
    except NodeError as exc:
        return NodeSample(node.name, at, unreachable=str(exc)[:200])
    if result.exit_code is None or result.timed_out:
        return NodeSample(node.name, at, unreachable=f"the probe did not end within {timeout_s:g} s")
    got = read_sample(node.name, at, result.stdout, before, gpus)
    if serving is None:
        return got
    try:
        running = serving()
    except (NodeError, OSError) as exc:
        return replace(got, notes=[*got.notes, f"serving process not asked: {exc}"[:200]])
    return replace(got, serving=running)
