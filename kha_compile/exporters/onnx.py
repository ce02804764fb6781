"""ONNX export: ``torch.onnx.export(dynamo=True)`` with one custom-domain node per MLP-value call.

Each ``torch.ops.kha.mlp_value`` call becomes one node ``kha::MLPValue`` that carries the string
attributes ``plugin_namespace`` and ``plugin_version``: TensorRT's ONNX parser looks a node that has
``plugin_namespace`` up in its plugin registry as plugin ``op_type`` (version ``plugin_version``,
default "1"), i.e. ``kha::MLPValue`` v1 (see :mod:`kha_compile.exporters.tensorrt`). The file also
carries a model-local function of the same domain and name that holds the decomposition, so
onnxruntime, the ONNX checker and every runtime that inlines functions run it as it is (TensorRT
too, when the plugin is not registered).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from torch import nn

from ..analysis.inputs import example_inputs
from ..core.errors import ExportError
from ..model.wrappers import sees_through_wrappers
from ..ops.mlp_value_onnx import (
    MLP_VALUE_DOMAIN,
    MLP_VALUE_DOMAIN_VERSION,
    MLP_VALUE_OP,
    PLUGIN_ID,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    import_onnx,
    mlp_value_function,
    translate_mlp_value,
)
from ..passes.fold import fold as fold_pass
from .common import check_destination, low_precision_dtypes, without_kv_cache
from .onnx_metadata import METADATA_KEYS, kha_metadata, read_kha_metadata
from .onnx_names import dynamic_axes_for, dynamic_shapes, name_dynamic_dims, rename_io
from .onnx_past import export_with_past
from .onnx_program import export_program, save_and_check

__all__ = [
    "METADATA_KEYS",
    "MLP_VALUE_DOMAIN",
    "MLP_VALUE_DOMAIN_VERSION",
    "MLP_VALUE_OP",
    "PLUGIN_ID",
    "PLUGIN_NAMESPACE",
    "PLUGIN_VERSION",
    "OnnxSummary",
    "TensorInfo",
    "check_destination",
    "dynamic_axes_for",
    "export_onnx",
    "import_onnx",
    "mlp_value_function",
    "onnx_summary",
    "read_kha_metadata",
    "translate_mlp_value",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Summary of an ONNX file (plain data, used by the tests and the TensorRT path)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A graph input or output: name, element type and dims (int, or a str for a dynamic one)."""

    name: str
    dtype: str
    dims: tuple[int | str | None, ...]

    @property
    def dynamic_axes(self) -> dict[int, str]:
        """``{axis: name}`` for every axis that is not a fixed size."""
        return {i: (d if isinstance(d, str) else "?") for i, d in enumerate(self.dims) if not isinstance(d, int)}

    def __str__(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.dims)
        return f"{self.name}: {self.dtype}[{dims}]"


@dataclasses.dataclass(frozen=True)
class OnnxSummary:
    """What an ONNX file holds: node counts, the MLP-value nodes, functions, inputs and outputs."""

    path: pathlib.Path | None
    opset: int  # default-domain opset the model imports
    num_nodes: int  # nodes of the main graph
    op_counts: dict[str, int]  # "domain::op_type" (or "op_type") -> count
    custom_nodes: tuple[str, ...]  # names of the kha::MLPValue nodes
    functions: tuple[tuple[str, str], ...]  # (domain, name) of the model-local functions
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]

    @property
    def num_custom_nodes(self) -> int:
        return len(self.custom_nodes)

    def __str__(self) -> str:
        lines = [
            (
                f"ONNX model {self.path or ''} (opset {self.opset}): {self.num_nodes} nodes, "
                f"{self.num_custom_nodes} {MLP_VALUE_DOMAIN}::{MLP_VALUE_OP}, "
                f"functions: {', '.join('::'.join(f) for f in self.functions) or 'none'}"
            )
        ]
        for kind, infos in (("input", self.inputs), ("output", self.outputs)):
            for info in infos:
                axes = info.dynamic_axes
                dyn = ", ".join(f"{a}={n}" for a, n in axes.items()) if axes else "static"
                lines.append(f"  {kind:6s} {info}  dynamic axes: {dyn}")
        return "\n".join(lines)


def onnx_summary(model_or_path: Any) -> OnnxSummary:
    """Summarise an ONNX file (or a loaded ``onnx.ModelProto``) without loading its weights.

    Example::

        s = onnx_summary("model.onnx")
        s.num_custom_nodes, [str(i) for i in s.inputs]     # 4, ['x: float32[batch, seq, 64]']
    """
    onnx = import_onnx()
    path = None
    if isinstance(model_or_path, (str, os.PathLike)):
        path = pathlib.Path(model_or_path)
        model = onnx.load(str(path), load_external_data=False)
    else:
        model = model_or_path
    graph = model.graph
    op_counts: dict[str, int] = {}
    for node in graph.node:
        key = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        op_counts[key] = op_counts.get(key, 0) + 1
    custom = tuple(n.name for n in graph.node if _is_mlp_value_node(n))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return OnnxSummary(
        path=path,
        opset=opset,
        num_nodes=len(graph.node),
        op_counts=op_counts,
        custom_nodes=custom,
        functions=tuple((f.domain, f.name) for f in model.functions),
        inputs=tuple(_tensor_info(v, onnx) for v in graph.input),
        outputs=tuple(_tensor_info(v, onnx) for v in graph.output),
    )


def _is_mlp_value_node(node: Any) -> bool:
    return node.domain == MLP_VALUE_DOMAIN and node.op_type == MLP_VALUE_OP


def _tensor_info(value_info: Any, onnx: Any) -> TensorInfo:
    ttype = value_info.type.tensor_type
    dims: list[int | str | None] = []
    for d in ttype.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type).name if ttype.elem_type else "?"
    if ttype.elem_type == onnx.TensorProto.BFLOAT16:
        dtype = "bfloat16"
    return TensorInfo(value_info.name, dtype, tuple(dims))


# --------------------------------------------------------------------------------------------
# export_onnx
# --------------------------------------------------------------------------------------------


@sees_through_wrappers
def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    example_args: Any = (),
    example_kwargs: dict[str, Any] | None = None,
    dynamic: bool = True,
    fold: bool = True,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    *,
    past: bool = False,
) -> pathlib.Path:
    """Export ``model`` to ONNX at ``path``: each MLP-value call is one ``kha::MLPValue`` node.

    With ``fold`` (default) a deep copy of a model with KHA gets its linear KHA folded into the
    weights first (``kc.fold(copy, strict=False)``); the caller's model is never modified (the copy
    needs as much memory again). With ``dynamic`` (default) the batch and sequence axes of the
    inputs are dynamic, named ``batch`` and ``sequence`` in inputs and outputs alike (only the
    batch for images), see :func:`dynamic_axes_for`. Example inputs are optional for a
    transformers model (exported with ``use_cache=False``, so no ``past_key_values`` output).

    Inputs keep the forward's parameter names; outputs are named after the model's own output
    fields (``logits``; ``last_hidden_state``, ``pooler_output``), a single tensor ``output`` and
    a tuple's items ``output_0..n``. ``input_names`` / ``output_names`` override them, one name
    per graph input / output (:class:`~kha_compile.core.errors.ExportNamesError` otherwise, naming what
    the model has). ``metadata_props`` record the library version, the KHA config and the matched
    sites (:data:`METADATA_KEYS`, read back with :func:`read_kha_metadata`).

    With ``past=True`` (a transformers decoder LM) the file takes and returns the KV cache, as
    onnxruntime-genai expects (``past_key_values.N.key/value`` in, ``present.N.key/value`` out;
    batch, sequence and past length dynamic), and ``genai_config.json`` is written beside it, so
    that ``onnxruntime_genai.Model(directory)`` generates: ``path`` is then a directory (the file
    is ``model.onnx`` inside it) or a ``.onnx`` path. See :mod:`kha_compile.exporters.onnx_past`.

    The file holds the ``kha::MLPValue`` function body, so onnxruntime runs it directly. Weights
    stay inside the file unless they pass torch.onnx's large-model threshold (1.5 GB; a protobuf
    file cannot exceed 2 GB), then they go to ``<name>.onnx.data`` beside it. Returns the path
    of the ``.onnx`` file.

    Raises :class:`~kha_compile.core.errors.ExportError` naming the step that failed (export,
    translation, function, names, save, check) with the exporter's own reason.

    Example::

        path = kc.export_onnx(model, "model.onnx", example_args=(x,), output_names=["y"])
        onnxruntime.InferenceSession(str(path)).run(None, {"x": x.numpy()})
        read_kha_metadata(path)["config"]                       # {'q': None, 'v': 'mlp', ...}
        kc.export_onnx(llm, "llm_genai", past=True)             # llm_genai/model.onnx + genai_config.json
    """
    if past:
        if example_args or example_kwargs or input_names is not None or output_names is not None:
            raise ExportError(
                "export_onnx(past=True) builds its own example inputs and names its inputs and outputs as "
                "onnxruntime-genai expects; call it without example_args, example_kwargs, input_names, output_names."
            )
        if not dynamic:
            raise ExportError(
                "export_onnx(past=True) needs dynamic=True: the past length grows by one with every token."
            )
        path = export_with_past(model, path, fold=fold)
        log.info("%s", onnx_summary(path))
        return path
    path = check_destination(path)
    import_onnx()
    if not isinstance(model, nn.Module):
        raise ExportError(f"export_onnx takes an nn.Module; got {type(model).__name__}.")

    args, kwargs = example_inputs(model, example_args, example_kwargs)
    kwargs = without_kv_cache(model, args, kwargs)
    name = type(model).__name__
    low = "/".join(map(str, low_precision_dtypes(model)))
    if low:
        log.warning(
            "%s has %s weights: the ONNX file computes in %s, for GPU runtimes (onnxruntime's CUDA provider, "
            "TensorRT). onnxruntime's CPU provider has no such kernels for most ops; for CPU inference export "
            "an fp32 copy: kc.export_onnx(copy.deepcopy(model).float(), path).",
            name,
            low,
            low,
        )
    metadata = kha_metadata(model, args, kwargs, folded=fold)
    if fold and any("kha" in n for n, _ in model.named_parameters()):
        model = copy.deepcopy(model)  # nothing to fold without KHA: no copy then
        _fold_copy(model)
    try:
        shapes = dynamic_shapes(model, args, kwargs) if dynamic else None
    except TypeError as e:
        raise ExportError(
            f"ONNX export of {name}, step 'export': the example inputs do not fit {name}.forward: {e}"
        ) from e
    program, num_custom = export_program(model, args, kwargs, shapes)
    ir_model = program.model
    exported = getattr(program, "exported_program", None)
    if dynamic:
        name_dynamic_dims(ir_model, exported.range_constraints if exported is not None else {})
    out_spec = exported.call_spec.out_spec if exported is not None else None
    rename_io(ir_model, out_spec, name, input_names, output_names)
    ir_model.metadata_props.update(metadata)
    save_and_check(program, path, name, num_custom)
    log.info("%s", onnx_summary(path))
    return path


def _fold_copy(model: nn.Module) -> None:
    """Fold the linear KHA of ``model`` (a copy) in place."""
    fold_pass(model, strict=False)
    log.info("folded the linear KHA of a copy of %s before export", type(model).__name__)
