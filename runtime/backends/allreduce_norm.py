"""A tensor-parallel layer's all-reduce and the residual add + RMSNorm after it, in one launch.

In a tensor-parallel decoder layer the o and down projections end in ``all_reduce``, whose only
reader is the ``add_rms_norm`` right after it. When the one-shot path takes the all-reduce
(:mod:`..distributed.collectives`: ``GRAPHDSL_ALLREDUCE=symm_mem``, CUDA, a message up to its
limit), its kernel also adds the residual and normalises
(:func:`~..distributed.collectives.all_reduce_add_rms_norm`), writing the norm's two outputs where
the memory plan put them; the norm node then launches nothing, and the all-reduce's own output,
which nothing else reads, is never written.

Like :mod:`.norm_carry` this is a schedule of two graph nodes, not a rewrite: dumps keep both ops,
and a run with a per-node hook (taps, profiles) runs them one by one. Per run, an output may share
an input's memory only row for row (the kernel reads each row before writing it); otherwise, or
when the one-shot path declines, both nodes run as before.
"""
from __future__ import annotations

from .norm_carry import overlaps

__all__ = ["AllReduceNorm"]

ENABLED = True        # False: the norm after a one-shot all-reduce launches its own kernel (an A/B)


class AllReduceNorm:
    """A backend's fused all-reduce + norm pairs during one run (see the module docstring)."""

    def __init__(self):
        self._plans: tuple = (None, {})          # (node list, its pairs)
        self._pairs: dict = {}                   # the current run's {all_reduce: (norm, input index)}
        self._done: set = set()                  # norm nodes whose outputs the all-reduce wrote

    def start(self, nodes, enabled: bool) -> None:
        """A run of ``nodes`` begins; ``enabled`` False (a per-node hook) fuses nothing."""
        from ..distributed.collectives import norm_after
        self._done = set()
        if not (enabled and ENABLED):
            self._pairs = {}
            return
        if self._plans[0] is not nodes:
            self._plans = (nodes, norm_after(nodes))
        self._pairs = self._plans[1]

    def launch(self, be, node, ins, values: dict, attrs: dict, storage: dict) -> bool:
        """Run ``node`` (an ``all_reduce``) with the norm after it, if it heads a pair and the
        one-shot path takes these tensors; False leaves both nodes to run one by one."""
        pair = self._pairs.get(node)
        if pair is None:
            return False
        from ..distributed.collectives import all_reduce_add_rms_norm
        norm, i = pair
        x = ins[0]
        residual, weight = values[norm.inputs[1 - i]], values[norm.inputs[2]]
        norm_ins = [x if k == i else values[t] for k, t in enumerate(norm.inputs)]
        out, s = (be._dst(t, storage, norm, attrs[norm], norm_ins, k) for k, t in enumerate(norm.outputs))
        if out is None or s is None or overlaps(out, s):
            return False
        for o in (out, s):
            for src in (x, residual):
                if overlaps(o, src) and (o.data_ptr() != src.data_ptr() or o.stride() != src.stride()):
                    return False
        if not all_reduce_add_rms_norm(x, residual, weight, attrs[norm]["eps"], out, s, attrs[node]["world_size"]):
            return False
        values[norm.outputs[0]], values[norm.outputs[1]] = out, s
        values[node.outputs[0]] = storage.get(node.outputs[0], s)   # never written: its only reader is done
        self._done.add(norm)
        return True

    def done(self, node) -> bool:
        """Whether ``node`` (an ``add_rms_norm``) already ran inside the all-reduce before it."""
        return node in self._done
