"""AOTInductor export: a ``.pt2`` package of a KHA model that runs without kha_compile, and without Python.

:func:`export_aoti` exports a model through ``torch.export``, lowers every ``kha::`` op to aten ops,
then compiles the program with AOTInductor into one package: the generated code as a shared
library, with the weights inside it. The package loads with ``torch._inductor.aoti_load_package``
in any Python process with the same torch (no kha_compile, no transformers), and with
``torch::inductor::AOTIModelPackageLoader`` from C++ (``examples/aoti_cpp/``).

* Linear KHA is folded into the weights of a copy (the caller's model is never modified).
* MLP-value KHA cannot fold. A ``torch.library.custom_op`` left in the program would make the
  package need Python and kha_compile when it loads ("Custom operators created via
  torch.library.custom_op cannot be run via AOTI without Python environment"), so each
  ``kha::mlp_value`` node is replaced by its formula (:data:`KHA_DECOMPOSITIONS`) with
  ``ExportedProgram.run_decompositions``, which decomposes nothing else. Inductor then compiles the
  formula like the rest of the model: C++ on CPU, its own Triton kernels and cuBLAS on CUDA.
* Inputs and outputs are flat: the package takes the model's tensor inputs in the forward's order
  and returns a tuple of tensors (a ``ModelOutput`` would need transformers to unflatten).
* Batch and sequence are dynamic, from 1 up (unbounded unless ``max_batch`` / ``max_seq``).
* The package carries the KHA metadata of the ONNX files (:mod:`kha_compile.exporters.metadata`)
  plus the input and output names, read back with :func:`read_aoti_metadata` or
  ``AOTIModelPackageLoader::get_metadata()`` in C++.
* With ``generation=True`` the package generates instead: prefill and one-token decode over a static
  KV cache held inside it (:mod:`kha_compile.exporters.aoti_generation`).

CUDA, not run here (no GPU was lent when this was written): a model on a CUDA device gives a CUDA
package through the same steps, with Inductor's own kernels for the decomposed MLP-value. To put
the fused kernel of :mod:`kha_compile.kernels.mlp_value` into the package instead, the op would be
declared with ``torch.library.triton_op`` and launch its kernel through
``torch.library.wrap_triton`` (a traceable launcher, without the build-failure fallback the eager op
has): ``torch.export`` keeps such an op as one node and AOTInductor compiles the Triton kernel into
the package. :func:`export_aoti` would then skip :func:`lower_kha_ops` for that op on CUDA only, and
keep the decomposition as the fallback when the compile fails.

Example::

    path = kc.export_aoti(model, "model.pt2")                   # a transformers model: inputs built
    runner = torch._inductor.aoti_load_package(str(path))       # any process, no kha_compile
    (logits,) = runner(input_ids, attention_mask)
    read_aoti_metadata(path)["input_names"]                     # ['input_ids', 'attention_mask']
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import pathlib
import time
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..analysis.inputs import example_inputs
from ..core.errors import ExportError
from ..model.wrappers import sees_through_wrappers
from ..passes.fold import fold as fold_pass
from .aoti_generation import export_generation
from .aoti_steps import AOTI_TOL, KHA_DECOMPOSITIONS, compile_package, eval_mode, input_ranges, kha_ops, lower_kha_ops
from .common import check_destination, root_reason, without_kv_cache
from .metadata import METADATA_PREFIX, kha_metadata, parse_metadata
from .onnx_names import BATCH_AXIS, SEQUENCE_AXIS, dynamic_axes_for, output_names_of

__all__ = [
    "AOTI_KEYS",
    "AOTI_TOL",
    "KHA_DECOMPOSITIONS",
    "check_tolerance",
    "export_aoti",
    "kha_ops",
    "lower_kha_ops",
    "read_aoti_metadata",
]

log = logging.getLogger(__name__)

SUFFIX = ".pt2"
AOTI_ULPS = 4  # for 16-bit outputs (a bf16 / fp16 model): this many of the dtype's eps, relative likewise


def check_tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance of the package check for outputs of ``dtype``.

    A bf16 or fp16 package rounds in other places than eager (fused kernels), so its outputs differ
    by a few units in the last place of that dtype; fp32 (and wider) keep :data:`AOTI_TOL`.

    Example::

        check_tolerance(torch.bfloat16)      # 0.03125
    """
    if dtype.is_floating_point and torch.finfo(dtype).bits <= 16:
        return AOTI_ULPS * torch.finfo(dtype).eps
    return AOTI_TOL


# the keys export_aoti writes besides the ONNX ones (METADATA_KEYS); names are comma-separated for C++
AOTI_KEYS = tuple(
    METADATA_PREFIX + k for k in ("format", "torch_version", "input_names", "output_names", "dynamic_shapes")
)
_LIST_KEYS = ("input_names", "output_names")


class _FlatIO(nn.Module):
    """``model`` called with its tensor inputs in ``names`` order (``consts`` fixed); returns a tuple of tensors."""

    def __init__(self, model: nn.Module, names: list[str], consts: dict[str, Any]) -> None:
        super().__init__()
        self.model, self.names, self.consts = model, names, consts

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _tensors(self.model(**dict(zip(self.names, tensors)), **self.consts))


def _tensors(out: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of a model output (a tensor, tuple, dict or ModelOutput), flattened in order."""
    return tuple(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


def _output_names(out: Any) -> list[str]:
    """One name per tensor of ``out``, as the ONNX export names them (``logits``, ``output``, ``output_0``)."""
    leaves, spec = pytree.tree_flatten(out)
    names = output_names_of(spec)
    return [n for n, leaf in zip(names, leaves) if isinstance(leaf, torch.Tensor)]


def _split_inputs(model: nn.Module, args: tuple, kwargs: dict) -> tuple[list[str], list[torch.Tensor], dict[str, Any]]:
    """The forward's tensor inputs (names, tensors) and the other inputs, which the package fixes."""
    name = type(model).__name__
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise ExportError(
            f"AOTI export of {name}, step 'export': the example inputs do not fit its forward: {e}"
        ) from e
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    consts: dict[str, Any] = {}
    for key, value in bound.arguments.items():
        param = signature.parameters[key]
        if param.kind is inspect.Parameter.VAR_KEYWORD:  # **kwargs of the forward: its items by name
            items = dict(value)
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            raise ExportError(
                f"AOTI export of {name}: its forward takes *{key}; the package needs named inputs. "
                "Wrap the model in a module whose forward names each input."
            )
        else:
            items = {key: value}
        for k, v in items.items():
            if isinstance(v, torch.Tensor):
                names.append(k)
                tensors.append(v)
            elif any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(v)):
                raise ExportError(
                    f"AOTI export of {name}: input {k!r} is a {type(v).__name__} of tensors; the package takes "
                    "tensors only. Export the module that takes them one by one (for a SentenceTransformer, "
                    "its transformers model, model[0].auto_model)."
                )
            else:
                consts[k] = v  # use_cache=False, return_dict, ...: fixed in the package
    return names, tensors, consts


def _dynamic_shapes(names: list[str], tensors: list[torch.Tensor], max_batch: int | None, max_seq: int | None) -> Any:
    """torch.export specs for ``_FlatIO``'s ``*tensors``: shared named Dims ``batch`` and ``sequence``, min 1.

    A sequence axis whose example length differs from the first one's gets its own Dim
    (``<input>_sequence``: a decoder's length). Named Dims with min 1 (Dim.DYNAMIC and Dim.AUTO start
    at 2); a size-1 example axis would be specialized, so it is refused here with what to do.
    """
    dims: dict[tuple[str, int], Any] = {}
    specs = []
    for name, t in zip(names, tensors):
        spec: dict[int, Any] = {}
        for axis, kind in dynamic_axes_for(name, t.dim()).items():
            size = int(t.shape[axis])
            if size < 2:
                raise ExportError(
                    f"AOTI export, step 'export': example input {name!r} has size {size} on axis {axis} ({kind}); "
                    f"torch.export fixes a size-1 axis, so it could not be dynamic. Give an example with at least "
                    f"2 along it, or export with dynamic=False."
                )
            key = (kind, 0 if kind == BATCH_AXIS else size)
            if key not in dims:
                taken = kind == SEQUENCE_AXIS and any(k[0] == SEQUENCE_AXIS for k in dims)
                upper = max_batch if kind == BATCH_AXIS else max_seq
                dim_name = f"{name}_{kind}" if taken else kind
                dims[key] = torch.export.Dim(dim_name, min=1, max=upper) if upper else torch.export.Dim(dim_name, min=1)
            spec[axis] = dims[key]
        specs.append(spec or None)
    return (tuple(specs),)  # one entry: the *tensors parameter


@sees_through_wrappers
def export_aoti(
    model: nn.Module,
    path: str | os.PathLike,
    example_args: Any = (),
    example_kwargs: dict[str, Any] | None = None,
    dynamic: bool = True,
    fold: bool = True,
    *,
    max_batch: int | None = None,
    max_seq: int | None = None,
    inductor_configs: dict[str, Any] | None = None,
    check: bool = True,
    generation: bool = False,
    max_cache_len: int | None = None,
) -> pathlib.Path:
    """Write an AOTInductor package of ``model`` to ``path`` (.pt2) that runs without kha_compile.

    With ``fold`` (default) a deep copy of a model with KHA gets its linear KHA folded into the weights
    (``kc.fold(copy, strict=False)``); MLP-value KHA stays and is lowered to aten ops (:func:`lower_kha_ops`).
    With ``dynamic`` (default) the batch and sequence axes of the inputs (:func:`dynamic_axes_for`) are
    dynamic from 1 to ``max_batch`` / ``max_seq`` (unbounded by default); the example inputs must then be
    at least 2 along them. Example inputs are optional for a transformers model (exported with
    ``use_cache=False``). The package is compiled for the device of the model and this machine's CPU
    (AOTInductor packages are specific to both); ``inductor_configs`` go to AOTInductor as they are.

    The package takes the forward's tensor inputs in order (other inputs, such as ``use_cache``, are fixed
    to the example's values) and returns a tuple of tensors, named as in the ONNX export; both lists are in
    its metadata (:func:`read_aoti_metadata`). With ``check`` (default) the package is loaded here and
    compared with the caller's model on the example inputs (within :data:`AOTI_TOL`), so a package that
    differs is never returned.

    With ``generation=True`` (a transformers decoder LM) the package generates: it takes ``input_ids``
    (batch, sequence) and ``cache_position`` (sequence,) and returns the ``logits``, over a static KV cache
    of ``max_cache_len`` positions (default: the model's ``max_position_embeddings``, at most
    :data:`~kha_compile.exporters.aoti_generation.DEFAULT_MAX_CACHE_LEN`) for up to ``max_batch`` sequences
    (default 1) held in the package; prefill and one-token decode are calls of the same graph (see
    :mod:`kha_compile.exporters.aoti_generation`). Its example inputs are built from the config; the check
    compares the prefill and one decode step with the model.

    Raises :class:`~kha_compile.core.errors.ExportError` naming the step that failed (export, lower,
    compile, check) with torch's own reason; with ``generation=True``,
    :class:`~kha_compile.core.errors.NoKVCacheError` / :class:`~kha_compile.core.errors.CacheLayoutError`
    for a model whose cache the package cannot hold, before anything is written.

    Example::

        path = kc.export_aoti(model, "model.pt2", example_args=(x,))
        (y,) = torch._inductor.aoti_load_package(str(path))(x)      # no kha_compile needed
        kc.export_aoti(llm, "gen.pt2", generation=True, max_cache_len=256)   # then generate_aoti(...)
    """
    path = _check_path(path)
    if not isinstance(model, nn.Module):
        raise ExportError(f"export_aoti takes an nn.Module; got {type(model).__name__}.")
    if generation:
        if example_args or example_kwargs or max_seq is not None or not dynamic:
            raise ExportError(
                "export_aoti(generation=True) builds its own example inputs and its sequence axis runs up to "
                "max_cache_len: call it without example_args, example_kwargs, max_seq, dynamic=False."
            )
        return export_generation(model, path, fold, max_batch or 1, max_cache_len, inductor_configs, check)
    if max_cache_len is not None:
        raise ExportError("max_cache_len is the static KV cache of export_aoti(generation=True); pass generation=True.")
    name = type(model).__name__
    args, kwargs = example_inputs(model, example_args, example_kwargs)
    kwargs = without_kv_cache(model, args, kwargs)
    names, tensors, consts = _split_inputs(model, args, kwargs)
    shapes = _dynamic_shapes(names, tensors, max_batch, max_seq) if dynamic else None
    metadata = kha_metadata(model, args, kwargs, folded=fold)

    target = model
    if json.loads(metadata[METADATA_PREFIX + "folded"]):  # fold asked, and there are linear transforms
        target = copy.deepcopy(model)  # the caller's model keeps its KHA
        fold_pass(target, strict=False)  # linear KHA into the weights; MLP-value stays, lowered below
        log.info("folded the linear KHA of a copy of %s before export", name)
    with eval_mode(model), eval_mode(target), torch.no_grad():
        out = model(**dict(zip(names, tensors)), **consts)  # the caller's model: the check covers the fold too
        want = _tensors(out)
        output_names = _output_names(out)
        timings: dict[str, float] = {}
        start = time.perf_counter()
        try:
            program = torch.export.export(_FlatIO(target, names, consts), tuple(tensors), dynamic_shapes=shapes)
        except Exception as e:
            raise ExportError(f"AOTI export of {name}, step 'export' failed: {root_reason(e)}") from e
        timings["export"] = time.perf_counter() - start
    start = time.perf_counter()
    program = lower_kha_ops(program)
    timings["lower"] = time.perf_counter() - start

    metadata.update(
        {
            METADATA_PREFIX + "format": "aoti",
            METADATA_PREFIX + "torch_version": torch.__version__,
            METADATA_PREFIX + "input_names": ",".join(names),
            METADATA_PREFIX + "output_names": ",".join(output_names),
            METADATA_PREFIX + "dynamic_shapes": json.dumps(input_ranges(program, names), sort_keys=True),
        }
    )
    start = time.perf_counter()
    compile_package(program, path, metadata, inductor_configs, name)
    timings["compile"] = time.perf_counter() - start
    if check:
        _check_package(path, tensors, want, name)
    log.info("AOTI export of %s to %s: %s", name, path, ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    return path


def _check_path(path: str | os.PathLike) -> pathlib.Path:
    if pathlib.Path(path).suffix != SUFFIX:
        raise ExportError(f"export_aoti writes an AOTInductor package, whose name ends in .pt2; got {str(path)!r}.")
    return check_destination(path, what="the AOTInductor package")


def _check_package(path: pathlib.Path, tensors: list[torch.Tensor], want: tuple[torch.Tensor, ...], name: str) -> None:
    """Run the package here on the example inputs; ExportError (step 'check') unless it matches ``want``."""
    try:
        got = torch._inductor.aoti_load_package(str(path))(*tensors)
    except Exception as e:
        raise ExportError(f"AOTI export of {name}, step 'check': the package does not run: {root_reason(e)}") from e
    got = (got,) if isinstance(got, torch.Tensor) else tuple(got)
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        raise ExportError(
            f"AOTI export of {name}, step 'check': the package returns shapes {[tuple(g.shape) for g in got]}, "
            f"the model {[tuple(w.shape) for w in want]}."
        )
    for i, (g, w) in enumerate(zip(got, want)):
        if not w.is_floating_point():
            ok = torch.equal(g, w)
            diff = 0.0 if ok else float("inf")
        else:
            diff = float((g.float() - w.float()).abs().max()) if w.numel() else 0.0
            ok = diff <= check_tolerance(w.dtype) * max(1.0, float(w.abs().max()) if w.numel() else 1.0)
        if not ok:
            raise ExportError(
                f"AOTI export of {name}, step 'check': output {i} of the package differs from the model by "
                f"{diff:.3g} on the example inputs (tolerance {check_tolerance(w.dtype):.3g} relative, "
                f"{w.dtype}); the file {str(path)!r} is wrong."
            )
        log.info("AOTI package output %d vs the model: max |diff| %.3g", i, diff)


def read_aoti_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The KHA metadata of a package written by :func:`export_aoti`, parsed, without loading its code.

    Returns the ONNX keys (``version``, ``kha``, ``config``, ``sites``, ``folded``) and ``format``
    (``"aoti"``), ``torch_version``, ``input_names`` and ``output_names`` (lists, in the package's order)
    and ``dynamic_shapes`` (``{input: {axis: [min, max or None]}}``), keys without the ``kha_compile.``
    prefix, plus ``"aoti"``: Inductor's own entries (``AOTI_DEVICE_KEY``, ``AOTI_CPU_ISA``, ...).
    Raises :class:`~kha_compile.core.errors.ExportError` for a file that is not such a package.

    Example::

        meta = read_aoti_metadata("model.pt2")
        meta["config"], meta["input_names"]          # {'v': 'mlp', ...}, ['input_ids', 'attention_mask']
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ExportError(f"no AOTInductor package at {str(path)!r}: the file does not exist.")
    try:
        loader: Any = torch._C._aoti.AOTIModelPackageLoader  # its static reader: the .so is not loaded
        raw = dict(loader.load_metadata_from_package(str(path), "model"))
    except Exception as e:
        raise ExportError(
            f"{str(path)!r} is not an AOTInductor package with a model named 'model' "
            f"({type(e).__name__}: {e}); write one with kc.export_aoti."
        ) from e
    try:
        out = parse_metadata(raw)
        if "dynamic_shapes" in out:
            out["dynamic_shapes"] = json.loads(out["dynamic_shapes"])
    except ValueError as e:
        raise ExportError(f"the kha_compile metadata of {str(path)!r} is not valid JSON ({e}); was it edited?") from e
    for key in _LIST_KEYS:
        if key in out:
            out[key] = out[key].split(",") if out[key] else []
    out["aoti"] = {k: v for k, v in raw.items() if not k.startswith(METADATA_PREFIX)}
    return out
