"""transformers' own parallel loading with KHA (kha_compile/model/sharded.py, carrier.py), 2 CPU ranks.

KHA applied before transformers shards the model (``from_pretrained(d, distributed_config=...)``
after a subclass or quantizer applied it in ``__init__``): its tensor-parallel plan gives losses, KHA
gradients, KHA weights after two SGD steps and no_grad logits equal to one process within 1e-5;
an inference-first model refuses with what to do until its projections adopt their local heads;
its FSDP2 plan the same. KHA applied after transformers sharded the model is refused with the order
that works (the tp_plan case: tests/parallel/test_tensor_parallel.py). See ``_hf_parallel_ranks.py``.
"""

from __future__ import annotations

import pytest
from _launch import expect, torchrun_once

pytestmark = pytest.mark.slow  # torchrun launches (2-4 ranks)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    return torchrun_once(tmp_path_factory, "hf_parallel", "_hf_parallel_ranks.py", 2, "{out}", timeout=300)


def test_kha_before_transformers_tensor_parallel_trains_like_one_process(hf_run):
    expect(hf_run, "OK transformers tp trained", 2)


def test_inference_first_under_transformers_tensor_parallel_is_refused_until_adopted(hf_run):
    expect(hf_run, "OK transformers tp inference after adopt", 2)


def test_from_pretrained_by_path_under_transformers_tensor_parallel_runs_inference_and_trains(hf_run):
    expect(hf_run, "OK from_pretrained by path under tp", 2)


def test_kha_before_transformers_fsdp2_trains_like_one_process(hf_run):
    expect(hf_run, "OK transformers fsdp2 trained", 2)


def test_apply_after_transformers_fsdp2_is_refused_with_the_order(hf_run):
    expect(hf_run, "OK transformers fsdp then apply refused", 2)
