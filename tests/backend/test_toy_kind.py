"""A transform kind registered from this file goes through the "kha" backend: fold, training, deploy.

No library line knows the kind: the fold rule finds it by its module class, takes its parameters by
their names and folds ``kind.fold_matrix_of`` (the transform of the identity, here diag(s)).
The reference applies the transforms per head at the projection outputs of an untouched model,
with forward hooks and the head layout of the config (4 query heads, 2 key/value heads of 16).
"""

from __future__ import annotations

import pytest
import torch
from backend_cases import loss_of, out_of, rel, run

import kha_compile as kc
import zoo
from helpers import kha_params, perturb
from toys import DiagScaleKind, registered_kind

HEAD_DIM = 16
CFG = dict(q="linear", k="diag_scale", v="diag_scale")


@pytest.fixture
def diag_scale():
    with registered_kind(DiagScaleKind()):
        yield


def _kha_model():
    case = zoo.make("llama")
    kc.apply(case.model, kc.KHAConfig(**CFG))
    perturb(case.model, scale=0.3)
    assert any(n.endswith("kha.k.s") for n in kha_params(case.model))
    return case


def _reference(state: dict[str, torch.Tensor]) -> zoo.ZooCase:
    """An untouched Llama with the transforms of ``state`` hooked onto its projection outputs, per head."""
    ref = zoo.make("llama")
    ref.model.load_state_dict({k: v for k, v in state.items() if ".kha." not in k})
    for name, module in ref.model.named_modules():
        role = name.rpartition(".")[2][:1]
        if not name.endswith(("q_proj", "k_proj", "v_proj")):
            continue
        prefix = f"{name}.kha.{role}."
        if CFG[role] == "linear":
            t = state[prefix + "weight"]
            fn = lambda h, t=t: h @ t  # noqa: E731
        else:
            s = state[prefix + "s"]
            fn = lambda h, s=s: h * s  # noqa: E731
        module.register_forward_hook(lambda _m, _a, y, fn=fn: fn(y.unflatten(-1, (-1, HEAD_DIM))).flatten(-2))
    return ref


def test_toy_kind_folded_under_no_grad(diag_scale):
    case = _kha_model()
    be = kc.backend(compiler="eager")
    compiled = torch.compile(case.model, backend=be)
    got = run(compiled, case)
    ref = _reference(case.model.state_dict())
    assert rel(got, run(ref.model, ref)) < 1e-5
    assert be.stats.rewrites["fold_linear"] == 3 * case.num_sites and not be.stats.declined
    with torch.no_grad():  # move the scales: the fold follows (it reads the live parameters)
        for n, p in kha_params(case.model).items():
            if n.endswith(".s"):
                p.mul_(torch.linspace(0.5, 1.5, p.numel()))
    ref = _reference(case.model.state_dict())
    assert rel(run(compiled, case), run(ref.model, ref)) < 1e-5
    assert len(be.stats.graphs) == 1


def test_toy_kind_stays_and_trains_with_grad(diag_scale):
    case = _kha_model()
    eager = out_of(case.model(*case.args, **case.kwargs))
    loss_of(eager).backward()
    want = {n: p.grad.clone() for n, p in kha_params(case.model).items()}
    case.model.zero_grad()
    be = kc.backend(compiler="eager")
    got = out_of(torch.compile(case.model, backend=be)(*case.args, **case.kwargs))
    loss_of(got).backward()
    assert be.stats.rewrites["fold_linear"] == 0
    assert be.stats.declined and all("gradients are on" in why for _, _, why in be.stats.declined)
    assert rel(got.detach(), eager.detach()) < 1e-5
    for n, g in want.items():
        p = case.model.get_parameter(n)
        assert ((p.grad - g).norm() / g.norm()).item() < 1e-4, n


@pytest.mark.parametrize("grad", [False, True], ids=["folded", "transform_call"])
@pytest.mark.parametrize("give_model", [False, True], ids=["plan", "model_given"])
def test_toy_kind_deployed_from_a_checkpoint(diag_scale, tmp_path, grad, give_model):
    case = _kha_model()
    kc.save_pretrained(case.model, tmp_path)
    ref = _reference(case.model.state_dict())
    vanilla = zoo.make("llama")
    opts = {"model": vanilla.model} if give_model else {}
    be = kc.backend(from_pretrained=tmp_path, compiler="eager", **opts)
    got = run(torch.compile(vanilla.model, backend=be), vanilla, grad=grad)
    assert rel(got.detach(), run(ref.model, ref)) < 1e-5
    assert be.stats.rewrites["deploy"] == 3 * vanilla.num_sites
    assert be.stats.mlp_value_ops == 0
    assert not kha_params(vanilla.model)
