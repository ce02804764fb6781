"""Tensor parallel (DTensor) for models that carry KHA: :func:`parallelize`.

torch's ``ColwiseParallel`` re-registers every parameter of the module it shards, children
included, and would shard the (d, d) transforms, which act on whole head vectors, like the
projection. :func:`parallelize` takes the user's plan unchanged and

1. hides each KHA projection's ``kha`` child while ``parallelize_module`` shards the projections;
2. gives each sharded projection its local head slots, read off the sharded weight (an index
   vector distributed like the weight's output axis), so separate, fused [Q|K|V] and interleaved
   [H, 3, Dh] projections work as long as every rank holds whole heads of every role;
3. replicates the KHA parameters over the TP mesh (``Replicate()`` DTensors) and runs the
   transforms on each rank's local heads; in the backward their gradient is summed over the TP
   group (one all-reduce per transform, its tensors in one bucket), which is exactly the
   single-process gradient, because each rank's heads only see their own part of the sum over all
   heads.

Linear KHA under TP is always token-side (the transforms act on the projection output): the
weight-side fold needs every head's rows, and a rank holds only its own.

torch's plain ``parallelize_module(model, mesh, plan)`` after ``kc.apply`` works too, with the
same results: each KHA projection takes its local head slots on its first forward, and the
transforms, which torch stores sharded like the weight, are gathered whole for each call (one
all-gather of d x d values per transform and call; ``kc.parallelize`` keeps them replicated
instead, and checks the plan when it shards, not on the first forward).

transformers' ``from_pretrained(d, tp_plan="auto")`` shards with transformers' own forwards,
which do not know KHA, so ``kc.apply`` and ``kc.load_pretrained`` refuse such a model. The route
that works: load without ``tp_plan``, ``kc.apply`` (or ``kc.load_pretrained``), then
``kc.parallelize(model, mesh, "auto")``, which translates the model's own ``tp_plan``
(``"colwise"``, ``"rowwise"``, ...) into torch's styles (:mod:`kha_compile.parallel.plans`).

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

from torch import nn

from ..core.errors import ShardedModelError, TensorParallelError, UnsupportedModelError
from ..model.carrier import KHAProjection, kha_modules
from ..model.mha import KHAMultiheadAttention
from ..model.sharded import (
    TRANSFORMERS_TP_ROUTE,
    TensorParallelKHA,
    shard_carrier,
    tensor_parallel_layout,
    transformers_tp_size,
)
from .plans import torch_plan
from .sharding import register_mlp_value_sharding

__all__ = ["parallelize"]

log = logging.getLogger(__name__)


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _tied(model: nn.Module) -> list[list[tuple[nn.Module, str, str]]]:
    """Groups of (module, parameter name, path) that share one parameter (tied embeddings)."""
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        for pname, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, pname, f"{path}.{pname}" if path else pname))
    return [group for group in owners.values() if len({id(m) for m, _, _ in group}) > 1]


def _retie(groups: list[list[tuple[nn.Module, str, str]]]) -> None:
    """Tie again what ``parallelize_module`` untied (it gives each sharded module new parameters)."""
    for group in groups:
        params = [m._parameters[n] for m, n, _ in group]
        if all(p is params[0] for p in params):
            continue
        layouts = {(tuple(getattr(p, "placements", ())), tuple(p.shape)) for p in params}  # type: ignore[union-attr]
        if len(layouts) > 1:
            where = ", ".join(
                f"{path} {tuple(getattr(p, 'placements', ('plain',)))}" for (_, _, path), p in zip(group, params)
            )
            raise TensorParallelError(
                f"tied parameters were sharded differently by the plan ({where}), so they would train apart. Shard "
                "them alike (input embedding RowwiseParallel(input_layouts=Replicate()) and output projection "
                "ColwiseParallel(output_layouts=Replicate()) both give Shard(0); plan='auto' does), or leave both "
                "out of the plan."
            )
        for m, n, _ in group[1:]:
            m.register_parameter(n, params[0])


def parallelize(model: nn.Module, device_mesh: Any, parallelize_plan: dict | str | Any, **kwargs: Any) -> nn.Module:
    """``parallelize_module`` for a model that carries KHA, with the user's plan unchanged.

    Call it after :func:`kha_compile.apply` and before ``fully_shard`` (FSDP2 + TP: pass the TP
    sub-mesh, e.g. ``mesh["tp"]``). The q/k/v projections are sharded by the plan (ColwiseParallel,
    fused QKV included); the KHA parameters become ``Replicate()`` DTensors on the TP mesh, their
    transforms run on each rank's local heads, and their gradients are summed over the TP group,
    so an optimizer step gives the same weights on every rank as one process would.
    ``parallelize_plan="auto"`` uses a transformers model's own plan (``model.tp_plan``), and plan
    values may be transformers style names (``"colwise"``, ``"rowwise"``, ...): both are translated
    to torch's styles (:mod:`kha_compile.parallel.plans`). Tied parameters (input and output
    embeddings) stay tied. Extra keyword arguments go to ``parallelize_module``. Returns ``model``.

    Example::

        kc.apply(model, kc.KHAConfig(v="mlp"))
        kc.parallelize(model, tp_mesh, {"layers.0.attn.q_proj": ColwiseParallel(), ...,
                                        "layers.0.attn.o_proj": RowwiseParallel()})
        kc.parallelize(hf_model, tp_mesh, "auto")   # a transformers model: its own tp_plan
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
    tp_size = transformers_tp_size(model)
    if tp_size is not None:
        raise ShardedModelError(
            f"{type(model).__name__} is already tensor parallel (transformers tp_plan, tp_size={tp_size}). "
            f"{TRANSFORMERS_TP_ROUTE} Nothing was changed."
        )
    kha = kha_modules(model)
    mha = [n for n, m in kha if isinstance(m, KHAMultiheadAttention)]
    if mha:
        raise UnsupportedModelError(
            f"tensor parallel of nn.MultiheadAttention with KHA ({mha[0]}) is not supported: "
            "torch's parallel styles shard nn.Linear projections only."
        )
    plan = torch_plan(model, parallelize_plan)  # before anything is sharded: refusals leave the model as it is
    tied = _tied(model)
    projections = [(n, m) for n, m in kha if isinstance(m, KHAProjection) and not isinstance(m, TensorParallelKHA)]
    hidden = {n: m._modules.pop("kha") for n, m in projections}
    try:
        parallelize_module(model, device_mesh, plan, **kwargs)
    finally:
        for n, m in projections:
            m._modules["kha"] = hidden[n]
    _retie(tied)
    plans = {n: tensor_parallel_layout(m, n) for n, m in projections}
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
