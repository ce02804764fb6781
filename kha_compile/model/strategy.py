"""Execution strategy of linear KHA: fold on the fly into the weight, or transform the projection output.

Linear KHA can run two ways with the same result:

- **token-side**: the projection runs as usual and ``x @ T`` is applied to every head vector of its
  output; costs ``tokens * d_out * d_k`` multiply-adds per projection (times 3 in training).
- **weight-side**: the projection runs once with the folded weight ``W'_h = T^T W_h`` per head slot
  (the fold primitive :func:`kha_compile.model.rows.fold_rows`, differentiable, so gradients of W
  and T are exact); costs ``d_in * d_out * d_k`` per call, independent of the token count.

``"auto"`` picks weight-side when the call has more tokens than the projection has input features
(every realistic training step, and the prefill of generation), token-side otherwise (a decode
step of one token). So the cost KHA adds to a projection is ``min(tokens, d_in) * d_out * d_k``
multiply-adds per call: at most ``d_k / d_in`` of the projection's own cost (3 % at
d_k = 128, d_in = 4096), in training and inference alike.

Nothing is cached between calls. A cache of the folded weight would have to notice every change
of a weight, and no cheap signal does: fused optimizers (``AdamW(fused=True)``, the Trainer's
default) update parameters without bumping their version counter, and neither do writes through
``param.data``. Computing the fold on every weight-side call is what keeps inference exact after
any weight change (optimizer steps of any kind, ``load_state_dict``, ``copy_``, ``.data``
assignment, FSDP2/TP). For zero overhead at inference, fold: ``kc.fold(model)`` (linear KHA).

Code traced by ``torch.compile`` / ``torch.export`` stays token-side whatever the strategy (the
``"kha"`` backend folds by itself), and so do sharded weights (DTensor under tensor parallelism).
MLP-value never folds, so it is always token-side; on a fused projection that carries both, the
linear roles go weight-side.

Choose per model with ``KHAConfig(strategy=...)``, or per module with its ``kha_strategy``
attribute (``"auto" | "weight" | "token"``).

Example::

    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear", strategy="weight"))
    model.model.layers[0].self_attn.q_proj.kha_strategy = "token"
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from ..core.errors import KHAConfigError
from ..core.optional import is_dtensor

__all__ = ["STRATEGIES", "as_parameters", "check_strategy", "needs_grad", "swapped_params", "use_weight_side"]

STRATEGIES = ("auto", "weight", "token")

Params = list[tuple[str, Tensor]]


def check_strategy(value: object, where: str = "strategy") -> str:
    """``value`` if it is one of :data:`STRATEGIES`, else a :class:`KHAConfigError` listing them.

    Example::

        check_strategy("weight")      # "weight"
    """
    if value not in STRATEGIES:
        raise KHAConfigError(f"{where}={value!r} is not allowed; use one of {', '.join(repr(s) for s in STRATEGIES)}.")
    return str(value)


def needs_grad(sources: Sequence[Tensor]) -> bool:
    """True when autograd will record through these tensors (grad mode on and one requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in sources)


def use_weight_side(strategy: str, sources: Sequence[Tensor], tokens: int, in_features: int) -> bool:
    """Whether a call folds linear KHA into the weight (True) or transforms the output (False).

    Example::

        use_weight_side("auto", [w, t], tokens=8192, in_features=1024)    # True
    """
    strategy = check_strategy(strategy, "kha_strategy")
    if torch.compiler.is_compiling():  # traced code stays token-side: the "kha" backend folds by itself
        return False
    if any(is_dtensor(t) for t in sources):  # sharded weights: their head slots are local, token-side
        return False
    if strategy != "auto":
        return strategy == "weight"
    return tokens > in_features


def as_parameters(module: nn.Module, params: Params) -> list[Tensor]:
    """The tensors of ``params`` (name, tensor), each flagged ``requires_grad`` like the parameter it
    stands for when no gradient is recorded.

    ATen picks some kernels by that flag (the matmul of a non-contiguous 3-D input), so a folded
    tensor that does not require grad where the parameter does would run another kernel than the
    model without KHA, and identity at init would not be exact under ``no_grad``.
    """
    if torch.is_grad_enabled():
        return [t for _, t in params]
    out = []
    for name, t in params:
        p = module._parameters.get(name)
        if p is not None and p.requires_grad and not t.requires_grad:
            t = t.detach().requires_grad_(True)
        out.append(t)
    return out


@contextlib.contextmanager
def swapped_params(module: nn.Module, params: Params) -> Iterator[None]:
    """Let ``module``'s own forward see ``params`` (name, tensor) in place of its parameters, for one call."""
    old = {name: module._parameters[name] for name, _ in params}
    module.__dict__["_kha_swapped"] = True
    try:
        for (name, _), t in zip(params, as_parameters(module, params)):
            module._parameters[name] = t  # type: ignore[assignment]  # a plain tensor for this call only
        yield
    finally:
        module._parameters.update(old)
        module.__dict__.pop("_kha_swapped", None)
