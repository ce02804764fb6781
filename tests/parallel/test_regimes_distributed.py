"""DDP and FSDP2 with mixed precision, pass-made KHA against KHA written by hand, on 2 CPU ranks (gloo).

One launch runs every check (tests/parallel/_regime_ranks.py): llama and qwen3, linear and
MLP-value KHA, per-rank batches; losses, no_grad logits and greedy tokens compared per rank.
"""

from __future__ import annotations

import pytest
from _launch import expect, torchrun_once

pytestmark = pytest.mark.slow  # torchrun launches (2-4 ranks)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def regimes_run(tmp_path_factory):
    return torchrun_once(tmp_path_factory, "regimes", "_regime_ranks.py", 2, timeout=600)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ddp_equals_kha_written_by_hand(regimes_run, arch, kind):
    expect(regimes_run, f"OK ddp {arch} {kind} equals hand-written", 2)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fsdp2_mixed_precision_equals_kha_written_by_hand(regimes_run, arch, kind):
    expect(regimes_run, f"OK fsdp2-bf16 {arch} {kind} equals hand-written", 2)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("name", ["ddp", "fsdp2-bf16"])
def test_identity_at_init_is_exact(regimes_run, name, arch, kind):
    """Right after apply, wrapped the same way: logits and every original weight's gradient equal exactly."""
    expect(regimes_run, f"OK {name} {arch} {kind} identity at init", 2)


@pytest.mark.parametrize("name", ["ddp", "fsdp2-bf16"])
def test_a_role_left_out_is_caught(regimes_run, name):
    expect(regimes_run, f"OK {name} catches a missing role", 2)
