"""Ahead-of-time (AOT) TensorRT implementation of the ``kha::MLPValue`` plugin, from the Triton kernels.

``tensorrt.plugin.aot_impl`` asks for the kernel's name, its PTX, the launch parameters
(``KernelLaunchParams``: grid, block, shared memory) and the scalar arguments as symbolic expressions
(``SymIntExprs`` of ``SymInt32``). TensorRT then embeds the kernel in the engine, so the engine runs
in ``trtexec`` and the C++ runtime without Python. TensorRT launches the kernel with the input
pointers, then the scalar arguments, then the output pointers (and null for arguments it was not
given: the two scratch pointers Triton appends, unused while their sizes are 0, which is checked).

The kernel is the forward of :mod:`kha_compile.kernels.mlp_value` (``_fwd``) behind a wrapper in that
argument order (``_fwd_plugin``), compiled with :func:`kha_compile.kernels.aot.compile_kernel` in the
first shipped autotune config that builds for the GPU's architecture without spilling. Everything
but the registration is a plain function: the compiled kernel (:func:`plugin_kernel`), the extents
(:func:`plugin_extents`: M rows of d), the grid as a function of M (:func:`launch_grid`, with ints,
sympy or TensorRT's shape expressions), the argument order (:data:`PLUGIN_ARGS`) and the ONNX marking
that tells TensorRT's parser to use the AOT implementation (:func:`mark_aot_nodes`).

Example::

    k = plugin_kernel("fp16", 64, "sm_90")
    M, d = plugin_extents((2, 8, 128, 64))           # 2048 rows of 64
    launch_grid(M, k.block_m)                         # (32, 1, 1)
"""

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..core.errors import KernelCompileError, OpInputError
from ..kernels.aot import KernelVariant, compile_kernel, kernel_variants
from .onnx import MLP_VALUE_OP, PLUGIN_NAMESPACE

__all__ = [
    "PLUGIN_ARGS",
    "PLUGIN_DTYPES",
    "PluginKernel",
    "launch_grid",
    "mark_aot_nodes",
    "plugin_extents",
    "plugin_kernel",
    "register_mlp_value_aot_impl",
]

log = logging.getLogger(__name__)

# The kernel's runtime arguments in launch order: TensorRT's (inputs..., scalars..., outputs...).
PLUGIN_ARGS = ("v", "w_up", "w_gate", "w_down", "M", "y")
PLUGIN_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class PluginKernel:
    """The compiled AOT kernel of one (dtype, head size, arch) and how to launch it."""

    name: str
    ptx: str
    dtype: str
    head_dim: int
    arch: str
    block_m: int
    num_warps: int
    shared_bytes: int
    config: dict[str, Any]

    @property
    def block(self) -> tuple[int, int, int]:
        """Threads per program: (32 * num_warps, 1, 1)."""
        return (32 * self.num_warps, 1, 1)


def plugin_extents(v_shape: Sequence[Any]) -> tuple[Any, Any]:
    """(M, d) of ``v`` (..., d): M the product of the leading dims. Dims may be ints or symbolic.

    Works on ints, sympy expressions and TensorRT's ``ShapeExpr`` alike (only ``*`` is used).

    Example::

        plugin_extents((2, 8, 128, 64))    # (2048, 64)
    """
    if len(v_shape) < 1:
        raise OpInputError("kha::MLPValue: v must have at least one dimension (..., d); got a scalar.")
    *lead, d = v_shape
    M: Any = 1
    for i, dim in enumerate(lead):
        M = dim if i == 0 else M * dim
    return M, d


def _cdiv(a: Any, b: int) -> Any:
    if isinstance(a, int):
        return -(-a // b)
    return (a + (b - 1)) // b  # sympy, or any expression with + and //


def launch_grid(M: Any, block_m: int, cdiv: Callable[[Any, int], Any] | None = None) -> tuple[Any, int, int]:
    """Programs to launch for M rows: (ceil(M / block_m), 1, 1), one row tile each.

    ``cdiv`` divides symbolically (``tensorrt.plugin.cdiv`` for TensorRT); by default ints divide
    exactly and other expressions use ``(M + block_m - 1) // block_m``.

    Example::

        launch_grid(1000, 64)    # (16, 1, 1)
    """
    return ((cdiv or _cdiv)(M, block_m), 1, 1)


@functools.lru_cache(maxsize=64)
def plugin_kernel(dtype: str, head_dim: int, arch: str) -> PluginKernel:
    """Compile the plugin's kernel for ``dtype`` ("fp32"/"fp16"/"bf16" or torch-style names), d and arch.

    Tries the shipped forward configs in order and keeps the first that builds, fits the
    architecture's shared memory and does not spill. Raises :class:`KernelCompileError` when none
    does (or d is outside 1..128), :class:`~kha_compile.core.errors.BackendUnavailableError` without Triton.

    Example::

        k = plugin_kernel("bf16", 128, "sm_90");  k.name, k.block_m, k.shared_bytes
    """

    dtype = PLUGIN_DTYPES.get(dtype, dtype)
    candidates = kernel_variants([dtype], [head_dim], ["fwd"], arch)
    if not candidates:
        raise KernelCompileError(
            f"the MLP-value kernels take head sizes 1..128 (fp32: 1..64); got d={head_dim} in {dtype}."
        )
    reasons = []
    for cand in candidates:
        variant = KernelVariant("fwd_plugin", dtype, head_dim, cand.block_m, None, cand.num_warps, cand.num_stages)
        try:
            k = compile_kernel(variant, arch)
        except KernelCompileError as e:
            reasons.append(str(e))
            continue
        if k.record.spills:
            reasons.append(f"{variant.config}: spills {k.record.spills} B")
            continue
        log.info(
            "MLP-value AOT kernel for %s, d=%d, %s: %s (%d registers, %d B shared)",
            dtype,
            head_dim,
            arch,
            variant.config,
            k.record.registers,
            k.shared_bytes,
        )
        return PluginKernel(
            k.name, k.ptx, dtype, head_dim, arch, variant.block_m, k.num_warps, k.shared_bytes, variant.config
        )
    raise KernelCompileError(
        f"no forward config of the MLP-value kernel builds for {arch} ({dtype}, d={head_dim}) "
        f"without spilling: {'; '.join(reasons)}"
    )


def mark_aot_nodes(model: Any, max_d: int = 128) -> int:
    """Set ``aot=1`` on the ``kha::MLPValue`` nodes the AOT kernel takes; returns how many it marked.

    TensorRT's ONNX parser uses a plugin's AOT implementation for a node that carries a true
    ``aot`` attribute, and its JIT ``impl`` otherwise. A node is marked when its head size (from
    the ``w_up`` initializer, (d, d)) is at most ``max_d``; others stay JIT. ``model`` is an ONNX
    ``ModelProto``, changed in place.

    Example::

        model = onnx.load("m.onnx");  mark_aot_nodes(model)    # 2
    """
    import onnx

    dims = {init.name: tuple(init.dims) for init in model.graph.initializer}
    count = 0
    for node in model.graph.node:
        if node.op_type != MLP_VALUE_OP:
            continue
        if not any(a.name == "plugin_namespace" and a.s.decode() == PLUGIN_NAMESPACE for a in node.attribute):
            continue
        w = dims.get(node.input[1]) if len(node.input) > 1 else None
        if w is None or len(w) != 2 or not 1 <= w[0] <= max_d:
            log.info(
                "MLPValue node %r: head size %s, not taken by the AOT kernel (d <= %d); it stays JIT",
                node.name,
                w[0] if w else "unknown",
                max_d,
            )
            continue
        kept = [a for a in node.attribute if a.name != "aot"]
        del node.attribute[:]
        node.attribute.extend([*kept, onnx.helper.make_attribute("aot", 1)])
        count += 1
    return count


# --------------------------------------------------------------------------------------------------
# Registration (needs tensorrt.plugin)
# --------------------------------------------------------------------------------------------------
def _constant(expr: Any) -> int | None:
    if getattr(expr, "is_fake", False) or not getattr(expr, "is_constant", False):
        return None
    return int(expr.constant_value())


def _current_arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def register_mlp_value_aot_impl(trt: Any, trtp: Any, plugin_id: str) -> None:
    """Register ``tensorrt.plugin.aot_impl`` for the MLP-value plugin (its descriptor must be registered).

    The kernel is compiled for the GPU TensorRT builds on (``torch.cuda.get_device_capability``).

    Example::

        register_mlp_value_aot_impl(tensorrt, tensorrt.plugin, "kha::MLPValue")
    """
    dtype_names = {trt.DataType.FLOAT: "fp32", trt.DataType.HALF: "fp16", trt.DataType.BF16: "bf16"}

    @trtp.aot_impl(plugin_id)
    def mlp_value_aot_impl(v, w_up, w_gate, w_down, outputs, tactic):
        dims = [v.shape_expr[i] for i in range(v.ndim)]
        M, d_expr = plugin_extents(dims)
        d = _constant(d_expr)
        if d is None:
            raise OpInputError(
                "kha::MLPValue AOT plugin: the head size (v's last dim) must be known when "
                "the engine is built; export the model with a fixed head size."
            )
        dtype = dtype_names.get(v.dtype)
        if dtype is None:
            raise OpInputError(f"kha::MLPValue AOT plugin: unsupported type {v.dtype}.")
        kernel = plugin_kernel(dtype, d, _current_arch())
        params = trtp.KernelLaunchParams()  # y and z of grid and block stay 1
        params.grid_x = launch_grid(M, kernel.block_m, cdiv=trtp.cdiv)[0]
        params.block_x = kernel.block[0]
        params.shared_mem = kernel.shared_bytes
        extra_args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(M)])  # the scalars, in PLUGIN_ARGS order
        return kernel.name.encode(), kernel.ptx.encode(), params, extra_args

    log.info("registered the AOT implementation of TensorRT plugin %s (Triton kernel, PTX)", plugin_id)
