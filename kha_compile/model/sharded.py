"""Sharded models inside the model: FSDP2 and DTensor detection, and tensor-parallel KHA projections.

:func:`refuse_sharded` says, before anything is touched, that a verb needs the unsharded model
(and, for a model that transformers sharded with ``tp_plan``, the order of calls that works).
:class:`TensorParallelKHA` is the class a KHA projection gets once its weight is sharded
column-wise: its transforms run on the rank's local heads (:func:`local_slots`), and their
gradients are summed over the TP group in one all-reduce per transform, which is exactly the
single-process gradient. ``kc.parallelize`` makes it eagerly, with the transforms replicated over
the TP mesh. After torch's own ``parallelize_module`` the projection becomes one on its first
forward (:func:`adopt_tensor_parallel`, no communication); torch then stores each transform
sharded like the weight (``Shard(0)``), and every call gathers it whole (one all-gather of its
d x d values) before it acts on whole head vectors.

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
from .slots import HeadSlot, layout_plan, transform_slices
from .transforms import kind_of

__all__ = [
    "UNADOPTED_TP",
    "TensorParallelKHA",
    "adopt_sharded_projections",
    "adopt_tensor_parallel",
    "is_dtensor",
    "is_sharded",
    "local_features",
    "local_slots",
    "refuse_sharded",
    "shard_carrier",
    "sharded_parts",
    "tensor_parallel_layout",
    "tp_class",
    "transformers_tp_size",
]

log = logging.getLogger(__name__)


def sharded_parts(model: nn.Module, limit: int = 3) -> list[str]:
    """Up to ``limit`` descriptions of what makes ``model`` sharded: FSDP2 modules, DTensor parameters, and
    modules that transformers' tensor parallel left holding plain local shards (the releases that shard so)."""
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
                return found
    for name, m in model.named_modules():
        # transformers releases that shard with local tensors (5.x before DTensor weights came back, e.g. 5.15)
        # mark each sharded module with its style and mesh; its weight is then a plain tensor of local rows
        style = m.__dict__.get("_hf_tp_plan")
        if style is not None and "_hf_device_mesh" in m.__dict__ and not any(map(is_dtensor, m.parameters(False))):
            found.append(f"module {name} holds a local shard ({style!r}, transformers' tensor parallel)")
            if len(found) >= limit:
                break
    return found


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2 modules or DTensor parameters."""
    return bool(sharded_parts(model, limit=1))


def transformers_tp_size(model: nn.Module) -> int | None:
    """The TP degree of a model that transformers sharded itself (``from_pretrained(..., tp_plan=...)``), else None."""
    if loaded("transformers") is None:
        return None
    for m in model.modules():
        size = m.__dict__.get("_tp_size")  # set on the instance by transformers' distributed loading
        if isinstance(size, int) and size > 1:
            return size
    return None


TRANSFORMERS_TP_ROUTE = (
    "transformers' own tensor-parallel forwards replace the projections' forward and do not know KHA. Load the "
    "model without tp_plan (every rank holds the full model), add KHA with kc.apply(model, cfg) or "
    "kc.load_pretrained(model, d), then shard it with kc.parallelize(model, mesh, 'auto'): that applies the "
    "model's own tp_plan (config.base_model_tp_plan) with torch's parallel styles, KHA included."
)


def refuse_sharded(model: nn.Module, verb: str) -> None:
    """Raise :class:`ShardedModelError` if ``model`` is sharded; ``verb`` names the refused call."""
    parts = sharded_parts(model)
    if not parts:
        return
    tp_size = transformers_tp_size(model) if verb != "fold" else None
    if tp_size is not None:
        raise ShardedModelError(
            f"{type(model).__name__} was sharded by transformers (tp_plan, tp_size={tp_size}; {', '.join(parts)}), "
            f"so kc.{verb} cannot run on it. {TRANSFORMERS_TP_ROUTE} Nothing was changed."
        )
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
        if model.__dict__.get("_is_distributed_loading_by_transformers"):  # from_pretrained(distributed_config=...)
            todo = (
                f"transformers sharded it while loading (distributed_config), before kc.{verb}. Load it without "
                "distributed_config, call kc.apply(model, cfg) (or kc.load_pretrained), then shard it: "
                "torch.distributed.fsdp.fully_shard on each decoder layer and on the model for FSDP2, "
                "kc.parallelize(model, mesh, 'auto') for tensor parallel. The model was not touched."
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
        """Apply the transforms to this rank's heads of ``y``: a DTensor sharded on its last axis, or the
        local shard itself (transformers' tensor-parallel inference path runs the projection on local tensors)."""
        from torch.distributed.tensor import DTensor

        slots, mode, stride = self._kha_tp_layout
        slots = tuple(s for s in slots if s.role not in skip)
        fns: dict[str, Callable[[Tensor], Tensor]] = {s.role: self._local_fn(s.role) for s in slots}
        if not isinstance(y, DTensor):
            return transform_slices(y, slots, mode, stride, fns)  # (..., local features): this rank's heads
        out = transform_slices(y.to_local(), slots, mode, stride, fns)
        return DTensor.from_local(out, y.device_mesh, y.placements, run_check=False, shape=y.shape, stride=y.stride())

    def _local_fn(self, role: str) -> Callable[[Tensor], Tensor]:
        module = self.kha[role]
        group = self._kha_tp_group
        names, tensors = zip(*module.named_parameters())
        params = dict(zip(names, _SumOverGroup.apply(group, *map(_whole_local, tensors))))  # one all-reduce each
        kind = kind_of(module)
        ordered = [params[n] for n in kind.param_names]
        return lambda x: kind.functional(x, *ordered)


def _whole_local(p: Tensor) -> Tensor:
    """The whole transform parameter on this rank: gathered if torch's ``ColwiseParallel`` sharded it."""
    if not is_dtensor(p):
        return p
    from torch.distributed.tensor import Replicate

    if not all(isinstance(pl, Replicate) for pl in p.placements):  # type: ignore[attr-defined]
        mesh = p.device_mesh  # type: ignore[attr-defined]
        p = p.redistribute(mesh, [Replicate()] * mesh.ndim)  # type: ignore[attr-defined]  # all-gather; grad: slice
    return p.to_local()  # type: ignore[attr-defined]


def tensor_parallel_layout(module: nn.Module, name: str) -> tuple[tuple[HeadSlot, ...], str, int] | None:
    """(local slots, plan, stride) of a KHA projection whose weight is sharded on its output axis; None: replicated.

    Reads the placements of the weight (a DTensor); no communication. Raises
    :class:`TensorParallelError` where the shard splits a head or shards the input features.

    Example::

        tensor_parallel_layout(q_proj, "model.layers.0.self_attn.q_proj")   # ((HeadSlot('q', 0, 2, 16, 16),), ...)
    """
    w = module._parameters.get("weight")
    if w is None or not is_dtensor(w):
        return None
    axis = getattr(module, "_kha_weight_axis", None)
    try:
        local = local_features(w, 0 if axis is None else axis)
    except TensorParallelError as e:
        raise TensorParallelError(
            f"{name}: a KHA projection is sharded with {e}; shard q/k/v projections with "
            "ColwiseParallel (output features), never on their input features."
        ) from None
    if local is None:
        return None
    kha: Any = module._modules["kha"]  # the carrier's KHATransforms
    slots = local_slots(name, tuple(s for s in module.__dict__["_kha_slots"] if s.role in kha), local)
    return (slots, *layout_plan(slots, len(local)))


def adopt_tensor_parallel(module: nn.Module) -> bool:
    """Make a KHA projection whose weight torch sharded column-wise a :class:`TensorParallelKHA` (False: not sharded).

    What a KHA projection does on its first forward after torch's own ``parallelize_module``:
    its local head slots are read off the sharded weight, with no communication. Errors name
    ``kc.parallelize``, which checks the same when it is called.
    """
    if isinstance(module, TensorParallelKHA):
        return False
    roles = "/".join(s.role for s in module.__dict__["_kha_slots"])
    try:
        layout = tensor_parallel_layout(module, f"{type(module).__name__} ({roles})")
    except TensorParallelError as e:
        raise TensorParallelError(
            f"{e} (found on the first forward after parallelize_module; kc.parallelize(model, mesh, plan) "
            "checks this when it shards, and names the module)"
        ) from None
    if layout is None:
        return False
    shard_carrier(module, layout, module._parameters["weight"].device_mesh.get_group())  # type: ignore[union-attr]
    log.debug("%s: tensor parallel on %s", type(module).__name__, layout[0])
    return True


def adopt_sharded_projections(model: nn.Module) -> list[str]:
    """Give every KHA projection of ``model`` whose weight is sharded column-wise its local heads now.

    For KHA applied before the model was sharded by code that does not know KHA (transformers'
    ``from_pretrained(..., tp_plan=...)`` / ``distributed_config`` after a quantizer's or a subclass's
    ``kc.apply``): a projection adopts its local heads on its first forward with grad enabled, but
    transformers' inference path (``no_grad``) runs on local tensors, where the sharding cannot be read.
    Returns the paths adopted; no communication.

    Example::

        model = AutoModelForCausalLM.from_pretrained(d, tp_plan="auto")   # KHA applied before loading
        adopt_sharded_projections(model)                                   # ['model.layers.0.self_attn.q_proj', ...]
    """
    fsdp = loaded("torch.distributed.fsdp")
    under_fsdp = [  # FSDP2 shards parameters as DTensors too: not tensor parallel, and unsharded for each forward
        name for name, m in model.named_modules() if fsdp is not None and isinstance(m, fsdp.FSDPModule)
    ]
    done = []
    for name, m in model.named_modules():
        if any(name == p or name.startswith(f"{p}.") or not p for p in under_fsdp):
            continue
        if "_kha_slots" in m.__dict__ and is_dtensor(m._parameters.get("weight")) and adopt_tensor_parallel(m):
            done.append(name)
    return done


UNADOPTED_TP = (
    "{name} carries KHA and was then sharded by transformers' tensor parallel (its forward runs on this rank's "
    "{got} of {want} output features), before kha_compile could read which heads this rank holds. Call "
    "kha_compile.parallel.adopt_sharded_projections(model) once after loading (no communication), or run one "
    "forward with grad enabled first; or load without tp_plan, kc.apply(model, cfg), then "
    "kc.parallelize(model, mesh, 'auto')."
)


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
        ):  # not affine after sharding: the local features as an index map
            out.append(HeadSlot.indexed(s.role, torch.tensor(rows)))
            continue
        out.append(HeadSlot(s.role, first[0], len(whole), s.head_dim, stride))
    return tuple(out)
