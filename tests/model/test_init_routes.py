"""KHA is identity after every route by which transformers and accelerate initialise or materialise a model.

Each test builds the model the same way twice, once with KHA and once without, with the same seed,
and compares the outputs exactly: identity at init means KHA changes nothing, whatever the route.
The KHA weights are perturbed (trained-like) wherever they hold values before the route runs, so a
route that leaves them alone fails as surely as one that leaves uninitialised memory.
"""

from __future__ import annotations

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, main_output, perturb, run_python

transformers = pytest.importorskip("transformers")

KHA = kc.KHAConfig(q="linear", k="linear", v="mlp")  # both transform kinds
SEQ = 40  # more tokens than hidden


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def bert_config():
    return transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )


ARCHS = {
    "llama": (transformers.LlamaForCausalLM, llama_config),
    "bert": (transformers.BertModel, bert_config),
}


def with_kha(cls):
    """A subclass of ``cls`` that applies KHA when it is built (how from_pretrained meets KHA without a KHA config)."""

    class WithKHA(cls):
        def __init__(self, config):
            super().__init__(config)
            kc.apply(self, KHA)

    WithKHA.__name__ = cls.__name__  # the checkpoint's architecture name, so transformers loads it quietly
    return WithKHA


def output(model) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return main_output(model.eval()(input_ids=ids))


def assert_identity(model, reference) -> None:
    assert kha_params(model), "KHA was not applied"
    assert not any(p.is_meta for p in model.parameters()), "a parameter is still on the meta device"
    torch.testing.assert_close(output(model), output(reference), rtol=0, atol=0)


def seeded(fn, seed: int = 3):
    torch.manual_seed(seed)
    return fn()


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("apply_inside", [True, False], ids=["apply-in-meta-block", "apply-after-meta-block"])
def test_init_weights_after_to_empty(arch, apply_inside):
    """transformers' own route (its test_init_weights_can_init_buffers): meta, to_empty, init_weights."""
    cls, config = ARCHS[arch]

    def build(kha: bool):
        with torch.device("meta"):
            model = cls(config())
            if kha and apply_inside:
                kc.apply(model, KHA)
        if kha and not apply_inside:
            kc.apply(model, KHA)
        model.to_empty(device="cpu")
        seeded(model.init_weights)
        return model

    assert_identity(build(True), build(False))


def _built(cls, config, kha: bool):
    """The model, seeded; with KHA applied and perturbed (trained-like) when ``kha``."""
    model = seeded(lambda: cls(config()))
    if kha:
        kc.apply(model, KHA)
        perturb(model)
    return model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_init_weights_per_module(arch):
    """``model._init_weights(module)`` on every module, as older transformers code and users call it."""
    cls, config = ARCHS[arch]

    def build(kha: bool):
        model = _built(cls, config, kha)

        def init_each():
            for module in model.modules():
                model._init_weights(module)

        seeded(init_each)
        return model

    assert_identity(build(True), build(False))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_initialize_weights_after_training(arch):
    """``initialize_weights()`` re-initialises a trained model: KHA goes back to identity with the rest."""
    cls, config = ARCHS[arch]

    def build(kha: bool):
        model = _built(cls, config, kha)
        for module in model.modules():
            module.__dict__.pop("_is_hf_initialized", None)  # post_init marked them: initialise again
        seeded(model.initialize_weights)
        return model

    assert_identity(build(True), build(False))


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("meta", [False, True], ids=["cpu", "meta-to-empty"])
def test_reset_parameters(arch, meta):
    """``reset_parameters()`` on every module that has one (torch's own re-initialisation), then the weights load."""
    cls, config = ARCHS[arch]
    reference = seeded(lambda: cls(config()))
    with torch.device("meta" if meta else "cpu"):
        model = cls(config())
    kc.apply(model, KHA)
    if meta:
        model.to_empty(device="cpu")
    perturb(model)
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    missing, _ = model.load_state_dict(reference.state_dict(), strict=False)  # every weight but KHA's
    assert missing and all(".kha." in name for name in missing)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in reference.named_buffers():  # non-persistent ones (rope) too
            buffers[name].copy_(value)
    assert_identity(model, reference)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"low_cpu_mem_usage": True}, {"device_map": "cpu"}],
    ids=["default-meta-loading", "low_cpu_mem_usage", "device_map"],
)
def test_from_pretrained_checkpoint_without_kha(arch, kwargs, tmp_path):
    """A plain checkpoint loaded into a model that applies KHA when built: every KHA tensor is missing."""
    cls, config = ARCHS[arch]
    seeded(lambda: cls(config())).save_pretrained(tmp_path)
    model = with_kha(cls).from_pretrained(tmp_path, **kwargs)
    assert_identity(model, cls.from_pretrained(tmp_path))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"low_cpu_mem_usage": True}, {"device_map": "cpu"}],
    ids=["default", "low_cpu_mem_usage", "device_map"],
)
def test_from_pretrained_keeps_loaded_kha(kwargs, tmp_path):
    """The other side: trained KHA tensors in the checkpoint are loaded, never re-initialised."""
    trained = seeded(lambda: transformers.LlamaForCausalLM(llama_config()))
    kc.apply(trained, KHA)
    perturb(trained)
    trained.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, **kwargs)
    for name, value in kha_params(trained).items():
        torch.testing.assert_close(kha_params(loaded)[name], value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(output(loaded), output(trained), rtol=0, atol=0)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_accelerate_init_empty_weights_and_dispatch(arch, tmp_path):
    """accelerate: build empty, apply KHA, load a checkpoint without KHA and dispatch."""
    accelerate = pytest.importorskip("accelerate")
    cls, config = ARCHS[arch]
    seeded(lambda: cls(config())).save_pretrained(tmp_path)

    def build(kha: bool):
        with accelerate.init_empty_weights():
            model = cls(config())
        if kha:
            kc.apply(model, KHA)
        return accelerate.load_checkpoint_and_dispatch(model, str(tmp_path), device_map={"": "cpu"})

    assert_identity(build(True), build(False))


def test_leaving_meta_by_to_gives_identity():
    """``.to(device)`` of a KHA transform on the meta device gives it memory at identity instead of raising."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config())
    kc.apply(model, KHA)
    for module in model.modules():
        if type(module).__module__.startswith("kha_compile.model.transforms"):
            module.to("cpu", torch.float64)
    params = kha_params(model)
    assert params and all(p.device.type == "cpu" and p.dtype == torch.float64 for p in params.values())
    eye = torch.eye(8, dtype=torch.float64)
    for name, p in params.items():
        want = torch.zeros_like(eye) if name.endswith(".gate") else eye
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=0, msg=name)


_FSDP_META = """
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 500))
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from kha_compile.model.transforms.linear import KHALinearTransform
from kha_compile.model.transforms.mlp import KHAMLPValue
with torch.device("meta"):
    model = torch.nn.Sequential(KHALinearTransform(8), KHAMLPValue(8))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
model.to_empty(device="cpu")
eye = torch.eye(8)
for name, p in model.named_parameters():
    assert type(p).__name__ == "DTensor", name
    assert torch.equal(p.full_tensor(), torch.zeros_like(eye) if name.endswith("gate") else eye), name
dist.destroy_process_group()
print("IDENTITY")
"""


def test_fsdp2_sharded_transforms_leave_meta_at_identity():
    """FSDP2 on the meta device, then to_empty: the transforms' DTensor parameters take the identity, sharded."""
    run_python(_FSDP_META, "IDENTITY", timeout=120)
