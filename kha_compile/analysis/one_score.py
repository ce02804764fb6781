"""One score matrix read both ways: T^Q and T^K are one transform there.

Bidirectional cross-attention computes one score matrix ``S = A B^T`` per head, from one projection (or
one per side) used for both roles, and reads it both ways: a softmax over its last axis weighs B's
values for A's tokens, a softmax over its first axis weighs A's values for B's tokens. Each side is
the queries of one direction and the keys of the other, in the same product. Two transforms (T^Q on
the queries, T^K on the keys) would need two score products; one score matrix has room for one
transform per side, and a definition that holds in both directions needs the same one on both:
``S' = (A T)(B T)^T``, so in each direction the queries and the keys carry T (T^Q = T^K = T).

It stays KHA: one matrix shared by every head of both roles, identity at init, and, being after the
projections, it folds into each (linear kinds). The match marks such sites ``tied`` (:func:`tie_one_score`);
the plan puts the one transform after both sides' projections (the second side holds the first's) and
the report says so (:func:`tied_note`). The transform is there when q or k asks for it (one asking is
enough: the note says the other role carries it too); q and k asking different kinds get neither, and
the note says why: one transform cannot be two kinds.

Example::

    tie_one_score(g, sites)      # the two directions of one score: sites[i].tied -> True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch.fx import Node

if TYPE_CHECKING:  # pragma: no cover
    from .graph import MatchGraph
    from .match import RawSite

__all__ = ["tie_one_score", "tied_kinds", "tied_note"]


def _score_of(g: MatchGraph, site: RawSite) -> Node | None:
    """The op both the site's q and k operands enter: the score product (or the attention call)."""
    q, k = site.targets["q"][0], site.targets["k"][0]
    if q is k:  # shared-QK: one operand for both roles (:mod:`.shared_roles`)
        return None
    common = [u for u in g.users(q) if u in set(g.users(k))]
    return common[0] if len(common) == 1 else None


def tie_one_score(g: MatchGraph, sites: list[RawSite]) -> None:
    """Mark the matched sites that read one score matrix both ways (the query operand of one is the key
    operand of another): their q and k get one transform after the projections, not the attention
    arguments :mod:`.shared_roles` gave them for sharing a projection's features.

    A q or k projection whose features a value role reads too is left as it was (not tied).

    Example::

        tie_one_score(g, sites)
    """
    by_score: dict[Node, list[RawSite]] = {}
    for site in sites:
        if site.reason or set(site.roles) != {"q", "k", "v"} or not {"q", "k"} <= set(site.targets):
            continue
        score = _score_of(g, site)
        if score is not None:
            by_score.setdefault(score, []).append(site)
    for group in by_score.values():
        queries = {s.targets["q"][0] for s in group}
        if not queries & {s.targets["k"][0] for s in group}:
            continue  # one score read one way (several value products of one softmax)
        if any(set(s.roles[r].shares) - {"q", "k"} for s in group for r in "qk"):
            continue
        for site in group:
            site.tied = True
            for r in "qk":
                site.roles[r] = dataclasses.replace(site.roles[r], at_attention=None, shares=(), shares_calls=False)


def tied_kinds(kinds: dict[str, str]) -> tuple[dict[str, str], str, str]:
    """(the kinds a tied site plans, the role whose name the one transform takes, what the note adds).

    The one transform is asked by q or by k; it takes q's name (k's when only k asks for it), and the
    other side holds it. q and k asking different kinds get neither: one transform cannot be two kinds.

    Example::

        tied_kinds({"q": "linear", "k": "linear", "v": "mlp"})    # ({"q": "linear", "v": "mlp"}, "q", "")
    """
    q, k = kinds.get("q"), kinds.get("k")
    rest = {r: x for r, x in kinds.items() if r not in ("q", "k")}
    if q is None and k is None:
        return rest, "", ""
    if q is not None and k is not None and q != k:
        return (
            rest,
            "",
            (
                f"the KHAConfig asks q={q!r} and k={k!r}, and here T^Q and T^K are one transform, so neither is "
                "inserted (give q and k the same kind)"
            ),
        )
    role = "q" if q is not None else "k"
    if q == k:
        return {role: kinds[role], **rest}, role, ""
    other = "keys" if role == "q" else "queries"
    return (
        {role: kinds[role], **rest},
        role,
        f"the KHAConfig asks {role}={kinds[role]!r} only; the {other} carry it too",
    )


def tied_note(site: RawSite, rename: Callable[[str], str] = lambda p: p) -> str:
    """What the report says of a tied site's q and k.

    Example::

        tied_note(site)     # "q, k: one score matrix read both ways (... qk_a and qk_b ...) ..."
    """
    paths = dict.fromkeys(rename(site.roles[r].projection.module_path) for r in "qk")
    sides = " and ".join(paths)
    return (
        "q, k: one score matrix read both ways (bidirectional: the queries of one direction are the keys of "
        f"the other): T^Q and T^K are one transform T, after {sides}, shared by both directions, so every "
        "query and key carries the same T (folded into the projection where linear)"
    )
