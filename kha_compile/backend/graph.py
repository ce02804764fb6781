"""The graph being rewritten: FX predicates, the real tensors behind its inputs, node insertion.

The rules work on a copy of the Dynamo graph (:func:`copy_graph`): Dynamo keeps using the
placeholders of the graph it passed after the backend returns.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, fx

from ..core.errors import BackendError
from ..model.carrier import KHAProjection
from ..model.mha import KHAMultiheadAttention
from ..model.parametrized import KHAFunctional
from ..model.transforms import transform_kinds
from .runtime import Recipe, Source, attribute
from .stats import GraphStats

__all__ = [
    "LINEAR_FNS",
    "MATMUL_FNS",
    "MUL_FNS",
    "MUL_METHODS",
    "SIGMOID_FNS",
    "SIGMOID_METHODS",
    "BackendOptions",
    "GraphContext",
    "concrete",
    "copy_graph",
    "erase_dead",
    "inside",
    "is_call",
    "is_matmul",
    "is_mlp_value_op",
    "touches_kha",
]

BackendOptions = dict[str, bool]  # {"fold": ..., "fuse_mlp": ...}

MATMUL_FNS: tuple[Any, ...] = (operator.matmul, torch.matmul)
MATMUL_METHODS = ("matmul", "__matmul__")
MUL_FNS: tuple[Any, ...] = (operator.mul, torch.mul)
MUL_METHODS = ("mul", "__mul__", "__rmul__")
SIGMOID_FNS: tuple[Any, ...] = (torch.sigmoid, torch.special.expit, torch.nn.functional.sigmoid)
SIGMOID_METHODS = ("sigmoid",)
LINEAR_FNS: tuple[Any, ...] = (torch._C._nn.linear, torch.nn.functional.linear)


def is_call(node: fx.Node, functions: tuple[Any, ...] = (), methods: tuple[str, ...] = ()) -> bool:
    """Whether ``node`` calls one of ``functions`` or one of the tensor ``methods``."""
    return (node.op == "call_function" and node.target in functions) or (
        node.op == "call_method" and node.target in methods
    )


def is_matmul(node: fx.Node) -> bool:
    """``a @ b`` / ``torch.matmul(a, b)`` / ``a.matmul(b)``, two positional arguments."""
    return is_call(node, MATMUL_FNS, MATMUL_METHODS) and len(node.args) == 2 and not node.kwargs


def is_mlp_value_op(node: fx.Node) -> bool:
    """A ``torch.ops.kha.mlp_value`` call."""
    return node.op == "call_function" and node.target in (torch.ops.kha.mlp_value, torch.ops.kha.mlp_value.default)


def _module_types(node: fx.Node) -> list[Any]:
    stack = node.meta.get("nn_module_stack") or {}
    return [v[1] for v in stack.values() if isinstance(v, tuple) and len(v) >= 2]


def inside(node: fx.Node, cls: type) -> bool:
    """Whether ``node`` was traced inside a module of class ``cls`` (innermost module)."""
    types_ = _module_types(node)
    if not types_:
        return False
    top = types_[-1]
    return (isinstance(top, type) and issubclass(top, cls)) or (isinstance(top, str) and top.endswith(cls.__name__))


def kha_classes() -> tuple[type, ...]:
    """Classes whose presence in a node's module stack means the graph carries KHA: the carriers and
    every registered transform kind's module."""
    kinds = tuple(k.module_cls for k in transform_kinds().values())
    return (KHAProjection, KHAMultiheadAttention, KHAFunctional, *kinds)


def touches_kha(node: fx.Node) -> bool:
    """Whether ``node`` is a KHA op or was traced inside a KHA module."""
    classes = kha_classes()
    return is_mlp_value_op(node) or any(isinstance(t, type) and issubclass(t, classes) for t in _module_types(node))


def concrete(value: Any) -> Any:
    """A SymInt (dynamic shape) becomes its hint; lists and tuples are converted elementwise.

    Raises :class:`~kha_compile.core.errors.BackendError` for a symbolic size without a hint.
    """
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise BackendError("a symbolic size without a hint; compile with torch.compile(..., dynamic=False)")
        return int(hint)
    if isinstance(value, (list, tuple)):
        return type(value)(concrete(v) for v in value)
    return value


def _fake_mode(example_inputs: Sequence[Any]) -> Any:
    try:
        from torch._guards import detect_fake_mode

        return detect_fake_mode(example_inputs)
    except Exception:  # pragma: no cover
        return None


class GraphContext:
    """One graph being rewritten: the real tensors behind its inputs and the extra inputs added."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], stats: GraphStats, options: BackendOptions):
        self.gm, self.graph = gm, gm.graph
        self.example_inputs = list(example_inputs)
        self.stats = stats
        self.options = options
        self.grad_enabled = torch.is_grad_enabled()
        self.placeholders = list(self.graph.find_nodes(op="placeholder"))
        self._index = {n: i for i, n in enumerate(self.placeholders)}
        self.recipes: list[Recipe] = []
        self._last_input: fx.Node | None = self.placeholders[-1] if self.placeholders else None
        self._fake_mode = _fake_mode(example_inputs)

    def source(self, node: Any) -> Source | None:
        """Where the real tensor behind a graph input (placeholder or get_attr) comes from, or None."""
        if not isinstance(node, fx.Node):
            return None
        if node.op == "placeholder" and node in self._index:
            i = self._index[node]
            return Source("arg", i) if isinstance(self.example_inputs[i], Tensor) else None
        if node.op == "get_attr":
            assert isinstance(node.target, str)
            return Source("attr", node.target)
        return None

    def tensor(self, src: Source | None) -> Tensor | None:
        """The real tensor of a source (at compile time), or None."""
        if src is None:
            return None
        t = src.resolve(self.example_inputs, lambda q: attribute(self.gm, q))
        return t if isinstance(t, Tensor) else None

    def tensor_of(self, node: Any) -> Tensor | None:
        """The real tensor behind a graph input node, or None."""
        return self.tensor(self.source(node))

    def value(self, node: Any) -> Any:
        """Shape-carrying value of a node: its real tensor for inputs, else its example value."""
        t = self.tensor_of(node)
        if t is not None:
            return t
        return node.meta.get("example_value") if isinstance(node, fx.Node) else node

    def add_inputs(self, recipe: Recipe, name: str) -> list[fx.Node]:
        """Append graph inputs computed at run time by ``recipe``; returns their placeholder nodes."""
        self.recipes.append(recipe)
        values = recipe.compute(self.tensor)
        nodes = []
        for j, v in enumerate(values):
            if self._last_input is None:
                with self.graph.inserting_before(next(iter(self.graph.nodes))):
                    node = self.graph.placeholder(f"{name}_{j}")
            else:
                with self.graph.inserting_after(self._last_input):
                    node = self.graph.placeholder(f"{name}_{j}")
            self._last_input = node
            if self._fake_mode is not None:
                with contextlib.suppress(Exception):  # metadata only
                    node.meta["example_value"] = self._fake_mode.from_tensor(v)
            nodes.append(node)
            self.example_inputs.append(v)
        return nodes

    def call(self, target: Callable[..., Any], args: tuple[Any, ...], like: fx.Node | None = None) -> fx.Node:
        """Insert ``target(*args)`` at the current insertion point, with an example value when possible."""
        node = self.graph.call_function(target, args)
        if like is not None and "nn_module_stack" in like.meta:
            node.meta["nn_module_stack"] = like.meta["nn_module_stack"]
        missing: list[fx.Node] = []
        fake_args = fx.node.map_arg(
            args, lambda n: missing.append(n) if "example_value" not in n.meta else n.meta["example_value"]
        )
        if self._fake_mode is not None and not missing:
            try:
                with self._fake_mode:
                    node.meta["example_value"] = target(*fake_args)
            except Exception:  # pragma: no cover - metadata only
                pass
        return node


def erase_dead(graph: fx.Graph, nodes: Sequence[fx.Node]) -> None:
    """Erase the given nodes once nothing uses them (in any order)."""
    pending = [n for n in nodes if n.graph is graph]
    changed = True
    while pending and changed:
        changed = False
        for n in list(pending):
            if not n.users:
                graph.erase_node(n)
                pending.remove(n)
                changed = True


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (nodes and their meta), sharing its attributes."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    out = graph.graph_copy(gm.graph, {})
    old_output = next(iter(reversed(gm.graph.nodes)))
    new_output = graph.output(out, type_expr=old_output.type)
    new_output.meta = dict(old_output.meta)
    return fx.GraphModule(gm, graph)
