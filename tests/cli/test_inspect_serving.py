"""``kha-compile inspect DIR`` on a saved model directory: the sites, and whether and how vLLM serves it."""

from __future__ import annotations

import json

import pytest
from cli_cases import run

import kha_compile as kc
from helpers import perturb
from kha_compile.cli import tiny

pytest.importorskip("transformers")


def _saved(tmp_path, cfg: kc.KHAConfig | None):
    model = tiny.make("tiny-llama")  # head size 16: vLLM's CPU attention does not take it
    if cfg is not None:
        kc.apply(model, cfg)
        perturb(model, scale=0.2)
    model.save_pretrained(tmp_path / "saved")
    return tmp_path / "saved"


def test_inspect_says_vllm_needs_the_plugin_for_mlp_value(capsys, tmp_path):
    code, out, _ = run(capsys, "inspect", str(_saved(tmp_path, kc.KHAConfig(v="mlp"))))
    assert code == 0
    assert "2 attention sites matched" in out  # the report, as for any model
    assert "serving in vLLM: yes" in out and "kha-compile[vllm]" in out and "v: MLP-value" in out
    assert "refuses head size 16" in out  # said up front


def test_inspect_json_carries_the_vllm_advice(capsys, tmp_path):
    code, out, _ = run(capsys, "inspect", str(_saved(tmp_path, None)), "--json")
    assert code == 0
    data = json.loads(out[out.index("{") :])
    assert data["vllm"]["servable"] is True and data["vllm"]["needs_plugin"] is False
    assert "serves it as it is" in data["vllm"]["lines"][0]


def test_inspect_of_a_tiny_model_name_has_no_vllm_section(capsys):
    code, out, _ = run(capsys, "inspect", "tiny-llama")
    assert code == 0 and "serving in vLLM" not in out
