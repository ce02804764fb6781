"""Small helpers shared by the test files."""

from __future__ import annotations

import torch
from torch import nn

import zoo


def main_output(out):
    """The tensor a model's forward is about: logits, last hidden state, or the output itself."""
    if isinstance(out, dict) and "sentence_embedding" in out:
        return out["sentence_embedding"]
    for attr in ("logits", "last_hidden_state"):
        if getattr(out, attr, None) is not None:
            return getattr(out, attr)
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def run(case: zoo.ZooCase) -> torch.Tensor:
    """The case's main output. Grad mode is left to the caller: nn.TransformerEncoderLayer's fused
    no-grad fast path rounds differently from its regular path, so compare like with like."""
    return main_output(case())


def kha_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".kha." in f".{n}"}


def perturb(model: nn.Module, seed: int = 1, scale: float = 0.1) -> None:
    """Move every KHA weight off its identity init, as training would; fails when there is none to move."""
    params = kha_params(model)
    assert params, f"{type(model).__name__} has no KHA parameters to perturb"
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in params.items():
            before = p.detach().clone()
            p.add_(scale * torch.randn(p.shape, generator=gen).to(p.dtype))
            assert p.is_meta or not torch.equal(p, before), f"perturbing {name} changed nothing"


def run_python(script: str, expect: str, timeout: int = 300) -> None:
    """Run ``script`` in a fresh interpreter; it must exit 0 and print ``expect``."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and expect in res.stdout, res.stderr[-2000:]
