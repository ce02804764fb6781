"""Shared test set-up: the zoo helper module is importable from every test folder."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config):
    """One torch thread per pytest-xdist worker: the workers already use every core, and more
    threads than cores make each one several times slower."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_runtest_setup(item):
    """``@pytest.mark.inductor``: the test hands graphs to Inductor, whose CPU code is measured first."""
    if item.get_closest_marker("inductor") is not None:
        import machine

        machine.require_inductor()
