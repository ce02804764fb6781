"""Subclasses made at run time: a KHA mixin put in front of a module's own class, created once.

kha_compile gives a module KHA by switching its ``__class__`` to ``<Prefix><Base>(Mixin, Base)``
(``KHALinear``, ``KHAFunctionalConv2d``, ``TPKHALinear``, ...). :func:`mixin_class` makes each such
class once per (mixin, base) pair and sets it as a global of the module that names it, so pickle
finds it by name in this process (a module-level ``__getattr__`` there recreates it in another).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = ["mixin_class", "module_class_named"]

_CLASSES: dict[tuple[type, type], type] = {}


def mixin_class(mixin: type, base_cls: type, name: str, module: str, **attrs: Any) -> type:
    """``class <name>(mixin, base_cls)`` living in ``module``, with class attributes ``attrs``; made once.

    Example::

        cls = mixin_class(KHAProjection, nn.Linear, "KHALinear", __name__, _kha_base_class=nn.Linear)
        module.__class__ = cls
    """
    cls = _CLASSES.get((mixin, base_cls))
    if cls is None:
        cls = type(name, (mixin, base_cls), {"__module__": module, "__qualname__": name, **attrs})
        _CLASSES[(mixin, base_cls)] = cls
        owner = sys.modules.get(module)
        if owner is not None:
            vars(owner).setdefault(name, cls)
    return cls


def module_class_named(name: str, mixin: type) -> type | None:
    """The ``nn.Module`` subclass called ``name`` that is not already a ``mixin`` class, or None.

    What a module-level ``__getattr__`` needs to recreate ``<Prefix><Base>`` when unpickling in a
    new process: find ``Base`` among the loaded module classes.

    Example::

        base = module_class_named("Linear", KHAProjection)     # torch.nn.Linear
    """
    stack: list[type] = list(nn.Module.__subclasses__())
    seen: set[type] = set()
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if cls.__name__ == name and not issubclass(cls, mixin):
            return cls
        stack.extend(cls.__subclasses__())
    return None
