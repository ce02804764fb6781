"""``kha::mlp_value`` in ONNX: one custom-domain ``kha::MLPValue`` node with a model-local function body.

The op's ONNX translation sits next to the op. :func:`translate_mlp_value` is the
``custom_translation_table`` entry for ``torch.onnx.export(dynamo=True)``; after the export the
exporter appends :func:`mlp_value_function` (the decomposition, in the model's default-domain
opset) so onnxruntime and every runtime that inlines functions run the file. The node carries
the plugin attributes TensorRT's parser needs (``plugin_namespace``, ``plugin_version``).
onnx and onnxscript are optional: they are imported when a function here runs.

Example::

    torch.onnx.export(model, args, dynamo=True,
                      custom_translation_table={torch.ops.kha.mlp_value.default: translate_mlp_value})
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..core.errors import BackendUnavailableError, ExportError

__all__ = [
    "MLP_VALUE_DOMAIN",
    "MLP_VALUE_DOMAIN_VERSION",
    "MLP_VALUE_OP",
    "PLUGIN_ID",
    "PLUGIN_NAMESPACE",
    "PLUGIN_VERSION",
    "import_onnx",
    "mlp_value_function",
    "mlp_value_schema",
    "translate_mlp_value",
]

MLP_VALUE_DOMAIN = "kha"  # ONNX domain of the custom node
MLP_VALUE_OP = "MLPValue"  # its op_type; also the TensorRT plugin name
MLP_VALUE_DOMAIN_VERSION = 1  # opset version of the "kha" domain
PLUGIN_NAMESPACE = "kha"  # node attribute "plugin_namespace"
PLUGIN_VERSION = "1"  # node attribute "plugin_version" (tensorrt.plugin registers "1")
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{MLP_VALUE_OP}"  # the id tensorrt.plugin.register takes

_MLP_VALUE_INPUTS = ("v", "w_up", "w_gate", "w_down")
_PLUGIN_ATTRIBUTES = ("plugin_namespace", "plugin_version")


def import_onnx() -> Any:
    """The ``onnx`` module, after checking that onnx and onnxscript are installed (BackendUnavailableError if not)."""
    try:
        import onnx
        import onnxscript  # noqa: F401  (torch.onnx's dynamo exporter needs it)
    except ImportError as e:
        raise BackendUnavailableError(
            f"ONNX export needs the onnx and onnxscript packages ({e}); install them with "
            f"`pip install onnx onnxscript` (or `pip install kha-compile[onnx]`)."
        ) from e
    return onnx


def mlp_value_function(opset: int) -> Any:
    """The ``kha::MLPValue`` FunctionProto: ``y = ((v @ w_up) * sigmoid(v @ w_gate)) @ (2 * w_down)``.

    Written in the default-domain ``opset`` of the model that carries it (a function at another
    opset than its model fails ``onnx.checker``). Type-generic: the 2 is cast like ``v @ w_up``.

    Example::

        model.functions.append(mlp_value_function(opset=20))
    """
    if opset < 15:
        raise ExportError(
            f"ONNX export, step 'function': the MLPValue function needs default-domain opset >= 15 "
            f"(CastLike); the model imports opset {opset}."
        )
    onnx = import_onnx()
    h = onnx.helper
    nodes = [
        h.make_node("MatMul", ["v", "w_up"], ["up"]),  # (..., d)
        h.make_node("MatMul", ["v", "w_gate"], ["gate"]),  # (..., d)
        h.make_node("Sigmoid", ["gate"], ["gate_sig"]),
        h.make_node("Mul", ["up", "gate_sig"], ["hidden"]),
        # the factor 2 goes on the (d, d) weight, not on the (..., d) activations: one pass over
        # the activations fewer, and exact (scaling by a power of two does not round)
        h.make_node("Constant", [], ["two_f32"], value_float=2.0),
        h.make_node("CastLike", ["two_f32", "w_down"], ["two"]),
        h.make_node("Mul", ["w_down", "two"], ["w_down2"]),
        h.make_node("MatMul", ["hidden", "w_down2"], ["y"]),  # (..., d)
    ]
    return h.make_function(
        MLP_VALUE_DOMAIN,
        MLP_VALUE_OP,
        list(_MLP_VALUE_INPUTS),
        ["y"],
        nodes,
        opset_imports=[h.make_opsetid("", opset)],
        attributes=list(_PLUGIN_ATTRIBUTES),
        doc_string="KHA MLP-value transform over the last axis of v; weights are (d, d).",
    )


@contextlib.contextmanager
def mlp_value_schema() -> Iterator[None]:
    """Register the ``kha::MLPValue`` OpSchema for the duration of an export.

    onnxscript needs a schema to build a custom-domain node with attributes. It is removed again
    afterwards (unless it was there before), so the saved file is checked against its function
    body, as every other tool will see it.
    """
    onnx = import_onnx()
    from onnx.defs import OpSchema

    if onnx.defs.has(MLP_VALUE_OP, MLP_VALUE_DOMAIN):
        yield
        return
    params = [OpSchema.FormalParameter(name, "T") for name in _MLP_VALUE_INPUTS]
    schema = OpSchema(
        MLP_VALUE_OP,
        MLP_VALUE_DOMAIN,
        MLP_VALUE_DOMAIN_VERSION,
        doc="KHA MLP-value: y = 2 * ((v @ w_up) * sigmoid(v @ w_gate)) @ w_down",
        inputs=params,
        outputs=[OpSchema.FormalParameter("y", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"], "floating point tensors")
        ],
        attributes=[
            OpSchema.Attribute(a, OpSchema.AttrType.STRING, "TensorRT plugin lookup key") for a in _PLUGIN_ATTRIBUTES
        ],
    )
    onnx.defs.register_schema(schema)
    try:
        yield
    finally:
        onnx.defs.deregister_schema(MLP_VALUE_OP, MLP_VALUE_DOMAIN_VERSION, MLP_VALUE_DOMAIN)


def translate_mlp_value(v, w_up, w_gate, w_down):
    """custom_translation_table entry: ``kha::mlp_value`` -> one ``kha::MLPValue`` node."""
    from onnxscript.values import Opset

    kha = Opset(MLP_VALUE_DOMAIN, MLP_VALUE_DOMAIN_VERSION)
    return kha.MLPValue(v, w_up, w_gate, w_down, plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)
