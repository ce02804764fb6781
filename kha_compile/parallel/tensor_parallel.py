"""Tensor parallel (DTensor) for models that carry KHA: :func:`parallelize`.

torch's ``ColwiseParallel`` re-registers every parameter of the module it shards, children
included, so the ``kha`` child of a KHA projection breaks it (``parameter name can't contain "."``)
and, even if it did not, would shard the (d, d) transforms, which act on whole head vectors.
:func:`parallelize` takes the user's plan unchanged and

1. hides each KHA projection's ``kha`` child while ``parallelize_module`` shards the projections;
2. gives each sharded projection its local head slots, read off the sharded weight (an index
   vector distributed like the weight's output axis), so separate, fused [Q|K|V] and interleaved
   [H, 3, Dh] projections work as long as every rank holds whole heads of every role;
3. replicates the KHA parameters over the TP mesh (``Replicate()`` DTensors) and runs the
   transforms on each rank's local heads; in the backward their gradient is summed over the TP
   group (one all-reduce per transform, its tensors in one bucket), which is exactly the
   single-process gradient, because each rank's heads only see their own part of the sum over all
   heads.

Rule for GQA/MQA: with fewer heads of a role than TP ranks a head would be split across ranks,
and :class:`~kha_compile.errors.TensorParallelError` says so; use a TP degree that divides every role's head
count, or leave that attention's projections out of the plan (replicated, computed on every rank).

Example::

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    kc.apply(model, kc.KHAConfig(v="mlp"))
    mesh = init_device_mesh("cpu", (2,))
    plan = {f"model.layers.{i}.self_attn.{p}": ColwiseParallel() for i in range(n) for p in ("q_proj", "k_proj", "v_proj")}
    plan |= {f"model.layers.{i}.self_attn.o_proj": RowwiseParallel() for i in range(n)}
    kc.parallelize(model, mesh, plan)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ShardedModelError, TensorParallelError, UnsupportedModelError
from ..mixins import mixin_class
from ..modules import (
    HeadSlot,
    KHALinearTransform,
    KHAMLPValue,
    KHAMultiheadAttention,
    KHAProjection,
    apply_segments,
    layout_plan,
    segment_pieces,
)
from ..passes.insert import kha_modules
from .fsdp import is_dtensor
from .sharding import register_mlp_value_sharding

__all__ = ["TensorParallelKHA", "parallelize"]

log = logging.getLogger(__name__)


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

    def kha_transform(self, y: Tensor) -> Tensor:
        """Apply the transforms to this rank's heads of ``y`` (a DTensor sharded on its last axis)."""
        from torch.distributed.tensor import DTensor

        if not isinstance(y, DTensor):  # pragma: no cover - ColwiseParallel always gives a DTensor here
            raise TensorParallelError(
                "a tensor-parallel KHA projection expected a DTensor output; shard it with ColwiseParallel."
            )
        local = y.to_local()
        slots, mode, stride = self._kha_tp_layout
        fns = {s.role: self._local_fn(s.role) for s in slots}
        width = local.shape[-1]
        if mode == "blocks":  # (…, H*Dh) blocks per role
            bounds: list[Any] = [(s.offset, s.num_heads * s.head_dim, (s.head_dim, fns[s.role])) for s in slots]
            out = apply_segments(local, width, segment_pieces(bounds, width))
        else:  # interleaved (…, H, S)
            lead = local.shape[:-1]
            y3 = local.reshape(*lead, width // stride, stride)  # (…, H, S)
            bounds = [(s.offset, s.head_dim, (s.head_dim, fns[s.role])) for s in slots]
            out = apply_segments(y3, stride, segment_pieces(bounds, stride)).reshape(*lead, width)
        return DTensor.from_local(out, y.device_mesh, y.placements, run_check=False, shape=y.shape, stride=y.stride())

    def _local_fn(self, role: str) -> Callable[[Tensor], Tensor]:
        module = self.kha[role]
        group = self._kha_tp_group
        names, tensors = zip(*module.named_parameters())
        local = [p.to_local() if is_dtensor(p) else p for p in tensors]
        params = dict(zip(names, _SumOverGroup.apply(group, *local)))  # one all-reduce per transform
        if isinstance(module, KHALinearTransform):  # the two built-in kinds without functional_call's overhead
            return lambda x: x @ params["weight"]
        if isinstance(module, KHAMLPValue):
            return lambda x: torch.ops.kha.mlp_value(x, params["up"], params["gate"], params["down"])
        return lambda x: torch.func.functional_call(module, params, (x,))


def _tp_class(cls: type) -> type:
    if issubclass(cls, TensorParallelKHA):
        return cls
    return mixin_class(TensorParallelKHA, cls, f"TP{cls.__name__}", __name__)


def _local_features(weight: Tensor, out_axis: int) -> Tensor | None:
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


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def parallelize(model: nn.Module, device_mesh: Any, parallelize_plan: dict | Any, **kwargs: Any) -> nn.Module:
    """``parallelize_module`` for a model that carries KHA, with the user's plan unchanged.

    Call it after :func:`kha_compile.apply` and before ``fully_shard`` (FSDP2 + TP: pass the TP
    sub-mesh, e.g. ``mesh["tp"]``). The q/k/v projections are sharded by the plan (ColwiseParallel,
    fused QKV included); the KHA parameters become ``Replicate()`` DTensors on the TP mesh, their
    transforms run on each rank's local heads, and their gradients are summed over the TP group,
    so an optimizer step gives the same weights on every rank as one process would. Extra keyword
    arguments go to ``parallelize_module``. Returns ``model``.

    Example::

        kc.apply(model, kc.KHAConfig(v="mlp"))
        kc.parallelize(model, tp_mesh, {"layers.0.attn.q_proj": ColwiseParallel(), ...,
                                        "layers.0.attn.o_proj": RowwiseParallel()})
        fully_shard(model, mesh=dp_mesh)          # optional, FSDP2 + TP
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    register_mlp_value_sharding()
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ShardedModelError(
            "kc.parallelize runs before fully_shard: call kc.apply, then kc.parallelize(model, "
            "mesh['tp'], plan), then fully_shard(..., mesh=mesh['dp'])."
        )
    kha = kha_modules(model)
    mha = [n for n, m in kha if isinstance(m, KHAMultiheadAttention)]
    if mha:
        raise UnsupportedModelError(
            f"tensor parallel of nn.MultiheadAttention with KHA ({mha[0]}) is not supported: "
            "torch's parallel styles shard nn.Linear projections only."
        )
    projections = [(n, m) for n, m in kha if isinstance(m, KHAProjection) and not isinstance(m, TensorParallelKHA)]
    hidden = {n: m._modules.pop("kha") for n, m in projections}
    try:
        parallelize_module(model, device_mesh, parallelize_plan, **kwargs)
    finally:
        for n, m in projections:
            m._modules["kha"] = hidden[n]
    plans: dict[str, tuple[tuple[HeadSlot, ...], str, int] | None] = {}
    for n, m in projections:
        w = getattr(m, "weight", None)
        if not isinstance(w, Tensor) or not is_dtensor(w):
            plans[n] = None  # not in the plan: replicated, computed on every rank
            continue
        try:
            local = _local_features(w, 0)
        except TensorParallelError as e:
            raise TensorParallelError(
                f"{n}: a KHA projection is sharded with {e}; shard q/k/v projections with "
                "ColwiseParallel (output features), never on their input features."
            ) from None
        if local is None:
            plans[n] = None
            continue
        slots = local_slots(n, tuple(s for s in m._kha_slots if s.role in m.kha), local)
        plans[n] = (slots, *layout_plan(slots, len(local)))
    by_parent: dict[str, set[bool]] = {}
    for n, p in plans.items():
        by_parent.setdefault(_parent(n), set()).add(p is not None)
    mixed = [k for k, v in by_parent.items() if len(v) > 1]
    if mixed:
        raise TensorParallelError(
            f"{mixed[0]}: some of its KHA projections are sharded by the plan and some are not. Shard all "
            "q/k/v projections of an attention with ColwiseParallel, or none of them."
        )
    for n, m in projections:
        layout = plans[n]
        if layout is None:
            continue
        mesh: Any = m.weight.device_mesh  # type: ignore[union-attr]
        for t in m.kha.values():
            for pname, param in list(t.named_parameters(recurse=False)):
                t.register_parameter(
                    pname,
                    nn.Parameter(
                        distribute_tensor(param.detach(), mesh, [Replicate()]), requires_grad=param.requires_grad
                    ),
                )
        m.__class__ = _tp_class(type(m))
        m.__dict__["_kha_tp_layout"] = layout
        m.__dict__["_kha_tp_group"] = mesh.get_group()
    count = sum(p is not None for p in plans.values())
    log.info("kc.parallelize: %d KHA projections sharded, %d replicated", count, len(plans) - count)
    return model
