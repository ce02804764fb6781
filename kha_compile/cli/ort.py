"""onnxruntime and comparison helpers of the command line: run an exported file on a torch call's inputs."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import torch

from ..core.errors import ExportError
from .models import require

__all__ = ["FOLD_TOL", "ONNX_TOL", "first_tensor", "max_diff", "ort_run"]

FOLD_TOL = 1e-4  # max |folded - KHA| on unit-norm embeddings / tiny-model logits
ONNX_TOL = 1e-4  # max |onnxruntime - torch|


def first_tensor(out: Any) -> torch.Tensor:
    """The first tensor of a model output (a tensor, a ModelOutput, a dict or a tuple)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    for x in out:
        if isinstance(x, torch.Tensor):
            return x
    raise ExportError(f"the model returned no tensor to compare with onnxruntime ({type(out).__name__}).")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def ort_run(path: pathlib.Path, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[np.ndarray]:
    """Run the ONNX file in onnxruntime on the same inputs as a torch call ``model(*args, **kwargs)``."""
    ort = require("onnxruntime", "onnx")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = torch.get_num_threads()
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feed: dict[str, Any] = {}
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    positional = [a for a in args if isinstance(a, torch.Tensor)]
    for name in names:
        if name in tensors:
            feed[name] = tensors[name].cpu().numpy()
        elif positional:
            feed[name] = positional.pop(0).cpu().numpy()
        else:
            raise ExportError(
                f"{path} takes an input {name!r} that the example inputs do not provide; "
                "export with the inputs you will run it on."
            )
    result: list[np.ndarray] = sess.run(None, feed)
    return result
