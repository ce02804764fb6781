"""Where kha_compile's own tensors live, whatever default device the caller set.

A model is often built inside ``with torch.device("meta"):`` (torchtitan-style, before ``to_empty``
or a checkpoint load), and ``kc.apply`` called in the same block. That block makes every factory
call without a ``device=`` (``torch.arange``, ``torch.zeros``, ``torch.randint``) a meta tensor,
and the analysis reads its index tensors (``bool(...)``, ``.item()``, ``.tolist()``), which meta
tensors cannot give. :func:`own_tensors_on_cpu` puts kha_compile's own tensors on the CPU for the
duration of a verb, and :func:`callers_device` gives the model's own code (a trace, a recorded
forward) back the default device the caller set, so a model's forward runs as it would have.

Example::

    with torch.device("meta"):
        with own_tensors_on_cpu():
            torch.arange(3).device           # cpu
            with callers_device():
                torch.arange(3).device       # meta
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["callers_device", "own_tensors_on_cpu"]

_CPU = torch.device("cpu")
# the default device of the caller of the outermost verb under way (None: no verb under way)
_CALLER: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("kha_caller_device", default=None)


def _default_device() -> torch.device:
    return torch.device(torch.get_default_device())


@contextlib.contextmanager
def own_tensors_on_cpu() -> Iterator[None]:
    """Build tensors without an explicit device on the CPU here, remembering the caller's default device.

    Nothing is entered when the default device is the CPU already (no torch function mode, no cost).

    Example::

        with torch.device("meta"), own_tensors_on_cpu():
            idx = torch.arange(8)               # a CPU index tensor the analysis can read
    """
    caller = _default_device()
    token = _CALLER.set(caller) if _CALLER.get() is None else None
    try:
        if caller == _CPU:
            yield
        else:
            with torch.device(_CPU):
                yield
    finally:
        if token is not None:
            _CALLER.reset(token)


@contextlib.contextmanager
def callers_device() -> Iterator[None]:
    """Run the model's own code under the default device of the verb's caller (see the module doc).

    Example::

        with callers_device():
            torch.export.export(model, args, kwargs, strict=False)
    """
    caller = _CALLER.get()
    if caller is None or caller == _default_device():
        yield
        return
    with torch.device(caller):
        yield
