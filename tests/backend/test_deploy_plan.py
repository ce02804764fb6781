"""Deploy mode from the insertion plan a checkpoint records: no model object, projections found by name."""

from __future__ import annotations

import json

import pytest
import torch
from backend_cases import RTOL_OUT, kha_case, rel, run

import kha_compile as kc
import zoo
from kha_compile.core.errors import AlreadyAppliedError, CheckpointError, DeployError, KHAError
from kha_compile.model.config import CONFIG_VERSION, KHAConfig
from kha_compile.store.format import CONFIG_NAME, read_plan


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint of the tiny llama with q linear and v MLP, and the outputs of that model."""
    case = kha_case("llama", kc.KHAConfig(q="linear", v="mlp"))
    path = tmp_path_factory.mktemp("plan_ckpt")
    kc.save_pretrained(case.model, path)
    return path, run(case.model, case)


def _edited(src, dst, edit):
    """A copy of checkpoint ``src`` in ``dst`` whose kha_config.json went through ``edit``."""
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / CONFIG_NAME).read_text())
    edit(cfg)
    (dst / CONFIG_NAME).write_text(json.dumps(cfg))
    return dst


def test_save_pretrained_records_the_plan(ckpt):
    path, _ = ckpt
    cfg = json.loads((path / CONFIG_NAME).read_text())
    assert cfg["version"] == CONFIG_VERSION == 3
    by_module = {p.path: p for p in read_plan(path)}
    assert set(by_module) == {f"model.layers.{i}.self_attn.{r}_proj" for i in range(2) for r in "qv"}
    q, v = by_module["model.layers.0.self_attn.q_proj"], by_module["model.layers.0.self_attn.v_proj"]
    assert (q.handler, q.kinds, q.out_features) == ("linear", {"q": "linear"}, 64)
    assert (v.kinds, v.out_features) == ({"v": "mlp"}, 32)
    ((role, offset, heads, dh, stride),) = [tuple(s.to_dict().values()) for s in v.slots]
    assert (role, offset, heads, dh, stride) == ("v", 0, 2, 16, 16)  # 2 kv heads of 16


@pytest.mark.parametrize("version", [1, 2])
def test_checkpoint_without_plan_needs_the_model(ckpt, tmp_path, version):
    path, ref = ckpt

    def old(cfg):
        del cfg["plan"]
        cfg["version"] = version
        if version == 1:
            del cfg["strategy"]

    old_path = _edited(path, tmp_path, old)
    assert read_plan(old_path) is None
    with pytest.raises(DeployError, match=r"records no insertion plan.*model=model.*re-save"):
        kc.backend(from_pretrained=old_path)
    vanilla = zoo.make("llama")
    be = kc.backend(from_pretrained=old_path, model=vanilla.model, compiler="eager")
    assert rel(run(torch.compile(vanilla.model, backend=be), vanilla), ref) < RTOL_OUT
    loaded = zoo.make("llama")  # and it still loads as a checkpoint
    kc.load_pretrained(loaded.model, old_path)
    assert rel(run(loaded.model, loaded), ref) < RTOL_OUT
    assert KHAConfig.from_dict({"version": version, "v": "mlp"}).v == "mlp"


def test_deploy_into_a_compiled_function(ckpt):
    """No module is handed to torch.compile: the plan finds the weights by their names."""
    path, ref = ckpt
    vanilla = zoo.make("llama")
    model = vanilla.model
    be = kc.backend(from_pretrained=path, compiler="eager")

    @torch.compile(backend=be)
    def logits(ids, mask):
        return model(input_ids=ids, attention_mask=mask).logits

    with torch.no_grad():
        got = logits(vanilla.kwargs["input_ids"], vanilla.kwargs["attention_mask"])
    assert rel(got, ref) < RTOL_OUT
    assert be.stats.rewrites["deploy"] == 2 * vanilla.num_sites


def test_deploy_into_a_graph_of_part_of_the_model(ckpt):
    """A graph break before the inner LlamaModel: its graph names the weights "layers.0...", one plan entry each."""
    path, ref = ckpt
    vanilla = zoo.make("llama")
    vanilla.model.model.register_forward_pre_hook(lambda *_: torch._dynamo.graph_break())
    be = kc.backend(from_pretrained=path, compiler="eager")
    assert rel(run(torch.compile(vanilla.model, backend=be), vanilla), ref) < RTOL_OUT
    assert len(be.stats.graphs) >= 2 and be.stats.rewrites["deploy"] == 2 * vanilla.num_sites


@pytest.mark.parametrize("give_model", [False, True], ids=["plan", "model_given"])
def test_deploy_into_a_graph_shared_by_the_layers(ckpt, give_model):
    """A graph break before every layer: Dynamo runs one graph for both layers, with each layer's weights.

    Each call must get its own layer's checkpoint tensors; from the plan alone the graph cannot tell
    the layers apart, so it refuses instead of running layer 0's transforms in layer 1.
    """
    path, ref = ckpt
    vanilla = zoo.make("llama")
    for layer in vanilla.model.model.layers:
        layer.register_forward_pre_hook(lambda *_: torch._dynamo.graph_break())
    be = kc.backend(from_pretrained=path, compiler="eager", **({"model": vanilla.model} if give_model else {}))
    compiled = torch.compile(vanilla.model, backend=be)
    if not give_model:
        with pytest.raises(DeployError, match=r"repeats.*model=model.*graph break"):
            run(compiled, vanilla)
        return
    assert rel(run(compiled, vanilla), ref) < RTOL_OUT
    layer_graphs = [g for g in be.stats.graphs if g.count("deploy")]
    assert len(layer_graphs) == 1 and layer_graphs[0].count("deploy") == 2  # one graph, run for both layers


def _out_features(cfg):
    cfg["plan"][0]["out_features"] += 16


def _renamed(cfg):
    """One planned projection (and its tensors) under a module name the model does not have."""
    entry = next(p for p in cfg["plan"] if p["module"].endswith("layers.1.self_attn.q_proj"))
    entry["module"] = entry["module"].replace("q_proj", "query")
    cfg["tensors"] = {k.replace("1.self_attn.q_proj", "1.self_attn.query"): v for k, v in cfg["tensors"].items()}


@pytest.mark.parametrize(
    "edit, match", [(_out_features, "shape mismatch"), (_renamed, "not in this model")], ids=["size", "name"]
)
def test_plan_validated_against_the_graph(ckpt, tmp_path, edit, match):
    path, _ = ckpt
    bad = _edited(path, tmp_path, edit)
    if edit is _renamed:  # the tensor file follows the renamed plan
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(bad / "kha_model.safetensors"))
        renamed = {k.replace("1.self_attn.q_proj", "1.self_attn.query"): v for k, v in tensors.items()}
        save_file(renamed, str(bad / "kha_model.safetensors"))
    vanilla = zoo.make("llama")
    compiled = torch.compile(vanilla.model, backend=kc.backend(from_pretrained=bad, compiler="eager"))
    with pytest.raises(KHAError, match=match) as info:
        run(compiled, vanilla)
    assert isinstance(info.value, CheckpointError) and "model=model" in str(info.value)


def test_plan_refuses_a_model_that_already_carries_kha(ckpt):
    path, _ = ckpt
    case = kha_case("llama", kc.KHAConfig(q="linear", v="mlp"))
    compiled = torch.compile(case.model, backend=kc.backend(from_pretrained=path, compiler="eager"))
    with pytest.raises(AlreadyAppliedError, match="backend='kha'"):
        run(compiled, case)
