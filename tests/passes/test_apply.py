"""apply / inspect / save / load on the zoo of tiny models: matched, identity at init, wired, trainable."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

import kha_compile as kc
import zoo
from helpers import expected_roles, kha_params, perturb, run, run_python, zoo_reference
from kha_compile.core.errors import (
    AlreadyAppliedError,
    CheckpointError,
    KHAConfigError,
    MissingExampleInputsError,
    NoAttentionFoundError,
)
from kha_compile.model.config import CONFIG_VERSION
from reference import check_against_reference

CONFIGS = {"mlp": kc.KHAConfig(v="mlp"), "linear": kc.KHAConfig(q="linear", k="linear", v="linear")}


@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
def test_apply_matches_every_block_is_identity_wired_and_trainable(name, cfg_name):
    """Matched, exact identity at init, every KHA parameter trained; wired: perturbed, its outputs and
    gradients equal the per-head reference (tests/reference.py), before and after 3 fused AdamW steps,
    at 16 tokens (token-side) and at 96 tokens (more than the projections' inputs: weight-side)."""
    case = zoo.make(name)
    untouched = copy.deepcopy(case.model)
    ref = run(case).detach()
    names_before = {n for n, _ in case.model.named_parameters()}
    kc.apply(case.model, CONFIGS[cfg_name], *case.example)

    report = kc.inspect(case.model, *case.example)
    assert len(report.matched) == case.num_sites, str(report)
    assert not report.skipped, str(report)
    kinds: dict[str, int] = {}
    for s in report.matched:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
        assert s.num_heads == case.num_heads and s.num_kv_heads == case.num_kv_heads, str(report)
        assert s.transforms == expected_roles(case, CONFIGS[cfg_name]), str(report)
    assert kinds == case.kinds

    params = kha_params(case.model)
    added = {n for n, _ in case.model.named_parameters()} - names_before
    assert added and all("kha" in n for n in added), sorted(added)[:4]
    assert set(params) == added  # kha_params (used below) sees exactly the parameters apply added

    out = run(case)
    assert torch.equal(out, ref), f"max diff {(out - ref).abs().max().item()}"

    out.float().pow(2).mean().backward()
    no_grad = [n for n, p in params.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, f"KHA parameters without gradient: {no_grad[:4]}"

    perturb(case.model)
    many = zoo.inputs(name, case.model, batch=4, seq=24)
    check_against_reference(
        case.model,
        zoo_reference(name, untouched),
        [case.example, many],
        expected_roles(case, CONFIGS[cfg_name]),
    )


@pytest.mark.parametrize("name", ["llama", "gpt2", "falcon", "torch_encoder"])  # Linear, Conv1D, fused MQA, MHA
def test_every_inserted_module_class_is_defined_in_kha_compile(name):
    """The public contract: every module KHA inserts (or re-classes) is a class defined in kha_compile."""
    case = zoo.make(name)
    before = {type(m) for m in case.model.modules()}
    kc.apply(case.model, kc.KHAConfig(q="linear", v="mlp"), *case.example)
    new = {type(m) for m in case.model.modules()} - before
    assert new, "apply inserted no module"
    foreign = sorted(f"{c.__module__}.{c.__qualname__}" for c in new if not c.__module__.startswith("kha_compile"))
    assert not foreign, f"modules inserted by apply whose class is not defined in kha_compile: {foreign}"


@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
def test_identity_in_bfloat16(name, cfg_name):
    case = zoo.make(name, dtype=torch.bfloat16)
    ref = run(case).detach()
    kc.apply(case.model, CONFIGS[cfg_name], *case.example)
    params = kha_params(case.model)
    assert params and all(p.dtype == torch.bfloat16 for p in params.values())
    assert torch.equal(run(case), ref)
    perturb(case.model, scale=0.3)  # KHA is on the bf16 path too
    assert not torch.allclose(run(case).float(), ref.float(), atol=1e-2)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt_neox", "t5"])
def test_generate_with_kv_cache_gives_the_original_tokens(name):
    case = zoo.make(name)
    ids = case.kwargs["input_ids"][:1, :4]  # t5: the encoder input; the decoder generates
    gen = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    ref = case.model.generate(ids, **gen)
    with torch.no_grad():
        logits = run(case)
    kc.apply(case.model, kc.KHAConfig(v="mlp"))
    out = case.model.generate(ids, **gen)
    assert torch.equal(out, ref)
    perturb(case.model)  # the transforms are on the path generate runs
    with torch.no_grad():
        assert not torch.allclose(run(case), logits, atol=1e-5)


def test_inspect_before_apply_reports_sites_without_transforms_and_a_table():
    case = zoo.make("qwen3")
    report = kc.inspect(case.model)
    assert len(report.matched) == 2
    site = report.sites[0]
    assert site.name == "model.layers.0.self_attn"
    assert (site.kind, site.num_heads, site.num_kv_heads, site.head_dim) == ("gqa", 4, 2, 16)
    assert site.rope and site.qk_norm and site.transforms == {}
    assert site.q_proj == "model.layers.0.self_attn.q_proj" and site.v_proj.endswith("v_proj")
    table = str(report)
    assert "model.layers.1.self_attn" in table and "gqa" in table and "qk-norm" in table


def test_mla_mlp_request_becomes_linear_and_the_report_says_why():
    case = zoo.make("deepseek_v3")
    kc.apply(case.model, kc.KHAConfig(v="mlp"))
    report = kc.inspect(case.model)
    assert all(s.kind == "mla" and s.transforms == {"v": "linear"} for s in report.matched)
    assert all("MLA" in s.note for s in report.matched)


def test_repeated_blocks_are_traced_once(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kha_compile.analysis import trace

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = LlamaForCausalLM(cfg).eval()
    seen = []
    real = trace._export

    def spy(m, args, kwargs):
        seen.append(len(m.model.layers))
        return real(m, args, kwargs)

    monkeypatch.setattr(trace, "_export", spy)
    kc.apply(model, kc.KHAConfig(v="linear"))
    assert seen == [1, 1]  # one representative of six identical layers: in apply's trace and in its self-check's
    assert len(model.model.layers) == 6
    assert sum(".kha." in n for n, _ in model.named_parameters()) == 6


def test_meta_device_model_gets_meta_transforms_without_materialising():
    case = zoo.make("llama", device="meta")
    kc.apply(case.model, kc.KHAConfig(v="mlp"))
    params = kha_params(case.model)
    assert len(params) == 6 and all(p.is_meta for p in params.values())


# --- save / load ----------------------------------------------------------------------------


def _trained(name="llama", cfg=kc.KHAConfig(q="linear", v="mlp")):
    case = zoo.make(name)
    kc.apply(case.model, cfg)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in kha_params(case.model).values():
            p.add_(0.1 * torch.randn_like(p))
    return case


def test_save_load_round_trip_gives_identical_outputs(tmp_path):
    case = _trained()
    kc.save_pretrained(case.model, tmp_path / "ckpt")
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["kha_config.json", "kha_model.safetensors"]
    meta = json.loads((tmp_path / "ckpt" / "kha_config.json").read_text())
    assert meta["version"] == CONFIG_VERSION and meta["q"] == "linear" and meta["v"] == "mlp"
    fresh = zoo.make("llama")
    kc.load_pretrained(fresh.model, tmp_path / "ckpt")
    assert torch.equal(run(fresh), run(case))


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]


def test_load_of_a_checkpoint_that_does_not_fit_leaves_the_model_unchanged(tmp_path):
    case = _trained("llama")
    kc.save_pretrained(case.model, tmp_path / "ckpt")
    other = zoo.make("qwen3")  # same shapes, different module names? no: same paths, different head count
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=128,
    )  # head dim 32, not 16
    model = LlamaForCausalLM(cfg).eval()
    state, classes = _snapshot(model)
    with pytest.raises(CheckpointError, match=r"does not fit.*shape mismatch"):
        kc.load_pretrained(model, tmp_path / "ckpt")
    assert [type(m) for m in model.modules()] == classes
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    del other


def test_load_of_a_truncated_file_is_a_clear_error_and_changes_nothing(tmp_path):
    case = _trained()
    kc.save_pretrained(case.model, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "kha_model.safetensors"
    f.write_bytes(f.read_bytes()[:-40])
    fresh = zoo.make("llama")
    state, classes = _snapshot(fresh.model)
    with pytest.raises(CheckpointError, match="truncated"):
        kc.load_pretrained(fresh.model, tmp_path / "ckpt")
    assert [type(m) for m in fresh.model.modules()] == classes
    after = fresh.model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


def test_load_of_a_missing_checkpoint_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"kha_config.json"):
        kc.load_pretrained(zoo.make("llama").model, tmp_path / "nowhere")


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("v", "gate"), ("q", "mlp"), ("k", 1)])
def test_invalid_config_lists_the_allowed_values(field, value):
    with pytest.raises(KHAConfigError, match="use one of") as err:
        kc.KHAConfig(**{field: value})
    assert "'linear'" in str(err.value) and isinstance(err.value, kc.KHAError)


def test_config_is_frozen_and_round_trips():
    cfg = kc.KHAConfig(q="linear")
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'q'"):
        cfg.q = None
    assert kc.KHAConfig.from_dict(cfg.to_dict()) == cfg
    assert kc.KHAConfig() == kc.KHAConfig(q=None, k=None, v="mlp")


def test_no_attention_is_a_clear_error_and_strict_false_warns():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    with pytest.raises(NoAttentionFoundError, match=r"no per-head attention.*scaled_dot_product_attention"):
        kc.apply(model, example_args=(x,))
    with pytest.warns(UserWarning, match="no per-head attention"):
        out = kc.apply(model, example_args=(x,), strict=False)
    assert out is model and not kha_params(model)


def test_apply_twice_is_refused_with_already():
    case = zoo.make("gpt2")
    kc.apply(case.model)
    with pytest.raises(AlreadyAppliedError, match="already"):
        kc.apply(case.model)


def test_non_transformers_model_without_inputs_says_to_pass_them():
    with pytest.raises(MissingExampleInputsError, match="example_args"):
        kc.apply(zoo.make("nanogpt").model)


@pytest.mark.parametrize("name", ["gpt_neox", "gpt2", "torch_encoder"])  # Linear, Conv1D, nn.MultiheadAttention
def test_remove_restores_the_original_classes_keys_and_outputs(name):
    case = zoo.make(name)
    with torch.no_grad():
        ref = run(case)
    keys = list(case.model.state_dict())
    classes = [type(m) for m in case.model.modules()]
    kc.apply(case.model, kc.KHAConfig(q="linear", k="linear", v="mlp"), *case.example)
    perturb(case.model)
    with torch.no_grad():
        assert not torch.allclose(run(case), ref, atol=1e-5)
    kc.remove(case.model)
    assert list(case.model.state_dict()) == keys and [type(m) for m in case.model.modules()] == classes
    with torch.no_grad():
        assert torch.equal(run(case), ref)


def test_transformer_decoder_layers_get_self_and_cross_sites():
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.TransformerDecoder(layer, num_layers=2).eval()
    tgt, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    ref = model(tgt, memory)
    kc.apply(model, kc.KHAConfig(q="linear", v="mlp"), example_args=(tgt, memory))
    kinds = sorted(s.kind for s in kc.inspect(model, example_args=(tgt, memory)).matched)
    assert kinds == ["cross", "cross", "mha", "mha"]
    assert torch.equal(model(tgt, memory), ref)
    perturb(model)
    assert not torch.allclose(model(tgt, memory), ref, atol=1e-5)


def test_generate_after_training_agrees_with_and_without_the_kv_cache():
    case = zoo.make("llama")
    kc.apply(case.model, kc.KHAConfig(q="linear", k="linear", v="mlp"))
    perturb(case.model, scale=0.3)
    ids = case.kwargs["input_ids"][:1, :4]
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    cached = case.model.generate(ids, use_cache=True, **gen)
    uncached = case.model.generate(ids, use_cache=False, **gen)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize(
    "name,rope,qk_norm",
    [("bert", False, False), ("phi", True, False), ("gpt_neox", True, False), ("qwen3", True, True)],
)
def test_report_flags_rope_and_qk_norm(name, rope, qk_norm):
    case = zoo.make(name)
    sites = kc.inspect(case.model, *case.example).matched
    assert sites and all((s.rope, s.qk_norm) == (rope, qk_norm) for s in sites)


def test_refused_second_apply_leaves_the_model_unchanged():
    case = zoo.make("llama")
    kc.apply(case.model, kc.KHAConfig(v="mlp"))
    perturb(case.model)
    state = {k: v.clone() for k, v in case.model.state_dict().items()}
    with pytest.raises(AlreadyAppliedError, match="already carries KHA transforms"):
        kc.apply(case.model, kc.KHAConfig(q="linear"))
    after = case.model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


def test_mlp_value_op_has_a_cuda_kernel_registered():
    # CUDA goes to the Triton kernel; every other device to the composite formula
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kha::mlp_value", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kha::mlp_value_backward", "CUDA")


def test_a_pickled_model_with_kha_loads_in_a_new_process(tmp_path):
    case = zoo.make("gpt2")  # nn.Linear-free: the projection is transformers' Conv1D
    kc.apply(case.model, kc.KHAConfig(q="linear", v="mlp"))
    perturb(case.model)
    with torch.no_grad():
        expected = run(case)
    torch.save({"model": case.model, "ids": case.kwargs["input_ids"], "expected": expected}, tmp_path / "m.pt")
    script = (
        "import torch, transformers\n"
        f"d = torch.load({str(tmp_path / 'm.pt')!r}, weights_only=False)\n"
        "with torch.no_grad(): out = d['model'](input_ids=d['ids']).logits\n"
        "torch.testing.assert_close(out, d['expected'])\n"
        "print('OK', type(d['model'].transformer.h[0].attn.c_attn).__name__)\n"
    )
    run_python(script, "OK KHAConv1D")


class HalfSupported(nn.Module):
    """One attention KHA can take and one it must skip (nn.MultiheadAttention with add_bias_kv: a
    learned bias row concatenated to k and v, which its handler does not carry)."""

    def __init__(self):
        super().__init__()
        self.ok = zoo.Block(32, 4)
        self.odd = nn.MultiheadAttention(32, 4, add_bias_kv=True, batch_first=True)

    def forward(self, x):
        x = self.ok(x)
        return x + self.odd(x, x, x, need_weights=False)[0]


def test_strict_apply_with_some_sites_skipped_inserts_the_rest_and_logs_each_skip(caplog):
    torch.manual_seed(0)
    model = HalfSupported().eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        ref = model(x)
    with caplog.at_level("WARNING", logger="kha_compile.passes.apply"):
        kc.apply(model, kc.KHAConfig(v="linear"), example_args=(x,), strict=True)
    report = kc.inspect(model, example_args=(x,))
    assert [s.name for s in report.matched] == ["ok.attn"], str(report)
    (skipped,) = report.skipped
    assert skipped.name == "odd" and "add_bias_kv/add_zero_attn is not supported" in skipped.reason, skipped.reason
    assert any(r.message.startswith("KHA skipped odd: nn.MultiheadAttention with add_bias_kv") for r in caplog.records)
    assert set(kha_params(model)) == {"ok.attn.c_attn.kha.v.weight"}
    with torch.no_grad():
        assert torch.equal(model(x), ref)
        perturb(model)
        assert not torch.allclose(model(x), ref, atol=1e-5)


class DepthAwareStack(nn.Module):
    """Code that depends on its own depth: cutting the repeated blocks down to one breaks it."""

    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList(zoo.Block(32, 4) for _ in range(3))

    def forward(self, x):
        if len(self.h) != 3:
            raise RuntimeError("this model needs its three blocks")
        for block in self.h:
            x = block(x)
        return x


def test_model_whose_code_needs_every_block_is_traced_whole():
    model = DepthAwareStack().eval()
    x = torch.randn(2, 5, 32)
    ref = model(x)
    kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(x,))
    assert len(kc.inspect(model, example_args=(x,)).matched) == 3
    assert torch.equal(model(x), ref)
    perturb(model)
    assert not torch.allclose(model(x), ref, atol=1e-5)
