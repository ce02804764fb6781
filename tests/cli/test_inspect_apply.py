"""kha_compile.cli.commands.inspect_apply: `inspect` and `apply`."""

from __future__ import annotations

import json
import logging

from cli_cases import run

import kha_compile as kc
from kha_compile.cli import main, tiny


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
    model = kc.load_pretrained(tiny.make("tiny-llama"), ckpt)
    assert {s.transforms["v"] for s in kc.inspect(model).matched} == {"mlp"}


def test_apply_without_roles_uses_the_default_config(capsys, tmp_path):
    code, _, _ = run(capsys, "apply", "tiny-bert", "--out", str(tmp_path))
    assert code == 0
    config = json.loads((tmp_path / "kha_config.json").read_text())
    assert (config["q"], config["k"], config["v"]) == (None, None, "mlp")


def test_apply_bad_kind_is_a_usage_error_of_apply_with_the_cli_spelling(capsys, tmp_path):
    code, out, err = run(capsys, "apply", "tiny-llama", "--v", "mpl", "--out", str(tmp_path / "x"))
    assert code == 2
    assert err.startswith("usage: kha-compile apply")
    assert "argument --v: 'mpl' is not allowed; use one of none, linear, mlp" in err
    assert "None" not in err and "Traceback" not in err + out
    assert not (tmp_path / "x").exists()
    code, _, err = run(capsys, "apply", "tiny-llama", "--q", "mlp", "--out", str(tmp_path / "x"))
    assert code == 2 and "argument --q: 'mlp' is not allowed; use one of none, linear" in err


def test_apply_kinds_are_case_insensitive_and_none_means_no_transform(capsys, tmp_path):
    code, _, _ = run(capsys, "apply", "tiny-llama", "--q", "Linear", "--v", "NONE", "--out", str(tmp_path))
    assert code == 0
    config = json.loads((tmp_path / "kha_config.json").read_text())
    assert (config["q"], config["k"], config["v"]) == ("linear", None, None)


def test_config_error_is_a_clean_error_with_exit_code_2(capsys, tmp_path):
    code, out, err = run(
        capsys, "apply", "tiny-llama", "--q", "none", "--k", "none", "--v", "none", "--out", str(tmp_path / "x")
    )
    assert code == 2
    assert "error:" in err and "inserts nothing" in err
    assert "Traceback" not in err + out
    assert not (tmp_path / "x").exists()


def test_verbose_error_shows_the_traceback(capsys, tmp_path):
    code, _, err = run(capsys, "-v", "apply", "tiny-llama", "--v", "none", "--q", "none", "--out", str(tmp_path))
    assert code == 2
    assert "Traceback" in err and "inserts nothing" in err


def test_unknown_model_is_a_clean_error(capsys):
    code, _, err = run(capsys, "inspect", "no-such-model")
    assert code == 2
    assert "unknown model 'no-such-model'" in err and "tiny-llama" in err and "Traceback" not in err


def test_logging_is_restored_after_a_command(capsys):
    logger = logging.getLogger("kha_compile")
    handlers, level = list(logger.handlers), logger.level
    assert main(["-v", "inspect", "tiny-bert"]) == 0
    capsys.readouterr()
    assert logger.handlers == handlers and logger.level == level
