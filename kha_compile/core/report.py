"""What the pass found: one :class:`AttentionSite` per attention, in a printable :class:`Report`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .kinds import SiteKind, SiteStatus

__all__ = ["AttentionSite", "Report"]


@dataclasses.dataclass
class AttentionSite:
    """One attention op in the model, matched (with its projections) or skipped (with a reason)."""

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
        return self.status == "matched"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Report:
    """The sites of a model; ``str(report)`` is a table.

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

    @property
    def matched(self) -> list[AttentionSite]:
        return [s for s in self.sites if s.matched]

    @property
    def skipped(self) -> list[AttentionSite]:
        return [s for s in self.sites if not s.matched]

    def rows(self) -> list[list[str]]:
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
        return "\n".join(lines).rstrip()

    def __len__(self) -> int:
        return len(self.sites)

    def to_dict(self) -> dict:
        return {"model": self.model, "trace_path": self.trace_path, "sites": [s.to_dict() for s in self.sites]}
