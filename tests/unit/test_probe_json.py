"""The probes' one output convention: a JSON line and an end marker, read back whole or refused by name."""
from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime

import pytest

from sparkbook.core.cluster import probes
from sparkbook.core.cluster.nodes import Result
from sparkbook.core.values.errors import ProbeOutputError

WHOLE = 'ray: a warning on stdout\nSPARKBOOK-JSON {"nodes": [], "placement_groups": []}\nSPARKBOOK-END\n'


def _refused(text: str) -> ProbeOutputError:
    with pytest.raises(ProbeOutputError) as info:
        probes.parse(text, node="lab-4", probe="Ray's node table")
    return info.value


def test_a_whole_reply_gives_its_document() -> None:
    assert probes.parse(WHOLE, node="lab-0", probe="p") == {"nodes": [], "placement_groups": []}
    result = Result("lab-0", ("python3",), 0, WHOLE, "", datetime.now(UTC), 0.1, False)
    assert probes.parse(result, node="lab-0", probe="p")["nodes"] == []


@pytest.mark.parametrize("cut", [len(WHOLE) - 5, WHOLE.index("SPARKBOOK-END"), WHOLE.index('"placement')])
def test_a_cut_reply_names_the_missing_end_marker(cut: int) -> None:
    error = _refused(WHOLE[:cut])
    assert (error.node, error.probe, error.missing, error.received_bytes) == ("lab-4", "Ray's node table",
                                                                             "end marker", cut)
    assert str(error).startswith(f"lab-4: Ray's node table: the probe's output has no end marker ({cut} bytes")


@pytest.mark.parametrize(("text", "missing"), [
    ("", "SPARKBOOK-JSON line"),
    ("Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named 'ray'\n", "SPARKBOOK-JSON line"),
    ("SPARKBOOK-JSON {not json\nSPARKBOOK-END\n", "decodable JSON document"),
    ("SPARKBOOK-JSON [1, 2]\nSPARKBOOK-END\n", "decodable JSON document"),
])
def test_garbage_is_refused_naming_what_is_missing(text: str, missing: str) -> None:
    error = _refused(text)
    assert error.missing == missing and error.received_bytes == len(text.encode())


@pytest.mark.parametrize(("name", "args", "key"), [("netdev_ips", ["lo"], "addresses"),
                                                    ("port_open", ["127.0.0.1", "9"], "open"),
                                                    ("bind", ["127.0.0.1", "0"], "bound")])
def test_every_probe_prints_by_the_convention(name: str, args: list[str], key: str) -> None:
    out = subprocess.run([sys.executable, "-I", "-c", probes.source(name), *args], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert out.splitlines()[-1] == probes.END
    assert key in probes.parse(out, node="here", probe=name)
