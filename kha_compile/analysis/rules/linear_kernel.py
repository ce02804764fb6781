"""Rule ``linear_kernel``: a linear-attention kernel call kept whole in the trace (gated delta rule, KDA, fla).

:mod:`..opaque_kernels` traces each such kernel as ``kha::linear_attention_kernel(q, k, v, others,
form)``. Its q and k are (B, S, H, Dk) and v is (B, S, Hv, Dv), Hv a multiple of H (Qwen3-Next
serves several value heads with one query/key head). The anchor names the kernel's form
("gated_delta_rule", "kimi_delta_attention", or an fla kernel's name), and the walk back from q, k,
v goes through the layer's depthwise short convolution and activation to the projections, where
KHA goes: before the convolution, the kernel's L2 norm of q and k, and its scaling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.fx import Node

from ..layout import shape_of
from ..opaque_kernels import linear_attention_kernel
from . import register_rule
from .base import Anchor

if TYPE_CHECKING:  # pragma: no cover
    from ..graph import MatchGraph

__all__ = ["KERNEL_OP", "LinearKernelRule"]

KERNEL_OP = linear_attention_kernel._opoverload


class LinearKernelRule:
    """Anchor on ``kha::linear_attention_kernel``: q, k, v are its first three arguments, (B, S, H, D).

    Example::

        rule = LinearKernelRule()
        anchor = rule.match(g, node)   # None unless node is a kept-whole kernel call
    """

    name = "linear_kernel"
    priority = 45

    def match(self, g: MatchGraph, node: Node) -> Anchor | None:
        if node.op != "call_function" or node.target is not KERNEL_OP:
            return None
        form = node.args[4] if len(node.args) > 4 and isinstance(node.args[4], str) else self.name
        q, k, v = node.args[:3]
        shapes = [shape_of(a) if isinstance(a, Node) else None for a in (q, k, v)]
        qs, ks, vs = shapes
        if qs is None or ks is None or vs is None or not (len(qs) == len(ks) == len(vs) == 4):
            return Anchor(node, form, {}, {}, f"{form} kernel: q, k, v are not (B, S, H, D) tensors ({shapes})")
        if qs != ks or vs[2] % ks[2]:
            return Anchor(
                node,
                form,
                {},
                {},
                f"{form} kernel: q {qs} and k {ks} differ, or the {vs[2]} value heads are no multiple of "
                f"the {ks[2]} key heads",
            )
        roles: dict[str, Node] = {"q": q, "k": k, "v": v}  # type: ignore[dict-item]
        return Anchor(node, form, roles, {"q": qs[-1], "k": ks[-1], "v": vs[-1]})


register_rule(LinearKernelRule())
