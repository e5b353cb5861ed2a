"""A JupyterLab server on loopback and Debian's Chromium driven by selenium, for the browser test.

No browser builds are downloaded: Chromium and chromedriver are Debian's (`make setup` installs them),
the driver's path is given explicitly and Selenium Manager is told to stay offline.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
START_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def widgets_extension_active() -> bool:
    """ipywidgets' JupyterLab extension, as `jupyter labextension list` reports it."""
    out = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True, text=True,
                         timeout=120)
    lines = (out.stdout + out.stderr).splitlines()
    return any("@jupyter-widgets/jupyterlab-manager" in line and "enabled" in line and "OK" in line for line in lines)


@dataclass
class JupyterLab:
    """A running `jupyter lab` (this venv's kernel), token-protected, on 127.0.0.1."""

    proc: subprocess.Popen
    port: int
    token: str
    root: Path
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}?token={self.token}"

    def api(self, path: str, method: str = "GET") -> object:
        req = urllib.request.Request(f"{self.base}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    def stop(self) -> None:
        """Shut the kernels down through the API, then end the server by its PID."""
        if self.proc.poll() is None:
            try:
                for kernel in self.api("kernels"):  # type: ignore[union-attr]
                    self.api(f"kernels/{kernel['id']}", method="DELETE")
            except OSError:
                pass
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def start_lab(root: Path, home: Path) -> JupyterLab:
    """`jupyter lab` serving `root`, with its runtime, config and data dirs under `home`; interactive kernels
    (SPARKBOOK_HEADLESS removed from their environment, so progress shows as widgets)."""
    port, token = free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != "SPARKBOOK_HEADLESS"}
    for name in ("runtime", "config/labconfig", "data"):
        (home / name).mkdir(parents=True, exist_ok=True)
    (home / "config/labconfig/page_config.json").write_text(json.dumps(  # no "official Jupyter news?" toast
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    env.update(JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_CONFIG_DIR=str(home / "config"),
               JUPYTER_DATA_DIR=str(home / "data"), JUPYTER_PLATFORM_DIRS="1")
    log = home / "jupyterlab.log"
    argv = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
            f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
            "--ServerApp.port_retries=0", "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    lab = JupyterLab(proc, port, token, root, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            lab.api("status")
            return lab
        except OSError:
            time.sleep(0.5)
    lab.stop()
    raise TimeoutError(f"jupyter lab did not answer on port {port} within {START_TIMEOUT_S} s: {log}")


def chromium(profile: Path, width: int = 1400, height: int = 1000):  # type: ignore[no-untyped-def]
    """Headless Debian Chromium through Debian's chromedriver; nothing is downloaded."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, should anything reach for it, must not go online
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", f"--user-data-dir={profile}", "--no-first-run"):
        options.add_argument(arg)
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(profile.parent / "chromedriver.log"))
    return webdriver.Chrome(service=service, options=options)
