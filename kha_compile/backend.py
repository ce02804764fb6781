"""The ``"kha"`` torch.compile backend: KHA rewrites on the Dynamo graph, then Inductor.

Importing :mod:`kha_compile` registers the name ``"kha"`` with Dynamo lazily: if Dynamo's backend
registry is not imported yet, a one-shot import hook registers the backend when it is, so
``import kha_compile`` imports nothing of Dynamo or Inductor.

Every Dynamo graph goes through these rules, each a small class with ``pattern`` / ``check`` /
``rewrite``; a declined match is recorded with its reason (``stats.declined``, DEBUG log):

- :class:`DeployKHA` (deploy mode only): inserts the transforms of a ``save_pretrained`` checkpoint
  after the projection ops of a model that never saw :func:`kha_compile.apply`.
- :class:`FuseMLPValue`: the hand-written form ``2 * ((v @ W_up) * sigmoid(v @ W_gate)) @ W_down``
  (``torch.matmul`` or ``@``, either operand order of ``*``, ``2 *``, ``2.0 *``, ``* 2``, or the
  factor after the down-projection) becomes one ``torch.ops.kha.mlp_value`` node.
  ``KHAMLPValue`` already traces to that node; ``stats.mlp_value_ops`` counts both.
- :class:`FoldLinearKHA`: when gradients are off (``torch.is_grad_enabled()`` is False while
  compiling, or none of the weight, bias and transforms requires grad), every KHA-Linear
  ``x @ T`` is folded into the rows of the projection that feeds it (``W[R_h] <- T^T W[R_h]``,
  ``b[R_h] <- T^T b[R_h]``, KHA_SPEC.md) and the matmul disappears.

Then the graph goes to Inductor (``torch._inductor.compile_fx.compile_fx``).

Design notes
------------
- Folding works on the graph, not on modules (the backend never sees the modules): the matmul
  is anchored by the module that traced it (``nn_module_stack`` holds a ``KHALinearTransform``),
  and the path from the projection op (``linear``, Conv1D's ``addmm``, ``matmul``) to it is
  replayed on a meta stand-in whose token axes have stride 0, so any chain of views (``narrow``,
  ``reshape``, ``unflatten``, ``split`` ...) of separate, fused or interleaved projections gives
  the head slot exactly. The fold is refused when anything else reads the transformed features.
  The matmul is replaced by its input; the layout ops around it stay and cost nothing.
- Folded weights are not baked into the compiled code: they are extra graph inputs that the
  returned callable computes from the live parameters, and recomputes whenever a source tensor
  is replaced or modified in place (its version counter moves). An optimizer step between two
  ``no_grad`` calls therefore never leaves a stale fold behind.
- Deploy mode needs the head layout, which only the model's analysis gives (``kc.apply``'s
  trace and match). ``kc.backend(from_pretrained=..., model=m)`` analyses ``m`` and validates the
  checkpoint right away: a misfit raises ``KHAError`` before anything compiles. Without ``model``
  the backend takes the module handed to ``torch.compile`` (the ``OptimizedModule`` on the call
  stack) and validates on the first compile; the ``KHAError`` is then raised through Dynamo
  unwrapped (Dynamo wraps backend errors in ``BackendCompilerFailed`` except its own
  ``ShortenTraceback`` family, so the error is re-raised as a subclass of both), and
  ``except kc.KHAError`` catches it. A transform that deploy mode cannot place raises too,
  since leaving it out would change the outputs. ``nn.MultiheadAttention`` (projections used
  functionally) is not supported in deploy mode: use ``kc.load_pretrained`` and ``"kha"``.
- The rules work on a copy of the graph: Dynamo keeps using the placeholders of the graph it
  passed after the backend returns.

``kha_compile.backend`` is this module and is also callable:
``kha_compile.backend(from_pretrained=..., **options)`` returns a :class:`KHABackend`.

Example::

    import kha_compile as kc
    compiled = torch.compile(model_with_kha, backend="kha")              # train or infer
    compiled = torch.compile(vanilla, backend=kc.backend(from_pretrained="kha_ckpt"))   # deploy
    kc.backend.last_stats().rewrites      # {'deploy': 2, 'fuse_mlp_value': 0, 'fold_linear': 0}
"""
from __future__ import annotations

import dataclasses
import importlib.abc
import logging
import operator
import sys
import types
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor, fx, nn

from .errors import CheckpointError, KHAError, NoAttentionFoundError
from .modules import HeadSlot, KHALinearTransform, KHAMLPValue, KHAMultiheadAttention, KHAProjection
from .modules import _pieces, _plan

__all__ = [
    "KHABackend", "BackendStats", "GraphStats", "Verdict", "Rule", "FuseMLPValue", "FoldLinearKHA",
    "DeployKHA", "create", "last_stats", "reset", "NAME",
]

log = logging.getLogger(__name__)

NAME = "kha"
_REGISTRY = "torch._dynamo.backends.registry"
_COMPILERS = ("inductor", "eager")


# --------------------------------------------------------------------------------------------
# stats and verdicts
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Verdict:
    """The answer of a rule's ``check``: ``ok``, or not with a ``reason``."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _ok() -> Verdict:
    return Verdict(True)


def _fail(reason: str) -> Verdict:
    return Verdict(False, reason)


@dataclasses.dataclass
class GraphStats:
    """What the backend did to one Dynamo graph."""

    index: int
    rewrites: dict[str, int] = dataclasses.field(default_factory=dict)   # rule name -> rewrites made
    declined: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (rule, node, reason)
    mlp_value_ops: int = 0       # kha::mlp_value nodes in the graph handed to the compiler
    has_kha: bool = False        # the graph carried or received any KHA transform

    def count(self, rule: str) -> int:
        return self.rewrites.get(rule, 0)


@dataclasses.dataclass
class BackendStats:
    """What one :class:`KHABackend` did, summed over the graphs it compiled (graph breaks give several)."""

    graphs: list[GraphStats] = dataclasses.field(default_factory=list)

    @property
    def rewrites(self) -> dict[str, int]:
        """Rewrites per rule over all graphs, every rule present (0 when it never fired)."""
        out = {r.name: 0 for r in (DeployKHA, FuseMLPValue, FoldLinearKHA)}
        for g in self.graphs:
            for k, v in g.rewrites.items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def mlp_value_ops(self) -> int:
        return sum(g.mlp_value_ops for g in self.graphs)

    @property
    def declined(self) -> list[tuple[str, str, str]]:
        return [d for g in self.graphs for d in g.declined]

    @property
    def has_kha(self) -> bool:
        return any(g.has_kha for g in self.graphs)

    def count(self, rule: str) -> int:
        return self.rewrites.get(rule, 0)

    def __str__(self) -> str:
        r = self.rewrites
        return (f"{len(self.graphs)} graph(s): {self.mlp_value_ops} kha::mlp_value op(s) "
                f"({r.get('fuse_mlp_value', 0)} fused from the decomposed form), "
                f"{r.get('fold_linear', 0)} linear transform(s) folded, "
                f"{r.get('deploy', 0)} transform(s) inserted from a checkpoint, "
                f"{len(self.declined)} declined")


# --------------------------------------------------------------------------------------------
# graph helpers
# --------------------------------------------------------------------------------------------

def _is_call(node: fx.Node, functions: tuple = (), methods: tuple = ()) -> bool:
    return ((node.op == "call_function" and node.target in functions)
            or (node.op == "call_method" and node.target in methods))


_MATMUL_FNS = (operator.matmul, torch.matmul)
_MATMUL_METHODS = ("matmul", "__matmul__")
_MUL_FNS = (operator.mul, torch.mul)
_MUL_METHODS = ("mul", "__mul__", "__rmul__")
_SIGMOID_FNS = (torch.sigmoid, torch.special.expit, torch.nn.functional.sigmoid)
_SIGMOID_METHODS = ("sigmoid",)
_LINEAR_FNS = (torch._C._nn.linear, torch.nn.functional.linear)


def _is_matmul(node: fx.Node) -> bool:
    return _is_call(node, _MATMUL_FNS, _MATMUL_METHODS) and len(node.args) == 2 and not node.kwargs


def _is_mlp_value_op(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (torch.ops.kha.mlp_value,
                                                          torch.ops.kha.mlp_value.default)


def _module_types(node: fx.Node) -> list:
    stack = node.meta.get("nn_module_stack") or {}
    return [v[1] for v in stack.values() if isinstance(v, tuple) and len(v) >= 2]


def _inside(node: fx.Node, cls: type) -> bool:
    """Whether ``node`` was traced inside a module of class ``cls`` (innermost module)."""
    types_ = _module_types(node)
    if not types_:
        return False
    top = types_[-1]
    return (isinstance(top, type) and issubclass(top, cls)) or (isinstance(top, str) and top.endswith(cls.__name__))


_KHA_CLASSES = (KHAProjection, KHALinearTransform, KHAMLPValue, KHAMultiheadAttention)


def _touches_kha(node: fx.Node) -> bool:
    return _is_mlp_value_op(node) or any(isinstance(t, type) and issubclass(t, _KHA_CLASSES)
                                         for t in _module_types(node))


def _concrete(value: Any) -> Any:
    """A SymInt (dynamic shape) becomes its hint; lists and tuples are converted elementwise."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise KHAError("a symbolic size without a hint")
        return int(hint)
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(v) for v in value)
    return value


_Source = tuple  # ("arg", index) | ("attr", qualname) | ("const", tensor)


class _GraphContext:
    """One graph being rewritten: the real tensors behind its inputs and the extra inputs added."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], stats: GraphStats, options: dict):
        self.gm, self.graph = gm, gm.graph
        self.example_inputs = list(example_inputs)
        self.stats = stats
        self.options = options
        self.grad_enabled = torch.is_grad_enabled()
        self.placeholders = list(self.graph.find_nodes(op="placeholder"))
        self._index = {n: i for i, n in enumerate(self.placeholders)}
        self.recipes: list[_Recipe] = []
        self._last_input = self.placeholders[-1] if self.placeholders else None
        self._fake_mode = _fake_mode(example_inputs)

    # the real tensor behind a graph input (placeholder or get_attr), or None
    def source(self, node: Any) -> Optional[_Source]:
        if not isinstance(node, fx.Node):
            return None
        if node.op == "placeholder" and node in self._index:
            i = self._index[node]
            return ("arg", i) if isinstance(self.example_inputs[i], Tensor) else None
        if node.op == "get_attr":
            return ("attr", node.target)
        return None

    def tensor(self, src: Optional[_Source]) -> Optional[Tensor]:
        if src is None:
            return None
        kind, where = src
        if kind == "arg":
            return self.example_inputs[where]
        if kind == "attr":
            obj = self.gm
            for part in where.split("."):
                obj = getattr(obj, part)
            return obj if isinstance(obj, Tensor) else None
        return where

    def value(self, node: Any) -> Any:
        """Shape-carrying value of a node: its real tensor for inputs, else its example value."""
        t = self.tensor(self.source(node))
        if t is not None:
            return t
        return node.meta.get("example_value") if isinstance(node, fx.Node) else node

    def add_inputs(self, recipe: "_Recipe", name: str) -> list[fx.Node]:
        """Append graph inputs computed at run time by ``recipe``; returns their placeholder nodes."""
        self.recipes.append(recipe)
        values = recipe.compute(self)
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
                try:
                    node.meta["example_value"] = self._fake_mode.from_tensor(v)
                except Exception:  # pragma: no cover - metadata only
                    pass
            nodes.append(node)
            self.example_inputs.append(v)
        return nodes

    def call(self, target: Callable, args: tuple, like: Optional[fx.Node] = None) -> fx.Node:
        """Insert ``target(*args)`` at the current insertion point, with an example value when possible."""
        node = self.graph.call_function(target, args)
        if like is not None and "nn_module_stack" in like.meta:
            node.meta["nn_module_stack"] = like.meta["nn_module_stack"]
        missing = []
        fake_args = fx.node.map_arg(args, lambda n: missing.append(n) if "example_value" not in n.meta
                                    else n.meta["example_value"])
        if self._fake_mode is not None and not missing:
            try:
                with self._fake_mode:
                    node.meta["example_value"] = target(*fake_args)
            except Exception:  # pragma: no cover - metadata only
                pass
        return node


def _fake_mode(example_inputs: Sequence[Any]):
    try:
        from torch._guards import detect_fake_mode
        return detect_fake_mode(example_inputs)
    except Exception:  # pragma: no cover
        return None


def _erase_dead(graph: fx.Graph, nodes) -> None:
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


# --------------------------------------------------------------------------------------------
# extra graph inputs, computed at run time from the live tensors
# --------------------------------------------------------------------------------------------

def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


class _Recipe:
    """Tensors computed by ``fn`` from ``sources``; recomputed when a source tensor changes."""

    def __init__(self, sources: Sequence[_Source], fn: Callable[..., Sequence[Tensor]]):
        self.sources = list(sources)
        self.fn = fn
        self._refs: list = []
        self._versions: list[int] = []
        self._values: Sequence[Tensor] = ()

    def _inputs(self, get: Callable[[_Source], Tensor]) -> list[Optional[Tensor]]:
        return [get(s) if s is not None else None for s in self.sources]

    def compute(self, ctx: _GraphContext) -> Sequence[Tensor]:
        tensors = self._inputs(ctx.tensor)
        with torch.no_grad():
            self._values = tuple(self.fn(*tensors))
        self._remember(tensors)
        return self._values

    def _remember(self, tensors) -> None:
        self._refs = [weakref.ref(t) if t is not None else None for t in tensors]
        self._versions = [_version(t) if t is not None else 0 for t in tensors]

    def values(self, args: Sequence[Any], attr: Callable[[str], Tensor]) -> Sequence[Tensor]:
        def get(src):
            kind, where = src
            return args[where] if kind == "arg" else attr(where) if kind == "attr" else where

        tensors = self._inputs(get)
        stale = any((r is None) != (t is None) or (t is not None and (r() is not t or _version(t) != v))
                    for r, t, v in zip(self._refs, tensors, self._versions))
        if stale:
            with torch.no_grad():
                self._values = tuple(self.fn(*tensors))
            self._remember(tensors)
            log.debug("kha backend: recomputed %d folded tensor(s) after a source tensor changed", len(self._values))
        return self._values


class _Runner:
    """The callable handed back to Dynamo: adds the computed inputs, then runs the compiled graph."""

    def __init__(self, compiled: Callable, recipes: list[_Recipe], gm: fx.GraphModule):
        self.compiled = compiled
        self.recipes = recipes
        self._gm = gm

    def _attr(self, qualname: str) -> Tensor:
        obj = self._gm
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def __call__(self, *args):
        extra = [t for r in self.recipes for t in r.values(args, self._attr)]
        return self.compiled(*args, *extra)  # Dynamo calls its compiled graphs positionally


# --------------------------------------------------------------------------------------------
# the rules
# --------------------------------------------------------------------------------------------

class Rule:
    """A graph rewrite: ``pattern`` finds candidates, ``check`` accepts or declines with a reason,
    ``rewrite`` changes the graph and returns how many rewrites it made.

    A match carries everything ``rewrite`` needs; rules keep no state between the calls.
    """

    name = "rule"
    strict = False  # a strict rule raises KHAError instead of declining (skipping it would change results)

    def pattern(self, ctx: _GraphContext) -> Iterator[Any]:
        raise NotImplementedError

    def check(self, match: Any, ctx: _GraphContext) -> Verdict:
        raise NotImplementedError

    def rewrite(self, match: Any, ctx: _GraphContext) -> int:
        raise NotImplementedError

    def run(self, ctx: _GraphContext) -> int:
        """Apply the rule everywhere it fits; record each decline; returns the rewrites made.

        A KHAError (a user-facing problem, such as a deploy checkpoint that cannot be placed)
        propagates; any other error inside ``pattern`` or ``check`` declines instead of failing
        the compile, and is logged as a warning.
        """
        total = 0
        try:
            matches = list(self.pattern(ctx))
        except KHAError:
            raise
        except Exception as exc:  # a bug here must not cost the user their compile
            if self.strict:
                raise KHAError(f"{self.name}: internal error while matching: {exc!r}") from exc
            log.warning("kha backend: rule %s failed on this graph and was skipped: %r", self.name, exc)
            ctx.stats.declined.append((self.name, "<graph>", f"internal error: {exc!r}"))
            matches = []
        for match in matches:
            if isinstance(match, _Declined):
                verdict, anchor = _fail(match.reason), match.anchor
            else:
                if any(n.graph is None or getattr(n, "_erased", False) for n in match.nodes()):
                    continue  # an earlier rewrite already consumed part of this match
                anchor = match.anchor
                try:
                    verdict = self.check(match, ctx)
                except KHAError:
                    raise
                except Exception as exc:
                    log.warning("kha backend: %s check failed at %s: %r", self.name, anchor.name, exc)
                    verdict = _fail(f"internal error: {exc!r}")
            if not verdict:
                if self.strict:
                    raise KHAError(f"{self.name}: cannot rewrite at {anchor.name}: {verdict.reason}")
                ctx.stats.declined.append((self.name, anchor.name, verdict.reason))
                log.debug("kha backend: %s declined at %s: %s", self.name, anchor.name, verdict.reason)
                continue
            total += self.rewrite(match, ctx)
        ctx.stats.rewrites[self.name] = ctx.stats.rewrites.get(self.name, 0) + total
        return total


@dataclasses.dataclass
class _Declined:
    anchor: fx.Node
    reason: str


# --- MLP-value -------------------------------------------------------------------------------

@dataclasses.dataclass
class _MLPMatch:
    anchor: fx.Node            # the node whose value the fused op replaces
    v: fx.Node
    up: Any
    gate: Any
    down: Any
    scale: float
    internal: list[fx.Node]    # nodes consumed by the pattern (all but ``anchor``)

    def nodes(self) -> list[fx.Node]:
        return [self.anchor, *self.internal]


def _mul_leaves(node: Any, internal: list[fx.Node], root: bool = True) -> Optional[list]:
    """Flatten a tree of ``*`` into its factors (nodes and numbers); internal mul nodes are collected."""
    if isinstance(node, fx.Node) and _is_call(node, _MUL_FNS, _MUL_METHODS) and len(node.args) == 2 \
            and not node.kwargs and (root or len(node.users) == 1):
        internal.append(node)
        out = []
        for a in node.args:
            leaves = _mul_leaves(a, internal, root=False)
            if leaves is None:
                return None
            out.extend(leaves)
        return out
    if isinstance(node, (fx.Node, int, float)) and not isinstance(node, bool):
        return [node]
    return None


class FuseMLPValue(Rule):
    """``2 * ((v @ W_up) * sigmoid(v @ W_gate)) @ W_down`` -> ``torch.ops.kha.mlp_value(v, W_up, W_gate, W_down)``.

    Anchored at the final matmul; the factor 2 may sit anywhere in the product or after the
    down-projection, and the two factors in either order.
    """

    name = "fuse_mlp_value"

    def pattern(self, ctx: _GraphContext) -> Iterator[_MLPMatch]:
        for node in ctx.graph.nodes:
            if not _is_matmul(node):
                continue
            match = self._match_at(node)
            if match is not None:
                yield match

    @staticmethod
    def _match_at(mm: fx.Node) -> Optional[_MLPMatch]:
        h, down = mm.args
        internal: list[fx.Node] = []
        leaves = _mul_leaves(h, internal)
        if leaves is None or not internal:
            return None
        scale = 1.0
        tensors = []
        for leaf in leaves:
            if isinstance(leaf, fx.Node):
                tensors.append(leaf)
            else:
                scale *= float(leaf)
        if len(tensors) != 2:
            return None
        sig = [t for t in tensors if _is_call(t, _SIGMOID_FNS, _SIGMOID_METHODS)]
        if len(sig) != 1:
            return None
        s = sig[0]
        a = tensors[1] if tensors[0] is s else tensors[0]
        g = s.args[0] if s.args else None
        if not (isinstance(g, fx.Node) and _is_matmul(g) and _is_matmul(a)) or a.args[0] is not g.args[0]:
            return None
        anchor = mm
        if scale != 2.0 and len(mm.users) == 1:  # (h @ W_down) * 2
            (user,) = mm.users
            if _is_call(user, _MUL_FNS, _MUL_METHODS) and len(user.args) == 2 and not user.kwargs:
                other = user.args[1] if user.args[0] is mm else user.args[0]
                if isinstance(other, (int, float)) and not isinstance(other, bool):
                    scale *= float(other)
                    anchor = user
        internal = [*internal, a, s, g] + ([mm] if anchor is not mm else [])
        return _MLPMatch(anchor, a.args[0], a.args[1], g.args[1], down, scale, internal)

    def check(self, m: _MLPMatch, ctx: _GraphContext) -> Verdict:
        if m.scale != 2.0:
            return _fail(f"the product's constant factor is {m.scale:g}, not 2 (not the KHA-MLP formula)")
        for n in m.internal:
            outside = [u for u in n.users if u not in m.nodes()]
            if outside:
                return _fail(f"intermediate {n.name} is also used by {outside[0].name}; fusing would compute it twice")
        v = ctx.value(m.v)
        ws = [ctx.value(w) for w in (m.up, m.gate, m.down)]
        if not isinstance(v, Tensor) or not all(isinstance(w, Tensor) for w in ws):
            return _fail("no shape information for v or the weights")
        if v.dim() < 1:
            return _fail("v is a scalar")
        d = v.shape[-1]
        for name, w in zip(("W_up", "W_gate", "W_down"), ws):
            if w.dim() != 2 or w.shape[0] != d or w.shape[1] != d:
                return _fail(f"{name} has shape {tuple(w.shape)}, not ({d}, {d}) for v of shape {tuple(v.shape)}")
            if w.dtype != v.dtype or w.device != v.device:
                return _fail(f"{name} is {w.dtype} on {w.device}, v is {v.dtype} on {v.device}")
        return _ok()

    def rewrite(self, m: _MLPMatch, ctx: _GraphContext) -> int:
        with ctx.graph.inserting_before(m.anchor):
            fused = ctx.call(torch.ops.kha.mlp_value.default, (m.v, m.up, m.gate, m.down), like=m.anchor)
        if "example_value" in m.anchor.meta:
            fused.meta["example_value"] = m.anchor.meta["example_value"]
        m.anchor.replace_all_uses_with(fused)
        _erase_dead(ctx.graph, m.nodes())
        return 1


# --- folding linear KHA into the projection ---------------------------------------------------

_VIEW_METHODS = {"narrow", "view", "reshape", "unflatten", "flatten", "transpose", "permute", "unsqueeze",
                 "squeeze", "split", "chunk", "contiguous", "__getitem__", "view_as"}
_VIEW_FUNCTIONS = {torch.narrow, torch.reshape, torch.flatten, torch.unflatten, torch.transpose, torch.permute,
                   torch.unsqueeze, torch.squeeze, torch.split, torch.chunk, operator.getitem}


@dataclasses.dataclass(frozen=True)
class _Projection:
    """A projection op whose weight (and bias) are graph inputs: ``y = linear(x, W, b)`` and kin."""

    node: fx.Node
    kind: str                 # "linear" (W: (out, in)) | "addmm" (W: (in, out)) | "matmul" (W: (in, out))
    weight: fx.Node
    bias: Optional[fx.Node]

    @property
    def out_axis(self) -> int:
        return 0 if self.kind == "linear" else 1

    def replace(self, weight: fx.Node, bias: Optional[fx.Node]) -> None:
        n = self.node
        if self.kind == "linear":
            n.update_arg(1, weight)
            if bias is not None:
                if len(n.args) > 2:
                    n.update_arg(2, bias)
                else:
                    n.update_kwarg("bias", bias)
        elif self.kind == "addmm":
            n.update_arg(2, weight)
            if bias is not None:
                n.update_arg(0, bias)
        else:
            n.update_arg(1, weight)


def _projection(node: Any, ctx: _GraphContext) -> Optional[_Projection]:
    """``node`` as a foldable projection op, or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target in _LINEAR_FNS:
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        kind = "linear"
    elif node.target is torch.addmm and len(node.args) == 3 and not node.kwargs:
        b, _, w = node.args
        kind = "addmm"
    elif node.target in _MATMUL_FNS and len(node.args) == 2:
        w, b, kind = node.args[1], None, "matmul"
    else:
        return None
    wt = ctx.tensor(ctx.source(w))
    if wt is None or wt.dim() != 2:
        return None
    if b is not None and (ctx.tensor(ctx.source(b)) is None or ctx.tensor(ctx.source(b)).dim() != 1):
        return None
    return _Projection(node, kind, w, b)


def _is_view(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _VIEW_METHODS) or (
        node.op == "call_function" and node.target in _VIEW_FUNCTIONS)


def _simulate_view(node: fx.Node, value: Any, base: Tensor, ctx: _GraphContext) -> Any:
    """Run the view op ``node`` on the stand-in ``value`` (meta, token axes of stride 0).

    Returns the stand-in of its output, or None when the op is not a pure view of its input.
    """
    rest = []
    try:
        for a in node.args[1:]:
            if isinstance(a, fx.Node):
                ev = a.meta.get("example_value")
                if isinstance(ev, Tensor) or ev is None:
                    return None
                a = ev
            rest.append(_concrete(a))
        kwargs = {k: _concrete(v) for k, v in node.kwargs.items()}
    except KHAError:
        return None
    if any(isinstance(v, fx.Node) for v in kwargs.values()):
        return None
    try:
        if node.op == "call_method":
            if node.target == "contiguous":
                return value  # same values, same order
            out = getattr(value, node.target)(*rest, **kwargs)
        else:
            out = node.target(value, *rest, **kwargs)
    except Exception:
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not all(isinstance(o, Tensor) and o._base is base for o in outs):
        return None  # a copy (reshape that could not view, advanced indexing): not followed
    return out


def _features(value: Any, width: int) -> Tensor:
    """Boolean mask (width,) of the projection features a stand-in value reads."""
    mask = torch.zeros(width, dtype=torch.bool)
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
        sizes = [s if st != 0 else 1 for s, st in zip(v.shape, v.stride())]
        if 0 in sizes:
            continue
        idx = torch.arange(width).as_strided(sizes, v.stride(), v.storage_offset())
        mask[idx.reshape(-1)] = True
    return mask


def _slot_of(value: Tensor, head_dim: int) -> Optional[HeadSlot]:
    """The HeadSlot a stand-in (…, H, Dh) covers: token axes stride 0, one head axis, Dh contiguous."""
    if not isinstance(value, Tensor) or value.dim() < 1 or value.shape[-1] != head_dim:
        return None
    if head_dim > 1 and value.stride(-1) != 1:
        return None
    axes = [(s, st) for s, st in zip(value.shape[:-1], value.stride()[:-1]) if s != 1 and st != 0]
    if len(axes) > 1:
        return None
    heads, stride = axes[0] if axes else (1, head_dim)
    if heads > 1 and stride < head_dim:
        return None
    return HeadSlot("?", value.storage_offset(), heads, head_dim, stride)


@dataclasses.dataclass
class _FoldMatch:
    anchor: fx.Node                     # the projection op
    proj: _Projection
    transforms: list[tuple[fx.Node, fx.Node, Optional[HeadSlot]]]   # (matmul, T input, slot)
    readers: list[tuple[fx.Node, Tensor]]   # other consumers of the projection's features: (node, mask)
    width: int
    problem: str = ""

    def nodes(self) -> list[fx.Node]:
        return [self.anchor] + [m for m, _, _ in self.transforms]


def _trace_back(node: fx.Node, ctx: _GraphContext, limit: int = 16) -> Optional[_Projection]:
    """Walk from ``node`` back through view ops to a projection op."""
    cur: Any = node
    for _ in range(limit):
        if not isinstance(cur, fx.Node):
            return None
        proj = _projection(cur, ctx)
        if proj is not None:
            return proj
        if not _is_view(cur) or not cur.args:
            return None
        cur = cur.args[0]
    return None


def _view_descendants(p: fx.Node, width: int, shape: Sequence[int], ctx: _GraphContext
                      ) -> tuple[dict[fx.Node, Any], list[tuple[fx.Node, fx.Node]]]:
    """Stand-ins of every view reachable from ``p``, and the (consumer, viewed node) pairs that read them."""
    base = torch.empty(width, device="meta")
    values = {p: base.as_strided(tuple(shape), (0,) * (len(shape) - 1) + (1,))}
    readers: list[tuple[fx.Node, fx.Node]] = []
    todo = [p]
    while todo:
        cur = todo.pop()
        for u in cur.users:
            if u in values:
                continue
            if _is_view(u) and u.args and u.args[0] is cur and all(
                    n is cur or n not in values for n in u.all_input_nodes):
                out = _simulate_view(u, values[cur], base, ctx)
                if out is not None:
                    values[u] = out
                    todo.append(u)
                    continue
            readers.append((u, cur))
    return values, readers


class FoldLinearKHA(Rule):
    """KHA-Linear ``x @ T`` after a projection -> the projection with folded weight (and bias).

    Anchored at the matmuls traced inside a :class:`KHALinearTransform`; every one that reaches
    the same projection through view ops is folded together. Applies only when gradients are off
    while compiling or none of the weight, bias and transforms requires grad.
    """

    name = "fold_linear"

    def pattern(self, ctx: _GraphContext) -> Iterator[Any]:
        groups: dict[fx.Node, list[tuple[fx.Node, fx.Node]]] = {}
        projs: dict[fx.Node, _Projection] = {}
        for node in ctx.graph.nodes:
            if not (_is_matmul(node) and _inside(node, KHALinearTransform)):
                continue
            t = node.args[1]
            tt = ctx.tensor(ctx.source(t))
            if tt is None or tt.dim() != 2 or tt.shape[0] != tt.shape[1]:
                yield _Declined(node, "the transform T is not a (d, d) graph input")
                continue
            proj = _trace_back(node.args[0], ctx)
            if proj is None:
                yield _Declined(node, "its input is not a view of a projection whose weight is a graph input "
                                      "(linear, addmm or matmul)")
                continue
            groups.setdefault(proj.node, []).append((node, t))
            projs[proj.node] = proj
        for p, members in groups.items():
            yield self._match(projs[p], members, ctx)

    @staticmethod
    def _match(proj: _Projection, members, ctx: _GraphContext) -> _FoldMatch:
        ev = proj.node.meta.get("example_value")
        wt = ctx.tensor(ctx.source(proj.weight))
        width = wt.shape[proj.out_axis]
        m = _FoldMatch(proj.node, proj, [], [], width)
        if not isinstance(ev, Tensor) or ev.dim() < 1:
            m.problem = "no example value for the projection output"
            return m
        try:
            shape = _concrete(tuple(ev.shape))
        except KHAError:
            m.problem = "the projection output has a symbolic size without a hint"
            return m
        if shape[-1] != width:
            m.problem = f"the projection output has {shape[-1]} features, its weight {width}"
            return m
        values, readers = _view_descendants(proj.node, width, shape, ctx)
        mine = {mm for mm, _ in members}
        for mm, t in members:
            s = mm.args[0]
            head_dim = ctx.tensor(ctx.source(t)).shape[0]
            slot = _slot_of(values.get(s), head_dim) if s in values else None
            m.transforms.append((mm, t, slot))
        for u, v in readers:
            if u in mine and u.args[0] is v:
                continue
            m.readers.append((u, _features(values[v], width)))
        return m

    def check(self, m: _FoldMatch, ctx: _GraphContext) -> Verdict:
        if m.problem:
            return _fail(m.problem)
        if not ctx.options.get("fold", True):
            return _fail("folding is switched off (fold=False)")
        tensors = [ctx.tensor(ctx.source(m.proj.weight)), ctx.tensor(ctx.source(m.proj.bias))]
        tensors += [ctx.tensor(ctx.source(t)) for _, t, _ in m.transforms]
        if ctx.grad_enabled and any(t is not None and t.requires_grad for t in tensors):
            return _fail("gradients are on and the weight or a transform requires grad; folding would cut "
                         "them off, so the transforms stay matmuls")
        folded = torch.zeros(m.width, dtype=torch.bool)
        for mm, _, slot in m.transforms:
            if slot is None:
                return _fail(f"{mm.name}: its input is not the head slices (…, H, Dh) of the projection output")
            idx = slot.index().reshape(-1)
            if folded[idx].any():
                return _fail(f"{mm.name}: two transforms act on the same projection features")
            folded[idx] = True
        for u, mask in m.readers:
            if (mask & folded).any():
                return _fail(f"{u.name} also reads the transformed features of {m.anchor.name}")
        return _ok()

    def rewrite(self, m: _FoldMatch, ctx: _GraphContext) -> int:
        proj = m.proj
        srcs = [ctx.source(proj.weight), ctx.source(proj.bias)] + [ctx.source(t) for _, t, _ in m.transforms]
        slots = [slot for _, _, slot in m.transforms]
        fn = _fold_fn(slots, proj.out_axis)
        new = ctx.add_inputs(_Recipe(srcs, fn), f"kha_folded_{m.anchor.name}")
        proj.replace(new[0], new[1] if proj.bias is not None else None)
        for mm, _, _ in m.transforms:
            mm.replace_all_uses_with(mm.args[0])
            ctx.graph.erase_node(mm)
        return len(m.transforms)


def _fold_fn(slots: Sequence[HeadSlot], out_axis: int) -> Callable[..., tuple]:
    """``fn(W, b, *T) -> (W', b')``: ``W[R_h] <- T^T W[R_h]``, ``b[R_h] <- T^T b[R_h]`` per head."""

    def fn(weight: Tensor, bias: Optional[Tensor], *ts: Tensor) -> tuple:
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        w = weight.detach().to(acc)
        w = w if out_axis == 0 else w.t()   # (out, in)
        w_new = w.clone()
        b_new = bias.detach().to(acc).clone() if bias is not None else None
        for slot, t in zip(slots, ts):
            t = t.detach().to(device=w.device, dtype=acc)
            idx = slot.index().to(w.device)                       # (H, Dh)
            w_new[idx] = t.t() @ w[idx]                           # (Dh, Dh) @ (H, Dh, in)
            if b_new is not None:
                b_new[idx] = bias.detach().to(acc)[idx] @ t      # (H, Dh)
        w_new = (w_new if out_axis == 0 else w_new.t()).to(weight.dtype).contiguous()
        out = (w_new,)
        if bias is not None:
            out += (b_new.to(bias.dtype),)
        return out

    return fn


# --- deploy: insert checkpoint transforms -----------------------------------------------------

@dataclasses.dataclass
class _DeployEntry:
    path: str
    module: "weakref.ReferenceType[nn.Module]"
    slots: list[HeadSlot]
    transforms: dict[str, tuple[str, list[Tensor]]]   # role -> (kind, tensors: [T] or [up, gate, down])
    out_features: int


@dataclasses.dataclass
class _DeployMatch:
    anchor: fx.Node
    proj: _Projection
    entry: _DeployEntry

    def nodes(self) -> list[fx.Node]:
        return [self.anchor]


_PARAMS = {"linear": ("weight",), "mlp": ("up", "gate", "down")}


class DeployKHA(Rule):
    """Deploy mode: insert a checkpoint's transforms after each projection op of the plain model.

    Linear transforms are folded into the projection when gradients are off (as in
    :class:`FoldLinearKHA`); the rest become ``x @ T`` or ``kha::mlp_value`` nodes.
    """

    name = "deploy"
    strict = True  # a transform left out would silently change the model's outputs

    def __init__(self, entries: Sequence[_DeployEntry]):
        self.entries = list(entries)

    def pattern(self, ctx: _GraphContext) -> Iterator[Any]:
        by_weight: dict[int, _DeployEntry] = {}
        for e in self.entries:
            mod = e.module()
            w = getattr(mod, "weight", None) if mod is not None else None
            if isinstance(w, Tensor):
                by_weight[id(w)] = e
        for node in list(ctx.graph.nodes):
            if node.op not in ("placeholder", "get_attr"):
                continue
            t = ctx.tensor(ctx.source(node))
            entry = by_weight.get(id(t)) if t is not None else None
            if entry is None or entry.module() is None or t is not entry.module().weight:
                continue
            uses = [u for u in node.users]
            found = False
            for u in uses:
                proj = _projection(u, ctx)
                if proj is not None and proj.weight is node:
                    found = True
                    yield _DeployMatch(u, proj, entry)
            if not found:
                raise KHAError(
                    f"deploy: the weight of {entry.path} is used in the graph only by "
                    f"{', '.join(f'{u.op} {u.target}' for u in uses) or 'nothing'}, not by a linear/addmm/matmul "
                    "op, so its KHA transforms cannot be inserted. Use kc.load_pretrained(model, ckpt) and "
                    "torch.compile(model, backend='kha') instead.")

    def check(self, m: _DeployMatch, ctx: _GraphContext) -> Verdict:
        w = ctx.tensor(ctx.source(m.proj.weight))
        if w.shape[m.proj.out_axis] != m.entry.out_features:
            return _fail(f"{m.entry.path}: weight has {w.shape[m.proj.out_axis]} output features, the plan "
                         f"{m.entry.out_features}")
        return _ok()

    def rewrite(self, m: _DeployMatch, ctx: _GraphContext) -> int:
        proj, entry = m.proj, m.entry
        w = ctx.tensor(ctx.source(proj.weight))
        b = ctx.tensor(ctx.source(proj.bias))
        consts = {r: (k, [t.to(device=w.device, dtype=w.dtype) for t in ts]) for r, (k, ts) in entry.transforms.items()}
        slots = [s for s in entry.slots if s.role in consts]
        may_fold = ctx.options.get("fold", True) and not (
            ctx.grad_enabled and (w.requires_grad or (b is not None and b.requires_grad)))
        fold = [s for s in slots if consts[s.role][0] == "linear"] if may_fold else []
        keep = [s for s in slots if s not in fold]
        if fold:
            srcs = [ctx.source(proj.weight), ctx.source(proj.bias)] + [("const", consts[s.role][1][0]) for s in fold]
            new = ctx.add_inputs(_Recipe(srcs, _fold_fn(fold, proj.out_axis)), f"kha_deploy_folded_{proj.node.name}")
            proj.replace(new[0], new[1] if proj.bias is not None else None)
        if keep:
            weights = {}
            for s in keep:
                if s.role not in weights:
                    kind, ts = consts[s.role]
                    nodes = ctx.add_inputs(_Recipe([("const", t) for t in ts], lambda *xs: xs),
                                           f"kha_deploy_{s.role}_{proj.node.name}")
                    weights[s.role] = (kind, nodes)
            y = proj.node
            before = set(ctx.graph.nodes)
            z = _emit_transform(ctx, y, keep, entry.out_features, weights)
            new_nodes = set(ctx.graph.nodes) - before
            y.replace_all_uses_with(z, delete_user_cb=lambda u: u not in new_nodes)
        return len(slots)


def _emit_transform(ctx: _GraphContext, y: fx.Node, slots: list[HeadSlot], width: int,
                    weights: dict[str, tuple[str, list[fx.Node]]]) -> fx.Node:
    """Insert nodes computing the KHA transform of ``y`` (…, width), like ``KHAProjection.kha_transform``.

    Uses ``unflatten``/``flatten`` on the last axis only, so any leading shape (static or dynamic) works.
    Nodes are inserted in order at the current insertion point.
    """
    mode, stride = _plan(tuple(slots), width)
    cursor = [y]

    def call(target, args):
        with ctx.graph.inserting_after(cursor[0]):  # keep the new nodes in order after y
            cursor[0] = ctx.call(target, args, like=y)
        return cursor[0]

    if mode == "blocks":
        src, axis = y, width
        bounds = [(s.offset, s.num_heads * s.head_dim, s) for s in slots]
    else:
        src, axis = call(torch.unflatten, (y, -1, (width // stride, stride))), stride   # (…, H, S)
        bounds = [(s.offset, s.head_dim, s) for s in slots]
    pieces = []
    for start, length, s in _pieces(bounds, axis):
        seg = src if (start == 0 and length == axis) else call(torch.narrow, (src, -1, start, length))
        if s is not None:
            if mode == "blocks":
                seg = call(torch.unflatten, (seg, -1, (s.num_heads, s.head_dim)))            # (…, H, Dh)
            kind, ws = weights[s.role]
            if kind == "mlp":
                seg = call(torch.ops.kha.mlp_value.default, (seg, *ws))
            else:
                seg = call(torch.matmul, (seg, ws[0]))
            if mode == "blocks":
                seg = call(torch.flatten, (seg, -2))                                           # (…, H*Dh)
        pieces.append(seg)
    out = pieces[0] if len(pieces) == 1 else call(torch.cat, (pieces, -1))
    if mode == "interleaved":
        out = call(torch.flatten, (out, -2))                                                   # (…, H*S)
    return out


# --------------------------------------------------------------------------------------------
# deploy preparation: the model's head layout and the checkpoint, validated before compiling
# --------------------------------------------------------------------------------------------

class _Deploy:
    """A read checkpoint, and per model the validated plan of where its transforms go."""

    def __init__(self, directory, example_args=(), example_kwargs=None):
        from .checkpoint import read_checkpoint

        self.directory = str(directory)
        self.cfg, self.tensors = read_checkpoint(directory)
        self.example_args, self.example_kwargs = example_args, example_kwargs
        self._plans: "weakref.WeakKeyDictionary[nn.Module, list[_DeployEntry]]" = weakref.WeakKeyDictionary()

    def entries(self, model: nn.Module) -> list[_DeployEntry]:
        plan = self._plans.get(model)
        if plan is None:
            plan = self._prepare(model)
            self._plans[model] = plan
        return plan

    def _prepare(self, model: nn.Module) -> list[_DeployEntry]:
        from .api import analyse
        from .checkpoint import checkpoint_misfit
        from .passes.insert import kha_modules

        name = type(model).__name__
        if kha_modules(model):
            raise KHAError(f"deploy: {name} already carries KHA transforms; compile it with backend='kha' "
                           "instead of backend=kc.backend(from_pretrained=...).")
        report, plan = analyse(model, self.cfg, self.example_args, self.example_kwargs)
        if not report.matched:
            raise NoAttentionFoundError(f"deploy: kha_compile found no attention site in {name} to put the "
                                        f"checkpoint {self.directory!r} into.")
        unsupported = [p.module_path for p in plan if p.handler == "mha"]
        if unsupported:
            raise KHAError(f"deploy mode inserts transforms after projection modules only; {unsupported[:3]} "
                           "are nn.MultiheadAttention in-projections. Use kc.load_pretrained(model, ckpt) and "
                           "torch.compile(model, backend='kha').")
        expected: dict[str, tuple[int, ...]] = {}
        for p in plan:
            for s in p.slots:
                if s.role in p.kinds:
                    for param in _PARAMS[p.kinds[s.role]]:
                        expected[f"{p.module_path}.kha.{s.role}.{param}"] = (s.head_dim, s.head_dim)
        misfit = checkpoint_misfit(expected, {k: tuple(v.shape) for k, v in self.tensors.items()})
        if misfit:
            raise CheckpointError(f"the KHA checkpoint in {self.directory!r} does not fit {name}: {misfit}.")
        entries = []
        for p in plan:
            transforms = {s.role: (p.kinds[s.role], [self.tensors[f"{p.module_path}.kha.{s.role}.{q}"]
                                                     for q in _PARAMS[p.kinds[s.role]]])
                          for s in p.slots if s.role in p.kinds}
            entries.append(_DeployEntry(p.module_path, weakref.ref(model.get_submodule(p.module_path)),
                                        [s for s in p.slots if s.role in p.kinds], transforms, p.out_features))
        log.info("deploy: %d KHA transforms from %s fit %s (%d projections)",
                 sum(len(e.transforms) for e in entries), self.directory, name, len(entries))
        return entries


def _compiled_root() -> Optional[nn.Module]:
    """The module given to ``torch.compile(module)``: the innermost OptimizedModule call on the stack.

    Only the frames of ``OptimizedModule.__call__`` and ``nn.Module``'s call wrappers are looked at,
    and only their ``self``.
    """
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover
        return None
    codes = {getattr(fn, "__code__", None) for fn in (OptimizedModule.__call__, nn.Module._call_impl,
                                                      getattr(nn.Module, "_wrapped_call_impl", None))}
    f = sys._getframe(1)
    while f is not None:
        if f.f_code in codes:
            obj = f.f_locals.get("self")
            if isinstance(obj, OptimizedModule):
                return obj._orig_mod
        f = f.f_back
    return None


_SURFACED: dict[type, type] = {}


def _surface(exc: KHAError) -> KHAError:
    """The same error, made to pass through Dynamo unwrapped.

    Dynamo wraps what a backend raises in ``BackendCompilerFailed``, except its own
    ``ShortenTraceback`` family; a subclass of both the KHA error and ``ShortenTraceback`` reaches
    the user as the KHA error (``except kc.KHAError`` catches it).
    """
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:  # pragma: no cover
        return exc
    base = type(exc)
    if issubclass(base, ShortenTraceback):
        return exc
    cls = _SURFACED.get(base)
    if cls is None:
        try:
            cls = type(base.__name__, (base, ShortenTraceback), {"__module__": base.__module__,
                                                                 "__qualname__": base.__qualname__})
        except TypeError:  # pragma: no cover - incompatible layouts
            return exc
        _SURFACED[base] = cls
    new = cls(*exc.args, first_useful_frame=None)
    return new.with_traceback(exc.__traceback__)


# --------------------------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------------------------

_LAST: Optional["KHABackend"] = None


class KHABackend:
    """A torch.compile backend: KHA rewrites on the Dynamo graph, then Inductor.

    ``stats`` holds what it did (per graph and summed). Options:

    - ``from_pretrained``: a ``kc.save_pretrained`` directory; deploy mode (see module docs).
    - ``model``, ``example_args``, ``example_kwargs``: the model to deploy into, analysed and
      validated against the checkpoint right away (a misfit raises ``KHAError`` here, before any
      compile). Without ``model`` the backend finds the module given to ``torch.compile`` and
      validates when it compiles (the ``KHAError`` then surfaces from the first call).
    - ``fold`` (True): fold linear KHA into the projections when gradients are off.
    - ``fuse_mlp`` (True): rewrite the decomposed MLP-value form into ``kha::mlp_value``.
    - ``compiler`` ("inductor"): "inductor", "eager" (run the rewritten graph as is) or a backend callable.

    Example::

        be = kc.backend(fold=True)
        y = torch.compile(model, backend=be)(x)
        be.stats.rewrites
    """

    def __init__(self, from_pretrained=None, *, model: Optional[nn.Module] = None, example_args: Any = (),
                 example_kwargs: Optional[dict] = None, fold: bool = True, fuse_mlp: bool = True,
                 compiler: Union[str, Callable] = "inductor"):
        if not (callable(compiler) or compiler in _COMPILERS):
            raise KHAError(f"compiler={compiler!r} is not allowed; use one of {', '.join(map(repr, _COMPILERS))} "
                           "or a torch.compile backend callable.")
        for name, flag in (("fold", fold), ("fuse_mlp", fuse_mlp)):
            if not isinstance(flag, bool):
                raise KHAError(f"{name} must be True or False, got {flag!r}.")
        if model is not None and from_pretrained is None:
            raise KHAError("model= is only used with from_pretrained= (deploy mode).")
        self.__name__ = NAME  # Dynamo names the backend in its messages by __name__
        self.options = {"fold": fold, "fuse_mlp": fuse_mlp}
        self.compiler = compiler
        self.stats = BackendStats()
        self._deploy = _Deploy(from_pretrained, example_args, example_kwargs) if from_pretrained is not None else None
        self._model = weakref.ref(model) if model is not None else None
        self._quiet: set = set()
        if model is not None:
            self._deploy.entries(model)  # validate now: a misfit raises before anything compiles

    def reset(self) -> None:
        """Forget the stats and which models were already reported as having no KHA."""
        self.stats = BackendStats()
        self._quiet.clear()

    def __repr__(self) -> str:
        mode = f"from_pretrained={self._deploy.directory!r}, " if self._deploy else ""
        return f"KHABackend({mode}fold={self.options['fold']}, fuse_mlp={self.options['fuse_mlp']}, compiler={self.compiler!r})"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        global _LAST
        _LAST = self
        try:
            return self._compile(gm, example_inputs)
        except KHAError as exc:
            raise _surface(exc) from None

    def _rules(self, root: Optional[nn.Module]) -> list[Rule]:
        rules: list[Rule] = []
        if self._deploy is not None:
            model = (self._model() if self._model is not None else None) or root
            if model is None:
                raise KHAError("deploy: cannot tell which model is being compiled (torch.compile of a function?); "
                               "pass it: kc.backend(from_pretrained=..., model=model).")
            rules.append(DeployKHA(self._deploy.entries(model)))
        if self.options["fuse_mlp"]:
            rules.append(FuseMLPValue())
        rules.append(FoldLinearKHA())
        return rules

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        root = _compiled_root()
        original, gm = gm, _copy(gm)  # Dynamo keeps using the graph it passed (its placeholders) after we return
        stats = GraphStats(len(self.stats.graphs))
        self.stats.graphs.append(stats)
        ctx = _GraphContext(gm, example_inputs, stats, self.options)
        had_kha = any(_touches_kha(n) for n in gm.graph.nodes)
        for rule in self._rules(root):
            rule.run(ctx)
        stats.mlp_value_ops = sum(1 for n in gm.graph.nodes if _is_mlp_value_op(n))
        stats.has_kha = had_kha or any(stats.rewrites.values()) or stats.mlp_value_ops > 0
        if stats.has_kha:
            gm.graph.lint()
            gm.recompile()
            log.info("kha backend: graph %d: %d kha::mlp_value op(s) (%d fused from the decomposed form), "
                     "%d linear transform(s) folded, %d inserted from a checkpoint, %d declined",
                     stats.index, stats.mlp_value_ops, stats.count(FuseMLPValue.name),
                     stats.count(FoldLinearKHA.name), stats.count(DeployKHA.name), len(stats.declined))
        else:
            key = id(root) if root is not None else None
            if key not in self._quiet:
                self._quiet.add(key)
                log.info("kha backend: no KHA transforms in %s; compiling it unchanged with %s",
                         type(root).__name__ if root is not None else "this graph", self._compiler_name())
            return self._inner(original, list(example_inputs))
        compiled = self._inner(gm, ctx.example_inputs)
        if ctx.recipes:
            return _Runner(compiled, ctx.recipes, gm)
        return compiled

    def _compiler_name(self) -> str:
        return self.compiler if isinstance(self.compiler, str) else getattr(self.compiler, "__name__", "a custom backend")

    def _inner(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        if self.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        if self.compiler == "eager":
            return gm.forward
        return self.compiler(gm, example_inputs)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (nodes and their meta), sharing its attributes."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    out = graph.graph_copy(gm.graph, {})
    old_output = next(iter(reversed(gm.graph.nodes)))
    new_output = graph.output(out, type_expr=old_output.type)
    new_output.meta = dict(old_output.meta)
    return fx.GraphModule(gm, graph)


def create(from_pretrained=None, **options) -> KHABackend:
    """A :class:`KHABackend` (``kha_compile.backend(...)`` calls this).

    Example::

        torch.compile(model, backend=kc.backend())                                   # same as "kha"
        torch.compile(vanilla, backend=kc.backend(from_pretrained="kha_ckpt"))       # deploy
        kc.backend(from_pretrained="kha_ckpt", model=vanilla)    # validates the checkpoint now
    """
    return KHABackend(from_pretrained, **options)


_DEFAULT: Optional[KHABackend] = None


def _default() -> KHABackend:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = KHABackend()
    return _DEFAULT


def kha(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """The backend registered as ``"kha"``: a shared default :class:`KHABackend`."""
    return _default()(gm, example_inputs)


def last_stats() -> BackendStats:
    """Stats of the backend that compiled most recently (the ``"kha"`` default one if none has)."""
    return (_LAST or _default()).stats


def reset() -> None:
    """Reset the stats of the default ``"kha"`` backend (and of the last one used)."""
    _default().reset()
    if _LAST is not None:
        _LAST.reset()


# --------------------------------------------------------------------------------------------
# registration under "kha", without importing Dynamo
# --------------------------------------------------------------------------------------------

def _register(registry: types.ModuleType) -> None:
    if NAME not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=kha, name=NAME)


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers "kha" right after Dynamo's backend registry module is first imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _REGISTRY:
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


def _install() -> None:
    registry = sys.modules.get(_REGISTRY)
    if registry is not None:
        _register(registry)
        return
    if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())


_install()


class _CallableModule(types.ModuleType):
    """This module, callable: ``kha_compile.backend(...)`` is :func:`create`."""

    def __call__(self, from_pretrained=None, **options) -> KHABackend:
        return create(from_pretrained, **options)


sys.modules[__name__].__class__ = _CallableModule
