"""What the lab needs on the root machine itself: Debian packages and Python packages.

Installs only what is missing, so on a prepared machine this is a few dpkg-query calls (< 1 s).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence

Progress = Callable[[str], None] | None

APT_PACKAGES = ("docker.io", "openssh-server", "openssh-client", "debootstrap", "iptables", "iproute2",
                "iputils-ping", "tini", "procps", "util-linux", "ca-certificates", "curl")
# import name -> pip requirement
PIP_PACKAGES = {"paramiko": "paramiko>=3", "yaml": "pyyaml"}


def _say(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)


def missing_apt_packages(packages: Sequence[str] = APT_PACKAGES) -> list[str]:
    if not shutil.which("dpkg-query"):
        return []
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${db:Status-Status}\n", *packages],
                         capture_output=True, text=True, timeout=60).stdout
    installed = {line.split()[0] for line in out.splitlines() if line.endswith(" installed")}
    return [p for p in packages if p not in installed]


def ensure_host_packages(progress: Progress = None) -> list[str]:
    """apt-get install the missing lab packages; returns what was installed."""
    missing = missing_apt_packages()
    if missing:
        _say(progress, f"host: apt-get install {' '.join(missing)}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=True, timeout=600, env=env,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], check=True,
                       timeout=1800, env=env, stdout=subprocess.DEVNULL)
    return missing


def ensure_python_packages(progress: Progress = None) -> list[str]:
    """pip install the Python packages the lab imports, if they are missing; returns what was installed."""
    missing = [req for mod, req in PIP_PACKAGES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        _say(progress, f"host: pip install {' '.join(missing)}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True, timeout=900)
        importlib.invalidate_caches()
    return missing


def ensure_host(progress: Progress = None) -> list[str]:
    """Everything the lab needs on the host, installed when missing."""
    return ensure_host_packages(progress) + ensure_python_packages(progress)

