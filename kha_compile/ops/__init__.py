"""Custom ops: ``torch.ops.kha.mlp_value`` (the fused MLP-value transform)."""
from .mlp_value import mlp_value, mlp_value_reference, check_mlp_value_inputs

__all__ = ["mlp_value", "mlp_value_reference", "check_mlp_value_inputs"]
