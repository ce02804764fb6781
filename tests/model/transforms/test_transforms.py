"""Transform kinds are a registry: a new kind is one spec, and config, apply, fold and remove use it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kha_compile as kc
import zoo
from helpers import kha_params, perturb, run
from kha_compile.core.errors import KHAConfigError, UnknownTransformError
from kha_compile.model.transforms import TransformKind, base, get_transform, register_transform, transform_kinds


class Scale(nn.Module):
    """A per-feature scale shared by every head: diag(s), identity at s = 1."""

    kind = "scale"

    def __init__(self, head_dim, *, dtype=None, device=None):
        super().__init__()
        self.s = nn.Parameter(torch.ones(head_dim, dtype=dtype, device=device))

    def forward(self, x):
        return ScaleKind().functional(x, self.s)


class ScaleKind(TransformKind):
    name = "scale"
    roles = ("k", "v")
    module_cls = Scale
    param_names = ("s",)
    foldable = True

    def functional(self, x, *params):
        return x * params[0]

    def fold_matrix(self, module):
        return torch.diag(module.s)


@pytest.fixture
def scale_kind():
    saved = base.KINDS.items()
    register_transform(ScaleKind())
    yield
    base.KINDS.restore(saved)


def test_builtin_kinds_and_their_roles():
    kinds = transform_kinds()
    assert list(kinds)[:2] == ["linear", "mlp"]
    assert kinds["linear"].roles == ("q", "k", "v") and kinds["linear"].foldable
    assert kinds["mlp"].roles == ("v",) and not kinds["mlp"].foldable
    with pytest.raises(UnknownTransformError, match=r"unknown KHA transform kind 'gate'.*'linear', 'mlp'"):
        get_transform("gate")
    assert issubclass(UnknownTransformError, KHAConfigError)


def test_old_import_paths_still_name_the_transform_classes():
    from kha_compile.model.transforms.linear import KHALinearTransform
    from kha_compile.model.transforms.linear import KHALinearTransform as Lin
    from kha_compile.model.transforms.mlp import KHAMLPValue

    assert KHALinearTransform is Lin and KHAMLPValue.kind == "mlp"


@pytest.mark.parametrize("name", ["linear", "mlp"])
def test_functional_forward_equals_the_module_and_starts_at_identity(name):
    kind = get_transform(name)
    module = kind.create(8)
    x = torch.randn(2, 3, 4, 8)
    assert torch.equal(module(x), x)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    torch.testing.assert_close(kind.functional(x, *kind.params(module)), module(x))
    assert set(kind.matrices(module)) == ({"T"} if name == "linear" else {"up", "gate", "down"})
    if kind.foldable:
        torch.testing.assert_close(x @ kind.fold_matrix(module), module(x))


def test_mlp_kind_carries_its_onnx_translation():
    (op,) = get_transform("mlp").onnx_translations()
    assert op is torch.ops.kha.mlp_value.default
    assert get_transform("linear").onnx_translations() == {}


def test_config_reads_the_allowed_values_from_the_registry(scale_kind):
    assert kc.KHAConfig(k="scale", v="scale").roles() == {"k": "scale", "v": "scale"}
    assert kc.KHAConfig(v="scale").foldable and not kc.KHAConfig(v="mlp").foldable
    with pytest.raises(KHAConfigError, match=r"KHAConfig.q='scale' is not allowed; use one of None, 'linear'\."):
        kc.KHAConfig(q="scale")


def test_a_registered_kind_is_applied_trained_folded_and_removed(scale_kind):
    case = zoo.make("llama")
    with torch.no_grad():
        ref = run(case)
    kc.apply(case.model, kc.KHAConfig(q="linear", k="scale", v="scale"))
    assert {s.transforms["k"] for s in kc.inspect(case.model).matched} == {"scale"}
    assert any(n.endswith("kha.k.s") for n in kha_params(case.model))
    with torch.no_grad():
        assert torch.equal(run(case), ref)
        perturb(case.model)
        trained = run(case)
        assert not torch.allclose(trained, ref, atol=1e-5)
    kc.fold(case.model)  # the scale folds through its fold_matrix, like linear
    assert not kha_params(case.model)
    with torch.no_grad():
        torch.testing.assert_close(run(case), trained, rtol=1e-4, atol=1e-4)
