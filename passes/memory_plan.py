"""Liveness-based memory planning into one arena.

Every intermediate that needs storage of its own (outputs of non-view, non-in-place nodes that are
not engine outputs) gets a byte range in a single arena. A tensor is live from the step that
produces it to the last step that reads it *or any view/alias of it*. Two tensors may share bytes
when their live ranges do not overlap. A pointwise node may also write its output over an input of
the same size whose life ends at that node (in-place reuse), which is safe for elementwise kernels.
A node's *workspace* (scratch its op's workspace rule asks for, see :mod:`graphdsl.opdef`) is live
during that node only. Placement is greedy by size (largest first, lowest fitting offset), aligned
to 256 bytes. The rows of a last-dim ``gather`` by a 1-D index live as long as its result (a
backend may read them through the index instead of the copy). The inputs of an ``add_rms_norm`` of
an ``all_reduce``'s result live through the node after it (a backend may do the norm inside that
node's GEMV, whose other programs write its output meanwhile).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphdsl.network import Network
from graphdsl.opdef import OpCategory

__all__ = ["Buffer", "MemoryPlan", "plan_memory", "ALIGN"]

ALIGN = 256


@dataclass
class Buffer:
    """A byte range of the arena shared by the tensors in ``tensors`` (in-place chains)."""

    nbytes: int
    start: int
    end: int
    tensors: list[str] = field(default_factory=list)
    offset: int = -1


@dataclass
class MemoryPlan:
    arena_bytes: int
    intermediate_bytes: int          # sum over all planned tensors, as if each had its own memory
    slots: dict[str, tuple[int, int]]  # tensor name -> (offset, nbytes)
    buffers: list[Buffer]
    workspace_slots: dict[str, tuple[int, int]] = field(default_factory=dict)  # node name -> (offset, nbytes)

    def describe(self) -> str:
        lines = [f"arena {self.arena_bytes} bytes for {len(self.slots)} tensors in {len(self.buffers)} buffers "
                 f"(sum of intermediates {self.intermediate_bytes} bytes)"]
        for b in sorted(self.buffers, key=lambda b: b.offset):
            lines.append(f"  [{b.offset:>12}, {b.offset + b.nbytes:>12})  steps {b.start:>4}..{b.end:<4}  "
                         + ", ".join(b.tensors))
        return "\n".join(lines)


def _read_through(node) -> bool:
    """A gather of the last dim by a 1-D index (act-order int4's ``x[..., perm]``): its reader may
    read ``x`` through the index instead of the gathered copy (``runtime/backends/gather_carry.py``),
    so ``x`` must not be overwritten before the reader runs."""
    if node.op != "gather" or len(node.inputs) != 2 or len(node.inputs[1].shape) != 1:
        return False
    return node.attrs.get("dim", 0) in (-1, len(node.inputs[0].shape) - 1)


def _norm_carried_into_next(node) -> bool:
    """An ``add_rms_norm`` of an ``all_reduce``'s result: a tensor-parallel backend may do the sum
    and the norm inside the next node, a GEMV (``runtime/backends/tp_carry.py``), so its inputs
    must not be overwritten before that node has run."""
    return node.op == "add_rms_norm" and any(t.producer is not None and t.producer.op == "all_reduce"
                                             for t in node.inputs)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_memory(net: Network, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                workspaces: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> MemoryPlan:
    """Plan ``net``'s intermediates given concrete ``specs`` (tensor name -> (shape, dtype)) and the
    nodes' ``workspaces`` (node name -> (shape, dtype)), each live during its node's step only."""
    workspaces = workspaces or {}
    nbytes = {name: _nbytes(shape, dt) for name, (shape, dt) in specs.items()}
    outputs = set(net.outputs.values())
    base: dict = {}                       # tensor -> tensor whose storage it uses
    for node in net.nodes:
        cat = node.category
        for i, t in enumerate(node.outputs):
            if cat is OpCategory.VIEW and node.inputs:
                base[t] = base.get(node.inputs[0], node.inputs[0])
            elif i in node.opdef.inplace:
                src = node.inputs[node.opdef.inplace[i]]
                base[t] = base.get(src, src)
    end = len(net.nodes)
    last_use: dict = {}
    for step, node in enumerate(net.nodes):
        for t in node.inputs:
            root = base.get(t, t)
            last_use[root] = step
            last_use[t] = step
    for t in outputs:                     # outputs reading arena storage are copied out at the end
        last_use[base.get(t, t)] = end
    for step, node in enumerate(net.nodes):   # a last-dim gather's rows live while its result does
        if _read_through(node):
            x, out = base.get(node.inputs[0], node.inputs[0]), node.outputs[0]
            last_use[x] = max(last_use.get(x, step), last_use.get(out, step))
        if _norm_carried_into_next(node) and step + 1 < end:
            for t in node.inputs:
                root = base.get(t, t)
                last_use[root] = max(last_use.get(root, step), step + 1)

    buffers: list[Buffer] = []
    owner: dict = {}                      # tensor -> Buffer
    scratch: dict = {}                    # node name -> (Buffer, nbytes)
    total = 0
    for step, node in enumerate(net.nodes):
        if node.name in workspaces:
            size = _nbytes(*workspaces[node.name])
            b = Buffer(_align(size), step, step, [f"{node.name} (workspace)"])
            buffers.append(b)
            scratch[node.name] = (b, size)
            total += size
        for i, t in enumerate(node.outputs):
            if t in base or t in outputs:
                continue
            size = nbytes[t.name]
            total += size
            life_end = last_use.get(t, step)
            reuse = None
            if node.category is OpCategory.POINTWISE:
                for x in node.inputs:
                    b = owner.get(x)
                    if (b is not None and b.end == step and last_use.get(x) == step and b.nbytes == _align(size)
                            and specs[x.name] == specs[t.name]):
                        reuse = b
                        break
            if reuse is not None:
                reuse.end = max(reuse.end, life_end)
                reuse.tensors.append(t.name)
                owner[t] = reuse
            else:
                b = Buffer(_align(size), step, life_end, [t.name])
                buffers.append(b)
                owner[t] = b

    placed: list[Buffer] = []
    arena = 0
    for b in sorted(buffers, key=lambda b: (-b.nbytes, b.start)):
        clashes = sorted((p for p in placed if p.start <= b.end and b.start <= p.end), key=lambda p: p.offset)
        off = 0
        for p in clashes:
            if off + b.nbytes <= p.offset:
                break
            off = max(off, p.offset + p.nbytes)
        b.offset = off
        placed.append(b)
        arena = max(arena, off + b.nbytes)
    slots = {t.name: (b.offset, nbytes[t.name]) for t, b in owner.items()}
    return MemoryPlan(arena, total, slots, buffers, {n: (b.offset, size) for n, (b, size) in scratch.items()})


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize
