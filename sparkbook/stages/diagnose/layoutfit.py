"""Which layouts of the model fit the nodes, with the KV cache each leaves: the plan's TP x PP split across the
nodes (one server), one replica per node (a server on each node, behind a router), and expert parallel where the
model has experts. On two DGX Sparks the best layout depends on the load (replicas of gpt-oss-120b beat TP=2 at
high concurrency), but only a layout that fits can be measured; every layout is held to the same load, max_num_seqs
sequences of max_model_len on each server, so one that fits serves the plan's load, not just one request."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.values.evidence import Finding
from ...core.values.modelinfo import FitRow, ModelFacts, NodeMemory, node_fit, split_fit, split_share
from ...core.values.params import Params

TP, REPLICAS, EXPERT_PARALLEL = "tp", "replicas", "expert parallel"


@dataclass(frozen=True)
class LayoutFit:
    """One layout against each node's memory: `rows` the share of every node it serves on (`node_fit`)."""

    layout: str  # TP | REPLICAS | EXPERT_PARALLEL
    split: str  # where the ranks lie, in words
    servers: int  # vLLM servers the layout runs (replicas: one per node)
    needed_tokens: int  # the KV cache each server must hold: max_num_seqs x max_model_len
    rows: list[FitRow]
    note: str | None = None  # what the rows do not say (None: nothing)

    @property
    def fits(self) -> bool:
        return bool(self.rows) and all(r.fits for r in self.rows)

    @property
    def holds_weights(self) -> bool:
        """Every node holds its weights and reserve with some KV cache left, within what CUDA can allocate: where
        it still does not fit, only the KV cache is short of the load."""
        return bool(self.rows) and all(r.kv_gib > 0 and r.planned_gib <= r.allocatable_gib for r in self.rows)

    @property
    def why(self) -> str:
        """'fits', or each node that does not hold its share, with its figures."""
        return "; ".join(f"{r.node}: {r.why}" for r in self.rows if not r.fits) or "fits"

    @property
    def kv_gib(self) -> float:
        """The least KV cache any node is left (GiB): what bounds the layout's load."""
        return min((r.kv_gib for r in self.rows), default=0.0)

    @property
    def kv_tokens(self) -> int:
        """The tokens each server's KV cache holds (the least over its nodes)."""
        return min((r.kv_tokens for r in self.rows), default=0)

    def row(self) -> dict[str, object]:
        return {"layout": self.layout, "split": self.split, "servers": self.servers, "fits the load": "yes" if self.fits
                else "NO", "weights GiB per node": f"{max((r.weights_gib for r in self.rows), default=0):.1f}",
                "KV GiB per node": f"{self.kv_gib:.1f}", "KV tokens per server": self.kv_tokens,
                "needed per server": self.needed_tokens, "why": self.why, "note": self.note or "-"}


def needed_tokens(params: Params) -> int:
    """max_num_seqs (1 unset) sequences of max_model_len (0 unset: only a KV cache at all is asked for)."""
    return (params.serve.max_num_seqs or 1) * (params.serve.max_model_len or 0)


def tp_fit(facts: ModelFacts, params: Params, memory: dict[str, NodeMemory]) -> LayoutFit:
    """The plan's TP x PP split: one server whose ranks lie over the nodes head first (as 05 serves it)."""
    s, need = params.serve, needed_tokens(params)
    rows = split_fit(facts, params, memory, need)
    return LayoutFit(TP, f"TP={s.tensor_parallel_size} PP={s.pipeline_parallel_size} over "
                     f"{', '.join(r.node for r in rows)}", 1, need, rows)


def replicas_fit(facts: ModelFacts, params: Params, memory: dict[str, NodeMemory]) -> LayoutFit:
    """One whole copy of the model per node, its ranks on that node's GPUs (TP over them; one rank without GPUs),
    each with the KV cache of the full load: the model and that KV cache within one node's memory."""
    need, rows = needed_tokens(params), []
    for node in params.nodes:
        if node.name in memory:
            ranks = len(node.gpus) or 1
            share = split_share(facts, params.serve, ranks, 1)
            rows.append(node_fit(node.name, ranks, memory[node.name], share, params.serve, bool(node.gpus), need))
    tps = sorted({r.ranks for r in rows})
    return LayoutFit(REPLICAS, f"one server per node ({len(rows)}), TP={'/'.join(map(str, tps))} within each",
                     len(rows), need, rows)


def expert_fit(facts: ModelFacts, tp: LayoutFit, params: Params) -> LayoutFit:
    """Expert parallel over the plan's split (vLLM --enable-expert-parallel): attention stays sharded by TP, each
    routed expert lies whole on one of the TP ranks; the weights per rank, and so the memory, are TP's."""
    size = params.serve.tensor_parallel_size
    per_rank = math.ceil(facts.experts / size)
    note = (f"{facts.experts} routed experts over {size} ranks per stage: {per_rank} per rank; the same memory as "
            "TP's split" + ("; with TP=1 no expert moves (nothing to spread)" if size == 1 else ""))
    return LayoutFit(EXPERT_PARALLEL, f"EP={size} (with {tp.split})", 1, tp.needed_tokens, tp.rows, note)


def layout_fits(facts: ModelFacts, params: Params, memory: dict[str, NodeMemory]) -> list[LayoutFit]:
    """Every layout the nodes could serve: the TP split; replicas where there are two nodes or more; expert
    parallel where the model has routed experts."""
    tp = tp_fit(facts, params, memory)
    out = [tp]
    if len(params.nodes) > 1:
        out.append(replicas_fit(facts, params, memory))
    if facts.experts:
        out.append(expert_fit(facts, tp, params))
    return out


def verdict(fits: list[LayoutFit]) -> str:
    """What the layouts mean for the plan, in one sentence each: whether a copy of the model fits one node (then
    replicas may serve more at high concurrency, the split less latency at low: only a measurement decides)."""
    tp = next(f for f in fits if f.layout == TP)
    replicas = next((f for f in fits if f.layout == REPLICAS), None)
    split = (f"The split ({tp.split}) fits, leaving {tp.kv_gib:.1f} GiB of KV cache per node ({tp.kv_tokens} tokens)."
             if tp.fits else f"The split ({tp.split}) does not hold the load: {tp.why}.")
    if replicas is None:
        return split + " One node: no replicas to weigh against it."
    if not replicas.fits and replicas.holds_weights:
        return (split + f" Replicas: a whole copy fits each node, but its KV cache holds {replicas.kv_tokens} tokens "
                        f"where the load asks {replicas.needed_tokens} (max_num_seqs x max_model_len): lower those "
                        "or give the KV cache more memory to weigh replicas.")
    if not replicas.fits:
        return (split + " Replicas do not fit: a whole copy of the model does not fit one node ("
                        f"{replicas.why})" + ("; the model must be split across the nodes." if tp.holds_weights
                                              else "."))
    return (split + f" Replicas fit: each node holds the whole model and {replicas.kv_gib:.1f} GiB of KV cache "
                    f"({replicas.kv_tokens} tokens per server, {replicas.servers} servers); they may serve more "
                    "requests at high concurrency than the split, which answers one request faster: measure both.")


def layout_findings(fits: list[LayoutFit], params: Params) -> list[Finding]:
    """serve.layout replicas where a copy per node does not fit is a blocker naming the field, before 03 copies an
    image and 05 loads a model that cannot serve the load."""
    if params.serve.layout != REPLICAS:
        return []
    replicas = next((f for f in fits if f.layout == REPLICAS), None)
    if replicas is None or not replicas.fits:
        why = replicas.why if replicas is not None else "one node"
        return [Finding("blocker", "layout", f"serve.layout: replicas: a copy of the model with the KV cache of "
                                             f"{needed_tokens(params)} tokens does not fit one node: {why}")]
    return []
