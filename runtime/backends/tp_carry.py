"""A tensor-parallel layer's all-reduce, residual add and RMSNorm carried by the decode GEMVs around
them: the all-reduce and the norm launch nothing.

In a TP decoder layer the row-parallel o or down projection ``p`` makes a partial row, ``all_reduce``
sums the ranks', ``add_rms_norm`` adds the residual and normalises, and the next projection ``c``
(qkv, gate|up, the LM head) reads the normed row. With every rank's GEMVs in reach of each other
(the one-shot all-reduce's conditions, :mod:`..distributed.collectives`), ``p``'s GEMV pushes its
tiles into every rank's carry buffer and ``c``'s GEMV sums them, adds, normalises and runs
(:mod:`..kernels.tp_carry`): a launch less, and no kernel boundary between the last tile's arrival
and the next GEMV. The norm's outputs land where the memory plan put them (``c`` writes the normed
rows and, one program, the sum), so every later reader finds them as before; the all-reduce's
output is never written (its only reader is the norm).

Like :mod:`.norm_carry` this is a schedule of four graph nodes, not a rewrite: dumps keep the
ops, a run with a per-node hook (taps, profiles) runs them one by one, and so does a run where any
condition fails. Conditions, once per node list (:func:`plan`): ``p`` (``x @ w.T``: ``matmul`` or
``quant_linear``) → its only reader ``all_reduce`` → its only reader ``add_rms_norm`` → ``c``
(``matmul`` / ``matmul_silu_mul`` / ``quant_linear`` / ``quant_linear_silu_mul``) reading the
normed rows as its input, four nodes in a row, neither the partial nor the normed rows a graph
output. The memory plan keeps the norm's inputs alive through ``c``
(``passes/memory_plan.py``). Per run (:meth:`TPCarry.producer`): both GEMVs take their operands
(fp16/bf16 rows, at most :data:`MAX_ROWS` of at most :data:`MAX_WIDTH`; plain or weight-only
quantized weights, not GGUF blocks; the producer's rows not read through an act-order gather;
an int4 consumer then reads its rows, not packed activations), the one-shot path takes a
message of this size, the group's carry buffers are mapped, and no output ``c`` writes shares
memory with what ``c`` reads.

``GRAPHDSL_TP_CARRY`` (``0`` default, ``1`` on; read when a backend first runs a node list):
off, since on two H200s it was slower than the one-shot kernel it replaces (Llama-3-8B shape,
TP2 bf16: 2.722 against 2.590 ms a token; docs/distributed.md); its outputs equal the one-shot
path's there (``tests/gpu/test_tensor_parallel_gpu.py``).
"""
from __future__ import annotations

from typing import NamedTuple

from graphdsl.env import env_flag

from ..device import triton_interprets
from .norm_carry import _plain_rows, overlaps, readers_and_outputs

__all__ = ["TPCarry", "Site", "plan", "enabled", "MAX_ROWS", "MAX_WIDTH"]

MAX_ROWS = 4          # rows a carried site takes: every consumer program normalises every row first
MAX_WIDTH = 8192      # row width a carried site takes: a consumer program holds a whole row in registers
PRODUCERS = ("matmul", "quant_linear")
CONSUMERS = ("matmul", "matmul_silu_mul", "quant_linear", "quant_linear_silu_mul")


def enabled() -> bool:
    """``GRAPHDSL_TP_CARRY``: on carries, off (the default) does not."""
    return env_flag("GRAPHDSL_TP_CARRY", False)


class Site(NamedTuple):
    """One carried all-reduce: ``producer`` → ``reduce`` → ``norm`` → ``consumer``."""

    producer: object          # graph Node: x @ w.T, row-parallel
    reduce: object            # all_reduce of its output
    norm: object              # add_rms_norm of the sum
    y_input: int              # the norm's input (0 or 1) that is the sum
    consumer: object          # the GEMV reading the normed rows first


def plan(nodes) -> dict:
    """The sites of ``nodes`` (a run's node list): ``{node: Site}`` for each site's four nodes."""
    if not nodes:
        return {}
    readers, outputs = readers_and_outputs(nodes)
    sites = {}
    for p, a, b, c in zip(nodes, nodes[1:], nodes[2:], nodes[3:]):
        if p.op not in PRODUCERS or not _plain_rows(p) or a.op != "all_reduce" or a.attrs.get("world_size", 1) == 1 \
                or b.op != "add_rms_norm" or c.op not in CONSUMERS or not _plain_rows(c):
            continue
        y, total, normed = p.outputs[0], a.outputs[0], b.outputs[0]
        if a.inputs[0] is not y or readers.get(y) != [a] or readers.get(total) != [b] or y in outputs \
                or total in outputs or normed in outputs or b.inputs[0] is b.inputs[1] or total not in b.inputs[:2]:
            continue
        if c.inputs[0] is not normed or normed in c.inputs[1:]:
            continue
        site = Site(p, a, b, b.inputs.index(total), c)
        for n in (p, a, b, c):
            sites[n] = site
    return sites


class TPCarry:
    """A backend's carried all-reduces during one run: :meth:`producer` launches a site's producer
    with the push (or declines), :meth:`done` tells whether an all-reduce or norm node is already
    taken care of, :meth:`tp_in` gives the consumer its sum + norm."""

    def __init__(self):
        self._plans: tuple = (None, {})
        self._sites: dict = {}
        self._active: dict = {}                 # consumer node -> GemvTPIn
        self._done: set = set()                 # the all-reduce and norm nodes of launched sites

    def start(self, nodes, enabled_now: bool) -> None:
        """A run of ``nodes`` begins; ``enabled_now`` False (a per-node hook) carries nothing."""
        self._active, self._done = {}, set()
        if not enabled_now:
            self._sites = {}
            return
        if self._plans[0] is not nodes:          # the setting is read once per node list, not every run
            self._plans = (nodes, plan(nodes) if enabled() else {})
        self._sites = self._plans[1]

    def producer(self, be, node, values: dict, attrs: dict, storage: dict) -> bool:
        """Launch ``node`` as a site's producer with the push, if it is one and every condition
        holds on these tensors; False leaves the site's nodes to run one by one."""
        site = self._sites.get(node)
        if site is None or site.producer is not node:
            return False
        tp_in = _launch(be, site, values, attrs, storage)
        if tp_in is None:
            return False
        self._active[site.consumer] = tp_in
        self._done.update((site.reduce, site.norm))
        return True

    def done(self, node) -> bool:
        """Whether ``node`` (an ``all_reduce`` or ``add_rms_norm``) is carried by a launched site."""
        return node in self._done

    def tp_in(self, node):
        """The :class:`~..kernels.tp_carry.GemvTPIn` a consumer GEMV applies, or None."""
        return self._active.get(node)


def _launch(be, site: Site, values: dict, attrs: dict, storage: dict):
    """Check the run-time conditions and launch the producer with the push; the consumer's
    :class:`~..kernels.tp_carry.GemvTPIn` (its rows, the norm's outputs, set in ``values``), or None."""
    from ..distributed.collectives import carry_buffers, carry_takes
    from ..kernels.gemv import GemvPush, GemvTPIn, gemv
    p, a, b, c = site.producer, site.reduce, site.norm, site.consumer
    x = values[p.inputs[0]]
    if x.dim() != 2 or not (x.device.type == "cuda" or triton_interprets()) or x.shape[0] > MAX_ROWS \
            or be.gather_rows is not None:           # (act-order: the producer reads x through a gather)
        return None
    weights = _gemv_weights(p, x, values, attrs)
    if weights is None:
        return None
    m, n = x.shape[0], weights[1]
    if n > MAX_WIDTH:
        return None
    residual, g = values[b.inputs[1 - site.y_input]], values[b.inputs[2]]
    if residual.shape != (m, n) or residual.dtype != x.dtype or residual.stride(-1) != 1 or g.shape != (n,) \
            or g.dtype != x.dtype or not g.is_contiguous() or b.outputs[0].dtype != x.dtype \
            or not carry_takes(residual):
        return None
    normed, s = (be._dst(t, storage, b, attrs[b], [residual, residual, g], i) for i, t in enumerate(b.outputs))
    out = storage.get(c.outputs[0])
    if normed is None or s is None or not normed.is_contiguous() or s.stride(-1) != 1 \
            or _gemv_weights(c, normed, values, attrs) is None or (out is not None and out.stride(-1) != 1):
        return None
    read = [residual, g] + [values[t] for t in c.inputs[1:]]
    written = [normed, s] + ([out] if out is not None else [])
    if any(overlaps(o, t) for o in written for t in read) or any(
            overlaps(o1, o2) for i, o1 in enumerate(written) for o2 in written[i + 1:]):
        return None
    bufs = carry_buffers(attrs[a]["world_size"], x.device, x.dtype, n)
    if bufs is None or not bufs.rows_fit(m, n):
        return None
    y = be._dst(p.outputs[0], storage, p, attrs[p], [values[t] for t in p.inputs], 0)   # never written:
    gemv(x, weights[0], out=y, workspace=be.gemv_workspace, push=GemvPush(bufs), **weights[2])   # tiles go out
    values[p.outputs[0]] = values[a.outputs[0]] = y
    values[b.outputs[0]], values[b.outputs[1]] = normed, s
    return GemvTPIn(bufs, residual, g, s, float(attrs[b]["eps"]))


def _gemv_weights(node, x, values: dict, attrs: dict):
    """``(weight, output columns, gemv keywords)`` of a carried site's projection reading rows ``x``
    through the decode GEMV (a plain or weight-only quantized weight; GGUF blocks and layers the GEMV
    does not take: None)."""
    from graphdsl.quant import code_rows, parse_scheme

    from ..gguf_scheme import GGUFMixScheme, GGUFScheme
    from ..kernels.gemv import gemv_supported
    from .triton_backend import _kernel_unsupported
    w = values[node.inputs[1]]
    if not node.op.startswith("quant"):
        return (w, w.shape[0], {}) if gemv_supported(x, w) else None
    scheme = parse_scheme(attrs[node]["scheme"])
    stored = [values[t] for t in node.inputs[1:]]
    if isinstance(scheme, (GGUFScheme, GGUFMixScheme)) or not gemv_supported(x, w, scheme) \
            or _kernel_unsupported(node, [x] + stored) is not None:
        return None
    kw = dict(scheme=scheme, scales=stored[1], zeros=stored[2] if len(stored) > 2 else None)
    return w, code_rows(w), kw
