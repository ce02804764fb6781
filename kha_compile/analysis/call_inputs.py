"""The inputs each module is first called with during a trace, kept as shapes and dtypes.

apply's self-check traces each site's module again on the inputs that module sees. Where the model
cannot run (its weights on the meta device: transformers' mask code calls ``.item()``), the inputs
recorded while apply traced the model stand in: tensors of the same shapes, dtypes and devices, made
afresh (no tensor of the trace is kept), and the plain values as they were.

Example::

    with recording(model) as seen:
        torch.export.export(model, args, kwargs, strict=False)
    call = seen.get(id(model.layers[0].self_attn))        # (args, kwargs) of TensorSpecs, or None
    if call is not None:
        args, kwargs = materialize(call)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

__all__ = ["TensorSpec", "materialize", "recording"]

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a tensor input was: enough to make one like it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class _Unrecordable(Exception):
    pass


def _spec(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        if not all(isinstance(s, int) for s in leaf.shape):  # a symbolic size: nothing to stand in for it
            raise _Unrecordable
        return TensorSpec(tuple(leaf.shape), leaf.dtype, leaf.device)
    if isinstance(leaf, _PLAIN):
        return leaf
    raise _Unrecordable  # an object of the model's (a cache, a config): the call is not recorded


def _specs(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    try:
        return _pytree.tree_map(_spec, tuple(args)), _pytree.tree_map(_spec, dict(kwargs))
    except _Unrecordable:
        return None
    except Exception:  # a container pytree cannot flatten
        return None


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[dict[int, tuple[tuple, dict] | None]]:
    """Yield ``{id(module): (args, kwargs) of its first call, as TensorSpecs, or None}``, filled while the
    block runs (hooks on every module of ``model``, taken out after)."""
    seen: dict[int, tuple[tuple, dict] | None] = {}

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if id(module) not in seen:
            seen[id(module)] = _specs(args, kwargs)

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def materialize(call: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """(args, kwargs) with a zero tensor for each TensorSpec (on its device: no memory on meta)."""

    def make(leaf: Any) -> Any:
        if isinstance(leaf, TensorSpec):
            return torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device)
        return leaf

    args, kwargs = call
    return _pytree.tree_map(make, args), _pytree.tree_map(make, kwargs)
