"""Tiny transformers models with random weights, for the CLI, examples and benchmarks.

Each has hidden size 64, 2 layers, 4 query heads of size 16 and a vocabulary of 128, so a full
apply / fold / export round trip takes a second or two on a CPU. Weights come from a fixed seed:
two calls of :func:`make` with the same name give the same model.

Example::

    from kha_compile import tiny
    model = tiny.make("tiny-llama")           # LlamaForCausalLM, GQA 4 q / 2 kv heads
    sorted(tiny.TINY_MODELS)                  # ['tiny-bert', 'tiny-gpt2', 'tiny-llama', 'tiny-qwen3']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core.errors import MissingDependencyError, ModelLoadError

__all__ = [
    "DECODER",
    "HEADS",
    "HEAD_DIM",
    "HIDDEN",
    "INTER",
    "LAYERS",
    "MAX_POS",
    "TINY_MODELS",
    "VOCAB",
    "hf_model",
    "make",
]

SEED = 0
HIDDEN, LAYERS, HEADS, INTER, VOCAB, MAX_POS = 64, 2, 4, 128, 128, 64
HEAD_DIM = HIDDEN // HEADS  # 16

# the config fields every tiny decoder shares (transformers names)
DECODER: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=INTER,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    max_position_embeddings=MAX_POS,
)


def hf_model(model_cls: str, config_cls: str, attn: str = "sdpa", **config: Any) -> nn.Module:
    """``transformers.<model_cls>`` built from ``transformers.<config_cls>(**config)``, random weights.

    Example::

        hf_model("LlamaForCausalLM", "LlamaConfig", **DECODER, num_key_value_heads=2)
    """
    try:
        import transformers
    except ImportError as e:
        raise MissingDependencyError("the tiny models are transformers models: pip install 'kha-compile[hf]'") from e
    cfg = getattr(transformers, config_cls)(**config)
    return getattr(transformers, model_cls)._from_config(cfg, attn_implementation=attn)


def _llama() -> nn.Module:  # GQA: 4 query heads, 2 key/value heads, rope
    return hf_model("LlamaForCausalLM", "LlamaConfig", **DECODER, num_key_value_heads=2)


def _qwen3() -> nn.Module:  # GQA with per-head q/k RMSNorm before rope
    return hf_model("Qwen3ForCausalLM", "Qwen3Config", **DECODER, num_key_value_heads=2, head_dim=HEAD_DIM)


def _gpt2() -> nn.Module:  # fused c_attn (Conv1D, weight stored (in, out)) split [Q|K|V]
    return hf_model(
        "GPT2LMHeadModel",
        "GPT2Config",
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=INTER,
        n_positions=MAX_POS,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )


def _bert() -> nn.Module:  # encoder, separate query/key/value, no rope
    return hf_model(
        "BertModel",
        "BertConfig",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTER,
        max_position_embeddings=MAX_POS,
    )


TINY_MODELS: dict[str, Callable[[], nn.Module]] = {
    "tiny-llama": _llama,
    "tiny-qwen3": _qwen3,
    "tiny-gpt2": _gpt2,
    "tiny-bert": _bert,
}


def make(name: str) -> nn.Module:
    """Build the tiny model ``name`` (one of :data:`TINY_MODELS`) in eval mode, seeded weights."""
    try:
        factory = TINY_MODELS[name]
    except KeyError:
        raise ModelLoadError(f"unknown tiny model {name!r}; choose one of {', '.join(sorted(TINY_MODELS))}.") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = factory()
    return model.eval()
