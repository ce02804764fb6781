"""kha_compile/model/mha.py: ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` with KHA are
bit-exact at init against the untouched model, also when fed permuted (non-contiguous) inputs.

The reference is a deep copy taken before ``kc.apply`` and run in the same grad mode. Linear KHA
keeps torch's own forward (fast paths included) on the folded in-projection, so it must equal the
untouched model as it runs by default. MLP-value cannot fold; while it holds exactly its
identity-init tensors it changes nothing, so without a gradient the module keeps torch's own
forward (fast paths included) too: it must equal the untouched model as it runs by default, bit
for bit. Once trained (perturbed) it runs the regular path with the transform.
"""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kha_compile as kc

LINEAR = kc.KHAConfig(q="linear", k="linear", v="linear")
CONFIGS = {"linear": LINEAR, "v-linear": kc.KHAConfig(v="linear"), "mlp": kc.KHAConfig(v="mlp")}
# (batch, tokens, d_model, heads): fewer tokens than d_model (token-side "auto"), and more (weight-side)
SHAPES = [(2, 5, 32, 4), (3, 40, 16, 2)]


def _non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` with the same shape and values, laid out transposed in memory."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


class PermutedAttention(nn.Module):
    """Attention over ``x`` (B, L, E) fed to ``nn.MultiheadAttention`` through layout ops.

    ``mode``: "self" passes one permuted tensor as q, k and v (``query is key is value``); "self3"
    permutes ``x`` three separate times (equal tensors, distinct objects); "cross" attends to ``mem``.
    """

    def __init__(self, E: int, H: int, batch_first: bool, mode: str):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, batch_first=batch_first)
        self.batch_first, self.mode = batch_first, mode

    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        if self.batch_first:  # (B, L, E), non-contiguous
            one, again, src = _non_contiguous, _non_contiguous, _non_contiguous(mem)
        else:  # (L, B, E), permuted views
            one, again, src = (lambda t: t.permute(1, 0, 2)), (lambda t: t.transpose(0, 1)), mem.permute(1, 0, 2)
        if self.mode == "self":
            q = k = v = one(x)
        elif self.mode == "self3":
            q, k, v = one(x), one(x), again(x)
        else:
            q, k, v = one(x), src, src
        return self.attn(q, k, v)[0]


class PermutedEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` fed ``x`` (B, L, E) non-contiguous (batch_first) or permuted."""

    def __init__(self, E: int, H: int, batch_first: bool, norm_first: bool):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            E, H, 2 * E, dropout=0.0, batch_first=batch_first, norm_first=norm_first
        )
        self.batch_first = batch_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(_non_contiguous(x) if self.batch_first else x.permute(1, 0, 2))


def _assert_identity_exact(ref: nn.Module, model: nn.Module, args: tuple, cfg_name: str) -> None:
    """Under grad and under no_grad, ``model`` (KHA at init) equals ``ref`` (untouched, torch's default
    paths, the fused fast path under no_grad included) bit for bit."""
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            got = model(*args)
            want = ref(*args)
        diff = (got - want).abs().max().item()
        assert torch.equal(got, want), f"grad={grad}: max |KHA - untouched| = {diff:.3g}"


CASES = list(itertools.product([True, False], ["self", "self3", "cross"], SHAPES, CONFIGS))


def _id(value: object) -> str:
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


@pytest.mark.parametrize("batch_first,mode,shape,cfg_name", CASES, ids=_id)
def test_multihead_attention_is_bit_exact_at_init_on_permuted_inputs(batch_first, mode, shape, cfg_name):
    B, L, E, H = shape
    torch.manual_seed(0)
    model = PermutedAttention(E, H, batch_first, mode).eval()
    x, mem = torch.randn(B, L, E), torch.randn(B, L + 3, E)
    ref = copy.deepcopy(model)
    kc.apply(model, CONFIGS[cfg_name], example_args=(x, mem))
    assert type(model.attn).__name__ == "KHAMultiheadAttention"
    _assert_identity_exact(ref, model, (x, mem), cfg_name)


@pytest.mark.parametrize(
    "batch_first,norm_first,shape,cfg_name",
    list(itertools.product([True, False], [False, True], SHAPES, ["linear", "mlp"])),
    ids=_id,
)
def test_transformer_encoder_layer_is_bit_exact_at_init_on_permuted_inputs(batch_first, norm_first, shape, cfg_name):
    B, L, E, H = shape
    torch.manual_seed(0)
    model = PermutedEncoderLayer(E, H, batch_first, norm_first).eval()
    x = torch.randn(B, L, E)
    ref = copy.deepcopy(model)
    kc.apply(model, CONFIGS[cfg_name], example_args=(x,))
    _assert_identity_exact(ref, model, (x,), cfg_name)


@pytest.mark.parametrize("batch_first", [True, False])
def test_one_tensor_as_query_key_and_value_keeps_one_packed_in_projection(batch_first, monkeypatch):
    """``query is key is value`` survives the token-side path: one in-projection GEMM, as torch does."""
    E, H = 32, 4
    torch.manual_seed(0)
    model = PermutedAttention(E, H, batch_first, "self").eval()
    x, mem = torch.randn(2, 5, E), torch.randn(2, 5, E)
    ref = copy.deepcopy(model)
    kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(x, mem))
    calls: list[tuple[int, ...]] = []
    real = F.linear

    def spy(inp, weight, bias=None):
        calls.append(tuple(weight.shape))
        return real(inp, weight, bias)

    monkeypatch.setattr(F, "linear", spy)  # F._in_projection_packed and the out-projection call it
    ref(x, mem)
    want, calls[:] = list(calls), []
    model(x, mem)
    assert calls == want == [(3 * E, E), (E, E)]  # one packed q/k/v GEMM, then the out-projection


@pytest.mark.parametrize("mode,kind", [("self", "mha"), ("self3", "mha"), ("cross", "cross")])
@pytest.mark.parametrize("batch_first", [True, False])
def test_permuted_self_attention_is_classified_self_attention(mode, kind, batch_first):
    x, mem = torch.randn(2, 5, 32), torch.randn(2, 8, 32)
    site = kc.inspect(PermutedAttention(32, 4, batch_first, mode), example_args=(x, mem)).sites[0]
    assert site.status == "matched" and site.kind == kind and site.num_heads == 4


@pytest.mark.slow  # a second interpreter: ~30 s
def test_bit_exact_identity_holds_on_avx2_kernels_too():
    """The same checks on the AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``), as an AVX2-only machine runs them."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    code = (  # one interpreter: it says which kernels it runs, then runs the checks on them
        "import sys, torch, pytest; print('capability', torch.backends.cpu.get_cpu_capability(), flush=True); "
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, '-k', 'bit_exact_at_init']))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "capability AVX2" in res.stdout.splitlines(), res.stdout[:300]
    assert " passed" in res.stdout and " deselected" in res.stdout, res.stdout[-500:]  # the checks ran, and only they


def test_mlp_value_off_identity_runs_the_regular_path_and_trains_through_its_transform():
    """The fast path at identity is a shortcut only: a moved MLP-value (no_grad) is applied, equal to the
    regular path under grad; with the in-projection frozen, a backward still reaches the transform."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    ref = copy.deepcopy(layer)
    x = torch.randn(2, 5, 32)
    kc.apply(layer, kc.KHAConfig(v="mlp"), example_args=(x,))
    for p in layer.self_attn.parameters():
        if all(p is not q for q in layer.self_attn.kha.parameters()):
            p.requires_grad_(False)
    kha = [p for n, p in layer.self_attn.named_parameters() if n.startswith("kha.")]
    for p in kha:
        p.requires_grad_(True)
    layer(x).sum().backward()  # at identity, under grad: the regular path, the gate gets a gradient
    assert all(p.grad is not None for p in kha) and bool(layer.self_attn.kha["v"].gate.grad.abs().sum() > 0)
    with torch.no_grad():
        layer.self_attn.kha["v"].gate.add_(0.1)
        moved = layer(x)
        assert (moved - ref(x)).abs().max() > 1e-3
    with torch.enable_grad():
        regular = layer(x).detach()
    torch.testing.assert_close(moved, regular, rtol=1e-5, atol=1e-6)


def _mha_reference(attn: nn.Module, q_in: torch.Tensor, kv_in: torch.Tensor, v_in: torch.Tensor) -> torch.Tensor:
    """Batch-first ``nn.MultiheadAttention`` with separate q/k/v weights, head by head from the stored
    parameters, each head vector through the role's KHA transform (``x @ T``)."""
    sd = attn.state_dict()
    E, H = attn.embed_dim, attn.num_heads
    b = sd["in_proj_bias"]
    t = {r: sd[f"kha.{r}.weight"] for r in "qkv"}
    q, k, v = (
        F.linear(inp, sd[f"{r}_proj_weight"], b[i * E : (i + 1) * E]).unflatten(-1, (H, -1)).transpose(1, 2) @ t[r]
        for i, (r, inp) in enumerate((("q", q_in), ("k", kv_in), ("v", v_in)))
    )  # (B, H, L, Dh)
    o = torch.softmax(q @ k.transpose(-1, -2) / (E // H) ** 0.5, dim=-1) @ v
    return F.linear(o.transpose(1, 2).flatten(2), sd["out_proj.weight"], sd["out_proj.bias"])


def test_multihead_attention_with_kdim_and_vdim_folds_each_role_into_its_own_bias_slice():
    """Separate q/k/v weights (kdim, vdim) and a packed bias: weight-side inference and kc.fold put each
    role's T into its own slice of in_proj_bias, checked against a per-head reference."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(32, 4, kdim=24, vdim=20, batch_first=True).eval()
    with torch.no_grad():
        attn.in_proj_bias.normal_()  # trained-like: torch initialises it to zeros
    q_in, k_in, v_in = torch.randn(2, 50, 32), torch.randn(2, 60, 24), torch.randn(2, 60, 20)
    kc.apply(attn, LINEAR, example_args=(q_in, k_in, v_in))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in attn.kha.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
        want = _mha_reference(attn, q_in, k_in, v_in)
        weight_side = attn(q_in, k_in, v_in, need_weights=False)[0]  # no gradient: folded in-projection
    token_side = attn(q_in, k_in, v_in)[0].detach()
    torch.testing.assert_close(weight_side, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(token_side, want, rtol=1e-4, atol=1e-5)
    kc.fold(attn)
    assert type(attn) is nn.MultiheadAttention
    with torch.no_grad():
        torch.testing.assert_close(attn(q_in, k_in, v_in, need_weights=False)[0], want, rtol=1e-4, atol=1e-5)
