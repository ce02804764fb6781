"""kha_compile.backend.rules.deploy and backend.deploy: a checkpoint's transforms in an untouched model."""

from __future__ import annotations

import pytest
import torch
from backend_cases import RTOL_OUT, kha_case, loss_of, reference, rel, run

import kha_compile as kc
import zoo
from kha_compile.core.errors import CheckpointError, KHAError


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    """A KHA-MLP checkpoint of the tiny llama, and the outputs the per-head reference gives for it."""
    case = kha_case("llama", kc.KHAConfig(v="mlp"))
    path = tmp_path_factory.mktemp("kha_ckpt")
    kc.save_pretrained(case.model, path)
    return path, reference(case, base=zoo.make("llama").model)  # deployed into an untouched llama


@pytest.mark.parametrize("give_model", [True, False], ids=["model_given", "model_found"])
def test_deploy_matches_applied_and_loaded(llama_ckpt, give_model):
    path, ref = llama_ckpt
    vanilla = zoo.make("llama")
    opts = {"model": vanilla.model} if give_model else {}
    be = kc.backend(from_pretrained=path, compiler="eager", **opts)
    got = run(torch.compile(vanilla.model, backend=be), vanilla)
    assert rel(got, ref) < RTOL_OUT
    assert be.stats.rewrites["deploy"] == vanilla.num_sites and be.stats.mlp_value_ops == vanilla.num_sites
    assert not any(".kha." in n for n, _ in vanilla.model.named_parameters())  # the model itself is untouched


@pytest.mark.slow
@pytest.mark.inductor
def test_deploy_inductor(llama_ckpt):
    path, ref = llama_ckpt
    vanilla = zoo.make("llama")
    be = kc.backend(from_pretrained=path)
    assert rel(run(torch.compile(vanilla.model, backend=be), vanilla), ref) < RTOL_OUT


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox"])  # fused Conv1D (addmm) and interleaved layouts
def test_deploy_mixed_linear_and_mlp(tmp_path, name):
    case = kha_case(name, kc.KHAConfig(q="linear", v="mlp"))
    kc.save_pretrained(case.model, tmp_path)
    vanilla = zoo.make(name)
    ref = reference(case, base=vanilla.model)  # the checkpoint's KHA in the untouched model
    be = kc.backend(from_pretrained=tmp_path, compiler="eager")
    got = run(torch.compile(vanilla.model, backend=be), vanilla)
    assert rel(got, ref) < RTOL_OUT
    assert be.stats.rewrites["deploy"] == 2 * case.num_sites  # q folded, v inserted as kha::mlp_value
    assert be.stats.mlp_value_ops == case.num_sites


def _wrong_shapes(src, dst):
    """A copy of checkpoint ``src`` in ``dst`` whose tensors are (8, 8) instead of (16, 16)."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = {k: torch.zeros(8, 8) for k in load_file(str(src / "kha_model.safetensors"))}
    save_file(tensors, str(dst / "kha_model.safetensors"))
    cfg = json.loads((src / "kha_config.json").read_text())
    cfg["tensors"] = {k: [8, 8] for k in tensors}
    (dst / "kha_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("misfit", ["other_model", "wrong_shapes"])
def test_deploy_checkpoint_not_fitting_raises_khaerror(llama_ckpt, tmp_path, misfit):
    if misfit == "other_model":
        bert = kha_case("bert", kc.KHAConfig(v="mlp"))
        kc.save_pretrained(bert.model, tmp_path)
        path, match = tmp_path, "not in this model"
    else:
        path, match = _wrong_shapes(llama_ckpt[0], tmp_path), "shape mismatch"
    vanilla = zoo.make("llama")
    # with the model: refused when the backend is made, before anything compiles
    with pytest.raises(CheckpointError, match=match):
        kc.backend(from_pretrained=path, model=vanilla.model)
    # without: refused on the first call, as the KHA error itself (not Dynamo's BackendCompilerFailed)
    compiled = torch.compile(vanilla.model, backend=kc.backend(from_pretrained=path, compiler="eager"))
    with pytest.raises(KHAError, match=match) as info:
        run(compiled, vanilla)
    assert isinstance(info.value, CheckpointError)


def test_deploy_missing_checkpoint_raises_at_once(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        kc.backend(from_pretrained=tmp_path / "nope")


def test_deploy_while_training_leaves_the_projection_its_gradient(tmp_path):
    """With gradients on and a weight that requires grad, deploy must not fold the checkpoint's linear
    transforms into the weight (the fold would cut the weight's gradient off): the gradient of every
    weight equals that of the applied-and-loaded model."""
    case = kha_case("llama", kc.KHAConfig(q="linear", k="linear", v="linear"))
    kc.save_pretrained(case.model, tmp_path)
    vanilla = zoo.make("llama")
    base = {k: v for k, v in case.model.state_dict().items() if ".kha." not in k}
    assert all(torch.equal(v, vanilla.model.state_dict()[k]) for k, v in base.items())  # same base weights
    be = kc.backend(from_pretrained=tmp_path, compiler="eager")
    loss_of(run(torch.compile(vanilla.model, backend=be), vanilla, grad=True)).backward()
    loss_of(run(case.model, case, grad=True)).backward()
    own = dict(case.model.named_parameters())
    for name, p in vanilla.model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, own[name].grad, rtol=1e-3, atol=1e-5)
