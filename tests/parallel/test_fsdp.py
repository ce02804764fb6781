"""FSDP2 edges (kha_compile/parallel/fsdp.py) and DDP on 2 CPU ranks, one launch for every check.

DDP after kc.apply matches one process on the combined batch.
Apply/inspect after fully_shard refused with the model intact (it still trains); save_pretrained
from every rank -> a fresh single-process load_pretrained gives the same logits; fold refused
with nothing changed; a DCP save/load round trip, gathered and folded, gives the same logits.
"""

from __future__ import annotations

import pytest
from _launch import expect, torchrun_once

pytestmark = pytest.mark.slow  # torchrun launches (2-4 ranks)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return torchrun_once(tmp_path_factory, "fsdp", "_fsdp_ranks.py", 2, "{out}")


def test_ddp_after_apply_matches_single_process(fsdp_run):
    expect(fsdp_run, "OK ddp matches single process", 2)


def test_apply_after_fully_shard_is_refused_and_model_still_trains(fsdp_run):
    expect(fsdp_run, "OK refused, still trains", 2)


def test_sharded_save_loads_in_one_process(fsdp_run):
    expect(fsdp_run, "OK sharded save -> single-process load", 2)


def test_fold_of_sharded_model_is_refused_unchanged(fsdp_run):
    expect(fsdp_run, "OK fold refused", 2)


def test_dcp_round_trip_folds_to_same_outputs(fsdp_run):
    expect(fsdp_run, "OK dcp round trip folds to the same outputs", 2)
