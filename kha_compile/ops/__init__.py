"""Custom ops: ``torch.ops.kha.mlp_value`` (the fused MLP-value transform) and its FLOP formulas."""

from .flops import mlp_value_backward_flops, mlp_value_flops
from .mlp_value import check_mlp_value_inputs, mlp_value, mlp_value_auto, mlp_value_reference

__all__ = [
    "check_mlp_value_inputs",
    "mlp_value",
    "mlp_value_auto",
    "mlp_value_backward_flops",
    "mlp_value_flops",
    "mlp_value_reference",
]
