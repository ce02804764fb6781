"""The diffusers sweep in the suite: a representative chunk of model classes (``CI_CLASSES``) and of
attention processors (``CI_PROCESSORS``), each built tiny, through apply, an independent attention
count, identity, perturbation, fold and a per-head reference (``tests/sweep_diffusers_models.py``,
``tests/sweep_diffusers_processors.py``, ``tests/sweep_cases.py``). ``python scripts/sweep_diffusers.py
run`` runs every class and processor and writes ``docs/diffusers_sweep.md``."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

import sweep_diffusers_models as sdm
import sweep_diffusers_processors as sdp
from sweep_cases import KHA_CONFIGS


@pytest.mark.slow
@pytest.mark.parametrize("name", sdm.CI_CLASSES)
def test_model_class(name):
    recs = sdm.run_class(name)
    assert [r["status"] for r in recs] == ["pass"] * len(KHA_CONFIGS), recs
    assert all(r["reference_rel_err"] <= 1e-4 for r in recs), recs  # every attention is an Attention


@pytest.mark.parametrize("name", sdp.CI_PROCESSORS)
def test_processor(name):
    recs = sdp.run_processor(name)
    assert [r["status"] for r in recs] == ["pass"] * len(KHA_CONFIGS), recs
    assert all(r["reference_rel_err"] <= 1e-4 for r in recs), recs


def test_sanas_linear_attention_processor_is_a_site():
    """ReLU linear attention with a ones row padded onto the values (its per-head reference is
    tests/analysis/rules/test_linear_attention.py's ``ones_column`` form)."""
    recs = sdp.run_processor("SanaLinearAttnProcessor2_0")
    assert [(r["status"], r["sites"]) for r in recs] == [("pass", [("matmul_1", "matched", "")])] * len(KHA_CONFIGS)


def test_every_model_class_has_a_tiny_config_or_is_named_as_missing():
    from sweep_diffusers_specs import SPECS

    missing = set(sdm.model_classes()) - set(SPECS) - set(sdm.SIBLINGS)
    assert len(missing) < len(SPECS), sorted(missing)  # the sweep's table lists these as not counted
