"""05's answers checked at depth, after the smoke test: the known answers and the agreement with the reference of
this model and plan (core.analysis.quality, core.cluster.qualityapi), as 05's decision and evidence; the first ok run
returns its greedy tokens as the new reference (the notebook keeps it beside the cluster's runs), a later one below
serve.quality.min_agreement fails naming the prompt and the first diverging position."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from ...core.analysis.quality import Reference, answers_verdict, known_answers_skipped, reference_key, settings_shown
from ...core.cluster.context import Context
from ...core.cluster.qualityapi import QualityReport, check, load_reference
from ...core.values.evidence import Alternative, Decision, now
from ...core.values.rundir import quality_reference
from .commands import ServeError, ServePlan

QUESTION = "What are 05's answers checked against?"


@dataclass(frozen=True)
class AnswerChecks:
    """The checks' report, the reference this run's greedy tokens make (None: it compared with one, or failed) and
    where the notebook keeps it, and the failure that stops 05 (None: none)."""

    report: QualityReport
    new_reference: Reference | None
    recorded: Path | None  # outputs/<cluster>/quality/<key>.json, where the session writes new_reference
    problem: str | None

    @property
    def remediation(self) -> str:
        if answers_verdict(self.report.answers):
            return ("a model that loses a fact at depth: check serve.max_model_len against the model's trained "
                    "context (and its rope scaling), the KV cache dtype, the chat template and the attention backend")
        return ("the served model answers differently from the reference's run: compare the image, the weights and "
                "the dtype or quantization with it (a changed or corrupted weight, a broken kernel, a new image "
                "writing token soup); remove outputs/<cluster>/quality/<key>.json only when the change is intended")

    def rows(self) -> list[dict[str, object]]:
        return [{"prompt": a.prompt, "compared": a.compared, "identical": a.identical, "share": f"{a.share:.0%}",
                 "first divergence": "none" if a.first_divergence is None else a.first_divergence,
                 "largest logprob gap": a.largest_gap, "at": a.gap_at} for a in self.report.agreements]

    def event(self) -> dict[str, object]:
        """What events.jsonl keeps: the verdicts and figures, not the token ids (those are the reference file's)."""
        r = self.report
        return {"checked": True, "key": r.key, "window": r.window, "known_answers_skipped": r.skipped,
                "answers": [a.row() for a in r.answers], "reference": None if r.reference is None else {
                    "run": r.reference.run, "at": r.reference.at, "image": r.reference.image},
                "agreement": self.rows(), "recorded": str(self.recorded) if self.recorded else None,
                "problem": self.problem, "seconds": round(r.seconds, 1)}

    def summary(self) -> str:
        r = self.report
        known = f"skipped ({r.skipped})" if r.skipped else f"{len(r.answers)} depths answered"
        agreed = (f"agrees with run {r.reference.run}'s reference" if r.reference else
                  f"recorded as the reference ({self.recorded.name})" if self.recorded else "no reference recorded")
        return f"known answers {known}; {agreed}" if self.problem is None else f"failed: {self.problem}"


def model_identity(ctx: Context) -> str:
    return ctx.params.model.path or str(ctx.params.model.hf_id)


def decision(ctx: Context, plan: ServePlan, image: str, reference: Reference | None, key: str) -> Decision:
    """Against what the answers are checked: the reference of an earlier run of this model and plan, or none yet
    (this run's greedy tokens become it when 05 passes)."""
    evidence = [f"model {model_identity(ctx)}", f"reference key {key} (core.analysis.quality.reference_key)",
                *(f"{k}: {v}" for k, v in settings_shown(plan.settings.quality).items())]
    if reference is not None:
        same = "the same image" if reference.image == image else f"image {reference.image} then, {image} now"
        return Decision(QUESTION, f"the reference of run {reference.run}",
                        f"run {reference.run} recorded this model and plan's greedy tokens at {reference.at} ({same}); "
                        "a share of identical top-1 tokens below serve.quality.min_agreement fails 05",
                        [Alternative("record a new reference", "one exists for this model and plan: replacing it "
                                     "would hide the change it is there to catch")], evidence, key="quality")
    return Decision(QUESTION, "none yet: this run's greedy tokens become the reference",
                    "no earlier ok run of this model and plan recorded its greedy tokens; they are recorded when "
                    "05's checks pass, and later runs compare with them",
                    [Alternative("compare with another plan's reference", "a changed dtype, parallel size, window or "
                                 "quantization changes greedy tokens by design")], evidence, key="quality")


def planned(ctx: Context, plan: ServePlan) -> dict[str, object]:
    """What the checks will do, for the preview: off, or the settings, the known answers' skip and the reference."""
    check = plan.settings.quality
    if not check.enabled:
        return {"checked": "no: serve.quality.enabled is false"}
    key, reference = reference_for(ctx, plan)
    return {**settings_shown(check), "known answers": known_answers_skipped(plan.settings) or "asked at each depth",
            "reference": f"run {reference.run}'s ({key})" if reference else f"none yet for {key}: this run records it"}


def reference_for(ctx: Context, plan: ServePlan) -> tuple[str, Reference | None]:
    key = reference_key(plan.settings, model_identity(ctx), plan.model_dir)
    return key, load_reference(ctx.run_dir, key)


def run_checks(ctx: Context, plan: ServePlan, image: str, key: str, reference: Reference | None) -> AnswerChecks:
    """Both checks against the serving plan's API; this run's greedy tokens returned as the reference where there
    was none and they passed."""
    settings = plan.settings
    try:
        report = check(plan.base_url, plan.model, settings, key, reference, settings.smoke_tokens())
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:  # a refused request or a reply unlike vLLM's
        raise ServeError(f"answers checked at depth: the request failed ({type(exc).__name__}: {str(exc)[:300]})",
                         remediation="read the serve log tail in the run's logs/; set serve.quality.enabled: false "
                         "to serve without the checks") from exc
    problem = report.problem(settings.quality.min_agreement)
    if reference is not None or problem is not None:
        return AnswerChecks(report, None, None, problem)
    made = Reference(key, ctx.run_dir.name, now(), image, report.traces)
    return AnswerChecks(report, made, quality_reference(ctx.run_dir, key), problem)


def check_answers(checks: AnswerChecks, *, judged_by_ab: bool = False) -> None:
    """ServeError where the checks failed; `judged_by_ab` (the image A/B's candidate arm): answers that disagree
    with the reference are left to 06's verdict, which then serves the baseline again (lost known answers still
    stop 05: that image is broken, not slower or different)."""
    if checks.problem and not (judged_by_ab and answers_verdict(checks.report.answers) is None):
        raise ServeError(f"answers checked at depth: {checks.problem}", remediation=checks.remediation)


def lowest_agreement(checks: AnswerChecks | None) -> float | None:
    """The lowest share of identical top-1 tokens over the prompts against the reference; 1.0 where these answers
    made the reference (they agree with it by definition); None where nothing was compared."""
    if checks is None:
        return None
    if checks.report.agreements:
        return min(a.share for a in checks.report.agreements)
    return 1.0 if checks.new_reference is not None else None
