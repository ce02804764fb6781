"""Tensor parallel with KHA (kha_compile/parallel/tensor_parallel.py, plans.py, sharding.py), 2 and 4 CPU ranks.

The rank script compares against a single-process run of the same model, 192 tokens (more than
d_model, so one process runs linear KHA weight-side and TP token-side): the loss of each of 2 SGD
steps, the KHA gradients of the first, the KHA weights after the second and the no_grad logits
after training, within 1e-5, and checks that every rank ends with the same KHA weights; through
kc.parallelize, torch's plain parallelize_module and plan="auto".
"""

from __future__ import annotations

import pytest
import torch
from _launch import expect, torchrun, torchrun_once

from kha_compile.cli import tiny
from kha_compile.core.errors import TensorParallelError
from kha_compile.model.sharded import local_slots
from kha_compile.model.slots import HeadSlot
from kha_compile.parallel.plans import torch_plan

pytestmark = pytest.mark.slow  # torchrun launches (2-4 ranks)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    return torchrun_once(tmp_path_factory, "tp", "_tp_ranks.py", 2, "tp", "{out}/kha")


def test_mlp_value_dtensor_rule(tp_run):
    expect(tp_run, "OK mlp_value DTensor", 2)  # Shard(0)/Shard(1) v, Replicate weights: forward and grads


@pytest.mark.parametrize("how", ["kc", "plain"])
@pytest.mark.parametrize("cfg", ["linear", "mlp"])
def test_tp_llama_matches_single_process(tp_run, cfg, how):
    # q, k, v linear / q, k linear + v mlp; GQA 4 q / 2 kv heads; kc.parallelize / torch's parallelize_module
    expect(tp_run, f"OK tp {how} llama {cfg}", 2)


def test_tp_auto_plan_matches_single_process_with_tied_embeddings(tp_run):
    expect(tp_run, "OK tp auto plan", 2)  # model.tp_plan translated to torch styles; embed / lm_head stay tied


def test_transformers_tp_plan_model_is_refused_with_the_route(tp_run):
    expect(tp_run, "OK tp transformers tp_plan refused", 2)  # kc.apply and kc.load_pretrained, model untouched


def test_tp_fused_qkv_matches_single_process(tp_run):
    expect(tp_run, "OK tp fused-qkv", 2)  # GPT-NeoX query_key_value [H, 3, Dh], ColwiseParallel


def test_tp_model_refuses_apply_inspect_fold_and_saves_from_rank0(tp_run):
    expect(tp_run, "OK tp refusals", 2)
    expect(tp_run, "OK tp save", 2)


def test_tp_mqa_over_more_ranks_than_kv_heads_is_refused(tp_run):
    expect(tp_run, "OK tp mqa refused", 2)  # by kc.parallelize, and on the first forward after parallelize_module


def test_fsdp2_plus_tp_2x2_matches_single_process():
    res = torchrun("_tp_ranks.py", 4, "fsdp_tp")
    expect(res, "OK fsdp+tp", 4)


def _slot(role, offset, heads, dim, stride):
    return HeadSlot(role, offset, heads, dim, stride)


def test_local_slots_interleaved_and_fused_blocks():
    inter = tuple(_slot(r, i * 4, 4, 4, 12) for i, r in enumerate("qkv"))  # [H=4, 3, Dh=4]
    rank1 = torch.arange(24, 48)  # ColwiseParallel over 2 ranks: heads 2, 3
    assert local_slots("qkv", inter, rank1) == tuple(_slot(r, i * 4, 2, 4, 12) for i, r in enumerate("qkv"))
    blocks = (_slot("q", 0, 4, 4, 4), _slot("k", 16, 2, 4, 4), _slot("v", 24, 2, 4, 4))  # [Q|K|V], GQA
    with pytest.raises(
        TensorParallelError, match="holds no 'q' head"
    ):  # rank 1 of 2 holds features 16..31: K and V only
        local_slots("qkv", blocks, torch.arange(16, 32))
    with pytest.raises(TensorParallelError, match="head 0 of role 'k' is split across ranks"):
        local_slots("k_proj", (_slot("k", 0, 1, 8, 8),), torch.arange(0, 4))


def test_torch_plan_translates_transformers_styles():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = tiny.make("tiny-llama")
    plan = torch_plan(model, "auto")
    assert set(plan) == set(model.tp_plan)
    q, o = plan["model.layers.*.self_attn.q_proj"], plan["model.layers.*.self_attn.o_proj"]
    assert type(q) is ColwiseParallel and q.output_layouts[0].is_shard()
    assert type(o) is RowwiseParallel and o.output_layouts == (Replicate(),)
    head, embed = plan["lm_head"], plan["model.embed_tokens"]
    assert type(head) is ColwiseParallel and head.output_layouts == (Replicate(),)
    assert type(embed) is RowwiseParallel and embed.input_layouts == (Replicate(),)
    mixed = torch_plan(model, {"model.layers.0.self_attn.q_proj": "colwise", "lm_head": RowwiseParallel()})
    assert (
        type(mixed["model.layers.0.self_attn.q_proj"]) is ColwiseParallel and type(mixed["lm_head"]) is RowwiseParallel
    )
    with pytest.raises(TensorParallelError, match="'packed_colwise' is a transformers style with no torch equivalent"):
        torch_plan(model, {"model.layers.*.mlp.gate_proj": "packed_colwise"})
    with pytest.raises(TensorParallelError, match="names no module"):
        torch_plan(model, {"model.layers.0.self_attn.q_proj.weight": "colwise"})
    with pytest.raises(TensorParallelError, match="has none: pass a plan"):
        torch_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), "auto")
