"""PEFT LoRA with KHA: T(Wx + BAx) in both orders, merge/fold commute, trainability, canonical keys."""

from __future__ import annotations

import copy

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, perturb
from kha_compile.cli import tiny

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model

LINEAR = kc.KHAConfig(q="linear", k="linear", v="linear")
MLP = kc.KHAConfig(q="linear", v="mlp")
IDS = torch.randint(0, tiny.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def _lora(model, targets=("q_proj", "v_proj")):
    p = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets), lora_dropout=0.0))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # lora_B starts at zero: move it so the delta matters
        for n, q in p.named_parameters():
            if "lora_B" in n:
                q.copy_(0.2 * torch.randn(q.shape, generator=gen))
    return p


def _build(order: str, cfg: kc.KHAConfig):
    model = tiny.make("tiny-llama")
    if order == "lora_then_kha":
        p = _lora(model)
        kc.apply(p, cfg)  # no example inputs: built from the transformers model inside
    else:
        kc.apply(model, cfg)
        p = _lora(model)
        kc.mark_trainable(p)
    perturb(p, scale=0.2)
    return p


def _reference(p, cfg) -> torch.Tensor:
    """T(Wx + BAx) computed by hand: merge LoRA into a plain copy, then give it KHA with the same weights."""
    base = tiny.make("tiny-llama")
    merged = copy.deepcopy(p)
    kc.remove(merged)
    merged = merged.merge_and_unload()
    base.load_state_dict(merged.state_dict())
    kc.apply(base, cfg)
    state = {
        k.replace("base_model.model.", "").replace(".base_layer.", "."): v
        for k, v in p.state_dict().items()
        if ".kha." in k
    }
    base.load_state_dict(state, strict=False)
    assert set(state) == set(kha_params(base))
    return base(input_ids=IDS).logits


@pytest.mark.parametrize("order", ["lora_then_kha", "kha_then_lora"])
def test_kha_transforms_base_plus_adapter(order):
    p = _build(order, LINEAR)
    q = p.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q).__name__ == "KHAAdapterLinear"
    assert not hasattr(q.base_layer, "kha")  # KHA sits on the wrapper, outside LoRA's delta
    torch.testing.assert_close(p(input_ids=IDS).logits, _reference(p, LINEAR), atol=1e-5, rtol=0)


@pytest.mark.parametrize("order", ["lora_then_kha", "kha_then_lora"])
def test_merge_and_fold_commute(order):
    p = _build(order, LINEAR)
    want = p(input_ids=IDS).logits
    a = kc.fold(copy.deepcopy(p).merge_and_unload())
    b = kc.fold(copy.deepcopy(p)).merge_and_unload()
    for folded in (a, b):
        assert not kha_params(folded)
        assert type(folded.model.layers[0].self_attn.q_proj) is torch.nn.Linear
        assert not hasattr(folded.config, "kha_compile")
        assert not folded._forward_pre_hooks  # vanilla: the re-wiring hook is gone too
        torch.testing.assert_close(folded(input_ids=IDS).logits, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("order", ["lora_then_kha", "kha_then_lora"])
def test_mlp_value_survives_merge(order):
    p = _build(order, MLP)
    want = p(input_ids=IDS).logits
    merged = copy.deepcopy(p).merge_and_unload()
    v = merged.model.layers[0].self_attn.v_proj
    assert v.kha["v"].kind == "mlp"
    torch.testing.assert_close(merged(input_ids=IDS).logits, want, atol=1e-5, rtol=0)
    kc.fold(merged, strict=False)  # q folds, MLP-value stays
    torch.testing.assert_close(merged(input_ids=IDS).logits, want, atol=1e-5, rtol=0)
    assert merged.config.kha_compile["v"] == "mlp" and merged.config.kha_compile["q"] is None


@pytest.mark.parametrize("order", ["lora_then_kha", "kha_then_lora"])
def test_gradients_reach_lora_and_kha(order):
    p = _build(order, MLP)
    p(input_ids=IDS, labels=IDS).loss.backward()
    grads = {n: q.grad for n, q in p.named_parameters() if q.requires_grad}
    kha = [n for n in grads if ".kha." in n]
    lora = [n for n in grads if "lora_" in n]
    assert kha and lora
    assert len(kha) == len(kha_params(p))  # every KHA parameter trains
    for n in kha + lora:
        assert grads[n] is not None and grads[n].abs().sum() > 0, n
    assert not any(q.requires_grad for n, q in p.named_parameters() if ".kha." not in n and "lora_" not in n)


def test_lora_after_kha_is_rewired_before_the_first_forward():
    """Without mark_trainable, the forward is still T(Wx + BAx) (KHA simply stays frozen)."""
    model = tiny.make("tiny-llama")
    kc.apply(model, LINEAR)
    p = _lora(model)
    perturb(p, scale=0.2)
    assert hasattr(p.base_model.model.model.layers[0].self_attn.q_proj.base_layer, "kha")
    out = p(input_ids=IDS).logits
    assert not hasattr(p.base_model.model.model.layers[0].self_attn.q_proj.base_layer, "kha")
    torch.testing.assert_close(out, _reference(p, LINEAR), atol=1e-5, rtol=0)
    assert not any(q.requires_grad for q in kha_params(p).values())  # get_peft_model froze them


def test_fold_without_forward_rewires_first():
    model = tiny.make("tiny-llama")
    kc.apply(model, LINEAR)
    p = _lora(model)
    perturb(p, scale=0.2)
    want = _reference(p, LINEAR)
    kc.fold(p)
    torch.testing.assert_close(p.merge_and_unload()(input_ids=IDS).logits, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("order", ["lora_then_kha", "kha_then_lora"])
def test_canonical_checkpoint_loads_into_plain_and_peft_models(order, tmp_path):
    p = _build(order, MLP)
    kc.save_pretrained(p, tmp_path)
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "kha_model.safetensors")))
    assert keys and not any("base_model" in k or "base_layer" in k for k in keys)
    plain = tiny.make("tiny-llama")
    kc.apply(plain, MLP)
    assert keys == set(kha_params(plain))
    kc.backend(from_pretrained=tmp_path, model=tiny.make("tiny-llama"))  # deploy mode validates names now
    fresh = kc.load_pretrained(tiny.make("tiny-llama"), tmp_path)
    torch.testing.assert_close(
        kha_params(fresh)["model.layers.0.self_attn.v_proj.kha.v.up"],
        dict(p.named_parameters())["base_model.model.model.layers.0.self_attn.v_proj.kha.v.up"],
    )
    # into a PEFT model: canonical keys map back onto the wrappers
    target = _lora(tiny.make("tiny-llama"))
    src = dict(p.named_parameters())
    with torch.no_grad():
        for n, q in target.named_parameters():
            if "lora_" in n:
                q.copy_(src[n])
    kc.load_pretrained(target, tmp_path)
    torch.testing.assert_close(target(input_ids=IDS).logits, p(input_ids=IDS).logits, atol=1e-6, rtol=0)


def test_inspect_peft_model_reports_wrappers():
    p = _build("lora_then_kha", MLP)
    report = kc.inspect(p)
    assert len(report.matched) == 2
    site = report.matched[0]
    assert site.v_proj == "model.layers.0.self_attn.v_proj"
    assert site.transforms == {"q": "linear", "v": "mlp"}


def test_apply_on_merged_adapters_refused():
    p = _lora(tiny.make("tiny-llama"))
    p.merge_adapter()
    with pytest.raises(kc.errors.UnsupportedModelError, match="merged"):
        kc.apply(p, LINEAR)
    assert not kha_params(p)


def test_example_lora_kha_runs():
    from helpers import run_python

    out = run_python("import runpy; runpy.run_path('examples/lora_kha.py', run_name='__main__')", "fold then merge")
    diffs = [float(line.rpartition("= ")[2]) for line in out.splitlines() if "max |logits - trained|" in line]
    assert len(diffs) == 2 and max(diffs) < 1e-5  # merge-then-fold and fold-then-merge equal the trained model


@pytest.mark.parametrize("order", ["lora_then_kha", "kha_then_lora"])
def test_fused_qkv_conv1d_gpt2_merge_and_fold_commute(order):
    """GPT-2's fused c_attn (Conv1D, weight (in, out)): per-role slots of one wrapper, lora_B rows."""
    cfg = kc.KHAConfig(q="linear", k="linear", v="linear")
    model = tiny.make("tiny-gpt2")
    lora_cfg = LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    if order == "lora_then_kha":
        p = get_peft_model(model, lora_cfg)
        kc.apply(p, cfg)
    else:
        kc.apply(model, cfg)
        p = kc.mark_trainable(get_peft_model(model, lora_cfg))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, q in p.named_parameters():
            if "lora_B" in n:
                q.copy_(0.2 * torch.randn(q.shape, generator=gen))
    perturb(p, scale=0.2)
    want = p(input_ids=IDS).logits
    assert type(p.base_model.model.transformer.h[0].attn.c_attn).__name__ == "KHAAdapterLinear"
    for folded in (kc.fold(copy.deepcopy(p).merge_and_unload()), kc.fold(copy.deepcopy(p)).merge_and_unload()):
        assert not kha_params(folded) and type(folded.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
        torch.testing.assert_close(folded(input_ids=IDS).logits, want, atol=1e-5, rtol=0)
