"""kc.apply and kc.inspect inside ``with torch.device("meta"):`` (torchtitan-style), kha_compile/core/devices.py.

A model built in a meta block gets KHA in the same block, on meta; after ``to_empty``, the torch
recipe (``reset_parameters()`` on every module that has one, then the base checkpoint) gives the
model that ``kc.apply`` after loading gives, in logits and in KHA gradients, with KHA trained-like
(the same perturbed KHA weights loaded into both). The reference is the model built and loaded on
the CPU, with KHA applied after loading.
"""

from __future__ import annotations

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, perturb

transformers = pytest.importorskip("transformers")

CFG = kc.KHAConfig(q="linear", v="mlp")
IDS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))  # 80 tokens > hidden 32


def _config():
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def _loss_and_grads(model):
    model.zero_grad()
    out = model(input_ids=IDS, labels=IDS, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in kha_params(model).items()}


def test_apply_and_inspect_in_a_meta_block_then_to_empty_and_load_equal_apply_after_loading():
    torch.manual_seed(0)
    loaded = transformers.LlamaForCausalLM._from_config(_config(), attn_implementation="sdpa")
    base = {k: v.clone() for k, v in loaded.state_dict().items()}  # the checkpoint
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM._from_config(_config(), attn_implementation="sdpa")
        report = kc.inspect(model)
        kc.apply(model, CFG)
    assert [s.name for s in report.matched] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert kha_params(model) and all(p.is_meta for p in kha_params(model).values())

    model.to_empty(device="cpu")
    for m in model.modules():  # the torch recipe after to_empty: KHA transforms come back at identity
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    missing, unexpected = model.load_state_dict(base, strict=False)
    assert not unexpected and missing and all(".kha." in k for k in missing)
    buffers = dict(loaded.named_buffers())  # rope's inv_freq is not in a checkpoint: set again after any to_empty
    for name, b in model.named_buffers():
        b.copy_(buffers[name])

    kc.apply(loaded, CFG)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, loaded(input_ids=IDS).logits)  # identity at init
    perturb(loaded, scale=0.2)
    model.load_state_dict({k: v for k, v in loaded.state_dict().items() if ".kha." in k}, strict=False)
    got, want = _loss_and_grads(model), _loss_and_grads(loaded)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    assert set(got[1]) == set(want[1])
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert max(float(g.abs().max()) for g in want[1].values()) > 1e-4


def test_apply_in_a_meta_block_to_a_model_on_the_cpu_builds_inputs_there():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(_config(), attn_implementation="sdpa")
    with torch.device("meta"):
        kc.apply(model, CFG)
    assert all(p.device.type == "cpu" for p in model.parameters())
    with torch.no_grad():
        assert model(input_ids=IDS).logits.isfinite().all()
