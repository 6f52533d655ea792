"""An act-order gather carried by the int4 GEMV that reads it: one launch less per projection.

``F.linear`` on an act-order int4 weight (``int4-g{g}[-zp]-act``, GPTQ's ``desc_act``) records
``gather(x, -1, perm)`` and then the plain scheme's ``quant_linear``: the groups take the inputs in
``perm``'s order. Run as it is recorded, the gather is a launch of its own before every such
projection (four a Llama layer). When the decode GEMV runs the projection (at most 16 rows), it
reads ``x[:, perm[k]]`` itself (``gemv(..., perm=)``; the packed activations of a one-row gate/up
are made in that order), so the gather node launches nothing: the sums are the same bits.

Like :mod:`.norm_carry` this is a schedule, not a graph rewrite: the graph and its dumps keep the
gather, and a run with a per-node hook (taps, profiles) launches it. A gather is carried when
(:func:`plan`, once per node list) it takes the last dim of ``x`` with a 1-D index, its output is
no graph output and its only reader, the node right after it (so nothing is written between
them), is a ``quant_linear`` / ``quant_linear_silu_mul`` / ``quant_linear_add`` node reading it
as its rows. The reader then must not write where ``x`` lies (its memory may be reused once the
gather has run: ``TritonBackend._writes_over``). At run time (:meth:`GatherCarry.take`) the
reader decides: when the GEMV cannot take the call (more rows, another kernel) the gather is
made then, into its planned slot, before the reader runs as before.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["GatherCarry", "Pending", "plan"]

ENABLED = True       # False: every act-order gather launches its own kernel (benchmarks/decode_ab.py's A/B)


class Pending(NamedTuple):
    """A gather not yet made: ``out = x[..., index]`` into ``slot``."""

    x: torch.Tensor
    index: torch.Tensor
    slot: torch.Tensor


def plan(nodes) -> set:
    """The gather nodes of ``nodes`` (a run's node list) that may be carried by their reader
    (module docstring)."""
    if not nodes:
        return set()
    from .triton_backend import _QUANT_OPS
    net = nodes[0].net
    readers = net.consumers()
    outputs = set(getattr(net, "outputs", {}).values())
    carried = set()
    for node, after in zip(nodes, nodes[1:]):
        if node.op != "gather" or len(node.inputs) != 2:
            continue
        x, index = node.inputs
        out = node.outputs[0]
        if len(index.shape) != 1 or node.attrs.get("dim", 0) not in (-1, len(x.shape) - 1) or out in outputs:
            continue
        users = readers.get(out, [])
        if users == [after] and after.op in _QUANT_OPS and after.inputs[0] is out and out not in after.inputs[1:]:
            carried.add(node)
    return carried


class GatherCarry:
    """A backend's carried gathers during one run: :meth:`defer` skips a carried gather's launch,
    :meth:`take` hands its reader the pending gather, :meth:`make` runs it after all."""

    def __init__(self):
        self._plans: tuple = (None, set())       # (node list, its carried gathers)
        self._carried: set = set()               # the current run's
        self._pending: dict = {}                 # gather output tensor -> Pending

    def start(self, nodes, enabled: bool) -> None:
        """A run of ``nodes`` begins; ``enabled`` False (a per-node hook) carries nothing."""
        self._pending = {}
        if not (enabled and ENABLED):
            self._carried = set()
            return
        if self._plans[0] is not nodes:
            self._plans = (nodes, plan(nodes))
        self._carried = self._plans[1]

    def defer(self, node, values: dict, storage: dict) -> bool:
        """Skip ``node`` if it is a carried gather whose operands the GEMV can read; its output's
        value is then its (unwritten) planned slot."""
        if node not in self._carried:
            return False
        x, index = values[node.inputs[0]], values[node.inputs[1]]
        out = node.outputs[0]
        slot = storage.get(out)
        if slot is None or index.dtype != torch.int32 or not index.is_contiguous() or x.stride(-1) != 1 \
                or tuple(slot.shape) != tuple(x.shape[:-1]) + (index.shape[0],) or slot.dtype != x.dtype:
            return False
        self._pending[out] = Pending(x, index, slot)
        values[out] = slot
        return True

    def take(self, node) -> Pending | None:
        """The gather pending for ``node``'s rows (its reader), now handed over, or None."""
        return self._pending.pop(node.inputs[0], None) if node.inputs else None

    @staticmethod
    def make(pending: Pending) -> torch.Tensor:
        """Run a pending gather into its slot (its reader could not read through the index)."""
        return torch.index_select(pending.x, -1, pending.index, out=pending.slot) \
            if pending.slot.is_contiguous() else pending.slot.copy_(pending.x.index_select(-1, pending.index))
