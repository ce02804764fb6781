"""Forward wrappers that training libraries leave on a model, seen through for export, fold and save.

``Trainer(bf16=True)`` / ``Trainer(fp16=True)`` (accelerate's native mixed precision) replaces the
model's ``forward`` with one that runs it under ``torch.autocast`` and casts the outputs to fp32,
and keeps the original in ``model._original_forward``; the wrapper stays after ``train()``. Traced
through it, an export computes in bf16 (Cast nodes and bf16 initializers that onnxruntime's CPU
provider cannot run; an AOTInductor package that differs from the fp32 model). The weights are
still fp32: the model saved and reloaded has no wrapper. :func:`plain_forward` gives a verb that
model for its duration, and puts the wrapper back after, so the caller's model is left as it was.

Example::

    trainer.train()                          # model.forward now autocasts to bf16
    with plain_forward(model):
        model(ids).logits.dtype              # torch.float32, computed in fp32, as after a reload
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from torch import nn

__all__ = ["forward_wrapper", "plain_forward", "sees_through_wrappers"]

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def forward_wrapper(model: Any) -> str | None:
    """What wraps ``model.forward`` (accelerate's mixed-precision wrapper), or None.

    Example::

        forward_wrapper(trainer.model)     # "accelerate's mixed-precision (autocast) forward" after Trainer(bf16=True)
    """
    state = getattr(model, "__dict__", {})
    if isinstance(model, nn.Module) and "forward" in state and callable(state.get("_original_forward")):
        return "accelerate's mixed-precision (autocast) forward"
    return None


@contextlib.contextmanager
def plain_forward(model: Any) -> Iterator[None]:
    """Run the block with ``model``'s own forward instead of accelerate's autocast wrapper; restore it after.

    Nothing changes for a model without a wrapper.

    Example::

        with plain_forward(model):
            kc.export_onnx(model, "m.onnx")          # fp32 graph, as the saved and reloaded model gives
    """
    what = forward_wrapper(model)
    if what is None:
        yield
        return
    state = model.__dict__
    wrapper, original = state.pop("forward"), state.pop("_original_forward")
    own = getattr(original, "__func__", None) is type(model).forward and getattr(original, "__self__", None) is model
    if not own:  # something else sat under the wrapper: keep it
        state["forward"] = original
    log.info("%s: seeing through %s (its weights are %s)", type(model).__name__, what, _dtypes(model))
    try:
        yield
    finally:
        state["forward"] = wrapper
        state["_original_forward"] = original


def sees_through_wrappers(fn: F) -> F:
    """Decorate a verb whose first argument is the model so that it runs under :func:`plain_forward`.

    Example::

        @sees_through_wrappers
        def export_onnx(model, path, ...): ...
    """

    @functools.wraps(fn)
    def verb(model: Any, *args: Any, **kwargs: Any) -> Any:
        with plain_forward(model):
            return fn(model, *args, **kwargs)

    return verb  # type: ignore[return-value]


def _dtypes(model: nn.Module) -> str:
    return "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})) or "none"
