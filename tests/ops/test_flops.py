"""kha_compile/ops/flops.py: FlopCounterMode counts kha::mlp_value and its backward.

The op's counts are checked against counts by hand and against FlopCounterMode of the unfused
formula; a Llama training step at the shape of issue 9 (8192 tokens) is counted on the meta device
and its ratio to the same step without KHA checked against the ratio derived from the config.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import kha_compile as kc
from helpers import META_BATCH, META_SEQ, meta_llama, training_step_flops
from kha_compile.ops import mlp_value_backward_flops, mlp_value_flops
from kha_compile.ops.mlp_value import mlp_value_backward_reference, mlp_value_reference


def _count(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def _inputs(shape, device="cpu", requires_grad=False):
    d = shape[-1]
    g = torch.Generator().manual_seed(0)
    v = torch.randn(*shape, generator=g).to(device)
    ws = [torch.randn(d, d, generator=g).to(device) for _ in range(3)]
    for t in (v, *ws):
        t.requires_grad_(requires_grad)
    return v, ws


@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 7, 32), (1, 64)])
def test_formulas_by_hand(shape):
    *lead, d = shape
    M = 1
    for x in lead:
        M *= x
    # forward: v W_up, v W_gate, h W_down: 3 products of (M, d) x (d, d), 2 FLOPs per multiply-add
    assert mlp_value_flops(shape) == 3 * (2 * M * d * d)
    # backward: a, g recomputed; grad_h; grad_v (2 products); dW_up, dW_gate, dW_down
    assert mlp_value_backward_flops(shape) == (2 + 1 + 2 + 3) * (2 * M * d * d)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 7, 32)])
def test_forward_count_equals_the_unfused_formula(device, shape):
    v, ws = _inputs(shape, device)
    fused = _count(lambda: torch.ops.kha.mlp_value(v, *ws))
    assert fused == _count(lambda: mlp_value_reference(v, *ws)) > 0
    assert fused == mlp_value_flops(shape)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_backward_op_count_equals_its_decomposition(device):
    shape = (2, 3, 7, 32)
    v, ws = _inputs(shape, device)
    grad = torch.ones(shape, device=device)
    fused = _count(lambda: torch.ops.kha.mlp_value_backward(grad, v, *ws))
    assert fused == _count(lambda: mlp_value_backward_reference(grad, v, *ws)) == mlp_value_backward_flops(shape)


def test_training_step_counts_forward_and_backward():
    shape = (4, 9, 32)
    M, d = 36, 32
    v, ws = _inputs(shape, requires_grad=True)
    fused = _count(lambda: torch.ops.kha.mlp_value(v, *ws).sum().backward())
    assert fused == mlp_value_flops(shape) + mlp_value_backward_flops(shape) == 22 * M * d * d
    # autograd of the unfused formula keeps a and g instead of recomputing them: 4 M d^2 fewer
    v2, ws2 = _inputs(shape, requires_grad=True)
    unfused = _count(lambda: mlp_value_reference(v2, *ws2).sum().backward())
    assert fused - unfused == 2 * (2 * M * d * d)


def test_llama_training_step_at_8192_tokens_on_meta():
    """Issue 9's shape: hidden 1024, 8 q / 4 kv heads of 128; batch 4 x seq 2048; 2 layers."""
    B, L = META_BATCH, META_SEQ
    step = training_step_flops
    base_model, kha_model = meta_llama(), meta_llama()
    kc.apply(kha_model, kc.KHAConfig(v="mlp"))
    base, kha = step(base_model), step(kha_model)

    # By hand. Linear layers: forward 2 T P, backward 4 T P (grad input and grad weight).
    T, H, n, dh, hq, hkv = B * L, 1024, 2, 128, 8, 4
    P = n * (H * (hq + 2 * hkv + hq) * dh + 3 * H * 2816) + H * 8192  # q, k, v, o; gate, up, down; lm_head
    # Attention (eager bmm): forward QK^T and AV, backward two products for each: 12 B hq L^2 dh per layer.
    attn = n * 12 * B * hq * L * L * dh
    assert base == 6 * T * P + attn
    # MLP-value on every kv head's values: M = T * hkv rows of dh; forward 6 M dh^2, backward 16 M dh^2.
    extra = n * 22 * (T * hkv) * dh * dh
    assert kha - base == extra
    ratio = kha / base
    assert ratio == pytest.approx(1 + extra / (6 * T * P + attn), rel=1e-12)
    assert 1.01 < ratio < 1.02  # 1.0119 with 2 layers, where the lm_head is a fifth of the step
    # per decoder layer (the limit for a deep model): 22 hkv dh^2 / (6 P_layer + 12 hq L dh) = 1.50%
    per_layer = extra / (base - 6 * T * H * 8192)
    assert per_layer == pytest.approx(22 * hkv * dh * dh / (6 * (P - H * 8192) / n + 12 * hq * L * dh))
    assert 0.0145 < per_layer < 0.0155
