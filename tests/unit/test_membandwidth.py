"""The memory bandwidth the roofline divides by: the card the head reports looked up in the table of datasheet
figures, the params' figure an override, each saying where it came from; an unknown card gets none, never a guess."""
from __future__ import annotations

import pytest

from sparkbook.core.analysis.membandwidth import OVERRIDE, bandwidth, card


@pytest.mark.parametrize(("reported", "gbs"), [
    ("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0), ("NVIDIA H100 NVL", 3900.0),
    ("NVIDIA H200", 4800.0), ("NVIDIA H200 NVL", 4800.0), ("NVIDIA GB10", 273.0), ("NVIDIA GH200 480GB", 4000.0),
    ("NVIDIA GH200 144G HBM3e", 4900.0), ("NVIDIA B200", 8000.0), ("NVIDIA A100-SXM4-80GB", 2039.0),
    ("NVIDIA A100 80GB PCIe", 1935.0), ("NVIDIA A100-PCIE-40GB", 1555.0), ("NVIDIA L40S", 864.0),
    ("NVIDIA L4", 300.0), ("NVIDIA GeForce RTX 4090", 1008.0), ("NVIDIA RTX 6000 Ada Generation", 960.0)])
def test_the_table_knows_cards_by_the_name_nvidia_smi_reports(reported: str, gbs: float) -> None:
    found = card(reported)
    assert found is not None and found.gbs == gbs


def test_a_card_the_table_lacks_has_no_figure() -> None:
    assert card("NVIDIA GB200") is None, "a GB200 is not a B200 by its name's tail"
    assert card("Intel(R) Xeon CPU") is None and card("NVIDIA Tesla T4") is None


def test_the_reported_card_gives_the_figure_and_names_its_entry() -> None:
    got = bandwidth(None, "NVIDIA H200")
    assert (got.gbs, got.source, got.finding) == (4800.0, "table entry for NVIDIA H200 (H200 (SXM or NVL) datasheet)",
                                                  None)


def test_the_params_figure_overrides_and_a_close_one_is_no_finding() -> None:
    got = bandwidth(3200.0, "NVIDIA H100 80GB HBM3")  # -4.5 %: within 10 %
    assert (got.gbs, got.source, got.finding) == (3200.0, OVERRIDE, None)
    assert bandwidth(20.0, None) == bandwidth(20.0, "a CPU") == type(got)(20.0, OVERRIDE), \
        "the lab's override on nodes without a known card: nothing to compare it with"


def test_an_override_more_than_ten_percent_from_the_card_is_a_finding_not_an_error() -> None:
    got = bandwidth(4800.0, "NVIDIA H100 80GB HBM3")
    assert got.gbs == 4800.0 and got.source == OVERRIDE and got.finding is not None
    assert (got.finding.severity, got.finding.topic) == ("warning", "bandwidth")
    assert got.finding.text == ("benchmark.memory_bandwidth_gbs 4800 GB/s is +43 % from the 3350 GB/s of the NVIDIA "
                                "H100 80GB HBM3 the head reports (H100 SXM datasheet): the roofline and ceilings use "
                                "the params' figure")
    assert bandwidth(250.0, "NVIDIA GB10").finding is None and bandwidth(240.0, "NVIDIA GB10").finding is not None, \
        "-8.4 % is within the band, -12.1 % is not"


def test_no_figure_without_a_known_card_or_an_override_says_why() -> None:
    unknown = bandwidth(None, "NVIDIA Quadro K2200")
    assert unknown.gbs is None and unknown.source == ("unknown card 'NVIDIA Quadro K2200' (not in the table of known "
                                                      "cards): no roofline; set benchmark.memory_bandwidth_gbs for one")
    none = bandwidth(None, None)
    assert none.gbs is None and none.source.startswith("no card reported (nvidia-smi on the head names no GPU)")
