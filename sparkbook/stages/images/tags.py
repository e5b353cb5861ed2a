"""What a candidate's name meant before, and fetching candidates where the head has a registry.

    tag_history(ids, before) -> dict[str, TagHistory]     each ref's image ID now and at the last run that probed it
    pull(ctx, refs) -> list[Pulled]                       `docker pull` of each candidate on the head (runtime.pull)

Why: a moving tag (`…:latest`) names another image from one week to the next (hellohal2064/vllm-qwen3.5-gb10:latest
was vLLM 0.16, then 0.17); a run that probes it with `--pull never` would otherwise record a new vLLM under an old
name without a word. A digest pin (`name@sha256:…`) cannot move.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...core.cluster.context import Context
from ...core.values.evidence import ProbedBefore
from ...core.values.handoff import pinned

PULL_TIMEOUT_S = 3600  # a 20 GB image over a slow link


@dataclass(frozen=True)
class TagHistory:
    """A candidate's ID now against the last earlier run of this cluster that probed it."""

    ref: str
    image_id: str | None
    earlier_id: str | None
    earlier_run: str | None  # None: no earlier run probed this ref

    @property
    def moved(self) -> bool:
        return self.earlier_id is not None and self.image_id is not None and self.earlier_id != self.image_id

    def cell(self) -> str:
        if self.earlier_run is None:
            return "first probe" if not pinned(self.ref) else "pinned by digest"
        if self.moved:
            return f"MOVED: was {(self.earlier_id or '')[:19]} in run {self.earlier_run}"
        return f"same ID as run {self.earlier_run}"

    def warning(self) -> str | None:
        if not self.moved:
            return None
        return (f"{self.ref} names another image than in run {self.earlier_run} ({(self.earlier_id or '')[:19]} -> "
                f"{(self.image_id or '')[:19]}): the tag moved; pin it by digest (name@sha256:...) to keep one image")


def tag_history(ids: dict[str, str | None], before: Mapping[str, ProbedBefore]) -> dict[str, TagHistory]:
    """For each ref (-> its image ID on the head now), the ID the newest earlier run that probed it recorded
    (`before`: records.earlier.probed_before, handed over by the notebook)."""
    return {ref: TagHistory(ref, image_id, *((then.image_id, then.run) if (then := before.get(ref)) else (None, None)))
            for ref, image_id in ids.items()}


@dataclass(frozen=True)
class Pulled:
    ref: str
    ok: bool
    detail: str  # the last line docker printed (its digest and status), or its error
    seconds: float


def pull(ctx: Context, refs: list[str]) -> list[Pulled]:
    """`docker pull` of each candidate on the head, one after another; a failure (no registry reached) is reported
    and the local copy, if any, is probed as before."""
    out = []
    for ref in refs:
        r = ctx.head.run(["docker", "pull", ref], timeout=PULL_TIMEOUT_S)
        text = (r.stdout if r.ok else r.stderr or r.stdout).strip().splitlines()
        out.append(Pulled(ref, r.ok, text[-1][:300] if text else "", round(r.duration_s, 1)))
    return out
