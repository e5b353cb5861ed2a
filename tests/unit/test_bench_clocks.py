"""06's GPU clocks (issue 31, item 7): nvidia-smi's CSV parsed from a recording on one H200, a drop beyond
benchmark.clock_drop flagged, nothing sampled where no node lists GPUs, a node without nvidia-smi named once, and
`compare` naming a clock difference between two runs as a likely cause."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sparkbook.core.cluster.nodes import Cluster
from sparkbook.core.values.params import load_params
from sparkbook.core.values.sweeppoint import SweepPoint
from sparkbook.records.compare import clock_causes
from sparkbook.stages.bench import tables
from sparkbook.stages.bench.clocks import Sampler, gpu_nodes, parse, summarize

DATA = Path(__file__).parent / "data" / "nvidia-smi-h200-clocks.txt"


def section(name: str) -> str:
    return DATA.read_text().split(f"## {name}\n")[1].split("## ")[0]


def test_the_recorded_csv_parses_with_its_header_skipped() -> None:
    idle = parse(section("idle"), "h200")
    assert [(s.node, s.gpu, s.sm_mhz, s.temperature_c, s.power_w) for s in idle] == [("h200", 0, 345.0, 34.0, 77.07)]
    load = parse(section("load"), "h200")
    assert [s.sm_mhz for s in load] == [345.0, 345.0, 1440.0, 1410.0, 1380.0, 1425.0]


def test_a_drop_beyond_clock_drop_is_flagged_from_the_points_start() -> None:
    under_load = parse(section("load"), "h200")[2:]  # the samples once the matmul loop ran: 1440 -> 1380 MHz
    (c,) = summarize(under_load, clock_drop=0.10)
    assert (c.sm_start_mhz, c.sm_min_mhz, c.temperature_max_c, c.samples) == (1440.0, 1380.0, 58.0, 4)
    assert c.drop_pct == pytest.approx(4.2) and not c.dropped  # 4.2 % inside the default 10 %
    assert summarize(under_load, clock_drop=0.03)[0].dropped
    (rise,) = summarize(parse(section("load"), "h200"), clock_drop=0.10)  # from idle up: no drop
    assert rise.drop_pct == 0.0 and not rise.dropped


def test_not_available_fields_are_none() -> None:
    """A DGX Spark answers [N/A] where it has no figure (its memory query; tests/unit/data/nvidia-smi-gb10.txt)."""
    (s,) = parse("0, 2405 MHz, 41, [N/A]\n", "spark")
    assert (s.sm_mhz, s.temperature_c, s.power_w) == (2405.0, 41.0, None)
    (c,) = summarize([s], 0.1)
    assert c.power_mean_w is None and c.drop_pct == 0.0


def test_the_table_shows_clocks_beside_the_figures_or_why_not() -> None:
    (c,) = summarize(parse(section("load"), "h200")[2:], clock_drop=0.03)
    point = SweepPoint.model_validate({"max_concurrency": 1, "output_throughput": 100.0,
                                       "sparkbook": {"clocks": [c]}})
    (row,) = tables.table([point])
    assert row["SM MHz start"] == "h200/0 1440" and row["SM MHz min"] == "h200/0 1380"
    assert row["clock drop"] == "h200/0 4.2 % DROPPED" and row["power W mean"] == "h200/0 695"
    lab = SweepPoint.model_validate({"max_concurrency": 1, "sparkbook": {"clocks_note": "not sampled: no GPUs"}})
    assert tables.table([lab])[0]["GPU clocks"] == "not sampled: no GPUs"
    assert tables.table([SweepPoint(max_concurrency=1)])[0]["GPU clocks"] == "not recorded"  # a point from before


def test_no_gpu_node_is_not_sampled_and_a_node_without_nvidia_smi_is_named(
        write_params: Callable[[dict[str, Any]], Path], base: dict[str, Any], tmp_path: Path) -> None:
    for node in base["nodes"]:
        node["transport"], node["gpus"] = "local", []
    cluster = Cluster(load_params(write_params(base)))
    try:
        assert gpu_nodes(list(cluster)) == []  # the params list no GPUs: nothing to sample
        with Sampler([]) as idle:
            pass
        assert idle.samples == [] and idle.errors == {}
        head = cluster.head
        with Sampler([head], interval_s=0.2) as sampler:  # this machine has no nvidia-smi
            pass
        assert sampler.samples == [] and head.name in sampler.errors and "nvidia-smi" in sampler.errors[head.name]
    finally:
        cluster.close()


def test_compare_names_a_clock_difference_as_a_likely_cause() -> None:
    load = parse(section("load"), "h200")

    def point(samples: list[Any]) -> SweepPoint:
        return SweepPoint.model_validate({"max_concurrency": 8, "sparkbook": {"clocks": summarize(samples, 0.1)}})

    boosted, capped = point(load[2:]), point([s.__class__(s.node, s.gpu, 1100.0, 80.0, 500.0) for s in load[2:]])
    (cause,) = clock_causes([boosted], [capped])
    assert cause.startswith("c=8: mean SM clock 1,414 MHz in A, 1,100 MHz in B (-22 %)") and "likely cause" in cause
    assert clock_causes([boosted], [point(load[3:])]) == []  # 1,414 vs 1,405 MHz: not apart
    assert clock_causes([SweepPoint(max_concurrency=8)], [capped]) == []  # A did not sample: no claim
