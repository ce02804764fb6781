"""Trace and match a model whole, or, where torch.export cannot, submodule by submodule.

Many models have ordinary attention blocks but a forward that ``torch.export`` cannot trace as a
whole: a loop over the experts that were hit, ``if not padding_mask.any():``, a router cast inside
forward, a cache object in the output. :func:`trace_and_match` first traces the whole model (one
block per type, :func:`~.trace.capture`) and matches it. When the trace or the match fails, it runs
the model once for real (under ``no_grad``), records the inputs of every submodule's first call,
and traces submodules top-down: a submodule that traces and matches is one part of the capture; one
that does not is replaced by its children. Repeated blocks of a ``ModuleList`` are traced once.
The capture says which path was taken (``Capture.path``) and which submodules could not be traced.

Example::

    cap, raw = trace_and_match(model, (x,), {})
    cap.path          # "one block per type" | "per submodule (...)"
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import time
import traceback
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

from ..core.devices import callers_device
from ..core.errors import AnalysisError, KHAError, TraceError
from ..core.quantized import is_quantized_linear
from .graph import module_path_of
from .heads import is_single_head
from .match import RawSite, find_sites
from .trace import Capture, block_signature, capture, index_attrs, no_cache, real_values

__all__ = ["capture_submodules", "prefix_sites", "record_calls", "trace_and_match", "why_trace_failed"]

log = logging.getLogger(__name__)

# torch.nn classes that hold attention; every other torch.nn leaf (Linear, Embedding, norms) cannot
_ATTENTION_CLASSES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


_USER_FRAME = re.compile(r'The following call raised this error:\s*File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)')
_OWN_FILES = ("/torch/", "/kha_compile/", "/contextlib.py", "<string>")


def _user_frame(exc: BaseException) -> tuple[str, str, str] | None:
    """(file, line, code) of the model code that raised: torch.export names it, else the traceback."""
    m = _USER_FRAME.search(str(exc))
    if m:
        return m.group(1), m.group(2), m.group(4)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not any(s in f.filename for s in _OWN_FILES)]
    if frames:
        return frames[-1].filename, str(frames[-1].lineno), frames[-1].line or ""
    return None


def why_trace_failed(exc: BaseException) -> str:
    """A short reason for a failed trace: the error and the line of model code it stopped at.

    Example::

        why_trace_failed(exc)   # "GuardOnDataDependentSymNode at esm2.py:108 (if not padding_mask.any():)"
    """
    cause = exc.__cause__ or exc
    frame = _user_frame(cause)
    where = ""
    if frame:
        path, line, code = frame
        where = f" at {path.rpartition('/')[2]}:{line} ({code.strip()[:100]})"
    line1 = _first_line(cause)
    if line1.startswith("torch.export could not trace"):
        line1 = line1.partition(": ")[2]
    return f"{type(cause).__name__}{where}: {line1[:160]}"


def record_calls(model: nn.Module, args: tuple, kwargs: dict) -> dict[int, tuple[tuple, dict]]:
    """id(module) -> (args, kwargs) of its first call in one real forward of ``model`` (no_grad).

    Tensors are copied, so a later in-place op of the forward does not change what was recorded.

    Example::

        calls = record_calls(model, (ids,), {})
        args, kwargs = calls[id(model.layers[0])]
    """
    calls: dict[int, tuple[tuple, dict]] = {}

    def keep(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().clone()
        if isinstance(t, (nn.Module, type)) or callable(t):
            return t
        try:  # a cache object the forward fills as it runs: keep it as it was at this call
            return copy.deepcopy(t)
        except Exception:
            return t

    def hook(module: nn.Module, a: tuple, kw: dict) -> None:
        if id(module) not in calls:
            calls[id(module)] = (_pytree.tree_map(keep, tuple(a)), _pytree.tree_map(keep, dict(kw)))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()]
    fastpath = torch.backends.mha.get_fastpath_enabled()
    try:
        torch.backends.mha.set_fastpath_enabled(False)  # MHA's own calls run, so they are recorded
        with torch.no_grad(), no_cache(model), callers_device():  # no cache object the layers fill as they run
            model(*args, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        for h in handles:
            h.remove()
    return calls


def prefix_sites(raw: list[RawSite], prefix: str) -> list[RawSite]:
    """Make the module and parameter paths of sites found in a submodule's graph the model's own.

    Example::

        prefix_sites(find_sites(capture(model.layers[0], a, kw).exported), "layers.0")
    """
    if not prefix:
        return raw

    def add(path: str) -> str:
        return f"{prefix}.{path}" if path else prefix

    at_root = [site for site in raw if not module_path_of(site.node)]
    for site in raw:
        if len(at_root) == 1 and site is at_root[0]:  # the submodule's own attention: named like the module
            site.name = prefix
        else:
            site.name = add(site.name)
        for matches in site.all_roles():
            proj = matches.projection
            proj.param = add(proj.param)
            proj.module_path = add(proj.module_path)
            for piece in proj.pieces:
                piece.name = add(piece.name)
    return raw


def _may_hold_attention(module: nn.Module) -> bool:
    if next(module.parameters(), None) is None or is_quantized_linear(module):
        return False
    if isinstance(module, _ATTENTION_CLASSES):
        return True
    builtin_leaf = type(module).__module__.startswith("torch.nn.") and not module._modules
    return not builtin_leaf


def _trace_part(module: nn.Module, call: tuple[tuple, dict], real: bool = False) -> tuple[Capture, list[RawSite]]:
    with real_values() if real else contextlib.nullcontext():
        cap = capture(module, *call)
    try:
        raw = find_sites(cap.exported, cap.aliases)
    except KHAError:
        raise
    except Exception as exc:  # the match on this graph failed: the caller tries the children instead
        raise AnalysisError(f"match failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    return cap, raw


_DATA_DEPENDENT = ("data-dependent", "GuardOnDataDependentSymNode")


def _trace_or_why(module: nn.Module, call: tuple[tuple, dict]) -> tuple[Capture, list[RawSite]] | str:
    """The submodule's capture and sites, or why it could not be traced. A forward that branches on its
    inputs' values (Reformer's ``if mask.sum() < n``) is traced again with the recorded inputs' real
    values answering the branch."""
    try:
        return _trace_part(module, call)
    except KHAError as exc:
        if any(t in f"{exc}\n{exc.__cause__}" for t in _DATA_DEPENDENT):
            try:
                return _trace_part(module, call, real=True)
            except KHAError:
                pass
        return why_trace_failed(exc)


def capture_submodules(model: nn.Module, args: tuple, kwargs: dict, reason: str) -> tuple[Capture, list[RawSite]]:
    """Trace the submodules of ``model`` top-down with inputs recorded from one forward; see the module doc.

    Example::

        cap, raw = capture_submodules(model, (ids,), {}, "the whole-model trace failed: ...")
        cap.parts          # [("layers.0", ExportedProgram), ...]
    """
    start = time.perf_counter()
    try:
        calls = record_calls(model, args, kwargs)
    except Exception as exc:
        raise TraceError(
            f"{reason}; and the model's own forward with these inputs fails too ({type(exc).__name__}: "
            f"{_first_line(exc)}), so kha_compile cannot trace it submodule by submodule. Check that "
            "model(*example_args, **example_kwargs) runs."
        ) from exc
    parts: list[tuple[str, Any]] = []
    groups: dict[str, list[list[int]]] = {}
    untraced: list[tuple[str, str]] = []
    sites: list[RawSite] = []

    def visit(path: str, module: nn.Module) -> None:
        if not _may_hold_attention(module):
            return
        call = calls.get(id(module))
        if call is not None and path:
            traced = _trace_or_why(module, call)
            if isinstance(traced, str):
                untraced.append((path, traced))
            else:
                cap, raw = traced
                parts.append((path, cap.exported))
                groups.update({f"{path}.{k}": v for k, v in cap.groups.items()})
                sites.extend(prefix_sites(raw, path))
                return
        children = list(module.named_children())
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            children = _representatives(path, module, calls, groups)
        for name, child in children:
            if child is not None:
                visit(f"{path}.{name}" if path else name, child)

    visit("", model)
    path = f"per submodule ({reason})"
    log.info("%s: traced %d submodules one by one (%s)", type(model).__name__, len(parts), reason)
    cap = Capture(None, groups, time.perf_counter() - start, path, parts, untraced)
    return cap, sites


def _representatives(
    path: str, blocks: nn.ModuleList, calls: dict[int, tuple[tuple, dict]], groups: dict[str, list[list[int]]]
) -> list[tuple[str, nn.Module]]:
    """One block per signature (preferring one that ran); ``groups`` maps it to all its copies."""
    ignore = index_attrs(blocks)
    by_sig: dict[tuple, list[int]] = {}
    for i, block in enumerate(blocks):
        by_sig.setdefault(block_signature(block, ignore), []).append(i)
    positions: list[list[int]] = [[] for _ in range(len(blocks))]
    chosen = []
    for members in by_sig.values():
        rep = next((i for i in members if id(blocks[i]) in calls), members[0])
        positions[rep] = members
        chosen.append((str(rep), blocks[rep]))
    if any(len(m) > 1 for m in by_sig.values()):
        groups[path] = positions  # a traced position is the representative's own index
    return sorted(chosen, key=lambda c: int(c[0]))


def _outside_blocks(cap: Capture, raw: list[RawSite]) -> str:
    """The first site whose projections sit in another repeated block (or one) than the site itself, or
    a single-head site in a repeated block (the heads of one attention written as a list of modules:
    the cut-down list hid the other heads)."""
    if not cap.groups:
        return ""
    for site in raw:
        where = cap.group_of(site.name)
        paths = [where, *(cap.group_of(m.projection.module_path) for m in site.all_roles())]
        if (is_single_head(site) or "heads" in site.join.values()) and any(p is not None for p in paths):
            return f"{site.name} has single-head attention calls in a repeated block (heads as a list of modules?)"
        for m in site.all_roles():
            here = cap.group_of(m.projection.module_path or m.projection.param)
            if here is not None and here != where:
                return f"{site.name} uses the projections of a repeated block"
    return ""


def trace_and_match(model: nn.Module, args: tuple, kwargs: dict) -> tuple[Capture, list[RawSite]]:
    """The capture of ``model`` and the sites found in it: whole, or per submodule where that fails.

    Example::

        cap, raw = trace_and_match(model, (x,), {})
    """
    try:
        cap = capture(model, args, kwargs)
    except TraceError as exc:
        reason = f"the whole-model trace failed: {why_trace_failed(exc)}"
        log.info("%s: %s; tracing submodules one by one", type(model).__name__, reason)
        try:
            return capture_submodules(model, args, kwargs, reason)
        except TraceError:
            raise exc from exc.__cause__  # the whole-model reason; the model's own forward fails too
    try:
        raw = find_sites(cap.exported, cap.aliases)
        outside = _outside_blocks(cap, raw)
        if outside:
            # an attention outside the repeated blocks uses their projections (the parent loops over the
            # list itself): the cut-down list hid the other copies, so trace every block
            log.info("%s: %s; tracing every block", type(model).__name__, outside)
            cap = capture(model, args, kwargs, dedupe_blocks=False)
            cap.path = f"whole model ({outside})"
            raw = find_sites(cap.exported, cap.aliases)
        return cap, raw
    except KHAError:
        raise
    except Exception as exc:  # the match on the whole graph failed (a data-dependent shape, ...)
        reason = f"the match on the whole-model graph failed: {type(exc).__name__}: {_first_line(exc)}"
        log.info("%s: %s; tracing submodules one by one", type(model).__name__, reason)
        try:
            cap, raw = capture_submodules(model, args, kwargs, reason)
        except KHAError:
            raw = []
        if raw:
            return cap, raw
        raise AnalysisError(
            f"kha_compile failed in the match step on {type(model).__name__}: {type(exc).__name__}: {exc}. "
            "The model is unchanged. Set KHA_MATCH_DEBUG=<node name> for the matcher's decisions, and "
            "report this with the model's code."
        ) from exc
