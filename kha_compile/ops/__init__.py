"""Custom ops: ``torch.ops.kha.mlp_value`` (the fused MLP-value transform) and its FLOP formulas."""
from .mlp_value import mlp_value, mlp_value_reference, check_mlp_value_inputs
from .flops import mlp_value_flops, mlp_value_backward_flops

__all__ = ["mlp_value", "mlp_value_reference", "check_mlp_value_inputs", "mlp_value_flops",
           "mlp_value_backward_flops"]
