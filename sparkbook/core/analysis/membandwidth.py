"""The memory bandwidth the roofline and the decode ceilings divide by, and where the figure came from.

The card is the one the head reports (nvidia-smi's name), looked up in a table of datasheet figures; the params'
`benchmark.memory_bandwidth_gbs` overrides it, and where the two are more than MISMATCH apart the run says so (an
H100 once ran with an H200's 4,800 GB/s from its params without a word). A card the table lacks, with no override,
gets no roofline: the reason is recorded, the figure never guessed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..values.evidence import Finding

MISMATCH = 0.10  # an override this far from the card's datasheet figure is a finding
OVERRIDE = "override in params (benchmark.memory_bandwidth_gbs)"


@dataclass(frozen=True)
class Card:
    """A card as nvidia-smi names it (`pattern`, searched case-insensitively) and its datasheet bandwidth."""

    pattern: str
    name: str  # as its datasheet calls it
    gbs: float


# First match wins: a more specific name (H100 NVL, GH200) before the family's plain one (H100, H200).
CARDS = (
    Card(r"\bGB10\b", "GB10 (DGX Spark)", 273.0),  # DGX Spark datasheet: 128 GB LPDDR5x, 273 GB/s
    # GH200 Grace Hopper Superchip datasheet: 96 GB HBM3 at 4 TB/s, 144 GB HBM3e at 4.9 TB/s
    Card(r"\bGH200\b.*\b144G", "GH200 144GB HBM3e", 4900.0),
    Card(r"\bGH200\b", "GH200 96GB HBM3", 4000.0),
    Card(r"\bH200\b", "H200 (SXM or NVL)", 4800.0),  # H200 datasheet: 141 GB HBM3e, 4.8 TB/s both forms
    Card(r"\bH100 NVL\b", "H100 NVL", 3900.0),  # H100 datasheet: NVL 94 GB HBM3, 3.9 TB/s
    Card(r"\bH100\b.*\bPCIe\b", "H100 PCIe", 2000.0),  # H100 PCIe product brief: 80 GB HBM2e, 2,000 GB/s
    Card(r"\bH100\b", "H100 SXM", 3350.0),  # H100 datasheet: SXM 80 GB HBM3, 3.35 TB/s ("NVIDIA H100 80GB HBM3")
    Card(r"\bB200\b", "B200", 8000.0),  # HGX B200 datasheet: 8 TB/s HBM3e per GPU
    # A100 datasheet: 80 GB SXM 2,039 GB/s, 80 GB PCIe 1,935 GB/s, 40 GB (SXM and PCIe) 1,555 GB/s
    Card(r"\bA100\b.*80GB.*PCIe", "A100 80GB PCIe", 1935.0),
    Card(r"\bA100\b.*80GB", "A100 80GB SXM", 2039.0),
    Card(r"\bA100\b", "A100 40GB", 1555.0),
    Card(r"\bL40S\b", "L40S", 864.0),  # L40S datasheet: 48 GB GDDR6, 864 GB/s
    Card(r"\bL40\b", "L40", 864.0),  # L40 datasheet: 48 GB GDDR6, 864 GB/s
    Card(r"\bL4\b", "L4", 300.0),  # L4 datasheet: 24 GB GDDR6, 300 GB/s
    Card(r"\bRTX PRO 6000\b", "RTX PRO 6000 Blackwell", 1792.0),  # its datasheet: 96 GB GDDR7, 1,792 GB/s
    Card(r"\bRTX 6000 Ada\b", "RTX 6000 Ada", 960.0),  # its datasheet: 48 GB GDDR6, 960 GB/s
    Card(r"\bRTX 5090\b", "GeForce RTX 5090", 1792.0),  # its specifications: 32 GB GDDR7, 1,792 GB/s
    Card(r"\bRTX 4090\b", "GeForce RTX 4090", 1008.0),  # its specifications: 24 GB GDDR6X, 1,008 GB/s
)


def card(gpu_name: str) -> Card | None:
    """The table's entry for a card as nvidia-smi names it ('NVIDIA H100 80GB HBM3'); None: not in the table."""
    return next((c for c in CARDS if re.search(c.pattern, gpu_name, re.IGNORECASE)), None)


@dataclass(frozen=True)
class Bandwidth:
    """Per-node memory bandwidth in GB/s and where it came from; `gbs` None: no roofline, `source` says why."""

    gbs: float | None
    source: str
    finding: Finding | None = None  # the override far from the reported card's datasheet figure


def mismatch(override: float, gpu_name: str, found: Card) -> Finding | None:
    """The line a run page shows where the params' figure is more than MISMATCH from the card's (None: close)."""
    apart = (override - found.gbs) / found.gbs
    if abs(apart) <= MISMATCH:
        return None
    return Finding("warning", "bandwidth", f"benchmark.memory_bandwidth_gbs {override:g} GB/s is {100 * apart:+.0f} % "
                   f"from the {found.gbs:g} GB/s of the {gpu_name} the head reports ({found.name} datasheet): the "
                   "roofline and ceilings use the params' figure")


def bandwidth(override: float | None, gpu_name: str | None) -> Bandwidth:
    """The figure the roofline uses: the params' override, else the table's for the card the head reports, else
    none (said why)."""
    found = card(gpu_name) if gpu_name else None
    if override:
        return Bandwidth(override, OVERRIDE, mismatch(override, gpu_name, found) if gpu_name and found else None)
    if gpu_name and found:
        return Bandwidth(found.gbs, f"table entry for {gpu_name} ({found.name} datasheet)")
    what = f"unknown card {gpu_name!r} (not in the table of known cards)" if gpu_name else \
        "no card reported (nvidia-smi on the head names no GPU)"
    return Bandwidth(None, f"{what}: no roofline; set benchmark.memory_bandwidth_gbs for one")
