"""kha_compile.cli.commands.viz: `viz` writes one row of panels per layer."""

from __future__ import annotations

import pytest
from cli_cases import run


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


def test_viz_without_matplotlib_says_what_to_install(capsys, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code, _, err = run(capsys, "viz", "tiny-llama", "--kha", str(tmp_path), "--out", str(tmp_path / "k.png"))
    assert code == 2 and "pip install 'kha-compile[viz]'" in err
