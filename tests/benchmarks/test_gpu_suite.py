"""benchmarks/gpu_suite.py: its smoke mode runs the whole flow on the CPU, so the GPU script does not rot.

The timings of a smoke run mean nothing; what is checked is that every part ran and recorded what the
GPU run reports (errors against the fp32 formula, each implementation's time, the op's dispatch, the
training and inference ratios with the FLOP ratios), and that a part that fails leaves the others'
results and the files in place.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
pytest.importorskip("transformers")
if importlib.util.find_spec("triton") is None:
    pytest.skip("the smoke run's kernel part needs triton (TRITON_INTERPRET=1)", allow_module_level=True)

from kha_compile.kernels.availability import interpreter_defect

if interpreter_defect() is not None:
    pytest.skip(interpreter_defect(), allow_module_level=True)


@pytest.fixture(scope="module")
def suite():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        yield importlib.import_module("gpu_suite")


@pytest.fixture(scope="module")
def smoke(suite, tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    code = suite.main(["--smoke", "--dims", "16", "--dtypes", "fp16", "--out-dir", str(out)])
    return code, json.loads((out / "gpu_suite_smoke.json").read_text()), (out / "gpu_suite_smoke.txt").read_text()


@pytest.mark.slow
def test_smoke_run_records_every_part(smoke):
    code, rec, text = smoke
    assert code == 0, text
    assert {k: p["status"] for k, p in rec["parts"].items()} == {"kernel": "done", "train": "done", "infer": "done"}
    assert rec["versions"]["torch"] and rec["versions"]["triton"] and rec["versions"]["transformers"]

    (case,) = rec["parts"]["kernel"]["cases"]
    assert case["errors_ok"] and set(case["errors"]) >= {"kernel forward", "compiled grad_v", "kernel grad_w_down"}
    assert set(case["times_ms"]["forward"]) == {"kernel", "eager", "compiled"}
    assert set(case["times_ms"]["backward"]) == {"kernel", "compiled"}
    assert set(case["ratios"]["forward+backward"]) == {"eager / kernel", "compiled / kernel"}
    dispatch = rec["parts"]["kernel"]["dispatch"]
    assert [(e["direction"], e["d"], e["dtype"]) for e in dispatch] == [
        ("forward", 16, "float16"),
        ("backward", 16, "float16"),
    ]
    assert all(e["path"] in ("kernel", "compiled") for e in dispatch)

    train = rec["parts"]["train"]
    assert set(train["flop_ratio"]) == {"none", "linear-qkv", "mlp-v"}
    assert train["flop_ratio"]["none"] == 1.0 and train["flop_ratio"]["mlp-v"] > 1.0  # KHA adds FLOPs
    assert set(train["times_ms"]) == {
        f"{v} {m}" for v in ("none", "linear-qkv", "mlp-v") for m in ("eager", "compiled")
    }
    assert not train["compile_errors"]

    infer = rec["parts"]["infer"]
    assert infer["mlp_logits_vs_formula"] < 1e-3  # the MLP-value model's op path against the eager formula
    assert infer["prefill_ratio"] > 0 and infer["decode_ratio"] > 0
    assert "GOAL" in text and "dispatch" in text


def test_a_failed_part_leaves_the_others_and_the_files(suite, tmp_path, monkeypatch):
    def broken(run, rec, *args, **kwargs):
        rec["partial"] = "kept"
        raise RuntimeError("compile failed (planted)")

    monkeypatch.setattr(suite, "run_train_part", broken)
    code = suite.main(["--smoke", "--parts", "train,infer", "--out-dir", str(tmp_path)])
    rec = json.loads((tmp_path / "gpu_suite_smoke.json").read_text())
    assert code == 3
    train = rec["parts"]["train"]
    assert train["status"] == "failed" and "compile failed (planted)" in train["error"] and train["partial"] == "kept"
    assert rec["parts"]["infer"]["status"] == "done"
    assert "part train stopped" in (tmp_path / "gpu_suite_smoke.txt").read_text()
