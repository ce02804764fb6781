"""Shared test set-up: the zoo helper module is importable from every test folder."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
