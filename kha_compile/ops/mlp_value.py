"""``kha::mlp_value``: V~ = 2 * ((V W_up) * sigmoid(V W_gate)) W_down over the last axis of V.

One op for eager, torch.compile, torch.export and ONNX: graphs keep it as a single node.
Under ``torch.autocast`` it follows autocast the way ``matmul`` does: its floating inputs are cast to the
autocast dtype (bf16 or fp16) and it runs in that dtype (gradients of fp32 master weights come back in
fp32 through the casts). Outside autocast, mixed dtypes are refused, never silently cast.
On CUDA tensors it runs the fused Triton kernels of :mod:`kha_compile.kernels.mlp_value` (forward,
and backward through ``kha::mlp_value_backward``) when triton is installed and the shape is one they
take (d <= 128; fp32, bf16, fp16); otherwise, and on every other device, the composite formula. Where
the GPU suite measured torch.compile of the formula faster on a GPU (or ``KHA_MLP_VALUE_PATH`` says
so), it runs that instead (:mod:`kha_compile.ops.mlp_value_path`).

Example::

    y = torch.ops.kha.mlp_value(v, w_up, w_gate, w_down)        # v: (..., d), weights (d, d)
    gv, gu, gg, gd = torch.ops.kha.mlp_value_backward(grad_y, v, w_up, w_gate, w_down)
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..core.errors import OpInputError
from ..kernels import mlp_value as kernels
from ..kernels.mlp_value import is_triton_build_error
from .mlp_value_path import compiled_formula, mlp_value_path

__all__ = [
    "autocast_device_types",
    "check_mlp_value_inputs",
    "mlp_value",
    "mlp_value_auto",
    "mlp_value_backward",
    "mlp_value_backward_reference",
    "mlp_value_reference",
]

logger = logging.getLogger(__name__)


def check_mlp_value_inputs(v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor) -> None:
    """Raise OpInputError unless the weights are (d, d) with d = v.shape[-1], all of v's dtype/device."""
    if v.dim() < 1:
        raise OpInputError("kha::mlp_value: v must have at least one dimension (..., d); got a scalar.")
    d = v.shape[-1]
    for name, w in (("w_up", w_up), ("w_gate", w_gate), ("w_down", w_down)):
        if w.dim() != 2 or w.shape[0] != d or w.shape[1] != d:
            raise OpInputError(
                f"kha::mlp_value: {name} has shape {tuple(w.shape)}, but v has shape {tuple(v.shape)}; "
                f"each weight must be ({d}, {d}) to match v's last dimension."
            )
        if w.dtype != v.dtype:
            raise OpInputError(
                f"kha::mlp_value: {name} is {w.dtype} but v is {v.dtype}; cast them to one dtype "
                "(model.to(dtype) casts the KHA weights with the model), or run the model under "
                "torch.autocast, which casts both to its dtype."
            )
        if w.device != v.device:
            raise OpInputError(
                f"kha::mlp_value: {name} is on {w.device} but v is on {v.device}; move them to one device."
            )


def mlp_value_reference(v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor) -> Tensor:
    """The composite formula, in plain torch ops (the op's reference and its decomposition).

    Written ``(v W_up) * (2 sigmoid(v W_gate))``: the same products as ``2 (v W_up) sigmoid(v W_gate)``
    (scaling by 2 is exact), and autograd then scales the gradient of ``v W_up`` by ``2 sigmoid = 1``
    at init instead of halving it first, which loses fp16 subnormals: identity at init stays exact
    in backward too.
    """
    return ((v @ w_up) * (2.0 * torch.sigmoid(v @ w_gate))) @ w_down


def _plain_eager(v: Tensor) -> bool:
    """True for a plain tensor off CUDA in eager mode: no tracing, no fake or sharded tensor, no mode.

    There the op's kernel is the composite formula anyway, and autograd of the formula saves the
    gate activations instead of recomputing them: the faster exact path (the same numbers as KHA
    written by hand). Everywhere else (CUDA: the fused Triton kernels; torch.compile, torch.export,
    ONNX: one node; DTensor: its sharding rule; FLOP counting: its formula) the op runs.
    """
    return (
        type(v) is Tensor
        and v.device.type != "cuda"
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
    )


def mlp_value_auto(v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor) -> Tensor:
    """The MLP-value transform by its fastest exact path: ``kha::mlp_value`` where it pays, else the formula.

    In plain eager mode off CUDA (see :func:`_plain_eager`) it is autograd of
    :func:`mlp_value_reference`, with the op's input checks outside autocast and autocast's own
    casts inside it (the same numbers the op gives). Everywhere else it is the op. What KHA's
    MLP-value transform modules call.

    Example::

        y = mlp_value_auto(v, w_up, w_gate, w_down)      # v: (..., d)
    """
    if not _plain_eager(v):
        return torch.ops.kha.mlp_value(v, w_up, w_gate, w_down)
    if not torch.is_autocast_enabled(v.device.type):
        check_mlp_value_inputs(v, w_up, w_gate, w_down)
    return mlp_value_reference(v, w_up, w_gate, w_down)


@torch.library.custom_op("kha::mlp_value", mutates_args=())
def mlp_value(v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor) -> Tensor:
    """Fused MLP-value transform over the last axis of ``v`` (..., d); weights are (d, d).

    Example::

        y = torch.ops.kha.mlp_value(v, w_up, w_gate, w_down)
    """
    check_mlp_value_inputs(v, w_up, w_gate, w_down)
    return mlp_value_reference(v, w_up, w_gate, w_down)


@mlp_value.register_fake
def _(v, w_up, w_gate, w_down):
    check_mlp_value_inputs(v, w_up, w_gate, w_down)
    return torch.empty_like(v)


def mlp_value_backward_reference(
    grad: Tensor,
    v: Tensor,
    w_up: Tensor,
    w_gate: Tensor,
    w_down: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients (v, w_up, w_gate, w_down) of ``mlp_value`` in plain torch ops (differentiable).

    Recomputes the gate activations from v instead of saving them: two (M, d) tensors fewer in memory.
    """
    d = v.shape[-1]
    v2 = v.reshape(-1, d)  # (M, d)
    g2 = grad.reshape(-1, d)  # (M, d)
    a = v2 @ w_up
    s = torch.sigmoid(v2 @ w_gate)
    h = 2.0 * a * s  # (M, d)
    grad_h = g2 @ w_down.t()
    grad_a = grad_h * (2.0 * s)
    grad_g = grad_h * (h * (1.0 - s))
    grad_v = grad_a @ w_up.t() + grad_g @ w_gate.t()
    return grad_v.reshape(v.shape), v2.t() @ grad_a, v2.t() @ grad_g, h.t() @ g2


@torch.library.custom_op("kha::mlp_value_backward", mutates_args=())
def mlp_value_backward(
    grad: Tensor,
    v: Tensor,
    w_up: Tensor,
    w_gate: Tensor,
    w_down: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients (grad_v, grad_w_up, grad_w_gate, grad_w_down) of ``kha::mlp_value`` for output grad ``grad``.

    Example::

        gv, gu, gg, gd = torch.ops.kha.mlp_value_backward(grad_y, v, w_up, w_gate, w_down)
    """
    _check_backward_inputs(grad, v, w_up, w_gate, w_down)
    return mlp_value_backward_reference(grad, v, w_up, w_gate, w_down)


def _check_backward_inputs(grad: Tensor, v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor) -> None:
    check_mlp_value_inputs(v, w_up, w_gate, w_down)
    if grad.shape != v.shape or grad.dtype != v.dtype or grad.device != v.device:
        raise OpInputError(
            f"kha::mlp_value_backward: grad has shape {tuple(grad.shape)} ({grad.dtype}, {grad.device}), "
            f"but v has shape {tuple(v.shape)} ({v.dtype}, {v.device}); they must match."
        )


@mlp_value_backward.register_fake
def _(grad, v, w_up, w_gate, w_down):
    _check_backward_inputs(grad, v, w_up, w_gate, w_down)
    return torch.empty_like(v), torch.empty_like(w_up), torch.empty_like(w_gate), torch.empty_like(w_down)


# --------------------------------------------------------------------------------------------------
# CUDA: the fused Triton kernels (imported on first call), the composite formula where they do not apply
# --------------------------------------------------------------------------------------------------
_TRITON_BROKEN: set[tuple[str, int, torch.dtype]] = set()  # launches whose kernels failed to build here


def _use_triton(kind: str, v: Tensor) -> bool:

    d = v.shape[-1]
    return (
        (kind, d, v.dtype) not in _TRITON_BROKEN
        and kernels.triton_supports(d, v.dtype)
        and kernels.triton_available()
        and kernels.launch_supported(kind, d, v.dtype, kernels.capability(v.device))
    )


def _run_triton(kind: str, v: Tensor, launch):
    """``launch()``, or None if Triton cannot build the kernel here (warned once; the composite runs).

    Only build-time failures (compile errors, not enough shared memory for any config, e.g. under
    another triton version) fall back; any other error propagates.
    """

    try:
        return launch()
    except Exception as e:
        if not is_triton_build_error(e):
            raise
        _TRITON_BROKEN.add((kind, v.shape[-1], v.dtype))
        logger.warning(
            "kha::mlp_value: the Triton %s kernel for d=%d, %s could not be built here (%s: %s); "
            "using the unfused composite for it from now on.",
            kind,
            v.shape[-1],
            v.dtype,
            type(e).__name__,
            e,
        )
        return None


_COMPILE_BROKEN: set[str] = set()  # directions whose compiled formula failed to build here


def _run_compiled(direction: str, fn, *args):
    """The formula ``fn`` compiled by torch.compile (the path recorded as faster than the kernels); the
    eager formula if it cannot be compiled here (warned once)."""
    if direction not in _COMPILE_BROKEN:
        try:
            return compiled_formula(fn)(*args)
        except torch._dynamo.exc.TorchDynamoException as e:
            _COMPILE_BROKEN.add(direction)
            logger.warning(
                "kha::mlp_value: torch.compile of the %s formula failed here (%s: %s); using the eager formula.",
                direction,
                type(e).__name__,
                e,
            )
    return fn(*args)


def _mlp_value_cuda(v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor) -> Tensor:
    check_mlp_value_inputs(v, w_up, w_gate, w_down)
    path = mlp_value_path("forward", v)
    if path == "compiled":
        return _run_compiled("forward", mlp_value_reference, v, w_up, w_gate, w_down)
    if path == "kernel" and _use_triton("forward", v):
        d = v.shape[-1]
        y = _run_triton(
            "forward", v, lambda: kernels.mlp_value_triton_forward(v.reshape(-1, d), w_up, w_gate, w_down)
        )  # (M, d)
        if y is not None:
            return y.reshape(v.shape)
    return mlp_value_reference(v, w_up, w_gate, w_down)


def _mlp_value_backward_cuda(
    grad: Tensor,
    v: Tensor,
    w_up: Tensor,
    w_gate: Tensor,
    w_down: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_backward_inputs(grad, v, w_up, w_gate, w_down)
    path = mlp_value_path("backward", v)
    if path == "compiled":
        return _run_compiled("backward", mlp_value_backward_reference, grad, v, w_up, w_gate, w_down)
    if path == "kernel" and _use_triton("backward", v):
        d = v.shape[-1]
        out = _run_triton(
            "backward",
            v,
            lambda: kernels.mlp_value_triton_backward(grad.reshape(-1, d), v.reshape(-1, d), w_up, w_gate, w_down),
        )
        if out is not None:
            gv, gu, gg, gd = out
            return gv.reshape(v.shape), gu, gg, gd
    return mlp_value_backward_reference(grad, v, w_up, w_gate, w_down)


mlp_value.register_kernel("cuda")(_mlp_value_cuda)
mlp_value_backward.register_kernel("cuda")(_mlp_value_backward_cuda)


# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    v, w_up, w_gate, w_down = ctx.saved_tensors
    if torch.is_grad_enabled():
        # create_graph=True (double backward): the composite formula is differentiable, the op is not.
        return mlp_value_backward_reference(grad, v, w_up, w_gate, w_down)
    return torch.ops.kha.mlp_value_backward(grad, v, w_up, w_gate, w_down)


mlp_value.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# Autocast: cast to the autocast dtype of the moment, as matmul does (torch.library.register_autocast
# takes one fixed dtype; bf16 and fp16 regions both need to work)
# --------------------------------------------------------------------------------------------------
_AUTOCAST_LIB = torch.library.Library("kha", "IMPL")  # kept alive for the registrations below


def _cast_for_autocast(t: Tensor, device_type: str, dtype: torch.dtype) -> Tensor:
    """``t`` in the autocast dtype, if autocast would cast it for a matmul (floating, on that device, not fp64)."""
    eligible = t.is_floating_point() and t.device.type == device_type and t.dtype != torch.float64
    return t.to(dtype) if eligible else t


def _register_autocast(device_type: str) -> None:
    """Register the Autocast<Device> kernel of ``kha::mlp_value``: cast, then run the op below autocast."""
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    below = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor) -> Tensor:
        dtype = torch.get_autocast_dtype(device_type)
        args = (_cast_for_autocast(t, device_type, dtype) for t in (v, w_up, w_gate, w_down))
        with torch._C._ExcludeDispatchKeyGuard(below):
            return torch.ops.kha.mlp_value.default(*args)

    _AUTOCAST_LIB.impl("mlp_value", kernel, key)


def autocast_device_types() -> tuple[str, ...]:
    """The device types whose autocast casts ``kha::mlp_value``'s inputs (every one torch has autocast for).

    Example::

        "cpu" in autocast_device_types()      # True
    """
    return tuple(d for d in ("cpu", "cuda", "xpu", "mps") if torch.amp.is_autocast_available(d))


for _device in autocast_device_types():
    _register_autocast(_device)
