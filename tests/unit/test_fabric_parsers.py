"""core.analysis.fabric and 04's all_reduce test as pure logic: ibdev2netdev and NCCL_DEBUG=INFO parsed from real outputs
(tests/unit/data, each file names its source), 02's roce_hcas findings, 04's limits per node kind and link rate, the
verdict with its causes, the figures 04 hands 06."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from sparkbook.core.analysis import fabric
from sparkbook.core.values import state
from sparkbook.core.values.handoff import FabricProof
from sparkbook.core.values.params import Params
from sparkbook.stages.raycluster import fabrictest

DATA = Path(__file__).parent / "data"
SPARK = ["rocep1s0f1", "roceP2p1s0f1"]


def _text(name: str) -> str:
    return (DATA / name).read_text()


def _params(gpus: list[int] | None = None, hcas: list[str] | None = None, netdev: str = "enp1s0f1np1",
            **fabric_fields: Any) -> Params:
    node = {"host": "10.0.0.1", "fabric_netdev": netdev, "gpus": [0] if gpus is None else gpus,
            "roce_hcas": SPARK if hcas is None else hcas}
    return Params.model_validate({
        "cluster": "unit",
        "nodes": [{"name": "a", "role": "head", "fabric_ip": "192.168.200.12", **node},
                  {"name": "b", "role": "worker", "fabric_ip": "192.168.200.13", **copy.deepcopy(node)}],
        "fabric": {"mtu": 9000, **fabric_fields},
        "runtime": {"kind": "docker", "images": ["example/vllm:0.17"]},
        "model": {"hf_id": "Org/Model-1B", "served_name": "model", "cache_dir": "/srv/models"},
        "serve": {"tensor_parallel_size": 2}})


# --- ibdev2netdev --------------------------------------------------------------------------------------
def test_ibdev2netdev_of_a_spark_parses_every_line_and_pairs_the_twins():
    hcas = fabric.parse_ibdev2netdev(_text("ibdev2netdev_spark_port1.txt").splitlines())
    assert [(h.name, h.netdev, h.up) for h in hcas] == [
        ("roceP2p1s0f0", "enP2p1s0f0np0", False), ("roceP2p1s0f1", "enP2p1s0f1np1", True),
        ("rocep1s0f0", "enp1s0f0np0", False), ("rocep1s0f1", "enp1s0f1np1", True)]
    assert [h.name for h in fabric.fabric_hcas(hcas, "enp1s0f1np1")] == ["roceP2p1s0f1", "rocep1s0f1"]
    assert fabric.port_key("mlx5_0") == "mlx5_0" and fabric.port_key("enP2p1s0f1np1") == "p1s0f1"


def test_right_roce_hcas_pass_with_both_twins_reported():
    spec = _params().nodes[0]
    findings = fabric.hca_findings(spec, _text("ibdev2netdev_spark_port1.txt").splitlines())
    assert [f.severity for f in findings] == ["fact"]
    assert "roceP2p1s0f1 (enP2p1s0f1np1) and rocep1s0f1 (enp1s0f1np1) are Up on one port" in findings[0].text


@pytest.mark.parametrize("hcas, netdev, expect", [
    (["mlx5_0"], "enp1s0f1np1", "roce_hcas names mlx5_0, which ibdev2netdev does not list"),
    (["rocep1s0f0", "roceP2p1s0f0"], "enp1s0f1np1", "rocep1s0f0 (port 1 ==> enp1s0f0np0) is Down"),
    (["rocep1s0f1"], "enp1s0f0np0", "rocep1s0f1 drives enp1s0f1np1, not the fabric netdev enp1s0f0np0"),
])
def test_wrong_roce_hcas_are_a_blocker_naming_the_hcas_up_on_the_fabric_netdev(hcas, netdev, expect):
    spec = _params(hcas=hcas, netdev=netdev).nodes[0]
    blockers = [f for f in fabric.hca_findings(spec, _text("ibdev2netdev_spark_port1.txt").splitlines())
                if f.severity == "blocker"]
    assert blockers and expect in blockers[0].text and blockers[0].text.startswith("a: ")
    if netdev == "enp1s0f1np1":
        assert blockers[0].text.endswith(f"HCAs ibdev2netdev shows Up for {netdev}: roceP2p1s0f1, rocep1s0f1")
    else:
        assert "shows no HCA Up for enp1s0f0np0" in blockers[0].text


def test_one_twin_of_two_is_a_warning_with_the_other_named():
    spec = _params(hcas=["rocep1s0f0"], netdev="enp1s0f0np0").nodes[0]
    findings = fabric.hca_findings(spec, _text("ibdev2netdev_spark_port0.txt").splitlines())
    warning = [f for f in findings if f.severity == "warning"]
    assert [f.severity for f in findings] == ["fact", "warning"]
    assert "leaves roceP2p1s0f0 unused" in warning[0].text and "add roceP2p1s0f0 to roce_hcas" in warning[0].text


def test_no_ibdev2netdev_warns_only_where_params_name_hcas():
    assert fabric.hca_findings(_params(hcas=[]).nodes[0], ["ibdev2netdev not present"]) == []
    [finding] = fabric.hca_findings(_params().nodes[0], ["ibdev2netdev not present"])
    assert finding.severity == "warning" and "cannot be checked" in finding.text


# --- NCCL_DEBUG=INFO -----------------------------------------------------------------------------------
def test_nccl_on_roce_with_both_spark_twins():
    t = fabrictest.parse_nccl(_text("nccl_ib_spark_twins.log"))
    assert (t.network, t.hcas, t.channels, t.fell_back) == ("IB", SPARK, ["NET/IB"], False)
    assert fabrictest.transport_problems("a", _params().nodes[0], t, across_nodes=True) == []


def test_nccl_using_one_twin_of_roce_hcas_is_named():
    t = fabrictest.parse_nccl(_text("nccl_ib_roce_mlx5.log"))
    assert (t.network, t.hcas, t.channels) == ("IB", ["mlx5_10", "mlx5_11"], [])
    [problem] = fabrictest.transport_problems("a", _params(hcas=["mlx5_1"]).nodes[0], t, across_nodes=True)
    assert "also uses mlx5_10, mlx5_11" in problem and "'=mlx5_1'" in problem  # NCCL_IB_HCA's prefix match
    unused, foreign = fabrictest.transport_problems("a", _params(hcas=["mlx5_10", "mlx5_12"]).nodes[0], t, True)
    assert "does not use mlx5_12 of roce_hcas" in unused and "uses mlx5_11, which roce_hcas does not name" in foreign


def test_nccl_gdrdma_channels_count_as_ib():
    t = fabrictest.parse_nccl(_text("nccl_ib_gdrdma.log"))
    assert (t.network, t.hcas, t.channels) == ("IB", ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"], ["NET/IB"])


@pytest.mark.parametrize("log, missing, ifs, channels", [
    ("nccl_socket.log", False, ["enp225s0f1"], []),
    ("nccl_socket_fallback.log", True, ["ens3"], ["P2P", "NET/Socket"]),
])
def test_a_socket_transport_where_roce_hcas_are_set_is_a_fallback(log, missing, ifs, channels):
    t = fabrictest.parse_nccl(_text(log))
    assert (t.fell_back, t.ib_missing, t.socket_ifs, t.channels) == (True, missing, ifs, channels)
    [problem] = fabrictest.transport_problems("b", _params().nodes[1], t, across_nodes=True)
    assert problem.startswith(f"b: NCCL fell back to NET/Socket over {ifs[0]}")
    assert "HCAs ibdev2netdev shows Up for enp1s0f1np1" in problem
    assert fabrictest.transport_problems("b", _params(hcas=[]).nodes[1], t, True) == []  # sockets by design
    assert fabrictest.transport_problems("b", _params().nodes[1], t, across_nodes=False) == []


# --- limits and verdict --------------------------------------------------------------------------------
def test_limits_per_node_kind_and_link_rate():
    roce = fabrictest.limits(_params(), 200000)
    assert (roce.kind, roce.min_gbps, roce.max_us) == ("roce", 120.0, 150.0)
    assert fabrictest.limits(_params(), None).min_gbps == 100.0
    assert fabrictest.limits(_params(hcas=[]), 10000).kind == "ethernet"
    cpu = fabrictest.limits(_params(gpus=[], hcas=[]), 10000)  # the lab: a veth's nominal rate is no real limit
    assert (cpu.kind, cpu.min_gbps, cpu.max_us) == ("cpu", 0.1, 8000.0)
    own = fabrictest.limits(_params(expect_gbps=150, max_allreduce_us=60), 200000)
    assert (own.min_gbps, own.max_us) == (150, 60) and "fabric.expect_gbps" in own.why


def test_sizes_step_from_small_to_large_and_ranks_follow_gpus():
    assert fabrictest.sizes(_params(gpus=[], hcas=[])) == [32768, 262144, 2097152, 8 << 20]
    assert fabrictest.sizes(_params(allreduce_large_bytes=1 << 20)) == [32768, 262144, 1 << 20]
    params = _params(gpus=[0, 1])
    ranks = fabrictest.ranks(params)
    assert [(r.node, r.rank, r.device) for r in ranks] == [("a", 0, 0), ("a", 1, 1), ("b", 2, 0), ("b", 3, 1)]
    cfg = fabrictest.config(params, ranks[3], 4, [0, 2], 29502)
    assert (cfg["backend"], cfg["device"], cfg["master"], cfg["netdev"]) == ("nccl", 1, "192.168.200.12:29502",
                                                                               "enp1s0f1np1")
    mixed = params.model_copy(update={"nodes": [params.nodes[0], params.nodes[1].model_copy(update={"gpus": []})]})
    configs = (fabrictest.config(mixed, r, 3, [0, 2], 1) for r in fabrictest.ranks(mixed))
    assert {(c["backend"], c["device"]) for c in configs} == {("gloo", -1)}


def _doc(rank: int, us: float, busbw: float, link_gbps: float, src: int, passes: tuple[float, ...] = ()) -> str:
    sizes = [{"bytes": 32768, "us": us, "algbw_gbps": 1.0, "busbw_gbps": 1.0, "iters": 20, "correct": True}
             | ({"passes_us": list(passes)} if passes else {}),
             {"bytes": 256 << 20, "us": 1e4, "algbw_gbps": busbw, "busbw_gbps": busbw, "iters": 5, "correct": True}]
    doc = {"rank": rank, "world": 2, "backend": "nccl", "torch": "2.9.0", "nccl": "2.27.3", "init_s": 1.0,
           "sizes": sizes, "links": [{"src_rank": src, "dst_rank": rank, "gbps": link_gbps}], "link_mbps": 200000}
    return f"NCCL INFO NET/IB : Using [0]rocep1s0f1:1/RoCE\nNCCL INFO Using network IB\n" \
           f"SPARKBOOK-JSON {json.dumps(doc)}\nSPARKBOOK-END\n"


def test_a_healthy_spark_pair_passes():
    params = _params(hcas=["rocep1s0f1"])
    docs = {0: _doc(0, 35, 160, 170, 1), 1: _doc(1, 35, 160, 165, 0)}
    test = fabrictest.collect(params, fabrictest.ranks(params), docs, 9)
    result = fabrictest.verdict(params, test)
    assert result.ok, result.problems
    assert [r["limit"] for r in fabrictest.rows(test, result)] == ["<= 150 us", ">= 120.00 Gb/s busbw"]
    assert [(x.src, x.dst) for x in test.links] == [("b", "a"), ("a", "b")]
    assert [ax.get_ylabel() for ax in fabrictest.figure(test, result).axes] == ["all_reduce time (us)", "busbw (Gb/s)"]


def test_a_slow_link_fails_naming_the_sending_node_with_figures_and_causes():
    params = _params(hcas=["rocep1s0f1"])
    docs = {0: _doc(0, 400, 13, 13, 1), 1: _doc(1, 400, 13, 160, 0)}
    test = fabrictest.collect(params, fabrictest.ranks(params), docs, 9)
    result = fabrictest.verdict(params, test)
    text = " ".join(result.problems)
    assert "a 32 KiB all_reduce takes 400 us, the limit is 150 us" in text
    assert "busbw at 256 MiB is 13.00 Gb/s, expected at least 120.00 Gb/s (0.6 x the 200 Gb/s link)" in text
    assert "the link b -> a carries 13.00 Gb/s" in text and "a -> b" not in text
    assert fabrictest.CAUSES["stale"] in result.causes and fabrictest.CAUSES["twin"] in result.causes
    with pytest.raises(fabrictest.FabricTestFailed, match="likely causes: .*ConnectX-7"):
        fabrictest.check(result)


def test_a_slow_latency_in_both_passes_names_both():
    """The probe times the latency size twice (first and last) and reports the better: a slow fabric is slow in
    both, and the problem shows both figures; a record without passes (older probes) reads as before."""
    params = _params(hcas=["rocep1s0f1"])
    docs = {r: _doc(r, 390, 160, 170, 1 - r, passes=(412.5, 390.0)) for r in (0, 1)}
    test = fabrictest.collect(params, fabrictest.ranks(params), docs, 9)
    assert test.sizes[0].passes_us == [412.5, 390.0] and test.sizes[1].passes_us == []
    (problem,) = fabrictest.verdict(params, test).problems
    assert problem == "a 32 KiB all_reduce takes 390 us in both passes (412, 390 us), the limit is 150 us"
    fast_again = {r: _doc(r, 35, 160, 170, 1 - r, passes=(8162.2, 35.0)) for r in (0, 1)}
    assert fabrictest.verdict(params, fabrictest.collect(params, fabrictest.ranks(params), fast_again, 9)).ok


def test_a_rank_without_its_document_is_an_error_naming_its_node():
    params = _params()
    test = fabrictest.collect(params, fabrictest.ranks(params),
                          {0: _doc(0, 35, 160, 170, 1), 1: "NCCL INFO x\nRuntimeError: connection refused\n"}, 30)
    result = fabrictest.verdict(params, test)
    assert not result.ok and "b (rank 1): RuntimeError: connection refused" in result.problems[0]
    assert "NCCL INFO" not in result.problems[0]


def test_06_shows_04s_figures_beside_the_decode_time(tmp_path):
    before = state.Handoffs(tmp_path).get(FabricProof)  # as 06's context reads it, before 04 stored one
    assert fabric.beside_decode(before, None)[0]["value"].startswith("not recorded")
    params = _params()
    docs = {0: _doc(0, 40, 160, 170, 1), 1: _doc(1, 40, 160, 165, 0)}
    test = fabrictest.collect(params, fabrictest.ranks(params), docs, 9)
    state.store(tmp_path, fabrictest.proof(test), lambda data: data, "04-ray-cluster")  # as 04's run.remember does
    rows = fabric.beside_decode(state.Handoffs(tmp_path).get(FabricProof), 37.0)
    assert [r["value"] for r in rows] == ["40.0 us", "160.00 Gb/s", "37.00 ms", "925"]


# --- one node: its GPUs' own link, or nothing to test -------------------------------------------------
def _one_node(gpus: list[int]) -> Params:
    p = _params(gpus=gpus, hcas=[])
    return p.model_copy(update={"nodes": [p.nodes[0]]})


@pytest.mark.parametrize("log, intra, kind", [("nccl_graph_nvl.log", "NVL", "nvlink"),
                                              ("nccl_graph_sys.log", "SYS", "pcie"),
                                              ("nccl_socket.log", "", "pcie")])  # not logged: the weaker link
def test_one_node_with_several_gpus_is_held_to_its_own_links_limits(log, intra, kind):
    t = fabrictest.parse_nccl(_text(log))
    assert t.intra == intra
    params = _one_node([0, 1])
    assert [(r.node, r.device) for r in fabrictest.ranks(params)] == [("a", 0), ("a", 1)]
    assert fabrictest.single_rank(params) is None
    lim = fabrictest.limits(params, 200000, fabrictest.link_kind(params, {"a": t}))
    assert (lim.kind, lim.min_gbps, lim.max_us) == (kind, *(fabrictest.KINDS[kind][i] for i in (2, 0)))
    assert "the default for " + kind in lim.why  # the NIC's rate is not what binds GPUs of one node


def test_nodes_of_several_gpus_are_held_to_the_link_between_them():
    t = fabrictest.parse_nccl(_text("nccl_graph_nvl.log"))
    params = _params(gpus=[0, 1], hcas=[])
    assert fabrictest.link_kind(params, {"a": t, "b": t}) == "ethernet"


def test_a_single_rank_skips_the_test_with_a_decision_saying_why():
    for params in (_one_node([0]), _one_node([])):
        why = fabrictest.single_rank(params)
        assert why is not None and "one rank in all" in why and "busbw is 0" in why
        decision = fabrictest.skip_decision(params, why)
        assert (decision.key, decision.choice) == ("fabric_test", "skipped")
    assert fabrictest.single_rank(_params(gpus=[])) is None  # two nodes without GPUs: one Gloo rank each
