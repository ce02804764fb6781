"""Distributed training with KHA: tensor parallel (:func:`parallelize`), FSDP2 edges, DTensor rules.

Order of calls: ``kc.apply`` on the unsharded model, then ``kc.parallelize`` (TP; torch's own
``parallelize_module`` works too), then ``fully_shard`` (FSDP2). ``kc.apply`` / ``kc.inspect`` /
``kc.fold`` on a sharded model raise :class:`~kha_compile.core.errors.ShardedModelError`; for a
model that transformers sharded (``from_pretrained(..., tp_plan="auto")``) the error gives the
order that works: load without ``tp_plan``, ``kc.apply``, ``kc.parallelize(model, mesh, "auto")``.

Example::

    kc.apply(model, kc.KHAConfig(v="mlp"))
    kc.parallelize(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
"""

from __future__ import annotations

import sys

from ..model.sharded import adopt_sharded_projections, is_sharded, refuse_sharded
from .sharding import register_mlp_value_sharding
from .tensor_parallel import parallelize

__all__ = ["adopt_sharded_projections", "is_sharded", "parallelize", "refuse_sharded", "register_mlp_value_sharding"]

if "torch.distributed.tensor" in sys.modules:  # importing it costs about a second: only if already in use
    register_mlp_value_sharding()
