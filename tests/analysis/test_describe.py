"""Source lines of graph nodes (kha_compile/analysis/describe.py): recorded by the traces whose reasons a user
reads, left out where nobody reads them (apply's self-check), and recorded again after such a block."""

from __future__ import annotations

import torch
from torch import nn

import kha_compile as kc
from kha_compile.analysis.describe import user_line, without_source_lines
from kha_compile.cli import tiny


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2.0  # the line user_line names


def _lines(module: nn.Module) -> list[str]:
    ep = torch.export.export(module, (torch.randn(2, 8),), strict=False)
    return [user_line(n) for n in ep.graph.nodes if n.op == "call_function"]


def test_lines_are_left_out_inside_the_block_only():
    with without_source_lines():
        assert not any(_lines(Scaled()))
    lines = _lines(Scaled())
    assert any(line.startswith("test_describe.py:") and "self.lin(x) * 2.0" in line for line in lines), lines


def test_apply_with_its_self_check_leaves_source_lines_on():
    model = tiny.make("tiny-llama")
    kc.apply(model, kc.KHAConfig(v="mlp"))  # the check traces inside without_source_lines
    assert not torch.fx.config.do_not_emit_stack_traces
    assert any(_lines(Scaled()))
