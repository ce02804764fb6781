"""Helpers of the CLI tests (imported as ``cli_cases``): run the command in-process, make checkpoints."""

from __future__ import annotations

import pathlib

import torch

from kha_compile.cli import main


def run(capture, *argv: str) -> tuple[int, str, str]:
    """``kha-compile ARGV`` in-process: (exit status, stdout, stderr)."""
    code = main(list(argv))
    out, err = capture.readouterr()
    return code, out, err


def trained_checkpoint(tmp_path: pathlib.Path, capsys, *roles: str) -> pathlib.Path:
    """A checkpoint written by `apply`, its transforms then moved off identity (as training would)."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    assert run(capsys, "apply", "tiny-llama", *roles, "--out", str(ckpt))[0] == 0
    weights = ckpt / "kha_model.safetensors"
    gen = torch.Generator().manual_seed(0)
    tensors = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "kha_compile", "version": "1"})
    return ckpt
