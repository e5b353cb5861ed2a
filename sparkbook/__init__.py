"""sparkbook: a notebook runbook from an old GPU deployment to vLLM over Ray, benchmarked."""
from .core.evidence import Alternative, Decision
from .core.nodes import Result, shell
from .core.params import ParamsError, load_params
from .runbook.session import Run, open_run

__all__ = ["Alternative", "Decision", "ParamsError", "Result", "Run", "load_params", "open_run", "shell"]
