"""kha_compile.backend.rules: one list of rules, in the order the stats report them."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

import kha_compile as kc
from kha_compile.backend import RULES, DeployKHA, FoldLinearKHA, FuseMLPValue, RuleName
from kha_compile.backend.rules import RuleSetup
from kha_compile.backend.stats import BackendStats, Decline, GraphStats


def test_rules_listed_once_and_named_by_the_literal():
    assert [r.name for r in RULES] == list(get_args(RuleName))
    assert list(BackendStats().rewrites) == [r.name for r in RULES]


@pytest.mark.parametrize(
    "options, deploy, expected",
    [
        ({"fold": True, "fuse_mlp": True}, None, [FuseMLPValue, FoldLinearKHA]),
        ({"fold": True, "fuse_mlp": False}, None, [FoldLinearKHA]),
        ({"fold": False, "fuse_mlp": True}, [], [DeployKHA, FuseMLPValue, FoldLinearKHA]),
    ],
)
def test_each_rule_decides_whether_it_runs(options, deploy, expected):
    setup = RuleSetup(options, deploy)
    assert [type(r) for cls in RULES if (r := cls.create(setup)) is not None] == expected


def test_stats_sum_over_graphs_and_declines_unpack():
    stats = BackendStats(
        [
            GraphStats(0, {"fold_linear": 2}, [Decline("fold_linear", "mm", "why")], 1, True),
            GraphStats(1, {"fold_linear": 1, "deploy": 3}, [], 2, False),
        ]
    )
    assert stats.rewrites == {"deploy": 3, "fuse_mlp_value": 0, "fold_linear": 3}
    assert stats.mlp_value_ops == 3 and stats.has_kha
    ((rule, node, reason),) = stats.declined
    assert (rule, node, reason) == ("fold_linear", "mm", "why")
    assert "3 linear transform(s) folded" in str(stats) and "3 transform(s) inserted" in str(stats)


def test_backend_stats_of_a_real_compile():
    mod = torch.nn.Linear(4, 4)
    be = kc.backend(compiler="eager")
    torch.compile(mod, backend=be)(torch.randn(2, 4))
    assert len(be.stats.graphs) == 1 and not be.stats.has_kha
