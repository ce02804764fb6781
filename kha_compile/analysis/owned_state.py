"""The state a model's code owns: kept as it was across a trace, and searched for fake tensors after it.

A trace runs the model's code on fake tensors. Code that keeps state between calls (a scratch buffer
at module level, allocated on the first call and written in place by later ones; a cache held as a
plain attribute; a buffer reassigned in ``forward``) would keep the *fake* tensor the trace made, and
the next real call would compute on it and return a fake tensor. :func:`kept_as_it_was` takes a
snapshot of that state before a trace and puts it back after: the globals of the Python modules
the model's classes come from (and of the modules their functions come from, one hop), one level
into the lists, dicts and sets they hold, and every module's attributes, parameters and buffers.
:func:`fake_tensors_in` lists where a fake tensor is still found (the self-check of ``kc.apply``).

Example::

    with kept_as_it_was(model):
        torch.export.export(model, args, strict=False)
    fake_tensors_in(model)         # [] : nothing the trace made is left behind
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree

__all__ = ["code_namespaces", "fake_tensors_in", "kept_as_it_was"]

# modules whose globals are never the model's own state: torch's, kha_compile's (its caches must outlive a
# trace) and Python's
_NOT_MODEL_CODE = ("torch", "kha_compile", "builtins", "typing", "functools", "collections", "abc", "math", "sys")


def _model_code(name: str) -> bool:
    root = name.partition(".")[0]
    return bool(name) and root not in _NOT_MODEL_CODE and not root.startswith("_")


def code_namespaces(model: nn.Module) -> list[tuple[str, dict[str, Any]]]:
    """(module name, globals) of the Python modules the model's classes come from, and of the modules
    their functions and classes come from (one hop: a helper module that holds the buffer).

    Example::

        [name for name, _ in code_namespaces(model)]     # ["mylib.attention", "mylib.model"]
    """
    names = {type(m).__module__ for m in model.modules()}
    for name in list(names):
        mod = sys.modules.get(name)
        for value in vars(mod).values() if mod is not None else ():
            if isinstance(value, (types.FunctionType, type)):
                names.add(getattr(value, "__module__", None) or "")
    return [(n, vars(sys.modules[n])) for n in sorted(names) if _model_code(n) and n in sys.modules]


def _copy(value: Any) -> Any:
    """One level into a plain list, dict or set (or an nn.Module's OrderedDict tables): its items as they
    are now; None for anything else (a subclass may compute its items: transformers' ``ACT2FN``)."""
    if type(value) in (dict, OrderedDict):
        return dict.copy(value)
    if type(value) in (list, set):
        return type(value)(value)
    return None


def _put_back(table: dict[str, Any], before: dict[str, Any], inner: dict[str, Any]) -> None:
    """Make ``table`` hold ``before`` again: names the trace bound or rebound, and container contents."""
    for name in [n for n in table if n not in before]:
        del table[name]
    for name, value in before.items():
        if table.get(name, _MISSING) is not value:
            table[name] = value
    for name, items in inner.items():
        box = table.get(name)
        if isinstance(box, dict) and type(box) in (dict, OrderedDict):
            now = dict.copy(box)
            if now.keys() != items.keys() or any(now[k] is not v for k, v in items.items()):
                box.clear()
                box.update(items)
        elif type(box) is list and (len(box) != len(items) or any(a is not b for a, b in zip(box, items))):
            box[:] = items
        elif type(box) is set and box != items:
            box.clear()
            box.update(items)


_MISSING = object()


def _snapshot(table: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return dict(table), {k: c for k, v in table.items() if (c := _copy(v)) is not None}


@contextlib.contextmanager
def kept_as_it_was(model: nn.Module) -> Iterator[None]:
    """Put back, after the block, the state the model's code owns as it was before (see the module doc).

    Example::

        with kept_as_it_was(model):
            torch.export.export(model, args, strict=False)     # a global scratch buffer stays real
    """
    spaces = [(table, *_snapshot(table)) for _, table in code_namespaces(model)]
    # each module's attributes, and one level in: its parameters, buffers, submodules and hooks
    modules = [(m.__dict__, *_snapshot(m.__dict__)) for m in model.modules()]
    try:
        yield
    finally:
        for table, before, inner in spaces + modules:
            _put_back(table, before, inner)


def _fakes(value: Any) -> bool:
    """A fake tensor, or a list, tuple, dict or set holding one (one level)."""
    if isinstance(value, FakeTensor):
        return True
    if type(value) in (dict, OrderedDict):
        value = list(dict.values(value))
    return type(value) in (list, tuple, set) and any(isinstance(v, FakeTensor) for v in value)


def fake_tensors_in(model: nn.Module, outputs: Any = None) -> list[str]:
    """Where a fake tensor is found: the outputs, parameters, buffers, module attributes, or the globals
    of the model's code (:func:`code_namespaces`). Empty when there is none.

    Example::

        fake_tensors_in(model, model(x))     # ["global _SCORES of mylib.attention"] after a bad trace
    """
    found = [f"output {i}" for i, leaf in enumerate(_pytree.tree_leaves(outputs)) if isinstance(leaf, FakeTensor)]
    found += [f"parameter {n}" for n, p in model.named_parameters() if isinstance(p, FakeTensor)]
    found += [f"buffer {n}" for n, b in model.named_buffers() if isinstance(b, FakeTensor)]
    for path, m in model.named_modules():
        found += [f"attribute {path or '<model>'}.{k}" for k, v in vars(m).items() if _fakes(v)]
    for name, table in code_namespaces(model):
        found += [f"global {k} of {name}" for k, v in list(table.items()) if _fakes(v)]
    return found
