"""AOTInductor packages that generate: prefill and one-token decode over a static KV cache held in the package.

``kc.export_aoti(model, path, generation=True)`` exports a transformers decoder LM through
:class:`StaticCacheLM`, a wrapper whose forward takes ``input_ids`` (batch, sequence) and
``cache_position`` (sequence,) — the positions of those tokens, ``arange(start, start + sequence)`` —
and returns the ``logits`` (batch, sequence, vocab). The keys and values of every layer live in
buffers of ``(max_batch, kv_heads, max_cache_len, head_size)`` inside the package, written in place
at ``cache_position`` by each call, so one compiled graph serves both steps:

- prefill: ``runner(prompt_ids, arange(P))``;
- decode: ``runner(next_id[:, None], tensor([P + t]))``, one token at a time.

Positions after the current one are masked out, so a new prompt starts again at position 0 without
clearing the cache. A call may use any batch from 1 to ``max_batch`` (the graph always computes
``max_batch`` rows: keep it at 1, the default, for one sequence at a time) and must keep ``start + sequence <= max_cache_len``: :func:`kha_compile.exporters.generate.generate_aoti`
refuses more with :class:`~kha_compile.core.errors.CacheOverflowError`, and the package itself stops
with "index out of bounds" (C++ ``std::runtime_error``) instead of writing outside its cache.
No attention mask: the rows of a batch are prompts of one length, without padding.

Example::

    path = kc.export_aoti(model, "gen.pt2", generation=True, max_cache_len=256)
    runner = torch._inductor.aoti_load_package(str(path))            # no kha_compile needed
    logits = runner(prompt, torch.arange(prompt.shape[1]))            # (B, P, vocab)
"""

from __future__ import annotations

import copy
import json
import logging
import pathlib
import time
from typing import Any

import torch
from torch import nn

from ..core.errors import CacheLayoutError, ExportError
from ..passes.fold import fold as fold_pass
from .aoti_steps import AOTI_TOL, compile_package, eval_mode, input_ranges, lower_kha_ops
from .common import root_reason
from .kv_cache import CacheLayout, cache_layout, model_config
from .metadata import METADATA_PREFIX, kha_metadata

__all__ = [
    "DEFAULT_MAX_CACHE_LEN",
    "GENERATION_INPUTS",
    "StaticCacheLM",
    "check_generation",
    "export_generation",
    "generation_example",
    "generation_shapes",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_CACHE_LEN = 1024  # or the model's max_position_embeddings, when that is smaller
GENERATION_INPUTS = ("input_ids", "cache_position")


class StaticCacheLM(nn.Module):
    """A decoder LM over a static KV cache in its own buffers: (input_ids, cache_position) -> logits.

    Example::

        lm = StaticCacheLM(model, cache_layout(model), max_batch=1, max_cache_len=64)
        logits = lm(prompt, torch.arange(prompt.shape[1]))
    """

    def __init__(self, model: nn.Module, layout: CacheLayout, max_batch: int, max_cache_len: int) -> None:
        super().__init__()
        import transformers

        self.model, self.layout = model, layout
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        try:
            cache: Any = transformers.StaticCache(config=model_config(model), max_cache_len=max_cache_len)
            cache.early_initialization(max_batch, layout.num_kv_heads, layout.head_size, layout.dtype, device)
        except Exception as e:
            raise ExportError(
                f"generation=True could not build transformers' StaticCache for {type(model).__name__}: "
                f"{root_reason(e)}"
            ) from e
        for i, layer in enumerate(cache.layers):
            if type(layer) is not transformers.StaticLayer or not hasattr(layer, "cumulative_length"):
                raise CacheLayoutError(
                    f"layer {i} of {type(model).__name__}'s static cache is a {type(layer).__name__}; the package's "
                    "cache is a plain StaticLayer per layer (transformers 5.x, with cumulative_length), so "
                    "sliding-window and shared-cache layers cannot be expressed."
                )
        self.cache: Any = cache
        self.max_batch = max_batch
        shape = (max_batch, layout.num_kv_heads, max_cache_len, layout.head_size)  # (B, H_kv, S_max, D)
        for i in range(layout.num_layers):
            self.register_buffer(f"key_cache_{i}", torch.zeros(shape, dtype=layout.dtype, device=device))
            self.register_buffer(f"value_cache_{i}", torch.zeros(shape, dtype=layout.dtype, device=device))

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        if self.max_batch > 1:
            # fewer rows than the cache: pad to max_batch (rows of token 0, dropped from the logits). Writing
            # into the first b rows of the buffers instead (a slice) compiles, with torch 2.13's Inductor, to a
            # copy-back that fills the other rows from uninitialized memory: NaN in them later.
            pad = input_ids.new_zeros(self.max_batch, s)  # not max_batch - b rows: a size 0 crashes the kernels
            input_ids = torch.cat([input_ids, pad])[: self.max_batch]  # (B_max, S)
        for i, layer in enumerate(self.cache.layers):
            layer.keys = getattr(self, f"key_cache_{i}")  # the traced buffers (export swaps them for its own)
            layer.values = getattr(self, f"value_cache_{i}")
            layer.cumulative_length = cache_position[0].clone()  # where this call writes (update adds in place)
        kwargs = {self.layout.cache_arg: self.cache, "use_cache": True}
        if self.layout.position_ids:
            kwargs["position_ids"] = cache_position.unsqueeze(0).expand(input_ids.shape[0], -1)  # (B_max, S)
        return self.model(input_ids=input_ids, **kwargs).logits[:b]


def generation_example(model: nn.Module, max_batch: int, max_cache_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, cache_position) of one prefill call: batch min(2, max_batch), 3 tokens (2 if the cache has 2)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    vocab = int(getattr(model_config(model), "vocab_size", 2) or 2)
    b, s = min(2, max_batch), min(3, max_cache_len)
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0)).to(device)  # (B, S)
    return ids, torch.arange(s, device=device)


def generation_shapes(max_batch: int, max_cache_len: int) -> Any:
    """torch.export dims of :class:`StaticCacheLM`: batch 1..max_batch (fixed at 1 when that is all), sequence."""
    seq = torch.export.Dim("sequence", min=1, max=max_cache_len)
    ids: dict[int, Any] = {1: seq}
    if max_batch > 1:
        ids[0] = torch.export.Dim("batch", min=1, max=max_batch)
    return {"input_ids": ids, "cache_position": {0: seq}}


def check_generation(runner: Any, model: nn.Module, ids: torch.Tensor, tol: float) -> float:
    """Prefill ``ids`` and decode one token with ``runner``; both logits against ``model`` without a cache.

    Returns the largest difference relative to max(1, max |logits|); ExportError when it passes ``tol``.
    """
    s = ids.shape[1]
    with torch.no_grad():
        got = [runner(ids, torch.arange(s, device=ids.device))]
        nxt = got[0][:, -1].argmax(-1, keepdim=True)  # (B, 1)
        got.append(runner(nxt, torch.tensor([s], device=ids.device)))
        full = model(input_ids=torch.cat([ids, nxt], 1), use_cache=False).logits  # (B, S + 1, V)
    worst = 0.0
    for step, (g, w) in enumerate(zip(got, (full[:, :s], full[:, s:]))):
        g = g[0] if isinstance(g, (list, tuple)) else g
        diff = float((g.float() - w.float()).abs().max()) / max(1.0, float(w.abs().max()))
        if g.shape != w.shape or not diff <= tol:
            raise ExportError(
                f"AOTI export of {type(model).__name__}, step 'check': the package's {('prefill', 'decode')[step]} "
                f"logits {tuple(g.shape)} differ from the model's {tuple(w.shape)} by {diff:.3g} (relative; tolerance "
                f"{tol})."
            )
        worst = max(worst, diff)
    return worst


def export_generation(
    model: nn.Module,
    path: pathlib.Path,
    fold: bool,
    max_batch: int,
    max_cache_len: int | None,
    inductor_configs: dict[str, Any] | None,
    check: bool,
) -> pathlib.Path:
    """export_aoti(generation=True): :class:`StaticCacheLM` of a (folded) copy, lowered, compiled, checked."""
    name = type(model).__name__
    layout = cache_layout(model)  # NoKVCacheError / CacheLayoutError before any work
    context = getattr(model_config(model), "max_position_embeddings", None)
    if max_cache_len is None:
        max_cache_len = min(DEFAULT_MAX_CACHE_LEN, context) if isinstance(context, int) else DEFAULT_MAX_CACHE_LEN
    if max_cache_len < 2 or max_batch < 1:
        raise ExportError(
            f"export_aoti(generation=True) needs max_cache_len >= 2 and max_batch >= 1; got {max_cache_len}, {max_batch}."
        )
    ids, positions = generation_example(model, max_batch, max_cache_len)
    metadata = kha_metadata(model, (), {"input_ids": ids, "use_cache": False}, folded=fold)
    cache = {"kind": "static", "max_cache_len": max_cache_len, "max_batch": max_batch, **layout.as_dict()}
    target = model
    if json.loads(metadata[METADATA_PREFIX + "folded"]):
        target = copy.deepcopy(model)
        fold_pass(target, strict=False)
    lm = StaticCacheLM(target, layout, max_batch, max_cache_len)
    shapes = generation_shapes(max_batch, max_cache_len)
    start = time.perf_counter()
    with eval_mode(target), torch.no_grad():
        try:
            program = torch.export.export(lm, (ids, positions), dynamic_shapes=shapes, strict=False)
        except Exception as e:
            raise ExportError(f"AOTI export of {name} (generation), step 'export' failed: {root_reason(e)}") from e
    program = lower_kha_ops(program)
    metadata.update(
        {
            METADATA_PREFIX + "format": "aoti",
            METADATA_PREFIX + "torch_version": torch.__version__,
            METADATA_PREFIX + "input_names": ",".join(GENERATION_INPUTS),
            METADATA_PREFIX + "output_names": "logits",
            METADATA_PREFIX + "dynamic_shapes": json.dumps(
                input_ranges(program, list(GENERATION_INPUTS)), sort_keys=True
            ),
            METADATA_PREFIX + "cache": json.dumps(cache, sort_keys=True),
        }
    )
    compile_package(program, path, metadata, inductor_configs, name)
    if check:
        try:
            runner = torch._inductor.aoti_load_package(str(path))
        except Exception as e:
            raise ExportError(
                f"AOTI export of {name}, step 'check': the package does not load: {root_reason(e)}"
            ) from e
        with eval_mode(model):
            diff = check_generation(runner, model, ids, AOTI_TOL)
        log.info("AOTI generation package vs the model: max relative |diff| %.3g", diff)
    log.info("AOTI export of %s (generation, %s) to %s in %.1f s", name, cache, path, time.perf_counter() - start)
    return path
