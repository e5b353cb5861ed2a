"""`sparkbook plan`'s choice of the image the stages after 03 are previewed for, on the committed lab records: the
last good deployment's, else the newest run's 03 choice (`run --to 04` deploys nothing), else none (03's first
candidate)."""
from __future__ import annotations

import shutil
from pathlib import Path

from sparkbook.core.values.params import load_params
from sparkbook.runbook.previews import shown_for

REPO = Path(__file__).resolve().parents[2]
EXAMPLES, LAB = REPO / "outputs" / "examples" / "lab", REPO / "params" / "lab.yaml"
GOOD, FAILED = "20261201T195946Z", "20261201T200508Z"  # 05 ended ok; 05 failed (its server died)


def _copy(run: str, outputs: Path, *names: str) -> None:
    (outputs / "lab" / run).mkdir(parents=True)
    for name in names:
        shutil.copy(EXAMPLES / run / name, outputs / "lab" / run / name)


def test_the_stages_after_03_are_shown_for_the_deployment_else_the_newest_03_choice(tmp_path: Path) -> None:
    params = load_params(LAB)
    assert shown_for(params, tmp_path) is None, "no run: 03's first candidate"
    _copy(FAILED, tmp_path, "state.json", "manifest.json")
    found = shown_for(params, tmp_path)
    assert found is not None and found[1] == f"run {FAILED}'s 03 chose", found
    _copy(GOOD, tmp_path, "state.json", "manifest.json")
    found = shown_for(params, tmp_path)
    assert found is not None and found[1] == "the last good deployment serves", "what serves comes first"
    assert found[0].ref == "sparkbook-lab/vllm-cpu:0.32.0"
