"""What the pass found: one :class:`AttentionSite` per attention, in a printable :class:`Report`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .kinds import SiteKind, SiteStatus

__all__ = ["AttentionSite", "Report"]


@dataclasses.dataclass
class AttentionSite:
    """One attention op in the model, matched (with its projections) or skipped (with a reason).

    Attributes:
        name: where the attention is (the module path of the attention, or the op's node name).
        status: ``"matched"`` or ``"skipped"``.
        reason: why the site was skipped (empty when matched).
        kind: ``"mha"``, ``"gqa"``, ``"mqa"``, ``"mla"`` or ``"cross"``.
        num_heads: query heads.
        num_kv_heads: key/value heads.
        head_dim: the size of a query/key head vector.
        v_head_dim: the size of a value head vector, where it differs.
        q_proj: module path of the projection feeding the queries (``k_proj``, ``v_proj`` likewise).
        rope: rotary embeddings sit between the projection and the attention.
        qk_norm: a norm on q and k sits between the projection and the attention.
        anchor: the rule that found the attention (``"sdpa"``, ``"manual_softmax"``, ...).
        transforms: role -> transform kind carried (``{"v": "mlp"}``), after ``apply``.
        note: what else to know: a requested transform changed, functional or N-d projections, k = v.
        joint: role -> the other projections feeding it (joint streams concatenated along the sequence,
            sums of projections), each applying the role's one shared transform.
        join: role -> how ``joint`` meets the role's own projection (``"cat"`` or ``"sum"``).
        found: on a skipped site, the roles that were traced back to a projection.
        calls: attention calls the site stands for (one per head where heads are separate modules).

    Example::

        site = kc.inspect(model).sites[0]
        site.status, site.kind, site.num_heads, site.projections("v")   # 'matched', 'gqa', 4, ['...v_proj']
    """

    name: str
    status: SiteStatus
    reason: str = ""
    kind: SiteKind | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    q_proj: str | None = None
    k_proj: str | None = None
    v_proj: str | None = None
    rope: bool = False
    qk_norm: bool = False
    anchor: str = ""  # "sdpa" | "manual_softmax"
    transforms: dict[str, str] = dataclasses.field(default_factory=dict)  # role -> "linear" | "mlp"
    note: str = ""  # e.g. why a requested transform was changed
    # role -> the other projections feeding it (joint streams: "cat" along the sequence; sums: "sum"),
    # each applying the same shared transform as the role's own projection
    joint: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    join: dict[str, str] = dataclasses.field(default_factory=dict)
    found: list[str] = dataclasses.field(default_factory=list)  # skipped: roles traced back to a projection
    calls: int = 1  # attention calls the site stands for: one per head where heads are separate modules

    def projections(self, role: str) -> list[str]:
        """Every projection module path of ``role``: its own, then those of joint streams."""
        own = getattr(self, f"{role}_proj")
        return ([own] if own else []) + list(self.joint.get(role, []))

    @property
    def matched(self) -> bool:
        """True for a matched site."""
        return self.status == "matched"

    def to_dict(self) -> dict:
        """The site as a JSON-ready dict."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Report:
    """The sites of a model; ``str(report)`` is a table.

    Attributes:
        model: the model's class name.
        sites: one :class:`AttentionSite` per attention call of the graph, matched or skipped.
        trace_seconds: how long the trace took.
        traced_blocks: repeated blocks traced once for all of their copies.
        trace_path: how the graph was captured: ``"whole model"``, ``"one block per type"`` or
            ``"per submodule"`` (when the whole model does not trace).
        untraced: ``(submodule, why)`` for submodules that could not be traced.
        note: what else to know about the whole model (``kc.inspect`` of a model with no attention
            says so here, with what was looked for).

    Example::

        report = kc.inspect(model)
        print(report)
        [s.name for s in report.sites if s.status == "skipped"]
    """

    model: str
    sites: list[AttentionSite]
    trace_seconds: float = 0.0
    traced_blocks: int = 0
    trace_path: str = "whole model"  # how the graph was captured: whole model, one block per type, per submodule
    untraced: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (submodule, why) not traced
    note: str = ""  # e.g. that no attention was found, and what was looked for

    @property
    def matched(self) -> list[AttentionSite]:
        """The matched sites."""
        return [s for s in self.sites if s.matched]

    @property
    def skipped(self) -> list[AttentionSite]:
        """The skipped sites, each with its reason."""
        return [s for s in self.sites if not s.matched]

    def rows(self) -> list[list[str]]:
        """The table's rows, one per site, in the columns of :attr:`HEADER`."""
        rows = []
        for s in self.sites:
            if s.matched:
                tf = ",".join(f"{r}:{k}" for r, k in sorted(s.transforms.items())) or "-"
                projs = "/".join(sorted({p.rpartition(".")[2] for r in "qkv" for p in s.projections(r)}))
                rows.append(
                    [
                        s.name,
                        s.kind or "",
                        str(s.num_heads),
                        str(s.num_kv_heads),
                        str(s.head_dim),
                        "yes" if s.rope else "-",
                        "yes" if s.qk_norm else "-",
                        projs,
                        tf,
                        s.note,
                    ]
                )
            else:
                rows.append([s.name, "skipped", "", "", "", "", "", "", "", s.reason])
        return rows

    HEADER: ClassVar[list[str]] = ["site", "kind", "heads", "kv", "dim", "rope", "qk-norm", "proj", "kha", "note"]

    def __str__(self) -> str:
        rows = [self.HEADER, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.HEADER) - 1)]
        lines = [
            f"{self.model}: {len(self.matched)} attention sites matched, {len(self.skipped)} skipped "
            f"(traced: {self.trace_path})"
        ]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + ("  " + r[-1] if r[-1] else ""))
        if self.note:
            lines.append(self.note)
        return "\n".join(lines).rstrip()

    def __len__(self) -> int:
        return len(self.sites)

    def to_dict(self) -> dict:
        """The report as a JSON-ready dict."""
        return {"model": self.model, "trace_path": self.trace_path, "sites": [s.to_dict() for s in self.sites]}
