"""Architectures the issue does not name: the pass is built for the family of attention code.

Each is checked against the per-head reference of tests/reference.py (its head layout written out from
the config and the architecture's own modeling code), perturbed and after fused optimizer steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kha_compile as kc
from helpers import perturb
from kha_compile.analysis.inputs import example_inputs
from reference import Reference, check_against_reference

transformers = pytest.importorskip("transformers")

BASE = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=64,
)
SEQ2SEQ = dict(
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    d_model=64,
    vocab_size=128,
    max_position_embeddings=64,
)

# name: (config class, model class, config, expected kinds)
CASES = {
    "bloom": ("BloomConfig", "BloomForCausalLM", BASE, {"mha": 2}),  # ALiBi, fused [H, 3, Dh]
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(BASE, rotary_dim=8), {"mha": 2}),  # interleaved partial rope
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(BASE, multi_query=True), {"mqa": 2}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", BASE, {"mha": 2}),  # QK-norm over the whole projection
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(BASE, head_dim=16, num_key_value_heads=2), {"gqa": 2}),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(BASE, rotary_dim=8, n_ctx=64), {"mha": 2}),
    "albert": ("AlbertConfig", "AlbertModel", dict(BASE, embedding_size=32), {"mha": 2}),  # one layer, run twice
    "bart": ("BartConfig", "BartModel", SEQ2SEQ, {"mha": 4, "cross": 2}),
    "swin": (
        "SwinConfig",
        "SwinModel",
        dict(embed_dim=16, depths=[1, 1], num_heads=[2, 4], image_size=32, patch_size=4, window_size=4),
        {"mha": 2},
    ),
}


HEADS = {"swin": [2, 4]}  # query heads per site, in site order, where they differ from BASE's 4


def _out(o):
    return o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_unnamed_architecture_is_matched_identity_and_wired(name, v):
    cfg_cls, model_cls, config, kinds = CASES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**config)).eval()
    untouched = copy.deepcopy(model)
    args, kwargs = example_inputs(model)
    ref = _out(model(*args, **kwargs))
    cfg = kc.KHAConfig(q="linear", k="linear", v=v)
    kc.apply(model, cfg)
    report = kc.inspect(model)
    got: dict[str, int] = {}
    for s in report.matched:
        got[s.kind] = got.get(s.kind, 0) + 1
    assert got == kinds and not report.skipped, str(report)
    heads = [s.num_heads for s in report.matched]
    assert heads == HEADS.get(name, [4] * len(heads)), str(report)
    assert torch.equal(_out(model(*args, **kwargs)), ref)
    perturb(model, scale=0.05)
    many = example_inputs(model, batch_size=4, seq_len=24)  # 96 tokens > hidden 64: weight-side too
    check_against_reference(model, Reference(untouched), [(args, kwargs), many], dict(cfg.roles()))
