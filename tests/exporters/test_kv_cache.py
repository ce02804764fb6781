"""kha_compile.exporters.kv_cache: the cache layout read from one forward, and what it refuses (with why).

The layout is checked against the transformers config each zoo model was built from (an independent
source: the cache is read from a forward, the config is what the model was made with).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kha_compile as kc
import zoo
from helpers import kha_params, perturb
from kha_compile.core.errors import CacheLayoutError, ExportError, NoKVCacheError
from kha_compile.exporters.kv_cache import cache_layout

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2", "mistral"])
def test_layout_is_the_configs(name):
    model = zoo.make(name).model
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layout = cache_layout(model)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_size) == (cfg.num_hidden_layers, kv_heads, head)
    assert layout.dtype == torch.float32 and layout.position_ids
    assert layout.past_names()[:2] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert layout.present_names()[-1] == f"present.{cfg.num_hidden_layers - 1}.value"


def test_layout_of_a_model_with_kha_is_unchanged_and_the_model_too():
    model = zoo.make("llama").model
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"))
    perturb(model)
    before = {n: p.detach().clone() for n, p in kha_params(model).items()}
    model.train()
    layout = cache_layout(model)
    assert (layout.num_kv_heads, layout.head_size) == (2, zoo.HEAD_DIM)
    assert model.training, "the probe must restore the training flag"
    assert all(torch.equal(before[n], p) for n, p in kha_params(model).items())


@pytest.mark.parametrize(
    "name, error, match",
    [
        ("bert", NoKVCacheError, "returned no KV cache"),  # an encoder
        ("t5", CacheLayoutError, "encoder-decoder"),
        ("gemma2", CacheLayoutError, r"sliding-window attention keeps only the last 16 positions"),
        ("deepseek_v3", CacheLayoutError, r"keys of head size 32 and values of head size 8"),  # MLA latent cache
    ],
)
def test_refused_layouts_say_what_they_are(name, error, match):
    with pytest.raises(error, match=match):
        cache_layout(zoo.make(name).model)


def test_a_module_without_a_cache_argument_has_no_kv_cache():
    with pytest.raises(NoKVCacheError, match=r"no `cache` / `past_key_values` argument and it has no transformers"):
        cache_layout(nn.Linear(4, 4))


def test_a_base_model_without_lm_head_is_refused():
    model = zoo.make("llama").model.model  # LlamaModel: a cache, but no logits
    with pytest.raises(ExportError, match="returns no logits"):
        cache_layout(model)


def test_a_meta_model_is_refused():
    with pytest.raises(ExportError, match="meta device"):
        cache_layout(zoo.make("llama", device="meta").model)
