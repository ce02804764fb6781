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
and :class:`~kha_compile.core.errors.TensorParallelError` says so; use a TP degree that divides every role's head
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
from typing import Any

from torch import Tensor, nn

from ..core.errors import ShardedModelError, TensorParallelError, UnsupportedModelError
from ..core.optional import is_dtensor
from ..model.carrier import KHAProjection, kha_modules
from ..model.mha import KHAMultiheadAttention
from ..model.sharded import TensorParallelKHA, local_features, local_slots, shard_carrier
from ..model.slots import HeadSlot, layout_plan
from .sharding import register_mlp_value_sharding

__all__ = ["parallelize"]

log = logging.getLogger(__name__)


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
            local = local_features(w, 0)
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
        shard_carrier(m, layout, mesh.get_group())
    count = sum(p is not None for p in plans.values())
    log.info("kc.parallelize: %d KHA projections sharded, %d replicated", count, len(plans) - count)
    return model
