"""apply checks its own rewrite before it returns (issue 34): identity at init, no fake tensor left behind,
and each operand carrying its own transform; a violation undoes the insertion and raises, or skips the site."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import forms_scratch as fs
import forms_zoo_more as fm
import kha_compile as kc
from form_checks import check_form
from helpers import kha_params, perturb
from kha_compile.analysis.owned_state import fake_tensors_in
from kha_compile.cli import tiny
from kha_compile.core.errors import NoAttentionFoundError, SelfCheckError
from kha_compile.handlers import plan as plan_module
from kha_compile.model.slots import HeadSlot
from kha_compile.passes import apply as apply_module

S, B = 40, 2  # more tokens than d_model


def _seq_first(seed: int = 0) -> torch.Tensor:
    return torch.randn(S, B, fs.D, generator=torch.Generator().manual_seed(seed))


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, S, fm.D, generator=torch.Generator().manual_seed(seed))


def _state(model: torch.nn.Module) -> tuple:
    """The classes of every module and every tensor of the state dict: what 'unchanged' means."""
    classes = [(n, type(m)) for n, m in model.named_modules()]
    return classes, {k: v.clone() for k, v in model.state_dict().items()}


def _same_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


# ---- form 1: a module-level scratch buffer written in place --------------------------------------


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_a_scratch_buffer_at_module_level_stays_real_after_apply(v):
    """The buffer is allocated by the first call, which is the trace: the trace must not leave it fake."""
    fs._SCORES = None
    model = fs.ScratchNet().eval()
    x = _seq_first()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v=v), example_args=(x,))
    assert fs._SCORES is None or not isinstance(fs._SCORES, FakeTensor)
    perturb(model)
    with torch.no_grad():
        y = model(x)
        expected = model.reference(x)
    assert not isinstance(y, FakeTensor) and not isinstance(fs._SCORES, FakeTensor)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-5)
    assert fake_tensors_in(model, y) == []


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_the_scratch_buffer_form_matches_a_per_head_reference_and_folds(v):
    x = _seq_first()
    check_form(fs.ScratchNet, (x,), v, sites=2, grad=False, qk=True, reference=lambda m: m.reference(x))


def test_the_scratch_buffer_form_saves_and_loads(tmp_path):
    fs._SCORES = None
    x = _seq_first()
    model = fs.ScratchNet().eval()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"), example_args=(x,))
    perturb(model)
    kc.save_pretrained(model, tmp_path)
    again = fs.ScratchNet().eval()
    again.load_state_dict({k: t for k, t in model.state_dict().items() if ".kha." not in k})
    kc.load_pretrained(again, tmp_path, example_args=(x,))
    with torch.no_grad():
        torch.testing.assert_close(again(x), model.reference(x), rtol=1e-4, atol=1e-5)


# ---- the self-check refusing a wrong rewrite ------------------------------------------------------


def _swap_q_and_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning that gives the query heads T^K's slot and the key heads T^Q's, in every entry."""
    real = plan_module.build_sites

    def swapped(model, raw, cap, cfg):
        sites, plan = real(model, raw, cap, cfg)
        for entry in plan:
            roles = {s.role for s in entry.slots}
            if {"q", "k"} <= roles:
                swap = {"q": "k", "k": "q"}
                entry.slots = [HeadSlot(swap.get(s.role, s.role), *_fields(s)) for s in entry.slots]  # type: ignore[arg-type]
        return sites, plan

    monkeypatch.setattr(apply_module, "build_sites", swapped)


def _fields(s: HeadSlot) -> tuple:
    return (s.offset, s.num_heads, s.head_dim, s.head_stride, s.rows)


def test_swapped_roles_are_refused_and_the_model_is_left_as_it_was(monkeypatch):
    _swap_q_and_k(monkeypatch)
    model = fm.GroupedWqkvNet().eval()
    before = _state(model)
    with pytest.raises(SelfCheckError, match=r"blocks\.0: q: it carries blocks\.0\.wqkv\.kha\.k.*roles are swapped"):
        kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=(_x(),))
    assert _same_state(before, _state(model)) and not kha_params(model)


def _value_transform_patched(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """After the insertion, T^V's module acts twice on the value heads, or T^Q acts after it (issue 34's
    case 3: a second transform on one role); both keep identity at init, so only the graph shows it."""
    real_insert = apply_module.insert

    def patched(model, plan):
        count = real_insert(model, plan)
        for module in model.modules():
            kha = module._modules.get("kha")
            if kha is not None and "v" in kha:
                t_v, t_q = kha["v"], kha["q"] if "q" in kha else None  # noqa: SIM401 - a ModuleDict has no get
                once = t_v.forward
                t_v.forward = (lambda h, f=once: f(f(h))) if how == "twice" else (lambda h, f=once, q=t_q: q(f(h)))
        return count

    monkeypatch.setattr(apply_module, "insert", patched)


@pytest.mark.parametrize(
    ("how", "message"),
    [("twice", r"v: the transform blocks\.0\.wqkv\.kha\.v acts twice"), ("other", r"v: 2 KHA transforms act on its")],
)
def test_a_role_transformed_twice_is_refused(monkeypatch, how, message):
    _value_transform_patched(monkeypatch, how)
    model = fm.GroupedWqkvNet().eval()
    before = _state(model)
    with pytest.raises(SelfCheckError, match=message):
        kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=(_x(),))
    assert _same_state(before, _state(model)) and not kha_params(model)


def test_a_plan_whose_transforms_overlap_is_refused(monkeypatch):
    """T^Q planned on the value heads too: the rewritten model no longer traces as the model did."""
    real = plan_module.build_sites

    def overlapping(model, raw, cap, cfg):
        sites, plan = real(model, raw, cap, cfg)
        for entry in plan:
            v = [s for s in entry.slots if s.role == "v"]
            if v and "q" not in entry.kinds:
                entry.slots.append(HeadSlot("q", *_fields(v[0])))
                entry.kinds["q"] = "linear"
        return sites, plan

    monkeypatch.setattr(apply_module, "build_sites", overlapping)
    model = fm.GroupedWqkvNet().eval()
    before = _state(model)
    with pytest.raises(SelfCheckError, match=r"the model: the rewritten model cannot be traced as the model was"):
        kc.apply(model, kc.KHAConfig(v="linear"), example_args=(_x(),))
    assert _same_state(before, _state(model))


def test_a_plan_that_breaks_identity_is_refused(monkeypatch):
    """An insertion whose transforms do not start at identity changes the outputs: refused, undone."""
    real_insert = apply_module.insert

    def off_identity(model, plan):
        count = real_insert(model, plan)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".kha." in name:
                    p.mul_(1.5)
        return count

    monkeypatch.setattr(apply_module, "insert", off_identity)
    model = fm.GroupedWqkvNet().eval()
    before = _state(model)
    with pytest.raises(SelfCheckError, match=r"output 0 differs .*identity at init broken"):
        kc.apply(model, kc.KHAConfig(v="linear"), example_args=(_x(),))
    assert _same_state(before, _state(model))


def test_a_fake_tensor_left_behind_is_refused(monkeypatch):
    """A fake scratch buffer left in the model code's globals (what the trace left before the fix) is found
    and named. It is planted right after the insertion, as a fake of the buffer's real shape, so the outcome
    does not depend on which trace attempt ran."""
    real_insert = apply_module.insert

    def insert_and_leave_a_fake(model, plan):
        count = real_insert(model, plan)
        fs._SCORES = FakeTensorMode(allow_non_fake_inputs=True).from_tensor(fs._SCORES)
        return count

    monkeypatch.setattr(apply_module, "insert", insert_and_leave_a_fake)
    fs._SCORES = None
    model = fs.ScratchNet().eval()
    with torch.no_grad():
        model(_seq_first())  # the buffer, real, at the shape the model uses
    with pytest.raises(
        SelfCheckError, match=r"fake tensors left behind by the trace: .*global _SCORES of forms_scratch"
    ):
        kc.apply(model, kc.KHAConfig(v="linear"), example_args=(_seq_first(),))
    assert not kha_params(model)
    fs._SCORES = None


class _SeparateQKV(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(fm.D, fm.D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (fm.to_heads(m(x)) for m in (self.q, self.k, self.v))
        return x + self.o(fm.from_heads(torch.nn.functional.scaled_dot_product_attention(q, k, v)))


class _TwoKinds(torch.nn.Module):
    """Two attentions of different forms: a fused, grouped wqkv (``a``) and separate projections (``b``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = fm.GroupedWqkv(), _SeparateQKV()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_strict_false_skips_only_the_site_that_fails(monkeypatch):
    """The swap hits only the fused projection's entry: with strict=False that site is skipped with the
    check's reason; the other keeps KHA, and the skipped one computes exactly what it did."""
    _swap_q_and_k(monkeypatch)
    torch.manual_seed(0)
    model = _TwoKinds().eval()
    x = _x()
    with torch.no_grad():
        a_before = model.a(x)
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=(x,), strict=False)
    report = kc.passes.apply.recorded_report(model)
    assert [s.name for s in report.matched] == ["b"]
    (skipped,) = report.skipped
    assert skipped.name == "a" and "self-check refused" in skipped.reason and "roles are swapped" in skipped.reason
    assert sorted({n.partition(".kha.")[0] for n in kha_params(model)}) == ["b.k", "b.q", "b.v"]
    perturb(model)
    with torch.no_grad():
        assert torch.equal(model.a(x), a_before)


def test_check_false_skips_the_check(monkeypatch):
    _swap_q_and_k(monkeypatch)
    model = fm.GroupedWqkvNet().eval()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=(_x(),), check=False)
    assert kha_params(model)  # the wrong plan went in: nothing checked it


def test_the_check_logs_its_time(caplog):
    with caplog.at_level(logging.INFO, logger="kha_compile.passes.validate"):
        kc.apply(fm.GroupedWqkvNet().eval(), kc.KHAConfig(v="mlp"), example_args=(_x(),))
    (line,) = [r.getMessage() for r in caplog.records if "self-check" in r.getMessage()]
    assert re.search(r"KHA self-check of GroupedWqkvNet in [0-9.]+s: identity checked, [1-9]\d* role operands", line)


# ---- inspect of a model with no attention ---------------------------------------------------------


def test_inspect_of_a_model_without_attention_says_so(caplog):
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    with caplog.at_level(logging.WARNING, logger="kha_compile.passes.apply"):
        report = kc.inspect(mlp, example_args=(torch.randn(2, 8),))
    assert not report.sites
    assert "found no per-head attention" in str(report) and "state-space layers" in report.note
    assert any("found no per-head attention" in r.getMessage() for r in caplog.records)
    with pytest.raises(NoAttentionFoundError, match="found no per-head attention"):
        kc.apply(mlp, example_args=(torch.randn(2, 8),))


# ---- a model on the meta device ----------------------------------------------------------------------


def _meta_llama() -> torch.nn.Module:
    with torch.device("meta"):
        return tiny.make("tiny-llama")  # the CLI's tiny Llama (GQA, rope), built on the meta device


def test_on_the_meta_device_the_check_traces_each_site_module_on_the_inputs_of_apply_trace(monkeypatch, caplog):
    """A meta model cannot run (Llama's mask code calls .item()), so the site's module is traced on the
    inputs it had in apply's own trace, not the whole model again; a role transformed twice is still refused there."""
    from kha_compile.passes import validate

    def whole_model_trace(*args, **kwargs):
        raise AssertionError("the check traced the whole model again")

    monkeypatch.setattr(validate, "_graphs", whole_model_trace)
    model = _meta_llama()
    with caplog.at_level(logging.INFO, logger="kha_compile.passes.validate"):
        kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"))
    (line,) = [r.getMessage() for r in caplog.records if "self-check of" in r.getMessage()]
    assert re.search(r"identity not checked, [3-9] role operands followed, 0 failures", line), line
    assert len(kha_params(model)) > 0

    _value_transform_patched(monkeypatch, "twice")  # T^V acts twice (v_proj carries only T^V here)
    model = _meta_llama()
    with pytest.raises(SelfCheckError, match=r"model\.layers\.0\.self_attn: v: the transform \S+kha\.v acts twice"):
        kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"))
    assert not kha_params(model)
