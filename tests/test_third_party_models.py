"""Models from libraries other than transformers, built from small configs (no downloads):
x-transformers (einsum attention, GQA, encoder and decoder) and litgpt (fused qkv, GQA, SDPA)."""
from __future__ import annotations

import pytest
import torch
from form_checks import check_form

V, T = 128, 8


def _ids():
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))


def _x_transformers(kind):
    xt = pytest.importorskip("x_transformers")
    layers = {
        "decoder_gqa_rope": lambda: xt.Decoder(dim=64, depth=2, heads=4, attn_kv_heads=2, attn_dim_head=16,
                                               rotary_pos_emb=True),
        "encoder": lambda: xt.Encoder(dim=64, depth=2, heads=4, attn_dim_head=16),
    }[kind]
    return lambda: xt.TransformerWrapper(num_tokens=V, max_seq_len=64, attn_layers=layers())


def _litgpt(name):
    litgpt = pytest.importorskip("litgpt")
    kv = 2 if name.startswith("Llama") else 4
    cfg = litgpt.Config.from_name(name, n_layer=2, n_embd=64, n_head=4, n_query_groups=kv, head_size=16,
                                  intermediate_size=128, padded_vocab_size=V, vocab_size=V, block_size=64)
    return lambda: litgpt.GPT(cfg)


CASES = {
    "x_transformers-decoder_gqa_rope": (lambda: _x_transformers("decoder_gqa_rope"), "einsum_softmax"),
    "x_transformers-encoder": (lambda: _x_transformers("encoder"), "einsum_softmax"),
    "litgpt-pythia": (lambda: _litgpt("pythia-14m"), "sdpa"),
    "litgpt-llama3_gqa": (lambda: _litgpt("Llama-3.2-1B"), "sdpa"),
}


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_apply_identity_perturb_fold(case, v):
    make, anchor = CASES[case]
    check_form(make(), (_ids(),), v, anchor=anchor)
