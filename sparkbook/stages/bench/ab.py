"""06's A/B of speculative decoding (benchmark.ab: speculative): the same sweep served without serve.speculative and
with it, the ratio of output tok/s at each concurrency against the noise of both arms' repeats, where the two
cross, and which configuration stays serving.

Acceptance is not speed-up (eugr/spark-vllm-docker's METRICS.md): a draft accepted 70 % of the time can still make
each step slower than it saves, and speculation usually helps at low concurrency and hurts at high. So the decision is
the measured ratio, and speculation must beat the baseline beyond the noise to stay: it costs memory and brings its
own failure modes (MTP with CUDA graphs, vLLM PR #41834), so a gain nothing measured keeps the plain plan.
"""
from __future__ import annotations

from typing import Any, Literal

from ...core.benchstats import compare, decode_steps_per_s, repeat_spread
from ...core.evidence import Alternative, Decision
from ...core.handoff import AbRatio, AbVerdict
from ...core.params import Speculative
from ...core.sweeppoint import SweepPoint
from .tables import speculation_columns

THROUGHPUT = "output_throughput"


def ratios(baseline: list[SweepPoint], speculative: list[SweepPoint]) -> list[AbRatio]:
    """Per concurrency both arms measured: speculative / baseline output tok/s, with the noise band of the
    comparison of two runs (the wider of the two points' spreads over their repeats; none with one repeat)."""
    return [AbRatio(max_concurrency=d.max_concurrency, baseline_tok_s=d.earlier, speculative_tok_s=d.now,
                    ratio=d.now / d.earlier, noise_pct=d.noise_pct, verdict=d.verdict)
            for d in compare(speculative, baseline, [THROUGHPUT])]


def crossing(rows: list[AbRatio]) -> str | None:
    """Where speculation stops (or starts) paying: between the two neighbouring concurrencies whose ratios lie on
    either side of 1; None where every ratio is on one side."""
    for a, b in zip(rows, rows[1:], strict=False):
        if (a.ratio > 1) != (b.ratio > 1):
            return (f"between c={a.max_concurrency} ({a.ratio:.2f}x) and c={b.max_concurrency} ({b.ratio:.2f}x)")
    return None


def verdict(rows: list[AbRatio], decide_at: int | None, spec: Speculative) -> AbVerdict:
    """The configuration that stays serving: speculation where it beats the baseline beyond the noise band at
    `decide_at` (default the lowest concurrency measured), else the baseline."""
    if not rows:
        raise ValueError("the A/B has no concurrency that both arms measured")
    at = next((r for r in rows if r.max_concurrency == decide_at), None) if decide_at is not None else rows[0]
    if at is None:
        raise ValueError(f"benchmark.ab_decide_at: c={decide_at} was not measured by both arms")
    band = f"noise band ±{at.noise_pct:.1f} %" if at.noise_pct is not None else "no noise band"
    figures = (f"at c={at.max_concurrency} speculation ({spec.method}, {spec.num_speculative_tokens} tokens) gives "
               f"{at.speculative_tok_s:,.1f} against {at.baseline_tok_s:,.1f} output tok/s = {at.ratio:.2f}x, {band}")
    why_not = {"worse": "it is slower beyond the noise",
               "within noise": "its gain is within the noise: no measured gain for the memory it takes and its "
                               "failure modes",
               "no noise estimate": "one repeat per point measures no noise, so no gain is shown (set "
                                    "benchmark.repeats to 2 or more)"}
    kept: Literal["baseline", "speculative"] = "speculative" if at.verdict == "better" else "baseline"
    reason = f"{figures}: " + ("faster beyond the noise" if kept == "speculative" else why_not[at.verdict]
                               + "; the runbook serves the baseline again, and later runs and `sparkbook up` serve "
                               "it once serve.speculative is removed from the params")
    return AbVerdict(kept=kept, reason=reason, decided_at=at.max_concurrency, crossing=crossing(rows), ratios=rows)


def decision(v: AbVerdict, spec: Speculative) -> Decision:
    """The A/B as a recorded decision: what stays serving, why, and the ratio at every concurrency."""
    other = "baseline" if v.kept == "speculative" else "speculative"
    names = {"speculative": f"with speculation ({spec.method}, {spec.num_speculative_tokens} tokens)",
             "baseline": "without speculation"}
    return Decision(
        question="Which configuration stays serving after the A/B of speculative decoding?",
        choice=names[v.kept], reason=v.reason, key="ab",
        alternatives=[Alternative(names[other], f"decided at c={v.decided_at}: {v.reason}")],
        evidence=[f"c={r.max_concurrency}: {r.ratio:.2f}x ({r.verdict})" for r in v.ratios]
        + [f"the ratio crosses 1 {v.crossing}" if v.crossing else "the ratio does not cross 1"])


def arm_rows(baseline: list[SweepPoint], speculative: list[SweepPoint]) -> list[dict[str, Any]]:
    """Both arms' figures at each concurrency, one row per arm: output tok/s with its repeats' range, the decode
    steps per second, TPOT and what speculation did."""
    def row(arm: str, p: SweepPoint) -> dict[str, Any]:
        steps, tput = decode_steps_per_s(p), repeat_spread(p, THROUGHPUT)
        return {"concurrency": p.max_concurrency, "arm": arm,
                "output tok/s": None if p.output_throughput is None else round(p.output_throughput, 1),
                "tok/s min-max": f"{tput.low:,.1f}-{tput.high:,.1f}" if tput else None,
                "decode steps/s": None if steps is None else round(steps, 1),
                "TPOT ms p50": None if p.median_tpot_ms is None else round(p.median_tpot_ms, 2),
                "TTFT ms p50": None if p.median_ttft_ms is None else round(p.median_ttft_ms, 1),
                **speculation_columns(p)}
    by_c = {p.max_concurrency: p for p in baseline}
    return [r for p in speculative if p.max_concurrency in by_c
            for r in (row("baseline", by_c[p.max_concurrency]), row("speculative", p))]


def ratio_rows(v: AbVerdict) -> list[dict[str, Any]]:
    return [{"concurrency": r.max_concurrency, "speculative / baseline": round(r.ratio, 3),
             "noise band %": None if r.noise_pct is None else round(r.noise_pct, 1), "verdict": r.verdict,
             "decides": "yes" if r.max_concurrency == v.decided_at else ""} for r in v.ratios]
