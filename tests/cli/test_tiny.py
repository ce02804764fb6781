"""kha_compile.cli.tiny: seeded tiny models by name."""

from __future__ import annotations

import pytest
import torch

from kha_compile.cli import tiny
from kha_compile.core.errors import ModelLoadError

pytest.importorskip("transformers")


def test_make_is_seeded():
    a, b = tiny.make("tiny-llama"), tiny.make("tiny-llama")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert a.config.hidden_size == tiny.HIDDEN and a.config.vocab_size == tiny.VOCAB


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ModelLoadError, match="unknown tiny model 'tiny-nope'; choose one of tiny-bert, tiny-gpt2"):
        tiny.make("tiny-nope")
