"""kha_compile.exporters.aoti: .pt2 packages that run without kha_compile (fresh Python, C++), their
metadata, and the errors of a bad export.

Each AOTInductor compile takes 20-35 s on two cores, so the module builds two packages (MLP-value
on v; linear q, k, v folded), shared by every test, of the tiny zoo Llama (hidden 64, head dim 16).
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from torch import nn

import kha_compile as kc
import zoo
from helpers import kha_params, perturb, run_outside_repo
from kha_compile.analysis.inputs import example_inputs
from kha_compile.core.errors import ExportError, MissingExampleInputsError
from kha_compile.exporters import aoti, aoti_steps
from kha_compile.exporters.aoti import export_aoti, lower_kha_ops, read_aoti_metadata
from kha_compile.exporters.metadata import METADATA_KEYS, METADATA_PREFIX, kha_metadata, parse_metadata

# lengths 17 and 100: more tokens than d_model (64), and neither is the example's 8
CALLS = [(3, 17), (1, 100)]

# Runs in a fresh interpreter that cannot import kha_compile (nor finds it on its path): loads the
# package, runs it on the saved inputs and prints the largest difference from the saved KHA outputs.
FRESH = r"""
import sys
sys.modules["kha_compile"] = None  # any import of kha_compile now raises ImportError
import torch
data = torch.load(sys.argv[2])
runner = torch._inductor.aoti_load_package(sys.argv[1])
for inputs, want, real in zip(data["inputs"], data["outputs"], data["real"]):
    (got,) = runner(*inputs)
    assert got.shape == want.shape, (got.shape, want.shape)
    print("diff", (got - want)[real].abs().max().item())
assert "transformers" not in sys.modules
print("loaded without kha_compile")
"""


def _model(cfg: kc.KHAConfig) -> nn.Module:
    model = zoo.make("llama").model
    kc.apply(model, cfg)
    perturb(model)  # trained-like KHA weights
    return model


def _calls(seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask) per CALLS shape; the second batch is left-padded by 5 tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for b, s in CALLS:
        ids = torch.randint(0, zoo.VOCAB, (b, s), generator=gen)
        mask = torch.ones(b, s, dtype=torch.long)
        if s > 50:
            mask[:, :5] = 0
        out.append((ids, mask))
    return out


def _eager(model: nn.Module, calls) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=i, attention_mask=m, use_cache=False).logits for i, m in calls]


@pytest.fixture(scope="module")
def mlp_package(tmp_path_factory):
    """(the KHA model with MLP-value on v, its package): example inputs built from the config."""
    model = _model(kc.KHAConfig(v="mlp"))
    return model, export_aoti(model, tmp_path_factory.mktemp("aoti") / "mlp.pt2")


@pytest.fixture(scope="module")
def linear_package(tmp_path_factory):
    """(the KHA model with linear q, k, v, its package, the example ids), folded in the package."""
    model = _model(kc.KHAConfig(q="linear", k="linear", v="linear"))
    ids = torch.randint(0, zoo.VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    path = export_aoti(model, tmp_path_factory.mktemp("aoti") / "linear.pt2", example_kwargs={"input_ids": ids})
    return model, path, ids


def test_mlp_value_package_runs_where_kha_compile_cannot_be_imported(mlp_package, tmp_path):
    model, path = mlp_package
    calls = _calls()
    real = [m.bool() for _, m in calls]  # padded positions attend to nothing: compare the real tokens
    torch.save({"inputs": calls, "outputs": _eager(model, calls), "real": real}, tmp_path / "ref.pt")
    stdout = run_outside_repo(FRESH, str(path), str(tmp_path / "ref.pt"), cwd=tmp_path)
    diffs = [float(line.split()[1]) for line in stdout.splitlines() if line.startswith("diff")]
    assert len(diffs) == len(CALLS) and max(diffs) < 1e-4, diffs
    assert "loaded without kha_compile" in stdout


def test_mlp_value_package_keeps_the_kha_weights(mlp_package):
    runner = torch._inductor.aoti_load_package(str(mlp_package[1]))
    assert sum(".kha." in name for name in runner.get_constant_fqns()) == 2 * 3  # up, gate, down per layer


def test_lower_kha_ops_refuses_a_kha_op_left_over(monkeypatch):
    monkeypatch.setattr(aoti_steps, "KHA_DECOMPOSITIONS", {})  # as if a new kha op had no formula
    with pytest.raises(ExportError, match=r"step 'lower': kha\.mlp_value\.default left in the program"):
        lower_kha_ops(_exported_mlp_block())


class _MLPValueBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up, self.gate, self.down = (nn.Parameter(torch.randn(4, 4, generator=gen)) for _ in range(3))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.kha.mlp_value(v, self.up, self.gate, self.down)


def _exported_mlp_block() -> torch.export.ExportedProgram:
    return torch.export.export(_MLPValueBlock(), (torch.randn(3, 4),))


def test_lower_kha_ops_replaces_mlp_value_by_its_formula():
    program = _exported_mlp_block()
    assert aoti.kha_ops(program) == {"kha.mlp_value.default"}
    lowered = lower_kha_ops(program)
    assert aoti.kha_ops(lowered) == set()
    v = torch.randn(3, 4)
    block = _MLPValueBlock()
    want = (2.0 * (v @ block.up) * torch.sigmoid(v @ block.gate)) @ block.down  # the spec's formula, written out
    torch.testing.assert_close(lowered.module()(v), want.detach())


def test_folded_linear_package_equals_the_kha_model(linear_package):
    model, path, _ = linear_package
    assert len(kha_params(model)) == 2 * 3, "export_aoti must not fold the caller's model"
    runner = torch._inductor.aoti_load_package(str(path))
    assert not [n for n in runner.get_constant_fqns() if "kha" in n]  # folded into q, k, v weights
    assert read_aoti_metadata(path)["input_names"] == ["input_ids"]
    for b, s in CALLS:
        ids = torch.randint(0, zoo.VOCAB, (b, s), generator=torch.Generator().manual_seed(s))
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits
        (got,) = runner(ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_metadata_is_the_onnx_metadata_plus_the_package_signature(mlp_package, linear_package):
    model, path = mlp_package
    meta = read_aoti_metadata(path)
    args, kwargs = example_inputs(model)
    want = parse_metadata(kha_metadata(model, args, kwargs, folded=True))
    assert {k: meta[k] for k in want} == want and len(want) == len(METADATA_KEYS)
    assert meta["config"]["v"] == "mlp" and meta["folded"] is False and len(meta["sites"]) == 2
    assert meta["format"] == "aoti" and meta["torch_version"] == torch.__version__
    assert meta["input_names"] == ["input_ids", "attention_mask"] and meta["output_names"] == ["logits"]
    unbounded = {"0": [1, None], "1": [1, None]}
    assert meta["dynamic_shapes"] == {"input_ids": unbounded, "attention_mask": unbounded}
    assert meta["aoti"]["AOTI_DEVICE_KEY"] == "cpu"
    assert set(aoti.AOTI_KEYS) <= {METADATA_PREFIX + k for k in meta}
    linear = read_aoti_metadata(linear_package[1])
    assert linear["folded"] is True and linear["config"]["q"] == "linear"


def test_export_refuses_a_path_that_is_not_a_package(tmp_path):
    model = zoo.make("llama").model
    with pytest.raises(ExportError, match=r"ends in \.pt2"):
        export_aoti(model, tmp_path / "model.onnx")
    with pytest.raises(ExportError, match="does not exist; create it first"):
        export_aoti(model, tmp_path / "missing" / "model.pt2")
    (tmp_path / "dir.pt2").mkdir()
    with pytest.raises(ExportError, match="it is a directory"):
        export_aoti(model, tmp_path / "dir.pt2")


def test_export_needs_example_inputs_for_a_plain_module(tmp_path):
    with pytest.raises(MissingExampleInputsError, match="pass example inputs"):
        export_aoti(nn.Linear(4, 4), tmp_path / "m.pt2")


def test_export_refuses_a_size_one_example_on_a_dynamic_axis(tmp_path):
    model = zoo.make("llama").model
    with pytest.raises(ExportError, match=r"size 1 on axis 0 \(batch\).*dynamic=False"):
        export_aoti(model, tmp_path / "m.pt2", example_kwargs={"input_ids": torch.zeros(1, 8, dtype=torch.long)})


def test_export_refuses_container_inputs(tmp_path):
    class TakesDict(nn.Module):
        def forward(self, features: dict) -> torch.Tensor:
            return features["x"] * 2

    with pytest.raises(ExportError, match="input 'features' is a dict of tensors"):
        export_aoti(TakesDict(), tmp_path / "m.pt2", example_args=({"x": torch.ones(2, 3)},))


def test_read_metadata_of_a_file_that_is_no_package(tmp_path):
    with pytest.raises(ExportError, match="the file does not exist"):
        read_aoti_metadata(tmp_path / "none.pt2")
    (tmp_path / "bad.pt2").write_bytes(b"not a zip")
    with pytest.raises(ExportError, match="is not an AOTInductor package"):
        read_aoti_metadata(tmp_path / "bad.pt2")


@pytest.mark.slow  # builds the C++ runner (the aoti_runner fixture): 10-25 s of g++ on two cores
def test_cpp_runner_matches_torch(mlp_package, aoti_runner):
    model, path = mlp_package
    runner = aoti_runner
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1"}  # no Python involved
    for b, s in CALLS:
        out = subprocess.run(
            [str(runner), str(path), str(b), str(s)], capture_output=True, text=True, env=env, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        lines = {
            ln.split(" ", 1)[0]: ln.split(" ") for ln in out.stdout.splitlines() if ln.startswith(("output", "values"))
        }
        shape = [int(x) for x in lines["output"][4:]]
        assert lines["output"][2] == "logits" and shape == [b, s, zoo.VOCAB]
        got = torch.tensor([float(x) for x in lines["values"][2:]], dtype=torch.float64).reshape(shape)
        # the runner's ids: (31 b + 7 s + 3) % vocab, attention_mask ones
        bi, si = torch.meshgrid(torch.arange(b), torch.arange(s), indexing="ij")
        ids = (31 * bi + 7 * si + 3) % zoo.VOCAB
        (want,) = _eager(model, [(ids, torch.ones_like(ids))])
        assert (got - want.double()).abs().max().item() < 1e-4
        assert "meta kha_compile.config" in out.stdout
