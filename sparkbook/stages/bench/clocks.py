"""Each GPU's SM clock, temperature and power sampled through a sweep point: throughput follows the clocks (a clock
cap costs 15-35 % on a DGX Spark), so a figure measured while they fell is flagged rather than taken at face value.

Sampled with nvidia-smi on every node that lists GPUs; where none does (the lab) nothing is sampled and the point
says so. A node whose nvidia-smi fails is named once and no longer asked.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

from ...core.cluster.nodes import Node, NodeError
from ...core.values.sweeppoint import GpuClocks

QUERY = ["nvidia-smi", "--query-gpu=index,clocks.sm,temperature.gpu,power.draw", "--format=csv,noheader"]
INTERVAL_S = 2.0
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class GpuSample:
    node: str
    gpu: int
    sm_mhz: float | None  # None where nvidia-smi says [N/A]
    temperature_c: float | None
    power_w: float | None


def _number(text: str) -> float | None:
    found = NUMBER.search(text)
    return float(found.group()) if found and "N/A" not in text else None


def parse(text: str, node: str) -> list[GpuSample]:
    """nvidia-smi's CSV of index, SM clock, temperature, power (a header line, if any, and `#` lines skipped)."""
    samples = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        samples.append(GpuSample(node, int(cells[0]), *(_number(c) for c in cells[1:])))
    return samples


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 1) if values else None


def summarize(samples: list[GpuSample], clock_drop: float) -> list[GpuClocks]:
    """Per GPU, in the order sampled; a drop counts from the first sample (the point's start)."""
    out = []
    for node, gpu in dict.fromkeys((s.node, s.gpu) for s in samples):
        mine = [s for s in samples if (s.node, s.gpu) == (node, gpu)]
        sm = [s.sm_mhz for s in mine if s.sm_mhz is not None]
        temps = [s.temperature_c for s in mine if s.temperature_c is not None]
        drop = round(100.0 * (sm[0] - min(sm)) / sm[0], 1) if sm and sm[0] else None
        out.append(GpuClocks(node, gpu, len(mine), sm[0] if sm else None, min(sm, default=None), _mean(sm),
                             max(temps, default=None), _mean([s.power_w for s in mine if s.power_w is not None]),
                             drop, drop is not None and drop > 100.0 * clock_drop))
    return out


@dataclass
class Sampler:
    """Samples the GPU nodes every INTERVAL_S seconds on a thread while a point is measured (`with sampler:`)."""

    nodes: list[Node]
    interval_s: float = INTERVAL_S
    samples: list[GpuSample] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # node: why it is no longer sampled
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        """One sample of every node still answering (each with its own timeout)."""
        for node in [n for n in self.nodes if n.name not in self.errors]:
            try:
                result = node.run(QUERY, timeout=max(5.0, self.interval_s * 2))
            except NodeError as exc:
                self.errors[node.name] = str(exc)[:200]
                continue
            if result.exit_code != 0:
                self.errors[node.name] = f"nvidia-smi exit {result.exit_code}: {result.stderr.strip()[:200]}"
                continue
            self.samples += parse(result.stdout, node.name)

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.sample()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def __enter__(self) -> Sampler:
        self.samples, self._stop = [], threading.Event()
        if self.nodes:
            self._thread = threading.Thread(target=self._loop, name="gpu-clocks", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=self.interval_s * 4 + 30)
        if self.nodes and not self.errors:
            self.sample()  # the point's end, so a short point still has a start and an end


def gpu_nodes(nodes: list[Node]) -> list[Node]:
    """The nodes whose params list GPUs: the ones to sample (none in the lab)."""
    return [n for n in nodes if n.spec.gpus]
