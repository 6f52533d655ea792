"""Incremental edits of a :class:`~graphdsl.Network` through its networkx view.

A :class:`GraphEditor` builds ``net.to_networkx()`` once and keeps it in step with every edit
(insert nodes, redirect the uses of a tensor, erase nodes), so passes ask "who reads this tensor"
in O(degree) instead of rescanning the node list. :meth:`GraphEditor.commit` writes the node list
back in a stable topological order (each node keeps the position of the code it came from).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterable

import networkx as nx

from graphdsl.errors import GraphDSLError
from graphdsl.network import Network, Node, module_scope
from graphdsl.tensor import Tensor

__all__ = ["GraphEditor", "OUTPUT"]


class _Output:
    """Marker for "read as a network output" in :meth:`GraphEditor.users`."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"output '{self.name}'"


OUTPUT = _Output


def _vertex(t: Tensor) -> str:
    return t.producer.name if t.producer is not None else f"input:{t.name}"


class GraphEditor:
    """Edit ``net`` in place; call :meth:`commit` when done."""

    def __init__(self, net: Network):
        self.net = net
        self.g: nx.MultiDiGraph = net.to_networkx()
        self.pos: dict[Node, float] = {n: float(i) for i, n in enumerate(net.nodes)}
        self._names = {n.name for n in net.nodes} | {t.name for n in net.nodes for t in n.outputs} | set(net.inputs)
        self._fresh = itertools.count()

    # -- queries ---------------------------------------------------------------------------
    @property
    def nodes(self) -> list[Node]:
        return sorted(self.pos, key=self.pos.__getitem__)

    def alive(self, node: Node) -> bool:
        return node in self.pos

    def users(self, t: Tensor) -> list:
        """Nodes reading ``t`` (each once), plus an :class:`OUTPUT` marker per output name."""
        src = _vertex(t)
        if src not in self.g:
            return []
        out, seen = [], set()
        for _, v, key in self.g.out_edges(src, keys=True):
            if key != t.name or v in seen:
                continue
            seen.add(v)
            data = self.g.nodes[v]
            out.append(data["node"] if data["kind"] == "op" else _Output(v.removeprefix("output:")))
        return out

    def node_users(self, node: Node) -> list[Node]:
        return [u for t in node.outputs for u in self.users(t) if isinstance(u, Node)]

    # -- edits -----------------------------------------------------------------------------
    def record(self, fn, *args, at: Node, like: Node | None = None, **kwargs):
        """Call graphdsl code ``fn(*args, **kwargs)`` recording into the network; the new nodes are
        placed just before ``at`` and carry the module path and source line of ``like`` (default
        ``at``). Returns ``(fn's result, new nodes)``."""
        like = like or at
        before = len(self.net.nodes)
        with self.net, module_scope(like.module):
            result = fn(*args, **kwargs)
        new = self.net.nodes[before:]
        del self.net.nodes[before:]
        base = self.pos[at]
        for i, n in enumerate(new):
            n.source = like.source
            self.insert(n, base - 1.0 + (i + 1) / (len(new) + 1))
        return result, new

    def insert(self, node: Node, position: float) -> None:
        self._rename(node)
        self.pos[node] = position
        self.g.add_node(node.name, kind="op", node=node)
        for t in node.inputs:
            src = _vertex(t)
            if t.producer is None and src not in self.g:
                self.g.add_node(src, kind="input", tensor=t)
            self.g.add_edge(src, node.name, key=t.name, tensor=t)

    def replace_uses(self, old: Tensor, new: Tensor, *, exclude: Iterable[Node] = ()) -> None:
        """Make every reader of ``old`` (outputs too) read ``new`` instead."""
        if old is new:
            return
        skip = set(exclude)
        src_old, src_new = _vertex(old), _vertex(new)
        if new.producer is None and src_new not in self.g:
            self.g.add_node(src_new, kind="input", tensor=new)
            self.net.inputs.setdefault(new.name, new)
        for user in self.users(old):
            if isinstance(user, _Output):
                self.net.outputs[user.name] = new
                v = f"output:{user.name}"
            else:
                if user in skip:
                    continue
                user.inputs = [new if x is old else x for x in user.inputs]
                v = user.name
            self.g.remove_edge(src_old, v, key=old.name)
            self.g.add_edge(src_new, v, key=new.name, tensor=new)

    def erase(self, node: Node) -> None:
        """Remove ``node``; its outputs must have no readers left."""
        for t in node.outputs:
            left = self.users(t)
            if left:
                raise GraphDSLError(f"cannot erase node '{node.name}': '{t.name}' is still read by {left}")
        self.g.remove_node(node.name)
        del self.pos[node]

    def commit(self) -> None:
        """Write the node list back in a stable topological order (by position)."""
        self.net.nodes = self._toposort()

    # -- helpers ---------------------------------------------------------------------------
    def _toposort(self) -> list[Node]:
        indeg = {n: 0 for n in self.pos}
        readers: dict[Node, list[Node]] = {n: [] for n in self.pos}
        for n in self.pos:
            for p in {t.producer for t in n.inputs if t.producer is not None}:
                if p not in self.pos:
                    raise GraphDSLError(f"node '{n.name}' reads '{p.name}', which was erased")
                indeg[n] += 1
                readers[p].append(n)
        heap = [(self.pos[n], i, n) for i, n in enumerate(self.pos) if indeg[n] == 0]
        heapq.heapify(heap)
        tie = itertools.count(len(heap))
        out = []
        while heap:
            _, _, n = heapq.heappop(heap)
            out.append(n)
            for r in readers[n]:
                indeg[r] -= 1
                if indeg[r] == 0:
                    heapq.heappush(heap, (self.pos[r], next(tie), r))
        if len(out) != len(self.pos):
            stuck = sorted(n.name for n in self.pos if indeg[n] > 0)[:8]
            raise GraphDSLError(f"rewrite produced a cycle through nodes {stuck}")
        return out

    def _rename(self, node: Node) -> None:
        if node.name in self.g and self.g.nodes[node.name].get("node") is node:
            return
        if node.name in self._names:
            base = node.name.rsplit("_", 1)[0] if node.name.rsplit("_", 1)[-1].isdigit() else node.name
            name = f"{base}_r{next(self._fresh)}"
            while name in self._names:
                name = f"{base}_r{next(self._fresh)}"
            node.name = name
            for i, t in enumerate(node.outputs):
                t.name = name if len(node.outputs) == 1 else f"{name}:{i}"
        self._names.add(node.name)
        self._names.update(t.name for t in node.outputs)
