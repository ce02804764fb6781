"""Capture a model's graph with torch.export (non-strict, fake tensors), once per distinct block.

Repeated blocks (the 80 decoder layers of a 70B model) are instances of one class with one
configuration. Before exporting, every ``nn.ModuleList`` of such blocks is cut down to one
representative per distinct block signature, so the trace costs O(distinct block types), not
O(depth). :class:`Capture` maps what is found in a representative back to all its copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..core.devices import callers_device
from ..core.errors import TraceError
from .call_inputs import recording
from .opaque_kernels import opaque_kernels
from .owned_state import kept_as_it_was
from .quantized import plain_linears

__all__ = [
    "Capture",
    "block_signature",
    "called_modules",
    "capture",
    "index_attrs",
    "leaves_no_trace",
    "module_aliases",
    "no_cache",
    "real_values",
    "unrun_modules",
]

log = logging.getLogger(__name__)

_SIMPLE = (int, float, str, bool, type(None))


def _simple_attrs(module: nn.Module) -> dict[str, object]:
    items: dict[str, object] = {}
    for key, value in vars(module).items():
        if key.startswith("_") or key == "training":
            continue
        if isinstance(value, _SIMPLE) or (isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value)):
            items[key] = value
    return items


def block_signature(module: nn.Module, ignore: frozenset = frozenset()) -> tuple:
    """What must agree for two blocks to share one trace: classes, tensor shapes, plain attributes.

    ``ignore`` holds (submodule path, attribute) pairs left out, such as a layer index.
    """
    if module is None:  # a ModuleList may hold None placeholders
        return (("", "None", ()),)
    parts: list[tuple[object, ...]] = []
    for name, sub in module.named_modules():
        attrs = tuple(sorted((k, v) for k, v in _simple_attrs(sub).items() if (name, k) not in ignore))
        parts.append((name, type(sub).__qualname__, attrs))
        for pname, p in sub.named_parameters(recurse=False):
            parts.append((name, pname, tuple(p.shape), p.dtype, p.requires_grad))
        for bname, b in sub.named_buffers(recurse=False):
            parts.append((name, bname, tuple(b.shape), b.dtype))
    return tuple(parts)


def index_attrs(blocks: nn.ModuleList) -> frozenset:
    """Attributes that hold the block's own position in every block (layer_idx, layer_id, ...)."""
    found = None
    for i, block in enumerate(blocks):
        if block is None:
            continue
        here = {
            (name, k)
            for name, sub in block.named_modules()
            for k, v in _simple_attrs(sub).items()
            if type(v) is int and v == i
        }
        found = here if found is None else found & here
    return frozenset(found or ())


@dataclasses.dataclass
class Capture:
    """An exported graph plus the map from traced module paths to the model's real ones."""

    exported: Any  # torch.export.ExportedProgram of the whole model (None when traced per submodule)
    # traced list path (e.g. "model.layers") -> for each traced position, the original indices it stands for
    groups: dict[str, list[list[int]]]
    seconds: float
    path: str = "whole model"  # how it was traced (the report shows it)
    # per-submodule tracing: (module path, program) of each traced submodule, paths relative to it
    parts: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    untraced: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (module path, why)
    # a module reachable by several paths (one block shared by two layers): other path -> its first path
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    # id(module) -> the (args, kwargs) of its first call in the trace, as shapes (.call_inputs), or None
    inputs: dict[int, Any] = dataclasses.field(default_factory=dict)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.exported.graph

    def programs(self) -> list[tuple[str, Any]]:
        """(module path prefix, exported program) of every traced part: the whole model is one part."""
        return list(self.parts) if self.exported is None else [("", self.exported)]

    @property
    def traced_blocks(self) -> int:
        """Repeated blocks traced once for all their copies."""
        return sum(sum(1 for p in positions if p) for positions in self.groups.values())

    def expand_path(self, path: str) -> list[str]:
        """All module paths in the real model that a traced module path stands for."""
        for list_path, positions in self.groups.items():
            prefix = list_path + "."
            if path.startswith(prefix):
                rest = path[len(prefix) :]
                idx, _, tail = rest.partition(".")
                if idx.isdigit() and int(idx) < len(positions):
                    return [f"{prefix}{orig}{'.' + tail if tail else ''}" for orig in positions[int(idx)]]
        return [path]

    def group_of(self, path: str) -> tuple[str, int] | None:
        """(list path, traced position) of the repeated block a traced path sits in, if any."""
        for list_path in self.groups:
            prefix = list_path + "."
            if path.startswith(prefix):
                idx = path[len(prefix) :].partition(".")[0]
                if idx.isdigit():
                    return list_path, int(idx)
        return None


@contextlib.contextmanager
def _representatives(model: nn.Module, enabled: bool) -> Iterator[dict[str, list[list[int]]]]:
    """Temporarily cut every ModuleList of repeated blocks down to one block per signature."""
    groups: dict[str, list[list[int]]] = {}
    swaps: list[tuple[nn.Module, str, nn.Module, str]] = []
    if enabled:
        for path, module in list(model.named_modules()):
            if not isinstance(module, nn.ModuleList) or len(module) < 2:
                continue
            reps: dict[tuple, int] = {}
            positions: list[list[int]] = []
            keep: list[nn.Module] = []
            ignore = index_attrs(module)
            for i, block in enumerate(module):
                sig = block_signature(block, ignore)
                if sig in reps:
                    positions[reps[sig]].append(i)
                else:
                    reps[sig] = len(keep)
                    keep.append(block)
                    positions.append([i])
            if len(keep) == len(module):
                continue
            # Keep the list's place in the model; the representatives keep their relative order.
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            swaps.append((parent, attr, module, path))
            groups[path] = positions
    try:
        for parent, attr, module, path in swaps:
            parent._modules[attr] = nn.ModuleList([module[p[0]] for p in groups[path]])  # type: ignore[index]
        yield groups
    finally:
        for parent, attr, module, _ in swaps:
            parent._modules[attr] = module


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs")  # fmt: skip


@contextlib.contextmanager
def leaves_no_trace(model: nn.Module) -> Iterator[None]:
    """Take out the forward hooks and instance attributes that the model's own code adds while it is traced.

    transformers installs its output-capturing hooks lazily, on the first forward that asks for
    attentions or hidden states (``config.output_attentions``), and marks the model as hooked; run
    on the cut-down list of one block per type, that would hook the representatives only, and the
    model would return one entry per *traced* layer ever after.

    Example::

        with leaves_no_trace(model):
            torch.export.export(model, (), kwargs, strict=False)
    """
    modules = list(model.modules())
    before = [({d: set(getattr(m, d, {})) for d in _HOOK_DICTS}, set(m.__dict__)) for m in modules]
    try:
        yield
    finally:
        for m, (hooks, attrs) in zip(modules, before):
            for d, keys in hooks.items():
                table: dict = getattr(m, d, None) or {}
                for k in [k for k in table if k not in keys]:
                    del table[k]
            for a in [a for a in m.__dict__ if a not in attrs]:
                del m.__dict__[a]


def capture(model: nn.Module, args: tuple, kwargs: dict, *, dedupe_blocks: bool = True) -> Capture:
    """Export ``model`` on fake tensors (no real compute) with one representative per block type.

    The model is left as it was: hooks and attributes its code adds during the trace are taken out
    again (:func:`leaves_no_trace`). Quantized linears are traced as plain ones (:func:`.quantized.plain_linears`).

    Example::

        cap = capture(model, (), {"input_ids": ids, "use_cache": False})
        cap.graph  # torch.fx.Graph of aten ops
    """
    with plain_linears(model), leaves_no_trace(model):
        return _capture(model, args, kwargs, dedupe_blocks)


def _capture(model: nn.Module, args: tuple, kwargs: dict, dedupe_blocks: bool) -> Capture:
    start = time.perf_counter()
    was_training = model.training
    try:
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        with (
            _bind_non_pytree_inputs(model, tuple(args), dict(kwargs or {})) as (t_args, t_kwargs),
            no_cache(model),
            recording(model) as inputs,
        ):
            unrun: list[str] = []
            try:
                with _representatives(model, dedupe_blocks) as groups:
                    ep = _export_grad_or_not(model, t_args, t_kwargs)
                    aliases = module_aliases(model)
                    if groups:
                        unrun = unrun_modules(model, ep)
                path = "one block per type" if groups else "whole model"
            except TraceError:
                if not (dedupe_blocks and groups):
                    raise
                # the model's code depends on its depth in a way the cut-down copy breaks: trace it whole
                log.info("tracing one block per type failed for %s; tracing every block", type(model).__name__)
                groups = {}
                ep = _export_grad_or_not(model, t_args, t_kwargs)
                aliases = module_aliases(model)
                path = "whole model (the one-block-per-type trace failed)"
            if unrun:
                # a representative did not run a block its copies may run (zip(attns, resnets[1:]) over a
                # list cut to one): trace every block, so no attention is left out
                log.info(
                    "%s: %d modules did not run when one block per type was traced (e.g. %s); tracing every block",
                    type(model).__name__,
                    len(unrun),
                    unrun[0],
                )
                groups = {}
                ep = _export_grad_or_not(model, t_args, t_kwargs)
                aliases = module_aliases(model)
                path = f"whole model ({unrun[0]} did not run in the one-block-per-type trace)"
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        model.train(was_training)
    seconds = time.perf_counter() - start
    log.debug("traced %s in %.2fs (%d repeated-block lists deduplicated)", type(model).__name__, seconds, len(groups))
    return Capture(ep, groups, seconds, path, aliases=aliases, inputs=inputs)


@contextlib.contextmanager
def real_values() -> Iterator[None]:
    """Trace with real tensors beside the fake ones, so a branch on data takes the example inputs' way.

    Example::

        with real_values():
            cap = capture(block, (x,), {"mask": mask})     # ``if mask.sum() < n`` no longer stops it
    """
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)  # each branch answered this way is logged as a warning
    try:
        with torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True):
            yield
    finally:
        shapes_log.setLevel(level)


@contextlib.contextmanager
def no_cache(model: nn.Module) -> Iterator[None]:
    """``config.use_cache = False`` for the trace (a transformers model whose forward does not name
    ``use_cache`` still reads it from its config; a cache object in the output is no pytree)."""
    config = getattr(model, "config", None)
    old = getattr(config, "use_cache", None)
    if not isinstance(old, bool) or not old:
        yield
        return
    try:
        config.use_cache = False  # type: ignore[union-attr]
    except Exception:  # a frozen config: leave it
        yield
        return
    try:
        yield
    finally:
        config.use_cache = old  # type: ignore[union-attr]


def module_aliases(model: nn.Module) -> dict[str, str]:
    """Every other path of a module reachable by several (a block shared by two layers) -> its first path;
    and ``"=" + name`` -> ``"|"``-joined names of a parameter tied between modules.

    Example::

        module_aliases(model)    # {"layers.2.shared": "layers.1.shared", "layers.2.shared.q": ...}
    """
    first = {id(m): p for p, m in model.named_modules()}
    aliases = {p: first[id(m)] for p, m in model.named_modules(remove_duplicate=False) if first[id(m)] != p}
    names: dict[int, list[str]] = {}
    for p, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(p)
    for group in names.values():  # a parameter tied between modules (not one module on two paths)
        owners = {aliases.get(n.rpartition(".")[0], n.rpartition(".")[0]) for n in group}
        if len(owners) > 1:
            for n in group:
                aliases["=" + n] = "|".join(group)
    return aliases


def called_modules(model: nn.Module, exported: Any) -> set[int]:
    """Ids of the modules of ``model`` whose forward left ops in the exported graph.

    Example::

        id(model.layers[0]) in called_modules(model, exported)
    """
    called: set[int] = set()
    paths: set[str] = set()
    for gm in exported.graph_module.modules():  # wrapped regions (no_grad, autocast) are subgraphs
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            for path, _ in (node.meta.get("nn_module_stack") or {}).values():
                paths.add(path)
    for path in paths:
        try:
            called.add(id(model.get_submodule(path)))
        except AttributeError:
            continue
    called.add(id(model))
    return called


def unrun_modules(model: nn.Module, exported: Any) -> list[str]:
    """Paths of modules holding parameters of their own that nothing in the graph used.

    A module counts as run when its forward left ops in the graph, or when another module read its
    parameters (``F.linear(x, self.qkv.weight)``, ``nn.MultiheadAttention.out_proj``).

    Example::

        unrun_modules(model, torch.export.export(model, (x,), strict=False))   # [] when all ran
    """
    called = called_modules(model, exported)
    used: set[int] = set()
    placeholders = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    for ph, name in exported.graph_signature.inputs_to_parameters.items():
        node = placeholders.get(ph)
        if node is not None and node.users:
            try:
                used.add(id(model.get_parameter(name)))
            except AttributeError:
                continue
    out = []
    for path, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if id(module) in called or not own or any(id(p) in used for p in own) or ".kha." in f".{path}.":
            continue  # KHA's own transforms of a parametrized weight are read when the weight is
        out.append(path)
    return out


# e.g. "FlexAttention does not support backward on CPU"; an op writing into a buffer (``out=``) under grad
_NO_BACKWARD = ("does not support backward", "arguments don't support automatic differentiation")
_REFUSES_GRAD: set[tuple[type, str]] = set()  # (model class, attention implementation) seen refusing grad


def _export_grad_or_not(model: nn.Module, args: tuple, kwargs: dict):
    """Export with grad on; where an op refuses grad (flex_attention on CPU), export without it.

    Grad on keeps nn.TransformerEncoderLayer / nn.MultiheadAttention off their fused inference
    fast paths, so the per-head structure stays visible in the graph. The analysis never runs a
    backward, so a model whose forward refuses grad on this platform is traced under no_grad.
    """
    key = (type(model), str(getattr(getattr(model, "config", None), "_attn_implementation", "")))
    if key not in _REFUSES_GRAD:
        with torch.enable_grad():
            try:
                return _export(model, args, kwargs)
            except TraceError as exc:
                if not any(text in _causes(exc) for text in _NO_BACKWARD):
                    raise
        _REFUSES_GRAD.add(key)  # the next model of this kind goes straight to no_grad
    log.info("%s refuses grad on this platform; tracing it under no_grad", type(model).__name__)
    with torch.no_grad():
        return _export(model, args, kwargs)


def _causes(exc: BaseException) -> str:
    texts = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        texts.append(str(cur))
        cur = cur.__cause__ or cur.__context__
    return "\n".join(texts)


_LEAF_TYPES = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)


def _exportable(value: object) -> bool:
    """Whether torch.export can take ``value`` as an input: a pytree of tensors and plain values."""
    from torch.utils import _pytree

    try:
        leaves = _pytree.tree_leaves(value)
    except Exception:  # a pytree node that cannot be flattened
        return False
    return all(isinstance(leaf, _LEAF_TYPES) for leaf in leaves)


@contextlib.contextmanager
def _bind_non_pytree_inputs(model: nn.Module, args: tuple, kwargs: dict) -> Iterator[tuple[tuple, dict]]:
    """Close over the inputs torch.export cannot take (a BlockMask, a dataclass, any object).

    For the analysis those inputs are constants: the model's ``forward`` is wrapped for the
    duration of the trace, so parameter and module paths stay the model's own. Yields the inputs
    left to pass to the export.
    """
    fixed_args = {i: a for i, a in enumerate(args) if not _exportable(a)}
    fixed_kwargs = {k: v for k, v in kwargs.items() if not _exportable(v)}
    if not fixed_args and not fixed_kwargs:
        yield args, kwargs
        return
    log.info(
        "binding %s as constants for the trace of %s (torch.export cannot take them as inputs)",
        [type(v).__name__ for v in (*fixed_args.values(), *fixed_kwargs.values())],
        type(model).__name__,
    )
    forward = model.forward
    had_own = "forward" in vars(model)
    n_args = len(args)

    def bound_forward(*a: Any, **kw: Any) -> Any:
        it = iter(a)
        full = [fixed_args[i] if i in fixed_args else next(it) for i in range(n_args)]
        full.extend(it)
        return forward(*full, **kw, **fixed_kwargs)

    model.forward = bound_forward
    try:
        yield (
            tuple(a for i, a in enumerate(args) if i not in fixed_args),
            {k: v for k, v in kwargs.items() if k not in fixed_kwargs},
        )
    finally:
        if had_own:
            model.forward = forward
        else:
            del model.forward


def _export(model: nn.Module, args: tuple, kwargs: dict):
    try:
        # the model's own code sees the caller's default device (a meta block); linear-attention kernels as
        # one op each (.opaque_kernels); the state the model's code owns is put back (.owned_state)
        with kept_as_it_was(model), callers_device(), opaque_kernels(model):
            return torch.export.export(model, tuple(args), dict(kwargs or {}), strict=False)
    except Exception as exc:  # torch.export raises many types; keep its reason
        raise TraceError(
            f"torch.export could not trace {type(model).__name__}: {type(exc).__name__}: {exc}\n"
            "Check that the example inputs run the model's forward (model(*example_args, "
            "**example_kwargs)), and for transformers models pass use_cache=False."
        ) from exc
