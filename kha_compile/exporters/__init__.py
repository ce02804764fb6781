"""Deployment: ONNX (with the MLP-value custom node and its function body; with a KV cache for
onnxruntime-genai), TensorRT engines and AOTInductor packages (.pt2, MLP-value lowered inside, no
kha_compile at run time; with a static KV cache for generation), and greedy loops over each."""

from .aoti import export_aoti, read_aoti_metadata
from .generate import generate_aoti, generate_genai, generate_onnx, generate_tensorrt
from .onnx import export_onnx, onnx_summary, read_kha_metadata
from .tensorrt import export_tensorrt

__all__ = [
    "export_aoti",
    "export_onnx",
    "export_tensorrt",
    "generate_aoti",
    "generate_genai",
    "generate_onnx",
    "generate_tensorrt",
    "onnx_summary",
    "read_aoti_metadata",
    "read_kha_metadata",
]
