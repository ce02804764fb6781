"""DTensor sharding rules of ``kha::mlp_value`` and ``kha::mlp_value_backward``.

The transform acts on the last axis of ``v`` (one head vector) with (d, d) weights, so ``v`` may be
sharded on any other axis (batch, sequence, heads) as long as the weights are replicated; the output
is sharded like ``v``. In the backward, the weight gradients of a sharded ``v`` are partial sums
(``Partial()``): DTensor reduces them where a replicated gradient is needed. Registered once: on
``import kha_compile`` when ``torch.distributed.tensor`` is already imported (importing it just for
this would cost ``import kha_compile`` about a second), on the first :func:`kha_compile.parallelize`,
or by calling :func:`register_mlp_value_sharding` (needed only when DTensor is imported after
kha_compile and the op gets DTensor inputs without ``kc.parallelize``).

Example::

    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    v = distribute_tensor(torch.randn(4, 8, 16), mesh, [Shard(0)])
    w = [distribute_tensor(x, mesh, [Replicate()]) for x in (up, gate, down)]
    y = torch.ops.kha.mlp_value(v, *w)          # DTensor, Shard(0)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .. import ops  # noqa: F401  (registers torch.ops.kha.*)

__all__ = ["register_mlp_value_sharding"]

log = logging.getLogger(__name__)

_REGISTERED = False


def register_mlp_value_sharding() -> bool:
    """Register the rules with DTensor (once); False where torch.distributed is unavailable."""
    global _REGISTERED
    if _REGISTERED:
        return True
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import Partial, Placement, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    # (output placements, input placements) pairs, one per strategy
    _Rules = list[tuple[list[Placement], list[Placement]]]

    @register_sharding(torch.ops.kha.mlp_value.default)
    def _forward_rule(v: Any, w_up: Any, w_gate: Any, w_down: Any) -> _Rules:
        rep: list[Placement] = [Replicate()]
        rules: _Rules = [(rep, [Replicate()] * 4)]
        for dim in range(v.ndim - 1):  # any axis but the head vector's own
            rules.append(([Shard(dim)], [Shard(dim), Replicate(), Replicate(), Replicate()]))
        return rules

    @register_sharding(torch.ops.kha.mlp_value_backward.default)
    def _backward_rule(grad: Any, v: Any, w_up: Any, w_gate: Any, w_down: Any) -> _Rules:
        rules: _Rules = [([Replicate()] * 4, [Replicate()] * 5)]
        for dim in range(v.ndim - 1):
            rules.append(
                (
                    [Shard(dim), Partial(), Partial(), Partial()],
                    [Shard(dim), Shard(dim), Replicate(), Replicate(), Replicate()],
                )
            )
        return rules

    _REGISTERED = True
    log.debug("registered DTensor sharding rules for kha::mlp_value and kha::mlp_value_backward")
    return True
