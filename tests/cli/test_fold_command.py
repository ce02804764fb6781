"""kha_compile.cli.commands.fold: `fold` writes a vanilla model equal to the KHA model."""

from __future__ import annotations

import torch
from cli_cases import run, trained_checkpoint

import kha_compile as kc
from kha_compile.cli import tiny


def test_fold_saves_a_vanilla_model_equal_to_the_kha_model(capsys, tmp_path):
    from transformers import LlamaForCausalLM

    ckpt = trained_checkpoint(tmp_path, capsys, "--q", "linear", "--k", "linear", "--v", "linear")
    out_dir = tmp_path / "folded"
    code, out, _ = run(capsys, "fold", "tiny-llama", "--kha", str(ckpt), "--out", str(out_dir))
    assert code == 0 and "folded" in out
    folded = LlamaForCausalLM.from_pretrained(str(out_dir)).eval()
    assert not any("kha" in k for k in folded.state_dict())
    kha_model = kc.load_pretrained(tiny.make("tiny-llama"), ckpt)
    plain = tiny.make("tiny-llama")
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
