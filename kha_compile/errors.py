"""The errors kha_compile raises on bad input. Every one is a :class:`KHAError`.

Each message says what went wrong and what to do about it.
"""
from __future__ import annotations

__all__ = [
    "KHAError", "KHAConfigError", "NoAttentionFoundError", "AlreadyAppliedError",
    "MissingExampleInputsError", "TraceError", "CheckpointError", "FoldError",
    "ExportError", "BackendUnavailableError", "OpInputError", "ShardedModelError",
]


class KHAError(Exception):
    """Base class of every error kha_compile raises on bad input."""


class KHAConfigError(KHAError, ValueError):
    """A KHAConfig field has a value outside the allowed set."""


class NoAttentionFoundError(KHAError):
    """The graph pass found no per-head attention to transform."""


class AlreadyAppliedError(KHAError):
    """apply() was called on a model that already carries KHA transforms."""


class MissingExampleInputsError(KHAError, TypeError):
    """A non-transformers model was given without example inputs."""


class TraceError(KHAError):
    """torch.export could not capture the model's graph."""


class CheckpointError(KHAError):
    """A KHA checkpoint is missing, truncated, or does not fit the model."""


class FoldError(KHAError):
    """A fold was refused (for example a non-foldable MLP-value transform exists)."""


class ExportError(KHAError):
    """An export step (ONNX, TensorRT) failed; the message names the step."""


class BackendUnavailableError(KHAError, ImportError):
    """An optional backend (TensorRT, Triton, a GPU) is not available here."""


class OpInputError(KHAError, ValueError):
    """Tensors given to a KHA op have the wrong shape, dtype or device."""


class ShardedModelError(KHAError):
    """The model is already sharded (FSDP2, DTensor tensor parallel) where an unsharded one is needed."""
