"""Graph nodes in words a user can act on: the op, the module that runs it, and the line of model code.

A reason that only says ``stopped at conv2d_20`` names a node of an exported graph nobody sees. The
walks from an attention back to its projections say instead which op stopped them, in which module
and, when the op is written in the model's own code, at which line::

    a linear over another axis (the nn.Linear E, in Linformer) at model.py:41 (k = self.E(k))

Example::

    op_words(node)      # "conv2d (in stages.3.0.attn, a Conv2d) at halo.py:88 (q = self.q(x))"
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch.fx
from torch.fx import Node

from .graph import module_path_of

__all__ = ["op_words", "user_line", "without_source_lines"]

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)')
_LIBRARY = ("/torch/", "/site-packages/", "/dist-packages/", "/kha_compile/")


def user_line(node: Node) -> str:
    """``file.py:LINE (code)`` of the last frame of model code that made ``node`` ('' when unknown).

    Example::

        user_line(node)     # "model.py:41 (k = self.E(k.transpose(1, 2)))"
    """
    frames = _FRAME.findall(str(node.meta.get("stack_trace") or ""))
    own = [f for f in frames if not any(part in f[0] for part in _LIBRARY)]
    if not own:
        return ""
    path, line, code = own[-1]
    code = code.split("  #")[0].strip()  # the code, not its comment
    return f"{path.rpartition('/')[2]}:{line} ({code[:80]})"


def op_words(node: Node) -> str:
    """The op of ``node``, the module whose forward runs it, and the model-code line that made it.

    Example::

        op_words(linear_node)     # "linear (in E, a Linear)"
    """
    target = getattr(node.target, "__name__", str(node.target))
    op = target.split(".")[0] if node.op == "call_function" else node.op
    stack = node.meta.get("nn_module_stack") or {}
    where = ""
    if stack:
        path = module_path_of(node)
        cls = str(list(stack.values())[-1][1]).rpartition(".")[2]
        where = f" (in {path or 'the model'}, a {cls})" if cls else f" (in {path or 'the model'})"
    line = user_line(node)
    return f"{op}{where}" + (f" at {line}" if line else "")


@contextlib.contextmanager
def without_source_lines() -> Iterator[None]:
    """Traces in this block record no source line per node (``node.meta["stack_trace"]``, what
    :func:`user_line` reads).

    The lines name the model code in the reasons a report gives; a trace nobody reads a reason of
    (apply's self-check) skips them: a sixth of an export's time.
    """
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before
