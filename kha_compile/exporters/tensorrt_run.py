"""Running a TensorRT engine built by :func:`kha_compile.export_tensorrt`: :class:`EngineRunner` and :func:`run_engine`.

:class:`EngineRunner` deserializes the engine once and keeps one execution context, so a generation
loop (:func:`kha_compile.exporters.generate.generate_tensorrt`) calls it once per token without
loading the engine again; :func:`run_engine` runs an engine once. Both register the MLP-value
plugin first and need ``tensorrt`` and an NVIDIA GPU.

Example::

    runner = EngineRunner("model.engine")
    out = runner({"x": torch.randn(2, 16, 64)})             # {name: CPU tensor}
"""

import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import torch

from ..core.errors import EngineError
from .tensorrt_plugin import import_tensorrt, register_mlp_value_plugin

__all__ = ["EngineRunner", "run_engine", "trt_logger"]

log = logging.getLogger(__name__)


def trt_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` that forwards TensorRT's messages to this module's logger."""
    levels = {
        trt.ILogger.Severity.INTERNAL_ERROR: logging.ERROR,
        trt.ILogger.Severity.ERROR: logging.ERROR,
        trt.ILogger.Severity.WARNING: logging.WARNING,
        trt.ILogger.Severity.INFO: logging.DEBUG,
        trt.ILogger.Severity.VERBOSE: logging.DEBUG,
    }

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            log.log(levels.get(severity, logging.INFO), "TensorRT: %s", msg)

    return _Logger()


class EngineRunner:
    """A TensorRT engine loaded once, with one execution context: ``runner({name: tensor}) -> {name: tensor}``.

    ``inputs`` maps each input name to its engine shape (-1 for a dynamic axis) and torch dtype.

    Example::

        runner = EngineRunner("model.engine")
        runner.inputs                                    # {'x': ((-1, -1, 64), torch.float32)}
        y = runner({"x": x})["output"]
    """

    def __init__(self, engine_path: str | os.PathLike) -> None:
        trt = import_tensorrt()
        register_mlp_value_plugin()
        self.path = pathlib.Path(engine_path)
        runtime = trt.Runtime(trt_logger(trt))
        self.engine = runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            raise EngineError(
                f"TensorRT could not load the engine {str(self.path)!r} (built by another TensorRT version or GPU?)."
            )
        self.dtypes = {
            trt.DataType.FLOAT: torch.float32,
            trt.DataType.HALF: torch.float16,
            trt.DataType.BF16: torch.bfloat16,
            trt.DataType.INT32: torch.int32,
            trt.DataType.INT64: torch.int64,
            trt.DataType.BOOL: torch.bool,
            trt.DataType.INT8: torch.int8,
            trt.DataType.UINT8: torch.uint8,
        }
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = {n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.inputs = {
            n: (tuple(self.engine.get_tensor_shape(n)), self.dtypes[self.engine.get_tensor_dtype(n)])
            for n in names
            if is_input[n]
        }
        self.output_names = [n for n in names if not is_input[n]]
        self.context = self.engine.create_execution_context()

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        missing = sorted(set(self.inputs) - set(inputs))
        if missing:
            raise EngineError(f"run_engine: inputs {missing} are missing; the engine takes {list(self.inputs)}.")
        keep: dict[str, torch.Tensor] = {}
        for name, (_, dtype) in self.inputs.items():
            t = torch.as_tensor(inputs[name]).to("cuda", dtype=dtype)
            keep[name] = t.contiguous()
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, keep[name].data_ptr())
        outputs: dict[str, torch.Tensor] = {}
        for name in self.output_names:
            shape = tuple(self.context.get_tensor_shape(name))
            dtype = self.dtypes[self.engine.get_tensor_dtype(name)]
            outputs[name] = torch.empty(shape, dtype=dtype, device="cuda")
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the copies above ran there
        with torch.cuda.stream(stream):
            if not self.context.execute_async_v3(stream.cuda_stream):
                raise EngineError(f"TensorRT failed to run {str(self.path)!r} (see its log).")
        stream.synchronize()
        return {name: t.cpu() for name, t in outputs.items()}


def run_engine(engine_path: str | os.PathLike, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Run a TensorRT engine once on ``inputs`` ({name: tensor or array}); returns CPU outputs.

    Inputs are cast to the engine's input types and moved to the GPU; the MLP-value plugin is
    registered first. Needs ``tensorrt`` and an NVIDIA GPU.

    Example::

        out = run_engine("model.engine", {"x": torch.randn(2, 16, 64)})
    """
    return EngineRunner(engine_path)(inputs)
