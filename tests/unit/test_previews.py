"""`sparkbook plan`'s choice of the image the stages after 03 are previewed for, on the committed lab records: the
last good deployment's, else the newest run's 03 choice (`run --to 04` deploys nothing), else none (03's first
candidate); and what it does with a stage it cannot tell: not known before a run acts (shown, exit 0), or a preview
that failed (exit 1)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from rundirs import reseal

from sparkbook import cli
from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.nodes import NodeError
from sparkbook.core.values.evidence import NotKnownYet, Shown
from sparkbook.core.values.params import load_params
from sparkbook.core.values.stagelist import STAGES
from sparkbook.core.values.state import Handoff, MissingState
from sparkbook.runbook import previews
from sparkbook.runbook.previews import StagePlan, shown_for

REPO = Path(__file__).resolve().parents[2]
EXAMPLES, LAB = REPO / "outputs" / "examples" / "lab", REPO / "params" / "lab.yaml"
GOOD, FAILED = "20261201T195946Z", "20261201T200508Z"  # 05 ended ok; 05 failed (its server died)


def _copy(run: str, outputs: Path, *names: str) -> None:
    """Files of a committed run, sealed as this controller's runbook would have written them."""
    (outputs / "lab" / run).mkdir(parents=True)
    for name in names:
        reseal(Path(shutil.copy(EXAMPLES / run / name, outputs / "lab" / run / name)))


def test_the_stages_after_03_are_shown_for_the_deployment_else_the_newest_03_choice(tmp_path: Path) -> None:
    known_hosts = tmp_path / "known_hosts"  # its lab's (lab 1), which this machine may never have brought up
    known_hosts.touch()
    params = load_params(EXAMPLES / GOOD / "params.yaml",  # the params it deployed with: the lab's fabric has moved
                         {"ssh.known_hosts": str(known_hosts)})
    assert shown_for(params, tmp_path) is None, "no run: 03's first candidate"
    _copy(FAILED, tmp_path, "state.json", "manifest.json")
    found = shown_for(params, tmp_path)
    assert found is not None and found[1] == f"run {FAILED}'s 03 chose", found
    _copy(GOOD, tmp_path, "state.json", "manifest.json")
    found = shown_for(params, tmp_path)
    assert found is not None and found[1] == "the last good deployment serves", "what serves comes first"
    assert found[0].ref == "sparkbook-lab/vllm-cpu:0.32.0"


class Door:
    """A stage's front door whose preview shows one line, or raises what it is given."""

    def __init__(self, raises: Exception | None = None) -> None:
        self.raises = raises

    def preview(self, ctx: Context) -> Seen:
        if self.raises is not None:
            raise self.raises
        return Seen()


@dataclass(frozen=True)
class Seen:
    assumed: tuple[Handoff, ...] = ()

    def shown(self) -> list[Shown]:
        return [Shown("what it would do", "one line")]


def planned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, raising: dict[str, Exception]) -> list[StagePlan]:
    monkeypatch.setattr(previews, "FRONT_DOORS", {s: Door(raising.get(s.id)) for s in STAGES})
    params = load_params(LAB)
    return previews.preview(Context(params, None, None, tmp_path), tmp_path)  # type: ignore[arg-type]


def test_what_is_not_known_before_a_run_is_shown_as_unknown_and_fails_nothing(monkeypatch, tmp_path) -> None:
    """Issue 54, item 6: `sparkbook plan` exits 0 when it showed what it could; a stage that cannot be told before a
    run acts (an image not on the head yet, a hand-off no preview assumes) says so and the rest are still shown."""
    plans = planned(monkeypatch, tmp_path, {"05": NotKnownYet("lab-0 holds no img"),
                                            "06": MissingState("'endpoint' is not known yet")})
    assert [p.why for p in plans][4:] == ["not known before a run acts: lab-0 holds no img",
                                          "not known before a run acts: 'endpoint' is not known yet"]
    assert all(p.shown and p.why is None for p in plans[:4]) and previews.showed_what_it_could(plans)


def test_a_preview_that_fails_fails_the_plan_and_the_stages_after_it_are_still_shown(monkeypatch, tmp_path) -> None:
    plans = planned(monkeypatch, tmp_path, {"02": NodeError("lab-1", "SSH: connection refused")})
    assert plans[1].failed == "its preview failed: lab-1: SSH: connection refused" and plans[1].unknown is None
    assert all(p.shown for p in plans[2:]) and not previews.showed_what_it_could(plans)


def test_sparkbook_plan_exits_0_when_it_showed_what_it_could_and_1_when_a_preview_failed(monkeypatch, tmp_path,
                                                                                          capsys) -> None:
    for raising, code in (({"05": NotKnownYet("lab-0 holds no img")}, 0), ({"01": OSError("no route")}, 1)):
        monkeypatch.setattr(previews, "FRONT_DOORS", {s: Door(raising.get(s.id)) for s in STAGES})
        assert cli.main(["plan", str(LAB), "--outputs", str(tmp_path)]) == code
        out = capsys.readouterr().out
        assert out.count("-- what it would do") == 5 and "NaN" not in out
