"""The steps every ONNX export of kha_compile takes: run torch.onnx, add the MLP-value function, save, check.

:func:`run_exporter` runs ``torch.onnx.export(dynamo=True)`` with the translations of every registered
transform kind; :func:`add_mlp_value_function` appends the ``kha::MLPValue`` function body after the
export; :func:`save_and_check` writes the file, runs ``onnx.checker`` and counts the custom nodes
again. :func:`kha_compile.export_onnx` (one forward) and the with-past export
(:mod:`kha_compile.exporters.onnx_past`) share them.

Example::

    program, num_custom = export_program(model, (x,), {}, shapes=None)   # + the MLP-value function
    save_and_check(program, path, "MyModel", num_custom)
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import torch
from torch import nn

from ..core.errors import ExportError
from ..model.transforms import transform_kinds
from ..ops.mlp_value_onnx import (
    MLP_VALUE_DOMAIN,
    MLP_VALUE_DOMAIN_VERSION,
    MLP_VALUE_OP,
    mlp_value_function,
    mlp_value_schema,
)
from .common import root_reason

__all__ = [
    "add_mlp_value_function",
    "count_mlp_value",
    "export_program",
    "run_exporter",
    "save_and_check",
    "translations",
]

log = logging.getLogger(__name__)


def translations() -> dict[Any, Any]:
    """torch op -> onnxscript translation for the ops every registered transform kind emits."""
    table: dict[Any, Any] = {}
    for kind in transform_kinds().values():
        table.update(kind.onnx_translations())
    return table


def run_exporter(model: nn.Module, args: tuple, kwargs: dict, shapes: Any) -> Any:
    """torch.onnx.export (dynamo) with the MLP-value translation; ExportError names the step."""
    name = type(model).__name__
    try:
        with mlp_value_schema():
            return torch.onnx.export(
                model,
                args,
                kwargs=kwargs,
                dynamo=True,
                dynamic_shapes=shapes,
                custom_translation_table=translations(),
                optimize=True,
                verbose=False,
            )
    except Exception as e:
        # torch.onnx: TorchExportError = torch.export failed (step 1); ConversionError = the
        # translation to ONNX failed (step 3); anything else is the exporter's own.
        kind = type(e).__name__
        step = {"TorchExportError": "export", "ConversionError": "translation"}.get(kind, "export")
        raise ExportError(f"ONNX export of {name}, step '{step}' failed: {root_reason(e)}") from e


def export_program(model: nn.Module, args: tuple, kwargs: dict, shapes: Any) -> tuple[Any, int]:
    """:func:`run_exporter` in eval mode (the training flag restored), then the MLP-value function added.

    Returns the ONNX program and how many ``kha::MLPValue`` nodes it holds.
    """
    was_training = model.training
    model.eval()
    try:
        program = run_exporter(model, args, kwargs, shapes)
    finally:
        model.train(was_training)
    num_custom = count_mlp_value(program.model)
    if num_custom:
        add_mlp_value_function(program.model)
    return program, num_custom


def count_mlp_value(ir_model: Any) -> int:
    """How many ``kha::MLPValue`` nodes the main graph of an onnx_ir model holds."""
    return sum(1 for node in ir_model.graph if node.domain == MLP_VALUE_DOMAIN and node.op_type == MLP_VALUE_OP)


def add_mlp_value_function(ir_model: Any) -> None:
    """Append the ``kha::MLPValue`` function (at the model's default opset) and its opset import."""
    import onnx_ir as ir

    opset = ir_model.opset_imports.get("", ir_model.opset_imports.get("ai.onnx"))
    if opset is None:
        raise ExportError("ONNX export, step 'function': the model imports no default-domain opset.")
    proto = mlp_value_function(opset)
    try:
        function = ir.serde.deserialize_function(proto)
        ir_model.functions[function.identifier()] = function
        ir_model.opset_imports.setdefault(MLP_VALUE_DOMAIN, MLP_VALUE_DOMAIN_VERSION)
    except Exception as e:
        raise ExportError(
            f"ONNX export, step 'function': could not add the {MLP_VALUE_DOMAIN}::"
            f"{MLP_VALUE_OP} function: {type(e).__name__}: {e}"
        ) from e


def save_and_check(program: Any, path: pathlib.Path, name: str, num_custom: int) -> None:
    """Save ``program`` to ``path``, run ``onnx.checker`` on it, and check that every MLP-value node is there."""
    try:
        program.save(path)  # external data only for models near protobuf's 2 GB limit
    except Exception as e:
        raise ExportError(
            f"ONNX export of {name}, step 'save': could not write {str(path)!r}: {type(e).__name__}: {e}"
        ) from e
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:
        raise ExportError(
            f"ONNX export of {name}, step 'check': onnx.checker rejects {str(path)!r}: {type(e).__name__}: {e}"
        ) from e
    saved = onnx.load(str(path), load_external_data=False)
    found = sum(1 for n in saved.graph.node if n.domain == MLP_VALUE_DOMAIN and n.op_type == MLP_VALUE_OP)
    if found != num_custom:  # the optimizer must keep every MLP-value node
        raise ExportError(
            f"ONNX export of {name}, step 'check': {num_custom} MLPValue nodes were translated but {found} are in "
            f"{str(path)!r}."
        )
