"""Roles that read the same features of one projection: their transforms go on the attention's arguments.

A transform after a projection changes every call of it and every role that reads its output. When
two roles read the same output features of one projection, that is not KHA:

* ``k = v``: one projection read as keys and as values (DeepSeek-V4's ``kv_proj``);
* ``q = k``: shared-QK attention, one projection read as queries and as keys (Reformer without LSH);
* one projection module *called* more than once with its calls feeding different roles: two-way
  cross-attention running one query/key projection on both inputs (the query of one direction and
  the key of the other come from it), in one attention or in two.

:func:`split_shared` finds every such role over all sites of a graph and gives it the argument of
the attention call that carries it (:mod:`.attention_calls`): its transform then acts on exactly
that role, where the paths part. A role whose argument cannot be found (it is joined from several
projections, or its attention is no call kha_compile can find again) keeps ``at_attention=None``;
the plan skips its site with the reason when the role has a transform.

Example::

    split_shared(g, sites)      # sites[0].roles["q"].at_attention -> AttentionArg("", "sdpa", 0, 0, -1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from .attention_calls import attention_arg

if TYPE_CHECKING:  # pragma: no cover
    from .graph import MatchGraph
    from .match import RawSite, RoleMatch

__all__ = ["sharing_words", "split_shared"]

_WORDS = {"q": "queries", "k": "keys", "v": "values"}


def _features(m: RoleMatch) -> set[int]:
    """The positions along the weight's output axis that the role's heads read."""
    return set(m.projection.feature_map[m.head_map.index].flatten().tolist())


def split_shared(g: MatchGraph, sites: list[RawSite]) -> None:
    """Mark every role whose projection features another role reads too, and give it its attention argument.

    Example::

        split_shared(g, sites)
    """
    readers: dict[str, list[tuple[RawSite, str, RoleMatch, set[int]]]] = {}
    for site in sites:  # skipped sites too: a role they read stays untouched by the others' transforms
        for r, first in site.roles.items():
            for m in (first, *site.joint.get(r, ())):
                readers.setdefault(m.projection.param, []).append((site, r, m, _features(m)))
    marks: dict[tuple[int, str], tuple[set[str], bool]] = {}  # (site, role) -> (roles sharing, through other calls)
    for group in readers.values():
        for s1, r1, m1, f1 in group:
            for _, r2, m2, f2 in group:
                if r1 != r2 and f1 & f2:
                    roles, calls = marks.get((id(s1), r1), (set(), False))
                    marks[(id(s1), r1)] = (roles | {r1, r2}, calls or m1.projection.node is not m2.projection.node)
    for site in sites:
        if site.reason or set(site.roles) != {"q", "k", "v"}:
            continue  # skipped: no transform to place
        for r in "qkv":
            mark = marks.get((id(site), r))
            if mark is None:
                continue
            roles, calls = mark
            arg = None
            target = site.targets.get(r)
            if target is not None and not site.joint.get(r):
                arg = attention_arg(g, site.node, target[0], target[1], r)
            shares = tuple(x for x in "qkv" if x in roles)
            site.roles[r] = dataclasses.replace(site.roles[r], at_attention=arg, shares=shares, shares_calls=calls)


def sharing_words(m: RoleMatch, rename: Callable[[str], str] = lambda p: p) -> str:
    """What the roles that share ``m``'s projection features are, in words ('' when none).

    Example::

        sharing_words(m)      # "q = k: queries and keys are the same features of qk"
    """
    if not m.shares:
        return ""
    proj = rename(m.projection.module_path or m.projection.param)
    names = [_WORDS[r] for r in m.shares]
    words = ", ".join(names[:-1]) + " and " + names[-1]
    if m.shares_calls:
        return f"{', '.join(m.shares)}: {proj} is called more than once and its calls feed {words}"
    return f"{' = '.join(m.shares)}: {words} are the same features of {proj}"
