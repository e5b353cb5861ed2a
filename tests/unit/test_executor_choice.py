"""05's executor (issue 40, item 8): an explicit serve.executor is what serves, TP x PP = 1 included; only an unset
one is chosen by the ranks and the platform; Ray on vLLM's CPU build is refused before anything starts."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparkbook.core.cluster.context import Context
from sparkbook.core.values.params import load_params
from sparkbook.stages.serve.commands import DEFAULT, Platform, ServeError, choose_executor

LAB = Path(__file__).resolve().parents[2] / "params" / "lab.yaml"
CUDA = Platform("cuda", "0.25.0", "2.9.0+cu129", 1, "2.60.0")
CPU = Platform("cpu", "0.32.0+cpu", "2.13.0+cpu", 0, "2.60.0")


def _ctx(executor: str | None, tp: int) -> Context:
    params = load_params(LAB)
    serve = params.serve.model_copy(update={"executor": executor, "tensor_parallel_size": tp})
    return Context(params.model_copy(update={"serve": serve}), None, None, Path("/tmp"))  # type: ignore[arg-type]


@pytest.mark.parametrize("executor, tp, platform, chosen", [
    (None, 1, CUDA, DEFAULT), (None, 2, CUDA, "ray"), (None, 2, CPU, "mp"),
    ("mp", 1, CUDA, "mp"), ("ray", 1, CUDA, "ray"), ("mp", 2, CUDA, "mp"), ("ray", 2, CUDA, "ray"), ("mp", 2, CPU, "mp"),
])
def test_an_explicit_executor_is_honoured_and_an_unset_one_chosen(executor, tp, platform, chosen) -> None:
    got, decision = choose_executor(_ctx(executor, tp), platform)
    assert got == chosen and decision.key == "executor"
    assert ("params set serve.executor" in decision.reason) == (executor is not None)


def test_an_unset_executor_on_an_image_without_ray_is_vllms_own_multinode_launch() -> None:
    """Issue 45: stock vLLM images carry no Ray; 04 formed none, so 05 serves with mp (and says why)."""
    got, decision = choose_executor(_ctx(None, 2), Platform("cuda", "0.33.0", "2.10.0+cu130", 1, None))
    assert got == "mp" and "no Ray" in decision.reason and "Ray absent" in decision.evidence
    got, _ = choose_executor(_ctx("ray", 2), Platform("cuda", "0.33.0", "2.10.0+cu130", 1, None))
    assert got == "ray", "an explicit setting is honoured (03 rejects an image without Ray for it)"


def test_ray_on_the_cpu_build_is_refused_naming_the_field() -> None:
    with pytest.raises(ServeError, match="serve.executor is ray.*CPU build refuses Ray") as err:
        choose_executor(_ctx("ray", 2), CPU)
    assert "serve.executor: mp" in str(err.value)
