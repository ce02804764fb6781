"""Fixtures shared by the exporter tests: the C++ AOTInductor runner of examples/aoti_cpp, built once."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def aoti_runner(tmp_path_factory) -> pathlib.Path:
    """examples/aoti_cpp/kha_aoti_runner built with build.sh against this torch (10-25 s of g++ on two cores)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine")
    runner = tmp_path_factory.mktemp("aoti_cpp") / "kha_aoti_runner"
    build = subprocess.run(
        ["bash", str(REPO / "examples/aoti_cpp/build.sh"), sys.executable, str(runner)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    return runner
