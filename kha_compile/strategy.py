"""Execution strategy of linear KHA: fold on the fly into the weight, or transform the projection output.

Linear KHA can run two ways with the same result:

- **token-side**: the projection runs as usual and ``x @ T`` is applied to every head vector of its
  output; costs ``tokens * d_out * d_k`` multiply-adds per projection (times 3 in training).
- **weight-side**: the projection runs once with the folded weight ``W'_h = T^T W_h`` per head slot
  (the fold primitive :func:`kha_compile.passes.rows.fold_rows`, differentiable, so gradients of W
  and T are exact); costs ``d_in * d_out * d_k``, independent of the token count.

``"auto"`` picks weight-side when the call has more tokens than the projection has input features
(every realistic training step), and always when no gradient is needed: then the folded weight
is cached and recomputed only when a source tensor changes (a new object, storage, dtype, device,
or a bumped ``_version`` counter: optimizer steps and in-place edits bump it). Code traced by
``torch.compile`` / ``torch.export`` stays token-side whatever the strategy (the ``"kha"`` backend
folds by itself), and so do sharded weights (DTensor under tensor parallelism: anything with
``__torch_function__``). MLP-value never folds, so it is
always token-side; on a fused projection that carries both, the linear roles go weight-side.

Choose per model with ``KHAConfig(strategy=...)``, or per module with its ``kha_strategy``
attribute (``"auto" | "weight" | "token"``).

Example::

    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear", strategy="weight"))
    model.model.layers[0].self_attn.q_proj.kha_strategy = "token"
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from .errors import KHAConfigError

__all__ = ["STRATEGIES", "cached_fold", "check_strategy", "needs_grad", "swapped_params", "use_weight_side"]

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
    if torch.overrides.has_torch_function(tuple(sources)):  # sharded (DTensor) weights: token-side
        return False
    if strategy != "auto":
        return strategy == "weight"
    return not needs_grad(sources) or tokens > in_features


def _key(sources: Sequence[Tensor]) -> tuple | None:
    try:
        return tuple((t._version, t.data_ptr(), t.dtype, t.device, tuple(t.shape)) for t in sources)
    except RuntimeError:  # inference tensors have no version counter: no caching
        return None


def cached_fold(owner: nn.Module, tag: object, sources: Sequence[Tensor], compute: Callable[[], Params]) -> Params:
    """``compute()``'s folded tensors, cached on ``owner`` while no gradient is needed.

    The cache (one entry per ``tag``) is reused while every source tensor is the same object with
    the same storage, dtype, device, shape and version counter; otherwise it is recomputed. With a
    gradient needed, nothing is cached and the fold is recorded by autograd.
    """
    if needs_grad(sources) or torch.compiler.is_compiling():
        return compute()
    key = _key(sources)
    cache: dict = owner.__dict__.setdefault("_kha_fold_cache", {})
    hit = cache.get(tag)
    if key is not None and hit is not None and hit[1] == key and all(a is b for a, b in zip(hit[0], sources)):
        params: Params = hit[2]
        return params
    with torch.no_grad():
        params = compute()
    if key is not None:
        cache[tag] = (tuple(sources), key, params)
    return params


@contextlib.contextmanager
def swapped_params(module: nn.Module, params: Params) -> Iterator[None]:
    """Let ``module``'s own forward see ``params`` (name, tensor) in place of its parameters, for one call."""
    old = {name: module._parameters[name] for name, _ in params}
    module.__dict__["_kha_swapped"] = True
    try:
        for name, t in params:
            module._parameters[name] = t  # type: ignore[assignment]  # a plain tensor for this call only
        yield
    finally:
        module._parameters.update(old)
        module.__dict__.pop("_kha_swapped", None)
