"""Fresh Dynamo state and backend stats around every backend test."""

from __future__ import annotations

import pytest
import torch

import kha_compile as kc


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    kc.backend.reset()
    yield
    torch._dynamo.reset()
