"""Constant folding of parameter-only subgraphs.

A node whose every input is a weight (or computed only from weights) — a transpose of a weight,
the q/k/v or gate/up concatenation a fusion introduced, a dtype cast of a norm weight — computes
the same value on every call. The build marks the nodes that depend only on declared
:class:`~graphdsl.nn.Parameter` s (so generic fusion leaves them alone); the engine evaluates the
nodes that depend only on *bound* weights once, when ``set_weights`` binds them, and skips them in
``forward``.
"""
from __future__ import annotations

from graphdsl.network import Network, Node
from graphdsl.nn import Parameter
from graphdsl.dim import DimExpr
from graphdsl.opdef import OpCategory, RuntimeParam

__all__ = ["parameter_only_nodes", "declared_parameters"]


def declared_parameters(net: Network) -> set[str]:
    return {name for name, t in net.inputs.items() if isinstance(t, Parameter)}


def parameter_only_nodes(net: Network, constant_inputs: set[str]) -> list[Node]:
    """Nodes (in order) all of whose inputs are in ``constant_inputs`` or produced by such nodes.

    Nodes with in-place effects, collectives and nodes without inputs are never folded.
    """
    const = {t for name, t in net.inputs.items() if name in constant_inputs}
    out = []
    for node in net.nodes:
        if not node.inputs or node.opdef.inplace or node.category is OpCategory.COLLECTIVE:
            continue
        if all(t in const for t in node.inputs) and not any(_symbolic(v) for v in node.attrs.values()):
            out.append(node)
            const.update(node.outputs)
    return out


def _symbolic(v) -> bool:
    """Attribute values known only per call (Dims, runtime parameters) keep a node out of folding."""
    if isinstance(v, (DimExpr, RuntimeParam)):
        return True
    return isinstance(v, tuple) and any(_symbolic(x) for x in v)
