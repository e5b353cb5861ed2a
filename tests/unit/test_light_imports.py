"""Reading a run's state or archiving it loads neither the SSH nor the Docker stack (issue 54): the value floor of
core stands on nothing that talks to a node, so the records and an importer of the schema stay light."""
from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("paramiko", "docker")


def loaded(module: str) -> list[str]:
    """The heavy packages that importing `module` in a fresh interpreter loads."""
    code = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()


@pytest.mark.parametrize("module", ["sparkbook.core.values.state", "sparkbook.core.values.handoff",
                                    "sparkbook.records.archive", "sparkbook", "sparkbook.core.analysis.benchcompare"])
def test_the_schema_and_the_archive_load_no_ssh_or_docker(module: str) -> None:
    assert loaded(module) == []


def test_the_check_sees_a_heavy_import() -> None:
    assert loaded("sparkbook.core.cluster.nodes") == ["paramiko"]
