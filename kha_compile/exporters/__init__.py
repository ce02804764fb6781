"""Deployment: ONNX (with the MLP-value custom node and its function body) and TensorRT engines."""

from .onnx import export_onnx, onnx_summary, read_kha_metadata
from .tensorrt import export_tensorrt

__all__ = ["export_onnx", "export_tensorrt", "onnx_summary", "read_kha_metadata"]
