"""Rule external: a torch.library custom attention op in (B, S, H, D) layout with GQA, registered
through kc.register_attention_op; the message for an unregistered one; bad arguments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kha_compile as kc
from form_checks import check_form
from kha_compile.analysis.rules.external import registered_attention_ops, unregister_attention_op
from kha_compile.core.errors import ExportError, NoAttentionFoundError, RegistrationError

D, T = 32, 6


def _attn_bshd_eager(q, k, v, scale):
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)  # (B, S, H, D)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return o.transpose(1, 2).contiguous()  # (B, S, H, D)


@torch.library.custom_op("kha_forms_test::attn_bshd", mutates_args=())
def attn_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Flash-attention style kernel: (B, S, H, D) in and out, fewer kv heads allowed."""
    return _attn_bshd_eager(q, k, v, scale)


@attn_bshd.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.scale = inputs[3]


def _backward(ctx, grad):
    qkv = [t.detach().requires_grad_() for t in ctx.saved_tensors]
    with torch.enable_grad():
        out = _attn_bshd_eager(*qkv, ctx.scale)
    return (*torch.autograd.grad(out, qkv, grad), None)


attn_bshd.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("kha_forms_test::attn_vkq", mutates_args=())
def attn_vkq(v: torch.Tensor, k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) with the arguments in an unusual order: v, k, q."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


@attn_vkq.register_fake
def _(v, k, q):
    return torch.empty_like(q)


class ExternalBlock(nn.Module):
    def __init__(self, d=D, n_head=4, n_kv=2, order="bshd"):
        super().__init__()
        self.h, self.kv, self.hd, self.order = n_head, n_kv, d // n_head, order
        self.q_proj = nn.Linear(d, n_head * self.hd)
        self.k_proj = nn.Linear(d, n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, n_kv * self.hd)
        self.o_proj = nn.Linear(n_head * self.hd, d)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.h, self.hd)  # (B, L, H, Dh)
        k = self.k_proj(x).view(B, L, self.kv, self.hd)  # (B, L, Hkv, Dh)
        v = self.v_proj(x).view(B, L, self.kv, self.hd)
        if self.order == "bshd":
            o = attn_bshd(q, k, v, self.hd**-0.5)  # (B, L, H, Dh)
        else:
            o = attn_vkq(v.transpose(1, 2), k.transpose(1, 2), q.transpose(1, 2)).transpose(1, 2)
        return x + self.o_proj(o.reshape(B, L, -1))


class TwoBlocks(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.blocks = nn.ModuleList([ExternalBlock(**kw), ExternalBlock(**kw)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture
def registered():
    kc.register_attention_op(torch.ops.kha_forms_test.attn_bshd, q=0, k=1, v=2, layout="bshd")
    kc.register_attention_op(attn_vkq, q=2, k=1, v=0, layout="bhsd")  # the custom_op object works too
    yield
    unregister_attention_op(torch.ops.kha_forms_test.attn_bshd)
    unregister_attention_op(attn_vkq)


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("order", ["bshd", "vkq"])
def test_registered_custom_op_with_gqa(registered, v, order):
    x = torch.randn(2, T, D)
    model = check_form(lambda: TwoBlocks(order=order), (x,), v, anchor="external")
    if v == "mlp":
        report = kc.inspect(model, example_args=(x,))
        assert {(s.kind, s.num_heads, s.num_kv_heads, s.head_dim) for s in report.matched} == {("gqa", 4, 2, 8)}


def test_registered_op_trains_one_step(registered):
    model = TwoBlocks()
    x = torch.randn(2, T, D)
    kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(x,))
    kha = [p for n, p in model.named_parameters() if ".kha." in f".{n}"]
    before = [p.detach().clone() for p in kha]
    opt = torch.optim.SGD(kha, lr=0.1)
    model(x).pow(2).mean().backward()  # the custom op's backward: autograd through its eager body
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, kha))


def test_unregistered_op_is_named_with_the_call_that_registers_it():
    model = TwoBlocks()
    with pytest.raises(NoAttentionFoundError, match="look like attention are not registered") as info:
        kc.apply(model, example_args=(torch.randn(1, T, D),))
    msg = str(info.value)
    assert "look like attention are not registered" in msg
    assert "kc.register_attention_op(torch.ops.kha_forms_test.attn_bshd, q=0, k=1, v=2, layout='bshd')" in msg
    assert "contains no attention op" not in msg
    assert not [n for n, _ in model.named_parameters() if ".kha." in f".{n}"]


def test_unregistered_op_layout_guess_bhsd():
    model = TwoBlocks(order="vkq")
    with pytest.raises(NoAttentionFoundError, match=r"attn_vkq, q=0, k=1, v=2, layout='bhsd'"):
        kc.apply(model, example_args=(torch.randn(1, T, D),))


def test_plain_model_still_says_no_attention_op():
    with pytest.raises(NoAttentionFoundError, match="contains no attention op"):
        kc.apply(nn.Sequential(nn.Linear(4, 4)), example_args=(torch.randn(2, 4),))


def test_registry_lists_and_forgets(registered):
    assert "torch.ops.kha_forms_test.attn_bshd" in registered_attention_ops()
    assert registered_attention_ops()["torch.ops.kha_forms_test.attn_vkq"].q == 2


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: kc.register_attention_op(torch.ops.kha_forms_test.attn_bshd, layout="sbhd"), "layout must be one of"),
        (lambda: kc.register_attention_op(torch.ops.kha_forms_test.attn_bshd, q=0, k=0, v=2), "three different"),
        (lambda: kc.register_attention_op(torch.ops.kha_forms_test.attn_bshd, q=-1), "non-negative"),
        (lambda: kc.register_attention_op(torch.ops.kha_forms_test.attn_bshd, v=3), "is not a tensor"),
        (lambda: kc.register_attention_op(torch.ops.kha_forms_test.attn_bshd, v=7), "out of range"),
        (lambda: kc.register_attention_op(F.scaled_dot_product_attention), "Python function"),
        (lambda: kc.register_attention_op("attn"), "expects an op"),
        (lambda: kc.register_attention_op(torch.ops.aten.scaled_dot_product_attention), "recognised already"),
    ],
)
def test_bad_registration_arguments(call, match):
    with pytest.raises(RegistrationError, match=match):
        call()
    assert "torch.ops.kha_forms_test.attn_bshd" not in registered_attention_ops()


def test_head_maps_come_from_the_projections_whatever_the_registered_layout():
    kc.register_attention_op(torch.ops.kha_forms_test.attn_bshd, layout="bhsd")  # wrong: it is bshd
    try:
        report = kc.inspect(TwoBlocks(n_kv=1, n_head=4), example_args=(torch.randn(1, T, D),))
    finally:
        unregister_attention_op(torch.ops.kha_forms_test.attn_bshd)
    # the head split is read off the index pushed from the projections (last axis = head dim, one
    # other varying axis = heads), so (B, S, H, D) is read right even when registered as bhsd
    assert [(s.kind, s.num_heads, s.num_kv_heads, s.head_dim) for s in report.matched] == [("mqa", 4, 1, 8)] * 2


def test_onnx_export_of_an_unknown_custom_op_fails_with_the_step_named(registered, tmp_path):
    model = TwoBlocks()
    x = torch.randn(1, T, D)
    kc.apply(model, example_args=(x,))
    with pytest.raises(ExportError, match=r"step '\w+'"):
        kc.export_onnx(model, tmp_path / "ext.onnx", example_args=(x,))
