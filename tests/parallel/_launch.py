"""Launch a rank script under torchrun on CPU (gloo), one OpenMP thread per rank."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def torchrun(
    script: str, nproc: int, *args: str, timeout: int = 120, python: str = sys.executable
) -> subprocess.CompletedProcess:
    """Run ``tests/parallel/<script>`` on ``nproc`` ranks with ``python``; the repo root comes first on PYTHONPATH."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / "tests" / "parallel" / script),
        *args,
    ]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def expect(res: subprocess.CompletedProcess, line: str, nproc: int) -> None:
    """Every rank printed ``line`` (the checks before it in the rank script held)."""
    got = res.stdout.count(line)
    assert got == nproc, f"{line!r} printed by {got}/{nproc} ranks (exit {res.returncode}):\n{res.stderr[-3000:]}"
