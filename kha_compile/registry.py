"""One ordered, named registry with lazy loading: what the rule, handler and transform registries share.

A registry holds items that have a ``name``, tried in order. On first use it registers its
built-ins, then imports every other module of its package, so an extension is one new file that
registers itself on import. Registering a name again replaces the old item (logged).

Example::

    RULES = Registry("attention rule", __name__, __path__, builtins=lambda: [SDPARule()], skip=("base", "sdpa"))
    RULES.register(MyRule(), first=True)
    [r.name for r in RULES.items()]
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

from .errors import RegistryError

__all__ = ["Named", "Registry"]


class Named(Protocol):
    """Anything with a ``name``: a rule, a projection handler, a transform kind."""

    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    """Ordered named items of one kind, loaded lazily (built-ins, then the package's other modules)."""

    def __init__(
        self,
        what: str,
        package: str,
        path: Iterable[str],
        *,
        builtins: Callable[[], Sequence[T]],
        skip: Sequence[str] = ("base",),
    ) -> None:
        self.what = what
        self._package = package
        self._path = list(path)
        self._builtins = builtins
        self._skip = set(skip)
        self._items: list[T] = []
        self._loaded = False
        self._log = logging.getLogger(package)  # the package's own logger

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for item in self._builtins():
            if all(x.name != item.name for x in self._items):
                self._items.append(item)
        for info in sorted(pkgutil.iter_modules(self._path), key=lambda i: i.name):
            if info.name not in self._skip:
                importlib.import_module(f"{self._package}.{info.name}")

    def register(self, item: T, *, first: bool = False) -> T:
        """Add ``item`` last (or first); one of the same name is replaced, with a log line."""
        self._load()
        for i, old in enumerate(self._items):
            if old.name == item.name:
                self._log.info("%s %r replaced by %s", self.what, item.name, type(item).__name__)
                del self._items[i]
                break
        if first:
            self._items.insert(0, item)
        else:
            self._items.append(item)
        return item

    def restore(self, items: Sequence[T]) -> None:
        """Put back an earlier ``items()`` list (tests that register something temporarily)."""
        self._load()
        self._items[:] = items

    def items(self) -> list[T]:
        """The items in the order they are tried."""
        self._load()
        return list(self._items)

    def get(self, name: str) -> T:
        """The item called ``name``; :class:`RegistryError` lists the registered ones."""
        for item in self.items():
            if item.name == name:
                return item
        raise RegistryError(f"no {self.what} named {name!r}; registered: {', '.join(x.name for x in self._items)}.")
