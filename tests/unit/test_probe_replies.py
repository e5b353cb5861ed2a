"""Probe replies (issue 20): each sectioned probe, run for real on this machine through a local node, parses when
whole and fails with ProbeOutputError naming node, probe and what is missing when its tail is cut; the local
process readers return whole replies, and a reply that ends at the deadline is marked timed out."""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from sparkbook.core.cluster.nodes import LocalNode, shell
from sparkbook.core.values.errors import ProbeOutputError
from sparkbook.core.values.params import Params, load_params
from sparkbook.stages.cleanup import inventory
from sparkbook.stages.diagnose import checks


class CutNode(LocalNode):
    """A local node whose replies lose their stdout after `keep` characters, as a reader that stops early
    loses them (exit status 0 all the same). Each command's first reply is replayed, so every cut is of the
    same reply (`ps` and /proc/meminfo change from one call to the next)."""

    keep: int | None = None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.replies: dict[tuple[str, ...], tuple[str, str, int | None]] = {}

    def _exec(self, argv: list[str], deadline_s: float, stdin: bytes | None) -> tuple[str, str, int | None]:
        command = tuple(argv[4:])  # without the node-side `timeout -k GRACE LIMIT` wrapper
        if command not in self.replies:
            self.replies[command] = super()._exec(argv, deadline_s, stdin)
        out, err, code = self.replies[command]
        return out[:self.keep], err, code


@pytest.fixture
def params(base: dict[str, Any], write_params, tmp_path: Path) -> Params:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Tiny"], "hidden_size": 8}, indent=2))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    (model / "model.safetensors").write_bytes(b"\0" * 1234)
    base["nodes"][0].update(transport="local", fabric_ip="127.0.0.1", fabric_netdev="lo")
    base["nodes"][1].update(transport="local", fabric_ip="127.0.0.2", fabric_netdev="lo")
    base["model"] = {"path": str(model), "served_name": "tiny", "cache_dir": str(tmp_path)}
    base["cleanup"] = {"processes": ["no-such-process"]}
    return load_params(write_params(base))


@pytest.fixture
def node(params: Params) -> CutNode:
    return CutNode(params.nodes[0], params.ssh)


PROBES = {
    "node facts": lambda n, p: checks.node_facts(n, p.nodes[0], p),
    "inventory": lambda n, p: inventory.inventory(n, p.cleanup),
    "links": lambda n, p: checks.links(n, p),
    "model files": lambda n, p: checks.model_files(n, p.model),
}


def _whole(node: CutNode, params: Params, probe: str) -> str:
    """The probe's whole stdout on this machine (the script as the stage sends it)."""
    scripts = {"node facts": shell(checks.FACTS, path=params.model.cache_dir, netdev="lo"),
               "inventory": shell(inventory.INVENTORY),
               "model files": shell(checks.MODEL_FILES, dir=params.model.path)}
    if probe == "links":
        return node.run(checks.bash(checks.LINKS, size=1472, port=1, ips="127.0.0.2"), timeout=20).stdout
    return node.run(scripts[probe], timeout=20).stdout


@pytest.mark.parametrize("probe", PROBES)
def test_whole_reply_parses(node: CutNode, params: Params, probe: str) -> None:
    assert PROBES[probe](node, params)


@pytest.mark.parametrize("probe", PROBES)
def test_every_cut_reply_gives_the_clear_error(node: CutNode, params: Params, probe: str) -> None:
    """Cut at each section's start, mid-section, and just before the end marker: never a bare KeyError/IndexError,
    never a reply taken as whole."""
    whole = _whole(node, params, probe)
    cuts = {whole.index(line) for line in whole.splitlines() if line.startswith("==")}
    cuts |= {len(whole) // 2, len(whole) - len("==end==\n"), 0}
    for keep in sorted(cuts):
        node.keep = keep
        with pytest.raises(ProbeOutputError) as info:
            PROBES[probe](node, params)
        err = info.value
        assert (err.node, err.probe, err.received_bytes) == ("a", probe, len(whole[:keep].encode())), keep
        assert str(err).startswith(f"a: {probe}: the probe's output has no "), str(err)


def test_cut_before_meminfo_names_it(node: CutNode, params: Params) -> None:
    whole = _whole(node, params, "node facts")
    node.keep = whole.index("==meminfo==")
    with pytest.raises(ProbeOutputError, match=r"^a: node facts: the probe's output has no meminfo section or end "
                                               rf"marker \({node.keep} bytes received\): run the step again") as caught:
        checks.node_facts(node, params.nodes[0], params)
    assert caught.value.node == "a" and caught.value.remediation


def test_links_without_a_peer_line_names_the_peer(node: CutNode, params: Params) -> None:
    whole = "==peers==\nPEER 127.0.0.9 0.05 1 1\n==end==\n"
    with pytest.raises(ProbeOutputError, match=r"^a: links: the probe's output has no line for b \("):
        checks._links("a", {"127.0.0.2": "b"}, whole)


def test_model_files_broken_json_is_a_fact_of_the_node(params: Params) -> None:
    Path(params.model.path, "config.json").write_text('{"architectures": ["Tiny"')
    files = checks.model_files(LocalNode(params.nodes[0], params.ssh), params.model)
    assert files.config is None and "is not valid JSON" in files.error


# --- the local process readers ---------------------------------------------------------------------------------
def _seq(n: int) -> str:
    return "".join(f"{i}\n" for i in range(1, n + 1))


def test_local_run_returns_both_streams_whole(params: Params) -> None:
    r = LocalNode(params.nodes[0], params.ssh).run(shell("seq 1 {n}; seq 1 {n} >&2", n=200_000), timeout=30)
    assert r.ok and r.stdout == _seq(200_000) and r.stderr == _seq(200_000)


def test_local_stream_to_a_sink_reads_stderr_too(params: Params) -> None:
    """stderr larger than a pipe's buffer while stdout goes to the sink: whole, and no stall."""
    sink = io.BytesIO()
    r = LocalNode(params.nodes[0], params.ssh).stream(shell("seq 1 {n} >&2; seq 1 {n}", n=100_000), sink=sink,
                                                      timeout=30)
    assert r.ok and sink.getvalue().decode() == _seq(100_000) and r.stderr == _seq(100_000)


def test_local_reply_ending_at_the_deadline_is_timed_out(params: Params) -> None:
    r = LocalNode(params.nodes[0], params.ssh).run(shell("echo partial; sleep 30"), timeout=1)
    assert r.timed_out and not r.ok


def test_local_stream_from_a_source(params: Params) -> None:
    r = LocalNode(params.nodes[0], params.ssh).stream(["wc", "-c"], source=io.BytesIO(b"x" * 3_000_000), timeout=30)
    assert r.ok and r.stdout.split() == ["3000000"]
