"""Launch a rank script under torchrun on CPU (gloo), one OpenMP thread per rank.

:func:`torchrun_once`: one launch per test run, whichever pytest-xdist worker asks first; the other
worker reads its output (worksteal can split a file's tests over both workers, and each would launch).
"""

from __future__ import annotations

import fcntl
import json
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


def torchrun_once(tmp_path_factory, key: str, script: str, nproc: int, *args: str, **kw) -> subprocess.CompletedProcess:
    """:func:`torchrun` once per test run for ``key``: the first worker to ask launches it (under a file
    lock) and leaves its output beside the workers' temporary folders; a later ask reads it back."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the folder that holds every worker's basetemp
    done, lock = shared / f"torchrun-{key}.json", shared / f"torchrun-{key}.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if done.is_file():
            out = json.loads(done.read_text())
            return subprocess.CompletedProcess(out["args"], out["returncode"], out["stdout"], out["stderr"])
        out_dir = shared / f"torchrun-{key}"
        out_dir.mkdir(exist_ok=True)
        res = torchrun(script, nproc, *(a.replace("{out}", str(out_dir)) for a in args), **kw)
        fields = {"args": res.args, "returncode": res.returncode, "stdout": res.stdout, "stderr": res.stderr}
        done.write_text(json.dumps(fields))
        return res
