"""Shared test set-up: the zoo helper module is importable from every test folder."""

from __future__ import annotations

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config):
    """One torch thread per pytest-xdist worker: the workers already use every core, and more
    threads than cores make each one several times slower.

    A full garbage collection a tenth as often as Python's default (threshold2 100, not 10): a test process
    holds millions of live objects (torch, transformers, onnx, every module-scoped model), and each full
    collection walks all of them, at the default about every three seconds. Measured (gc.callbacks) on
    tests/passes, tests/handlers and two attention-forms files, two workers: 12 full collections per worker
    instead of 27-28, and 5.5 s of collecting instead of 9 to 10 (of about 120 s). Only when collections run
    changes, not what they free.
    """
    gc.set_threshold(*gc.get_threshold()[:2], 100)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_runtest_setup(item):
    """``@pytest.mark.inductor``: the test hands graphs to Inductor, whose CPU code is measured first."""
    if item.get_closest_marker("inductor") is not None:
        import machine

        machine.require_inductor()
