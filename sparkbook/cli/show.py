"""How the command line shows what sparkbook.api returns: tables of rows, and where a run went."""
from __future__ import annotations

from pathlib import Path

from ..core.values.rundir import INDEX


def table(rows: list[dict[str, str]], colwidth: int = 60, width: int = 250) -> str:
    """Rows as a plain-text table, each cell cut at `colwidth` characters."""
    import pandas as pd  # slow to import: only where a table is shown

    with pd.option_context("display.max_colwidth", colwidth, "display.width", width):
        return pd.DataFrame(rows).to_string(index=False)


def run_dir(path: Path) -> None:
    print(f"run dir: {path}\nindex:   {path / INDEX}")
