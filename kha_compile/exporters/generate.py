"""Greedy generation from the exported files: onnxruntime, AOTInductor and TensorRT, one loop for all three.

:func:`greedy` is the loop (argmax of the last logits, one token per step, as transformers'
``generate(do_sample=False)``); each target gives it a step ``(new_ids, start) -> logits``:

- :func:`generate_onnx`: a plain onnxruntime session over the with-past ONNX file
  (``export_onnx(past=True)``), the cache fed back from ``present.N.*`` to ``past_key_values.N.*``;
- :func:`generate_aoti`: the generation package (``export_aoti(generation=True)``), whose static cache
  lives inside it; a call that would pass its cache is refused with
  :class:`~kha_compile.core.errors.CacheOverflowError` before the package runs;
- :func:`generate_tensorrt`: a TensorRT engine built from the with-past ONNX file (needs TensorRT and
  an NVIDIA GPU).

onnxruntime-genai needs no loop of ours: ``onnxruntime_genai.Model(directory)`` reads the
``genai_config.json`` beside the ONNX file. Prompts of one batch have one length (no padding).

Example::

    kc.export_onnx(model, "genai", past=True)
    tokens = generate_onnx("genai/model.onnx", prompt, max_new_tokens=16)   # (B, P + 16)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..core.errors import CacheOverflowError, ExportError
from ..core.optional import require
from .aoti import read_aoti_metadata
from .kv_cache import PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE
from .tensorrt_run import EngineRunner

__all__ = ["PastStep", "generate_aoti", "generate_genai", "generate_onnx", "generate_tensorrt", "greedy"]

log = logging.getLogger(__name__)

Step = Callable[[torch.Tensor, int], torch.Tensor]  # (new ids (B, s), start position) -> logits (B, s, V)
_ORT_DTYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(double)": torch.float64}


def greedy(
    step: Step,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
) -> torch.Tensor:
    """Greedy decoding: the prompt through ``step`` once, then one token per call; returns (B, P + new).

    With ``eos_token_id`` a sequence that produced it gets ``pad_token_id`` (default: the first eos id)
    from then on, and the loop stops when every sequence has, as transformers' ``generate`` does.

    Example::

        tokens = greedy(lambda ids, start: model(ids, ...).logits, prompt, 8)
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1 or max_new_tokens < 0:
        raise ExportError(
            f"generation takes input_ids of shape (batch, prompt length >= 1) and max_new_tokens >= 0; got "
            f"{tuple(input_ids.shape)} and {max_new_tokens}."
        )
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []))
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    tokens = input_ids.to(torch.long).cpu()
    done = torch.zeros(tokens.shape[0], dtype=torch.bool)
    new, start = input_ids, 0  # what the next step feeds: the prompt, then one token at a time
    for _ in range(max_new_tokens):
        logits = step(new, start)
        nxt = logits[:, -1].float().argmax(-1).to(torch.long).cpu()  # (B,)
        if len(eos):
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            done |= torch.isin(nxt, eos)
        start = tokens.shape[1]
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        if bool(done.all()):
            break
        new = nxt[:, None].to(input_ids.device)
    return tokens


class PastStep:
    """A :data:`Step` over a with-past file: feeds ``past_key_values.N.*`` back from ``present.N.*``.

    ``run(feeds) -> {name: tensor}`` runs the file once; ``inputs`` maps the file's input names to their
    shape (a str or -1 for a dynamic axis) and torch dtype. The first call passes an empty past.

    Example::

        step = PastStep(run, {"input_ids": (("batch", "sequence"), torch.int64), ...}, batch=1)
        logits = step(prompt, 0)
    """

    def __init__(self, run: Callable[[dict[str, torch.Tensor]], Mapping[str, Any]], inputs: dict, batch: int) -> None:
        self.run, self.inputs = run, inputs
        self.past: dict[str, torch.Tensor] = {}
        self.present: dict[str, str] = {}
        for i in range(len(inputs)):
            for past, present in ((PAST_KEY % i, PRESENT_KEY % i), (PAST_VALUE % i, PRESENT_VALUE % i)):
                if past in inputs:
                    shape, dtype = inputs[past]
                    heads, head_size = (int(d) for d in (shape[1], shape[3]))
                    self.past[past] = torch.zeros(batch, heads, 0, head_size, dtype=dtype)  # (B, H_kv, 0, D)
                    self.present[past] = present
        if not self.past or "input_ids" not in inputs:
            raise ExportError(
                f"this file takes {sorted(inputs)}: no input_ids and past_key_values.N.key/value, so it was not "
                "written by export_onnx(past=True)."
            )

    def __call__(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        b, s = ids.shape
        feeds = {"input_ids": ids, **self.past}
        if "attention_mask" in self.inputs:
            feeds["attention_mask"] = torch.ones(b, start + s, dtype=torch.long)  # (B, past + S)
        if "position_ids" in self.inputs:
            feeds["position_ids"] = torch.arange(start, start + s)[None].expand(b, s)  # (B, S)
        out = self.run(feeds)
        self.past = {past: torch.as_tensor(out[present]) for past, present in self.present.items()}
        return torch.as_tensor(out["logits"])


def generate_onnx(
    path: str | os.PathLike,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    session: Any = None,
) -> torch.Tensor:
    """Greedy tokens from a with-past ONNX file in a plain onnxruntime session (CPU unless ``session`` is given).

    Example::

        generate_onnx("genai/model.onnx", torch.tensor([[5, 17, 33]]), 8)    # (1, 11)
    """
    if session is None:
        ort = require("onnxruntime", why="generate_onnx")
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = {i.name: (tuple(i.shape), _ORT_DTYPES.get(i.type, torch.int64)) for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]

    def run(feeds: dict[str, torch.Tensor]) -> dict[str, Any]:
        arrays = {k: v.contiguous().numpy() for k, v in feeds.items()}
        return {n: torch.from_numpy(a) for n, a in zip(names, session.run(None, arrays))}

    step = PastStep(run, inputs, input_ids.shape[0])
    return greedy(step, input_ids.cpu(), max_new_tokens, eos_token_id, pad_token_id)


def generate_aoti(
    path: str | os.PathLike,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    runner: Any = None,
) -> torch.Tensor:
    """Greedy tokens from a generation package (``export_aoti(generation=True)``); ``runner``: one already loaded.

    Raises :class:`~kha_compile.core.errors.CacheOverflowError` (before the package runs) when the prompt
    and the new tokens pass the package's ``max_cache_len``, or the batch its ``max_batch``.

    Example::

        generate_aoti("gen.pt2", torch.tensor([[5, 17, 33]]), 8)             # (1, 11)
    """
    meta = read_aoti_metadata(path)
    cache = meta.get("cache") or {}
    if cache.get("kind") != "static":
        raise ExportError(
            f"{str(path)!r} is not a generation package (no static KV cache in its metadata); write one with "
            "kc.export_aoti(model, path, generation=True)."
        )
    b, p = input_ids.shape
    need = p + max(max_new_tokens - 1, 0)  # the last token is never fed back
    if need > cache["max_cache_len"] or b > cache["max_batch"]:
        raise CacheOverflowError(
            f"{b} prompt(s) of {p} tokens + {max_new_tokens} new tokens need {b} x {need} cache positions; the "
            f"package {str(path)!r} holds {cache['max_batch']} x {cache['max_cache_len']}. Generate fewer tokens, or "
            f"export with a larger max_cache_len / max_batch."
        )
    if runner is None:
        runner = torch._inductor.aoti_load_package(str(path))

    def step(ids: torch.Tensor, start: int) -> torch.Tensor:
        out = runner(ids, torch.arange(start, start + ids.shape[1], device=ids.device))
        return out[0] if isinstance(out, (list, tuple)) else out

    with torch.no_grad():
        return greedy(step, input_ids, max_new_tokens, eos_token_id, pad_token_id)


def generate_tensorrt(
    engine_path: str | os.PathLike,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
) -> torch.Tensor:
    """Greedy tokens from a TensorRT engine built from a with-past ONNX file (needs TensorRT and a GPU).

    Build the engine with the past length in its profile, e.g. ``kc.export_tensorrt("genai/model.onnx",
    "llm.engine", dim_ranges={"sequence": (1, 1, 512), "past_sequence": (0, 511, 4095)})``.

    Example::

        generate_tensorrt("llm.engine", torch.tensor([[5, 17, 33]]), 8)      # (1, 11)
    """
    runner = EngineRunner(engine_path)
    step = PastStep(runner, runner.inputs, input_ids.shape[0])
    return greedy(step, input_ids, max_new_tokens, eos_token_id, pad_token_id)


def generate_genai(
    directory: str | os.PathLike,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    model: Any = None,
) -> torch.Tensor:
    """Greedy tokens from onnxruntime-genai over the directory of ``export_onnx(past=True)``; ``model``: an
    ``onnxruntime_genai.Model`` already loaded. Stops at the eos ids of its ``genai_config.json``.

    Example::

        generate_genai("genai", torch.tensor([[5, 17, 33]]), 8)            # (1, 11) or shorter at eos
    """
    og = require("onnxruntime_genai", why="generate_genai")
    if model is None:
        model = og.Model(str(directory))
    b, p = input_ids.shape
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=p + max_new_tokens, do_sample=False, batch_size=b)
    generator = og.Generator(model, params)
    generator.append_tokens(input_ids.to(torch.int32).cpu().numpy())
    while not generator.is_done():
        generator.generate_next_token()
    rows = [torch.from_numpy(np.asarray(generator.get_sequence(i))).to(torch.long) for i in range(b)]
    return torch.stack(rows)
