"""Common-subexpression elimination: two nodes with the same op, the same input tensors and equal
attributes compute the same values, so the later one's readers read the earlier one's outputs.

Nodes with in-place effects, and nodes reading a tensor that some op updates in place (a KV cache
read before and after its write is the same tensor with different contents), are left alone.
"""
from __future__ import annotations

from graphdsl.network import Network

from .graph_edit import GraphEditor

__all__ = ["common_subexpression_elimination"]


def _key(node):
    try:
        attrs = tuple(sorted(node.attrs.items()))
        hash(attrs)
    except TypeError:
        return None
    return node.op, tuple(id(t) for t in node.inputs), attrs


def common_subexpression_elimination(net: Network | GraphEditor) -> int:
    """Merge duplicate nodes; return how many were removed."""
    ed = net if isinstance(net, GraphEditor) else GraphEditor(net)
    written = {n.inputs[i] for n in ed.nodes for i in n.opdef.inplace.values()}
    seen: dict = {}
    removed = 0
    for node in ed.nodes:
        if node.opdef.inplace or any(t in written for t in node.inputs):
            continue
        key = _key(node)
        if key is None:
            continue
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        for old, new in zip(node.outputs, first.outputs):
            ed.replace_uses(old, new)
        ed.erase(node)
        removed += 1
    if not isinstance(net, GraphEditor):
        ed.commit()
    return removed
