"""What every exporter does with a model before and around its own step.

- :func:`check_destination`: the output path can be written (an ``ExportError`` naming the fix);
- :func:`without_kv_cache`: ``use_cache=False`` for forwards that take it (a KV cache is no output);
- :func:`root_reason`: the innermost cause of a toolchain error, for the ``ExportError`` message;
- :func:`low_precision_dtypes`: the 16-bit float dtypes of a model's weights (a bf16 model exports
  as bf16; the exporters say what that means for the runtime).

Example::

    path = check_destination("out/model.onnx")      # ExportError when out/ does not exist
    kwargs = without_kv_cache(model, args, kwargs)   # {..., "use_cache": False} for a causal LM
"""

from __future__ import annotations

import inspect
import logging
import os
import pathlib

import torch
from torch import nn

from ..core.errors import ExportError

__all__ = ["check_destination", "low_precision_dtypes", "root_reason", "without_kv_cache"]

log = logging.getLogger(__name__)


def check_destination(path: str | os.PathLike, what: str = "the ONNX model") -> pathlib.Path:
    """``path`` as a Path, after checking that a file can be written there (ExportError if not)."""
    path = pathlib.Path(path).expanduser()
    parent = path.parent.resolve()
    if path.is_dir():
        raise ExportError(f"cannot write {what} to {str(path)!r}: it is a directory; give a file path inside it.")
    if not parent.is_dir():
        raise ExportError(
            f"cannot write {what} to {str(path)!r}: its directory {str(parent)!r} does not exist; create it first."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {what} to {str(path)!r}: its directory {str(parent)!r} is not writable.")
    return path


def without_kv_cache(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``kwargs`` plus ``use_cache=False`` where the forward takes it and the call does not set it.

    A transformers KV cache in the outputs is not an ONNX output (and not a pytree type
    torch.export knows).
    """
    if "use_cache" in kwargs:
        return kwargs
    try:
        inspect.signature(model.forward).bind(*args, **kwargs, use_cache=False)
    except (TypeError, ValueError):  # no such parameter, or args already cover it
        return kwargs
    if "use_cache" not in inspect.signature(model.forward).parameters:
        return kwargs  # it would only land in **kwargs
    log.info("exporting %s with use_cache=False", type(model).__name__)
    return {**kwargs, "use_cache": False}


def root_reason(error: BaseException, max_chars: int = 2000) -> str:
    """The innermost cause of an exporter error, as 'Type: message' (the exporter's reason)."""
    root = error
    seen = {id(root)}
    while root.__cause__ is not None and id(root.__cause__) not in seen:
        root = root.__cause__
        seen.add(id(root))
    text = f"{type(root).__name__}: {root}".strip()
    if root is not error:
        text += f" (from {type(error).__name__})"
    return text if len(text) <= max_chars else text[:max_chars] + " ..."


def low_precision_dtypes(model: nn.Module) -> list[torch.dtype]:
    """The 16-bit floating dtypes among ``model``'s parameters and buffers (empty for an fp32 model).

    Example::

        low_precision_dtypes(model.to(torch.bfloat16))      # [torch.bfloat16]
    """
    tensors = [*model.parameters(), *model.buffers()]
    found = {t.dtype for t in tensors if t.is_floating_point() and torch.finfo(t.dtype).bits <= 16}
    return sorted(found, key=str)
