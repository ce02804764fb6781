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


def pytest_collection_modifyitems(session, config, items):
    """The files holding a ``slow`` test run first, each file's tests in their order.

    pytest-xdist's worksteal hands each worker a run of consecutive tests, and a worker that runs dry
    steals from the end of the other's: with the slow files first, what is stolen near the end is short
    tests, so neither worker waits alone on a minute-long vLLM or torchrun test at the end, and a file's
    module-scoped set-up (a compiled package, a torchrun launch) is less often split over both workers.
    """
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within a file is kept


def pytest_runtest_setup(item):
    """``@pytest.mark.inductor``: the test hands graphs to Inductor, whose CPU code is measured first."""
    if item.get_closest_marker("inductor") is not None:
        import machine

        machine.require_inductor()
