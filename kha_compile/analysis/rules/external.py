"""Rule ``external``: attention ops the user registered with :func:`register_attention_op`.

A model that calls its own attention kernel (a ``torch.library`` custom op, a flash-attention
style op in (B, S, H, D) layout) shows that op in the exported graph, opaque. Once registered with
the argument positions of q, k and v, it is an anchor like SDPA: the head vector is the last axis
of each input, and the head maps (GQA/MQA included) come from the projections, whatever the layout.

An unregistered op that looks like attention (three or more tensor inputs of rank >= 3 that come
from projections, q and k with the same last dim) is reported with the call that registers it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from ...core.errors import RegistrationError
from ...core.registry import Registry
from ..graph import SDPA_OPS
from ..layout import LAYOUT_OPS, NotLayout, push_layout, shape_of
from . import attention_rules, register_rule
from .base import Anchor
from .flex_attention import FLEX_OPS

if TYPE_CHECKING:  # pragma: no cover
    from ..graph import MatchGraph

__all__ = [
    "ExternalAttentionRule",
    "OpSpec",
    "register_attention_op",
    "registered_attention_ops",
    "unregister_attention_op",
]

log = logging.getLogger(__name__)

LAYOUTS = ("bhsd", "bshd")
_KNOWN_NAMESPACES = {"aten", "prims", "kha", "_operator", "quantized_decomposed"}


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Where q, k and v are among a registered op's arguments, and their layout."""

    name: str
    q: int
    k: int
    v: int
    layout: str
    keys: tuple[Any, ...] = ()  # what the graph can show for the op: the packet and its overloads


OPS: Registry[OpSpec] = Registry("registered attention op")


def _op_name(op: Any) -> str:
    if isinstance(op, torch._ops.OpOverload):
        return f"torch.ops.{op.namespace}.{op._schema.name.split('::')[-1]}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        ns, _, name = op._qualified_op_name.partition("::")
        return f"torch.ops.{ns}.{name}"
    if isinstance(op, torch._ops.HigherOrderOperator):
        return f"torch.ops.higher_order.{op.name()}"
    return repr(op)


def _resolve(op: Any) -> tuple[list[Any], str]:
    """(the keys the graph can show for ``op``, its display name), or a RegistrationError."""
    if hasattr(op, "_opoverload") and isinstance(op._opoverload, torch._ops.OpOverload):
        op = op._opoverload  # a torch.library.custom_op function
    if isinstance(op, torch._ops.OpOverloadPacket):
        overloads = [getattr(op, name) for name in op.overloads()]
        return [op, *overloads], _op_name(op)
    if isinstance(op, torch._ops.OpOverload):
        return [op], _op_name(op)
    if isinstance(op, torch._ops.HigherOrderOperator):
        return [op], _op_name(op)
    if callable(op):
        raise RegistrationError(
            f"{getattr(op, '__qualname__', op)!r} is a Python function, not an op: torch.export traces "
            "through Python functions, so it never appears in the graph. Register the op it calls "
            "(torch.ops.NS.NAME), or make it one with torch.library.custom_op (with a register_fake "
            "implementation) and register that."
        )
    raise RegistrationError(
        f"register_attention_op expects an op (torch.ops.NS.NAME, an overload such as "
        f"torch.ops.NS.NAME.default, or a torch.library.custom_op), got {type(op).__name__}."
    )


def _check_schema(keys: list[Any], name: str, roles: dict[str, int]) -> None:
    for key in keys:
        if not isinstance(key, torch._ops.OpOverload):
            continue
        args = key._schema.arguments
        for role, pos in roles.items():
            if pos >= len(args):
                raise RegistrationError(
                    f"{name} takes {len(args)} arguments, so {role}={pos} is out of range; pass the "
                    f"position of the {role} tensor, e.g. register_attention_op({name}, q=0, k=1, v=2)."
                )
            if not str(args[pos].type).startswith("Tensor"):
                raise RegistrationError(
                    f"argument {pos} of {name} ({args[pos].name}: {args[pos].type}) is not a tensor, so it "
                    f"cannot be {role}; its tensor arguments are "
                    f"{[i for i, a in enumerate(args) if str(a.type).startswith('Tensor')]}."
                )


def register_attention_op(op: Any, *, q: int = 0, k: int = 1, v: int = 2, layout: str = "bhsd") -> None:
    """Tell kha_compile that ``op`` computes attention from the q, k, v tensors at these positions.

    ``layout`` is where the heads are: ``"bhsd"`` (B, H, S, D) or ``"bshd"`` (B, S, H, D); the head
    dim is the last axis in both. Fewer kv heads than q heads (GQA/MQA) are read from the shapes.
    Registering an op again replaces its entry.

    Example::

        import kha_compile as kc
        kc.register_attention_op(torch.ops.mylib.flash_attn, q=0, k=1, v=2, layout="bshd")
        kc.apply(model, example_args=(x,))
    """
    roles = {"q": q, "k": k, "v": v}
    for role, pos in roles.items():
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
            raise RegistrationError(f"{role} must be a non-negative argument position (an int), got {pos!r}.")
    if len(set(roles.values())) != 3:
        raise RegistrationError(f"q, k and v must be three different argument positions, got q={q}, k={k}, v={v}.")
    if layout not in LAYOUTS:
        raise RegistrationError(f"layout must be one of {LAYOUTS} (where the heads axis is), got {layout!r}.")
    keys, name = _resolve(op)
    if any(key in SDPA_OPS or key in FLEX_OPS for key in keys):
        raise RegistrationError(f"{name} is recognised already (rules sdpa / flex_attention); no need to register it.")
    _check_schema(keys, name, roles)
    OPS.register(OpSpec(name, q, k, v, layout, tuple(keys)))
    log.debug("registered attention op %s (q=%d, k=%d, v=%d, layout=%s)", name, q, k, v, layout)


def unregister_attention_op(op: Any) -> bool:
    """Forget a registered op; returns whether it was registered.

    Example::

        kc.register_attention_op(torch.ops.mylib.attn)
        unregister_attention_op(torch.ops.mylib.attn)   # True
    """
    _, name = _resolve(op)
    return OPS.unregister(name) is not None


def registered_attention_ops() -> dict[str, OpSpec]:
    """Display name -> spec of every registered op.

    Example::

        registered_attention_ops()   # {"torch.ops.mylib.attn": OpSpec(...)}
    """
    return {spec.name: spec for spec in OPS.items()}


def _spec_of(target: Any) -> OpSpec | None:
    packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else None
    for spec in OPS.items():
        if target in spec.keys or (packet is not None and packet in spec.keys):
            return spec
    return None


def _arg(node: Node, pos: int) -> Any:
    if pos < len(node.args):
        return node.args[pos]
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        args = target._schema.arguments
        if pos < len(args):
            return node.kwargs.get(args[pos].name)
    return None


def _namespace(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "higher_order"
    return getattr(target, "__module__", "") or ""


class ExternalAttentionRule:
    """Anchor on registered attention ops; name unregistered ops that look like attention.

    Example::

        rule = ExternalAttentionRule()
        anchor = rule.match(g, node)   # None unless node calls a registered or attention-like op
    """

    name = "external"
    priority = 90

    def match(self, g: MatchGraph, node: Node) -> Anchor | None:
        if node.op != "call_function":
            return None
        spec = _spec_of(node.target)
        if spec is not None:
            return self._registered(node, spec)
        return self._unregistered(g, node)

    def _registered(self, node: Node, spec: OpSpec) -> Anchor:
        roles = {r: _arg(node, getattr(spec, r)) for r in "qkv"}
        bad = [r for r, n in roles.items() if not isinstance(n, Node) or shape_of(n) is None]
        if bad:
            return Anchor(
                node,
                self.name,
                {},
                {},
                f"{spec.name}: {', '.join(bad)} is not a tensor with a static shape "
                f"at the registered position ({', '.join(f'{r}={getattr(spec, r)}' for r in bad)})",
            )
        shapes = {r: shape_of(n) for r, n in roles.items()}
        if shapes["q"][-1] != shapes["k"][-1]:  # type: ignore[index]
            return Anchor(
                node,
                self.name,
                {},
                {},
                f"{spec.name}: q and k last dims differ ({shapes['q']} vs {shapes['k']}); "
                "check the registered q/k/v positions",
            )
        axis = 1 if spec.layout == "bhsd" else 2
        if all(len(s) == 4 for s in shapes.values()):  # type: ignore[arg-type]
            hq, hk, hv = (shapes[r][axis] for r in "qkv")  # type: ignore[index]
            if hk != hv or hq % hk:
                return Anchor(
                    node,
                    self.name,
                    {},
                    {},
                    f"{spec.name}: with layout={spec.layout!r} the heads are q {hq}, "
                    f"k {hk}, v {hv}, which is not MHA/GQA/MQA; check the registered layout",
                )
        return Anchor(node, self.name, dict(roles), {r: s[-1] for r, s in shapes.items()})  # type: ignore[index]

    def _unregistered(self, g: MatchGraph, node: Node) -> Anchor | None:
        target = node.target
        if (
            not isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator))
            or _namespace(target) in _KNOWN_NAMESPACES
            or target in FLEX_OPS
        ):
            return None
        tensors = [(i, a) for i, a in enumerate(node.args) if isinstance(a, Node) and len(shape_of(a) or ()) >= 3]
        if len(tensors) < 3:
            return None
        fed = [(i, a) for i, a in tensors if g.find_projections(a, limit=120)[0]]
        if len(fed) < 3:
            return None
        (iq, q), (ik, k), (iv, _) = fed[:3]
        if shape_of(q)[-1] != shape_of(k)[-1]:  # type: ignore[index]
            return None
        if self._claimed_later(g, node):
            return None  # a rule registered after this one knows the op: let it answer
        layout = _guess_layout(g, q)
        call = f"kc.register_attention_op({_op_name(target)}, q={iq}, k={ik}, v={iv}, layout={layout!r})"
        return Anchor(
            node,
            "unregistered",
            {},
            {},
            f"{_op_name(target)} looks like attention (q, k, v come from projections) but is not "
            f"registered; if it computes attention, call {call} before kc.apply",
        )

    def _claimed_later(self, g: MatchGraph, node: Node) -> bool:
        rules = attention_rules()
        mine = next((i for i, r in enumerate(rules) if r.name == self.name), len(rules))
        return any(r.match(g, node) is not None for r in rules[mine + 1 :])


def _guess_layout(g: MatchGraph, node: Node) -> str:
    """ "bhsd" or "bshd" for a 4-D q: which axis the projection's features vary along."""
    shape = shape_of(node)
    if shape is None or len(shape) != 4:
        return "bhsd"
    projs, _ = g.find_projections(node, limit=120)
    if projs:
        path = g.path_nodes(projs[0].node, node)
        chain = g.articulation(path) if path else []
        pshape = shape_of(projs[0].node)
        if chain and pshape is not None:
            idx: Any = torch.arange(pshape[-1]).expand(pshape)
            try:
                for prev, cur in itertools.pairwise(chain):
                    if cur.target in LAYOUT_OPS and cur.args and cur.args[0] is prev:
                        idx = push_layout(idx, cur, prev, g.constants)
                    elif shape_of(cur) != shape_of(prev):
                        raise NotLayout("shape changes")
                if isinstance(idx, torch.Tensor) and idx.dim() == 4:
                    for axis in (1, 2):
                        if idx.shape[axis] > 1 and bool((idx != idx.narrow(axis, 0, 1)).any()):
                            return "bhsd" if axis == 1 else "bshd"
            except (NotLayout, RuntimeError, IndexError, TypeError):
                pass
    val: Any = node.meta.get("val")
    try:
        return "bhsd" if val.stride(1) < val.stride(2) else "bshd"
    except (AttributeError, TypeError, RuntimeError):
        return "bhsd"


register_rule(ExternalAttentionRule())
