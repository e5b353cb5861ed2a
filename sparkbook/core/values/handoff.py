"""What each notebook leaves in state.json for the ones after it, one typed model per hand-off.

    01-cleanup          Stopped         "cleanup"    what was stopped and where the restore plan is
    01-cleanup          OldDeployment   "old_deployment"  the images the old deployment's containers ran
    02-diagnosis        ModelFacts      "model"      (core.values.modelinfo) the model as its config and files
                                                     describe it
    02-diagnosis        Diagnosis       "diagnosis"  findings, the question 03 answers, the installed image's probe,
                                                     each node's memory
    03-image-selection  ImageChoice     "image"      the chosen image and its ID on every node
    03-image-selection  AbBaseline      "ab_baseline"  benchmark.ab image: the baseline arm's image, or why none
    04-ray-cluster      RayCluster      "ray"        the Ray address, each node's container, what Ray reports
    04-ray-cluster      FabricProof     "fabric"     the all_reduce test's figures, for 06 to set beside its decode
    05-serve            Endpoint        "endpoint"   where to send requests and what was started where
    05-serve            AbAnswers       "ab_answers" each A/B arm's agreement with the answer reference
    06-benchmark        BenchmarkSummary "benchmark" single stream, peak, roofline share, regressions
    06-benchmark        AbVerdict       "ab"         the A/B's ratios and the configuration that stays serving (the
                                                     driver serves the baseline again when it is kept)
    06-benchmark        SoakReport      "soak"       the soak's worst window against the median, what ended it
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from .abarm import AbKind
from .evidence import Finding
from .imagefacts import RegistryProbe
from .stagelist import BENCH, CLEANUP, DIAGNOSE, IMAGES, RAYCLUSTER, SERVE
from .state import Handoff


@dataclass(frozen=True)
class Action:
    """One stop (or restore) cleanup did on a node, and how it went."""

    node: str
    name: str
    command: str
    ok: bool
    detail: str
    seconds: float


class Stopped(Handoff):
    key = "cleanup"
    notebook = CLEANUP.name

    stopped: list[Action]
    restore_plan: str


class OldDeployment(Handoff):
    """The images the running containers 01 found ran (sparkbook's own left out), with where each ran: 02 and
    03 take the old deployment's image from here when runtime.installed_image is not set."""

    key = "old_deployment"
    notebook = CLEANUP.name

    images: dict[str, list[str]]  # image -> ["node/container", ...], the most used first


class Diagnosis(Handoff):
    key = "diagnosis"
    notebook = DIAGNOSE.name

    findings: list[Finding]
    question_for_03: str
    installed_image: RegistryProbe | None
    node_memory: dict[str, int] = {}  # node -> the bytes its GPU (or system) has, for 05's OOM ladder


class ImageChoice(Handoff):
    key = "image"
    notebook = IMAGES.name

    ref: str
    id: str | None
    vllm_version: str | None
    ray_version: str | None  # None: no Ray in the image, where `probed`
    nodes: dict[str, str | None]  # node -> the image ID it holds
    digests: list[str] = []  # the chosen image's repo digests (name@sha256:...; none: built or loaded here)
    candidates: dict[str, str | None] = {}  # every candidate ref -> its image ID on the head (None: not held)

    @property
    def on_nodes(self) -> str:
        """What every node holds the image under, for 04's containers and the operators: the image ID where `ref`
        is a digest pin (`name@sha256:...`: a pin does not survive `docker save | docker load`, so the nodes 03 copies
        it to hold the ID, not the digest), else `ref`."""
        return self.id if pinned(self.ref) and self.id else self.ref

    @property
    def probed(self) -> bool:
        """Whether its facts were read (every image 03 chooses has a vLLM version); not so for the candidate
        `sparkbook plan` shows before a first run where its probe did not answer: its Ray is then unknown."""
        return self.vllm_version is not None


class AbBaseline(Handoff):
    """benchmark.ab image: the image the baseline (and kept) arm serves, the one that serves now or, on a first run,
    runtime.installed_image; None where there is none to compare with 03's choice (`reason` says why: the same
    image ID, or no baseline that loads the model), and then no arm runs and 03's choice serves as without an A/B."""

    key = "ab_baseline"
    notebook = IMAGES.name

    image: ImageChoice | None
    reason: str


def pinned(ref: str) -> bool:
    """Whether an image reference is a digest pin (`name@sha256:...`)."""
    return "@sha256:" in ref


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class JoinedNode(_Part):
    name: str
    ip: str
    resources: dict[str, float]  # CPU, GPU, memory


class RayCluster(Handoff):
    key = "ray"
    notebook = RAYCLUSTER.name

    address: str | None  # None: 04 formed no Ray (topology.without_ray), the containers alone
    containers: dict[str, str]  # node -> container name
    reused: bool
    container_ids: dict[str, str]
    nodes: list[JoinedNode]
    # ISO time 04 replaced places that held a live server (05 counts the dark from it); they are kept aside till then
    stopped_server_at: str | None = None


class FabricProof(Handoff):
    """04's all_reduce figures that 06 sets beside its decode time: a small size's latency, a large one's busbw."""

    key = "fabric"
    notebook = RAYCLUSTER.name

    backend: str  # nccl | gloo
    world: int
    small_bytes: int
    small_us: float
    large_bytes: int
    large_busbw_gbps: float


class Endpoint(Handoff):
    key = "endpoint"
    notebook = SERVE.name

    base_url: str
    model: str
    executor: str
    commands: dict[str, list[str]]  # node -> `vllm serve` argv
    env: dict[str, dict[str, str]]
    logs: dict[str, str]
    ready_s: float
    attempts: int
    reused: bool
    api_key_env: str | None = None  # the variable whose value every request sends as its bearer token
    addresses: dict[str, str] = {}  # network (management, fabric) -> the URL clients use there
    seconds_without_service: float | None = None  # a replacement's: old server stopped -> new one answered (behind
    # a kept front: the longest stretch a client polling it went unanswered)
    front_refused: int | None = None  # behind a kept front: the client's asks refused meanwhile (None: no front kept)
    front_failed: int | None = None  # ... and those that failed (an error status, or unanswered within hold_s)
    quality_key: str | None = None  # the reference 05's answers agreed with or recorded (None: not checked)
    router: list[str] | None = None  # serve.layout replicas: the router's argv on the head (base_url is its)
    router_log: str | None = None  # the file the router writes, in its place on the head
    front: bool = False  # the router is the front (serve.front: router), in its own place; else in the head's
    replicas: dict[str, str] = {}  # node -> its replica's own URL, as the router reaches it (none: one server)


class AbAnswers(Handoff):
    """Each A/B arm's answers as 05 checked them: the lowest share of identical top-1 tokens against the reference
    over its prompts (1.0 where the arm recorded the reference itself; None: not checked), for 06's verdict."""

    key = "ab_answers"
    notebook = SERVE.name

    agreement: dict[str, float | None] = {}  # arm -> its lowest agreement

    def adding(self, arm: str, agreement: float | None) -> AbAnswers:
        return AbAnswers(agreement={**self.agreement, arm: agreement})


class BenchPoint(_Part):
    max_concurrency: int
    completed: int
    failed: int
    output_throughput: float | None
    median_ttft_ms: float | None
    p99_ttft_ms: float | None
    median_tpot_ms: float | None
    p99_tpot_ms: float | None


class BenchDepth(_Part):
    """One depth of 06's context-depth axis (single stream; core.analysis.depthsweep has the definitions)."""

    depth: int
    ttft_ms: float | None
    decode_tok_s: float | None
    prefill_tok_s: float | None


class PrefixCacheFigure(_Part):
    """06's prefix-cache pair: the same prefix sent twice, the second TTFT against the first."""

    prefix_tokens: int
    first_ttft_ms: float | None
    second_ttft_ms: float | None
    ratio: float | None  # second / first: near 1 without reuse
    cached_tokens: int | None  # the server's prefix-cache hits over the second request
    queried_tokens: int | None  # its prefix-cache lookups then (0: prefix caching is off on it)
    reuse: str  # what the server did with the prefix, said plainly
    server_setting: str  # what the server's argv says of prefix caching


class BenchmarkSummary(Handoff):
    key = "benchmark"
    notebook = BENCH.name

    single_stream_output_tok_s: float | None
    single_stream_median_tpot_ms: float | None
    single_stream_median_ttft_ms: float | None
    peak_output_tok_s: float | None
    peak_at_concurrency: int
    failed_requests: int
    roofline_ceiling_tok_s: float | None  # None: no memory bandwidth known for the card (06's roofline event says why)
    roofline_percent: float | None
    bench_dir: str
    compared_with: str | None
    worse_than_earlier: list[str]
    points: list[BenchPoint]
    depths: list[BenchDepth] = []  # benchmark.depths, in order (none: not measured)
    prefix_cache: PrefixCacheFigure | None = None


class AbRatio(_Part):
    """One concurrency of the A/B: the second arm's output tok/s (the params' own plan) over the baseline's, judged
    against the noise band of both arms' repeats."""

    max_concurrency: int
    baseline_tok_s: float
    second_tok_s: float
    ratio: float
    noise_pct: float | None  # None: no repeats to measure the noise with
    verdict: str  # better | worse | within noise | no noise estimate (the second arm against the baseline)

    @model_validator(mode="before")
    @classmethod
    def _speculative_records(cls, data: Any) -> Any:
        """Records of the speculative A/B alone named the second arm's figure speculative_tok_s."""
        if isinstance(data, dict) and "speculative_tok_s" in data and "second_tok_s" not in data:
            data = {("second_tok_s" if k == "speculative_tok_s" else k): v for k, v in data.items()}
        return data


class AbVerdict(Handoff):
    key = "ab"
    notebook = BENCH.name

    ab: AbKind = "speculative"  # what was compared (records before the layout A/B compared speculation only)
    kept: Literal["baseline", "speculative", "replicas", "candidate"]  # the arm that stays serving (core.values.abarm)
    agreement: dict[str, float | None] = {}  # ab image: each arm's agreement with the answer reference (AbAnswers)
    reason: str
    decided_at: int  # the concurrency whose ratio decided
    crossing: str | None  # where the ratio crosses 1, if it does, in its A/B's words
    ratios: list[AbRatio]

    def crossing_words(self) -> str:
        """Where the arms cross, as the page and the decision say it: "replicas win above c=8" for the layout
        A/B (its crossing is said so), "the ratio crosses 1 between ..." for speculation."""
        if self.crossing is None:
            return "the ratio does not cross 1"
        return self.crossing if self.ab == "layout" else f"the ratio crosses 1 {self.crossing}"


class SoakReport(Handoff):
    """06's soak: what ran, the throughput's worst window against the median, and what ended it where it failed
    (the rule, the node, the time, the log lines)."""

    key = "soak"
    notebook = BENCH.name

    planned_s: float
    ran_s: float
    concurrency: int
    context: int
    output_len: int
    requests_ok: int
    requests_failed: int
    window_s: float  # the windows throughput is judged over: a minute, or a quarter of a soak shorter than 3 minutes
    median_tok_s: float | None
    worst_tok_s: float | None
    worst_at_s: float | None  # the worst window's start, seconds into the soak
    failure: str | None  # None: the soak held
    failed_rule: str | None = None  # engine dead | node unreachable | Xid | OOM kill | error rate | answers
    failed_node: str | None = None
    failed_at: str | None = None  # UTC, ISO
    lines: list[str] = []  # the kernel or server log lines that name the failure
    series: str  # the samples and windows, relative to the run dir (bench/soak.json)
    answers: str | None = None  # 05's answer checks asked again after the soak, in words (None: the soak failed first)
