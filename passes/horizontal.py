"""Horizontal fusion of projections: several matmuls of one input by different weights (q, k and v;
gate and up) become one matmul by the concatenated weights, split on the last dim.

``x @ Wq.T, x @ Wk.T, x @ Wv.T``  ->  ``split(x @ cat(Wq, Wk, Wv).T, (q, k, v))``

The concatenation reads only weights, so the engine folds it once when the weights are bound
(``set_weights``) and every forward runs one larger GEMM instead of three. The split parts are
views: consumers read them in place (fused kernels through strides). When all parts have one size
the split is written as ``split(y, n)``, the form the ``swiglu`` rule matches.
"""
from __future__ import annotations

from graphdsl import functional as F
from graphdsl.network import Node
from graphdsl.opdef import OpCategory

from .graph_edit import GraphEditor
from .rewriter import ops

__all__ = ["merge_projections"]

_MATMUL = F.matmul.opdef


def _candidate(node: Node):
    """(key, weight) when ``node`` is ``x @ W`` / ``x @ W.T`` with a 2-D weight input, else None."""
    if node.category is not OpCategory.MATMUL or node.opdef is not _MATMUL or node.attrs.get("transpose_a"):
        return None
    x, w = node.inputs
    if w.producer is not None or x.shape is None or w.shape is None or len(x.shape) != 2 or len(w.shape) != 2:
        return None
    if not all(isinstance(s, int) for s in w.shape):
        return None
    return (x, bool(node.attrs.get("transpose_b")), w.dtype), w


def merge_projections(ed: GraphEditor) -> list[tuple[str, int]]:
    """Merge projection groups in place; return (first member's name, group size) per merge."""
    groups: dict = {}
    for node in ed.nodes:
        c = _candidate(node)
        if c is not None:
            groups.setdefault(c[0], []).append(node)
    merged = []
    for (x, tb, _), members in groups.items():
        if len(members) < 2:
            continue
        members = sorted(members, key=ed.pos.__getitem__)
        weights = [m.inputs[1] for m in members]
        sizes = [w.shape[0] if tb else w.shape[1] for w in weights]
        sections = len(sizes) if len(set(sizes)) == 1 else tuple(sizes)

        def record(x, *ws):
            y = ops.matmul(x, F.cat(list(ws), dim=0 if tb else 1), transpose_a=False, transpose_b=tb)
            return F.split(y, sections, -1)

        parts, new = ed.record(record, x, *weights, at=members[0])
        for m, part in zip(members, parts):
            ed.replace_uses(m.outputs[0], part, exclude=new)
        for m in members:
            ed.erase(m)
        merged.append((members[0].name, len(members)))
    return merged
