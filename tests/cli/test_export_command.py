"""kha_compile.cli.commands.export: `export`, its output directory, and the onnxruntime check."""

from __future__ import annotations

import pytest
from cli_cases import run


@pytest.mark.slow  # a full torch.onnx export: 10-20 s on two busy cores
def test_export_mlp_value_writes_custom_nodes_and_matches_onnxruntime(capsys, tmp_path):
    pytest.importorskip("onnxruntime")
    from kha_compile.exporters import onnx_summary

    path = tmp_path / "sub" / "model.onnx"
    code, out, _ = run(capsys, "export", "tiny-qwen3", str(path), "--mlp")
    assert code == 0
    assert onnx_summary(path).num_custom_nodes == 2
    assert f"created the output directory {path.parent}" in out
    assert "onnxruntime vs torch" in out and "✓" in out


def _identity_onnx(target, path, **kwargs):
    """Stands in for export_onnx: writes a one-node ONNX file (the command's own steps around it are tested)."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_export_creates_a_missing_directory_and_says_so(capsys, tmp_path, monkeypatch, caplog):
    pytest.importorskip("onnx")
    import logging

    import kha_compile.cli.commands.export as export_command  # the name the command calls

    monkeypatch.setattr(export_command, "export_onnx", _identity_onnx)
    path = tmp_path / "new" / "deeper" / "model.onnx"
    with caplog.at_level(logging.INFO, logger="kha_compile"):  # -v: the command logs at INFO
        code, out, _ = run(capsys, "-v", "export", "tiny-llama", str(path), "--no-check")
    assert code == 0 and path.is_file()
    assert f"created the output directory {path.parent}" in out
    assert any("created the output directory" in r.getMessage() for r in caplog.records)
    # an existing directory is used as is, without the message
    code, out, _ = run(capsys, "export", "tiny-llama", str(path), "--no-check")
    assert code == 0 and "created the output directory" not in out


def test_export_under_a_file_is_refused(capsys, tmp_path, monkeypatch):
    pytest.importorskip("onnx")
    import kha_compile.cli.commands.export as export_command  # the name the command calls

    monkeypatch.setattr(export_command, "export_onnx", _identity_onnx)
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, "export", "tiny-llama", str(tmp_path / "file" / "model.onnx"), "--no-check")
    assert code == 2 and "exists and is not a directory" in " ".join(err.split())  # rich wraps long lines


def test_export_help_documents_the_directory_behaviour(capsys):
    code, out, _ = run(capsys, "export", "--help")
    assert code == 0 and "directory is created (and reported) if it does not exist" in " ".join(out.split())


def test_export_refuses_an_extension_that_names_no_format(capsys, tmp_path):
    code, _, err = run(capsys, "export", "tiny-llama", str(tmp_path / "model.bin"))
    err = " ".join(err.split())  # rich wraps long lines
    assert code == 2 and "give OUT ending in .onnx (ONNX) or .pt2 (AOTInductor package)" in err
    assert not (tmp_path / "model.bin").exists()


@pytest.mark.slow  # one AOTInductor compile: 20-40 s on two busy cores
def test_export_pt2_writes_a_package_and_checks_it_against_torch(capsys, tmp_path):
    import torch

    from kha_compile.exporters import read_aoti_metadata

    path = tmp_path / "model.pt2"
    code, out, _ = run(capsys, "export", "tiny-llama", str(path), "--mlp")
    assert code == 0, out
    meta = read_aoti_metadata(path)
    assert meta["config"]["v"] == "mlp" and meta["input_names"] == ["input_ids", "attention_mask"]
    assert "AOTInductor export" in out and "package vs torch" in out and "✓" in out
    assert "input_ids" in out and "0: 1..∞" in out
    # the package runs on a shape other than the example's (dynamic batch and sequence)
    ids = torch.randint(0, 128, (3, 11))
    (logits,) = torch._inductor.aoti_load_package(str(path))(ids, torch.ones_like(ids))
    assert logits.shape == (3, 11, 128)


@pytest.mark.slow  # a with-past torch.onnx export: 10-25 s on two busy cores
def test_export_genai_writes_the_directory_and_checks_generated_tokens(capsys, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "genai"
    code, text, _ = run(capsys, "export", "tiny-llama", str(out), "--genai", "--mlp")
    assert code == 0, text
    assert (out / "model.onnx").is_file() and (out / "genai_config.json").is_file()
    assert "input past_key_values.0.key" in text and "output present.1.value" in text
    for line in ("onnxruntime loop tokens", "onnxruntime-genai tokens"):
        assert any(line in ln and "equal ✓" in ln for ln in text.splitlines()), text


@pytest.mark.parametrize(
    "out, flags, match",
    [
        ("m.onnx", ["--genai", "--generation"], "give one"),
        ("m.onnx", ["--generation"], r"give OUT ending in \.pt2"),
        ("m.bin", ["--genai"], r"writes a directory \(or a \.onnx file\)"),
        ("m.pt2", ["--max-cache-len", "8"], "add --generation"),
    ],
)
def test_export_generation_flags_that_do_not_fit(capsys, tmp_path, out, flags, match):
    import re

    code, _, err = run(capsys, "export", "tiny-llama", str(tmp_path / out), *flags)
    assert code != 0 and re.search(match, err), err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("out", ["genai", "new/deeper/genai", "genai.onnx"])
def test_a_refused_genai_export_writes_nothing_and_names_the_flag(capsys, tmp_path, out):
    # an encoder keeps no KV cache: refused after loading, before anything is written
    code, _, err = run(capsys, "export", "tiny-bert", str(tmp_path / out), "--genai")
    err = " ".join(err.split())
    assert code == 2 and "keeps none" in err
    assert "without --genai / --generation" in err and "past=True" not in err
    assert not list(tmp_path.iterdir())  # no directory left behind
