"""FLOP formulas of ``kha::mlp_value`` and ``kha::mlp_value_backward`` for ``torch.utils.flop_counter``.

Registered on import of :mod:`kha_compile.ops`, so ``FlopCounterMode`` (and the profiler's FLOP
column, which uses the same registry) counts the fused op instead of 0. Like torch's own formulas,
they count the matrix products (2 FLOPs per multiply-add) and leave out element-wise work (the
sigmoid and the gating), so a count of the op equals a ``FlopCounterMode`` count of its decomposition:

* forward: ``a = v W_up``, ``g = v W_gate``, ``y = h W_down``: 3 GEMMs of (M, d) x (d, d) = 6 M d^2;
* backward (:func:`~kha_compile.ops.mlp_value.mlp_value_backward_reference`): a and g recomputed from
  v (2 GEMMs), ``grad_h`` (1), ``grad_v`` (2) and the three weight gradients (3): 16 M d^2.
  Autograd through the unfused formula saves a and g instead and does 12 M d^2; the op trades those
  4 M d^2 for two (M, d) activations not kept in memory.

M is the product of v's leading dims and d its last dim.

Example::

    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as fc:
        torch.ops.kha.mlp_value(v, w_up, w_gate, w_down)
    fc.get_total_flops() == mlp_value_flops(v.shape)           # 6 * M * d * d
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from . import mlp_value as _mlp_value  # noqa: F401  (defines torch.ops.kha.mlp_value, registered on below)

__all__ = ["BACKWARD_GEMMS", "FORWARD_GEMMS", "mlp_value_backward_flops", "mlp_value_flops"]

FORWARD_GEMMS = 3  # (M, d) x (d, d) products in the forward
BACKWARD_GEMMS = 8  # in the op's backward (2 recomputed + grad_h + 2 for grad_v + 3 weight gradients)


def _rows_and_dim(v_shape: Sequence[int]) -> tuple[int, int]:
    d = int(v_shape[-1])
    return math.prod(int(x) for x in v_shape[:-1]), d


def mlp_value_flops(v_shape: Sequence[int]) -> int:
    """FLOPs of ``kha::mlp_value`` for ``v`` of shape (..., d): 6 * M * d^2 (3 GEMMs).

    Example::

        mlp_value_flops((4, 2048, 8, 128))    # 6 * 65536 * 128 * 128
    """
    M, d = _rows_and_dim(v_shape)
    return FORWARD_GEMMS * 2 * M * d * d


def mlp_value_backward_flops(v_shape: Sequence[int]) -> int:
    """FLOPs of ``kha::mlp_value_backward`` for ``v`` of shape (..., d): 16 * M * d^2 (8 GEMMs).

    Example::

        mlp_value_backward_flops((65536, 128))    # 16 * 65536 * 128 * 128
    """
    M, d = _rows_and_dim(v_shape)
    return BACKWARD_GEMMS * 2 * M * d * d


@register_flop_formula(torch.ops.kha.mlp_value)
def _mlp_value_flop(v_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return mlp_value_flops(v_shape)


@register_flop_formula(torch.ops.kha.mlp_value_backward)
def _mlp_value_backward_flop(grad_shape: Any, v_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return mlp_value_backward_flops(v_shape)
