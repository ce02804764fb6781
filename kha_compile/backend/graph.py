"""The graph being rewritten: FX predicates, the real tensors behind its inputs and their names, node insertion.

The rules work on a copy of the Dynamo graph (:func:`copy_graph`): Dynamo keeps using the
placeholders of the graph it passed after the backend returns.

A parameter's name comes from the graph, not from the module: Dynamo records where each
placeholder's value came from (``node.meta["grapharg"].source``, e.g.
``L['self']._modules['model']._modules['layers']._modules['0']._parameters['weight']``), and
:func:`param_names` reads the module path off that chain (``model.layers.0.weight``), relative to
whatever object holds the model (``self``, an argument, a global or a closure). ``get_attr`` nodes
are named by ``gm.meta["dynamo_flat_name_to_original_fqn"]``.
"""

from __future__ import annotations

import contextlib
import operator
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, fx

from ..core.errors import BackendError
from ..model.carrier import KHAProjection
from ..model.mha import KHAMultiheadAttention
from ..model.parametrized import KHAFunctional
from ..model.transforms import transform_kinds
from .runtime import Lookup, Source, Switch, attribute
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
    "is_call",
    "is_matmul",
    "is_mlp_value_op",
    "param_names",
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


def kha_classes() -> tuple[type, ...]:
    """Classes whose presence in a node's module stack means the graph carries KHA: the carriers and
    every registered transform kind's module."""
    kinds = tuple(k.module_cls for k in transform_kinds().values())
    return (KHAProjection, KHAMultiheadAttention, KHAFunctional, *kinds)


def touches_kha(node: fx.Node) -> bool:
    """Whether ``node`` is a KHA op or was traced inside a KHA module."""
    classes = kha_classes()
    return is_mlp_value_op(node) or any(isinstance(t, type) and issubclass(t, classes) for t in _module_types(node))


_TAIL = re.compile(r"\._(modules|parameters|buffers)\[(['\"])([^'\"\]]+)\2\]$")


def source_path(name: str) -> str | None:
    """The module path a Dynamo source name ends in: ``X._modules['a']._parameters['w']`` -> ``"a.w"``.

    None when the name does not end in a parameter or buffer reached through ``_modules``.

    Example::

        source_path("L['self']._modules['q_proj']._parameters['weight']")      # "q_proj.weight"
    """
    parts: list[str] = []
    rest = name
    while True:
        m = _TAIL.search(rest)
        if m is None:
            break
        if (m.group(1) == "modules") != bool(parts):  # the leaf first, then only modules above it
            break
        parts.append(m.group(3))
        rest = rest[: m.start()]
    return ".".join(reversed(parts)) if parts else None


def param_names(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """The path of every graph input that is a module's parameter or buffer (``"model.layers.0.q_proj.weight"``).

    Read from the source Dynamo recorded for each placeholder, or ``gm.meta["dynamo_flat_name_to_original_fqn"]``
    for ``get_attr`` nodes; inputs that are not parameters are left out.
    """
    flat = gm.meta.get("dynamo_flat_name_to_original_fqn") or {}
    out: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        path: str | None = None
        if node.op == "placeholder":
            source = getattr(node.meta.get("grapharg"), "source", None)
            name = getattr(source, "name", None)
            name = name() if callable(name) else name
            path = source_path(name) if isinstance(name, str) else None
        elif node.op == "get_attr" and isinstance(node.target, str):
            path = flat.get(node.target)
        if path is not None:
            out[node] = path
    return out


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
    """One graph being rewritten: the real tensors behind its inputs, their names and the constant inputs added."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], stats: GraphStats, options: BackendOptions):
        self.gm, self.graph = gm, gm.graph
        self.example_inputs = list(example_inputs)
        self.stats = stats
        self.options = options
        self.grad_enabled = torch.is_grad_enabled()
        self.placeholders = list(self.graph.find_nodes(op="placeholder"))
        self._index = {n: i for i, n in enumerate(self.placeholders)}
        self.names = param_names(gm)  # graph input -> parameter path
        self.constants: list[Tensor] = []  # appended to every call's arguments (runtime.Runner)
        self.switches: list[Switch] = []  # constants tied to the weight they were made for
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

    def add_constants(self, tensors: Sequence[Tensor], name: str) -> list[fx.Node]:
        """Append graph inputs that hold ``tensors`` on every call (backend-owned constants, never a
        parameter); returns their placeholder nodes."""
        nodes = []
        for j, v in enumerate(tensors):
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
            self.constants.append(v)
        return nodes

    def tie(self, nodes: Sequence[fx.Node], weight: fx.Node, lookup: Lookup) -> None:
        """Tie the constants of ``nodes`` (the last ones :meth:`add_constants` added) to the real tensor
        behind graph input ``weight``: a call that passes another tensor there gets ``lookup(that tensor)``
        instead (:class:`~kha_compile.backend.runtime.Switch`)."""
        t = self.tensor_of(weight)
        if not nodes or weight.op != "placeholder" or t is None:
            return  # an attribute of the graph: always the same tensor
        first = len(self.constants) - len(nodes)
        self.switches.append(Switch(self._index[weight], weakref.ref(t), first, len(nodes), lookup))

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
    """A GraphModule over a copy of ``gm``'s graph (nodes and their meta, its own meta), sharing its attributes."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    out = graph.graph_copy(gm.graph, {})
    old_output = next(iter(reversed(gm.graph.nodes)))
    new_output = graph.output(out, type_expr=old_output.type)
    new_output.meta = dict(old_output.meta)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)  # Dynamo's (dynamo_flat_name_to_original_fqn names get_attr inputs)
    return copy
