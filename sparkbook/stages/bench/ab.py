"""06's A/B (benchmark.ab): the same sweep served by the baseline arm and by the params' own plan, the ratio of
output tok/s at each concurrency against the noise of both arms' repeats, where the two cross, and which
configuration stays serving.

Speculative decoding (ab: speculative) against the plan without it. Acceptance is not speed-up (eugr/spark-vllm-
docker's METRICS.md): a draft accepted 70 % of the time can still make each step slower than it saves, and speculation
usually helps at low concurrency and hurts at high. So the decision is the measured ratio, and speculation must beat
the baseline beyond the noise to stay: it costs memory and brings its own failure modes (MTP with CUDA graphs, vLLM PR
#41834), so a gain nothing measured keeps the plain plan. Decided by default at the lowest concurrency.

The layout (ab: layout): a whole copy of the model on each node behind the router (replicas) against one model split
across the nodes (tp, the baseline: the layout every multi-node plan has served). Splitting makes each token's step
faster where one stream is alone (kubis.ai on two DGX Sparks, gpt-oss-120b: 69.0 tok/s at TP=2 against 57.7 for
replicas), replicas carry more load (567.9 at c=64 against TP=2's 471.7 at c=32). So it is decided by default at the
highest concurrency measured, the load replicas are for, and replicas stay only where they beat tp beyond the noise:
each node then holds the whole model and a KV cache of its own, and a router stands in the path.

The image (ab: image): 03's choice against the image that serves now, the same plan. A newer image has to earn its
place by answers and speed, not by its version (a `:latest` that changed the default executor overnight, newer images
slower or answering differently: eugr#363). It stays where its answers agree with the reference at least as well as
the baseline's (serve.quality.min_agreement, or the baseline's own share where that is lower) and it is not slower
beyond the noise band; an upgrade needs no gain, only no loss. Decided by default at the highest concurrency, the
load the cluster serves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.analysis.benchstats import compare, decode_steps_per_s, repeat_spread
from ...core.values.abarm import BASELINE, AbArm, AbKind, second_arm, serves
from ...core.values.evidence import Alternative, Decision
from ...core.values.handoff import AbAnswers, AbRatio, AbVerdict
from ...core.values.params import Params
from ...core.values.sweeppoint import SweepPoint
from .tables import speculation_columns

THROUGHPUT = "output_throughput"


@dataclass(frozen=True)
class Contest:
    """What one A/B compares, in its own words: the arms' short labels (tables, the crossing), what each serves
    (the decision's options), who gives the second arm's figure, what keeping it costs where its gain is not shown,
    until when later runs measure both arms again, and whether the lowest or the highest concurrency decides by
    default."""

    ab: AbKind  # benchmark.ab
    second: AbArm  # the second arm's name (core.values.abarm)
    labels: tuple[str, str]  # (baseline, second)
    serves: tuple[str, str]  # (baseline, second) in core.values.abarm's words, the second with its settings
    subject: str  # the second arm as the reason's subject: "speculation (ngram, 3 tokens)"
    cost: str
    later: str
    question: str
    decide_highest: bool


def contest(params: Params) -> Contest:
    """The A/B the params ask for (benchmark.ab; its validation guarantees serve.speculative for speculative and
    serve.layout replicas for layout)."""
    if params.benchmark.ab == "layout":
        return Contest("layout", second_arm("layout"), ("tp", "replicas"),
                       (serves("layout", BASELINE), serves("layout", "replicas")),
                       "replicas (a copy per node behind the router)",
                       "no measured gain for each node holding the whole model and its own KV cache, and a router "
                       "in the path", "until the params say serve.layout: tp without benchmark.ab",
                       "Which layout stays serving after the A/B of tp against replicas?", decide_highest=True)
    if params.benchmark.ab == "image":
        return Contest("image", second_arm("image"), ("baseline image", "03's choice"),
                       (serves("image", BASELINE), serves("image", "candidate")), "03's choice of image",
                       "", "until the params change (a later run measures both images again)",
                       "Which image stays serving after the A/B of images?", decide_highest=True)
    spec = params.serve.speculative
    if params.benchmark.ab != "speculative" or spec is None:
        raise ValueError("benchmark.ab: the params ask for no A/B this stage can judge")
    what = f"{spec.method}, {spec.num_speculative_tokens} tokens"
    return Contest("speculative", second_arm("speculative"), ("baseline", "speculative"),
                   (serves("speculative", BASELINE), f"{serves('speculative', 'speculative')} ({what})"),
                   f"speculation ({what})",
                   "no measured gain for the memory it takes and its failure modes",
                   "until the params drop serve.speculative and benchmark.ab",
                   "Which configuration stays serving after the A/B of speculative decoding?", decide_highest=False)


def ratios(baseline: list[SweepPoint], second: list[SweepPoint]) -> list[AbRatio]:
    """Per concurrency both arms measured: second / baseline output tok/s, with the noise band of the comparison of
    two runs (the wider of the two points' spreads over their repeats; none with one repeat)."""
    return [AbRatio(max_concurrency=d.max_concurrency, baseline_tok_s=d.earlier, second_tok_s=d.now,
                    ratio=d.now / d.earlier, noise_pct=d.noise_pct, verdict=d.verdict)
            for d in compare(second, baseline, [THROUGHPUT])]


def crossing(rows: list[AbRatio], c: Contest) -> str | None:
    """Where the arms cross; None where every ratio is on one side of 1. Speculation: the first pair of neighbouring
    concurrencies whose ratios lie on either side of 1 (where it stops, or starts, paying). The layout, in the
    words of the page: the arm that wins above the last such pair, up to the highest concurrency measured ("replicas win
    above c=4"), since above it the same layout wins at every point."""
    pairs = [(a, b) for a, b in zip(rows, rows[1:], strict=False) if (a.ratio > 1) != (b.ratio > 1)]
    if not pairs:
        return None
    if c.ab != "layout":
        a, b = pairs[0]
        return f"between c={a.max_concurrency} ({a.ratio:.2f}x) and c={b.max_concurrency} ({b.ratio:.2f}x)"
    a, b = pairs[-1]
    winner = "replicas win" if b.ratio > 1 else "tp wins"
    return (f"{winner} above c={a.max_concurrency} (replicas / tp {a.ratio:.2f}x at c={a.max_concurrency}, "
            f"{b.ratio:.2f}x at c={b.max_concurrency})")


def _deciding(rows: list[AbRatio], decide_at: int | None, c: Contest) -> AbRatio:
    """The ratio that decides: at `decide_at`, by default the lowest concurrency measured for speculation, the
    highest for the layout and the image."""
    if not rows:
        raise ValueError("the A/B has no concurrency that both arms measured")
    default = rows[-1] if c.decide_highest else rows[0]
    at = next((r for r in rows if r.max_concurrency == decide_at), None) if decide_at is not None else default
    if at is None:
        raise ValueError(f"benchmark.ab_decide_at: c={decide_at} was not measured by both arms")
    return at


def image_verdict(rows: list[AbRatio], decide_at: int | None, c: Contest, answers: AbAnswers,
                  min_agreement: float, images: tuple[str, str]) -> AbVerdict:
    """The image that stays serving: 03's choice where its answers agree with the reference at least as well as the
    baseline's (min_agreement, or the baseline's own share where lower) and it is not slower beyond the noise band
    at `decide_at`; else the baseline image. `images`: (the baseline's, 03's choice) as the reason names them."""
    at = _deciding(rows, decide_at, c)
    base, cand = answers.agreement.get(BASELINE), answers.agreement.get(c.second)
    floor = min_agreement if base is None else min(min_agreement, base)
    band = f"noise band ±{at.noise_pct:.1f} %" if at.noise_pct is not None else "no noise band"
    figures = (f"at c={at.max_concurrency} 03's choice {images[1]} gives {at.second_tok_s:,.1f} against "
               f"{at.baseline_tok_s:,.1f} output tok/s of {images[0]} = {at.ratio:.2f}x, {band}; answers agree "
               f"{_share(cand)} against the baseline's {_share(base)} (needed: {floor:.0%})")
    why_not = [w for w in (
        None if cand is not None and cand >= floor else "its answers agree less than the baseline's",
        "it is slower beyond the noise" if at.verdict == "worse" else
        "one repeat per point measures no noise, so it is not shown to be as fast" if at.verdict == "no noise estimate"
        else None) if w]
    kept = BASELINE if why_not else c.second
    reason = f"{figures}: " + ("as good an answer and not slower: the upgrade stays" if not why_not else
                               "; ".join(why_not) + "; the runbook serves the baseline image again, as `sparkbook up`, "
                               f"`watch` and a rollback do {c.later}")
    return AbVerdict.model_validate({"ab": c.ab, "kept": kept, "reason": reason, "decided_at": at.max_concurrency,
                                     "crossing": crossing(rows, c), "ratios": rows,
                                     "agreement": {BASELINE: base, c.second: cand}})


def _share(agreement: float | None) -> str:
    return "not compared" if agreement is None else f"{agreement:.0%}"


def verdict(rows: list[AbRatio], decide_at: int | None, c: Contest) -> AbVerdict:
    """The configuration that stays serving: the second arm where it beats the baseline beyond the noise band at
    `decide_at` (default the lowest concurrency measured for speculation, the highest for the layout), else the
    baseline."""
    at = _deciding(rows, decide_at, c)
    band = f"noise band ±{at.noise_pct:.1f} %" if at.noise_pct is not None else "no noise band"
    figures = (f"at c={at.max_concurrency} {c.subject} gives {at.second_tok_s:,.1f} against {at.baseline_tok_s:,.1f} "
               f"output tok/s = {at.ratio:.2f}x, {band}")
    why_not = {"worse": "it is slower beyond the noise",
               "within noise": f"its gain is within the noise: {c.cost}",
               "no noise estimate": "one repeat per point measures no noise, so no gain is shown (set "
                                    "benchmark.repeats to 2 or more)"}
    kept = c.second if at.verdict == "better" else BASELINE
    reason = f"{figures}: " + ("faster beyond the noise" if kept != BASELINE else why_not[at.verdict]
                               + f"; the runbook serves the {c.labels[0]} arm again, as `sparkbook up` and a rollback "
                               f"do, and a later run measures both arms again {c.later}")
    return AbVerdict.model_validate({"ab": c.ab, "kept": kept, "reason": reason, "decided_at": at.max_concurrency,
                                     "crossing": crossing(rows, c), "ratios": rows})


def decision(v: AbVerdict, c: Contest) -> Decision:
    """The A/B as a recorded decision: what stays serving, why, the ratio at every concurrency and where the arms
    cross."""
    names = {BASELINE: c.serves[0], c.second: c.serves[1]}
    other = c.second if v.kept == BASELINE else BASELINE
    return Decision(
        question=c.question, choice=names[v.kept], reason=v.reason, key="ab",
        alternatives=[Alternative(names[other], f"decided at c={v.decided_at}: {v.reason}")],
        evidence=[f"c={r.max_concurrency}: {c.labels[1]} / {c.labels[0]} {r.ratio:.2f}x ({r.verdict})"
                  for r in v.ratios] + [v.crossing_words()])


def arm_rows(baseline: list[SweepPoint], second: list[SweepPoint], c: Contest) -> list[dict[str, Any]]:
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
    return [r for p in second if p.max_concurrency in by_c
            for r in (row(c.labels[0], by_c[p.max_concurrency]), row(c.labels[1], p))]


def ratio_rows(v: AbVerdict, c: Contest) -> list[dict[str, Any]]:
    return [{"concurrency": r.max_concurrency, f"{c.labels[1]} / {c.labels[0]}": round(r.ratio, 3),
             "noise band %": None if r.noise_pct is None else round(r.noise_pct, 1), "verdict": r.verdict,
             "decides": "yes" if r.max_concurrency == v.decided_at else ""} for r in v.ratios]
