"""The ``kha::MLPValue`` TensorRT plugin (``tensorrt.plugin``): shape and type rules, and registration.

The plugin is written against TensorRT's Python plugin API ``tensorrt.plugin`` (TensorRT >= 10.7,
"quickly deployable plugins"): ``register`` gives the output shape and type, ``autotune`` the
supported types, ``impl`` the computation run just in time by TensorRT (the Triton kernel of
:mod:`kha_compile.kernels` where it takes the head size and type, else the op's torch reference),
and, where TensorRT has ``aot_impl`` (>= 10.10), an ahead-of-time implementation
(:mod:`kha_compile.exporters.tensorrt_aot`): the Triton kernel compiled to PTX and embedded in the
engine, so that the engine runs without Python. The JIT implementation stays as the fallback.

The shape and type rules are plain functions; ``tensorrt`` is imported only by the functions that
need it.

Note: this module avoids ``from __future__ import annotations``: ``tensorrt.plugin.register`` reads
the annotations of the descriptor function as real classes.
"""

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.errors import BackendUnavailableError, OpInputError
from ..kernels import mlp_value_triton_forward, triton_available, triton_supports
from ..ops.mlp_value import mlp_value_reference
from .onnx import PLUGIN_ID
from .tensorrt_aot import register_mlp_value_aot_impl

__all__ = [
    "PLUGIN_DTYPE_NAMES",
    "aot_registered",
    "import_tensorrt",
    "mlp_value_output_dtype",
    "mlp_value_output_shape",
    "register_mlp_value_plugin",
]

log = logging.getLogger(__name__)

PLUGIN_DTYPE_NAMES = ("float32", "float16", "bfloat16")  # the dtypes of v the plugin takes
_INSTALL_HINT = (
    "Install TensorRT (>= 10.7, for tensorrt.plugin) on a Linux machine with an NVIDIA GPU and "
    "CUDA 12: `pip install tensorrt` or `pip install tensorrt-cu12 --extra-index-url "
    "https://pypi.nvidia.com` (the packages on the public index fetch the real wheel from NVIDIA's "
    "index, which must be reachable), together with a CUDA build of PyTorch. The ONNX file from "
    "kc.export_onnx runs anywhere with onnxruntime."
)


# --------------------------------------------------------------------------------------------
# The plugin's shape and type rules (plain functions)
# --------------------------------------------------------------------------------------------


def mlp_value_output_shape(input_shapes: Sequence[Sequence[int | None]]) -> tuple[int | None, ...]:
    """Output shape of ``kha::MLPValue`` from its four input shapes: that of ``v``.

    ``v`` is (..., d) and each weight (d, d). A dim may be ``None`` (not known at build time);
    known dims must agree. Raises :class:`~kha_compile.core.errors.OpInputError` otherwise.

    Example::

        mlp_value_output_shape([(2, 4, None, 64), (64, 64), (64, 64), (64, 64)])   # (2, 4, None, 64)
    """
    if len(input_shapes) != 4:
        raise OpInputError(f"kha::MLPValue takes 4 inputs (v, w_up, w_gate, w_down); got {len(input_shapes)}.")
    v, *weights = (tuple(s) for s in input_shapes)
    if len(v) < 1:
        raise OpInputError("kha::MLPValue: v must have at least one dimension (..., d); got a scalar.")
    d = v[-1]
    for name, w in zip(("w_up", "w_gate", "w_down"), weights):
        if len(w) != 2:
            raise OpInputError(f"kha::MLPValue: {name} must be a (d, d) matrix; got shape {w}.")
        known = [x for x in (d, *w) if x is not None]
        if any(x != known[0] for x in known):
            raise OpInputError(
                f"kha::MLPValue: {name} has shape {w} but v has shape {v}; each "
                f"weight must be ({d}, {d}) to match v's last dimension."
            )
    return v


def mlp_value_output_dtype(dtypes: Sequence[str]) -> str:
    """Output type of ``kha::MLPValue`` from its four input types ("float32", "float16", "bfloat16").

    All four must be the same floating type. Raises :class:`~kha_compile.core.errors.OpInputError`.

    Example::

        mlp_value_output_dtype(["float16"] * 4)    # 'float16'
    """
    if len(dtypes) != 4:
        raise OpInputError(f"kha::MLPValue takes 4 inputs; got {len(dtypes)} types.")
    if dtypes[0] not in PLUGIN_DTYPE_NAMES:
        raise OpInputError(f"kha::MLPValue supports {', '.join(PLUGIN_DTYPE_NAMES)}; v is {dtypes[0]}.")
    if any(t != dtypes[0] for t in dtypes):
        raise OpInputError(f"kha::MLPValue: all inputs must share one type; got {list(dtypes)}.")
    return dtypes[0]


# --------------------------------------------------------------------------------------------
# Backend check, plugin registration
# --------------------------------------------------------------------------------------------


def import_tensorrt() -> Any:
    """``tensorrt`` (with ``tensorrt.plugin``), after checking for it and for an NVIDIA GPU."""
    missing = []
    trt: Any = None
    try:
        import tensorrt

        trt = tensorrt
        import tensorrt.plugin
    except ImportError as e:
        found = f" (found tensorrt {trt.__version__}, which has no tensorrt.plugin)" if trt else ""
        missing.append(f"the `tensorrt` Python package, version >= 10.7{found} ({e})")
        trt = None
    if not torch.cuda.is_available():
        missing.append(
            f"an NVIDIA GPU visible to PyTorch (torch {torch.__version__}, CUDA build: "
            f"{torch.version.cuda or 'none'}; torch.cuda.is_available() is False)"
        )
    if missing:
        raise BackendUnavailableError(
            "TensorRT export and inference need " + " and ".join(missing) + ", which this machine "
            "lacks. " + _INSTALL_HINT
        )
    return trt


_PLUGIN_REGISTERED = False
_AOT_REGISTERED = False


def aot_registered() -> bool:
    """True once the plugin's ahead-of-time implementation is registered in this process.

    Example::

        register_mlp_value_plugin();  aot_registered()    # True with TensorRT >= 10.10 and Triton
    """
    return _AOT_REGISTERED


def register_mlp_value_plugin() -> None:
    """Register the ``kha::MLPValue`` TensorRT plugin (``tensorrt.plugin``) in this process; idempotent.

    Needed before parsing an ONNX file with MLP-value nodes and before loading an engine built
    with its JIT implementation. Without it, TensorRT's parser falls back to the node's ONNX
    function body. Registers the AOT implementation too where TensorRT has ``aot_impl`` and
    Triton is installed.

    Example::

        register_mlp_value_plugin()
        engine = trt.Runtime(logger).deserialize_cuda_engine(blob)
    """
    global _PLUGIN_REGISTERED, _AOT_REGISTERED
    if _PLUGIN_REGISTERED:
        return
    trt = import_tensorrt()
    import tensorrt.plugin as trtp

    dtype_names = {trt.DataType.FLOAT: "float32", trt.DataType.HALF: "float16", trt.DataType.BF16: "bfloat16"}
    kernel = _mlp_value_kernel()

    def known_dims(desc: Any) -> tuple[int | None, ...]:
        dims = []
        for expr in desc.shape_expr:
            dims.append(expr.constant_value() if not expr.is_fake and expr.is_constant else None)
        return tuple(dims)

    @trtp.register(PLUGIN_ID)
    def mlp_value_desc(
        v: trtp.TensorDesc, w_up: trtp.TensorDesc, w_gate: trtp.TensorDesc, w_down: trtp.TensorDesc
    ) -> trtp.TensorDesc:
        descs = (v, w_up, w_gate, w_down)
        mlp_value_output_shape([known_dims(t) for t in descs])
        mlp_value_output_dtype([dtype_names.get(t.dtype, str(t.dtype)) for t in descs])
        return v.like()  # (..., d), v's type

    @trtp.autotune(PLUGIN_ID)
    def mlp_value_autotune(v, w_up, w_gate, w_down, outputs):
        types = "FP32|FP16|BF16"  # all five I/O share one type
        return [trtp.AutoTuneCombination(", ".join([types] * 5), "LINEAR")]

    @trtp.impl(PLUGIN_ID)
    def mlp_value_impl(v, w_up, w_gate, w_down, outputs, stream) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            tv = torch.as_tensor(v, device="cuda")  # (..., d)
            weights = [torch.as_tensor(w, device="cuda") for w in (w_up, w_gate, w_down)]
            out = torch.as_tensor(outputs[0], device="cuda")
            d = tv.shape[-1]
            y = kernel(tv.reshape(-1, d), *weights)  # (M, d)
            out.copy_(y.reshape(out.shape))

    _PLUGIN_REGISTERED = True
    log.info("registered TensorRT plugin %s (JIT, kernel %s)", PLUGIN_ID, kernel.__name__)
    if not hasattr(trtp, "aot_impl"):
        log.info(
            "this TensorRT (%s) has no tensorrt.plugin.aot_impl (>= 10.10): %s runs JIT only",
            getattr(trt, "__version__", "?"),
            PLUGIN_ID,
        )
        return
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        log.info("Triton is not installed: %s has no AOT implementation and runs JIT", PLUGIN_ID)
        return

    register_mlp_value_aot_impl(trt, trtp, PLUGIN_ID)
    _AOT_REGISTERED = True


def _mlp_value_kernel() -> Callable:
    """``kernel(v, w_up, w_gate, w_down)`` for v (M, d): the Triton forward where it takes (d, dtype)."""

    try:
        available = triton_available()
    except ImportError:
        available = False
    if not available:
        log.info("the Triton MLP-value kernel is not available: the TensorRT plugin computes MLP-value with torch")
        return mlp_value_reference

    def mlp_value_kernel(v, w_up, w_gate, w_down):
        if triton_supports(v.shape[-1], v.dtype):
            return mlp_value_triton_forward(v, w_up, w_gate, w_down)
        return mlp_value_reference(v, w_up, w_gate, w_down)

    return mlp_value_kernel
