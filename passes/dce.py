"""Dead-code elimination: drop nodes none of whose outputs reach a marked output.

Nodes with in-place effects (an ``OpDef.inplace`` entry, e.g. ``reshape_and_cache`` writing the
KV cache) are roots too: their write is visible to the caller even when nothing reads the result.
"""
from __future__ import annotations

from graphdsl.network import Network

__all__ = ["dead_code_elimination"]


def dead_code_elimination(net: Network) -> int:
    """Remove dead nodes from ``net`` in place; return how many were removed."""
    live = set(net.outputs.values())
    keep = []
    for node in reversed(net.nodes):
        if node.opdef.inplace or any(t in live for t in node.outputs):
            keep.append(node)
            live.update(node.inputs)
    removed = len(net.nodes) - len(keep)
    net.nodes = keep[::-1]
    return removed
