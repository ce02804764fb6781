"""ONNX with a KV cache: the decoder file that onnxruntime-genai (and a plain onnxruntime loop) generates from.

:func:`export_with_past` (``kc.export_onnx(model, path, past=True)``) exports a transformers decoder LM
through a wrapper whose forward takes the cache as tensors and returns the grown cache:

==============================  ======================================  ==========================
input / output                  shape                                   dtype
==============================  ======================================  ==========================
``input_ids``                   (batch, sequence)                       int64
``attention_mask``              (batch, total_sequence)                 int64 (1 = attend)
``position_ids``                (batch, sequence)                       int64 (where the model takes them)
``past_key_values.N.key/value`` (batch, kv_heads, past_sequence, head)  the model's float type
``logits``                      (batch, sequence, vocab)                the model's float type
``present.N.key/value``         (batch, kv_heads, past_sequence +       the model's float type
                                sequence, head)
==============================  ======================================  ==========================

``total_sequence`` is ``past_sequence + sequence``; the first call passes an empty past
(``past_sequence`` 0). Every axis named here is dynamic. KHA sits inside the projections, so the cache
holds what the model caches (keys after KHA and RoPE, values after KHA): MLP-value KHA stays one
``kha::MLPValue`` node with its function body per site, linear KHA is folded into a copy's weights.
``genai_config.json`` goes beside the file (:mod:`kha_compile.exporters.genai`). A model whose cache
the file cannot express is refused before anything is written
(:mod:`kha_compile.exporters.kv_cache`).

Example::

    path = kc.export_onnx(model, "llm_genai", past=True)    # llm_genai/model.onnx, llm_genai/genai_config.json
    import onnxruntime_genai as og
    gen = og.Generator(og.Model("llm_genai"), og.GeneratorParams(og.Model("llm_genai")))
"""

from __future__ import annotations

import copy
import json
import logging
import os
import pathlib
import warnings
from typing import Any

import torch
from torch import nn

from ..core.errors import ExportError
from ..ops.mlp_value_onnx import import_onnx
from ..passes.fold import fold as fold_pass
from .common import check_destination
from .genai import genai_config, write_genai_config
from .kv_cache import CacheLayout, cache_layout, cache_tensors, output_cache
from .metadata import METADATA_PREFIX, kha_metadata
from .onnx_names import rename_io
from .onnx_program import export_program, save_and_check

__all__ = ["DIMS", "FILENAME", "TOTAL_SEQUENCE_AXIS", "export_with_past", "past_destination"]

log = logging.getLogger(__name__)

FILENAME = "model.onnx"  # the file's name when the destination is a directory
TOTAL_SEQUENCE_AXIS = "total_sequence"
# the dynamic axes of the file: name -> lowest size (a first call has no past)
DIMS = {"batch": 1, "sequence": 1, "past_sequence": 0, TOTAL_SEQUENCE_AXIS: 1}
_EXAMPLE = {"batch": 2, "sequence": 3, "past_sequence": 5}  # distinct sizes, none of them 1


class _WithPast(nn.Module):
    """``model`` with its KV cache as flat tensors: (ids, mask[, positions], *past) -> (logits, *present)."""

    def __init__(self, model: nn.Module, layout: CacheLayout) -> None:
        super().__init__()
        import transformers

        self.model, self.layout = model, layout
        self.cache_cls = transformers.DynamicCache

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *rest: torch.Tensor) -> tuple:
        position_ids, past = (rest[0], rest[1:]) if self.layout.position_ids else (None, rest)
        cache = self.cache_cls(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.layout.num_layers)])
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, self.layout.cache_arg: cache, "use_cache": True}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        out = self.model(input_ids=input_ids, **kwargs)
        return (out.logits, *(t for pair in cache_tensors(output_cache(out)) for t in pair))


def past_destination(path: str | os.PathLike) -> tuple[pathlib.Path, pathlib.Path]:
    """``(onnx file, directory)`` for ``path``: a ``.onnx`` path, or a directory (``model.onnx`` inside).

    A directory that does not exist yet is created by the export, when its parent exists (checked here).

    Example::

        past_destination("out")          # (PosixPath('out/model.onnx'), PosixPath('out'))
    """
    path = pathlib.Path(path).expanduser()
    if path.suffix == ".onnx":
        return check_destination(path), path.parent
    if path.exists() and not path.is_dir():
        raise ExportError(
            f"export_onnx(past=True) writes a directory (model.onnx and genai_config.json) or a .onnx file; "
            f"{str(path)!r} is a file that does not end in .onnx."
        )
    if not path.exists():
        check_destination(path, what="the genai directory")  # its parent must exist and be writable
    else:
        check_destination(path / FILENAME)
    return path / FILENAME, path


def _example(model: nn.Module, layout: CacheLayout) -> tuple[torch.Tensor, ...]:
    """(ids, mask[, positions], *past) of one call with a past, on the model's device."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    b, s, p = _EXAMPLE["batch"], _EXAMPLE["sequence"], _EXAMPLE["past_sequence"]
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 2) or 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (b, s), generator=gen).to(device)  # (B, S)
    mask = torch.ones(b, p + s, dtype=torch.long, device=device)  # (B, P + S)
    positions = (torch.arange(p, p + s, device=device))[None].expand(b, s).contiguous()  # (B, S)
    shape = (b, layout.num_kv_heads, p, layout.head_size)  # (B, H_kv, P, D)
    past = [torch.randn(shape, generator=gen).to(device, layout.dtype) for _ in range(2 * layout.num_layers)]
    return (ids, mask, *([positions] if layout.position_ids else []), *past)


def _dynamic_shapes(layout: CacheLayout) -> tuple:
    """torch.export dims of ``_WithPast``: batch, sequence, past_sequence and total_sequence, named."""
    dim = {name: torch.export.Dim(name, min=low) for name, low in DIMS.items()}
    tokens = {0: dim["batch"], 1: dim["sequence"]}
    rest = ([tokens] if layout.position_ids else []) + [{0: dim["batch"], 2: dim["past_sequence"]}] * (
        2 * layout.num_layers
    )
    return (tokens, {0: dim["batch"], 1: dim[TOTAL_SEQUENCE_AXIS]}, tuple(rest))


def export_with_past(model: nn.Module, path: str | os.PathLike, fold: bool = True) -> pathlib.Path:
    """Write the with-past ONNX file of ``model`` and ``genai_config.json`` beside it; returns the file.

    ``path`` is a directory (created when missing; the file is ``model.onnx`` inside) or a ``.onnx`` path.
    Raises :class:`~kha_compile.core.errors.NoKVCacheError` / :class:`~kha_compile.core.errors.CacheLayoutError`
    for a model whose cache the file cannot express, before anything is written, and
    :class:`~kha_compile.core.errors.ExportError` naming the step for the rest.

    Example::

        export_with_past(model, "out")    # out/model.onnx, out/genai_config.json
    """
    onnx_path, directory = past_destination(path)
    import_onnx()
    layout = cache_layout(model)
    config = genai_config(model, layout, onnx_path.name)  # its errors come before any file
    name = type(model).__name__
    args = _example(model, layout)
    metadata = kha_metadata(model, (), {"input_ids": args[0], "use_cache": False}, folded=fold)
    metadata[METADATA_PREFIX + "cache"] = json.dumps({"kind": "dynamic", **layout.as_dict()}, sort_keys=True)
    target = model
    if fold and any("kha" in n for n, _ in model.named_parameters()):
        target = copy.deepcopy(model)  # the caller's model keeps its KHA
        fold_pass(target, strict=False)
        log.info("folded the linear KHA of a copy of %s before export", name)
    with warnings.catch_warnings():  # each named Dim is used by several inputs, as intended
        warnings.filterwarnings("ignore", message=r"# The axis name: .* will not be used")
        program, num_custom = export_program(_WithPast(target, layout), args, {}, _dynamic_shapes(layout))
    ir_model = program.model
    inputs = ["input_ids", "attention_mask", *(["position_ids"] if layout.position_ids else []), *layout.past_names()]
    rename_io(ir_model, None, name, inputs, ["logits", *layout.present_names()])
    ir_model.metadata_props.update(metadata)
    if not directory.exists():
        directory.mkdir()
        log.info("created the genai directory %s", directory)
    save_and_check(program, onnx_path, name, num_custom)
    write_genai_config(directory, config)
    log.info("wrote %s and %s/genai_config.json (KV cache: %s)", onnx_path, directory, layout.as_dict())
    return onnx_path
