"""The A/B's notebooks (benchmark.ab: speculative): 05 and 06 run first as the baseline arm, without
serve.speculative, then as the params' own plan, on the same nodes one after the other; 06 of the second arm decides
which configuration stays serving, and where that is the baseline, 05 serves it again as the last notebook.

An arm is a notebook run under its own output name, `NN-name.ab-<arm>.ipynb`, with the notebook's `ab_arm`
parameter set: its record (decisions, events, logs) is filed under that name, its sweep points under ab-baseline/.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.handoff import AbVerdict
from ..core.params import Params
from ..core.state import load

SERVE, BENCH = "05", "06"
KEPT = "kept"


def arm_name(notebook: str, arm: str) -> str:
    return notebook.replace(".ipynb", f".ab-{arm}.ipynb")


def source(name: str) -> str:
    """The notebook an output name runs: `05-serve.ab-baseline.ipynb` runs `05-serve.ipynb`."""
    stem, _, arm = name.removesuffix(".ipynb").partition(".ab-")
    return f"{stem}.ipynb" if arm else name


def parameters(name: str) -> dict[str, Any]:
    """The notebook parameters of an arm's output name (none for the params' own plan)."""
    _, _, arm = name.removesuffix(".ipynb").partition(".ab-")
    return {"ab_arm": arm} if arm else {}


def with_arms(names: list[str], params: Params) -> list[str]:
    """`names` with the baseline arm's 05 and 06 before 05, where the params ask for an A/B and both 05 and 06 are
    among them (an A/B needs a server and a sweep on it; `--only 05` or `--upto 05` serves the params' plan)."""
    serve = [n for n in names if n.startswith(SERVE)]
    bench = [n for n in names if n.startswith(BENCH)]
    if params.benchmark.ab is None or len(serve) != 1 or len(bench) != 1:
        return names
    at = names.index(serve[0])
    return names[:at] + [arm_name(serve[0], "baseline"), arm_name(bench[0], "baseline")] + names[at:]


def follow_up(run_dir: Path, name: str, params: Params, names: list[str]) -> str | None:
    """After the second arm's 06: 05 once more, serving the baseline, where the A/B kept it (None otherwise)."""
    if params.benchmark.ab is None or not name.startswith(BENCH) or parameters(name):
        return None
    if load(run_dir, AbVerdict).kept == "speculative":
        return None
    return arm_name(next(n for n in names if n.startswith(SERVE)), KEPT)
