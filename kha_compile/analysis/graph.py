"""The graph view every attention rule and the match share: op tables and lookups over one exported program.

:class:`MatchGraph` indexes an ``ExportedProgram`` once (parameters, buffers, lifted constants,
the calls of each module, in-place writes) and finds projections: a ``linear``/``addmm``/``mm``/
``matmul``/``einsum``/``tensordot`` against a parameter seen through layout ops
(:class:`Projection`). The op tables (``SDPA_OPS``, ``SOFTMAX_OPS``, ...) live here, so rules and
the match read the same ones.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node

from .hops import inline_wrappers
from .layout import LAYOUT_OPS, NotLayout, push_layout, shape_of
from .params import (
    POINTWISE_CONVS,
    PROJ_TARGETS,
    ParamPiece,
    bias_pieces,
    feature_axis_last,
    param_chain,
    post_bias,
    projection_info,
    root_param,
    weight_source,
)
from .writes import index_args

__all__ = [
    "ALLOC_OPS",
    "COPY_OPS",
    "META_ARGS",
    "NORM_OPS",
    "PROJ_OPS",
    "SDPA_OPS",
    "SOFTMAX_OPS",
    "STOP",
    "TRIG_OPS",
    "MatchGraph",
    "Projection",
    "module_path_of",
]

log = logging.getLogger(__name__)
aten = torch.ops.aten

SDPA_OPS = {
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_cudnn_attention.default,
}
SOFTMAX_OPS = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
STOP = object()  # what a visit of MatchGraph.walk_back returns for "not past this node"
PROJ_OPS = PROJ_TARGETS  # linear, addmm, mm, matmul, einsum, tensordot
NORM_OPS = {
    aten.rsqrt.default,
    aten.rms_norm.default,
    aten.layer_norm.default,
    aten.native_layer_norm.default,
    aten.var_mean.correction,
}
TRIG_OPS = {aten.cos.default, aten.sin.default, aten.polar.default}
COPY_OPS = {aten.copy_.default, aten.copy.default}
# ops that read only the dtype / shape of their arguments after the first
META_ARGS = {aten.type_as.default, aten.expand_as.default, aten.view_as.default, aten.reshape_as.default}
ALLOC_OPS = {
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.new_full.default,
    aten.full_like.default,
}


@dataclasses.dataclass
class Projection:
    """A projection node and the parameter whose output axis its features index."""

    node: Node
    param: str  # qualified name of the weight (traced paths)
    module_path: str  # the module owning the weight; for a weight used functionally, the module calling it
    is_module_call: bool  # the node is the owner module's own forward (nn.Linear, Conv1D, ...)
    feature_map: torch.Tensor  # output feature f -> position along the weight's output axis
    input_node: Node
    out_index: torch.Tensor | None = None  # the op output's shape: feature number of each element
    pieces: list[ParamPiece] = dataclasses.field(default_factory=list)  # weight, then bias pieces
    pieces_reason: str = ""  # why the bias could not be read as parameter pieces
    occurrence: int = 0  # earlier projection calls on the same weight in the calling module's forward

    @property
    def features_last(self) -> bool:
        """True when features lie on the output's last axis only, in order (an nn.Linear output)."""
        idx = self.out_index
        return idx is None or bool(torch.equal(idx, torch.arange(idx.shape[-1]).expand(idx.shape)))


def _order(graph: torch.fx.Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def module_path_of(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _canonical_names(
    graph: torch.fx.Graph, params: dict[str, str], buffers: dict[str, str], aliases: dict[str, str]
) -> None:
    def member(name: str) -> str:
        owner, _, attr = name.rpartition(".")
        return f"{aliases[owner]}.{attr}" if owner in aliases else name

    for table in (params, buffers):
        for key, name in table.items():
            table[key] = member(name)
    for key in [k for k in aliases if k.startswith("=")]:  # tied parameters: under their first-path names
        aliases["=" + member(key[1:])] = "|".join(member(n) for n in aliases[key].split("|"))
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {k: (aliases.get(p, p), t) for k, (p, t) in stack.items()}


def _tensor_inputs(node: Node) -> list[Node]:
    return [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor) or n.op == "call_function"]


class MatchGraph:
    """Lookups over one exported program that every rule shares."""

    def __init__(self, exported, aliases: dict[str, str] | None = None) -> None:
        self.exported = exported
        inline_wrappers(exported.graph_module)  # autocast / grad-mode regions: their ops, in line
        self.graph = exported.graph
        self.order: dict[Node, float] = dict(_order(self.graph))  # a written placeholder sits after its writes
        sig = exported.graph_signature
        self.params: dict[str, str] = dict(sig.inputs_to_parameters)
        self.buffers: dict[str, str] = dict(sig.inputs_to_buffers)
        self.aliases = aliases or {}
        if aliases:  # one module reached by several paths: every name and module stack uses its first path
            _canonical_names(self.graph, self.params, self.buffers, aliases)
        consts = {}
        for name, target in getattr(sig, "inputs_to_lifted_tensor_constants", {}).items():
            value = exported.constants.get(target)
            if isinstance(value, torch.Tensor):
                consts[name] = value
        self.constants = consts
        self.scope: dict[str, list[Node]] = {}
        for n in self.graph.nodes:
            if n.op == "call_function" and n.target is not aten._assert_tensor_metadata.default:
                for key, (path, _) in (n.meta.get("nn_module_stack") or {}).items():
                    if path:  # every enclosing module call, so a call's scope includes its children's
                        self.scope.setdefault(key, []).append(n)
        # In-place writes (``buf = x.new_empty(...); buf[..., :n] = piece``): the data of ``buf``
        # comes from ``piece``; ops like new_empty read only the metadata of their input.
        self.writes: dict[Node, list[Node]] = {}
        self.written_by: dict[Node, list[Node]] = {}
        for n in self.graph.nodes:
            if n.op == "call_function" and n.target in COPY_OPS and isinstance(n.args[0], Node):
                base = n.args[0]
                while (
                    base.op == "call_function"
                    and base.target in LAYOUT_OPS
                    and base.args
                    and isinstance(base.args[0], Node)
                ):
                    base = base.args[0]
                src = n.args[1]
                if isinstance(src, Node):
                    self.writes.setdefault(base, []).append(src)
                    self.written_by.setdefault(src, []).append(base)
                    if base.op == "placeholder":  # a cache (buffer, list element, argument) filled in place:
                        self.order[base] = self.order[n] + 0.5  # it holds the written values after the write

    def inputs(self, n: Node) -> list[Node]:
        """The inputs whose values flow into ``n`` (not those it reads only the dtype or shape of)."""
        if n.op == "call_function" and n.target in ALLOC_OPS:
            own: list[Node] = []
        elif n.op == "call_function" and n.target in META_ARGS:  # x.type_as(v): only x's values
            own = [a for a in n.args[:1] if isinstance(a, Node)]
        else:
            positions = index_args(n)  # gather / index_put_ indices are positions, not values
            own = [a for a in n.all_input_nodes if a not in positions]
        return own + self.writes.get(n, [])

    def users(self, n: Node) -> list[Node]:
        """The users that take the values of ``n`` (see :meth:`inputs`)."""
        out = [
            u
            for u in n.users
            if not (
                u.op == "call_function"
                and (u.target in ALLOC_OPS or (u.target in META_ARGS and u.args[0] is not n) or n in index_args(u))
            )
        ]
        return out + self.written_by.get(n, [])

    # -- projections ---------------------------------------------------------------------
    def param_source(self, node: Node, out_axis: int) -> tuple[str, torch.Tensor] | None:
        """(param name, feature map) when ``node`` is a parameter seen through layout ops."""
        found = param_chain(node, self.params)
        if found is None:
            return None
        cur, chain = found
        name = self.params[cur.name]
        if ".kha." in f".{name}":
            return None  # KHA's own transforms are not projections
        shape = shape_of(cur)
        if shape is None or len(shape) != 2:
            return None
        if not chain:  # the weight itself: features are its rows (linear) or columns (addmm/mm)
            return name, torch.arange(shape[out_axis])
        rows = torch.arange(shape[0]).unsqueeze(1).expand(shape)
        cols = torch.arange(shape[1]).unsqueeze(0).expand(shape)
        try:
            for op, src in reversed(chain):
                rows = push_layout(rows, op, src, self.constants)
                cols = push_layout(cols, op, src, self.constants)
        except (NotLayout, RuntimeError, IndexError, TypeError):
            return None
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
            return None
        # output feature f is row f (linear) or column f (addmm/mm) of the derived weight
        r = rows if out_axis == 0 else rows.t()
        c = cols if out_axis == 0 else cols.t()
        if bool((r == r[:, :1]).all()):
            return name, r[:, 0].clone()  # features index the parameter's rows
        if bool((c == c[:, :1]).all()):
            return name, c[:, 0].clone()  # features index the parameter's columns
        return None

    def as_projection(self, node: Node) -> Projection | None:
        """The projection computed by ``node`` (a weight of any rank through layout ops), or None."""
        for x, w, axes, out_index in projection_info(node):  # noqa: B007 - used after the break
            piece = weight_source(w, axes, self.params, self.constants)
            # x @ W: the weight is the parameter; for linear the weight is positional, so x may be made of
            # parameters too (a learned query token expanded over the batch)
            if (
                piece is not None
                and ".kha." not in f".{piece.name}"
                and (node.target is aten.linear.default or not self.is_param(x))
            ):
                break
        else:
            return None
        piece = self._local(piece, node)
        module_path = piece.name.rpartition(".")[0]
        is_call = self.is_module_output(node, module_path)
        if not is_call:  # used functionally: the module whose forward computes it is where KHA goes
            module_path = module_path_of(node)
        proj = Projection(node, piece.name, module_path, is_call, piece.feature_map, x, out_index, [piece])
        bias = (
            node.args[2]
            if (node.target is aten.linear.default or node.target in POINTWISE_CONVS) and len(node.args) > 2
            else node.args[0]
            if node.target is aten.addmm.default
            else None
        )
        after = post_bias(node) if bias is None else None
        if after is not None and self.is_param(after):
            bias = after
        if isinstance(bias, Node):
            index = feature_axis_last(node, out_index)  # a conv's bias runs along its channel axis
            pieces, why = bias_pieces(bias, index, int(piece.feature_map.numel()), self.params, self.buffers)
            proj.pieces.extend(pieces)
            proj.pieces_reason = why
        if not proj.is_module_call:
            proj.occurrence = self._occurrence(node, root_param(w, self.params))
        return proj

    def _local(self, piece: ParamPiece, node: Node) -> ParamPiece:
        """A tied parameter named as the module calling ``node`` holds it (the export names it once)."""
        tied = self.aliases.get("=" + piece.name)
        if not tied:
            return piece
        here = module_path_of(node)
        names = tied.split("|")
        local = [n for n in names if n.rpartition(".")[0] == here] or [n for n in names if n.startswith(here + ".")]
        return dataclasses.replace(piece, name=local[0]) if local else piece

    def _occurrence(self, node: Node, weight: Node | None) -> int:
        """How many projection calls on ``weight`` run before ``node`` in its module call."""
        stack = node.meta.get("nn_module_stack") or {}
        scope = self.scope.get(list(stack)[-1], []) if stack else list(self.graph.nodes)
        return sum(
            1
            for n in scope
            if n.target in PROJ_OPS
            and self.order[n] < self.order[node]
            and any(root_param(a, self.params) is weight for a in n.all_input_nodes)
        )

    def is_weight(self, node: Any) -> bool:
        """True when ``node`` is a parameter seen through layout ops (a weight, not computed from one)."""
        return param_chain(node, self.params) is not None

    def is_param(self, node: Any, params: bool = True) -> bool:
        """True when ``node`` is made of parameters, buffers and zeros only (no activation); ``params=False``:
        of buffers and constants only (a fixed tensor, such as a random projection, nothing trained)."""
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if not isinstance(n, Node) or n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder" and not (
                (params and n.name in self.params) or n.name in self.buffers or n.name in self.constants
            ):
                return False  # an activation (a user input) feeds it, or a parameter where none may
            stack.extend(n.all_input_nodes)
        return True

    def is_module_output(self, node: Node, module_path: str) -> bool:
        """True when the module at ``module_path`` only computes ``node`` and post-processes it.

        After the projection, the module may reshape it, add a bias, or (after apply) run KHA's
        own transforms; any other input (an attention op in the same module) means the weight is
        used functionally inside a bigger module.
        """
        stack = node.meta.get("nn_module_stack") or {}
        if not module_path or not stack or module_path_of(node) != module_path:
            return False
        own = {node}
        if any(n.target in SDPA_OPS or n.target in SOFTMAX_OPS for n in self.scope.get(list(stack)[-1], ())):
            return False  # the attention itself owns the weight: used functionally, not a projection module
        for n in self.scope.get(list(stack)[-1], ()):  # this call of the module (shared layers run it often)
            if self.order[n] <= self.order[node]:
                if (
                    n is not node
                    and self.order[n] < self.order[node]
                    and n.target not in PROJ_OPS
                    and not self._feeds_weight(n, node)
                ):
                    return False
                continue
            for inp in n.all_input_nodes:
                if inp not in own and not (
                    inp.op == "placeholder" and (inp.name in self.params or inp.name in self.constants)
                ):
                    return False
            own.add(n)
        return True

    @staticmethod
    def _feeds_weight(n: Node, proj: Node) -> bool:
        """A node before the projection in its module that only prepares the weight (t, numpy_T)."""
        return all(u is proj or u.target in LAYOUT_OPS for u in n.users)

    # -- walks ---------------------------------------------------------------------------
    def walk_back(self, start: Any, visit: Callable[[Node], Any], depth: int, *, values_only: bool = True) -> Any:
        """Breadth-first back from ``start`` over call_function nodes, ``depth`` levels at most.

        ``visit(n)`` returns a result (the walk ends with it), :data:`STOP` (not past ``n``) or None (on to
        its inputs: those whose values flow into it, or every input node unless ``values_only``).

        Example::

            g.walk_back(q, lambda n: n if n.target in SOFTMAX_OPS else None, 12)   # the nearest softmax, or None
        """
        frontier: list[Any] = [start]
        seen: set[Node] = set()
        for _ in range(depth):
            nxt: list[Node] = []
            for n in frontier:
                if not isinstance(n, Node) or n in seen or n.op != "call_function":
                    continue
                seen.add(n)
                found = visit(n)
                if found is STOP:
                    continue
                if found is not None:
                    return found
                nxt.extend(self.inputs(n) if values_only else n.all_input_nodes)
            if not nxt:
                return None
            frontier = nxt
        return None

    def find_projections(
        self, start: Node, limit: int = 400, *, through_softmax: bool = False
    ) -> tuple[list[Projection], str]:
        """Projections reached walking back from ``start`` (not walking past a projection).

        A softmax ends the walk (it is another attention's), unless ``through_softmax``: in attention
        without one, a softmax on q or k is their feature map (CoaT's softmax of k over the tokens)."""
        found: list[Projection] = []
        seen = {start}
        queue = deque([start])
        steps = 0
        unwritten: list[str] = []  # buffers read that nothing in the graph writes
        while queue:
            node = queue.popleft()
            steps += 1
            if steps > limit:
                return found, f"gave up after {limit} nodes walking back from {start.name}"
            proj = self.as_projection(node)
            if proj is not None:
                found.append(proj)
                continue
            if node.op == "placeholder":  # a cache filled in place: follow what was written into it
                if node.name in self.buffers and node not in self.writes and len(shape_of(node) or ()) >= 3:
                    unwritten.append(self.buffers[node.name])
                nexts = self.writes.get(node, [])
            elif (
                node.op != "call_function"
                or node.target in SDPA_OPS
                or (node.target in SOFTMAX_OPS and not through_softmax)
                or node.target is aten.embedding.default
            ):
                continue
            else:
                nexts = self.inputs(node)
            for inp in nexts:
                if inp.op == "placeholder" and inp.name in self.params:
                    continue
                if inp not in seen:
                    seen.add(inp)
                    queue.append(inp)
        why = ""
        if unwritten and not found:
            why = (
                f"it reads the buffer {unwritten[0]} (a KV cache?), which nothing in the traced forward writes; "
                "trace with inputs that fill the cache (a prefill call)"
            )
        return found, why

    def path_nodes(self, src: Node, dst: Node) -> list[Node]:
        """Nodes on some path src -> dst (both included), in graph order."""
        lo, hi = self.order[src], self.order[dst]
        anc = {dst}
        queue = deque([dst])
        while queue:
            n = queue.popleft()
            for inp in self.inputs(n):
                if inp not in anc and self.order[inp] >= lo:
                    anc.add(inp)
                    queue.append(inp)
        if src not in anc:
            return []
        desc = {src}
        queue = deque([src])
        while queue:
            n = queue.popleft()
            for user in self.users(n):
                if user in anc and user not in desc and self.order[user] <= hi:
                    desc.add(user)
                    queue.append(user)
        return sorted(desc, key=self.order.__getitem__)

    def articulation(self, path: list[Node]) -> list[Node]:
        """The nodes every path from path[0] to path[-1] goes through, in order."""
        pos = {n: i for i, n in enumerate(path)}
        covered = [0] * (len(path) + 1)
        for n in path:
            for inp in self.inputs(n):
                if inp in pos and pos[n] - pos[inp] > 1:
                    covered[pos[inp] + 1] += 1
                    covered[pos[n]] -= 1
        out, run = [], 0
        for i, n in enumerate(path):
            run += covered[i]
            if run == 0:
                out.append(n)
        return out
