"""Linear-attention kernels kept whole in the trace: one ``kha::linear_attention_kernel`` op per call.

The linear-attention layers of hybrid LLMs call a kernel on their q, k, v heads: the gated delta
rule (Qwen3-Next, Qwen3.5, OLMo hybrid: ``torch_chunk_gated_delta_rule`` and its recurrent form,
or flash-linear-attention's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``),
Kimi's delta attention (``chunk_kimi_delta_attention``, fla's ``chunk_kda``), and any other
``fla.ops`` kernel whose first three arguments are q, k, v. Traced through, such a kernel is
hundreds of ops (a chunked scan, a triangular solve written as a loop) in which q, k and v mix
with each other; traced as one op, it is an attention call like SDPA: its arguments are the
q, k, v heads, laid out (B, S, H, D).

While the analysis traces a model, :func:`opaque_kernels` replaces every such function that the
model's own modules name at module level with a wrapper that calls the op (its fake
implementation gives the output shapes), and puts the originals back afterwards. The model is
never run this way: the op exists for the graph, where the ``linear_kernel`` rule anchors on it.

Example::

    with opaque_kernels(model):
        exported = torch.export.export(model, args, kwargs, strict=False)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["KERNEL_FORMS", "kernel_form", "linear_attention_kernel", "opaque_kernels"]

log = logging.getLogger(__name__)

# function name -> the attention form it computes (transformers' torch implementations and fla's kernels)
KERNEL_FORMS: dict[str, str] = {
    "torch_chunk_gated_delta_rule": "gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "gated_delta_rule",
    "chunk_gated_delta_rule": "gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "gated_delta_rule",
    "chunk_kimi_delta_attention": "kimi_delta_attention",
    "recurrent_kimi_delta_attention": "kimi_delta_attention",
    "chunk_kda": "kimi_delta_attention",
    "fused_recurrent_kda": "kimi_delta_attention",
}
_QKV_NAMES = (("q", "k", "v"), ("query", "key", "value"))

_LOCK = threading.RLock()


@torch.library.custom_op("kha::linear_attention_kernel", mutates_args=())
def linear_attention_kernel(q: Tensor, k: Tensor, v: Tensor, others: list[Tensor], form: str) -> tuple[Tensor, Tensor]:
    """A linear-attention kernel call as one op: (output (B, S, Hv, Dv), final state (B, Hv, Dk, Dv)).

    ``others`` are the kernel's other tensor arguments (gates, decays, an initial state): inputs of
    the op so the graph shows what the output depends on. The op stands for the kernel in a trace
    on fake tensors only; it has no computation of its own.

    Example::

        out, state = torch.ops.kha.linear_attention_kernel(q, k, v, [g, beta], "gated_delta_rule")
    """
    raise RuntimeError(
        f"kha::linear_attention_kernel ({form}) stands for a kernel only while kha_compile traces a model; "
        "it does not run"
    )


@linear_attention_kernel.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, others: list[Tensor], form: str) -> tuple[Tensor, Tensor]:
    b, s, hv, dv = v.shape
    return v.new_empty((b, s, hv, dv)), v.new_empty((b, hv, k.shape[-1], dv), dtype=torch.float32)


def kernel_form(fn: Any) -> str | None:
    """The attention form of a kernel function kha_compile keeps whole in the trace, or None.

    Example::

        kernel_form(modeling_qwen3_next.torch_chunk_gated_delta_rule)     # "gated_delta_rule"
    """
    if not callable(fn) or isinstance(fn, (type, nn.Module)):
        return None
    name = getattr(fn, "__name__", "")
    if name in KERNEL_FORMS:
        return KERNEL_FORMS[name]
    module = getattr(fn, "__module__", "") or ""
    if module.startswith("fla.ops."):
        try:
            params = list(inspect.signature(fn).parameters)[:3]
        except (TypeError, ValueError):
            return None
        if tuple(params) in _QKV_NAMES:
            return f"fla.{name}"
    return None


def _wrapper(fn: Callable[..., Any], form: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def opaque(*args: Any, **kwargs: Any) -> Any:
        names = ("q", "k", "v")
        qkv = list(args[:3])
        for i in range(len(qkv), 3):  # passed by keyword (either naming)
            qkv.append(kwargs.pop(names[i], None) if names[i] in kwargs else kwargs.pop(_QKV_NAMES[1][i], None))
        others = [a for a in (*args[3:], *kwargs.values()) if isinstance(a, Tensor)]
        out, state = torch.ops.kha.linear_attention_kernel(*qkv, others, form)
        return out, (state if kwargs.get("output_final_state") else None)

    opaque.__kha_opaque__ = True  # type: ignore[attr-defined]
    return opaque


def _model_modules(model: nn.Module) -> list[Any]:
    names = {type(m).__module__ for m in model.modules()}
    return [sys.modules[n] for n in sorted(names) if n in sys.modules]


@contextlib.contextmanager
def opaque_kernels(model: nn.Module) -> Iterator[list[str]]:
    """For the duration of a trace, the linear-attention kernels the model's modules call, as one op each.

    Yields the qualified names of the functions replaced (empty for a model that calls none).

    Example::

        with opaque_kernels(model) as replaced:
            exported = torch.export.export(model, args, kwargs, strict=False)
    """
    swaps: list[tuple[Any, str, Any]] = []
    with _LOCK:
        for module in _model_modules(model):
            for attr, value in list(vars(module).items()):
                if getattr(value, "__kha_opaque__", False):
                    continue
                form = kernel_form(value)
                if form is not None:
                    swaps.append((module, attr, value))
                    setattr(module, attr, _wrapper(value, form))
        if swaps:
            log.debug("tracing %d linear-attention kernels as one op each", len(swaps))
        try:
            yield [f"{m.__name__}.{a}" for m, a, _ in swaps]
        finally:
            for module, attr, value in reversed(swaps):
                setattr(module, attr, value)
