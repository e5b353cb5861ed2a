"""05's failures: known signatures in vLLM/Ray logs (a named cause, the line that shows it, a remediation) and the
remediation ladder that retries a graph-capture OOM with less memory, then eager."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...core.modelinfo import VLLM_DEFAULT_UTILIZATION
from ...core.params import ServeSettings

GRAPH_OOM = "CUDA out of memory during graph capture"


@dataclass(frozen=True)
class Signature:
    """A cause and the log patterns that prove it (all of `requires` must match too, anywhere)."""

    cause: str
    patterns: tuple[str, ...]
    remediation: str
    requires: tuple[str, ...] = ()
    consequence: bool = False   # follows from another failure (a dead peer): a seen fact explains it better

    def first_match(self, text: str) -> str | None:
        if not all(re.search(p, text, re.I) for p in self.requires):
            return None
        for line in text.splitlines():
            if any(re.search(p, line, re.I) for p in self.patterns):
                return line.strip()
        return None


# Most specific first: a graph-capture OOM also says "worker died" further down.
SIGNATURES: tuple[Signature, ...] = (
    Signature("architecture not supported",
              (r"Model architectures? \[.*\] (are|is) not supported",),
              "this image's vLLM does not register the architecture: pick an image whose vLLM does (03)"),
    Signature("architecture failed to be inspected",
              (r"failed to be inspected", r"Error in inspecting model architecture"),
              "the architecture is registered but its module does not import (grafted or mismatched files): "
              "use an image whose own vLLM ships the model (03)"),
    Signature("argument not recognized",
              (r"error: unrecognized arguments:", r"error: argument --\S+: invalid"),
              "this image's vLLM does not know an argument of the serve command (its argparse refused it): remove "
              "it from serve.extra_args, or choose an image whose vLLM has it (03)"),
    Signature(GRAPH_OOM,
              (r"CUDA out of memory", r"OutOfMemoryError", r"CUDA error: out of memory"),
              "lower serve.gpu_memory_utilization to the lowest that still holds weights and KV cache (02's memory "
              "fit); if that is not enough, serve with --enforce-eager",
              requires=(r"captur\w* .*(cuda ?graph|cudagraph)|cuda ?graph.*captur|cudagraph",)),
    # vLLM's own texts: vllm/v1/core/kv_cache_utils.py (_check_enough_kv_cache_memory) and, before V1,
    # vllm/worker/worker.py (raise_if_cache_size_invalid).
    Signature("no memory left for the KV cache",
              (r"No available memory for the cache blocks",
               r"KV cache is needed, which is larger than the available KV cache memory",
               r"larger than the maximum number of tokens that can be stored in KV cache"),
              "weights (and activations) leave too little for the KV cache of one max_model_len sequence: lower "
              "serve.max_model_len (or serve.max_num_seqs), raise serve.gpu_memory_utilization, or spread the "
              "model over more nodes (serve.tensor_parallel_size / pipeline_parallel_size); 02's memory fit shows "
              "what each node holds"),
    Signature("placement group not scheduled",
              (r"placement group.*(not|never|cannot|could not).*schedul", r"No available node types can fulfill",
               r"Waiting for creating a placement group"),
              "Ray and vLLM disagree on node IPs or a stale placement group holds the GPUs: set VLLM_HOST_IP per "
              "node, recreate the Ray containers (04); on 1-GPU nodes use the SPREAD strategy"),
    Signature("duplicate node IP",
              (r"Every node should have a unique IP address",),
              "two nodes report the same VLLM_HOST_IP: give each node its own fabric IP in params (04)"),
    Signature("NCCL timeout",
              (r"NCCL.*(timeout|timed out)", r"Watchdog caught collective operation timeout"),
              "NCCL picked the wrong interface or the fabric drops traffic: check NCCL_SOCKET_IFNAME / NCCL_IB_HCA "
              "and the fabric (02)"),
    Signature("rank never joined",
              (r"DistStoreError", r"waiting for clients", r"TCPStore.*(timed out|timeout)",
               r"Timed out .*(rendezvous|store)"),
              "a rank did not reach master_addr:master_port: check that every node's serve process started and "
              "the master port is open on the fabric", consequence=True),
    Signature("address already in use",
              (r"Address already in use", r"EADDRINUSE", r"\[Errno 98\]"),
              "the serve port is taken on the head: stop the service holding it (01) or change serve.port"),
    Signature("worker died",
              (r"Worker.*(died|exited unexpectedly|failed)", r"ActorDiedError", r"The actor died",
               r"Engine core initialization failed", r"EngineCore.*(died|failed)", r"\bKilled\b", r"SIGKILL"),
              "a worker process died: read its node's log tail for the first error; check memory (dmesg, OOM killer)",
              consequence=True),
)

UNKNOWN = "unknown failure"
TIMEOUT = "not ready in time"


@dataclass(frozen=True)
class FailureCause:
    """The classified cause of a failed start: where it was seen and the line that proves it."""

    cause: str
    node: str
    evidence: str
    remediation: str
    also: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        return self.cause != UNKNOWN

    def summary(self) -> str:
        return f"{self.cause} on {self.node}: {self.evidence!r} -> {self.remediation}"


def classify(logs: dict[str, str], observed: dict[str, str] | None = None) -> FailureCause:
    """The most specific known cause over every node's log tail.

    `observed` are facts seen without logs ({"lab-1": "container is not running"}): they explain a failure
    better than consequences in other logs (a rank that never joined), worse than a root cause in a log."""
    found: list[tuple[int, str, Signature, str]] = []
    for node, text in logs.items():
        for rank, sig in enumerate(SIGNATURES):
            line = sig.first_match(text)
            if line is not None:
                found.append((rank + len(SIGNATURES) * sig.consequence, node, sig, line))
    found.sort(key=lambda f: f[0])
    also = tuple(dict.fromkeys(f"{s.cause} on {n}" for _, n, s, _ in found))
    if found and not (found[0][2].consequence and observed):
        _, node, sig, line = found[0]
        return FailureCause(sig.cause, node, line, sig.remediation, also[1:])
    if observed:
        node, fact = next(iter(observed.items()))
        died = _by_cause("worker died")
        return FailureCause(died.cause, node, fact, died.remediation, also)
    node = next(iter(logs), "")
    last = next((ln.strip() for ln in reversed((logs.get(node) or "").splitlines()) if ln.strip()), "")
    return FailureCause(UNKNOWN, node, last, "read the log tails; add the signature to sparkbook.stages.serve.failures")


def not_ready(logs: dict[str, str], node: str, seconds: float) -> FailureCause:
    """A start that neither failed nor finished in time: a root cause from the logs if one shows,
    otherwise the phase it was in (the last line of `node`'s log)."""
    found = classify(logs)
    if found.known and not _by_cause(found.cause).consequence:
        return found
    last = next((ln.strip() for ln in reversed((logs.get(node) or "").splitlines()) if ln.strip()), "(no output)")
    return FailureCause(TIMEOUT, node, last[-300:], f"still starting after {seconds:.0f} s: raise "
                        "serve.ready_timeout_s if the last line shows progress (a loaded node, a large model), else "
                        "read the tails", (f"{found.cause} on {found.node}",) if found.known else ())


def _by_cause(cause: str) -> Signature:
    return next(s for s in SIGNATURES if s.cause == cause)


@dataclass(frozen=True)
class Remedy:
    """A change to the serve settings that addresses a diagnosed cause, and why."""

    cause: str
    change: dict[str, object]
    settings: ServeSettings
    reason: str
    alternatives: list[tuple[str, str]] = field(default_factory=list)


def remedy(cause: FailureCause, settings: ServeSettings, floor: float | None = None) -> Remedy | None:
    """The next automatic remediation for `cause` under `settings`, or None where there is none.

    Graph-capture OOM: lower gpu_memory_utilization straight to `floor`, the lowest that still holds the
    weights and the KV cache on every node (`modelinfo.utilization_floor`, from 02's memory fit); when the
    floor is not below the current value (it was tried, or nothing fits lower) or unknown (None: no fit),
    --enforce-eager. Each attempt reloads every weight, so the ladder has at most these two steps. Every
    other cause needs a person (or an earlier stage)."""
    if cause.cause != GRAPH_OOM or settings.enforce_eager:
        return None
    current = settings.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION
    eager = ("enforce_eager", "costs decode speed; tried only if less memory is not enough")
    if floor is not None and floor < current:
        change: dict[str, object] = {"gpu_memory_utilization": floor}
        reason = (f"graph capture ran out of memory at gpu_memory_utilization {current}: {floor} is the lowest "
                  "that still holds the weights and the KV cache for max_model_len on every node (02's memory "
                  f"fit), freeing {current - floor:.0%} more of the GPU for the capture")
        alts = [eager]
    else:
        change = {"enforce_eager": True}
        reason = ("no memory fit from 02 to lower gpu_memory_utilization by" if floor is None
                  else f"no gpu_memory_utilization holds the weights and the KV cache (02's memory fit needs {floor})"
                  if floor > 1 else f"gpu_memory_utilization {current} is at or below the memory fit's floor {floor}"
                  ) + ": skip CUDA graph capture"
        alts = [("lower gpu_memory_utilization", "below the memory fit's floor the weights and the KV cache for "
                 "max_model_len no longer fit")]
    return Remedy(cause.cause, change, settings.model_copy(update=change), reason, alts)
