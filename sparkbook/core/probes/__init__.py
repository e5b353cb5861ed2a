"""Standalone scripts that run inside candidate images (stdlib only; each prints one JSON document)."""
from importlib.resources import files


def source(name: str) -> str:
    """The text of probe `name` (e.g. "registry"), to pass as `python3 -c SOURCE ARGS...`."""
    return (files(__name__) / f"{name}.py").read_text()
