"""The transformers sweep in the suite: a representative chunk of model types (``CI_TYPES``), each
built tiny from its default config, through apply, an independent attention count, identity,
perturbation and fold (``tests/sweep_cases.py``). ``KHA_SWEEP=all`` runs every type;
``python scripts/sweep_transformers.py run`` runs them all and writes ``docs/transformers_sweep.md``."""

from __future__ import annotations

import functools
import os

import pytest

pytest.importorskip("transformers")

from sweep_cases import CI_TYPES, KHA_CONFIGS, run_type
from sweep_configs import model_types

TYPES = sorted(model_types()) if os.environ.get("KHA_SWEEP") == "all" else list(CI_TYPES)


@functools.cache
def _records(model_type: str) -> dict[str, dict]:
    """Every config of one type, as the sweep script runs them: built and counted once, each config on a copy
    (the tests of one type are next to each other, so one worker runs them)."""
    return {rec["config"]: rec for rec in run_type(model_type)}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(KHA_CONFIGS))
@pytest.mark.parametrize("model_type", TYPES)
def test_model_type(model_type, config):
    rec = _records(model_type)[config]
    if rec["status"] == "not_counted" and os.environ.get("KHA_SWEEP") == "all":
        pytest.skip(f"transformers cannot build {model_type} tiny: {rec.get('error')}")
    assert rec["status"] in ("pass", "skipped", "no_attention"), rec
    if rec["status"] == "skipped":  # declined with a reason for every counted attention call
        assert rec["sites"] and all(reason for _, _, reason in rec["sites"]), rec
