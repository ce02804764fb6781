"""Fused Triton kernels for the MLP-value transform ``y = 2 * ((v W_up) * sigmoid(v W_gate)) W_down``.

``v`` is (M, d) and the three weights are (d, d), d <= 128. Triton is imported on first use, and the
kernels are built on first use too (so ``TRITON_INTERPRET=1`` set by a test before that call works).

Example::

    from kha_compile.kernels import mlp_value_triton, triton_available
    if triton_available():
        y = mlp_value_triton(v, w_up, w_gate, w_down)          # v: (M, d) on CUDA, bf16/fp16/fp32
        y.sum().backward()                                      # runs the fused backward below

Forward (one kernel, persistent over row tiles)
    Each program loads W_up, W_gate and W_down once (3 x 32 KiB at d = 128 in bf16) and walks its row
    tiles: one load of the V tile (BLOCK_M, D); ``a = V W_up`` and ``g = V W_gate`` (two ``tl.dot``
    in the same loop body, fp32 accumulators); ``h = 2 a sigmoid(g)`` in registers, rounded once to
    the input dtype; ``y = h W_down``; one store. HBM traffic: read V, write y, the weights once per
    program. At d = 128 (bf16) that is 192 FLOP per byte, about the H100/H200 ridge point, so the
    kernel sits between the bandwidth and the tensor-core roofs; BLOCK_M / warps / stages are
    autotuned on the GPU. The gate's sigmoid is four PTX instructions on the GPU (ex2 and rcp
    approximations, denormals flushed: the same values as ``tl.exp`` and ``/`` without their range
    checks), a third of the element-wise instructions. At d <= 64 up to 4 programs share an SM (their
    weights take <= 24 KiB), at d = 128 one does (96 KiB of weights), with BLOCK_M x stages rows in flight.

Backward (a fused kernel for d <= 64; a FlashAttention-2 style split into two launches above that)
    With ``s = sigmoid(g)``, ``h = 2 a s`` and G the output gradient::

        grad_h = G W_down^T
        grad_a = 2 s grad_h                    grad_g = h (1 - s) grad_h
        grad_v = grad_a W_up^T + grad_g W_gate^T
        dW_up = V^T grad_a     dW_gate = V^T grad_g     dW_down = h^T G

    Nothing is saved from the forward but V: one kernel body (``_bwd``) recomputes a, g, s, h from
    the V tile in registers. The three weight gradients are sums over all M rows, so each program
    keeps fp32 accumulators while it walks its row tiles, writes them once to a workspace
    (P, 3, d, d), and a sum over P (a second, tiny reduction) finishes them: deterministic, no atomics.

    * d <= 64: one launch does everything: grad_v per row tile (8 ``tl.dot`` per tile) plus the three
      accumulators (3 x d x d fp32, at most 48 KiB per program).
    * d > 64 (padded to 128): the three full accumulators would be 192 KiB per program, more than the register file
      can hold next to the tiles. So, like FlashAttention-2's separate dQ pass: launch 1 walks row
      tiles and writes grad_v only (5 dots, no accumulators); launch 2 has a program per (column
      block nb of BLOCK_N, row group) that accumulates ``dW_up[:, nb]``, ``dW_gate[:, nb]`` and
      ``dW_down[nb, :]``. Blocking over columns recomputes nothing element-wise (``grad_a[:, nb]``,
      ``grad_g[:, nb]`` and ``h[:, nb]`` need only ``a[:, nb]``, ``g[:, nb]`` and ``grad_h[:, nb]``);
      programs of one row group with adjacent column blocks are launched together, so the second
      read of a V/G tile comes from L2. Cost against the minimum (read V, G; write grad_v): one more
      pass over V and G (mostly from L2) and 3 recomputed GEMMs (11 instead of 8 per row), instead
      of writing and re-reading grad_a, grad_g and h for cuBLAS.

    Row groups P: 2 per SM (persistent); in the split, the column blocks of a row group share them.
    BLOCK_M (and the split's BLOCK_N in {32, 64}) are autotuned on the GPU, from config lists that
    compile for the GPU's architecture within shared memory and without register spills
    (:mod:`kha_compile.kernels.configs`: ``CONFIGS`` less ``LEFT_OUT``, checked with
    :mod:`kha_compile.kernels.aot` for sm_80 and sm_90).
    Below sm_90 the split's grad-v launch at d > 64 (16-bit) cannot fit (five 128 x 128 weight tiles
    on chip); there the op's backward runs the composite formula (cuBLAS), and fp32 runs the kernels
    up to d = 64 only (``triton_supports``).

Precision: operands of every ``tl.dot`` are in the input dtype (tensor cores), accumulation in fp32,
the element-wise gate math in fp32; h, grad_a and grad_g are rounded (to nearest even) to the input
dtype before they feed a GEMM, as an eager bf16 computation would, and the weight gradients are
summed in fp32 and rounded once. fp32 inputs use full-precision dots (FMA units, slow: fp32 is for
checking, bf16/fp16 for speed) unless ``torch.backends.cuda.matmul.allow_tf32`` is on (then TF32,
like cuBLAS).

Interpreter notes (triton 3.8/3.9, ``TRITON_INTERPRET=1``): the interpreter keeps bf16 as raw uint16
bits, and ``tl.dot`` and arithmetic on bf16 compute on the bit patterns (triton-lang/triton#11584);
its fp32 -> bf16 cast truncates instead of rounding to nearest. So in interpreter mode (constexpr
``UPCAST``) bf16 tiles are widened to fp32 right after each load, and the bf16 rounding points are
done by hand on the fp32 bits (round to nearest even). It also accepts ``tl.dot`` shapes below 16,
which the GPU rejects: every block here is a power of two >= 16 (checked on the host). GPU code
paths are unaffected by all of this.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from typing import Any

import torch
from torch import Tensor

from ..core.errors import OpInputError
from .availability import (
    DTYPES,
    MAX_D,
    MAX_D_FP32,
    interpret_mode,
    is_triton_build_error,
    require_backend,
    triton_available,
    triton_supports,
)
from .configs import CONFIGS, MIN_DOT, capability, config_class, configs_for, launch_supported, padded_d

__all__ = [
    "MAX_D",
    "MAX_D_FP32",
    "capability",
    "config_class",
    "configs_for",
    "is_triton_build_error",
    "launch_supported",
    "mlp_value_triton",
    "mlp_value_triton_backward",
    "mlp_value_triton_forward",
    "padded_d",
    "triton_available",
    "triton_supports",
]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Kernels (built lazily, once per interpreter/compiled mode); their autotuning configs are in configs.py
# --------------------------------------------------------------------------------------------------
# Without autotuning (the interpreter, or explicit block sizes): BLOCK_M, and BLOCK_N of the split.
_DEFAULT_BLOCK_M = 32
_DEFAULT_SPLIT_BLOCK_N = 64


class _KernelSet:
    """The @triton.jit kernels of one mode and, when autotuning, one autotuner per (launch, config class)."""

    def __init__(self, jit: Any, autotune: bool, do_bench: Any = None) -> None:
        self.fwd, self.bwd = jit._fwd, jit._bwd
        self.fwd_plugin = jit._fwd_plugin  # the forward in TensorRT's AOT-plugin argument order
        self.autotune = autotune
        self._do_bench = do_bench
        self._tuners: dict[tuple[str, str, tuple], Any] = {}

    def tuner(self, kind: str, cls: str, configs: list[tuple[int, int | None, int, int]] | None = None) -> Any:
        """The autotuned kernel for launch ``kind`` ("fwd", "fused", "dv", "dw") over ``configs`` (default:
        all of the class), or None when not tuning."""
        if not self.autotune:
            return None
        configs = list(CONFIGS[(kind, cls)] if configs is None else configs)
        key = (kind, cls, tuple(configs))
        if key not in self._tuners:
            import triton

            configs = [
                triton.Config({"BLOCK_M": bm, **({"BLOCK_N": bn} if bn else {})}, num_warps=w, num_stages=st)
                for bm, bn, w, st in configs
            ]
            keys = ["d", "M_BUCKET", "PRECISION"]
            if kind != "fwd":
                keys += ["COMPUTE_DV", "COMPUTE_DW"]
            fn = self.fwd if kind == "fwd" else self.bwd
            self._tuners[key] = triton.autotune(configs, key=keys, do_bench=self._do_bench)(fn)
        return self._tuners[key]


def _build_kernels(interpret: bool, autotune: bool | None = None, do_bench: Any = None) -> _KernelSet:
    """Load the @triton.jit kernels for this mode; autotune them on the GPU (by default).

    ``autotune``/``do_bench`` let a test drive the autotuned launch path in interpreter mode too.
    """
    import importlib.util

    # A fresh module object per mode: the jit decorators read TRITON_INTERPRET when they run.
    name = f"{__package__}._mlp_value_jit_{'interpret' if interpret else 'compiled'}"
    path = os.path.join(os.path.dirname(__file__), "_mlp_value_jit.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a file next to this one
    jit = importlib.util.module_from_spec(spec)
    sys.modules[name] = jit  # triton and inspect look kernels' modules up by name
    spec.loader.exec_module(jit)
    return _KernelSet(jit, autotune=(not interpret) if autotune is None else autotune, do_bench=do_bench)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> _KernelSet:
    return _build_kernels(interpret)


# --------------------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------------------
def _m_bucket(M: int) -> int:
    # Autotuning key: re-tune per power of two of M, not per M (sequence lengths vary).
    return max(0, M - 1).bit_length()


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _max_programs(device: torch.device, per_sm: int = 2) -> int:
    """How many persistent programs to launch: ``per_sm`` per SM on the GPU, a few in the interpreter."""
    if device.type == "cuda":
        return per_sm * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # > 1 (and > 1 row group in the split) so that interpreter tests walk several tiles per program


def _check(name: str, v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor, grad: Tensor | None = None) -> None:
    if v.dim() != 2:
        raise OpInputError(
            f"{name}: v must be 2-D (M, d); got shape {tuple(v.shape)}. Reshape it with v.reshape(-1, d), "
            "or call torch.ops.kha.mlp_value, which takes (..., d)."
        )
    d = v.shape[1]
    if v.dtype not in DTYPES:
        raise OpInputError(
            f"{name}: v of shape {tuple(v.shape)} is {v.dtype}; the Triton kernel takes float32, bfloat16 "
            "or float16 (torch.ops.kha.mlp_value takes any floating dtype)."
        )
    if not 1 <= d <= MAX_D:
        raise OpInputError(
            f"{name}: v has shape {tuple(v.shape)}, d = {d}; the Triton kernel takes 1 <= d <= {MAX_D} "
            "(torch.ops.kha.mlp_value falls back to cuBLAS above that)."
        )
    named = [("w_up", w_up), ("w_gate", w_gate), ("w_down", w_down)]
    if grad is not None:
        named.append(("grad_out", grad))
    for wname, w in named:
        want = tuple(v.shape) if wname == "grad_out" else (d, d)
        if tuple(w.shape) != want:
            raise OpInputError(
                f"{name}: {wname} has shape {tuple(w.shape)}, but v has shape {tuple(v.shape)}; {wname} must be {want}."
            )
        if w.dtype != v.dtype:
            raise OpInputError(f"{name}: {wname} is {w.dtype} but v is {v.dtype}; cast them to one dtype.")
        if w.device != v.device:
            raise OpInputError(f"{name}: {wname} is on {w.device} but v is on {v.device}; move them to one device.")


def _rows(x: Tensor) -> Tensor:
    """x with unit stride along the feature axis (a copy only if needed)."""
    return x if x.stride(1) == 1 else x.contiguous()


def _launch(
    ks: _KernelSet,
    kind: str,
    cls: str,
    grid: Any,
    args: tuple,
    meta: dict,
    block_m: int | None,
    block_n: int | None = None,
) -> None:
    """Launch the autotuned kernel, or the plain one with fixed blocks (explicit sizes or no autotuning).

    ``grid(meta)`` maps the launch's meta-parameters (BLOCK_M, BLOCK_N) to the grid.
    """
    # the configs of the architecture the tensors are on (v is args[0]); all of them in the interpreter
    cc = capability(args[0].device)
    tuner = ks.tuner(kind, cls, configs_for(kind, cls, meta["D"], cc)) if ks.autotune else None
    if tuner is not None and block_m is None and (kind != "dw" or block_n is None):
        # "fwd" has no BLOCK_N; "dw" tunes it; "fused"/"dv" take the whole hidden axis.
        tuner[grid](*args, **meta, **({"BLOCK_N": block_n} if kind in ("fused", "dv") else {}))
        return
    fixed = {"BLOCK_M": block_m or _DEFAULT_BLOCK_M}
    if kind != "fwd":
        fixed["BLOCK_N"] = block_n or _DEFAULT_SPLIT_BLOCK_N
    for k, b in fixed.items():
        _check_block(b, k.lower())
    kernel = ks.fwd if kind == "fwd" else ks.bwd
    kernel[grid(fixed)](*args, **meta, **fixed)


def mlp_value_triton_forward(
    v: Tensor,
    w_up: Tensor,
    w_gate: Tensor,
    w_down: Tensor,
    *,
    block_m: int | None = None,
) -> Tensor:
    """Forward only, no autograd: ``2 * ((v @ w_up) * sigmoid(v @ w_gate)) @ w_down`` for v (M, d).

    ``block_m`` fixes the row tile (a power of two >= 16; default: autotuned on the GPU, 32 in the
    interpreter).

    Example::

        y = mlp_value_triton_forward(v, w_up, w_gate, w_down)   # (M, d)
    """
    _check("mlp_value_triton", v, w_up, w_gate, w_down)
    require_backend(v.device)
    M, d = v.shape
    y = torch.empty((M, d), dtype=v.dtype, device=v.device)
    if M == 0:
        return y
    v = _rows(v)
    w_up, w_gate, w_down = w_up.contiguous(), w_gate.contiguous(), w_down.contiguous()
    interpret = interpret_mode()
    D = padded_d(d)
    meta = dict(d=d, D=D, UPCAST=interpret and v.dtype == torch.bfloat16, PRECISION=_precision(v.dtype))
    args = (v, w_up, w_gate, w_down, y, M, v.stride(0), y.stride(0), _m_bucket(M))
    # up to 4 programs of D <= 64 share an SM (their weights take <= 24 KiB of shared memory); at
    # D = 128 one fits, and the extra programs wait for a free SM (no cost but the tail)
    max_p = _max_programs(v.device, per_sm=4 if D <= 64 else 2)

    def grid(m):  # persistent: at most max_p programs, each walking row tiles
        return (min(_cdiv(M, m["BLOCK_M"]), max_p),)

    with _on_device(v.device):
        _launch(_kernels(interpret), "fwd", config_class("fwd", D, v.dtype), grid, args, meta, block_m)
    return y


def mlp_value_triton_backward(
    grad_out: Tensor,
    v: Tensor,
    w_up: Tensor,
    w_gate: Tensor,
    w_down: Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients (grad_v, grad_w_up, grad_w_gate, grad_w_down) of the forward for v (M, d).

    ``block_n`` picks the backward's shape: ``block_n >= D`` (d padded to a power of two >= 16) runs
    the single fused launch, a smaller power of two (>= 16) the two-launch split with that column
    block. Default: fused for d <= 64, the split above (block autotuned on the GPU, 64 in the
    interpreter); see the module docstring. ``block_m`` fixes the row tile.

    Example::

        gv, gwu, gwg, gwd = mlp_value_triton_backward(grad_y, v, w_up, w_gate, w_down)
    """
    _check("mlp_value_triton_backward", v, w_up, w_gate, w_down, grad=grad_out)
    require_backend(v.device)
    M, d = v.shape
    D = padded_d(d)
    if M == 0:
        z = torch.zeros((d, d), dtype=v.dtype, device=v.device)
        return torch.empty_like(v), z, z.clone(), z.clone()
    v, grad_out = _rows(v), _rows(grad_out)
    w_up, w_gate, w_down = w_up.contiguous(), w_gate.contiguous(), w_down.contiguous()
    fused = (D <= 64) if block_n is None else block_n >= D

    interpret = interpret_mode()
    ks = _kernels(interpret)
    cls = config_class("bwd", D, v.dtype)
    meta = dict(d=d, D=D, UPCAST=interpret and v.dtype == torch.bfloat16, PRECISION=_precision(v.dtype))
    max_p = _max_programs(v.device)
    # Row groups of the weight-gradient launch: fixed here, since the workspace is sized by it; a
    # group without row tiles writes zeros. In the split, column blocks of one row group share a wave.
    P = max(1, min(_cdiv(M, MIN_DOT), max_p if fused else max_p // 2))
    grad_v = torch.empty_like(v)
    ws = torch.empty((P, 3, d, d), dtype=torch.float32, device=v.device)
    args = (
        v,
        grad_out,
        w_up,
        w_gate,
        w_down,
        grad_v,
        ws,
        M,
        v.stride(0),
        grad_out.stride(0),
        grad_v.stride(0),
        _m_bucket(M),
    )

    with _on_device(v.device):
        if fused:
            _launch(ks, "fused", cls, lambda m: (1, P), args, dict(meta, COMPUTE_DV=True, COMPUTE_DW=True), block_m, D)
        else:
            # 1) grad_v per row tile (the whole hidden axis in each program); 2) weight-gradient blocks.
            # (fp32 at D = 128 under TF32 would stage W_up, W_gate and W_down^T in shared memory twice
            # over, 336 KiB: that launch keeps full precision, which fits.)
            dv_meta = dict(meta, COMPUTE_DV=True, COMPUTE_DW=False)
            if v.dtype == torch.float32 and D >= 128:
                dv_meta["PRECISION"] = "ieee"
            _launch(ks, "dv", cls, lambda m: (1, min(_cdiv(M, m["BLOCK_M"]), max_p)), args, dv_meta, block_m, D)
            _launch(
                ks,
                "dw",
                cls,
                lambda m: (D // m["BLOCK_N"], P),
                args,
                dict(meta, COMPUTE_DV=False, COMPUTE_DW=True),
                block_m,
                block_n,
            )
    dw = ws.sum(0).to(v.dtype)  # (3, d, d): the reduction over row groups
    # three tensors of their own: a custom op's outputs may not alias each other (torch checks it on CUDA)
    return grad_v, dw[0].clone(), dw[1].clone(), dw[2].clone()


def _on_device(device: torch.device):
    """Launch context: Triton launches on the current CUDA device, so make it v's."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_block(b: int, name: str) -> None:
    if b < MIN_DOT or b & (b - 1):
        raise OpInputError(f"{name} must be a power of two >= {MIN_DOT} (tl.dot's minimum); got {b}.")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _MLPValueTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, w_up, w_gate, w_down):
        ctx.save_for_backward(v, w_up, w_gate, w_down)
        return mlp_value_triton_forward(v, w_up, w_gate, w_down)

    @staticmethod
    def backward(ctx, grad):
        v, w_up, w_gate, w_down = ctx.saved_tensors
        return mlp_value_triton_backward(grad, v, w_up, w_gate, w_down)


def mlp_value_triton(v: Tensor, w_up: Tensor, w_gate: Tensor, w_down: Tensor) -> Tensor:
    """Fused MLP-value transform of v (M, d) with (d, d) weights, as one Triton kernel; differentiable.

    Raises BackendUnavailableError without triton (or without a GPU and TRITON_INTERPRET=1), and
    OpInputError on shapes/dtypes it does not take (v must be 2-D, d <= 128, fp32/bf16/fp16).

    Example::

        y = mlp_value_triton(v, w_up, w_gate, w_down)   # == 2 * ((v @ w_up) * sigmoid(v @ w_gate)) @ w_down
    """
    _check("mlp_value_triton", v, w_up, w_gate, w_down)
    require_backend(v.device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (v, w_up, w_gate, w_down)):
        return _MLPValueTriton.apply(v, w_up, w_gate, w_down)
    return mlp_value_triton_forward(v, w_up, w_gate, w_down)
