"""05's memory: on unified-memory nodes (GB10: the GPU allocates from the OS's memory) the page cache dropped just
before launch and 02's fit checked again against what CUDA can allocate then; every serving node's MemAvailable
before the launch, and the settle check after a failed attempt (memory back within serve.settle_gib of it, else the
node and what still holds memory are named); the kernel's OOM-kill lines of a node whose server died."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from ...core.analysis.hostfacts import Memory, meminfo, memory_from, sections
from ...core.cluster.context import Context
from ...core.cluster.nodes import Node
from ...core.values.modelinfo import GIB, FitRow, ModelFacts, memory_fit
from .commands import ServeError, ServePlan

SAMPLE = ("echo ==gpumem==; nvidia-smi --query-gpu=memory.total,memory.used --format=csv,noheader,nounits "
          "2>/dev/null; echo ==meminfo==; cat /proc/meminfo; echo ==end==")
DROP = "sync; echo 3 > /proc/sys/vm/drop_caches"  # eugr/spark-vllm-docker's drop-caches mod does the same
KERNEL = "cat /proc/uptime; dmesg 2>&1 | tail -n 400"
# what holds memory in a place: its processes by resident size (python3 is in every image 04 can run)
HOLDERS = ("import os\nrows=[]\nfor p in filter(str.isdigit, os.listdir('/proc')):\n try:\n"
           "  s=open(f'/proc/{p}/status').read(); c=open(f'/proc/{p}/cmdline','rb').read().replace(b'\\0',b' ')\n"
           "  kb=int(s.split('VmRSS:')[1].split()[0]) if 'VmRSS:' in s else 0\n"
           "  rows.append((kb,p,c.decode(errors='replace')[:80]))\n except (OSError, IndexError):\n  pass\n"
           "for kb,p,c in sorted(rows,reverse=True)[:5]: print(f'pid {p} {kb/1048576:.2f} GiB {c}')")
POLL_S = 2.0


def page_cache(node: Node) -> tuple[int, int]:
    """(MemAvailable, Cached) in bytes, from the node's /proc/meminfo."""
    info = meminfo(node.run(["cat", "/proc/meminfo"], timeout=30, check=True).stdout.splitlines())
    return info["MemAvailable"], info.get("Cached", 0)


def sample(node: Node) -> Memory:
    """The node's memory now: /proc/meminfo and, where nvidia-smi reports it, the GPU's own."""
    r = node.run(["sh", "-c", SAMPLE], timeout=60, check=True)
    s = sections(r.stdout, node.name, "memory", ("meminfo",))
    return memory_from(meminfo(s["meminfo"]), s.get("gpumem", []))


def samples(ctx: Context, nodes: list[str]) -> dict[str, Memory]:
    """Every named node's memory now; raises naming each node that did not answer."""
    return dict(zip(nodes, ctx.cluster.fan_out(sample, [ctx.cluster.nodes[n] for n in nodes], timeout=120)
                    .values_or_raise(ServeError), strict=True))


def unified(ctx: Context, node: str, memory: Memory) -> bool:
    """The node's unified_memory in params where set, else what nvidia-smi says (GPUs without memory of their own)."""
    said = ctx.params.node(node).unified_memory
    return memory.unified if said is None else said


@dataclass(frozen=True)
class CacheDrop:
    """One node's page cache dropped: MemAvailable and the page cache (Cached) before and after (bytes), or why it
    could not be."""

    node: str
    before: int
    after: int
    cached_before: int
    cached_after: int
    error: str | None = None

    def row(self) -> dict[str, object]:
        return {"node": self.node, "MemAvailable before GiB": round(self.before / GIB, 2),
                "MemAvailable after GiB": round(self.after / GIB, 2),
                "page cache before GiB": round(self.cached_before / GIB, 2),
                "page cache after GiB": round(self.cached_after / GIB, 2), "error": self.error or "-"}


def drop_caches(ctx: Context, nodes: list[str]) -> list[CacheDrop]:
    """`sync; echo 3 > /proc/sys/vm/drop_caches` on every node named (as the SSH user: root, or the drop fails and
    says so), MemAvailable read before and after."""
    def one(node: Node) -> CacheDrop:
        before = page_cache(node)
        r = node.run(["sh", "-c", DROP], timeout=180)
        error = None if r.ok else ((r.stderr or r.stdout).strip()[-300:] or f"exit {r.exit_code}")
        after = page_cache(node)
        return CacheDrop(node.name, before[0], after[0], before[1], after[1], error)

    return ctx.cluster.fan_out(one, [ctx.cluster.nodes[n] for n in nodes], timeout=300).values_or_raise(ServeError)


@dataclass(frozen=True)
class BeforeLaunch:
    """What 05 knew of memory just before its first launch: every serving node's MemAvailable (the settle check's
    reference), the unified-memory nodes, their page-cache drops and 02's fit measured again on them."""

    available: dict[str, int]
    unified: list[str]
    drops: list[CacheDrop] = field(default_factory=list)
    fit: list[FitRow] = field(default_factory=list)
    memory: dict[str, Memory] = field(default_factory=dict)  # each serving node's sample, after any drop

    def unfit(self) -> list[FitRow]:
        return [r for r in self.fit if not r.fits]


def before_launch(ctx: Context, serve_plan: ServePlan, model: ModelFacts) -> BeforeLaunch:
    """Sample every serving node; on the unified ones drop the page cache, then measure what CUDA can allocate
    again (as 02 does: MemTotal less what GB10 keeps, at most MemAvailable) and redo 02's fit for the plan's
    settings on it. The settle check's reference is MemAvailable after any drop."""
    memory = samples(ctx, [c.node for c in serve_plan.commands])
    uma = [n for n, m in memory.items() if unified(ctx, n, m)]
    if not uma:
        return BeforeLaunch({n: m.mem_available for n, m in memory.items()}, [], memory=memory)
    drops = drop_caches(ctx, uma)
    memory.update(samples(ctx, uma))
    params = ctx.params.model_copy(update={"serve": serve_plan.settings})
    fit = memory_fit(model, params, {n: memory[n].for_fit(n) for n in uma})
    return BeforeLaunch({n: m.mem_available for n, m in memory.items()}, uma, drops, fit, memory)


def held(ctx: Context, before: BeforeLaunch) -> dict[str, int]:
    """What the server that just became ready holds on each serving node, in the terms of 02's fit (GPU memory
    where the GPU reports its own, else MemAvailable): its sample before the launch against one now. Recorded with
    the server, so that a later run's 02 counts it free where 05 would stop it."""
    after = samples(ctx, list(before.memory))
    return {n: before.memory[n].taken_by(after[n]) for n in after}


def check_fit(before: BeforeLaunch) -> None:
    """Stop 05 before any weight loads where the fit no longer holds after the drop, with both figures."""
    bad = before.unfit()
    if bad:
        raise ServeError("02's memory fit no longer holds on unified memory after the page cache was dropped: "
                         + "; ".join(f"{r.node}: the plan takes {r.planned_gib} GiB, CUDA can allocate "
                                     f"{r.allocatable_gib} GiB now ({r.why})" for r in bad),
                         node=bad[0].node, remediation="stop what else holds memory on the node (01's inventory "
                         "lists it), or lower serve.gpu_memory_utilization / max_model_len")


@dataclass(frozen=True)
class Settle:
    """After a failed attempt: each serving node's MemAvailable before the first launch, right after the failure and
    once settled (or at the deadline), and what still held memory where it did not come back."""

    attempt: int
    before: dict[str, int]
    after_failure: dict[str, int]
    after_settle: dict[str, int]
    seconds: float
    tolerance_gib: float
    holders: dict[str, list[str]] = field(default_factory=dict)

    def unsettled(self) -> list[str]:
        return [n for n in self.before if self.before[n] - self.after_settle[n] > self.tolerance_gib * GIB]

    @property
    def ok(self) -> bool:
        return not self.unsettled()

    def rows(self) -> list[dict[str, object]]:
        return [{"attempt": self.attempt, "node": n, "MemAvailable before launch GiB": round(self.before[n] / GIB, 2),
                 "after failure GiB": round(self.after_failure[n] / GIB, 2),
                 "after settle GiB": round(self.after_settle[n] / GIB, 2), "settled": n not in self.unsettled(),
                 "seconds": round(self.seconds, 1), "still holding": "; ".join(self.holders.get(n, [])) or "-"}
                for n in self.before]

    def problem(self) -> str | None:
        bad = self.unsettled()
        return None if not bad else (
            f"memory did not come back after attempt {self.attempt} within {self.seconds:.0f} s: " + "; ".join(
                f"{n}: MemAvailable {self.after_settle[n] / GIB:.2f} GiB against {self.before[n] / GIB:.2f} before the "
                f"launch (more than serve.settle_gib {self.tolerance_gib:g} below); still holding: "
                f"{', '.join(self.holders.get(n, [])) or 'nothing of this runbook (another process on the node)'}"
                for n in bad))


def settle(ctx: Context, before: dict[str, int], attempt: int) -> Settle:
    """Wait (serve.settle_timeout_s at most) until every serving node's MemAvailable is back within serve.settle_gib
    of `before`; where it is not, name the biggest processes still in the node's container."""
    s, t0 = ctx.params.serve, time.monotonic()

    def now() -> dict[str, int]:
        return {n: m.mem_available for n, m in samples(ctx, list(before)).items()}

    first = latest = now()
    while any(before[n] - latest[n] > s.settle_gib * GIB for n in before) and \
            time.monotonic() - t0 < s.settle_timeout_s:
        time.sleep(POLL_S)
        latest = now()
    result = Settle(attempt, before, first, latest, time.monotonic() - t0, s.settle_gib)
    holders = {n: holding(ctx, ctx.cluster.nodes[n]) for n in result.unsettled()}
    return Settle(attempt, before, first, latest, result.seconds, s.settle_gib, holders)


def holding(ctx: Context, node: Node) -> list[str]:
    """The node's container (04's, this runbook's) and its biggest processes, or why they cannot be listed."""
    place = ctx.places[node.name]
    if not ctx.runtime.alive(node, place):
        return []
    r = ctx.runtime.exec(node, place, ["python3", "-c", HOLDERS], timeout=30)
    lines = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
    return [f"container {place.name}: " + (" | ".join(lines) if r.ok and lines else f"unlisted ({r.stderr[-120:]})")]


_DMESG = re.compile(r"^\[\s*(\d+\.\d+)\]\s*(.*)$")


def recent_kernel_lines(text: str, since_s: float) -> list[str]:
    """`cat /proc/uptime; dmesg` output -> the kernel's lines of the last `since_s` seconds (dmesg's own
    timestamps are seconds since boot, as /proc/uptime's first figure)."""
    lines = text.splitlines()
    try:
        uptime = float(lines[0].split()[0])
    except (IndexError, ValueError):
        return []
    return [m[2] for m in map(_DMESG.match, lines[1:]) if m and float(m[1]) >= uptime - since_s]


def kernel_lines(ctx: Context, nodes: list[str], since_s: float) -> dict[str, str]:
    """The kernel's recent lines on each node named (its OOM kills name the process), '' where dmesg is refused."""
    if not nodes:
        return {}

    def one(node: Node) -> str:
        return "\n".join(recent_kernel_lines(node.run(["sh", "-c", KERNEL], timeout=30).stdout, since_s))

    outcomes = ctx.cluster.fan_out(one, [ctx.cluster.nodes[n] for n in nodes], timeout=60)
    return {n: o.value or "" for n, o in outcomes.items() if o.ok}
