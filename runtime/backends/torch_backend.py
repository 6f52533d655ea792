"""The reference backend: each node runs its op's torch reference, on CPU or CUDA.

Non-view results are copied into their planned arena slot (or straight into the caller's output
buffer), so memory use follows the plan; views and in-place results alias their source.
"""
from __future__ import annotations

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.opdef import OpCategory

__all__ = ["TorchBackend"]


class TorchBackend:
    name = "torch"

    def launches(self, net_or_nodes) -> int:
        """Kernel launches per forward: every node but views (a network or a list of nodes)."""
        nodes = getattr(net_or_nodes, "nodes", net_or_nodes)
        return sum(1 for n in nodes if n.category is not OpCategory.VIEW)

    def run(self, nodes, values: dict, attrs: dict, storage: dict, after=None) -> None:
        """Execute ``nodes`` in order.

        Args:
            values: tensor -> torch tensor, pre-filled with inputs; results are added.
            attrs: node -> resolved attributes.
            storage: tensor -> preallocated destination (arena slot or caller's output buffer).
            after: optional ``fn(node, values)`` called after each node has run (taps, profiles);
                it must not change ``values``.
        """
        for node in nodes:
            self._run_one(node, values, attrs, storage)
            if after is not None:
                after(node, values)

    def _run_one(self, node, values: dict, attrs: dict, storage: dict) -> None:
        results = node.opdef.run([values[t] for t in node.inputs], attrs[node])
        for t, r in zip(node.outputs, results):
            dst = storage.get(t)
            if dst is not None:
                if r.shape != dst.shape or r.dtype != dst.dtype:
                    raise GraphDSLError(
                        f"node '{node.name}' ({node.op} at {node.source}): the op's torch reference returned "
                        f"{list(r.shape)} {r.dtype} but its shape rule promised {list(dst.shape)} {dst.dtype}")
                dst.copy_(r)
                values[t] = dst
            else:
                values[t] = r
