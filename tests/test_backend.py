"""Tests for kha_compile.backend: the "kha" torch.compile backend and deploy mode.

Inductor compiles are slow on CPU (tens of seconds for a tiny 2-layer model), so the rewrite logic
is tested with ``compiler="eager"`` (the rewritten Dynamo graph runs as is) and Inductor runs in a
few end-to-end tests; those on more than one model are marked slow.
"""
from __future__ import annotations

import logging
import subprocess
import sys

import operator

import pytest
import torch
from torch import nn

import kha_compile as kc
import zoo
from kha_compile.backend import KHABackend
from kha_compile.errors import CheckpointError, KHAError

RTOL_OUT, RTOL_GRAD = 1e-4, 1e-3


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    kc.backend.reset()
    yield
    torch._dynamo.reset()


def _out(o):
    for name in ("logits", "last_hidden_state"):
        if hasattr(o, name):
            return getattr(o, name)
    return o


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _perturb(model: nn.Module, seed: int = 1) -> None:
    """Move every KHA parameter off its identity init, so the transforms do something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".kha." in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))


def _kha_case(name: str, cfg: kc.KHAConfig) -> zoo.ZooCase:
    case = zoo.make(name)
    kc.apply(case.model, cfg)
    _perturb(case.model)
    return case


def _loss(out: torch.Tensor) -> torch.Tensor:
    """A loss with non-trivial gradients (``square().mean()`` is constant after a final LayerNorm)."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    return (out * w).sum()


def _run(model, case, grad: bool = False):
    with torch.set_grad_enabled(grad):
        return _out(model(*case.args, **case.kwargs))


# --- registration and the public object -----------------------------------------------------

def test_registered_lazily_under_kha():
    code = ("import sys, kha_compile\n"
            "assert 'torch._dynamo' not in sys.modules, 'importing kha_compile imported dynamo'\n"
            "import torch._dynamo\n"
            "assert 'kha' in torch._dynamo.list_backends()\n"
            "from torch._dynamo.backends.registry import lookup_backend\n"
            "assert lookup_backend('kha') is kha_compile.backend.kha\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_backend_module_is_callable():
    be = kc.backend(fold=False)
    assert isinstance(be, KHABackend) and be.options["fold"] is False
    assert kc.backend.last_stats().rewrites == {"deploy": 0, "fuse_mlp_value": 0, "fold_linear": 0}
    with pytest.raises(KHAError, match="compiler="):
        kc.backend(compiler="tvm")
    with pytest.raises(KHAError, match="from_pretrained"):
        kc.backend(model=nn.Linear(2, 2))


# --- Inductor end to end --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", pytest.param("qwen3", marks=pytest.mark.slow),
                                  pytest.param("bert", marks=pytest.mark.slow)])
def test_mlp_value_inductor_matches_eager_forward_and_grads(name):
    """One compile with gradients on: outputs and one backward step's KHA gradients match eager."""
    case = _kha_case(name, kc.KHAConfig(v="mlp"))
    model = case.model
    ref = _run(model, case, grad=True)
    _loss(ref).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if ".kha." in n}
    model.zero_grad()

    compiled = torch.compile(model, backend="kha")
    got = _run(compiled, case, grad=True)
    _loss(got).backward()

    assert _rel(got.detach(), ref.detach()) < RTOL_OUT
    for n, g in ref_grads.items():
        p = model.get_parameter(n)
        assert ((p.grad - g).norm() / g.norm()).item() < RTOL_GRAD, n
    stats = kc.backend.last_stats()
    assert stats.mlp_value_ops == case.num_sites
    assert stats.rewrites["fold_linear"] == 0 and stats.has_kha


def test_linear_qkv_folded_under_no_grad_inductor():
    case = _kha_case("llama", kc.KHAConfig(q="linear", k="linear", v="linear"))
    ref = _run(case.model, case)
    be = kc.backend()
    got = _run(torch.compile(case.model, backend=be), case)
    assert _rel(got, ref) < RTOL_OUT
    assert be.stats.rewrites["fold_linear"] == 3 * case.num_sites
    assert be.stats.mlp_value_ops == 0


# --- folding (rewritten graph run eagerly) ----------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt_neox"])  # separate, fused Conv1D, interleaved [H, 3, Dh]
@pytest.mark.parametrize("cfg", [kc.KHAConfig(q="linear", k="linear", v="linear"), kc.KHAConfig(q="linear", v="mlp")],
                         ids=["qkv_linear", "q_linear_v_mlp"])
def test_fold_layouts(name, cfg):
    case = _kha_case(name, cfg)
    ref = _run(case.model, case)
    be = kc.backend(compiler="eager")
    got = _run(torch.compile(case.model, backend=be), case)
    assert _rel(got, ref) < RTOL_OUT
    n_linear = sum(kind == "linear" for kind in cfg.roles().values())
    assert be.stats.rewrites["fold_linear"] == n_linear * case.num_sites
    assert be.stats.mlp_value_ops == (case.num_sites if cfg.v == "mlp" else 0)
    assert not be.stats.declined


def test_fold_declined_while_training():
    case = _kha_case("llama", kc.KHAConfig(q="linear", k="linear", v="linear"))
    be = kc.backend(compiler="eager")
    ref = _run(case.model, case, grad=True)
    got = _run(torch.compile(case.model, backend=be), case, grad=True)
    assert _rel(got.detach(), ref.detach()) < RTOL_OUT
    assert be.stats.rewrites["fold_linear"] == 0
    assert be.stats.declined and all("gradients are on" in why for _, _, why in be.stats.declined)


def test_fold_follows_in_place_updates():
    """A folded weight is recomputed when a source parameter changes (e.g. an optimizer step)."""
    case = _kha_case("llama", kc.KHAConfig(v="linear"))
    be = kc.backend(compiler="eager")
    compiled = torch.compile(case.model, backend=be)
    _run(compiled, case)
    with torch.no_grad():
        case.model.get_parameter("model.layers.0.self_attn.v_proj.kha.v.weight").mul_(-1.5)
    got, ref = _run(compiled, case), _run(case.model, case)
    assert _rel(got, ref) < RTOL_OUT
    assert be.stats.rewrites["fold_linear"] == case.num_sites and len(be.stats.graphs) == 1


# --- the decomposed MLP-value form --------------------------------------------------------------

class HandMLP(nn.Module):
    """KHA-MLP on values written out by hand, in one of several equivalent spellings."""

    def __init__(self, d: int = 16, form: str = "paper"):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up, self.gate, self.down = (nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5) for _ in range(3))
        self.form = form

    def forward(self, v):
        up, gate, down = self.up, self.gate, self.down
        if self.form == "paper":
            return 2 * ((v @ up) * torch.sigmoid(v @ gate)) @ down
        if self.form == "matmul_swapped":
            return torch.matmul(torch.sigmoid(torch.matmul(v, gate)) * torch.matmul(v, up), down) * 2
        if self.form == "reference":
            return (2.0 * (v @ up) * torch.sigmoid(v @ gate)) @ down
        if self.form == "scale_after":
            return 2.0 * (((v @ up) * (v @ gate).sigmoid()) @ down)
        if self.form == "no_factor_2":
            return ((v @ up) * torch.sigmoid(v @ gate)) @ down
        if self.form == "shared_intermediate":
            a = v @ up
            return 2 * (a * torch.sigmoid(v @ gate)) @ down + a
        raise ValueError(self.form)


@pytest.mark.parametrize("form", ["paper", "matmul_swapped", "reference", "scale_after"])
def test_decomposed_mlp_value_rewritten(form):
    mod, v = HandMLP(form=form), torch.randn(2, 5, 3, 16)
    seen = []

    def record(gm, example_inputs):
        seen.append([n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")])
        return gm.forward

    be = kc.backend(compiler=record)
    with torch.no_grad():
        got, ref = torch.compile(mod, backend=be)(v), mod(v)
    assert be.stats.rewrites["fuse_mlp_value"] == 1 and be.stats.mlp_value_ops == 1
    # the fused op is the only computation left (no matmul, sigmoid or scaling in any spelling)
    assert [t for t in seen[0] if t not in (operator.getitem,)] == [torch.ops.kha.mlp_value.default]
    assert _rel(got, ref) < RTOL_OUT


@pytest.mark.parametrize("form, reason", [("no_factor_2", "not 2"), ("shared_intermediate", "also used by")])
def test_decomposed_near_misses_declined_with_reason(form, reason):
    mod, v = HandMLP(form=form), torch.randn(4, 16)
    be = kc.backend(compiler="eager")
    with torch.no_grad():
        got, ref = torch.compile(mod, backend=be)(v), mod(v)
    assert be.stats.rewrites["fuse_mlp_value"] == 0
    assert [r for rule, _, r in be.stats.declined if rule == "fuse_mlp_value" and reason in r]
    assert _rel(got, ref) < RTOL_OUT


def test_decomposed_mlp_value_inductor_trains():
    mod, v = HandMLP(), torch.randn(2, 5, 16)
    ref = mod(v)
    _loss(ref).backward()
    ref_grads = [p.grad.clone() for p in mod.parameters()]
    mod.zero_grad()
    got = torch.compile(mod, backend="kha")(v)
    _loss(got).backward()
    assert kc.backend.last_stats().rewrites["fuse_mlp_value"] == 1
    assert _rel(got.detach(), ref.detach()) < RTOL_OUT
    for p, g in zip(mod.parameters(), ref_grads):
        assert ((p.grad - g).norm() / g.norm()).item() < RTOL_GRAD


# --- no KHA ---------------------------------------------------------------------------------

def test_model_without_kha_compiles_unchanged_and_logs_once(caplog):
    mod = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    compiled = torch.compile(mod, backend="kha", dynamic=False)
    with caplog.at_level(logging.INFO, logger="kha_compile.backend"), torch.no_grad():
        for n in (3, 5):  # a second shape recompiles: still one log line
            x = torch.randn(n, 16)
            assert _rel(compiled(x), mod(x)) < RTOL_OUT
    stats = kc.backend.last_stats()
    assert len(stats.graphs) == 2 and not stats.has_kha
    assert stats.rewrites == {"deploy": 0, "fuse_mlp_value": 0, "fold_linear": 0} and stats.mlp_value_ops == 0
    lines = [r for r in caplog.records if r.name == "kha_compile.backend"]
    assert len(lines) == 1 and "no KHA" in lines[0].getMessage()


# --- deploy mode ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    """A KHA-MLP checkpoint of the tiny llama, and that model's eager outputs after load_pretrained."""
    case = _kha_case("llama", kc.KHAConfig(v="mlp"))
    path = tmp_path_factory.mktemp("kha_ckpt")
    kc.save_pretrained(case.model, path)
    loaded = zoo.make("llama")
    kc.load_pretrained(loaded.model, path)
    return path, _run(loaded.model, loaded)


@pytest.mark.parametrize("give_model", [True, False], ids=["model_given", "model_found"])
def test_deploy_matches_applied_and_loaded(llama_ckpt, give_model):
    path, ref = llama_ckpt
    vanilla = zoo.make("llama")
    opts = {"model": vanilla.model} if give_model else {}
    be = kc.backend(from_pretrained=path, compiler="eager", **opts)
    got = _run(torch.compile(vanilla.model, backend=be), vanilla)
    assert _rel(got, ref) < RTOL_OUT
    assert be.stats.rewrites["deploy"] == vanilla.num_sites and be.stats.mlp_value_ops == vanilla.num_sites
    assert not any(".kha." in n for n, _ in vanilla.model.named_parameters())  # the model itself is untouched


@pytest.mark.slow
def test_deploy_inductor(llama_ckpt):
    path, ref = llama_ckpt
    vanilla = zoo.make("llama")
    be = kc.backend(from_pretrained=path)
    assert _rel(_run(torch.compile(vanilla.model, backend=be), vanilla), ref) < RTOL_OUT


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox"])  # fused Conv1D (addmm) and interleaved layouts
def test_deploy_mixed_linear_and_mlp(tmp_path, name):
    case = _kha_case(name, kc.KHAConfig(q="linear", v="mlp"))
    kc.save_pretrained(case.model, tmp_path)
    ref = _run(case.model, case)
    vanilla = zoo.make(name)
    be = kc.backend(from_pretrained=tmp_path, compiler="eager")
    got = _run(torch.compile(vanilla.model, backend=be), vanilla)
    assert _rel(got, ref) < RTOL_OUT
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
        bert = _kha_case("bert", kc.KHAConfig(v="mlp"))
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
        _run(compiled, vanilla)
    assert isinstance(info.value, CheckpointError)


def test_deploy_missing_checkpoint_raises_at_once(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        kc.backend(from_pretrained=tmp_path / "nope")
