"""``kha::mlp_value``: V~ = 2 * ((V W_up) * sigmoid(V W_gate)) W_down over the last axis of V.

One op for eager, torch.compile, torch.export and ONNX: graphs keep it as a single node.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import OpInputError

__all__ = ["mlp_value", "mlp_value_reference", "check_mlp_value_inputs"]


def check_mlp_value_inputs(v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor) -> None:
    """Raise OpInputError unless the weights are (d, d) with d = v.shape[-1], all of v's dtype/device."""
    if v.dim() < 1:
        raise OpInputError("kha::mlp_value: v must have at least one dimension (..., d); got a scalar.")
    d = v.shape[-1]
    for name, w in (("w_up", w_up), ("w_gate", w_gate), ("w_down", w_down)):
        if w.dim() != 2 or w.shape[0] != d or w.shape[1] != d:
            raise OpInputError(
                f"kha::mlp_value: {name} has shape {tuple(w.shape)}, but v has shape {tuple(v.shape)}; "
                f"each weight must be ({d}, {d}) to match v's last dimension."
            )
        if w.dtype != v.dtype:
            raise OpInputError(
                f"kha::mlp_value: {name} is {w.dtype} but v is {v.dtype}; cast them to one dtype."
            )
        if w.device != v.device:
            raise OpInputError(
                f"kha::mlp_value: {name} is on {w.device} but v is on {v.device}; move them to one device."
            )


def mlp_value_reference(v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor) -> Tensor:
    """The composite formula, in plain torch ops (the op's reference and its decomposition)."""
    return (2.0 * (v @ w_up) * torch.sigmoid(v @ w_gate)) @ w_down


@torch.library.custom_op("kha::mlp_value", mutates_args=())
def mlp_value(v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor) -> Tensor:
    """Fused MLP-value transform over the last axis of ``v`` (..., d); weights are (d, d).

    Example::

        y = torch.ops.kha.mlp_value(v, w_up, w_gate, w_down)
    """
    check_mlp_value_inputs(v, w_up, w_gate, w_down)
    return mlp_value_reference(v, w_up, w_gate, w_down)


@mlp_value.register_fake
def _(v, w_up, w_gate, w_down):
    check_mlp_value_inputs(v, w_up, w_gate, w_down)
    return torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    v, w_up, w_gate, w_down = ctx.saved_tensors
    # Recompute the gate activations instead of saving them: two (M, d) tensors fewer in memory.
    d = v.shape[-1]
    v2 = v.reshape(-1, d)  # (M, d)
    g2 = grad.reshape(-1, d)  # (M, d)
    a = v2 @ w_up
    s = torch.sigmoid(v2 @ w_gate)
    h = 2.0 * a * s  # (M, d)
    grad_h = g2 @ w_down.t()
    grad_a = grad_h * (2.0 * s)
    grad_g = grad_h * (2.0 * a * s * (1.0 - s))
    grad_v = grad_a @ w_up.t() + grad_g @ w_gate.t()
    return (
        grad_v.reshape(v.shape),
        v2.t() @ grad_a,
        v2.t() @ grad_g,
        h.t() @ g2,
    )


mlp_value.register_autograd(_backward, setup_context=_setup_context)
