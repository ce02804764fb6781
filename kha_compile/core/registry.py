"""The one registry of kha_compile: named items of one kind, tried in an explicit priority order.

Transform kinds, attention rules, projection handlers and registered attention ops all live in a
:class:`Registry`. Each item has a ``name`` and a ``priority`` (lower is tried first; ties go by
name), so the order never depends on which module happened to be imported first. On first use a
registry registers its built-ins, then imports every other module of its package, so an
extension is one new file that registers itself on import. Registering a name again replaces
the old item (logged).

Example::

    RULES = Registry("attention rule", __name__, __path__, builtins=lambda: [SDPARule()], skip=("base", "sdpa"))
    RULES.register(MyRule(), priority=15)          # between sdpa (10) and manual_softmax (20)
    [r.name for r in RULES.items()]
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

from .errors import RegistryError

__all__ = ["DEFAULT_PRIORITY", "FIRST", "Named", "Registry"]

DEFAULT_PRIORITY = 50  # an extension without a priority: after the specific built-ins, before the fallbacks
FIRST = 0  # ``first=True``: before every built-in


class Named(Protocol):
    """Anything with a ``name``: a rule, a projection handler, a transform kind, an op spec."""

    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    """Named items of one kind in priority order, loaded lazily (built-ins, then the package's modules).

    ``package``/``path`` name the package whose other modules are imported on first use (``None``:
    nothing to import; no ``path``: the package's own ``__path__``). An item's priority is its ``priority`` attribute, else the one it was
    registered with, else :data:`DEFAULT_PRIORITY`.
    """

    def __init__(
        self,
        what: str,
        package: str | None = None,
        path: Iterable[str] = (),
        *,
        builtins: Callable[[], Sequence[T]] = tuple,
        skip: Sequence[str] = ("base",),
    ) -> None:
        self.what = what
        self._package = package
        self._path = list(path)
        self._builtins = builtins
        self._skip = set(skip)
        self._items: dict[str, tuple[int, T]] = {}
        self._ranks: dict[int, int] = {}  # id(item) -> the priority it was registered with (for restore)
        self._loaded = False
        self._lock = threading.RLock()
        self._log = logging.getLogger(package or __name__)  # the package's own logger

    def _load(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            for item in self._builtins():
                if item.name not in self._items:
                    self._put(item, _priority_of(item, None))
            if self._package is not None:
                path = self._path or list(getattr(importlib.import_module(self._package), "__path__", []))
                for info in sorted(pkgutil.iter_modules(path), key=lambda i: i.name):
                    if info.name not in self._skip:
                        importlib.import_module(f"{self._package}.{info.name}")

    def register(self, item: T, *, priority: int | None = None, first: bool = False) -> T:
        """Add ``item`` at its priority (``first=True``: before every built-in); a same-named one is replaced.

        Example::

            register_handler(MyHandler(), priority=5)
        """
        self._load()
        with self._lock:
            rank = FIRST if first else _priority_of(item, priority)
            old = self._items.get(item.name)
            if old is not None and old[1] is not item:
                self._log.info("%s %r replaced by %s", self.what, item.name, type(item).__name__)
            self._put(item, rank)
        return item

    def _put(self, item: T, rank: int) -> None:
        self._items[item.name] = (rank, item)
        self._ranks[id(item)] = rank

    def unregister(self, name: str) -> T | None:
        """Remove the item called ``name``; returns it (None when there was none)."""
        self._load()
        with self._lock:
            entry = self._items.pop(name, None)
        return None if entry is None else entry[1]

    def restore(self, items: Sequence[T]) -> None:
        """Put back an earlier ``items()`` list (tests that register something temporarily)."""
        self._load()
        with self._lock:
            self._items = {item.name: (self._ranks.get(id(item), DEFAULT_PRIORITY), item) for item in items}

    def items(self) -> list[T]:
        """The items in the order they are tried: by priority, then by name."""
        self._load()
        with self._lock:
            ranked = sorted(self._items.items(), key=lambda kv: (kv[1][0], kv[0]))
        return [item for _, (_, item) in ranked]

    def names(self) -> list[str]:
        return [item.name for item in self.items()]

    def get(self, name: str) -> T:
        """The item called ``name``; :class:`RegistryError` lists the registered ones."""
        self._load()
        entry = self._items.get(name)
        if entry is None:
            raise RegistryError(f"no {self.what} named {name!r}; registered: {', '.join(self.names())}.")
        return entry[1]

    def find(self, name: str) -> T | None:
        """The item called ``name``, or None."""
        self._load()
        entry = self._items.get(name)
        return None if entry is None else entry[1]

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._items


def _priority_of(item: object, given: int | None) -> int:
    if given is not None:
        return int(given)
    own = getattr(item, "priority", None)
    return int(own) if isinstance(own, int) else DEFAULT_PRIORITY
