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

from .errors import UnsupportedModelError

__all__ = ["mixin_class", "module_class_named"]

_CLASSES: dict[tuple[type, type], type] = {}


def _assignable(base_cls: type, cls: type) -> bool:
    """Whether an instance of ``base_cls`` can take ``cls`` as its ``__class__`` (same object layout)."""
    try:
        probe: Any = object.__new__(base_cls)
    except TypeError:  # a class object.__new__ cannot make: assume yes, the switch itself will tell
        return True
    try:
        object.__setattr__(probe, "__class__", cls)
    except TypeError:
        return False
    return True


def _mixin_first_class(mixin: type, base_cls: type, name: str, namespace: dict[str, Any]) -> type:
    """``class <name>(base_cls, mixin)`` whose method order still puts ``mixin`` first.

    A base whose primary base is not ``nn.Module`` (``class Attn(ABC, nn.Module)``) has another
    layout chain than ``(mixin, base_cls)``, and Python refuses that ``__class__`` switch. With
    ``base_cls`` first, the layout is the base's own; a metaclass derived from the base's puts the
    mixin's methods in front again (its ``mro``), so ``super()`` in the mixin reaches the base.
    """
    meta: Any = type(base_cls)
    head = [c for c in mixin.__mro__ if c not in base_cls.__mro__]

    def mro(cls: type) -> list[type]:
        return [cls, *head, *base_cls.__mro__]

    ordered: Any = type(meta)(f"_MixinFirst{meta.__name__}", (meta,), {"mro": mro, "__module__": __name__})
    cls: type = ordered(name, (base_cls, mixin), namespace)
    return cls


def mixin_class(mixin: type, base_cls: type, name: str, module: str, **attrs: Any) -> type:
    """``class <name>(mixin, base_cls)`` living in ``module``, with class attributes ``attrs``; made once.

    Example::

        cls = mixin_class(KHAProjection, nn.Linear, "KHALinear", __name__, _kha_base_class=nn.Linear)
        module.__class__ = cls
    """
    cls = _CLASSES.get((mixin, base_cls))
    if cls is None:
        namespace = {"__module__": module, "__qualname__": name, **attrs}
        cls = type(name, (mixin, base_cls), dict(namespace))
        if not _assignable(base_cls, cls):  # e.g. class Attn(ABC, nn.Module): another layout chain
            cls = _mixin_first_class(mixin, base_cls, name, dict(namespace))
            if not _assignable(base_cls, cls):
                raise UnsupportedModelError(
                    f"kha_compile cannot give {base_cls.__qualname__} its KHA subclass: Python refuses the "
                    f"__class__ switch (the object layouts differ; bases {[b.__name__ for b in base_cls.__bases__]}). "
                    "Put nn.Module (or the projection class) first among its bases."
                )
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
