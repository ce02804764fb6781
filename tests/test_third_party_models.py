"""Models from libraries other than transformers, built from small configs (no downloads):
x-transformers (einsum attention, GQA, encoder and decoder) and fair-esm's ESM-2 (separate q/k/v
linears, rotary, bmm + softmax, key padding mask). Each is checked against the per-head reference of
tests/reference.py, perturbed and after fused optimizer steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kha_compile as kc
from form_checks import check_form
from helpers import kha_params, perturb
from kha_compile.core.errors import TraceError
from reference import Reference, check_against_reference

V, T = 128, 8


def _ids(batch: int = 2, seq: int = T):
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(0))


def _x_transformers(kind):
    xt = pytest.importorskip("x_transformers")
    layers = {
        "decoder_gqa_rope": lambda: xt.Decoder(
            dim=64, depth=2, heads=4, attn_kv_heads=2, attn_dim_head=16, rotary_pos_emb=True
        ),
        "encoder": lambda: xt.Encoder(dim=64, depth=2, heads=4, attn_dim_head=16),
    }[kind]
    return lambda: xt.TransformerWrapper(num_tokens=V, max_seq_len=64, attn_layers=layers())


def _esm2():
    esm = pytest.importorskip("esm")
    alphabet = esm.Alphabet.from_architecture("ESM-1b")
    return esm.model.esm2.ESM2(num_layers=2, embed_dim=64, attention_heads=4, alphabet=alphabet)


def _esm2_logits():
    pytest.importorskip("esm")
    return lambda: ESM2Logits(_esm2())


def _esm_ids(padded: bool, batch: int = 2, seq: int = T) -> torch.Tensor:
    """Amino-acid token ids (4..23 in the ESM-1b alphabet); ``padded`` pads the second sequence."""
    ids = torch.randint(4, 24, (batch, seq), generator=torch.Generator().manual_seed(0))
    if padded:
        ids[1, seq - 3 :] = 1  # <pad>
    return ids


class ESM2Logits(nn.Module):
    """ESM-2's own forward up to the logits, minus its ``if not padding_mask.any()`` branch.

    ``ESM2.forward`` drops the key padding mask when no token is padding; that test reads the
    token values, which ``torch.export`` cannot trace (see ``test_esm2_forward_is_data_dependent``).
    This module always passes the mask, so one graph covers padded and unpadded batches, and it
    computes exactly what ``ESM2.forward(tokens)["logits"]`` computes (asserted below). ``kc.apply``
    on it inserts KHA into the ESM2 it holds, which then runs with KHA through its own forward.
    """

    def __init__(self, esm2: nn.Module) -> None:
        super().__init__()
        self.esm = esm2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        m = self.esm
        pad = tokens.eq(m.padding_idx)
        masked = tokens.eq(m.mask_idx)
        x = m.embed_scale * m.embed_tokens(tokens)
        x = x.masked_fill(masked.unsqueeze(-1), 0.0)  # token dropout, as ESM2.forward (on by default)
        observed = masked.sum(-1).to(x.dtype) / (~pad).sum(-1)
        x = x * (1 - 0.15 * 0.8) / (1 - observed)[:, None, None]
        x = (x * (1 - pad.unsqueeze(-1).type_as(x))).transpose(0, 1)  # (T, B, E), as ESM2's layers take it
        for layer in m.layers:
            x, _ = layer(x, self_attn_padding_mask=pad)
        return m.lm_head(m.emb_layer_norm_after(x).transpose(0, 1))


# case -> (model factory, example inputs, the anchor rule every site must match)
CASES = {
    "x_transformers-decoder_gqa_rope": (lambda: _x_transformers("decoder_gqa_rope"), _ids, "einsum_softmax"),
    "x_transformers-encoder": (lambda: _x_transformers("encoder"), _ids, "einsum_softmax"),
    "esm2": (_esm2_logits, lambda: _esm_ids(False), "manual_softmax"),
    "esm2_padded": (_esm2_logits, lambda: _esm_ids(True), "manual_softmax"),
}

# case -> (reference layout, its head counts as the model was built above, inputs of 96 tokens)
REFERENCE = {
    "x_transformers-decoder_gqa_rope": ("x_transformers", {"heads": 4, "kv_heads": 2, "dim_head": 16}, _ids),
    "x_transformers-encoder": ("x_transformers", {"heads": 4, "dim_head": 16}, _ids),
    "esm2": ("esm", {"heads": 4, "dim": 64}, lambda batch, seq: _esm_ids(False, batch, seq)),
    "esm2_padded": ("esm", {"heads": 4, "dim": 64}, lambda batch, seq: _esm_ids(True, batch, seq)),
}


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_apply_identity_perturb_fold(case, v):
    make, ids, anchor = CASES[case]
    model = check_form(make(), (ids(),), v, anchor=anchor)
    if isinstance(model, ESM2Logits):  # the ESM2 inside runs the same KHA (perturbed; folded for linear)
        with torch.enable_grad():
            assert torch.equal(model.esm(ids())["logits"], model(ids()))


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_perturbed_and_trained_equal_the_per_head_reference(case, v):
    make, ids, _ = CASES[case]
    arch, heads, many = REFERENCE[case]
    torch.manual_seed(0)
    model = make()().eval()  # a case makes a factory (after importorskip)
    untouched = copy.deepcopy(model)
    cfg = kc.KHAConfig(q="linear", k="linear", v=v)
    kc.apply(model, cfg, example_args=(ids(),))
    perturb(model)
    examples = [((ids(),), {}), ((many(4, 24),), {})]  # 16 and 96 tokens (> width 64: weight-side)
    check_against_reference(model, Reference(untouched, arch, heads), examples, dict(cfg.roles()))


@pytest.mark.parametrize("padded", [False, True])
def test_esm2_logits_module_is_esm2_forward(padded):
    esm2 = _esm2().eval()
    ids = _esm_ids(padded)
    assert torch.equal(ESM2Logits(esm2)(ids), esm2(ids)["logits"])


def test_esm2_forward_is_data_dependent():
    """kc.apply on the bare ESM2 fails in the trace, at ESM2's ``padding_mask.any()``; nothing changes."""
    esm2 = _esm2().eval()
    ids = _esm_ids(False)
    ref = esm2(ids)["logits"]
    with pytest.raises(TraceError, match=r"padding_mask\.any\(\)"):
        kc.apply(esm2, kc.KHAConfig(v="linear"), example_args=(ids,))
    assert not kha_params(esm2)
    assert torch.equal(esm2(ids)["logits"], ref)
