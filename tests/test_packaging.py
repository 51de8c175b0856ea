"""The distribution installs nothing but the `llmgw` name (the edges and the simulator keep
their folders at the top of the repository and install below it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What a build reads; copied so that a stale build/ in the work tree cannot leak in.
BUILD_INPUTS = ("pyproject.toml", "README.md", "llmgw", "extproc", "asgi", "sim")


@pytest.mark.slow
def test_wheel_holds_only_llmgw_and_its_dist_info(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name,
                src / name,
                symlinks=True,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
            )
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path / "dist"
    # No build isolation: the venv's setuptools (the `native` extra) builds it, so the test
    # fetches no build environment from the index at run time.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(out),
        ],
        check=True,
        timeout=600,
        capture_output=True,
    )
    (wheel,) = out.glob("llmgw-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert len(top) == 2, sorted(top)
    assert "llmgw" in top, sorted(top)
    assert all(t == "llmgw" or (t.startswith("llmgw-") and t.endswith(".dist-info")) for t in top)
    for module in (
        "llmgw/extproc/server.py",
        "llmgw/asgi/proxy.py",
        "llmgw/sim/fleet.py",
        "llmgw/cli/demo.py",
        "llmgw/testing/extproc.py",
    ):
        assert module in names, module
