"""The subcommands of ``kha-compile``, one module each (or one per group), in the order ``--help`` lists them.

Each module has ``NAME``, ``register(sub, common) -> parser`` (adds its subparser) and
``run(args, ui) -> exit status``. A new command is one new module and one entry in :data:`COMMANDS`.
"""

from __future__ import annotations

from types import ModuleType

from . import bench, demo, export, fold, inspect_apply, kernels, viz

__all__ = ["COMMANDS"]

COMMANDS: tuple[ModuleType, ...] = (demo, inspect_apply, fold, export, bench, viz, kernels)
