"""Which KHA transforms reach an attention operand from its projection, feature by feature.

The self-check of ``kc.apply`` traces the rewritten model and asks, for each role of each site:
which of KHA's own transforms (products with a ``.kha.`` parameter, ``kha::mlp_value``) act on the
features that go from the role's projection to the attention's operand? Only this path counts:
an operand also depends on earlier layers' transforms through the residual stream, which is no
error. A bitmask per feature is pushed over every node between the projection and the operand:

* layout and index ops move the masks (:func:`.layout.push_layout`), ``cat`` joins them (pieces
  from elsewhere carry none), ``index_copy`` writes them, ``getitem`` picks a tuple's element;
* a KHA transform sets its own bit on every feature it outputs, over the masks of its input (a
  bit already set means the same transform acts twice);
* value ops combine their inputs' masks feature by feature (broadcast where shapes differ);
* anything else (a product, a reduction) loses the features: the answer is then None (unknown).

A fused [Q|K|V] projection transformed slot by slot and joined again by ``cat`` keeps each role's
own bit on its own features, so the q operand split off later carries T^Q only.

Example::

    reach = transforms_reaching(g, site.roles["q"].projection, q_node)
    reach.params, reach.twice      # {"blocks.0.qkv.kha.q.weight"}, False
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
from torch.fx import Node

from .graph import MatchGraph, Projection
from .layout import INDEX_OPS, LAYOUT_OPS, NotLayout, constant_index, push_layout, shape_of
from .propagate import cat_known, depthwise_channels, tuple_item

__all__ = ["Reach", "kha_params_of", "transforms_reaching"]

aten = torch.ops.aten

_MAX_NUMEL = 1 << 22
_MAX_BITS = 62
_CHAIN = 8  # ops between a KHA parameter and the product that reads it (t, expand, a dtype cast)


@dataclasses.dataclass
class Reach:
    """The KHA parameters whose transforms act on an operand's features (one name per transform's tensor
    read in the graph), and whether one transform acts twice on the same features."""

    params: set[str]
    twice: bool = False


def kha_params_of(g: MatchGraph, node: Node, skip: set[Node]) -> list[str]:
    """Names of the ``.kha.`` parameters ``node`` reads (directly or through single-input ops such as a
    transpose or a cast), not counting its inputs in ``skip``."""
    found: list[str] = []
    for a in node.all_input_nodes:
        cur = a
        for _ in range(_CHAIN):
            if cur in skip:
                break
            if cur.op == "placeholder":
                name = g.params.get(cur.name, "")
                if ".kha." in f".{name}":
                    found.append(name)
                break
            ins = cur.all_input_nodes
            if cur.op != "call_function" or len(ins) != 1:
                break
            cur = ins[0]
    return found


def _or_all(t: torch.Tensor) -> int:
    """The bitwise or of every element (a broadcast axis counted once; halves or-ed pairwise)."""
    for a in range(t.dim()):
        if t.stride(a) == 0 and t.shape[a] > 1:
            t = t.narrow(a, 0, 1)
    x = t.reshape(-1)
    if x.numel() == 0:
        return 0
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, x.new_zeros(1)])
        half = x.numel() // 2
        x = x[:half] | x[half:]
    return int(x.item())


def _index_copy(g: MatchGraph, node: Node, known: dict[Node, Any]) -> torch.Tensor:
    base, dim, index, source = node.args[:4]
    value = known.get(base) if isinstance(base, Node) else None
    positions = constant_index(index, g.constants)
    src_shape = shape_of(source) if isinstance(source, Node) else None
    if value is None:
        shape = shape_of(base) if isinstance(base, Node) else None
        value = torch.zeros(shape, dtype=torch.long) if shape is not None else None
    if not isinstance(value, torch.Tensor) or positions is None or not isinstance(dim, int) or src_shape is None:
        raise NotLayout("index_copy of an unknown base or at computed positions")
    written = known.get(source) if isinstance(source, Node) else None
    if not isinstance(written, torch.Tensor):
        written = torch.zeros(src_shape, dtype=torch.long)
    return value.index_copy(dim, positions.long(), written.expand(src_shape))


def _push(g: MatchGraph, node: Node, known: dict[Node, Any]) -> Any:
    """The masks of ``node``'s output from its inputs'; raises NotLayout where the features are lost."""
    if node.target is operator.getitem:
        return tuple_item(node, known)
    if node.target is aten.cat.default:
        return cat_known(node, known, fill=0)  # a piece from elsewhere: no transform of this path
    if node.target is aten.index_copy.default:
        return _index_copy(g, node, known)
    first = node.args[0] if node.args and isinstance(node.args[0], Node) else None
    if first is not None and first in known and depthwise_channels(node) is not None:
        mask = known[first]  # (B, C, L): each channel mixed over the sequence only
        per_channel = torch.tensor([_or_all(c) for c in mask.unbind(1)], dtype=torch.long)
        return per_channel.view(1, -1, 1).expand(shape_of(node) or mask.shape).clone()
    if first is not None and first in known and (node.target in LAYOUT_OPS or node.target in INDEX_OPS):
        return push_layout(known[first], node, first, g.constants)
    out = shape_of(node)
    values = [known[i] for i in node.all_input_nodes if i in known]
    if out is None or not values or not all(isinstance(v, torch.Tensor) for v in values):
        raise NotLayout(f"{node.target}: no known input of a static shape")
    if node.target in _PRODUCTS:
        raise NotLayout(f"{node.target} mixes features")
    try:
        acc = torch.zeros(out, dtype=torch.long)
        for v in values:
            acc = acc | v.broadcast_to(out)
    except RuntimeError as exc:
        raise NotLayout(f"{node.target} changes the shape") from exc
    return acc


_PRODUCTS = {
    aten.matmul.default,
    aten.bmm.default,
    aten.mm.default,
    aten.addmm.default,
    aten.linear.default,
    aten.einsum.default,
    aten.baddbmm.default,
    aten.convolution.default,
    aten.conv1d.default,
    aten.conv2d.default,
}


def _weight_side(g: MatchGraph, proj: Projection) -> bool:
    """True when the projection's weight itself is computed from KHA parameters (a parametrized weight)."""
    seen: set[Node] = {proj.input_node} if isinstance(proj.input_node, Node) else set()
    frontier = [a for a in proj.node.all_input_nodes if a not in seen]
    for _ in range(12):
        nxt: list[Node] = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder" and ".kha." in f".{g.params.get(n.name, '')}":
                return True
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return False


def transforms_reaching(g: MatchGraph, proj: Projection, target: Node) -> Reach | None:
    """The KHA transforms on the way from ``proj`` to ``target`` (see the module doc), or None when the
    features cannot be followed there.

    Example::

        transforms_reaching(g, roles["k"].projection, k_node).params     # {"...c_attn.kha.k.weight"}
    """
    path = g.path_nodes(proj.node, target)
    shape = shape_of(proj.node)
    if not path or shape is None or math.prod(shape) > _MAX_NUMEL or _weight_side(g, proj):
        return None
    bits: dict[str, int] = {}
    twice = False
    known: dict[Node, Any] = {proj.node: torch.zeros(shape, dtype=torch.long)}
    for node in path[1:]:
        if node.op != "call_function":
            continue
        names = kha_params_of(g, node, set(known))
        try:
            if names:
                base = 0
                for i in node.all_input_nodes:
                    if isinstance(known.get(i), torch.Tensor):
                        base |= _or_all(known[i])
                own = 0
                for name in dict.fromkeys(names):
                    if name not in bits:
                        if len(bits) >= _MAX_BITS:
                            return None
                        bits[name] = 1 << len(bits)
                    own |= bits[name]
                twice = twice or bool(base & own)
                out = shape_of(node)
                if out is None:
                    continue
                known[node] = torch.full(out, base | own, dtype=torch.long)
            else:
                known[node] = _push(g, node, known)
        except (NotLayout, RuntimeError, IndexError, TypeError, ValueError):
            continue
    at = known.get(target)
    if not isinstance(at, torch.Tensor):
        return None
    mask = _or_all(at)
    return Reach({n for n, b in bits.items() if mask & b}, twice)
