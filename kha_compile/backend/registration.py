"""Registration of the backend under ``"kha"``, without importing Dynamo.

If Dynamo's backend registry is not imported yet, a one-shot import hook registers the backend
when it is, so ``import kha_compile`` imports nothing of Dynamo or Inductor. The entry point
``torch_dynamo_backends: kha = kha_compile.backend:kha`` (pyproject.toml) is the other way in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

from .compiler import NAME, kha

__all__ = ["REGISTRY", "install"]

REGISTRY = "torch._dynamo.backends.registry"


def _register(registry: types.ModuleType) -> None:
    if NAME not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=kha, name=NAME)


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _register(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers "kha" right after Dynamo's backend registry module is first imported."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != REGISTRY:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register ``"kha"`` now if Dynamo's registry is loaded, else when it is first imported."""
    registry = sys.modules.get(REGISTRY)
    if registry is not None:
        _register(registry)
        return
    if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
