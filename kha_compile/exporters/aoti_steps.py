"""The steps of an AOTInductor export that every package takes: lower the kha ops, compile, read ranges.

:func:`lower_kha_ops` replaces every ``kha::`` op by its formula (:data:`KHA_DECOMPOSITIONS`), so the
package needs no kha_compile to load; :func:`compile_package` runs AOTInductor with the package's
metadata; :func:`input_ranges` reads the dynamic input axes back from the program. Both
:func:`kha_compile.export_aoti` paths (one forward; generation over a static cache) use them.

Example::

    program = lower_kha_ops(torch.export.export(model, (x,)))
    compile_package(program, pathlib.Path("m.pt2"), metadata, None, "MyModel")
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import torch
from torch import nn
from torch.utils._sympy.numbers import int_oo

from ..core.errors import ExportError
from ..ops.mlp_value import mlp_value_reference
from .common import root_reason

__all__ = ["AOTI_TOL", "KHA_DECOMPOSITIONS", "compile_package", "eval_mode", "input_ranges", "kha_ops", "lower_kha_ops"]

log = logging.getLogger(__name__)

AOTI_TOL = 1e-4  # max |package - eager| of the check, relative to max(1, max |eager|)
# what a kha:: op becomes in the package; every new kha op needs its formula here (lower_kha_ops checks)
KHA_DECOMPOSITIONS: dict[Any, Any] = {torch.ops.kha.mlp_value.default: mlp_value_reference}


def lower_kha_ops(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` with every ``kha::`` op replaced by aten ops (:data:`KHA_DECOMPOSITIONS`; nothing else).

    Raises :class:`~kha_compile.core.errors.ExportError` (step 'lower') naming any ``kha::`` op left.

    Example::

        ep = lower_kha_ops(torch.export.export(model, (x,)))
        torch._inductor.aoti_compile_and_package(ep)     # the package needs no kha_compile
    """
    try:
        program = program.run_decompositions(KHA_DECOMPOSITIONS)  # only these ops: the rest stays as exported
    except Exception as e:
        raise ExportError(f"AOTI export, step 'lower': decomposing the kha ops failed: {root_reason(e)}") from e
    left = sorted(kha_ops(program))
    if left:
        raise ExportError(
            f"AOTI export, step 'lower': {', '.join(left)} left in the program after lowering (no entry in "
            "KHA_DECOMPOSITIONS); the package would need kha_compile to load. This is a kha_compile bug: report it."
        )
    return program


def kha_ops(program: torch.export.ExportedProgram) -> set[str]:
    """The ``kha::`` ops called anywhere in ``program`` (sub-graphs included), as ``kha.name.overload``."""
    found = set()
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function" and getattr(node.target, "namespace", None) == "kha":
                    found.add(str(node.target))
    return found


def input_ranges(program: torch.export.ExportedProgram, names: list[str]) -> dict[str, dict[str, list[int | None]]]:
    """``{input: {axis: [min, max]}}`` of the program's dynamic input axes (max None: unbounded)."""
    ranges = {str(sym): vr for sym, vr in program.range_constraints.items()}
    users = set(program.graph_signature.user_inputs)
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in users]
    out: dict[str, dict[str, list[int | None]]] = {}
    for name, node in zip(names, placeholders):
        for axis, size in enumerate(node.meta["val"].shape):
            vr = ranges.get(str(size)) if isinstance(size, torch.SymInt) else None
            if vr is not None:
                upper = None if vr.upper == int_oo or not vr.upper.is_finite else int(vr.upper)  # unbounded
                out.setdefault(name, {})[str(axis)] = [int(vr.lower), upper]
    return out


def compile_package(
    program: torch.export.ExportedProgram,
    path: pathlib.Path,
    metadata: dict[str, str],
    inductor_configs: dict[str, Any] | None,
    name: str,
) -> None:
    """AOTInductor: ``program`` into the package ``path`` with ``metadata``; ExportError (step 'compile')."""
    options = {
        # Inductor assumes dynamic sizes >= 2; without this the runtime input checks
        # (AOTI_RUNTIME_CHECK_INPUTS=1) refuse batch or sequence 1
        "aot_inductor.check_lowerbound": False,
        **(inductor_configs or {}),
        "aot_inductor.metadata": dict(metadata),  # a copy: Inductor adds its AOTI_* keys to the dict it gets
    }
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=options)
    except Exception as e:
        raise ExportError(f"AOTI export of {name}, step 'compile' failed: {root_reason(e)}") from e


class eval_mode:
    """Context: ``module`` in eval mode, its training flag restored afterwards."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.training = module, module.training

    def __enter__(self) -> None:
        self.module.eval()

    def __exit__(self, *exc: object) -> None:
        self.module.train(self.training)
