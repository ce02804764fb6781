"""kha_compile.serving.vllm.advice: whether and how vLLM can serve a saved directory (``kha-compile inspect DIR``)."""

from __future__ import annotations

import importlib.metadata

import pytest
from serve_models import Case, build

import kha_compile as kc
from kha_compile.serving.vllm import PLUGIN_ENTRY_POINT, plugin_status, vllm_advice

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("advice")
    cases = [
        Case("mlp", "llama", kc.KHAConfig(v="mlp"), heads=2, kv=1),
        Case("linear", "qwen2", kc.KHAConfig(q="linear", v="linear"), heads=2, kv=1),
        Case("folded", "llama", kc.KHAConfig(v="linear"), heads=2, kv=1, save="folded"),
        Case("olmo2", "olmo2", kc.KHAConfig(v="mlp"), heads=2, kv=1),
        Case("hd16", "llama", kc.KHAConfig(v="mlp"), heads=2, kv=1, head_dim=16),
    ]
    return {c.name: build(c, root)[0] for c in cases}


def test_mlp_value_needs_the_plugin(saved):
    advice = vllm_advice(saved["mlp"])
    assert advice.servable and advice.needs_plugin
    text = "\n".join(advice.lines)
    assert "v: MLP-value" in text and "kha-compile[vllm]" in text and f"vllm serve {saved['mlp']}" in text
    assert "does not fold: without the plugin vLLM refuses" in text


def test_linear_serves_with_the_plugin_or_folded(saved):
    advice = vllm_advice(saved["linear"])
    assert advice.servable and advice.needs_plugin
    assert any("folds it into the QKV weights at load" in line and "kc.fold(model)" in line for line in advice.lines)


def test_a_folded_model_serves_as_it_is(saved):
    advice = vllm_advice(saved["folded"])
    assert advice.servable and not advice.needs_plugin
    assert "serves it as it is" in advice.lines[0]


def test_what_vllm_cannot_serve_says_why(saved, tmp_path):
    advice = vllm_advice(saved["olmo2"])
    assert not advice.servable and "Olmo2ForCausalLM" in advice.lines[0]
    advice = vllm_advice(tmp_path)  # no model here at all
    assert not advice.servable and "no config.json" in advice.lines[0]


def test_head_size_16_only_on_a_gpu_build(saved):
    line = vllm_advice(saved["hd16"]).lines[0]
    assert "CPU attention refuses head size 16" in line and "only a GPU build can" in line


def test_plugin_status_reads_installed_metadata_without_importing_vllm():
    version, registered = plugin_status()
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert registered == any(p.value == PLUGIN_ENTRY_POINT for p in points)
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert version is None  # this environment has no vLLM (it lives in its own, scripts/vllm_env.sh)
