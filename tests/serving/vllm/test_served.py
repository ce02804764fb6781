"""kha_compile.serving.vllm.served: a saved directory read and checked for vLLM, without vLLM.

Every expected tensor comes from the trained model object itself (its named parameters), never from a
reload through the code under test; every refusal names what disagrees.
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from serve_models import Case, build, write_config_entry

import kha_compile as kc
from kha_compile.core.errors import CheckpointError, ServingError
from kha_compile.serving.vllm import CPU_HEAD_SIZES, SUPPORTED_ARCHITECTURES, check_servable, read_served
from kha_compile.store.hf import LEGACY_HINTS, quantization_entry

pytest.importorskip("transformers")

MIX = kc.KHAConfig(q="linear", k="linear", v="mlp")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (directory, trained model) for the directories these tests read."""
    root = tmp_path_factory.mktemp("saved")
    cases = [
        Case("mix", "llama", MIX, heads=2, kv=1),
        Case("kcsave", "qwen3", kc.KHAConfig(v="mlp"), heads=2, kv=1, save="kc"),
        Case("folded", "llama", kc.KHAConfig(v="linear"), heads=2, kv=1, save="folded"),
        Case("olmo2", "olmo2", kc.KHAConfig(v="linear"), heads=2, kv=1),
        Case("hd16", "llama", kc.KHAConfig(v="mlp"), heads=2, kv=1, head_dim=16),
    ]
    return {c.name: build(c, root) for c in cases}


def _copy(saved, name: str, tmp_path):
    target = tmp_path / name
    shutil.copytree(saved[name][0], target)
    return target


def _kha_params(model) -> dict:
    return {n: p.detach() for n, p in model.named_parameters() if ".kha." in n}


def test_a_save_pretrained_directory_is_read_with_its_trained_kha(saved):
    directory, model = saved["mix"]
    served = read_served(directory)
    assert (served.architecture, served.head_dim, served.has_kha) == ("LlamaForCausalLM", 32, True)
    assert served.config == MIX and not served.foldable
    assert sorted(served.attentions) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    params = _kha_params(model)
    for prefix, attention in served.attentions.items():
        assert attention.kinds == {"q": "linear", "k": "linear", "v": "mlp"}
        for role, names in (("q", ["weight"]), ("k", ["weight"]), ("v", ["up", "gate", "down"])):
            want = [params[f"{prefix}.{role}_proj.kha.{role}.{n}"] for n in names]
            assert all(a.equal(b) for a, b in zip(attention.tensors[role], want)), (prefix, role)


def test_kc_save_pretrained_into_the_models_directory_records_kha_in_its_config(saved):
    directory, model = saved["kcsave"]  # base files written before kc.apply, then kc.save_pretrained
    data = json.loads((directory / "config.json").read_text())
    assert data["kha_compile"]["v"] == "mlp" and data["quantization_config"] == quantization_entry(data["kha_compile"])
    assert not any(".kha." in k for k in load_file(str(directory / "model.safetensors")))  # base weights only
    served = read_served(directory)
    params = _kha_params(model)
    assert served.architecture == "Qwen3ForCausalLM" and len(served.attentions) == 2
    for prefix, attention in served.attentions.items():
        assert attention.tensors["v"][0].equal(params[f"{prefix}.v_proj.kha.v.up"])


def test_a_folded_directory_has_no_kha_and_needs_no_plugin(saved):
    served = read_served(saved["folded"][0])
    assert not served.has_kha and served.attentions == {} and served.config is None
    check_servable(served)  # nothing to refuse: vLLM serves it as it is


def test_the_quantization_method_names_kha_compile(saved):
    data = json.loads((saved["mix"][0] / "config.json").read_text())
    assert data["quantization_config"]["quant_method"] == "kha_compile"  # what vLLM without the plugin names
    assert {k: data["quantization_config"][k] for k in "qkv"} == {"q": "linear", "k": "linear", "v": "mlp"}


@pytest.mark.parametrize("entry", ["kha_compile", "quantization_config"])
def test_either_entry_alone_records_the_kha(saved, tmp_path, entry):
    d = _copy(saved, "mix", tmp_path)
    (d / "kha_config.json").unlink()
    write_config_entry(d, **{entry: None})  # the other one is left
    served = read_served(d)
    assert served.config == MIX and len(served.attentions) == 2


def test_refused_without_a_config_json(tmp_path):
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        read_served(tmp_path)


def test_kha_tensors_without_a_config_saying_how_to_run_them(saved, tmp_path):
    d = _copy(saved, "mix", tmp_path)
    (d / "kha_config.json").unlink()
    write_config_entry(d, kha_compile=None, quantization_config={"quant_method": LEGACY_HINTS[1]})
    with pytest.raises(CheckpointError, match=r"holds \d+ KHA tensors .* neither a 'kha_compile' entry"):
        read_served(d)


def test_the_hint_without_kha(saved, tmp_path):
    d = _copy(saved, "folded", tmp_path)
    write_config_entry(d, quantization_config={"quant_method": LEGACY_HINTS[1]})  # an earlier version's sentence
    with pytest.raises(CheckpointError, match="quantization_config hint"):
        read_served(d)
    write_config_entry(d, quantization_config=quantization_entry(MIX.to_dict()))  # the entry, but no tensors
    with pytest.raises(CheckpointError, match=r"hold no '\.kha\.' tensors"):
        read_served(d)


def test_a_config_that_names_other_kinds_than_the_tensors(saved, tmp_path):
    d = _copy(saved, "mix", tmp_path)
    (d / "kha_config.json").unlink()
    (d / "kha_model.safetensors").unlink()
    entry = json.loads((d / "config.json").read_text())["kha_compile"]
    write_config_entry(d, kha_compile=dict(entry, v="linear"))
    with pytest.raises(CheckpointError, match=r"says v='linear' .* holds \['down', 'gate', 'up'\]"):
        read_served(d)
    write_config_entry(d, kha_compile=dict(entry, q=None))
    with pytest.raises(
        CheckpointError,
        match=r"\(roles \['k', 'v'\]\), but model.layers.0.self_attn holds KHA tensors for roles \['k', 'q', 'v'\]",
    ):
        read_served(d)


def test_tensors_of_another_head_size_than_the_model(saved, tmp_path):
    d = _copy(saved, "mix", tmp_path)
    write_config_entry(d, head_dim=64)
    with pytest.raises(CheckpointError, match=r"shape \(32, 32\), but the model's head size is 64"):
        read_served(d)


def test_kha_on_a_fused_projection_is_not_served(saved, tmp_path):
    d = _copy(saved, "mix", tmp_path)
    (d / "kha_config.json").unlink()
    (d / "kha_model.safetensors").unlink()
    weights = load_file(str(d / "model.safetensors"))  # as a GPT-2 c_attn or Phi-3 qkv_proj would name them
    save_file(
        {k.replace(".v_proj.kha.", ".qkv_proj.kha."): v for k, v in weights.items()}, str(d / "model.safetensors")
    )
    with pytest.raises(ServingError, match="does not sit on a separate q_proj, k_proj or v_proj"):
        read_served(d)


def test_an_architecture_the_plugin_does_not_serve_is_named_with_the_ones_it_does(saved):
    with pytest.raises(ServingError, match="Olmo2ForCausalLM") as err:
        check_servable(read_served(saved["olmo2"][0]))
    msg = str(err.value)
    assert "'Olmo2ForCausalLM'" in msg and all(a in msg for a in SUPPORTED_ARCHITECTURES)
    assert "kc.fold" in msg  # linear KHA: folding is the way out


def test_head_size_16_is_refused_up_front_on_cpu_and_not_on_gpu(saved):
    served = read_served(saved["hd16"][0])
    assert 16 not in CPU_HEAD_SIZES
    with pytest.raises(ServingError, match=r"does not take head size 16.*32, 64"):
        check_servable(served)
    check_servable(served, head_sizes=None)  # a GPU build: its backends decide
