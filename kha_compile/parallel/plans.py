"""Tensor-parallel plans written as transformers writes them, in torch's parallel styles.

transformers models carry a tensor-parallel plan (``model.tp_plan``, from
``config.base_model_tp_plan`` and the head's ``_tp_plan``) whose values are style names
(``"colwise"``, ``"rowwise"``, ...). transformers applies it with its own forwards, which do not
know KHA; :func:`torch_plan` gives the same sharding as torch ``ParallelStyle`` objects, which
:func:`kha_compile.parallelize` applies with KHA (``plan="auto"``: the model's own plan).

Example::

    torch_plan(model, "auto")
    # {'lm_head': ColwiseParallel(output_layouts=Replicate()), 'model.layers.*.self_attn.q_proj': ColwiseParallel(), ...}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..core.errors import TensorParallelError

__all__ = ["HF_STYLES", "torch_plan"]


def _styles() -> dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    }


# transformers style names with a torch equivalent (the others are refused with their names)
HF_STYLES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "colwise_gather_output",
    "rowwise_rep",
    "rowwise_split_input",
    "embedding_rowwise",
    "embedding_colwise",
    "replicate",
)


def torch_plan(model: nn.Module, plan: Any) -> Any:
    """``plan`` with transformers style names (``"colwise"``) replaced by torch ``ParallelStyle`` objects.

    ``plan="auto"`` reads the model's own plan (``model.tp_plan``). Entries already given as torch
    styles pass through; ``"replicate"`` entries are left out (every rank keeps the full tensor).
    Raises :class:`TensorParallelError` for a style torch has no equivalent of.

    Example::

        torch_plan(model, {"model.layers.*.self_attn.q_proj": "colwise"})   # {...: ColwiseParallel()}
    """
    if isinstance(plan, str):
        if plan != "auto":
            raise TensorParallelError(f"plan={plan!r}: pass 'auto' (the model's tp_plan) or a dict of module -> style.")
        own = getattr(model, "tp_plan", None)
        if not isinstance(own, dict) or not own:
            raise TensorParallelError(
                f"plan='auto' reads the tensor-parallel plan of a transformers model (model.tp_plan, from "
                f"config.base_model_tp_plan), and {type(model).__name__} has none: pass a plan "
                "{module path: ColwiseParallel() | RowwiseParallel() | 'colwise' | 'rowwise'}."
            )
        plan = dict(own)
    if not isinstance(plan, dict) or not any(isinstance(v, str) for v in plan.values()):
        return plan
    styles = _styles()
    modules = dict(model.named_modules())
    out: dict[str, Any] = {}
    for key, style in plan.items():
        if not isinstance(style, str):
            out[key] = style
        elif style == "replicate":
            continue
        elif style not in styles:
            raise TensorParallelError(
                f"tp_plan entry {key!r}: {style!r} is a transformers style with no torch equivalent "
                f"(known: {', '.join(HF_STYLES)}); give that entry as a torch ParallelStyle, or leave it out of the plan "
                "(replicated)."
            )
        elif "*" not in key and key not in modules:
            raise TensorParallelError(
                f"tp_plan entry {key!r} names no module of {type(model).__name__} (a parameter?): torch's parallel "
                "styles shard modules; give a plan for its module instead."
            )
        else:
            out[key] = styles[style]()
    return out
