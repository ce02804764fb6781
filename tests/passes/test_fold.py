"""fold(): exact, restores the original classes and keys, refuses MLP-value when strict.

"Exact" is measured against the per-head reference of tests/reference.py (the untouched model with the
spec's transforms applied by hooks at its projection outputs), never against the KHA model itself:
under no_grad its weight-side strategy runs the same fold primitive as ``kc.fold``.
"""

from __future__ import annotations

import pytest
import torch

import kha_compile as kc
import zoo
from helpers import expected_roles, kha_params, perturb, perturb_biases, reference_output, run, run_python
from kha_compile.core.errors import FoldError
from kha_compile.model.carrier import KHAProjection
from kha_compile.model.mha import KHAMultiheadAttention
from kha_compile.model.rows import fold_rows
from kha_compile.model.slots import HeadSlot

LINEAR = kc.KHAConfig(q="linear", k="linear", v="linear")


def no_kha_left(model):
    return not any(
        isinstance(m, (KHAProjection, KHAMultiheadAttention)) or type(m).__module__.startswith("kha_compile")
        for m in model.modules()
    )


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "qwen3",
        "gpt2",
        "bert",
        "mistral",
        "phi",
        "t5",
        "deepseek_v3",
        "gpt_neox",
        "falcon",
        "torch_encoder",
        "nanogpt",
        "vit",
        "gemma2",
    ],
)
def test_fold_is_exact_and_restores_the_original_model(name):
    case = zoo.make(name)
    keys = list(case.model.state_dict())
    classes = [type(m) for m in case.model.modules()]
    kc.apply(case.model, LINEAR, *case.example)
    perturb(case.model)
    perturb_biases(case.model)  # a forgotten bias fold is exact at transformers' zero-bias init
    expected = reference_output(name, case.model, *case.example, expect=expected_roles(case, LINEAR))
    kc.fold(case.model)
    with torch.no_grad():
        got = run(case)
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel < 2e-5
    assert list(case.model.state_dict()) == keys
    assert [type(m) for m in case.model.modules()] == classes
    assert no_kha_left(case.model)


def test_fold_of_multihead_attention_with_kdim_and_vdim_puts_each_role_in_its_own_bias_slice():
    """Separate q/k/v weights, one packed bias: each role's T folds into its own third of ``in_proj_bias``.
    The expected output is the token-side KHA model (transforms after the in-projection, no fold)."""
    torch.manual_seed(0)
    attn = torch.nn.MultiheadAttention(32, 4, kdim=24, vdim=20, batch_first=True).eval()
    with torch.no_grad():
        attn.in_proj_bias.normal_()  # torch initialises it to zeros, where a misplaced fold is exact
    q, k, v = torch.randn(2, 6, 32), torch.randn(2, 9, 24), torch.randn(2, 9, 20)
    kc.apply(attn, LINEAR, example_args=(q, k, v))
    perturb(attn)
    with torch.enable_grad():  # few tokens and a gradient: token-side, nothing folded
        expected = attn(q, k, v)[0].detach()
    kc.fold(attn)
    assert type(attn) is torch.nn.MultiheadAttention
    with torch.no_grad():
        torch.testing.assert_close(attn(q, k, v)[0], expected, rtol=1e-5, atol=1e-5)


def test_strict_fold_with_mlp_value_is_refused_and_changes_nothing():
    case = zoo.make("llama")
    kc.apply(case.model, kc.KHAConfig(q="linear", v="mlp"))
    perturb(case.model)
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    classes = [type(m) for m in case.model.modules()]
    with pytest.raises(FoldError, match=r"MLP-value.*v_proj\.kha\.v.*Nothing was changed.*strict=False"):
        kc.fold(case.model)
    after = case.model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert [type(m) for m in case.model.modules()] == classes


def test_non_strict_fold_folds_linear_and_keeps_mlp_value():
    case = zoo.make("gpt2")  # fused c_attn: q linear and v mlp share one projection
    kc.apply(case.model, kc.KHAConfig(q="linear", k="linear", v="mlp"))
    perturb(case.model)
    expected = reference_output("gpt2", case.model, *case.example, expect={"q": "linear", "k": "linear", "v": "mlp"})
    kc.fold(case.model, strict=False)
    names = list(kha_params(case.model))
    assert names and all(".kha.v." in n for n in names)
    with torch.no_grad():
        torch.testing.assert_close(run(case), expected, rtol=1e-5, atol=1e-5)


def test_fold_in_bfloat16_computes_in_float32_and_keeps_the_dtype():
    case = zoo.make("llama", dtype=torch.bfloat16)
    kc.apply(case.model, LINEAR)
    perturb(case.model, scale=0.05)
    expected = reference_output("llama", case.model, *case.example, expect=dict(LINEAR.roles()), dtype=torch.float32)
    kc.fold(case.model)
    assert all(p.dtype == torch.bfloat16 for p in case.model.parameters())
    with torch.no_grad():
        got = run(case).float()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 3e-2


@pytest.mark.parametrize("axis", [0, 1])
def test_fold_rows_matches_the_transform_on_the_output(axis):
    torch.manual_seed(0)
    slot = HeadSlot("v", 8, 3, 4, 6)  # interleaved: heads every 6 features starting at 8
    out_features, in_features = 8 + 3 * 6, 5
    w = torch.randn(out_features, in_features) if axis == 0 else torch.randn(in_features, out_features)
    b = torch.randn(out_features)
    t = torch.randn(4, 4)
    x = torch.randn(7, in_features)
    y = x @ (w.t() if axis == 0 else w) + b
    idx = slot.index()
    heads = y[:, idx] @ t  # (7, H, Dh)
    expected = y.clone()
    expected[:, idx] = heads
    w2, b2 = fold_rows(w, b, slot, t, axis)
    got = x @ (w2.t() if axis == 0 else w2) + b2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fold_without_kha_is_a_no_op():
    case = zoo.make("bert")
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    kc.fold(case.model)
    assert all(torch.equal(v, before[k]) for k, v in case.model.state_dict().items())


def test_folded_checkpoint_reloads_with_plain_from_pretrained_without_kha_compile(tmp_path):
    case = zoo.make("llama")
    kc.apply(case.model, LINEAR)
    perturb(case.model)
    with torch.no_grad():
        expected = run(case)
    kc.fold(case.model)
    case.model.save_pretrained(tmp_path / "vanilla")
    torch.save({"ids": case.kwargs["input_ids"], "expected": expected}, tmp_path / "io.pt")
    script = (
        "import sys, torch; sys.modules['kha_compile'] = None\n"  # importing kha_compile would fail
        "from transformers import AutoModelForCausalLM\n"
        f"io = torch.load({str(tmp_path / 'io.pt')!r})\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'vanilla')!r}).eval()\n"
        "with torch.no_grad(): out = m(input_ids=io['ids']).logits\n"
        "torch.testing.assert_close(out, io['expected'], rtol=1e-4, atol=1e-5)\n"
        "print('OK', type(m).__name__)\n"
    )
    run_python(script, "OK LlamaForCausalLM")
