"""Extension points, each used from this file only: a transform kind, an attention rule, a projection handler.

Each one is registered here, with no line of library code changed, and goes through apply, fold,
save/load, ONNX export and the ``"kha"`` backend. Outputs are checked against references computed
by hand from the untouched modules and the KHA tensors (per head), not by the library's own code.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import kha_compile as kc
from helpers import kha_params, perturb
from kha_compile.analysis.rules import RULES, register_rule
from kha_compile.analysis.rules.base import Anchor
from kha_compile.handlers import HANDLERS, ProjectionHandler, owner_of, register_handler
from kha_compile.model.carrier import KHAProjection, attach, detach
from kha_compile.model.rows import fold_rows
from kha_compile.model.transforms import kind_of
from toys import DiagScaleKind, registered_kind

D, H, T = 32, 4, 40  # more tokens than d_model: linear KHA runs weight-side in training
DH = D // H


# -- a transform kind: a per-feature scale shared by all heads (diag(s), foldable): toys.DiagScaleKind --

# -- an attention rule: sigmoid attention, sigmoid(q k^T / sqrt(d) + b) @ v ---------------------------
aten = torch.ops.aten


class SigmoidAttentionRule:
    name = "toy_sigmoid_attention"

    def match(self, g, node):
        if node.op != "call_function" or node.target is not aten.sigmoid.default:
            return None
        score = node.args[0]
        for _ in range(4):  # through the scaling and the bias
            if score.target is aten.matmul.default:
                break
            score = next((a for a in score.args if hasattr(a, "target")), None)
            if score is None:
                return None
        else:
            return None
        value = next((u for u in node.users if u.target is aten.matmul.default and u.args[0] is node), None)
        if value is None:
            return Anchor(node, self.name, {}, {}, "sigmoid scores without a value matmul")
        q, kt, v = score.args[0], score.args[1], value.args[1]
        dims = {"q": q.meta["val"].shape[-1], "k": kt.meta["val"].shape[-2], "v": v.meta["val"].shape[-1]}
        return Anchor(value, self.name, {"q": q, "k": kt, "v": v}, dims)


# -- a projection handler: a low-rank projection y = (x A) B, KHA folded into the columns of B ------------
class LowRank(nn.Module):
    def __init__(self, d_in, d_out, rank=8):
        super().__init__()
        self.A = nn.Parameter(torch.randn(d_in, rank) / math.sqrt(d_in))
        self.B = nn.Parameter(torch.randn(rank, d_out) / math.sqrt(rank))

    def forward(self, x):
        return (x @ self.A) @ self.B


class LowRankHandler(ProjectionHandler):
    name = "toy_lowrank"
    priority = 5
    module_call = True

    def accepts(self, model, m):
        return isinstance(owner_of(model, m), LowRank), ""

    def owns(self, module):
        return isinstance(module, KHAProjection) and isinstance(module, LowRank)

    def attach(self, module, entry):
        attach(module, tuple(entry.slots), entry.kinds, entry.out_features, handler=self.name, weight_axis=None)

    def detach(self, module):
        detach(module)

    def fold(self, module, roles):
        b = module.B
        for s in module._kha_slots:
            if s.role in roles:
                t = module.kha[s.role]
                b, _ = fold_rows(b, None, s, kind_of(t).fold_matrix(t), axis=1)
        return [("B", b)]


class SigmoidBlock(nn.Module):
    """One attention block: low-rank q, linear k and v, sigmoid attention."""

    def __init__(self):
        super().__init__()
        self.q = LowRank(D, D)
        self.k, self.v, self.o = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, H, DH).transpose(1, 2)  # (B, H, L, Dh)
        k = self.k(x).view(B, L, H, DH).transpose(1, 2)
        v = self.v(x).view(B, L, H, DH).transpose(1, 2)
        s = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(DH) - math.log(L))  # (B, H, L, L)
        return x + self.o((s @ v).transpose(1, 2).reshape(B, L, D))


@pytest.fixture
def extensions():
    """Register the three extensions for one test; the registries are restored afterwards."""
    rules, handlers = RULES.items(), HANDLERS.items()
    with registered_kind(DiagScaleKind()):
        register_rule(SigmoidAttentionRule())
        register_handler(LowRankHandler())
        yield
    RULES.restore(rules)
    HANDLERS.restore(handlers)


def _reference(block: SigmoidBlock, x: torch.Tensor, kha: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """The block by hand, per head, with the KHA tensors applied to each head vector of each role."""
    B, L, _ = x.shape
    heads = {
        "q": (x @ block.q.A.detach() @ block.q.B.detach()).view(B, L, H, DH),
        "k": nn.functional.linear(x, block.k.weight, block.k.bias).view(B, L, H, DH),
        "v": nn.functional.linear(x, block.v.weight, block.v.bias).view(B, L, H, DH),
    }
    for role, tensors in kha.items():
        if "weight" in tensors:  # linear: x @ T
            heads[role] = heads[role] @ tensors["weight"]
        else:  # diag_scale: x * s
            heads[role] = heads[role] * tensors["s"]
    out = torch.zeros(B, L, H, DH)
    for h in range(H):
        q, k, v = (heads[r][:, :, h] for r in "qkv")  # (B, L, Dh)
        out[:, :, h] = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(DH) - math.log(L)) @ v
    return x + block.o(out.reshape(B, L, D))


def _kha_tensors(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in kha_params(model).items():
        role, pname = name.split(".kha.")[1].split(".")
        out.setdefault(role, {})[pname] = p.detach().clone()
    return out


def _block_and_input() -> tuple[SigmoidBlock, torch.Tensor]:
    torch.manual_seed(0)
    return SigmoidBlock(), torch.randn(2, T, D)


def _cfg() -> kc.KHAConfig:
    return kc.KHAConfig(q="linear", k="diag_scale", v="diag_scale")  # valid once the kind is registered


def test_without_the_rule_the_built_in_rule_for_attention_without_softmax_anchors_it():
    """Sigmoid attention has no softmax: without the toy rule, the built-in ``linear_attention`` rule
    anchors it; registered, the toy rule (tried first) claims it, and the built-in one adds no second site."""
    block, x = _block_and_input()
    (site,) = kc.inspect(block, example_args=(x,)).sites
    assert site.anchor == "linear_attention"


def test_extensions_apply_train_and_fold_against_a_per_head_reference(extensions):
    block, x = _block_and_input()
    with torch.no_grad():
        ref0 = block(x)
    kc.apply(block, _cfg(), example_args=(x,))
    (site,) = kc.inspect(block, example_args=(x,)).matched
    assert site.anchor == "toy_sigmoid_attention" and site.transforms == {
        "q": "linear",
        "k": "diag_scale",
        "v": "diag_scale",
    }
    assert block.q.__dict__["_kha_handler"] == "toy_lowrank"
    with torch.no_grad():
        assert torch.equal(block(x), ref0)  # identity at init
    perturb(block)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2, fused=True)
    for _ in range(3):  # trains: every KHA tensor gets a gradient
        opt.zero_grad()
        block(x).square().mean().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in kha_params(block).values())
        opt.step()
    with torch.no_grad():
        trained = block(x)
        torch.testing.assert_close(trained, _reference(block, x, _kha_tensors(block)), rtol=1e-5, atol=1e-5)
    kc.fold(block)
    assert not kha_params(block) and type(block.q) is LowRank and type(block.k) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(block(x), trained, rtol=1e-5, atol=1e-5)


def test_extensions_save_load_onnx_and_backend(extensions, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    block, x = _block_and_input()
    kc.apply(block, _cfg(), example_args=(x,))
    perturb(block)
    block.eval()
    with torch.no_grad():
        trained = block(x)
    expected = _reference(block, x, _kha_tensors(block)).detach()
    torch.testing.assert_close(trained, expected, rtol=1e-5, atol=1e-5)

    kc.save_pretrained(block, tmp_path / "ckpt")
    fresh, _ = _block_and_input()
    kc.load_pretrained(fresh, tmp_path / "ckpt", example_args=(x,))
    with torch.no_grad():
        assert torch.equal(fresh(x), trained)

    path = kc.export_onnx(block, tmp_path / "folded.onnx", example_args=(x,))  # folds a copy
    (got,) = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-4, atol=1e-4)
    assert kha_params(block)  # the caller's model keeps its KHA

    be = kc.backend(compiler="eager")
    with torch.no_grad():
        compiled = torch.compile(block, backend=be, dynamic=False)(x)
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-5)
    assert be.stats.rewrites["fold_linear"] == 3  # q linear into B's columns; k and v scales into their rows
