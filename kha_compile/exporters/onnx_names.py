"""Names in an exported ONNX graph: dynamic axes, graph inputs and outputs.

Dynamic input axes are named ``batch`` and ``sequence`` (shared by every input; a second,
independent sequence length gets ``<input>_sequence``). Graph outputs are named after the model's
own output fields (``logits``, ``last_hidden_state``, ``pooler_output``) read from the exported
program's output spec; a plain tensor output is ``output``, a tuple's are ``output_0..n``.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..core.errors import ExportNamesError

__all__ = [
    "BATCH_AXIS",
    "SEQUENCE_AXIS",
    "dynamic_axes_for",
    "dynamic_shapes",
    "name_dynamic_dims",
    "output_names_of",
    "rename_io",
]

log = logging.getLogger(__name__)

BATCH_AXIS = "batch"
SEQUENCE_AXIS = "sequence"
_IMAGE_HINTS = ("pixel", "image", "video")


def dynamic_axes_for(name: str, ndim: int) -> dict[int, str]:
    """Which axes of an input named ``name`` with ``ndim`` dims are exported dynamic, and their names.

    Tensors of 2 or 3 dims get a dynamic batch (0) and sequence (1); image-like inputs (a name with
    "pixel", "image" or "video") and tensors of 4+ dims (images, 4-D masks) only a dynamic batch;
    scalars and 1-D tensors none.

    Example::

        dynamic_axes_for("input_ids", 2)       # {0: 'batch', 1: 'sequence'}
        dynamic_axes_for("pixel_values", 4)    # {0: 'batch'}
    """
    if ndim < 2:
        return {}
    if ndim >= 4 or any(hint in name.lower() for hint in _IMAGE_HINTS):
        return {0: BATCH_AXIS}
    return {0: BATCH_AXIS, 1: SEQUENCE_AXIS}


def dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """torch.export ``dynamic_shapes`` keyed by the forward's parameter names, Dim.AUTO per axis.

    Dim.AUTO (not DYNAMIC): an axis the model pins (a size-1 example batch, a fixed-size buffer)
    comes out fixed instead of failing the export; :func:`name_dynamic_dims` warns about it.
    """
    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {axis: torch.export.Dim.AUTO for axis in dynamic_axes_for(name, value.dim())} or None
        if isinstance(value, dict):
            return {k: spec(str(k), v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(spec(name, v) for v in value)
        return None

    return {name: spec(name, value) for name, value in bound.arguments.items()}


def name_dynamic_dims(ir_model: Any, range_constraints: Mapping[Any, Any]) -> None:
    """Rename the exporter's symbols (``s77``) of dynamic input axes to ``batch`` / ``sequence``.

    Every batch axis is ``batch`` (the inputs of one call share it, even where torch.export did not
    prove it); the first sequence symbol is ``sequence`` and another, independent one (a decoder's
    length) ``<input>_sequence``. Applied to every value of the graph, expressions such as
    ``s27 + 1`` included. An input axis meant to be dynamic that the model pins to one size (a
    symbol whose range is a single value, or a fixed dim) is written as that size, with a warning.
    """
    import onnx_ir as ir

    fixed = {
        str(sym): int(vr.lower)
        for sym, vr in range_constraints.items()
        if vr.lower == vr.upper and getattr(vr.lower, "is_integer", False)
    }
    graph = ir_model.graph
    mapping: dict[str, str | int] = {}
    for value in graph.inputs:
        if value.shape is None:
            continue
        for axis, wanted in dynamic_axes_for(value.name, len(value.shape)).items():
            dim = value.shape[axis]
            symbol = dim.value if isinstance(dim, ir.SymbolicDim) else None
            if symbol is None or symbol in fixed:
                size = fixed.get(symbol, dim) if symbol is not None else dim
                log.warning(
                    "input %r axis %d (%s) is exported as the fixed size %s: the model allows no other",
                    value.name,
                    axis,
                    wanted,
                    size,
                )
                if symbol is not None:
                    mapping[symbol] = size
                continue
            if symbol not in mapping:
                taken = wanted != BATCH_AXIS and wanted in mapping.values()
                mapping[symbol] = f"{value.name}_{wanted}" if taken else wanted
    if not mapping:
        return
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in mapping) + r")\b")

    def rename(d: Any) -> Any:
        if not isinstance(d, ir.SymbolicDim) or d.value is None:
            return d
        if isinstance(mapping.get(d.value), int):
            return mapping[d.value]
        return ir.SymbolicDim(pattern.sub(lambda m: str(mapping[m.group(1)]), d.value))

    values = list(graph.inputs) + list(graph.outputs)
    values += [out for node in ir.traversal.RecursiveGraphIterator(graph) for out in node.outputs]
    for value in values:
        if value.shape is not None:
            value.shape = ir.Shape([rename(d) for d in value.shape])


# --------------------------------------------------------------------------------------------
# Output and input names
# --------------------------------------------------------------------------------------------


def output_names_of(out_spec: Any) -> list[str]:
    """Names of the flattened outputs of a call whose output pytree has spec ``out_spec``.

    Fields of a ModelOutput or dict keep their key (``logits``; ``hidden_states.0`` inside a
    tuple field); a single tensor is ``output``; the items of a returned tuple are ``output_0..n``.

    Example::

        output_names_of(exported_program.call_spec.out_spec)   # ['last_hidden_state', 'pooler_output']
    """
    placeholders = [torch.empty(0) for _ in range(out_spec.num_leaves)]
    tree = pytree.tree_unflatten(placeholders, out_spec)
    names = []
    for path, _ in pytree.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        if not parts:
            names.append("output")
        elif isinstance(path[0], pytree.SequenceKey):
            names.append(".".join([f"output_{parts[0]}", *parts[1:]]))
        else:
            names.append(".".join(parts))
    return names


def _default_output_names(count: int) -> list[str]:
    return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]


def _check_names(kind: str, given: Sequence[str], current: Sequence[str], model_name: str) -> None:
    if isinstance(given, str) or not all(isinstance(n, str) and n for n in given):
        raise ExportNamesError(f"{kind}_names must be a list of non-empty strings, one per {kind}; got {given!r}.")
    if len(given) != len(current):
        raise ExportNamesError(
            f"{kind}_names has {len(given)} name(s) but the exported {model_name} has "
            f"{len(current)} {kind}(s): {', '.join(current)}. Give one name per {kind}, in that "
            f"order."
        )
    dupes = sorted({n for n in given if list(given).count(n) > 1})
    if dupes:
        raise ExportNamesError(f"{kind}_names repeats {', '.join(map(repr, dupes))}; ONNX names must be unique.")


def rename_io(
    ir_model: Any,
    out_spec: Any,
    model_name: str,
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
) -> None:
    """Name the graph outputs after the model's output fields (or ``output_names``) and, with
    ``input_names``, rename the graph inputs. :class:`ExportNamesError` for a wrong count."""
    import onnx_ir as ir

    graph = ir_model.graph
    outputs = list(graph.outputs)
    if input_names is not None:
        _check_names("input", input_names, [v.name for v in graph.inputs], model_name)
    derived: list[str] | None = None
    if out_spec is not None:
        try:
            derived = output_names_of(out_spec)
        except (
            TypeError,
            ValueError,
            KeyError,
            AttributeError,
            RuntimeError,
        ) as e:  # cannot rebuild
            log.warning(
                "could not read the output names of %s (%s: %s); using defaults",
                model_name,
                type(e).__name__,
                e,
            )
    if derived is None or len(derived) != len(outputs):
        if derived is not None:
            log.warning(
                "%s returns %d values (%s) but the ONNX graph has %d outputs; using default output names",
                model_name,
                len(derived),
                ", ".join(derived),
                len(outputs),
            )
        derived = _default_output_names(len(outputs))
    if len(set(derived)) != len(derived):
        derived = _default_output_names(len(outputs))
    if output_names is not None:
        _check_names("output", output_names, derived, model_name)
        derived = list(output_names)

    renames: list[tuple[Any, str]] = []
    if input_names is not None:
        renames += list(zip(graph.inputs, input_names))
    seen: set[int] = set()
    for i, value in enumerate(outputs):
        if value.is_graph_input() or id(value) in seen:  # a passthrough or a repeated value
            node = ir.Node("", "Identity", [value], num_outputs=1)
            graph.append(node)
            node.outputs[0].shape, node.outputs[0].type = value.shape, value.type
            graph.outputs[i] = value = node.outputs[0]
        seen.add(id(value))
        renames.append((value, derived[i]))
    _apply_renames(graph, renames)


def _apply_renames(graph: Any, renames: list[tuple[Any, str]]) -> None:
    """Give each value its new name; other values that hold one of those names are moved aside."""
    import onnx_ir as ir

    targets = {id(v) for v, _ in renames}
    wanted = {name for _, name in renames}
    everything = list(graph.inputs) + list(graph.initializers.values())
    everything += [out for node in ir.traversal.RecursiveGraphIterator(graph) for out in node.outputs]
    names = {v.name for v in everything if v.name}
    for value in everything:
        if id(value) in targets or value.name not in wanted:
            continue
        if value.is_initializer() or value.is_graph_input():
            raise ExportNamesError(
                f"the name {value.name!r} is already taken by a graph "
                f"{'weight' if value.is_initializer() else 'input'}; choose "
                f"another one."
            )
        n = 1
        while f"{value.name}_{n}" in names or f"{value.name}_{n}" in wanted:
            n += 1
        value.name = f"{value.name}_{n}"
        names.add(value.name)
    for value, name in renames:
        value.name = name
