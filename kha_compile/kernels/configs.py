"""Autotuning configs of the fused MLP-value Triton kernels, per launch, operand class and GPU architecture.

Plain data and arithmetic: importing this module does not import triton, so the AOT compiler
(:mod:`kha_compile.kernels.aot`), the op's dispatch and the TensorRT exporter read it freely.

Example::

    D = padded_d(48)                                    # 64
    configs_for("fused", config_class("fused", D, torch.bfloat16), D, 80)
    launch_supported("backward", 128, torch.bfloat16, 80)   # False: cuBLAS runs it on sm_80
"""

from __future__ import annotations

import torch

__all__ = [
    "CONFIGS",
    "LEFT_OUT",
    "MIN_DOT",
    "arch_class",
    "capability",
    "config_class",
    "configs_for",
    "launch_supported",
    "padded_d",
]

MIN_DOT = 16  # tl.dot on NVIDIA needs K >= 16 for 16-bit operands; keep every block dim >= 16

# (BLOCK_M, BLOCK_N or None, num_warps, num_stages) per launch and operand class. Checked with
# kha_compile.kernels.aot (``python benchmarks/kernels_aot.py``, triton 3.9) for sm_80 and sm_90:
# each config used on an architecture compiles there without register spills and within its
# shared memory (163 KiB per block on sm_80, 227 KiB on sm_90). fp32 uses FMA dots under "ieee"
# precision, whose register tiles only fit at small BLOCK_M.
CONFIGS: dict[tuple[str, str], list[tuple[int, int | None, int, int]]] = {
    ("fwd", "16bit"): [
        (64, None, 4, 3),
        (128, None, 8, 3),
        (256, None, 8, 2),
        (64, None, 4, 4),
        (128, None, 8, 4),
        (64, None, 8, 3),
        (128, None, 8, 2),
    ],
    # d = 128: the three weights take 96 KiB of shared memory, so one program per SM; the row tiles
    # in flight (BLOCK_M x stages) are what hides memory latency (sm_90: 3 x 128 rows fit, 229 KiB).
    ("fwd", "16bit-d128"): [
        (64, None, 4, 2),
        (64, None, 8, 3),
        (128, None, 8, 1),
        (128, None, 8, 2),
        (64, None, 8, 2),
        (64, None, 8, 4),
        (128, None, 8, 3),
    ],
    ("fwd", "fp32"): [(16, None, 8, 1), (16, None, 8, 2), (32, None, 8, 1)],
    ("fused", "16bit"): [
        (32, None, 4, 3),
        (32, None, 8, 2),
        (64, None, 8, 2),
        (64, None, 8, 3),
        (128, None, 8, 2),
        (128, None, 8, 3),
        (16, None, 4, 2),
    ],
    ("fused", "fp32"): [(16, None, 8, 1), (16, None, 8, 2)],
    ("dv", "16bit"): [(32, None, 4, 2), (32, None, 8, 2), (32, None, 8, 3), (32, None, 8, 1)],
    ("dv", "fp32"): [(16, None, 8, 1), (16, None, 8, 2)],
    ("dw", "16bit"): [(32, 32, 4, 2), (32, 32, 8, 3), (32, 64, 8, 2), (32, 64, 8, 3), (64, 32, 8, 2), (64, 32, 8, 3)],
    ("dw", "fp32"): [(16, 32, 8, 1), (16, 32, 8, 2), (32, 32, 8, 1), (32, 32, 8, 2)],
}
# Which of them each architecture class uses, by padded head size D: (kind, class, D) -> configs
# left out there. sm_80 (and other GPUs below sm_90: less shared memory, and its mma.sync code holds
# more in registers than sm_90's wgmma) spills or overflows in these; sm_90 in the ones marked so.
LEFT_OUT: dict[str, dict[tuple[str, str, int], set[tuple[int, int | None, int, int]]]] = {
    "sm_80": {
        ("fwd", "16bit-d128", 128): {
            (64, None, 4, 2),
            (128, None, 8, 1),
            (128, None, 8, 2),
            (64, None, 8, 4),
            (128, None, 8, 3),
        },
        ("fused", "16bit", 64): {
            (32, None, 4, 3),
            (64, None, 8, 2),
            (64, None, 8, 3),
            (128, None, 8, 2),
            (128, None, 8, 3),
        },
        # grad_v keeps W_up, W_gate, W_down^T and both transposes on chip: 5 x 32 KiB plus the tiles
        # is more than 163 KiB whatever the blocks, so below sm_90 the op's backward at d > 64 runs
        # the composite (cuBLAS) instead (see launch_supported).
        ("dv", "16bit", 128): {(32, None, 4, 2), (32, None, 8, 2), (32, None, 8, 3), (32, None, 8, 1)},
    },
    "sm_90": {
        ("fused", "16bit", 32): {(128, None, 8, 2), (128, None, 8, 3)},
        ("dv", "16bit", 128): {(32, None, 8, 1)},
    },
}


def arch_class(cc: int | None) -> str | None:
    """ "sm_80" below compute capability 9.0, "sm_90" from it, None when unknown (interpreter)."""
    if cc is None:
        return None
    return "sm_90" if cc >= 90 else "sm_80"


def configs_for(kind: str, cls: str, D: int, cc: int | None) -> list[tuple[int, int | None, int, int]]:
    """The autotune configs of launch ``kind`` for operand class ``cls`` and padded head size D on ``cc``.

    ``cc`` is the compute capability (e.g. 90); None gives all of them, as in the interpreter.

    Example::

        configs_for("fused", "16bit", 64, 80)     # [(32, None, 8, 2), (16, None, 4, 2)]
    """
    left_out = LEFT_OUT.get(arch_class(cc) or "", {}).get((kind, cls, D), set())
    return [c for c in CONFIGS[(kind, cls)] if c not in left_out]


def launch_supported(direction: str, d: int, dtype: torch.dtype, cc: int | None) -> bool:
    """True if every launch of the ``direction`` ("forward"/"backward") has a config on compute capability cc.

    Example::

        launch_supported("backward", 128, torch.bfloat16, 80)    # False: cuBLAS runs it on sm_80
    """
    D = padded_d(d)
    kinds = ["fwd"] if direction == "forward" else (["fused"] if D <= 64 else ["dv", "dw"])
    return all(configs_for(k, config_class(k, D, dtype), D, cc) for k in kinds)


def config_class(kind: str, D: int, dtype: torch.dtype) -> str:
    """The tuning-config class of a ``kind`` launch at padded head size ``D``: "fp32", "16bit" or "16bit-d128"."""
    if dtype == torch.float32:
        return "fp32"
    return "16bit-d128" if kind == "fwd" and D >= 128 else "16bit"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def padded_d(d: int) -> int:
    """The head size the kernels compute with: ``d`` rounded up to a power of two (at least the dot minimum)."""
    return max(MIN_DOT, _next_pow2(d))


def capability(device: torch.device | None = None) -> int | None:
    """Compute capability of the CUDA device the kernels run on (e.g. 90); None where they run on no GPU.

    ``device`` is the tensors' device: a CPU device (the ``TRITON_INTERPRET=1`` interpreter) gives
    None even on a machine with a GPU, so the interpreter keeps every config; None asks about the
    current CUDA device.

    Example::

        capability(torch.device("cpu"))     # None: no architecture's configs are left out
    """
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor
