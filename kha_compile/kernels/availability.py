"""Whether the Triton MLP-value kernels can run here, and for which head sizes and dtypes.

triton is optional: it is imported once, when first asked (:func:`triton_available`).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any

import numpy as np
import torch

from ..core.errors import BackendUnavailableError

__all__ = [
    "DTYPES",
    "MAX_D",
    "MAX_D_FP32",
    "import_triton",
    "interpret_mode",
    "interpreter_defect",
    "is_triton_build_error",
    "require_backend",
    "triton_available",
    "triton_supports",
]

logger = logging.getLogger(__name__)

MAX_D = 128  # largest head size the kernels take (the accumulators must fit in registers)
# Largest head size the op sends to the kernels in fp32: above it, three fp32 weight tiles (192 KiB at
# D = 128) do not fit sm_80's shared memory and spill on sm_90, and cuBLAS runs the composite instead.
MAX_D_FP32 = 64
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_INSTALL_HINT = (
    "the fused MLP-value kernel needs Triton: `pip install triton`, and an NVIDIA GPU (CUDA tensors), "
    "or TRITON_INTERPRET=1 in the environment before first use to run it on CPU tensors (slow, for tests)."
)


@functools.lru_cache(maxsize=1)
def import_triton() -> Any:
    """Import triton once; return the module, or None if it is not importable."""
    try:
        import triton
        import triton.language
    except Exception as e:
        logger.debug("triton is not importable: %s", e)
        return None
    return triton


def interpret_mode() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    triton = import_triton()
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    """True if the Triton kernels can run here: triton imports and there is a CUDA GPU or TRITON_INTERPRET=1.

    Example::

        if triton_available():
            y = mlp_value_triton(v, w_up, w_gate, w_down)
    """
    if import_triton() is None:
        return False
    if interpret_mode():
        return interpreter_defect() is None
    return torch.cuda.is_available()


def _major_minor(version: str) -> tuple[int, int]:
    major, minor, *_ = [*(int(x) for x in re.findall(r"\d+", version)[:2]), 0, 0]
    return major, minor


def interpreter_defect(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why Triton's interpreter (``TRITON_INTERPRET=1``) cannot run the kernels with these versions, or None.

    Triton before 3.7 reads a loop bound in the interpreter with ``int()`` of a one-element numpy
    array, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"; triton-lang/triton#9171, fixed in 3.7). Every kernel here walks its row tiles in such
    a loop. The versions default to the installed ones.

    Example::

        interpreter_defect("3.6.0", "2.4.1")     # the reason, naming the fix
        interpreter_defect("3.9.0", "2.4.1")     # None
    """
    if triton_version is None:
        triton = import_triton()
        if triton is None:
            return None
        triton_version = str(triton.__version__)
    numpy_version = np.__version__ if numpy_version is None else numpy_version
    if _major_minor(triton_version) >= (3, 7) or _major_minor(numpy_version) < (2, 4):
        return None
    return (
        f"triton {triton_version}'s interpreter (TRITON_INTERPRET=1) cannot run the kernels' loops under numpy "
        f"{numpy_version}: numpy >= 2.4 refuses the int() it takes of a loop bound (triton-lang/triton#9171, "
        "fixed in triton 3.7). Install triton >= 3.7, or numpy < 2.4."
    )


def triton_supports(d: int, dtype: torch.dtype) -> bool:
    """True if ``kha::mlp_value`` runs the kernels for head size ``d`` and ``dtype``.

    bf16/fp16: d <= 128; fp32: d <= 64 (``MAX_D_FP32``). The kernel functions themselves take fp32 up
    to 128 too (the interpreter tests use that).
    """
    return dtype in DTYPES and 1 <= d <= (MAX_D_FP32 if dtype == torch.float32 else MAX_D)


def is_triton_build_error(e: BaseException) -> bool:
    """True if ``e`` is Triton failing to build a kernel (compile error, out of shared memory, ptxas)."""
    triton = import_triton()
    if triton is None:
        return False
    kinds: list[type] = []
    for mod, names in (
        ("triton.compiler.errors", ("CompilationError",)),
        ("triton.runtime.errors", ("OutOfResources", "PTXASError")),
    ):
        try:
            module = __import__(mod, fromlist=list(names))
        except ImportError:
            continue
        kinds += [getattr(module, n) for n in names if hasattr(module, n)]
    return isinstance(e, tuple(kinds))


def require_backend(device: torch.device) -> None:
    if import_triton() is None:
        raise BackendUnavailableError("Triton is not installed; " + _INSTALL_HINT)
    if interpret_mode():
        defect = interpreter_defect()
        if defect is not None:
            raise BackendUnavailableError(defect)
        return
    if device.type != "cuda":
        raise BackendUnavailableError(f"the tensors are on {device}, and TRITON_INTERPRET is not set; " + _INSTALL_HINT)
    if not torch.cuda.is_available():
        raise BackendUnavailableError("no CUDA GPU is available; " + _INSTALL_HINT)
