"""Fused kernels: the Triton MLP-value kernel (triton is imported only when a kernel is first used)."""

from .mlp_value import (
    MAX_D,
    mlp_value_triton,
    mlp_value_triton_backward,
    mlp_value_triton_forward,
    triton_available,
    triton_supports,
)

__all__ = [
    "MAX_D",
    "mlp_value_triton",
    "mlp_value_triton_backward",
    "mlp_value_triton_forward",
    "triton_available",
    "triton_supports",
]
