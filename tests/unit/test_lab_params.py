"""The params of a lab beside the default one (SPARKBOOK_LAB_ID): its nodes are named as the default lab's, so
their state dirs (the run lock among them) must be their own, or two labs' runs refuse each other."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from sparkbook.core.values.params import load_params

READ = "import sparkbook.lab as lab; print(lab.params_file(2))"


def _lab_params(lab_id: str, home: Path) -> dict:
    env = {"SPARKBOOK_LAB_ID": lab_id, "SPARKBOOK_LAB_HOME": str(home), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", READ], env=env, capture_output=True, text=True, timeout=60, check=True)
    path = Path(out.stdout.strip())
    return {"path": path, "data": yaml.safe_load(path.read_text())}


def test_another_lab_id_keeps_its_nodes_state_apart(tmp_path):
    other = _lab_params("7", tmp_path)
    dirs = [n["state_dir"] for n in other["data"]["nodes"]]
    assert dirs == ["/root/.sparkbook-7/lab-0", "/root/.sparkbook-7/lab-1"]
    for name in ("key_file", "known_hosts"):  # what `sparkbook lab up` makes
        Path(other["data"]["ssh"][name]).parent.mkdir(exist_ok=True)
        Path(other["data"]["ssh"][name]).write_text("")
    assert [n.state_dir for n in load_params(other["path"]).nodes] == dirs, "the params take them as they are"
    default = _lab_params("0", tmp_path / "other-home")
    assert all("state_dir" not in n for n in default["data"]["nodes"]), "the default lab: ~/.sparkbook/NAME"
