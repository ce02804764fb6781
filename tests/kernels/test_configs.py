"""kha_compile.kernels.configs: which autotune configs each launch gets, per architecture."""

from __future__ import annotations

import pytest
import torch

from kha_compile.kernels import configs as kcfg


@pytest.mark.parametrize(("d", "D"), [(1, 16), (16, 16), (17, 32), (48, 64), (64, 64), (100, 128), (128, 128)])
def test_padded_d_is_the_next_power_of_two_from_the_dot_minimum(d, D):
    assert kcfg.padded_d(d) == D


def test_config_class():
    assert kcfg.config_class("fwd", 64, torch.float32) == "fp32"
    assert kcfg.config_class("fwd", 128, torch.bfloat16) == "16bit-d128"
    assert kcfg.config_class("fused", 128, torch.float16) == "16bit"
    assert kcfg.config_class("fwd", 64, torch.float16) == "16bit"


def test_an_architecture_leaves_out_what_does_not_fit_it():
    every = kcfg.CONFIGS[("fused", "16bit")]
    assert kcfg.configs_for("fused", "16bit", 64, None) == every  # the interpreter: all of them
    sm80 = kcfg.configs_for("fused", "16bit", 64, 80)
    assert sm80 == [c for c in every if c not in kcfg.LEFT_OUT["sm_80"][("fused", "16bit", 64)]]
    assert 0 < len(sm80) < len(every)
    assert kcfg.configs_for("fused", "16bit", 64, 90) == every  # nothing left out at D = 64 on sm_90
    assert kcfg.arch_class(86) == "sm_80" and kcfg.arch_class(90) == "sm_90" and kcfg.arch_class(None) is None


def test_backward_at_d128_runs_the_kernels_from_sm90_only():
    assert not kcfg.launch_supported("backward", 128, torch.bfloat16, 80)
    assert kcfg.launch_supported("backward", 128, torch.bfloat16, 90)
    assert kcfg.launch_supported("forward", 128, torch.bfloat16, 80)
    assert kcfg.launch_supported("backward", 64, torch.bfloat16, 80)
