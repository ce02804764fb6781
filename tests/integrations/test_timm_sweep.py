"""The timm sweep in the suite: a representative chunk of architectures (``CI_ARCHS``), each built with
small depths, through apply, an independent attention count, identity, perturbation, fold and, for
timm's own ``Attention``, a per-head reference (``tests/sweep_timm_models.py``, ``tests/sweep_cases.py``).
``python scripts/sweep_timm.py run`` runs every family and writes ``docs/timm_sweep.md``."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("timm") is None:
    pytest.skip(
        "timm is not installed (scripts/_venv.sh installs it without its dependencies)", allow_module_level=True
    )

from torch import nn

import sweep_timm_models as stm
from reference import Proj, _stacked
from sweep_cases import KHA_CONFIGS, run_built


@pytest.mark.slow
@pytest.mark.parametrize("name", stm.CI_ARCHS)
def test_architecture(name):
    recs = stm.run_arch(name)
    assert [r["status"] for r in recs] == ["pass"] * len(KHA_CONFIGS), recs
    if name == "vit_small_patch16_224":  # timm's own Attention: checked per head too
        assert all(r["reference_rel_err"] <= 1e-4 for r in recs), recs


def test_timm_imports_beside_a_torchvision_stand_in_that_is_gone_afterwards():
    import sys

    timm = stm.import_timm()
    assert "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None
    model, how = stm.build("vit_small_patch16_224")
    assert how == "depths shrunk" and len(model.blocks) == stm.DEPTH
    assert "vit_small_patch16_224" in timm.list_models()


def _wrong_roles(model: nn.Module, cfg: object) -> list[Proj]:
    """timm's fused qkv read as [K | Q | V]: the shapes fit, the roles do not."""
    out = []
    for path, m in stm._standard(model):
        h, dh = m.num_heads, m.head_dim
        out.append(Proj(f"{path}.qkv", ("q", "k", "v"), _stacked((("k", h), ("q", h), ("v", h)), dh)))
    return out


def test_the_per_head_reference_fails_on_a_wrong_layout():
    def make():
        model, _ = stm.build("vit_small_patch16_224")
        return model, stm.example_args(model), {}

    recs = run_built(make, ("linear_qkv",), {"model_type": "vit"}, pass_inputs=True, layout=lambda *_: _wrong_roles)
    assert recs[0]["status"] == "fail" and recs[0]["category"] == "per-head reference mismatch", (
        recs[0].get("category"),
        recs[0].get("error"),
    )
