"""Tensor parallelism across pyproject's transformers range: right or refused, never silently wrong.

transformers releases shard a model in different ways: DTensor weights (4.51 to 4.57, and 5.24), or plain
local shards marked on the module (``_hf_tp_plan`` / ``_hf_device_mesh``, e.g. 5.15), which kha_compile once
took for an unsharded model: ``kc.apply`` was accepted and each rank's KHA gradient was a partial sum.
The rank script (``_hf_versions_ranks.py``) runs in a side environment (``scripts/hf_env.sh VERSION``,
kept in ~/.cache/kha_compile) of the oldest release of the range and of 5.15.0; each order (kc.apply after
transformers sharded the model, or KHA applied before it loads) gives the loss and KHA gradients of one
process, or a KHAError. The newest release (the main venv's) is tests/parallel/test_transformers_parallel.py
(KHA before: trained like one process) and test_tensor_parallel.py (apply after: refused).
KHA_HF_ENVS=0 skips the side environments.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess

import pytest
from _launch import ROOT, expect, torchrun

import kha_compile as kc
from kha_compile.cli import tiny

pytest.importorskip("transformers")


def oldest() -> str:
    found = re.search(r'"transformers>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert found, "pyproject.toml's hf extra names no transformers>= bound"
    return found.group(1)


@functools.cache
def side_python(version: str) -> tuple[str | None, str]:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "hf_env.sh"), version], capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return done.stdout.strip().splitlines()[-1], ""


@pytest.mark.slow
@pytest.mark.parametrize("version", ["oldest", "5.15.0"])
def test_transformers_tensor_parallel_is_right_or_refused(version, tmp_path):
    if os.environ.get("KHA_HF_ENVS") == "0":
        pytest.skip("KHA_HF_ENVS=0: the side transformers environments are off")
    version = oldest() if version == "oldest" else version
    python, reason = side_python(version)
    if python is None:
        pytest.skip(f"the transformers {version} environment could not be built here: {reason}")
    res = torchrun("_hf_versions_ranks.py", 2, str(tmp_path), timeout=400, python=python)
    expect(res, f"OK apply after transformers tp: refused (transformers {version}", 2)
    expect(res, "OK apply before transformers tp: ", 2)  # right (equal to one process) or refused: both say OK


def test_local_shards_left_by_transformers_are_refused():
    """The marks transformers 5.15 leaves on a module it sharded with a plain local tensor: apply refuses."""
    model = tiny.make("tiny-llama")
    assert not kc.parallel.is_sharded(model)
    q = model.model.layers[0].self_attn.q_proj
    q.weight = type(q.weight)(q.weight.detach()[: q.out_features // 2].clone())  # rank 0's rows
    q.__dict__.update(_hf_tp_plan="colwise", _hf_device_mesh=object())
    model.__dict__["_tp_size"] = 2
    assert kc.parallel.is_sharded(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(kc.errors.ShardedModelError, match=r"sharded by transformers \(tp_plan, tp_size=2; module "):
        kc.apply(model, kc.KHAConfig())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)
