"""Which path ``kha::mlp_value`` takes on a CUDA GPU: the fused Triton kernels or the formula compiled by torch.compile.

The Triton kernels are the default. Where ``benchmarks/gpu_suite.py`` measured torch.compile of the
formula faster than the kernels on a GPU (per direction, padded head size and dtype), it prints the
entry to add to :data:`RECORDED`, and the op runs the compiled formula there. The environment variable
``KHA_MLP_VALUE_PATH`` overrides both: ``kernel``, ``compiled``, ``formula`` (the eager composite), or
``auto`` (the default: the recorded choice, else the kernels).

Example::

    # KHA_MLP_VALUE_PATH=compiled python train.py   -> every CUDA call of the op runs the compiled formula
    mlp_value_path("forward", v)                    # "kernel" unless recorded or overridden
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
from torch import Tensor

from ..core.errors import KHAConfigError
from ..kernels.configs import padded_d

__all__ = ["ENV", "PATHS", "RECORDED", "compiled_formula", "mlp_value_path", "recorded_key"]

ENV = "KHA_MLP_VALUE_PATH"
PATHS = ("kernel", "compiled", "formula")
# (GPU name as torch.cuda.get_device_name gives it, "forward"/"backward", padded d, dtype) -> path,
# for the cases where the GPU suite measured the compiled formula faster than the kernels. Empty
# until a GPU run shows such a case (benchmarks/results/gpu_suite_<device>.txt prints the entries).
RECORDED: dict[tuple[str, str, int, str], str] = {}


def recorded_key(direction: str, device_name: str, d: int, dtype: torch.dtype) -> tuple[str, str, int, str]:
    """The :data:`RECORDED` key of a call: (GPU name, direction, padded d, dtype name).

    Example::

        recorded_key("forward", "NVIDIA H200", 100, torch.bfloat16)   # ("NVIDIA H200", "forward", 128, "bfloat16")
    """
    return device_name, direction, padded_d(d), str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=8)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def mlp_value_path(direction: str, v: Tensor) -> str:
    """The path (one of :data:`PATHS`) of the op's ``direction`` ("forward"/"backward") for CUDA tensor ``v``.

    Raises KHAConfigError when ``KHA_MLP_VALUE_PATH`` holds something else than a path or ``auto``.

    Example::

        mlp_value_path("backward", v)     # "kernel", "compiled" or "formula"
    """
    chosen = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if chosen in PATHS:
        return chosen
    if chosen != "auto":
        raise KHAConfigError(
            f"{ENV}={os.environ[ENV]!r} is not a path of kha::mlp_value; set it to one of "
            f"{', '.join(PATHS)} or auto (the recorded choice per GPU), or unset it."
        )
    if not RECORDED:
        return "kernel"
    index = v.device.index if v.device.index is not None else torch.cuda.current_device()
    return RECORDED.get(recorded_key(direction, _device_name(index), v.shape[-1], v.dtype), "kernel")


@functools.lru_cache(maxsize=4)
def compiled_formula(fn: Callable[..., object]) -> Callable[..., object]:
    """torch.compile of the formula ``fn``, made once (dynamic shapes: one compile per dtype and device).

    Example::

        y = compiled_formula(mlp_value_reference)(v, w_up, w_gate, w_down)
    """
    return torch.compile(fn, dynamic=True)
