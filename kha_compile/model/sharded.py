"""Sharded models inside the model: FSDP2 and DTensor detection, and tensor-parallel KHA projections.

:func:`refuse_sharded` says, before anything is touched, that a verb needs the unsharded model.
:class:`TensorParallelKHA` is the class a KHA projection gets once its weight is sharded
column-wise (``kc.parallelize``): its transforms run on the rank's local heads
(:func:`local_slots`), with parameters replicated over the TP mesh and their gradients summed
over the TP group in one all-reduce per transform, which is exactly the single-process gradient.

Example::

    from kha_compile.model.sharded import sharded_parts
    sharded_parts(model)            # [] for a plain model, e.g. ['FSDP module model.layers.0'] after fully_shard
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import ShardedModelError, TensorParallelError
from ..core.mixins import mixin_class
from ..core.optional import is_dtensor, loaded
from .slots import HeadSlot, transform_slices
from .transforms import kind_of

__all__ = [
    "TensorParallelKHA",
    "is_dtensor",
    "is_sharded",
    "local_features",
    "local_slots",
    "refuse_sharded",
    "shard_carrier",
    "sharded_parts",
    "tp_class",
]

log = logging.getLogger(__name__)


def sharded_parts(model: nn.Module, limit: int = 3) -> list[str]:
    """Up to ``limit`` descriptions of what makes ``model`` sharded: FSDP2 modules and DTensor parameters."""
    found: list[str] = []
    fsdp = loaded("torch.distributed.fsdp")  # no FSDP2 module exists before it is imported
    for name, m in model.named_modules():
        if fsdp is not None and isinstance(m, fsdp.FSDPModule):
            found.append(f"FSDP module {name or '<root>'}")
            if len(found) >= limit:
                return found
    for name, p in model.named_parameters():
        if is_dtensor(p):
            found.append(f"DTensor parameter {name} {tuple(p.placements)}")  # type: ignore[attr-defined]
            if len(found) >= limit:
                break
    return found


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2 modules or DTensor parameters."""
    return bool(sharded_parts(model, limit=1))


def refuse_sharded(model: nn.Module, verb: str) -> None:
    """Raise :class:`ShardedModelError` if ``model`` is sharded; ``verb`` names the refused call."""
    parts = sharded_parts(model)
    if not parts:
        return
    if verb == "fold":
        todo = (
            "Gather first: call kc.save_pretrained(model, d) on every rank (rank 0 writes the KHA weights), "
            "then in one process load the trained base weights into a plain model, kc.load_pretrained(plain, d) "
            "and kc.fold(plain); or gather the full state dict with torch.distributed.checkpoint.state_dict."
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) into an unsharded "
            "model that carries KHA (kc.apply), and fold that one. Nothing was changed."
        )
    else:
        todo = (
            f"kc.{verb} must run on the unsharded model: call kc.apply(model, ...) first, then "
            "kc.parallelize(model, mesh, plan) for tensor parallel and/or fully_shard(...) for FSDP2. "
            "The model was not touched and still trains as it is."
        )
    raise ShardedModelError(f"{type(model).__name__} is already sharded ({', '.join(parts)}). {todo}")


class _SumOverGroup(torch.autograd.Function):
    """Identity forward on several tensors; the backward sums their gradients over ``group`` in one all-reduce."""

    @staticmethod
    def forward(ctx: Any, group: Any, *xs: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        flat = [g.reshape(-1) for g in grads if g is not None]
        if len(flat) != len(grads):  # pragma: no cover - every KHA parameter takes part in its forward
            raise TensorParallelError("a KHA parameter got no gradient on this rank; every rank must use all of them.")
        bucket = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
        torch.distributed.all_reduce(bucket, group=ctx.group)
        return (None, *(b.view_as(g) for b, g in zip(bucket.split([f.numel() for f in flat]), grads)))


class TensorParallelKHA:
    """Mixin of a KHA projection sharded column-wise: transforms run on the local heads.

    :func:`parallelize` gives a KHA projection a subclass of this mixin and its own class (so
    ``detach``/``fold`` still find the original class). ``_kha_tp_layout`` holds the local slots.
    """

    _kha_tp_layout: tuple[tuple[HeadSlot, ...], str, int]
    _kha_tp_group: Any
    kha: nn.ModuleDict

    def _kha_weight_side_roles(self, args: tuple, kwargs: dict) -> tuple[str, ...]:
        return ()  # sharded weights: the transforms run on each rank's local heads (token-side)

    def kha_transform(self, y: Tensor, skip: Sequence[str] = ()) -> Tensor:
        """Apply the transforms to this rank's heads of ``y`` (a DTensor sharded on its last axis)."""
        from torch.distributed.tensor import DTensor

        if not isinstance(y, DTensor):  # pragma: no cover - ColwiseParallel always gives a DTensor here
            raise TensorParallelError(
                "a tensor-parallel KHA projection expected a DTensor output; shard it with ColwiseParallel."
            )
        local = y.to_local()
        slots, mode, stride = self._kha_tp_layout
        slots = tuple(s for s in slots if s.role not in skip)
        out = transform_slices(local, slots, mode, stride, {s.role: self._local_fn(s.role) for s in slots})
        return DTensor.from_local(out, y.device_mesh, y.placements, run_check=False, shape=y.shape, stride=y.stride())

    def _local_fn(self, role: str) -> Callable[[Tensor], Tensor]:
        module = self.kha[role]
        group = self._kha_tp_group
        names, tensors = zip(*module.named_parameters())
        local = [p.to_local() if is_dtensor(p) else p for p in tensors]
        params = dict(zip(names, _SumOverGroup.apply(group, *local)))  # one all-reduce per transform
        kind = kind_of(module)
        ordered = [params[n] for n in kind.param_names]
        return lambda x: kind.functional(x, *ordered)


def shard_carrier(module: nn.Module, layout: tuple[tuple[HeadSlot, ...], str, int], group: Any) -> None:
    """Make a KHA projection whose weight is sharded column-wise a :class:`TensorParallelKHA`.

    ``layout``: its local (slots, plan, stride); ``group``: the TP process group its transforms'
    gradients are summed over.
    """
    module.__class__ = tp_class(type(module))
    module.__dict__["_kha_tp_layout"] = layout
    module.__dict__["_kha_tp_group"] = group


def tp_class(cls: type) -> type:
    """The tensor-parallel class of a KHA projection class (``TPKHA<Base>``, made once)."""
    if issubclass(cls, TensorParallelKHA):
        return cls
    return mixin_class(TensorParallelKHA, cls, f"TP{cls.__name__}", __name__)


def local_features(weight: Tensor, out_axis: int) -> Tensor | None:
    """Global indices of this rank's output features (None: the output axis is not sharded)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = weight.placements  # type: ignore[attr-defined]
    if all(isinstance(p, Replicate) for p in placements):
        return None
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == out_axis) for p in placements):
        raise TensorParallelError(f"placements {tuple(placements)}")
    out = weight.shape[out_axis]
    idx = torch.arange(out, dtype=torch.int64, device=weight.to_local().device)  # type: ignore[attr-defined]
    one_d = [Shard(0) if isinstance(p, Shard) else Replicate() for p in placements]
    return distribute_tensor(idx, weight.device_mesh, one_d, src_data_rank=None).to_local()  # type: ignore[attr-defined]


def local_slots(name: str, slots: tuple[HeadSlot, ...], local: Tensor) -> tuple[HeadSlot, ...]:
    """The head slots of ``slots`` that this rank holds, in local feature positions (whole heads only)."""
    pos = {int(g): i for i, g in enumerate(local.tolist())}
    out = []
    for s in slots:
        index = s.index()  # (H, Dh) global features
        held = [[pos.get(int(f)) for f in row] for row in index.tolist()]
        whole = [h for h, row in enumerate(held) if all(p is not None for p in row)]
        split = [h for h, row in enumerate(held) if any(p is not None for p in row) and h not in whole]
        if split or not whole:
            why = (
                f"head {split[0]} of role {s.role!r} is split across ranks"
                if split
                else f"this rank holds no {s.role!r} head"
            )
            raise TensorParallelError(
                f"{name}: {why} ({s.num_heads} {s.role} heads of size {s.head_dim}, {len(local)} of "
                f"{s.num_heads * s.head_dim if s.head_stride == s.head_dim else 'its'} features here). KHA's "
                "transforms act on whole head vectors, so every TP rank must hold whole heads of every role: use "
                "a TP degree that divides the head count of every role (GQA/MQA: the number of kv heads), or "
                "leave this attention's projections out of the plan (replicated)."
            )
        rows = [[int(p) for p in held[h] if p is not None] for h in whole]
        first = [r[0] for r in rows]
        stride = first[1] - first[0] if len(first) > 1 else s.head_dim
        if any(r != list(range(r[0], r[0] + s.head_dim)) for r in rows) or any(
            f != first[0] + i * stride for i, f in enumerate(first)
        ):
            raise TensorParallelError(
                f"{name}: the local features of role {s.role!r} do not form an affine head layout "
                "after sharding; kha_compile cannot place its transforms on this shard."
            )
        out.append(HeadSlot(s.role, first[0], len(whole), s.head_dim, stride))
    return tuple(out)
