"""Stand-in notebooks for the driver's tests: a tagged parameters cell and one body cell, run by papermill as the
real notebooks are (the driver, its A/B arms, resume and skip logic need no lab)."""
from __future__ import annotations

from pathlib import Path

import nbformat


def write_notebook(folder: Path, name: str, parameters: str, body: str) -> None:
    """`folder/name`: a parameters cell (`parameters`: its source, papermill's defaults) and `body`."""
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell(parameters)
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, folder / name)
