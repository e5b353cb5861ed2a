"""02, diagnosis: one read-only pass over the cluster (checks.py): the nodes' facts, the fabric links, the model's
files and facts, the memory fit of the plan, the installed image's registry; the findings, and the gate that stops
the run at a blocker no later stage resolves.

The front door: `preview(ctx)` (the nodes, the model and the memory fit: what `sparkbook plan` shows) and
`run(ctx, preview, ...)`, which tests the links, probes the installed image, gathers the findings and gates."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...core.cluster import imageprobes, topology
from ...core.cluster.context import Context
from ...core.values import modelinfo
from ...core.values.errors import SparkbookError
from ...core.values.evidence import Finding, ProbedBefore, Shown, StageOutcome
from ...core.values.fanout import Outcome
from ...core.values.handoff import Diagnosis, OldDeployment
from ...core.values.imagefacts import RegistryProbe
from ...core.values.modelinfo import FitRow, ModelFacts, NodeMemory
from ...core.values.state import Handoff
from . import checks, imageids, layoutfit
from .checks import Link, ModelFiles, NodeFacts
from .layoutfit import LayoutFit


@dataclass(frozen=True)
class DiagnosePreview:
    """The read-only facts 02 stands on: every node's facts, the model's files on each node and the facts read from
    one copy, each node's memory (what this runbook's answering server holds counted free: 05 stops it first) and
    the plan's fit in it, the layouts that fit (`layouts`); `assumed` hands the previews after it the ModelFacts and a
    Diagnosis of the memory alone (05's OOM floor stands on it; the findings are the run's)."""

    facts: dict[str, Outcome[NodeFacts]]
    files: dict[str, Outcome[ModelFiles]]
    source: ModelFiles
    model: ModelFacts
    memory: dict[str, NodeMemory]
    fit: list[FitRow]
    layouts: list[LayoutFit]
    assumed: tuple[Handoff, ...] = ()

    def facts_shown(self) -> list[Shown]:
        return [Shown("Node facts", [o.value.row() if o.value is not None else {"node": n, "os": f"UNREACHABLE: "
                                     f"{o.error}"} for n, o in self.facts.items()])]

    def model_shown(self) -> list[Shown]:
        return [Shown("The model on each node", checks.model_rows(self.files)),
                Shown(f"Model facts (config.json from {self.source.node})", self.model.summary())]

    def fit_shown(self, ctx: Context) -> list[Shown]:
        s = ctx.params.serve
        return [Shown(f"Memory fit: TP={s.tensor_parallel_size} PP={s.pipeline_parallel_size}, utilization "
                      f"{s.gpu_memory_utilization or modelinfo.VLLM_DEFAULT_UTILIZATION}, KV "
                      f"{s.kv_cache_memory_bytes or 'what is left'}, max_model_len {s.max_model_len}", self.fit_rows())]

    def fit_rows(self) -> list[dict[str, object]]:
        """Each node's fit, with what CUDA can allocate now and after 05 stops this runbook's running server."""
        return [{"node": f.node, "ranks": str(f.ranks), "planned GiB": f"{f.planned_gib:.1f}",
                 "weights GiB": f"{f.weights_gib:.1f}", "KV GiB": f"{f.kv_gib:.1f}", "KV tokens": f.kv_tokens,
                 "allocatable now GiB": f"{f.allocatable_now_gib:.1f}",
                 "held by our running server GiB": f"{f.held_gib:.1f} (run {f.held_by})" if f.held_by else "-",
                 "allocatable after its stop GiB": f"{f.allocatable_gib:.1f}", "fits": "yes" if f.fits else "NO",
                 "why": f.why, "allocatable from": f.allocatable_source} for f in self.fit]

    def layouts_shown(self) -> list[Shown]:
        """Each layout with the KV cache it leaves, and the one that fits best for many requests."""
        return [Shown("Layouts that fit: the plan's split, one replica per node, expert parallel", [
            f.row() for f in self.layouts]), Shown("What that means", layoutfit.verdict(self.layouts))]

    def shown(self) -> list[Shown]:
        return [Shown(f"Memory fit of {self.model.architectures[0] if self.model.architectures else 'the model'} "
                      f"({modelinfo.human_params(self.model.total_params)} parameters)", self.fit_rows()),
                *self.layouts_shown()]


def preview(ctx: Context) -> DiagnosePreview:
    """Every node's facts and the model's files (in parallel), the model's facts from one copy, the fit."""
    facts, files = checks.facts_all(ctx), checks.model_files_all(ctx)
    source = checks.config_source(files, ctx.params.head.name)
    model = modelinfo.model_facts(source.config or {}, source.index, source.file_sizes, source.dir)
    server = topology.live_server(ctx.params, ctx.cluster, ctx.runtime)
    memory = checks.fit_memory({n: o.value.memory for n, o in facts.items() if o.value is not None}, server)
    return DiagnosePreview(facts, files, source, model, memory, modelinfo.memory_fit(model, ctx.params, memory),
                           layoutfit.layout_fits(model, ctx.params, memory),
                           (model, checks.diagnosis([], None, model.architectures[0], memory)))


@dataclass(kw_only=True)
class DiagnoseOutcome(StageOutcome):
    """What 02 found beside its preview: the links, the installed image's probe (or why none), every finding, the
    Diagnosis, the blockers a later stage resolves."""

    links: dict[str, Outcome[list[Link]]]
    probe: RegistryProbe | None
    no_probe: str  # why the installed image was not probed (shown where probe is None)
    probe_source: str
    findings: list[Finding]
    diagnosis: Diagnosis

    def links_shown(self, ctx: Context) -> list[Shown]:
        rows = [link for o in self.links.values() if o.value is not None for link in o.value]
        return [Shown(f"Fabric links (MTU {ctx.params.fabric.mtu}, TCP to port {ctx.params.ray.port})",
                      rows or "no links tested")]

    def probe_shown(self, architecture: str) -> list[Shown]:
        if self.probe is None:
            return [Shown("The installed image: not probed", self.no_probe)]
        return [Shown(f"Does {self.probe.image} register {architecture}? (from {self.probe_source})", self.probe)]

    def findings_shown(self) -> list[Shown]:
        return [Shown("Findings", self.findings), Shown("The question 03 must answer", self.diagnosis.question_for_03)]

    def gate_shown(self) -> list[Shown]:
        return [Shown("Blockers a later stage resolves (they do not stop 02)",
                      checks.left_to_later(self.findings) or "none")]


def run(ctx: Context, preview: DiagnosePreview, *, proceed_despite_blockers: bool,
        images_before: Mapping[str, ProbedBefore]) -> DiagnoseOutcome:
    """The links, the installed image's probe (01's OldDeployment where params name no image), the findings (with
    each image tag that names another image than the cluster's last run recorded: `images_before`, from
    records.earlier.images_before, the notebook's `session.images_before()`) and the Diagnosis; then the gate: a
    blocker no later stage resolves is the error, unless overridden (a decision)."""
    links = checks.links_all(ctx)
    old = ctx.handoffs.get(OldDeployment)
    found = old.images if old else None  # None: 01 did not run here; only runtime.installed_image can name it
    architecture = preview.model.architectures[0]
    probe = imageprobes.probe_installed(ctx, architecture, found)
    no_probe = imageprobes.no_installed_reason(ctx, found)
    findings = (checks.node_findings(preview.facts, ctx.params) + checks.link_findings(links, ctx.params)
                + checks.model_findings(preview.files) + checks.speculation_findings(preview.model, ctx.params)
                + checks.fit_findings(preview.fit) + layoutfit.layout_findings(preview.layouts, ctx.params)
                + [checks.image_finding(probe, no_probe)] + imageids.moved_tags(ctx, images_before))
    diagnosis = checks.diagnosis(findings, probe, architecture, preview.memory)
    out = DiagnoseOutcome(links=links, probe=probe, no_probe=no_probe,
                          probe_source=imageprobes.installed_source(ctx, probe), findings=findings,
                          diagnosis=diagnosis, handoffs=[preview.model, diagnosis])
    out.event("memory_fit", preview.fit)  # what counted free, the running server's share with the run it serves
    out.event("layout_fit", preview.layouts)
    try:
        override = checks.gate(findings, ctx.params, proceed_despite_blockers)
    except SparkbookError as exc:  # Blocked: every stopping blocker, each with what to do
        out.error = exc
        return out
    if override:
        out.decide(override)
    return out
