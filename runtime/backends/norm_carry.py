"""The RMSNorm between two decode GEMVs, carried by their epilogues: one launch less per norm.

In a decoder layer the ``o_proj`` / ``down_proj`` product ``y`` meets the residual in
``add_rms_norm``, whose normed output feeds only the next projections (qkv, gate/up, the
lm_head). When all of them run as decode GEMVs (<= 16 rows), the producer GEMV adds the residual
itself and stores, besides the sum ``s``, ``s · weight`` and the sums of ``s²`` of each row's
32-column chunks (:class:`~..kernels.gemv.GemvRmsOut`); each consumer GEMV reads ``s · weight``
and multiplies its float32 sums by ``rsqrt(Σ s² / N + eps)`` (:class:`~..kernels.gemv.GemvRmsIn`).
The ``add_rms_norm`` node then launches nothing. The product equals the unfused one up to where
one bfloat16 rounding falls (``(ŝ·r)`` rounded before the weight multiply there, ``ŝ·w`` here).

The GGUF GEMVs carry it too, for one row (:func:`_gguf_producer`): a producer on the tensor cores
(one Q4_K or Q6_K part) stores the same three things and, when a consumer runs a Q4_K part on the
tensor cores, the A operand of ``s · weight`` (:class:`~..kernels.gemv.GemvRmsOut` ``planes``),
which those consumers read instead of an activation launch (the backend's ``_planes_ready``); every
part of a GGUF consumer, on either core, multiplies its sums by the factor. Then neither the
norm's launch nor its planes' (``gguf_mma.norm_planes``) runs.

With one row, an int4 consumer that reads packed activations (``gemv(..., xpack=)``; the gate/up
GEMVs of :func:`.triton_backend.xpack_pays`) gets them from the producer too: its epilogue also
stores ``s · weight`` in their bytes (:class:`~..kernels.gemv.GemvRmsOut` ``packed``), so the
consumer needs no pack launch (:meth:`NormCarry.xpack`; ``PACK``).

This is a schedule of three graph nodes, not a graph rewrite: the graph and its dumps keep the
three ops, more rows run them one by one as before, and so does a run with a per-node hook (taps,
profiles read every node's output, and here ``y`` and the normed tensor are never written).

Conditions. Once per node list (:func:`plan`): the producer (``matmul`` of ``x @ w.T``, or
``quant_linear``) is immediately followed by the ``add_rms_norm`` that is its output's only reader;
the normed output is read only by such projections (``matmul``, ``matmul_silu_mul``,
``quant_linear``, ``quant_linear_silu_mul``) as their input rows — directly, or through an
act-order gather that :mod:`.gather_carry` may carry (the norm's factor is per row, so it applies
to gathered rows alike) — and neither is a graph output.
Per run (:meth:`NormCarry.producer`), on the real tensors: every GEMV takes its operands, the norm
keeps the dtype, and the sum's planned storage is the residual's or overlaps none of the
producer's inputs (the producer writes it while its other programs still read them). A site's
``s · weight`` and partial sums live in one of two backend buffers, taken in turn; :func:`plan`
keeps a site only if every reader of the last site on its buffer has run before its producer.
When the planner put the sum into the memory of an input the producer still reads (it dies
there), the sum goes to the slot's third buffer instead and its readers are handed that one —
for a sum that is no graph output and whose readers all run before that buffer is taken again.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..device import triton_interprets

__all__ = ["NormCarry", "Site", "plan", "overlaps", "readers_and_outputs", "PRODUCERS", "CONSUMERS"]

ENABLED = True       # False: every norm launches its own kernel (benchmarks/decode_ab.py's A/B)
THROUGH_GATHERS = True   # False: no site whose consumers read through an act-order gather (the A/B)
# producers' weight kinds whose sites are carried. In-model A/B on an H100 (µs a batch-1 step, carried vs
# launched): Llama-3-8B int4 2586 vs 2684; bf16 5544 vs 5545 and Llama-3.2-1B 1110 vs 1115; fp8 3599 vs 3469
# (docs/quantization-log.md). On three H200s, bf16: 8B 4086 vs 4117, 4019 vs 4073; 1B 860 vs 859, 854 vs 867,
# 859 vs 883.
# fp8 W8A8 (H200, two builds each): 8B 2820, 2803 carried vs 2713, 2712 launched. "gguf": the GGUF tensor-core
# producers (_gguf_producer; measured in docs/quantization-log.md)
KINDS = ("int4", "float", "gguf")
# one row: the producer also stores the normed rows as the packed activations of its int4 consumers that
# read packed rows (GemvRmsOut.packed; gemv xpack=) instead of a launch making them. In-model A/B (H200,
# µs a batch-1 step): Llama-3-8B int4 2169 -> 2140. False for the A/B
PACK = True
PRODUCERS = ("matmul", "quant_linear")
CONSUMERS = ("matmul", "matmul_silu_mul", "quant_linear", "quant_linear_silu_mul")


class Site(NamedTuple):
    """One carried norm: ``producer`` → ``norm`` (``add_rms_norm``) → ``consumers``."""

    producer: object          # graph Node
    norm: object              # graph Node, right after the producer
    y_input: int              # the norm's input (0 or 1) that is the producer's output
    consumers: tuple          # graph Nodes reading the normed output as their rows
    slot: int                 # which of the two scratch buffers
    sum_aside: bool           # the sum may go to the slot's buffer when its planned storage cannot take it


def _plain_rows(node) -> bool:
    """``node`` multiplies its input 0 (rows) by a weight: ``x @ w.T`` or a quantized linear."""
    if node.op in ("quant_linear", "quant_linear_silu_mul"):
        return True
    return bool(node.attrs.get("transpose_b")) and not node.attrs.get("transpose_a")


def readers_and_outputs(nodes) -> tuple[dict, set]:
    """For a run's node list: ``{tensor: the nodes reading it}`` and the set of graph outputs of
    its network (what a schedule of several nodes must leave alone)."""
    net = nodes[0].net
    return net.consumers(), set(getattr(net, "outputs", {}).values())


def plan(nodes) -> dict:
    """The sites of ``nodes`` (a run's node list): ``{norm node: Site}``, also keyed by producer."""
    if not nodes:
        return {}
    from .gather_carry import plan as gather_plan
    readers, outputs = readers_and_outputs(nodes)
    index = {n: i for i, n in enumerate(nodes)}
    gathers = gather_plan(nodes) if THROUGH_GATHERS else set()   # act-order: the reader after a gather
    sites, last_read = {}, [-1, -1]
    for i, p in enumerate(nodes[:-1]):
        b = nodes[i + 1]
        if p.op not in PRODUCERS or b.op != "add_rms_norm" or not _plain_rows(p):
            continue
        y = p.outputs[0]
        if readers.get(y) != [b] or y in outputs or b.inputs[0] is b.inputs[1] or y not in b.inputs[:2]:
            continue
        normed = b.outputs[0]
        cons = [nodes[index[c] + 1] if c in gathers and c.inputs[0] is normed else c
                for c in readers.get(normed, [])]
        if not cons or normed in outputs or any(
                c.op not in CONSUMERS or (c.inputs[0] is not normed and c.inputs[0].producer not in gathers)
                or normed in c.inputs[1:] or not _plain_rows(c) or c not in index for c in cons):
            continue
        slot = next((s for s in (0, 1) if last_read[s] < i), None)
        if slot is None:
            continue
        sum_readers = readers.get(b.outputs[1], [])
        aside = b.outputs[1] not in outputs and all(r in index for r in sum_readers)
        last_read[slot] = max(index[r] for r in cons + (sum_readers if aside else []))
        site = Site(p, b, b.inputs.index(y), tuple(cons), slot, aside)
        sites[b] = sites[p] = site
    return sites


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return start, start + extent * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory ranges ``a`` and ``b`` span (first to last element) intersect."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


class NormCarry:
    """A backend's carried norms during one run: :meth:`producer` launches a site's producer with
    the norm in its epilogue (or declines), :meth:`norm` tells whether the norm node is already
    done, :meth:`rms_in` gives a consumer its row scale."""

    def __init__(self):
        self._plans: tuple = (None, {})          # (node list, its sites)
        self._sites: dict = {}                   # the current run's sites (empty: none carried)
        self._active: dict = {}                  # normed tensor -> (GemvRmsIn, scaled, sum)
        self._buffers: dict = {}                 # (slot, device, m, n, dtype) -> (scaled, partials, sum aside)

    def start(self, nodes, enabled: bool) -> None:
        """A run of ``nodes`` begins; ``enabled`` False (a per-node hook) carries nothing."""
        self._active = {}
        if not (enabled and ENABLED):
            self._sites = {}
            return
        if self._plans[0] is not nodes:
            self._plans = (nodes, plan(nodes))
        self._sites = self._plans[1]

    def _planes_for(self, slot, device, n) -> tuple:
        """The slot's Q4_K A operand buffers for rows of ``n`` (``GemvWorkspace.planes``' shapes; not
        those: the producer may itself be reading an A operand of ``n`` inputs from there)."""
        from ..kernels.gguf_mma import empty_planes
        key = ("planes", slot, str(device), n)
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = self._buffers[key] = empty_planes(n, device)
        return bufs

    def _packed_for(self, slot, device, n) -> torch.Tensor:
        key = ("packed", slot, str(device), n)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.zeros(6, n // 8, dtype=torch.int32, device=device)
        return buf

    def _buffers_for(self, slot, device, m, n, dtype):
        from ..kernels.gemv import RMS_CHUNK
        key = (slot, str(device), m, n, dtype)
        bufs = self._buffers.get(key)
        if bufs is None:            # s · weight, the partial sums, the sum when set aside
            bufs = self._buffers[key] = (torch.empty(m, n, dtype=dtype, device=device),
                                         torch.empty(m, -(-n // RMS_CHUNK), dtype=torch.float32, device=device),
                                         torch.empty(m, n, dtype=dtype, device=device))
        return bufs

    def producer(self, be, node, values: dict, attrs: dict, storage: dict) -> bool:
        """Launch ``node`` as a site's producer with the norm carried, if it is one and every
        condition holds on these tensors; False leaves the three nodes to run one by one."""
        site = self._sites.get(node)
        if site is None or site.producer is not node:
            return False
        launch = _launch(be, site, values, attrs, storage, self)
        if launch is None:
            return False
        self._active[site.norm.outputs[0]] = launch
        values[node.outputs[0]] = storage.get(node.outputs[0], launch.sum)   # never written: its only reader is done
        return True

    def norm(self, node, values: dict) -> bool:
        """Whether ``node`` (an ``add_rms_norm``) was carried by its producer; its outputs are then
        the producer's ``s · weight`` (read only by the consumers, with :meth:`rms_in`) and sum."""
        hit = self._active.get(node.outputs[0]) if node.op == "add_rms_norm" else None
        if hit is None:
            return False
        values[node.outputs[0]], values[node.outputs[1]] = hit.scaled, hit.sum
        return True

    def xpack(self, node, scheme):
        """The packed activations (int32 ``[6, K / 8]``) the producer stored for ``node``, an int4
        consumer reading the normed rows directly with this group, or None."""
        hit = self._active.get(node.inputs[0]) if node.inputs else None
        if hit is None or hit.packed is None or getattr(scheme, "group_size", None) != hit.group:
            return None
        from ..kernels.gemv import W_INT4, W_INT4_ZP, weight_kind
        return hit.packed if weight_kind(scheme) in (W_INT4, W_INT4_ZP) else None

    def rms_in(self, node):
        """The :class:`~..kernels.gemv.GemvRmsIn` a consumer GEMV applies, or None. A consumer may
        read the normed rows through an act-order gather (:mod:`.gather_carry`; the factor is per
        row, so it applies to the gathered rows alike)."""
        if not node.inputs:
            return None
        t = node.inputs[0]
        hit = self._active.get(t)
        if hit is None and t.producer is not None and t.producer.op == "gather":
            hit = self._active.get(t.producer.inputs[0])
        return None if hit is None else hit.rms_in


class _Carried(NamedTuple):
    """A launched site: the consumers' row scale, ``s · weight``, the sum, and the packed rows."""

    rms_in: object            # GemvRmsIn
    scaled: torch.Tensor
    sum: torch.Tensor
    packed: torch.Tensor | None
    group: int


def _pack_group(site: Site, values: dict, attrs: dict, k: int) -> int:
    """The int4 group of the site's consumers that read the normed rows directly (not through a
    gather), packed (:func:`.triton_backend.xpack_pays`), in the one-row loop's whole steps, if
    they share one; else 0."""
    from graphdsl.quant import parse_scheme

    from ..kernels.gemv import W_INT4, W_INT4_ZP, weight_kind
    from .triton_backend import xpack_pays
    groups = set()
    for c in site.consumers:
        cs = parse_scheme(attrs[c]["scheme"]) if c.op.startswith("quant") else None
        if c.inputs[0] is site.norm.outputs[0] and weight_kind(cs) in (W_INT4, W_INT4_ZP) \
                and k % cs.group_size == 0 and xpack_pays(c.op == "quant_linear_silu_mul", values[c.inputs[1]]):
            groups.add(cs.group_size)
    return groups.pop() if len(groups) == 1 else 0


def _launch(be, site: Site, values: dict, attrs: dict, storage: dict, carry: NormCarry):
    """Check the run-time conditions and launch the producer; a :class:`_Carried` or None."""
    from graphdsl.quant import parse_scheme

    from ..kernels.gemv import GemvRmsIn, GemvRmsOut, gemv, gemv_supported, packs_rows
    p, b = site.producer, site.norm
    ins = [values[t] for t in p.inputs]
    x = ins[0]
    from .triton_backend import _kernel_unsupported
    if x.dim() != 2 or not (x.device.type == "cuda" or triton_interprets()):
        return None
    quant = p.op == "quant_linear"
    scheme = parse_scheme(attrs[p]["scheme"]) if quant else None
    w = ins[1]
    kind = _kind(scheme)
    runs = _gguf_producer(x, ins[1:], scheme, attrs[p]["out_features"]) if kind == "gguf" \
        else gemv_supported(x, w, scheme)
    if not runs or kind not in KINDS:
        return None
    m = x.shape[0]
    residual, g = values[b.inputs[1 - site.y_input]], values[b.inputs[2]]
    n = residual.shape[-1]
    if residual.shape != (m, n) or residual.dtype != x.dtype or residual.stride(-1) != 1 or g.shape != (n,) \
            or g.dtype != x.dtype or not g.is_contiguous() or b.outputs[0].dtype != x.dtype:
        return None
    scaled, part, aside = carry._buffers_for(site.slot, x.device, m, n, x.dtype)
    s_dst = storage.get(b.outputs[1])
    read = ins if be.gather_rows is None else ins + [be.gather_rows.x]    # act-order: x read through perm
    if s_dst is None or tuple(s_dst.shape) != (m, n) or s_dst.dtype != x.dtype or s_dst.stride(-1) != 1 \
            or any(overlaps(s_dst, t) for t in read) or (overlaps(s_dst, residual) and (
                s_dst.data_ptr() != residual.data_ptr() or s_dst.stride() != residual.stride())):
        if not site.sum_aside or overlaps(aside, residual):    # (the last site on the slot: done with it)
            return None
        s_dst = aside           # the planner reused a dying input's memory: its readers get this buffer
    for c in site.consumers:
        cins = [scaled] + [values[t] for t in c.inputs[1:]]     # the rows are not made yet
        quant_c = c.op.startswith("quant")
        cs = parse_scheme(attrs[c]["scheme"]) if quant_c else None
        dst = storage.get(c.outputs[0])
        runs = _gguf_consumer(scaled, cins[1:], c.op) if _kind(cs) == "gguf" else gemv_supported(scaled, cins[1], cs)
        if not runs or (dst is not None and dst.stride(-1) != 1) \
                or (quant_c and _kernel_unsupported(c, cins) is not None):
            return None
    if kind == "gguf":
        return _launch_gguf(be, site, p, ins, scheme, residual, g, scaled, part, s_dst, attrs, carry)
    group = _pack_group(site, values, attrs, n) if PACK and m == 1 else 0
    packed = carry._packed_for(site.slot, x.device, n) if group and packs_rows(x, w, scheme, group) else None
    rms_out = GemvRmsOut(g, scaled, part, packed, group if packed is not None else 0)
    if quant:
        stored = ins[1:]
        rows, perm = be.gather_rows, None          # act-order: x read through the gather's index
        if rows is not None:
            x, perm = rows.x.reshape(-1, rows.x.shape[-1]), rows.index
        gemv(x, stored[0], residual, out=s_dst, workspace=be.gemv_workspace, scheme=scheme, scales=stored[1],
             zeros=stored[2] if len(stored) > 2 else None, rms_out=rms_out, perm=perm)
    else:
        gemv(x, w, residual, out=s_dst, workspace=be.gemv_workspace, rms_out=rms_out)
    return _Carried(GemvRmsIn(part, n, float(attrs[b]["eps"])), scaled, s_dst, packed, rms_out.pack_group)


def _kind(scheme) -> str:
    """``"float"`` (fp16/bf16), ``"int8"``, ``"int4"``, ``"fp8"`` (weight-only or W8A8) or ``"gguf"``:
    the GEMV's weight kind."""
    from ..gguf_scheme import GGUFMixScheme, GGUFScheme
    from ..kernels.gemv import W_FP8, W_FP8_A8, W_INT4, W_INT4_ZP, W_INT8, weight_kind
    if isinstance(scheme, (GGUFScheme, GGUFMixScheme)):
        return "gguf"
    return {W_INT8: "int8", W_INT4: "int4", W_INT4_ZP: "int4", W_FP8: "fp8",
            W_FP8_A8: "fp8"}.get(weight_kind(scheme), "float")


def _gguf_producer(x: torch.Tensor, stored: list, scheme, n: int) -> bool:
    """Whether a GGUF projection of ``x`` can carry the norm: one fp16/bf16 row, one part, run on the
    tensor cores (its epilogue writes the norm's operands), of whole super-blocks of outputs."""
    from ..kernels.gguf_linear import mma_eligible
    parts = scheme.row_parts(n)
    if x.shape[0] != 1 or len(parts) != 1 or len(stored) != 1 or n % 256 or x.stride(-1) != 1:
        return False
    (qtype, _, _), = parts
    return qtype in ("Q4_K", "Q6_K") and mma_eligible(x, stored[0], qtype)


def _gguf_consumer(rows: torch.Tensor, stored: list, op: str) -> bool:
    """Whether a GGUF projection reading ``rows`` runs its decode GEMVs on them (each part applies
    the norm's factor; ``triton_backend._quant_linear``)."""
    from ..kernels.gguf_linear import MAX_GEMV_ROWS
    return op in ("quant_linear", "quant_linear_silu_mul") and 1 <= rows.shape[0] <= MAX_GEMV_ROWS \
        and rows.stride(-1) == 1 and all(t.is_contiguous() for t in stored)


def _launch_gguf(be, site: Site, p, ins: list, scheme, residual, g, scaled, part, s_dst, attrs, carry):
    """Launch a GGUF producer with the norm in its tensor-core epilogue; with the A operand of
    ``s · weight`` for the consumers that run a Q4_K part on the tensor cores (handed to them through
    the backend's ``_planes_ready``)."""
    from graphdsl.quant import parse_scheme

    from ..kernels.gemv import GemvRmsIn, GemvRmsOut
    from ..kernels.gguf_linear import gguf_gemv
    from .triton_backend import _planes_for, _planes_takers
    n = residual.shape[-1]
    readers = [c for c in site.consumers
               if c.op.startswith("quant") and _kind(parse_scheme(c.attrs["scheme"])) == "gguf"]
    takers = _planes_takers(be, readers, scaled)
    planes = carry._planes_for(site.slot, scaled.device, n) if takers else None
    (qtype, _, _), = scheme.row_parts(n)
    gguf_gemv(ins[0], ins[1], qtype, residual, out=s_dst, workspace=be.gemv_workspace,
              planes=_planes_for(be._planes_ready.pop(p, None), ins[0], ins[1], qtype),
              rms_out=GemvRmsOut(g, scaled, part, planes=planes))
    be._planes_ready.update(dict.fromkeys(takers, planes))
    return _Carried(GemvRmsIn(part, n, float(attrs[site.norm]["eps"])), scaled, s_dst, None, 0)

