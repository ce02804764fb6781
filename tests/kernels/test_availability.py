"""kha_compile.kernels.availability: when the Triton kernels can run, and why not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kha_compile.core.errors import BackendUnavailableError
from kha_compile.kernels import availability, mlp_value_triton

triton = pytest.importorskip("triton")


@pytest.mark.parametrize(
    ("triton_version", "numpy_version", "broken"),
    [
        ("3.6.0", "2.4.6", True),
        ("3.5.1", "2.5.0.dev0", True),
        ("3.6.0", "2.3.5", False),
        ("3.7.0", "2.4.6", False),
        ("3.9.0+git1234", "2.5.2", False),
    ],
)
def test_interpreter_defect_by_versions(triton_version, numpy_version, broken):
    reason = availability.interpreter_defect(triton_version, numpy_version)
    assert (reason is not None) == broken
    if broken:
        assert triton_version in reason and numpy_version in reason
        assert "triton >= 3.7" in reason and "9171" in reason


def test_the_interpreter_with_the_defect_is_refused_with_its_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(np, "__version__", "2.4.6")
    assert not availability.triton_available()
    with pytest.raises(BackendUnavailableError, match=r"triton 3\.6\.0.*numpy 2\.4\.6.*triton >= 3\.7"):
        mlp_value_triton(torch.randn(4, 16), *[torch.eye(16)] * 3)
