"""The stages in run order, one value each: its notebook, its package, the hand-offs it reads and writes, its longest
wait. The only module that spells a stage id or a notebook name (tests/unit/test_stage_list.py greps the package).

It is in core, not in `sparkbook.stages`, because its readers span every layer: the hand-offs (core.values.handoff) name
the notebook that writes each, the records read run dirs by stage, the runbook runs the notebooks in this order, and
core imports nothing above itself. The hand-offs are named here, not imported: core.values.handoff imports this list.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .benchbudget import point_timeout_s
from .params import Params


@dataclass(frozen=True)
class Wait:
    """The longest a cell of a stage may wait under the params, and why (in the params' own names)."""

    seconds: float
    why: str


@dataclass(frozen=True)
class Stage:
    """One notebook of the runbook and what it stands on."""

    name: str  # the notebook's stem, what its records carry as their stage: "05-serve"
    package: str  # its module under sparkbook.stages: "serve"
    reads: tuple[str, ...]  # the hand-offs (core.values.handoff, core.values.modelinfo) it recalls, by class name
    writes: tuple[str, ...]  # the hand-offs it remembers
    longest_wait: Callable[[Params], Wait] | None = None  # None: no wait beyond papermill's default cell limit
    needs: tuple[str, ...] = ()  # of `reads`, those it cannot run without (the others it falls back without)

    @property
    def id(self) -> str:
        """'05': what --from, --only and --upto take, the prefix of every name of its notebook."""
        return self.name.partition("-")[0]

    @property
    def notebook(self) -> str:
        return f"{self.name}.ipynb"

    def owns(self, name: str) -> bool:
        """Whether a notebook, output or stage name is this stage's: `05-serve.ipynb`, an A/B arm's
        `05-serve.ab-kept.ipynb`, a test's own `05-x.ipynb`."""
        return name.partition("-")[0] == self.id


def _ray_join(params: Params) -> Wait:
    ray = params.ray
    return Wait(ray.join_timeout_s, f"ray.join_timeout_s {ray.join_timeout_s:g} s")


def _serve_attempts(params: Params) -> Wait:
    s = params.serve
    return Wait((s.max_remedies + 1) * s.ready_timeout_s,
                f"{s.max_remedies + 1} attempts (serve.max_remedies {s.max_remedies} + 1) x serve.ready_timeout_s "
                f"{s.ready_timeout_s:g} s")


def _sweep(params: Params) -> Wait:

    sweep = sum(point_timeout_s(params.benchmark, c) for c in params.benchmark.concurrency)
    soak = params.benchmark.soak_wait_s
    return Wait(sweep + soak, f"the sweep's point timeouts, {sweep:.0f} s in all"
                + (f", and the soak's {soak:.0f} s (benchmark.soak_s and its last requests)" if soak else ""))


CLEANUP = Stage("01-cleanup", "cleanup", reads=(), writes=("Stopped", "OldDeployment"))
DIAGNOSE = Stage("02-diagnosis", "diagnose", reads=("OldDeployment",), writes=("ModelFacts", "Diagnosis"))
IMAGES = Stage("03-image-selection", "images", reads=("ModelFacts", "Diagnosis"), writes=("ImageChoice", "AbBaseline"))
RAYCLUSTER = Stage("04-ray-cluster", "raycluster", reads=("ImageChoice",), writes=("RayCluster", "FabricProof"),
                   longest_wait=_ray_join, needs=("ImageChoice",))
SERVE = Stage("05-serve", "serve", reads=("ImageChoice", "RayCluster", "ModelFacts", "Diagnosis", "AbAnswers"),
              writes=("Endpoint", "AbAnswers"), longest_wait=_serve_attempts,
              needs=("ImageChoice", "ModelFacts", "Diagnosis"))
BENCH = Stage("06-benchmark", "bench", reads=("Endpoint", "ModelFacts", "FabricProof", "ImageChoice", "AbBaseline",
                                              "AbAnswers"),
              writes=("BenchmarkSummary", "AbVerdict", "SoakReport"), longest_wait=_sweep,
              needs=("Endpoint", "ModelFacts"))
STAGES = (CLEANUP, DIAGNOSE, IMAGES, RAYCLUSTER, SERVE, BENCH)  # in run order


def stage_of(name: str) -> Stage | None:
    """The stage a notebook, output or stage name is of (see Stage.owns); None for a name of no stage."""
    return next((s for s in STAGES if s.owns(name)), None)
