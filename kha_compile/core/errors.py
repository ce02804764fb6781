"""The errors kha_compile raises on bad input. Every one is a :class:`KHAError`.

Each message says what went wrong and what to do about it. Catch :class:`KHAError` for all of them,
or a subclass for one kind of failure.

Example::

    try:
        kc.apply(model, kc.KHAConfig(v="mlp"))
    except kc.KHAError as e:
        log.error("KHA not applied: %s", e)
"""

from __future__ import annotations

__all__ = [
    "AlreadyAppliedError",
    "AnalysisError",
    "BackendError",
    "BackendOptionError",
    "BackendUnavailableError",
    "CacheLayoutError",
    "CacheOverflowError",
    "CheckpointError",
    "CommandError",
    "DeployError",
    "EngineError",
    "ExportError",
    "ExportNamesError",
    "FoldError",
    "InternalError",
    "KHAConfigError",
    "KHAError",
    "KernelCompileError",
    "MissingDependencyError",
    "MissingExampleInputsError",
    "ModelLoadError",
    "NoAttentionFoundError",
    "NoKHATransformsError",
    "NoKVCacheError",
    "OpInputError",
    "RegistrationError",
    "RegistryError",
    "SelfCheckError",
    "ServingError",
    "ShardedModelError",
    "TensorParallelError",
    "TraceError",
    "TracedPathError",
    "UnknownTransformError",
    "UnsupportedLayoutError",
    "UnsupportedModelError",
]


class KHAError(Exception):
    """Base class of every error kha_compile raises on bad input."""


# ---- settings and arguments ------------------------------------------------------------------


class KHAConfigError(KHAError, ValueError):
    """A KHAConfig field has a value outside the allowed set."""


class UnknownTransformError(KHAConfigError):
    """A transform kind name is not registered (kha_compile.model.transforms)."""


class RegistryError(KHAError, LookupError):
    """A rule or projection-handler name is not registered."""


class RegistrationError(KHAError, ValueError):
    """register_attention_op was given something it cannot register (not an op, bad roles or layout)."""


class MissingExampleInputsError(KHAError, TypeError):
    """A non-transformers model was given without example inputs."""


class OpInputError(KHAError, ValueError):
    """Tensors given to a KHA op have the wrong shape, dtype or device."""


class CommandError(KHAError, ValueError):
    """A ``kha-compile`` command was given arguments it cannot work with."""


# ---- the model: analysis and apply -------------------------------------------------------------


class TraceError(KHAError):
    """torch.export could not capture the model's graph."""


class AnalysisError(KHAError):
    """An unexpected failure inside one analysis step (trace, match, plan); the model is unchanged."""


class NoAttentionFoundError(KHAError):
    """The graph pass found no per-head attention to transform."""


class SelfCheckError(KHAError):
    """apply's check of its own rewrite failed (identity, a fake tensor left, or a misplaced transform); undone."""


class AlreadyAppliedError(KHAError):
    """apply() was called on a model (or module) that already carries KHA transforms."""


class UnsupportedModelError(KHAError):
    """The model has a construct kha_compile cannot put KHA into (the message names it)."""


class UnsupportedLayoutError(UnsupportedModelError):
    """A projection's head layout is neither separate/fused blocks nor an interleaved [H, roles, Dh] layout."""


class ShardedModelError(KHAError):
    """The model is already sharded (FSDP2, DTensor tensor parallel) where an unsharded one is needed."""


class TensorParallelError(KHAError):
    """Tensor parallelism shards a KHA projection in a way its transforms cannot follow (split heads, input features)."""


class TracedPathError(KHAError):
    """At run time a KHA module took another code path than the one traced when KHA was applied."""


# ---- the model afterwards: transforms, checkpoints, fold ----------------------------------------


class NoKHATransformsError(KHAError):
    """The model carries no KHA transforms where the operation needs some."""


class CheckpointError(KHAError):
    """A KHA checkpoint is missing, truncated, or does not fit the model."""


class FoldError(KHAError):
    """A fold was refused (for example a non-foldable MLP-value transform exists)."""


class ModelLoadError(KHAError):
    """A model named on the command line could not be found or loaded."""


# ---- export and kernels ------------------------------------------------------------------------


class ExportError(KHAError):
    """An export step (ONNX, TensorRT) failed; the message names the step."""


class ExportNamesError(ExportError, ValueError):
    """input_names / output_names given to an export do not fit the model's inputs or outputs."""


# ---- generation from exported files (KV cache) ------------------------------------------------


class NoKVCacheError(ExportError):
    """An export with a KV cache was asked of a model that keeps none (an encoder, a module without a cache)."""


class CacheLayoutError(ExportError):
    """The model's KV cache has a layout the export cannot express (the message names it)."""


class CacheOverflowError(KHAError, ValueError):
    """A generation call needs more positions (or sequences) than a static KV cache holds."""


class EngineError(KHAError):
    """A built TensorRT engine could not be loaded or run, or was given the wrong inputs."""


class KernelCompileError(KHAError, ValueError):
    """A Triton kernel could not be compiled ahead of time (unknown architecture, failed build, no fit)."""


# ---- serving engines ---------------------------------------------------------------------------


class ServingError(KHAError):
    """A serving engine (vLLM) cannot serve a saved directory with its KHA as asked; the message says why."""


# ---- the torch.compile backend -----------------------------------------------------------------


class BackendError(KHAError):
    """The torch.compile backend ``"kha"`` could not rewrite a graph as asked."""


class BackendOptionError(BackendError, ValueError):
    """An option of ``kc.backend(...)`` has a value outside the allowed set."""


class DeployError(BackendError):
    """Deploy mode (``kc.backend(from_pretrained=...)``) cannot place a checkpoint's transforms."""


# ---- this machine ------------------------------------------------------------------------------


class BackendUnavailableError(KHAError, ImportError):
    """An optional backend (TensorRT, Triton, a GPU) is not available here."""


class MissingDependencyError(KHAError, ImportError):
    """An optional Python package (transformers, onnxruntime, matplotlib, ...) is not installed."""


# ---- bugs --------------------------------------------------------------------------------------


class InternalError(KHAError, RuntimeError):
    """An invariant of kha_compile itself broke: a bug; please report it with the message."""
