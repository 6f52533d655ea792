"""Generic fusion: every connected group of pointwise ops, optionally ending in one row reduction
(RMSNorm, softmax, a sum/mean/max over the last dim), becomes one ``fused`` node — one kernel.

Grouping walks the nodes in order. A fusable pointwise node joins the groups of the fusable
producers it reads (all of them, when legal); a row reduction may join one open group and closes
it (nothing can be fused after a reduction in the same kernel). A merge is legal when

* the group's iteration shape stays the shape of one of its members (every member's shape
  broadcasts to it; a row reduction iterates over its input's shape), and
* no path leaves the group and comes back into it through a node outside it (that would be a
  cycle once the group is one node).

``scalar`` constants a group reads are copied into it, so they cost no launch. Each group becomes
a ``fused`` node whose sub-program lists the member ops in order; its outputs are the member
results read outside the group. A group of one op stays as it is (backends run a lone fusable op
through the same code generator). Nodes that could not join say why in the fusion report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from graphdsl.functional import scalar as _scalar
from graphdsl.functional._rules import broadcast_shapes
from graphdsl.errors import GraphDSLError
from graphdsl.network import Node
from graphdsl.opdef import OpCategory

from .fused_ops import FUSED_OPS, fused
from .graph_edit import GraphEditor
from .rewriter import NearMiss
from .shapes import same_extent_value

__all__ = ["default_can_fuse", "is_row_reduction", "fuse_groups", "Group"]

_SCALAR = _scalar.opdef
_FUSED = {f.opdef.name for f in FUSED_OPS.values()}


def is_row_reduction(node: Node) -> bool:
    """A single-output reduction over the last dim only: output = input shape (a row op such as
    softmax or rms_norm), or input shape without / with size 1 at the last dim; any other input
    (a weight) is at most 1-D."""
    if node.category is not OpCategory.REDUCTION or len(node.outputs) != 1 or not node.inputs:
        return False
    x, out = node.inputs[0].shape, node.outputs[0].shape
    if x is None or out is None or len(x) == 0:
        return False
    if any(t.shape is None or len(t.shape) > 1 for t in node.inputs[1:]):
        return False
    return tuple(out) in (tuple(x), tuple(x[:-1]), tuple(x[:-1]) + (1,))


def default_can_fuse(node: Node) -> str | None:
    """None when ``node`` may join a fused group, else the reason it may not (shape-level only;
    backends narrow this to the ops they can generate code for)."""
    if node.op in _FUSED:
        return "already a fused op"
    if any(t.shape is None or t.dtype is None for t in list(node.inputs) + list(node.outputs)):
        return "shape: unknown while building (declare input shapes to fuse)"
    if node.category is OpCategory.POINTWISE:
        if len(node.outputs) != 1:
            return "pointwise op with several outputs"
        return None
    if node.category is OpCategory.REDUCTION:
        return None if is_row_reduction(node) else "shape: not a reduction over the last dim only"
    return f"{node.category.value} op, not pointwise or a row reduction"


@dataclass(eq=False)
class Group:
    members: list[Node] = field(default_factory=list)
    shape: tuple = ()
    closed: bool = False          # ends in a reduction


def _broadcast_to(a: tuple, b: tuple) -> bool:
    """True when shape ``a`` broadcasts to ``b`` without growing it."""
    try:
        out = broadcast_shapes([a, b], "fusion")
    except GraphDSLError:
        return False
    return len(out) == len(b) and all(same_extent_value(x, y) for x, y in zip(out, b))


def _iteration_shape(node: Node) -> tuple:
    return tuple(node.inputs[0].shape) if node.category is OpCategory.REDUCTION else tuple(node.outputs[0].shape)


class _Grouper:
    def __init__(self, ed: GraphEditor, can_fuse: Callable[[Node], str | None], skip: set[Node]):
        self.ed, self.can_fuse, self.skip = ed, can_fuse, skip
        self.group_of: dict[Node, Group] = {}
        self.reasons: dict[Node, str] = {}

    def _creates_cycle(self, members: set[Node]) -> bool:
        top = max(self.ed.pos[n] for n in members)
        stack = [u for n in members for u in self.ed.node_users(n) if u not in members]
        seen = set()
        while stack:
            n = stack.pop()
            # a scalar constant read by the group is copied into it: no path runs through it
            if n in seen or self.ed.pos[n] > top or n.opdef is _SCALAR:
                continue
            seen.add(n)
            for u in self.ed.node_users(n):
                if u in members:
                    return True
                stack.append(u)
        return False

    def _merge(self, a: Group, b: Group, shape: tuple, closed: bool) -> Group | str:
        members = set(a.members) | set(b.members)
        if self._creates_cycle(members):
            return "fusing would create a cycle (a path leaves the group and comes back)"
        a.members.extend(b.members)
        a.shape, a.closed = shape, closed
        for n in b.members:
            self.group_of[n] = a
        return a

    def run(self) -> list[Group]:
        for node in self.ed.nodes:
            if node.opdef is _SCALAR:
                continue
            reason = "parameter-only (folded when weights are bound)" if node in self.skip else self.can_fuse(node)
            if reason is not None:
                self.reasons[node] = reason
                continue
            is_red = node.category is OpCategory.REDUCTION
            mine = Group([node], _iteration_shape(node), is_red)
            self.group_of[node] = mine
            producers = [t.producer for t in (node.inputs[:1] if is_red else node.inputs) if t.producer is not None]
            for p in dict.fromkeys(producers):
                g = self.group_of.get(p)
                if g is None or g is mine:
                    continue
                if g.closed:
                    self.reasons.setdefault(node, f"cannot join the group of '{p.name}': it already ends in a reduction")
                    continue
                if is_red:
                    ok, shape = _broadcast_to(g.shape, mine.shape), mine.shape
                elif _broadcast_to(g.shape, mine.shape):
                    ok, shape = True, mine.shape
                else:
                    ok, shape = _broadcast_to(mine.shape, g.shape), g.shape
                if not ok:
                    self.reasons.setdefault(node, f"shape: {list(node.outputs[0].shape)} and the group of "
                                                  f"'{p.name}' ({list(g.shape)}) do not share an iteration shape")
                    continue
                merged = self._merge(g, mine, shape, mine.closed or g.closed)
                if isinstance(merged, str):
                    self.reasons.setdefault(node, merged)
                    continue
                mine = merged
        groups = []
        for g in self.group_of.values():
            if g not in groups:
                groups.append(g)
        return groups


def _materialise(ed: GraphEditor, group: Group) -> Node | None:
    members = sorted(group.members, key=ed.pos.__getitem__)
    if len(members) < 2:           # one op is one launch already; backends lower it on its own
        return None
    inside = set(members)
    ref: dict = {}
    inputs: list = []
    program: list = []

    def input_ref(t):
        if t not in ref:
            ref[t] = len(inputs)
            inputs.append(t)
        return ref[t]

    # scalar constants read by the group are copied in (refs fixed up after inputs are known)
    pending = []
    for n in members:
        args = []
        for t in n.inputs:
            if t.producer is not None and t.producer in inside:
                args.append(("val", t))
            elif t.producer is not None and t.producer.opdef is _SCALAR:
                s = t.producer
                like = s.inputs[0]
                if like.producer in inside:
                    args.append(("const", t, ("val", like)))
                else:
                    input_ref(like)
                    args.append(("const", t, ("in", like)))
            else:
                input_ref(t)
                args.append(("in", t))
        pending.append((n, args))
    n_in = len(inputs)
    values: dict = {}

    def resolve(a):
        kind = a[0]
        if kind == "in":
            return ref[a[1]]
        if kind == "val":
            return values[a[1]]
        t = a[1]
        if t not in values:
            s = t.producer
            program.append((s.op, (resolve(a[2]),), tuple(sorted(s.attrs.items()))))
            values[t] = n_in + len(program) - 1
        return values[t]

    for n, args in pending:
        refs = tuple(resolve(a) for a in args)
        program.append((n.op, refs, tuple(sorted(n.attrs.items()))))
        values[n.outputs[0]] = n_in + len(program) - 1
    def dies_with_group(u) -> bool:     # a scalar whose only readers are members: copied in, then dead
        return (isinstance(u, Node) and u.opdef is _SCALAR
                and all(isinstance(x, Node) and x in inside for x in ed.users(u.outputs[0])))

    outs = []
    for n in members:
        t = n.outputs[0]
        if any(not (isinstance(u, Node) and u in inside) and not dies_with_group(u) for u in ed.users(t)):
            outs.append(t)
    if not outs:
        return None
    absorbed = tuple(n.name for n in members)
    result, new = ed.record(lambda *ins: fused(*ins, program=tuple(program), outputs=tuple(values[t] for t in outs),
                                               absorbed=absorbed), *inputs, at=members[-1])
    node = new[-1]
    for old, nt in zip(outs, node.outputs):
        ed.replace_uses(old, nt, exclude=new)
    for n in reversed(members):
        for u in ed.users(n.outputs[0]):
            if isinstance(u, Node) and u.opdef is _SCALAR and not ed.users(u.outputs[0]):
                ed.erase(u)
        if all(not ed.users(t) for t in n.outputs):
            ed.erase(n)
    return node


def fuse_groups(ed: GraphEditor, can_fuse: Callable[[Node], str | None] = default_can_fuse,
                skip: set[Node] | None = None, *, pass_name: str = "generic_fusion") -> tuple[list[Node], list[NearMiss]]:
    """Group and fuse; return (new fused nodes, near misses for nodes that stayed out)."""
    grouper = _Grouper(ed, can_fuse, skip or set())
    groups = grouper.run()
    made = []
    for g in groups:
        node = _materialise(ed, g)
        if node is not None:
            made.append(node)
    # scalars that only fused groups read are dead now
    for n in [n for n in ed.nodes if n.opdef is _SCALAR]:
        if not any(ed.users(t) for t in n.outputs):
            ed.erase(n)
    misses = [NearMiss("generic_fusion", pass_name, n.name, n.op, n.module, n.source, r)
              for n, r in grouper.reasons.items()
              if ed.alive(n) and n.op not in _FUSED and n.category in (OpCategory.POINTWISE, OpCategory.REDUCTION)]
    return made, misses
