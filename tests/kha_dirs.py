"""Trained tiny KHA models saved as transformers directories, for the loading-by-path tests.

``trained(name, cfg)`` is a tiny Llama or Qwen3 (kha_compile.cli.tiny: hidden 64, 2 layers, 4 query and
2 key/value heads of 16, vocabulary 128) with KHA applied and perturbed off identity, as training
leaves it. ``save(model, directory)`` writes it with ``model.save_pretrained`` and a word-level
tokenizer over :data:`WORDS` (pipelines and lm-evaluation-harness load one from the directory).
:data:`IDS` has more tokens (2 x 40) than the model has features (64), so linear KHA runs weight-side.
"""

from __future__ import annotations

import copy
import pathlib

import torch
from torch import nn

import kha_compile as kc
from helpers import perturb
from kha_compile.cli import tiny

LINEAR = kc.KHAConfig(q="linear", k="linear", v="linear")
MLP = kc.KHAConfig(q="linear", v="mlp")
IDS = torch.randint(0, tiny.VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
WORDS = tuple(
    [
        "the",
        "a",
        "cat",
        "dog",
        "sat",
        "ran",
        "on",
        "under",
        "mat",
        "sun",
        "tree",
        "house",
        "red",
        "blue",
        "green",
        "big",
        "small",
        "one",
        "two",
        "three",
        "is",
        "was",
        "and",
        "bird",
        "fish",
        "water",
        "sky",
        "door",
        "car",
        "road",
        "hill",
    ]
)


def plain(name: str, **config) -> nn.Module:
    """The tiny model ``name`` ("llama" or "qwen3") without KHA, seeded weights (``config``: overrides)."""
    if not config:
        return tiny.make(f"tiny-{name}")
    extra = {"head_dim": tiny.HEAD_DIM} if name == "qwen3" else {}
    fields = dict(tiny.DECODER, num_key_value_heads=2, **extra, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.SEED)
        model = tiny.hf_model(f"{name.capitalize()}ForCausalLM", f"{name.capitalize()}Config", **fields)
    return model.eval()


def trained(name: str, cfg: kc.KHAConfig, **config) -> nn.Module:
    """:func:`plain` with KHA ``cfg`` applied and moved off identity (every role, every tensor)."""
    model = plain(name, **config)
    kc.apply(model, cfg)
    perturb(model, scale=0.2)
    return model


def tokenizer():
    """A word-level fast tokenizer over :data:`WORDS` (ids below the tiny vocabulary), with bos/eos/pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<pad>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def save(model: nn.Module, directory: pathlib.Path, **kwargs) -> pathlib.Path:
    """``model.save_pretrained(directory, **kwargs)`` and the tokenizer next to it."""
    model.save_pretrained(directory, **kwargs)
    tokenizer().save_pretrained(directory)
    return directory


def in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` in ``dtype`` as ``from_pretrained(..., dtype=dtype)`` builds it: every weight in
    ``dtype``, the rotary frequencies (buffers ``*inv_freq``, not in the checkpoint) computed in float32."""
    out = copy.deepcopy(model).to(dtype)
    for name, buf in model.named_buffers():
        if name.endswith("inv_freq"):
            owner, _, attr = name.rpartition(".")
            setattr(out.get_submodule(owner), attr, buf.clone())
    return out


def logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits
