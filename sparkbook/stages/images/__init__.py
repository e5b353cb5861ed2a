"""03, image selection: choose the image (choice), put it on every node (distribute, with the layer delta of
layerdelta), and put the model on every node (modelcopy); a moving tag and the pull (tags).

The front door: `preview(ctx)` (the model target, the nodes' facts, the candidates in the order 03 probes them, the
policy and the installed image, the copy plan and the facts of the candidate tried first: read-only probes and one
throwaway container of that candidate, as 03 probes each) and `run(ctx, preview)`, which probes, decides,
distributes and copies the model, and returns its evidence."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ...core.cluster.context import Context
from ...core.cluster.nodes import NodeError
from ...core.values import rundir
from ...core.values.abarm import changes_image
from ...core.values.errors import SparkbookError
from ...core.values.evidence import Decision, ProbedBefore, Shown, StageOutcome
from ...core.values.handoff import AbBaseline, Diagnosis, ImageChoice
from ...core.values.modelinfo import ModelFacts
from ...core.values.state import Handoff
from . import abbase, choice, distribute, memo, modelcopy, tags
from .choice import Candidate, ImageFacts, ModelTarget
from .distribute import Distribution, ImageCopyPlan
from .modelcopy import ModelCopy
from .tags import Pulled, TagHistory


# --- preview ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImagesPreview:
    """What 03 would do: the model it probes for, what the nodes need (compute capabilities, CPU architectures),
    the candidates in the order it probes them (pulled first where runtime.pull), the policy and the installed
    image it decides by, and the copy plan and facts of the candidate it tries first; `assumed` is that candidate
    as an ImageChoice (03 chooses by probing: `sparkbook plan` shows the stages after it for this one), its vLLM and
    Ray as its facts read them, unknown (None) where it was not probed (first_facts says why)."""

    target: ModelTarget
    capabilities: dict[str, list[str]]
    machines: dict[str, str]
    candidates: list[str]
    pull: bool  # runtime.pull: `docker pull` of each candidate on the head before the probes
    policy: str
    installed: str | None
    no_installed: str | None  # why there is no installed image (None where there is one)
    copy: ImageCopyPlan | None  # None: no copy plan, `copy_unknown` says why
    copy_unknown: str | None
    head: str
    facts: ImageFacts | None  # the first candidate's, probed on the head; None: `facts_unknown` says why
    facts_unknown: str | None
    assumed: tuple[Handoff, ...] = ()

    @property
    def first(self) -> str:
        return self.candidates[0]

    def shown(self) -> list[Shown]:
        return [Shown("What the probes test", self.target_row()),
                Shown(f"Candidates, in the order 03 probes them on {self.head}", self.candidate_rows()),
                Shown("Image policy", {"runtime.image_policy": self.policy,
                                       "installed image": self.installed or f"none: {self.no_installed}"}),
                *self.copy_shown(), self.facts_shown(),
                Shown("What 03 hands on, as far as the preview tells", self.assumed_text())]

    def target_row(self) -> dict[str, object]:
        caps = str(self.capabilities or "no GPUs in params: no CUDA architecture check")
        return {**vars(self.target), "GPU compute capabilities": caps, "CPU architectures": str(self.machines)}

    def candidate_rows(self) -> list[dict[str, object]]:
        return [{"order": i, "image": ref, "pulled first": f"docker pull {ref}" if self.pull else "no (runtime.pull)",
                 "installed": "yes" if ref == self.installed else "-"} for i, ref in enumerate(self.candidates, 1)]

    def copy_shown(self) -> list[Shown]:
        p = self.copy
        if p is None:
            return [Shown(f"Image copy of {self.first}", f"not known before a run: {self.copy_unknown}")]
        return [Shown(f"Image copy of {p.image} ({p.size_bytes / 1e9:.2f} GB) from {p.source}, if it is chosen",
                      [{"node": n, "holds": held or "nothing", "action": "copy from the head over the fabric"
                        if n in p.to_copy else "already held: nothing copied"} for n, held in p.held.items()])]

    def facts_shown(self) -> Shown:
        f = self.facts
        title = f"What {self.first} holds (a throwaway container of it on {self.head}, as 03 probes it)"
        if f is None:
            return Shown(title, f"not known: {self.facts_unknown}")
        torch = f"{f.torch_version} ({f.torch_cuda or 'cpu'})" if f.torch_version else "none"
        return Shown(title, {"vLLM": f.vllm_version or "none: 03 finds it unusable", "torch (CUDA)": torch,
                             "Ray": f.ray or "none (the module and the ray CLI)"})

    def assumed_text(self) -> str:
        held = f"the head holds it as {self.copy.image_id[:19]}" if self.copy else "its ID is not known yet"
        return (f"03 chooses by probing every candidate (runtime.image_policy {self.policy}); {self.first} is the "
                f"candidate it tries first ({held}): the stages after 03 are previewed for it")


def preview(ctx: Context) -> ImagesPreview:
    """The model target (02's ModelFacts, else config.json on the head), the nodes' facts, the candidates, the
    policy with the installed image (runtime.installed_image, else the one 02 probed) and the copy plan of the
    first candidate. Read-only: nvidia-smi, uname, image IDs; no probe container is started."""
    target = choice.model_target(ctx, ctx.handoffs.get(ModelFacts))
    diagnosis = ctx.handoffs.get(Diagnosis)
    probed = diagnosis.installed_image if diagnosis else None
    policy, installed = choice.image_policy(ctx, probed.image if probed else None)
    refs = choice.candidate_refs(ctx)
    plan, unknown = copy_plan(ctx, refs[0])
    facts, facts_unknown = first_facts(ctx, refs[0], target)
    return ImagesPreview(target, choice.compute_capabilities(ctx), choice.node_machines(ctx), refs, ctx.images.pulls,
                         policy, installed, None if installed else ctx.images.no_installed_reason(), plan, unknown,
                         ctx.head.name, facts, facts_unknown, (first_choice(refs[0], facts, plan),))


def first_facts(ctx: Context, ref: str, target: ModelTarget | None = None) -> tuple[ImageFacts | None, str | None]:
    """(The facts of the candidate 03 tries first, None), probed as 03 probes it (a throwaway container on the
    head), or as an earlier run kept them for this image ID and `target` (images.memo); or (None, why not): the
    head does not hold it yet, or its probe did not answer."""
    lacking = ctx.runtime.lacks(ctx.head, ref)
    if lacking is not None:
        return None, f"{ctx.head.name} {lacking}" + ("; 03 pulls it before its probes" if ctx.images.pulls else "")
    kept = memo.recall(ctx, ref, target)[0] if target else None
    facts = kept.value.facts if kept else choice.probe_facts(ctx, ref)
    return (None, f"its probe did not answer: {facts.error}") if facts.error else (facts, None)


def first_choice(ref: str, facts: ImageFacts | None, plan: ImageCopyPlan | None) -> ImageChoice:
    """The candidate 03 tries first as the ImageChoice it would hand on: its vLLM and Ray as probed (both None
    where it was not: not known, see ImageChoice.probed); its ID where the head holds it."""
    return ImageChoice(ref=ref, id=plan.image_id if plan else None, vllm_version=facts.vllm_version if facts else None,
                       ray_version=facts.ray if facts else None, nodes={})


def copy_plan(ctx: Context, ref: str) -> tuple[ImageCopyPlan | None, str | None]:
    """(distribute.plan of `ref`, None), or (None, why there is none): the Python runtime copies nothing, and a
    head that does not hold `ref` yet (runtime.pull fetches it in the run) has no copy to plan."""
    if not ctx.images.copies_images:
        return None, "runtime python: no image to copy, each node runs its own environment"
    try:
        return distribute.plan(ctx, ref), None
    except NodeError as exc:
        return None, str(exc)


# --- run -------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ImagesOutcome(StageOutcome):
    """What 03 did: the pull, every candidate's probes and the tag history, the choice, the distribution, the
    model copy and the ImageChoice. A field is None where 03 stopped before its step (outcome.error says why)."""

    head: str
    pulled: list[Pulled] | None = None  # None: runtime.pull is off
    candidates: list[Candidate] = field(default_factory=list)
    history: dict[str, TagHistory] = field(default_factory=dict)
    moved: list[str] = field(default_factory=list)  # the warnings of tags that name another image than before
    recalled: list[str] = field(default_factory=list)  # candidates whose probes an earlier run's answers stand for
    refused: list[str] = field(default_factory=list)  # kept answers not trusted (the image was probed again)
    decision: Decision | None = None
    copied: Distribution | None = None
    model_copy: ModelCopy | None = None
    image: ImageChoice | None = None
    ab_baseline: AbBaseline | None = None  # benchmark.ab image: the baseline arm's image, or why there is none

    def _stopped(self, title: str) -> list[Shown]:
        why = self.error.message if self.error else "not reached"
        return [Shown(title, f"03 stopped at or before this step: {why}")]

    def candidates_shown(self) -> list[Shown]:
        shown = [] if self.pulled is None else [Shown(f"docker pull on {self.head} (runtime.pull)", self.pulled)]
        shown.append(Shown(f"Candidate images on {self.head}", choice.rows(self.candidates, self.history)))
        if self.moved:
            shown.append(Shown("WARNING: a candidate's tag names another image than at the last run", self.moved))
        if self.recalled or self.refused:
            shown.append(Shown("Probes kept by image ID and model (outputs/<cluster>/learned/)",
                               [*self.recalled, *self.refused]))
        return shown

    def failures_shown(self) -> list[Shown]:
        return [Shown("Registered, yet it fails inspection", choice.failure_reports(self.candidates))]

    def decision_shown(self) -> list[Shown]:
        d = self.decision
        if d is None:
            return self._stopped("Decision")
        return [Shown(f"Decision — {d.question}", {"chosen": d.choice, "reason": d.reason}),
                Shown("Not chosen", [{"image": a.option, "because": a.rejected_because} for a in d.alternatives]
                      or "no other candidate"),
                *([Shown("The A/B's baseline image (benchmark.ab image)", {
                    "baseline": self.ab_baseline.image.ref if self.ab_baseline.image else "none",
                    "why": self.ab_baseline.reason})] if self.ab_baseline else [])]

    def distribution_shown(self) -> list[Shown]:
        if self.copied is None:
            return self._stopped("Image distribution")
        return [Shown(self.copied.message, self.copied.rows())]

    def model_copy_shown(self) -> list[Shown]:
        if self.model_copy is None:
            return self._stopped("Model copy")
        return [Shown(self.model_copy.message, self.model_copy.rows())]

    def image_shown(self) -> list[Shown]:
        if self.image is None:
            return self._stopped("image (state.json)")
        return [Shown("image (state.json)", self.image)]

    def summary_shown(self) -> list[Shown]:
        if self.decision is None or self.copied is None or self.model_copy is None:
            return self._stopped("03 summary")
        return [Shown("03 summary", choice.summary(self.candidates, self.decision,
                                                   f"{self.copied.message}; model: {self.model_copy.message}"))]


def run(ctx: Context, preview: ImagesPreview, *, probed_before: Mapping[str, ProbedBefore],
        serving: ImageChoice | None = None) -> ImagesOutcome:
    """Pull (runtime.pull), probe every candidate, decide by the preview's policy, put the chosen image on every
    node and the model beside it, and hand on the ImageChoice (with benchmark.ab image, the A/B's baseline beside
    it). A failure ends it as outcome.error, after the evidence gathered so far. `probed_before`: the image ID
    earlier runs probed under each candidate's name (records.earlier.probed_before; the notebook's
    `session.probed_before(...)`), so a moved tag warns; `serving`: the image of the cluster's deployment
    (`session.serving_image()`), the image A/B's baseline."""
    out = ImagesOutcome(head=preview.head)
    if preview.pull:
        out.pulled = tags.pull(ctx, preview.candidates)
        out.event("image_pull", out.pulled)
    evaluated = [memo.evaluate(ctx, ref, preview.target, preview.capabilities, preview.machines)
                 for ref in preview.candidates]
    out.candidates = [e.candidate for e in evaluated]
    out.recalled = [line for e in evaluated if (line := e.line())]
    out.refused = [e.refused for e in evaluated if e.refused]
    out.learned.extend(e.learned for e in evaluated if e.learned)
    for e in evaluated:
        out.event("image_probe", e.candidate)
        if e.recalled or e.refused:
            out.event("image_probe_recalled", {"image": e.candidate.image, "recalled": e.line(),
                                               "refused": e.refused})
    out.logs = choice.inspection_logs(out.candidates)
    evidence = [str(ctx.run_dir / rundir.LOGS / name) for name in out.logs]
    out.history = tags.tag_history({c.image: c.facts.image_id for c in out.candidates}, probed_before)
    out.moved = [w for h in out.history.values() if (w := h.warning())]
    try:
        out.error = decide(ctx, preview, out, [*evidence, *out.moved])
        if out.error is None and out.image is not None and changes_image(ctx.params.benchmark.ab):
            chosen = abbase.baseline(ctx, out.image, serving, preview.installed, out.candidates,
                                     lambda ref: memo.evaluate(ctx, ref, preview.target, preview.capabilities,
                                                               preview.machines))
            out.ab_baseline = chosen.handoff
            out.decide(chosen.decision)
            out.learned.extend(chosen.learned)
            out.handoffs.append(chosen.handoff)
    except SparkbookError as exc:  # no usable image; a node that cannot be read or copied to
        out.error = exc
    return out


def decide(ctx: Context, preview: ImagesPreview, out: ImagesOutcome, evidence: list[str]) -> SparkbookError | None:
    """The choice, the distribution and the model copy, each recorded in `out`; the error that stops 03 there."""
    installed_ids = distribute.image_ids(ctx, preview.installed) if preview.installed else {}
    decision = out.decide(choice.choose(out.candidates, evidence, preview.policy, preview.installed, installed_ids))
    out.decision = decision
    copied = out.copied = distribute.distribute(ctx, decision.choice)
    out.event("distribution", copied)
    if not copied.verified:
        return distribute.NotDistributed(copied.message)
    model_copy = out.model_copy = modelcopy.copy_model(ctx)
    out.event("model_copy", model_copy)
    if not model_copy.verified:
        return modelcopy.ModelCopyError(model_copy.message)
    out.image = choice.image_state(out.candidates, decision.choice, copied.ids)
    out.handoffs.append(out.image)
    return None

