"""Models from libraries other than transformers, built from small configs (no downloads):
x-transformers (einsum attention, GQA, encoder and decoder) and fair-esm's ESM-2 (separate q/k/v
linears, rotary, bmm + softmax, key padding mask), applied directly: its forward branches on token
values, so it is traced submodule by submodule. Each is checked against the per-head reference of
tests/reference.py, perturbed and after fused optimizer steps."""

from __future__ import annotations

import copy

import pytest
import torch

import kha_compile as kc
from form_checks import check_form
from helpers import perturb
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


def _esm_ids(padded: bool, batch: int = 2, seq: int = T) -> torch.Tensor:
    """Amino-acid token ids (4..23 in the ESM-1b alphabet); ``padded`` pads the second sequence."""
    ids = torch.randint(4, 24, (batch, seq), generator=torch.Generator().manual_seed(0))
    if padded:
        ids[1, seq - 3 :] = 1  # <pad>
    return ids


def _logits(y):
    return y["logits"] if isinstance(y, dict) else y


# case -> (model factory, example inputs, the anchor rule every site must match)
CASES = {
    "x_transformers-decoder_gqa_rope": (lambda: _x_transformers("decoder_gqa_rope"), _ids, "einsum_softmax"),
    "x_transformers-encoder": (lambda: _x_transformers("encoder"), _ids, "einsum_softmax"),
    "esm2": (lambda: _esm2, lambda: _esm_ids(False), "manual_softmax"),
    "esm2_padded": (lambda: _esm2, lambda: _esm_ids(True), "manual_softmax"),
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
    check_form(make(), (ids(),), v, anchor=anchor, output=_logits)


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
def test_esm2_is_traced_per_submodule_and_says_why(padded):
    """ESM2.forward branches on token values (``if not padding_mask.any():``), which torch.export
    refuses; kc.apply traces its layers one by one, with the inputs one forward gave them, and the
    report says so, naming the line."""
    esm2 = _esm2().eval()
    ids = _esm_ids(padded)
    ref = esm2(ids)["logits"]
    kc.apply(esm2, kc.KHAConfig(v="linear"), example_args=(ids,))
    report = kc.inspect(esm2, example_args=(ids,))
    assert report.trace_path.startswith("per submodule") and "padding_mask.any()" in report.trace_path
    assert [s.name for s in report.matched] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert torch.equal(esm2(ids)["logits"], ref)
