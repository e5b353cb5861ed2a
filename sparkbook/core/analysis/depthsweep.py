"""06's context-depth axis and its prefix-cache pair as typed values, their file in the run dir (bench/depth.json)
and the comparison of two runs' depth figures. Core, because 06 writes them and the records read and compare them.

Depth is llama-benchy's: `depth` tokens of context before a prompt of `input_len` tokens, `output_len` tokens
generated, one stream. Its decode rate is llama-benchy's tg t/s, (output tokens - 1) / (last token - first token);
its prefill rate is llama-benchy's pp t/s, (depth + input_len) / TTFT, with vLLM's TTFT (request sent -> first
token) where llama-benchy subtracts an estimated latency first. Every depth's prompts are fresh random tokens, so
no cached prefix shortens them (llama-benchy without --enable-prefix-caching). The prefix-cache pair is two
requests that share their first `prefix_tokens` tokens and differ after: the second's TTFT against the first's is
what a cached prefix saves (llama-benchy's ctx_pp step, then the prompt over the cached context).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..values.rundir import BENCH
from .benchstats import ACROSS_SETUPS, RequestRecord, spread_band_pct

DEPTH_FILE = "depth.json"
HITS = "vllm:prefix_cache_hits_total"  # tokens the server took from its prefix cache (vLLM V1)
QUERIES = "vllm:prefix_cache_queries_total"  # tokens it looked up there (none where prefix caching is off)
CACHED_BELOW = 0.5  # without the counters: a second TTFT under this share of the first's suggests a cached prefix
DEPTH_METRICS = (("ttft_ms", False), ("decode_tok_s", True))  # (figure, higher is better)


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DepthPoint(_Model):
    """One depth of the sweep: medians over its repeats (one request each), and each repeat's figures."""

    depth: int
    input_len: int
    output_len: int
    prompt_tokens: int | None  # what the server counted (usage): depth + input_len when it took the prompt whole
    ttft_ms: float | None
    decode_tok_s: float | None
    prefill_tok_s: float | None
    ttft_ms_repeats: list[float] = []
    decode_tok_s_repeats: list[float] = []
    errors: list[str] = []

    def figure(self, name: str) -> float | None:
        return {"ttft_ms": self.ttft_ms, "decode_tok_s": self.decode_tok_s}[name]

    def repeats(self, name: str) -> list[float]:
        return {"ttft_ms": self.ttft_ms_repeats, "decode_tok_s": self.decode_tok_s_repeats}[name]


class PrefixCachePair(_Model):
    """The same prefix sent twice (different suffixes): both TTFTs, the server's cache lookups and hits over the
    second request, and what its command line says of prefix caching. The counters decide what happened: vLLM can
    turn prefix caching off whatever the argv says (its CPU build does for an MLA model, the lab's), and a TTFT
    ratio alone moves with the noise of a shared machine."""

    prefix_tokens: int
    suffix_tokens: int
    first_ttft_ms: float | None
    second_ttft_ms: float | None
    cached_tokens: int | None  # the rise of vllm:prefix_cache_hits_total over the second request (None: no counter)
    queried_tokens: int | None = None  # the rise of vllm:prefix_cache_queries_total over it (None: no counter)
    server_setting: str  # what the server's argv says (on, off, or vLLM's default)
    errors: list[str] = []

    @property
    def ratio(self) -> float | None:
        """Second TTFT / first TTFT: near 1 without reuse, well below 1 with the prefix served from the cache."""
        if not self.first_ttft_ms or self.second_ttft_ms is None:
            return None
        return self.second_ttft_ms / self.first_ttft_ms

    def verdict(self) -> str:
        """The pair said plainly: the ratio, what the server's counters say it did, and its argv's setting."""
        if self.ratio is None:
            return f"not measured: {'; '.join(self.errors) or 'no TTFT'}"
        return (f"the second request's TTFT was {self.ratio:.2f}x the first's ({self.second_ttft_ms:,.1f} ms against "
                f"{self.first_ttft_ms:,.1f} ms, {self.prefix_tokens} shared tokens): {self.reuse()}; prefix caching "
                f"on the server's command line: {self.server_setting}")

    def reuse(self) -> str:
        """What the server did with the prefix, from its counters where it has them, else from the ratio."""
        if self.cached_tokens:
            return f"the server served {self.cached_tokens} of its tokens from its prefix cache"
        if self.queried_tokens == 0:
            return "the server looked nothing up in a prefix cache: prefix caching is off on it"
        if self.queried_tokens:
            return f"prefix caching is on (the server looked up {self.queried_tokens} tokens) but none was cached"
        return ("the ratio suggests a cached prefix" if self.ratio is not None and self.ratio < CACHED_BELOW else
                "no reuse of the prefix is visible") + " (the server has no prefix-cache counters to say)"


class DepthSweep(_Model):
    """bench/depth.json: the depth points in order and the prefix-cache pair (None: no depth above 0)."""

    points: list[DepthPoint]
    prefix_cache: PrefixCachePair | None
    prefix_cache_note: str | None = None  # why there is no pair


def depth_file(bench_root: Path) -> Path:
    return bench_root / BENCH / DEPTH_FILE


def write(bench_root: Path, sweep: DepthSweep) -> Path:
    path = depth_file(bench_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(sweep.model_dump_json(indent=1))
    return path


def read(run_dir: Path) -> DepthSweep | None:
    """The run's depth sweep (None: 06 measured none there, or the file cannot be read)."""
    try:
        return DepthSweep.model_validate_json(depth_file(run_dir).read_text())
    except (OSError, ValueError):
        return None


# --- figures from the requests --------------------------------------------------------------------
def decode_tok_s(record: RequestRecord) -> float | None:
    """llama-benchy's tg t/s for one request: (output tokens - 1) / (last token - first token)."""
    if not record.ok or record.output_tokens < 2 or record.ttft_s is None or record.e2el_s is None \
            or record.e2el_s <= record.ttft_s:
        return None
    return (record.output_tokens - 1) / (record.e2el_s - record.ttft_s)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def depth_point(depth: int, input_len: int, output_len: int, records: list[RequestRecord]) -> DepthPoint:
    """A depth's figures from its repeats' requests: medians of TTFT, decode and prefill rate; failures named."""
    ok = [r for r in records if r.ok and r.ttft_s is not None]
    ttfts = [1000.0 * r.ttft_s for r in ok if r.ttft_s is not None]
    decodes = [d for r in ok if (d := decode_tok_s(r)) is not None]
    ttft = _median(ttfts)
    return DepthPoint(depth=depth, input_len=input_len, output_len=output_len,
                      prompt_tokens=next((r.prompt_tokens for r in ok if r.prompt_tokens is not None), None),
                      ttft_ms=ttft, decode_tok_s=_median(decodes),
                      prefill_tok_s=(depth + input_len) / (ttft / 1000.0) if ttft else None,
                      ttft_ms_repeats=ttfts, decode_tok_s_repeats=decodes,
                      errors=[r.error for r in records if not r.ok])


def prefix_setting(argv: list[str]) -> str:
    """What a `vllm serve` argv says of prefix caching: the last of its flags wins, as in argparse."""
    flags = [a for a in argv if a.split("=", 1)[0] in ("--enable-prefix-caching", "--no-enable-prefix-caching")]
    if not flags:
        return "not set on the command line (vLLM's default: on)"
    on = flags[-1].split("=", 1)[0] == "--enable-prefix-caching" and \
        flags[-1].partition("=")[2].lower() not in ("false", "0")
    return f"{'on' if on else 'off'} ({flags[-1]} on the command line)"


def prefix_pair(prefix_tokens: int, suffix_tokens: int, first: RequestRecord, second: RequestRecord,
                before: dict[str, float], after: dict[str, float], setting: str) -> PrefixCachePair:
    """The pair's figures: both TTFTs, and the cache lookups and hits the second request added, from the server's
    counters scraped around it (None where it has no such counter)."""
    def ttft(r: RequestRecord) -> float | None:
        return 1000.0 * r.ttft_s if r.ok and r.ttft_s is not None else None

    def rise(name: str) -> int | None:
        return int(after[name] - before[name]) if name in before and name in after else None

    return PrefixCachePair(prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens, first_ttft_ms=ttft(first),
                           second_ttft_ms=ttft(second), cached_tokens=rise(HITS), queried_tokens=rise(QUERIES),
                           server_setting=setting,
                           errors=[f"{n}: {r.error}" for n, r in (("first", first), ("second", second)) if not r.ok])


def failed(sweep: DepthSweep | None) -> int:
    """Requests of the depth sweep and the pair that failed."""
    if sweep is None:
        return 0
    return sum(len(p.errors) for p in sweep.points) + (len(sweep.prefix_cache.errors) if sweep.prefix_cache else 0)


# --- two runs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DepthDelta:
    """One figure at one depth, run B against run A, judged against the noise of both points' repeats."""

    depth: int
    metric: str
    earlier: float
    now: float
    change_pct: float
    noise_pct: float | None  # None: fewer than two repeats in both points
    across_setups: bool = False  # the two runs served different plans or images (benchcompare.Setups)

    @property
    def verdict(self) -> str:
        """worse | better (outside the band) | within noise | no noise estimate (not judged) | ACROSS_SETUPS."""
        if self.across_setups:
            return ACROSS_SETUPS
        if self.noise_pct is None:
            return "no noise estimate"
        good = self.change_pct if dict(DEPTH_METRICS)[self.metric] else -self.change_pct
        return "within noise" if abs(good) <= self.noise_pct else "better" if good > 0 else "worse"

    @property
    def worse(self) -> bool:
        return self.verdict == "worse"


def compare(earlier: DepthSweep | None, now: DepthSweep | None) -> list[DepthDelta]:
    """Each depth both runs measured, each figure: the change and the wider repeat spread of the two points."""
    if earlier is None or now is None:
        return []
    before = {p.depth: p for p in earlier.points}
    deltas = []
    for point in now.points:
        old = before.get(point.depth)
        if old is None:
            continue
        for metric, _ in DEPTH_METRICS:
            a, b = old.figure(metric), point.figure(metric)
            if not a or b is None:
                continue
            bands = [x for x in (spread_band_pct(point.repeats(metric)), spread_band_pct(old.repeats(metric)))
                     if x is not None]
            deltas.append(DepthDelta(point.depth, metric, a, b, 100.0 * (b - a) / abs(a), max(bands, default=None)))
    return deltas


def ratios(earlier: DepthSweep | None, now: DepthSweep | None) -> tuple[float | None, float | None]:
    """The prefix-cache ratio of run A and of run B (None where a run has no pair)."""
    def ratio(s: DepthSweep | None) -> float | None:
        return s.prefix_cache.ratio if s and s.prefix_cache else None
    return ratio(earlier), ratio(now)


def ratio_text(pair: tuple[float | None, float | None]) -> str:
    """`A -> B` of the prefix-cache ratios ('-' where a run has none)."""
    return " -> ".join("-" if r is None else f"{r:.2f}" for r in pair)


def delta_lines(deltas: list[DepthDelta], pair: tuple[float | None, float | None]) -> list[str]:
    """The depth comparison as text (B against A)."""
    lines = ["context depth (single stream, B against A; noise band = the spread over each point's repeats):"]
    lines += [f"  d={d.depth} {d.metric}: {d.earlier:,.2f} -> {d.now:,.2f}  {d.change_pct:+.1f} %: {d.verdict}"
              + (f" (noise +-{d.noise_pct:.1f} %)" if d.noise_pct is not None else "")
              for d in deltas] or ["  no depth measured in both"]
    return lines + [f"  prefix cache, second TTFT / first: {ratio_text(pair)}"]


def delta_rows(deltas: list[DepthDelta]) -> list[dict[str, object]]:
    return [{"depth": d.depth, "metric": d.metric, "earlier": round(d.earlier, 2), "now": round(d.now, 2),
             "change %": round(d.change_pct, 1), "noise %": None if d.noise_pct is None else round(d.noise_pct, 1),
             "verdict": d.verdict} for d in deltas]
