"""Tiny decoder LMs with trained-like KHA, saved as users save them, and their greedy tokens in transformers.

Each :class:`Case` builds one architecture from a tiny config (random weights, head size 32: vLLM's
CPU attention refuses 16), applies KHA, perturbs every KHA weight off its identity init (as training
would), saves the directory and generates greedily with transformers' ``generate`` on the KHA model:
the reference vLLM's tokens are compared with. Per generated token it also records the margin between
the two best logits, so a comparison can tell a near-tie (float rounding between two engines) from
a real difference.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable
from typing import Any

import torch
import transformers
from serve_greedy import greedy  # noqa: F401  (re-exported for the tests)
from torch import nn

import kha_compile as kc
from helpers import perturb

HEAD_DIM = 32
VOCAB = 128
BLOCK = 32  # the KV-cache block size the tests ask vLLM for (its CPU kernels take multiples of 32)
# three prompts in one batch: two share a 70-token prefix (more than two KV blocks, so the prefix cache
# holds two full blocks of it), one is short; vocab ids only, no tokenizer
_PREFIX = [(7 * i + 3) % (VOCAB - 3) + 3 for i in range(70)]
PROMPTS = [[*_PREFIX, 11, 12, 13, 14, 15], [*_PREFIX, 41, 40, 39, 38, 37, 36, 35, 34, 33], [5, 9, 20, 30, 44, 61, 77]]


def _common(heads: int, kv: int, head_dim: int, **extra: Any) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=512,
        initializer_range=0.15,  # logits far enough apart that greedy tokens are not near-ties
        tie_word_embeddings=False,
        **extra,
    )


_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
# architecture -> (model class, config class, extra config); heads, kv heads and head size come from the Case
ARCHS: dict[str, tuple[Callable[..., nn.Module], Callable[..., Any], dict[str, Any]]] = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {}),  # q/k/v with bias
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {}),  # QK-norm after the projections
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, _MOE),
    "olmo2": (transformers.Olmo2ForCausalLM, transformers.Olmo2Config, {}),  # not served by the plugin
    "qwen3_next": (  # a gated-delta-rule layer and a full-attention layer: refused by the plugin, with the reason
        transformers.Qwen3NextForCausalLM,
        transformers.Qwen3NextConfig,
        dict(
            layer_types=["linear_attention", "full_attention"],
            mlp_only_layers=[0, 1],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
        ),
    ),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One saved model: architecture, heads, KHA config and how it is saved.

    ``save``: "hf" (model.save_pretrained of the KHA model), "kc" (the base model's own files, then
    kc.save_pretrained of the KHA into the same directory), "folded" (kc.fold, then save_pretrained).
    """

    name: str
    arch: str
    cfg: kc.KHAConfig
    heads: int = 4
    kv: int = 2
    save: str = "hf"
    seed: int = 0
    head_dim: int = HEAD_DIM


def build(case: Case, root: pathlib.Path) -> tuple[pathlib.Path, nn.Module]:
    """Build, apply KHA, perturb and save ``case`` under ``root``; returns the directory and the model."""
    torch.manual_seed(case.seed)
    model_cls, config_cls, extra = ARCHS[case.arch]
    model = model_cls(config_cls(**_common(case.heads, case.kv, case.head_dim, **extra))).eval()
    directory = root / case.name
    if case.save == "kc":
        model.save_pretrained(directory)  # the base model's files, without KHA
    kc.apply(model, case.cfg)
    perturb(model, seed=case.seed + 1, scale=0.3)
    if case.save == "hf":
        model.save_pretrained(directory)
        kc.save_pretrained(model, directory)  # both writers, as a user who calls both would
    elif case.save == "kc":
        kc.save_pretrained(model, directory)
    else:
        kc.fold(model)
        model.save_pretrained(directory)
    return directory, model


def write_config_entry(directory: pathlib.Path, **changes: Any) -> None:
    """Change top-level entries of ``directory/config.json`` (None deletes one)."""
    path = directory / "config.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=2))


TIE = 1e-3  # logit margins below this are near-ties: two engines' float rounding may pick either token


def mismatch(reference: list[dict[str, list]], got: list[list[int]]) -> tuple[str, int]:
    """Where ``got`` (greedy tokens per prompt) departs from transformers' ``reference``, and how many tokens agreed.

    At a near-tie (margin < :data:`TIE`) the engines may legitimately pick different tokens; the
    comparison of that prompt stops there. Any other difference is reported.
    """
    problems, compared = [], 0
    for i, (ref, tokens) in enumerate(zip(reference, got)):
        if len(tokens) != len(ref["tokens"]):
            problems.append(f"prompt {i}: {len(tokens)} tokens, transformers {len(ref['tokens'])}")
            continue
        for j, (want, have) in enumerate(zip(ref["tokens"], tokens)):
            if want != have:
                if ref["margins"][j] >= TIE:
                    problems.append(
                        f"prompt {i}: token {j} is {have}, transformers gives {want} (logit margin {ref['margins'][j]:.3g})"
                    )
                break
            compared += 1
    return "; ".join(problems), compared
