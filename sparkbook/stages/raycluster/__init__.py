"""04: the node containers (containers.py), Ray started in them, the join wait and the gate (formation.py), a
running cluster kept when it is still right (keep.py), and the all_reduce test of the fabric under it
(fabrictest.py). Where vLLM launches its own ranks across the nodes (serve.executor mp, or an image without Ray:
topology.without_ray, issue 45) no Ray starts anywhere: the containers, the fabric test and the hand-off alone.

The front door: `preview(ctx)` (per node the container start it would make, its `ray start`, the env names, and
whether the running cluster is kept; read-only probes) and `run(ctx, preview)`, which starts those very specs, forms
Ray, gates it, tests the fabric and returns its evidence."""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from matplotlib.figure import Figure

from ...core.cluster.context import Context
from ...core.cluster.nodes import Result
from ...core.cluster.progress import Progress
from ...core.cluster.runtime import StartSpec
from ...core.cluster.topology import LiveServer, address, live_server, without_ray
from ...core.values.errors import SparkbookError
from ...core.values.evidence import Alternative, Decision, Shown, StageOutcome, now
from ...core.values.handoff import ImageChoice, RayCluster
from ...core.values.params import Params
from ...core.values.state import Handoff
from . import containers, fabrictest, formation, keep
from .containers import NodeContainer, RayStageError
from .fabrictest import AllReduceTest, FabricVerdict
from .formation import Gate, Join, RayStart
from .keep import Reuse


# --- preview ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeStart:
    """One node's part of 04: the container start (`run` hands this very value to the runtime) and its `ray start`."""

    spec: StartSpec
    ray: list[str]

    def row(self) -> dict[str, str]:
        return {"node": self.spec.node, "node container": self.spec.command_line(),
                "ray start": shlex.join(self.ray) if self.ray else "- (no Ray)",
                "env (names)": ", ".join(self.spec.env_names)}


@dataclass(frozen=True)
class RayPreview:
    """What 04 would do: from 03's image, per node the container start and `ray start`; whether the running cluster
    is kept instead (then nothing is started); whether the fabric test runs; and the RayCluster it would hand 05
    (`assumed`: as it would form, before any node has joined; none where whether Ray forms is not known yet)."""

    image: ImageChoice
    starts: list[NodeStart]
    kept: Reuse
    skip: str | None  # why the all_reduce test is skipped (one rank); None: it runs
    address: str | None  # None: no Ray (no_ray says why)
    assumed: tuple[Handoff, ...] = ()
    live: LiveServer | None = None  # the server the containers 04 would replace still serve (None: none answers)
    no_ray: str | None = None  # why no Ray forms (topology.without_ray); None: Ray forms, or ray_unknown
    ray_unknown: str | None = None  # why it is not known whether Ray forms (ray_unknown); None: known

    @property
    def specs(self) -> dict[str, StartSpec]:
        return {s.spec.node: s.spec for s in self.starts}

    def shown(self) -> list[Shown]:
        kept = ("kept: the running cluster is still right, nothing is started" if self.kept.ok
                else f"started anew: {self.kept.reason}")
        return [Shown("Image (03)", self.image_row()), Shown(self.starts_title(), [s.row() for s in self.starts]),
                Shown("The running cluster", kept),
                *([Shown("A live server in the containers 04 would replace", replacing(self.live, self.kept))]
                  if self.live and not self.kept.ok else []),
                Shown("Fabric test", f"skipped: {self.skip}" if self.skip else "all_reduce across the nodes")]

    def image_row(self) -> dict[str, str]:
        """03's image; what is not known before 03 probes it says so (a plan before a first run)."""
        c, unknown = self.image, "not known: 03's probe of it tells"
        return {"image": c.ref, "id": c.id or "not known: 03 puts it on the nodes",
                "vLLM": c.vllm_version or unknown,
                "Ray": (c.ray_version or "none") if c.probed else unknown}

    def starts_title(self) -> str:
        if self.ray_unknown is not None:
            return f"Node containers, Ray not known yet: {self.ray_unknown}"
        if self.no_ray is not None:
            return f"Node containers, no Ray: {self.no_ray}"
        return f"Node containers and Ray (Ray address {self.address})"


def ray_unknown(params: Params, choice: ImageChoice) -> str | None:
    """Why it is not known whether 04 forms Ray: the params leave it to the image's Ray (topology.without_ray)
    and its probe did not answer (`sparkbook plan` before a first run); None: known."""
    leaves_it_to_the_image = params.serve.layout != "replicas" and params.serve.executor is None
    if choice.probed or not leaves_it_to_the_image:
        return None
    return (f"serve.executor is unset and whether {choice.ref} has Ray is not known until 03 probes it: with Ray, "
            "each node's `ray start` below runs; without, 05 serves with vLLM's own multi-node launch")


def preview(ctx: Context) -> RayPreview:
    """03's image; each node's container start (its devices probed) and `ray start`; whether the cluster a
    previous run left is kept (read-only: the daemons, the containers and Ray are asked, nothing is started)."""
    choice = ctx.handoffs.need(ImageChoice)
    ctx = ctx.with_image(choice.on_nodes)
    unknown = ray_unknown(ctx.params, choice)
    no_ray = None if unknown else without_ray(ctx.params, choice.ray_version)
    specs = containers.start_specs(ctx)
    starts = [NodeStart(specs[n.name], [] if no_ray else formation.ray_argv(ctx.params, n)) for n in ctx.params.nodes]
    forms = RayCluster(address=None if no_ray or unknown else address(ctx.params),
                       containers={n: p.name for n, p in ctx.places.items()}, reused=False, container_ids={}, nodes=[])
    keeping = kept(ctx, choice.id, ray=no_ray is None)
    live = None if keeping.ok else live_server(ctx.params, ctx.cluster, ctx.runtime)
    return RayPreview(choice, starts, keeping, fabrictest.single_rank(ctx.params), forms.address,
                      () if unknown else (forms,), live, no_ray, unknown)


def replacing(live: LiveServer, keeping: Reuse) -> str:
    return (f"the node containers serve {live.model} at {live.base_url} (run {live.run or 'unknown'}); starting "
            f"04's containers anew ({keeping.reason}) stops that server: only with -p confirm_replace=true, and "
            "drained first (the head's server gets SIGTERM and up to serve.drain_timeout_s to finish what it runs)")


def kept(ctx: Context, image_id: str | None, *, ray: bool) -> Reuse:
    """The running cluster and whether it is kept; never where 03's image ID is not known yet (a plan before 03)."""
    if image_id is None:
        return Reuse([], {}, None, "the image's ID is not known before 03 has put it on every node", with_ray=ray)
    return keep.reusable(ctx, image_id, ray=ray)


# --- run -------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class RayOutcome(StageOutcome):
    """What 04 did: the containers (kept or started), `ray start` per container, the join, `ray status`, the gate,
    the fabric test (or why it was skipped) with its figure, and the RayCluster. A field is None where 04 stopped
    before its step (outcome.error says why)."""

    kept: Reuse
    skip: str | None
    no_ray: str | None = None  # why no Ray was formed (the Ray steps show it); None: Ray forms
    containers: list[NodeContainer] | None = None
    started: list[RayStart] | None = None
    join: Join | None = None
    status_results: list[Result] = field(default_factory=list)  # `ray status`: the notebook records it (run.results)
    gate: Gate | None = None
    test: AllReduceTest | None = None
    verdict: FabricVerdict | None = None
    figures: dict[str, Figure] = field(default_factory=dict)  # file name -> figure (run.show_figures)
    ray: RayCluster | None = None

    def _stopped(self, title: str) -> list[Shown]:
        if self.no_ray is not None and self.containers is not None:
            return [Shown(title, f"no Ray on this path: {self.no_ray}")]
        why = self.error.message if self.error else "not reached"
        return [Shown(title, f"04 stopped at or before this step: {why}")]

    def containers_shown(self) -> list[Shown]:
        if self.containers is None:
            return self._stopped("Node containers")
        return [Shown("Node containers", [c.row() for c in self.containers])]

    def ray_start_shown(self) -> list[Shown]:
        title = "ray start, per container"
        if self.started is None or self.no_ray is not None:
            return self._stopped(title)
        return [Shown(title, [s.row() for s in self.started]
                      or "Ray already runs in every container: kept (see the decision)")]

    def join_shown(self) -> list[Shown]:
        j = self.join
        if j is None:
            return self._stopped("Ray join")
        return [Shown("Ray join", {"joined": ", ".join(j.joined), "missing": ", ".join(j.missing) or "none",
                                   "seconds": round(j.seconds, 1), "stopped because": j.stopped_because or "-"})]

    def status_shown(self) -> list[Shown]:
        if not self.status_results:
            return self._stopped("ray status")
        status = self.status_results[0]
        return [Shown("ray status", status.stdout or status.stderr)]

    def gate_shown(self) -> list[Shown]:
        if self.gate is None:
            return self._stopped("Ray gate")
        return [Shown("Ray gate", self.gate.rows)]

    def fabric_shown(self) -> list[Shown]:
        if self.skip:
            return [Shown("Fabric test", f"skipped: {self.skip}")]
        test, verdict = self.test, self.verdict
        if test is None or verdict is None:
            return self._stopped("Fabric test")
        return [Shown(f"all_reduce across {test.world} ranks ({test.backend}; {test.versions}), {test.seconds:.1f} s; "
                      f"limits: {verdict.limits.why}", fabrictest.rows(test, verdict)),
                Shown("Transport per node and measured links", fabrictest.transport_rows(test))]

    def ray_shown(self) -> list[Shown]:
        if self.ray is None:
            return self._stopped("ray (state.json)")
        return [Shown("ray (state.json)", self.ray)]

    def summary_shown(self) -> list[Shown]:
        ray, join = self.ray, self.join
        if ray is None or (join is None and self.no_ray is None):
            return [Shown("04 summary", f"04 stopped at or before this step: "
                                        f"{self.error.message if self.error else 'not reached'}")]
        return [Shown("04 summary", {"Ray address": ray.address or f"none: {self.no_ray}",
                                     "nodes joined": len(join.joined) if join else "-",
                                     "join seconds": round(join.seconds, 1) if join else "-",
                                     "gate": "passed" if join else "-",
                                     "fabric": self.fabric_line(), "containers": ", ".join(ray.containers.values())})]

    def fabric_line(self) -> str:
        if self.skip or self.test is None:
            return f"test skipped: {self.skip}"
        small, large = self.test.sizes[0], self.test.sizes[-1]
        return (f"{small.us:,.0f} us at {small.bytes >> 10} KiB, {large.busbw_gbps:.2f} Gb/s busbw "
                f"({self.test.backend})")


def run(ctx: Context, preview: RayPreview, *, confirm_replace: bool) -> RayOutcome:
    """Keep the running cluster or start the preview's containers and Ray, wait for the join, gate, test the fabric
    and hand on the RayCluster (and the fabric's figures). Containers that hold a live server are replaced only with
    confirm_replace, as 05 replaces a server (issue 40): without it nothing is touched; with it they are stopped and
    kept aside (event `containers_set_aside`) until 05's server answers, and a failure in 04 or 05 brings them back
    with their plan (runbook.fallback). A failure ends it as outcome.error, after the evidence gathered so far."""
    ctx = ctx.with_image(preview.image.on_nodes)
    out = RayOutcome(kept=preview.kept, skip=preview.skip, no_ray=preview.no_ray)
    out.decide(ray_decision(preview))
    out.decide(preview.kept.decision(preview.image.id or ""))
    live = None if preview.kept.ok else preview.live  # the server that stops with the containers replaced
    if live is not None:
        out.decide(replace_decision(live, preview.kept, confirm_replace))
        if not confirm_replace:
            out.error = RayStageError(f"04 would stop a live server: {replacing(live, preview.kept)}",
                                      remediation="run again with -p confirm_replace=true to replace it, or with the "
                                                  "image and settings it runs to keep it")
            return out
    try:
        stopped = now() if live is not None else None  # from the drain on, the old server takes no new request
        if live is not None:  # drained, then kept aside, not removed, until the new server answers (05 drops them)
            out.event("server_drained", containers.drain_head(ctx, ctx.params.serve.drain_timeout_s))
            out.event("containers_set_aside", {"run": live.run, "at": now(), "nodes": containers.set_aside(ctx)})
        out.error = form(ctx, preview, out, stopped)
    except SparkbookError as exc:  # a container or Ray that does not start, Ray's node table unreadable
        out.error = exc
    return out


def ray_decision(preview: RayPreview) -> Decision:
    """Whether Ray forms: recorded either way, since a stock vLLM image has none (issue 45)."""
    question, evidence = "Form a Ray cluster in the node containers?", [
        f"image {preview.image.ref}: Ray {preview.image.ray_version or 'absent'}"]
    if preview.no_ray is not None:
        return Decision(question, "no Ray", preview.no_ray, [Alternative(
            "form Ray", "nothing on this path uses it, and Ray busy-loops a CPU core on every node (vllm#21231)")],
                        evidence, key="ray")
    return Decision(question, "form Ray", "the image has Ray and serve.executor is not mp: 05 may serve with the "
                    "Ray executor", [Alternative("no Ray", "set serve.executor: mp to serve with vLLM's own "
                                                            "multi-node launch")], evidence, key="ray")


def replace_decision(live: LiveServer, keeping: Reuse, confirmed: bool) -> Decision:
    question = "Replace the node containers that hold a live server?"
    evidence = [f"{live.base_url} answers /health, serving {live.model} for run {live.run or 'unknown'}",
                f"not kept: {keeping.reason}"]
    if confirmed:
        return Decision(question, "replace them", "confirm_replace is true: the server stops with its containers",
                        [Alternative("keep them, stop here", "confirm_replace asks for the replacement")], evidence,
                        key="replace_containers")
    return Decision(question, "keep them, stop here", "confirm_replace is false: a live server is replaced only when "
                    "asked", [Alternative("replace them", "confirm_replace is false")], evidence,
                    key="replace_containers")


def form(ctx: Context, preview: RayPreview, out: RayOutcome, stopped_server_at: str | None) -> SparkbookError | None:
    """The containers, Ray, the join, the gate and the fabric test, each recorded in `out`; the error that stops
    04 there. `stopped_server_at`: when the live server these containers held stopped with them (05 counts the
    seconds without service from then)."""
    reused = preview.kept.ok
    started_containers = preview.kept.containers if reused else \
        containers.start_containers(ctx, preview.specs, preview.image.id)
    out.containers = started_containers
    if preview.no_ray is not None:
        return _without_ray(ctx, preview, out, stopped_server_at)
    out.started = [] if reused and not preview.kept.starts_ray else formation.start_ray(ctx)
    with Progress("Ray nodes joined", total=len(ctx.params.nodes)) as bar:
        join = out.join = formation.wait_for_join(ctx, started_containers, out.started, on_round=bar.update)
    out.event("ray_join", join)
    out.status_results = [formation.status(ctx)]
    gate = out.gate = formation.gate(ctx, started_containers, join)
    out.event("ray_gate", gate)
    if not gate.ok:
        return formation.GateFailed(gate)
    error = fabric(ctx, preview, out)
    if error is not None:
        return error
    out.ray = formation.summary(ctx, started_containers, join, reused=reused).model_copy(
        update={"stopped_server_at": stopped_server_at})
    out.handoffs.append(out.ray)
    return None


def _without_ray(ctx: Context, preview: RayPreview, out: RayOutcome, stopped_server_at: str | None
                 ) -> SparkbookError | None:
    """No Ray: the containers stand, the fabric test proves the links 05's ranks will use, the hand-off has no
    address."""
    assert out.containers is not None
    error = fabric(ctx, preview, out)
    if error is not None:
        return error
    out.ray = formation.summary(ctx, out.containers, None, reused=preview.kept.ok).model_copy(
        update={"stopped_server_at": stopped_server_at})
    out.handoffs.append(out.ray)
    return None


def fabric(ctx: Context, preview: RayPreview, out: RayOutcome) -> SparkbookError | None:
    """The all_reduce test (or the decision to skip it), its figure and FabricProof; the failed verdict's error."""
    if preview.skip:
        out.decide(fabrictest.skip_decision(ctx.params, preview.skip))
        return None
    test = out.test = fabrictest.run_allreduce(ctx)
    verdict = out.verdict = fabrictest.verdict(ctx.params, test)
    out.event(fabrictest.EVENT, test)
    out.event("fabric_verdict", verdict)
    out.figures = {"fabric-allreduce.png": fabrictest.figure(test, verdict)}
    if not verdict.ok:
        return fabrictest.FabricTestFailed(verdict)
    out.handoffs.append(fabrictest.proof(test))  # 06 sets these figures beside its decode time
    return None
