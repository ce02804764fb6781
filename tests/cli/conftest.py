"""Tables at a fixed width for every CLI test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Tables at a fixed width, whatever the terminal of the test run."""
    monkeypatch.setenv("COLUMNS", "200")
