"""Triton GEMV for decode: ``out = x @ w.T (+ add)`` for a few rows ``x`` (M <= 16).

At decode batch sizes a projection reads its whole weight ``w [N, K]`` to produce a handful of
rows, so the op is bound by the bytes of ``w`` and by how many of them are in flight. The kernel:

* **Tiles.** Program ``(n, s)`` owns ``BLOCK_N`` output columns and the ``s``-th of ``SPLIT_K``
  equal slices of K. It streams its ``[BLOCK_N, K / SPLIT_K]`` slab of ``w`` in
  ``[BLOCK_N, BLOCK_K]`` tiles (contiguous along K) and multiplies each by the matching
  ``[16, BLOCK_K]`` slice of the rows (M padded to 16 with masked loads) with ``tl.dot``, so the
  compiler software-pipelines the weight loads ``num_stages`` deep through shared memory, which is
  what keeps enough bytes in flight. Accumulation is float32.
* **Split-K without a second launch** (:mod:`.splitk`). With ``SPLIT_K > 1`` each program writes its
  float32 partial tile (one row: its ``[BLOCK_N]`` sums) to a workspace and bumps the tile's
  arrival counter (a release/acquire atomic); the program that arrives last sums the ``SPLIT_K``
  partials *in slice order* (so results do not depend on arrival order), several slices' loads
  in flight at once, applies the epilogue, stores, and resets the counter to 0 for the next
  launch (so CUDA-graph replays need no memset).
* **Epilogue**: ``+ add`` — a bias ``[N]`` or a residual ``[M, N]``; or, with ``silu_mul``, SwiGLU
  over a packed ``[gate | up]`` weight: each tile's rows are the gate and up rows of half as many
  output columns, interleaved, so one stream feeds both and the epilogue writes ``silu(g) * u``.
  With ``lora`` (``HAS_LORA``, the fused ``matmul_lora`` / ``matmul_add_lora`` /
  ``matmul_silu_mul_lora`` ops) each row's LoRA term ``Σ_r v[m, r]·B[n, s, r]`` joins the float32
  tile first (``v``: the float32 split-K partials of the BGMV shrink launched just before, summed;
  ``s``: the row's adapter slot, ``< 0`` none; for SwiGLU tile rows map back to their gate or up
  row of ``B``) — in :func:`_finish`, so the K loop is the base engine's, and with split-K the
  program that finishes the tile adds it once.
* **An RMSNorm carried between two GEMVs** (``rms_out`` / ``rms_in``, :class:`GemvRmsOut`,
  :class:`GemvRmsIn`; used by ``runtime/backends/norm_carry.py``): a residual GEMV also stores
  ``ŷ · weight`` and each row's sums of ``ŷ²`` per 32 columns, and the next GEMV, reading
  ``ŷ · weight``, multiplies its sums by ``rsqrt(Σ ŷ² / N + eps)``, so the norm needs no launch.
* **Quantized weights** (``scheme=``, the weight-only schemes of :mod:`graphdsl.quant`;
  ``WKIND``): int8 / fp8 codes are exact in fp16/bf16 and enter ``tl.dot`` as loaded, the row
  scale multiplying the float32 sums before the epilogue; one row runs CUDA-core FMAs instead —
  int4 over nibbles OR-ed into the mantissa of 1.0 (:func:`.gemv_loops._int4_step_float`), fp8 over
  codes shifted into float32 bits (:func:`.gemv_loops._fp8_row_loop`) —, more int4 rows ``tl.dot``
  over 16-bit magic-number nibble planes (:func:`.gemv_loops._int4_k_loop`): no conversion instructions (1/8 of the FMA
  rate on Hopper) on the one-row paths. One int4 row takes integer dot products by default
  (``INT_DOT``, :func:`.gemv_loops._int4_step_dp4a`: activations in 16-bit fixed point per group, four ``dp4a``
  a word; faster on the H200 than the float loop); with ``xpack`` it reads those bytes made
  before (:mod:`.int4_acts`, or stored by the producer of a carried norm: :class:`GemvRmsOut`)
  instead of making them. These loops are bound by their instructions: they read 16-bit
  activations four to an int64 load (``X_WIDE``) and chain the ``dp4a`` of four words
  (``benchmarks/loop_sass.py`` counts them). int4 codes may come in blocks of 128 inputs
  (``scheme.blocked``, ``w [K / 128, N, 64]``: ``KB``, :func:`.gemv_loops._kb_words`), the layout a CUDA bind
  stores: a step of many rows then reads one contiguous piece (8B int4 step 2068 -> 1943 µs on an
  H200). Launches: :func:`_pick_quant_config`, :func:`_pick_xpack_config`.
* **fp8 with dynamic activation scales** (W8A8, ``W_FP8_A8``): each row's scale
  ``max|x_row| / 448`` first (:func:`_a8_row_scales`, the whole row read before the K loop), then
  every K step rounds its activation tile times ``1 / scale`` to e4m3 (:func:`_to_e4m3`) and
  multiplies it with the codes on the e4m3 tensor cores; the epilogue applies both scales. The
  codes are :func:`graphdsl.quant.quantize_fp8_rows`' bit for bit. Launch: :func:`_pick_a8_config`.
* **PDL** (:mod:`.pdl`): on Hopper the kernel may launch while its predecessor finishes. A grid of
  more programs than SMs lets the next kernel launch only once its programs are past the K loop:
  launched at the usual point (when its last wave starts), the next kernel's programs take each SM
  its tail frees and idle there, which cost the Llama-3-8B step 4144 -> 4303 µs once the down
  projection followed the gate/up GEMV directly (H200, in-model A/B; every GEMV late: 4246).
  Before its wait each program asks L2 for the first K steps of its weight slab
  (:func:`.pdl.prefetch_l2`; weights are written by no kernel of a step), so the loop after the wait
  starts on L2 hits while the previous kernel was finishing: 1-2% of a batch-1 step (H100 A/B,
  ``_PREFETCH_STEPS``). Before the late launch above this was measured slower.

Tried on the H200 and measured slower, so not kept (docs/performance-log.md has the figures): loading
the rows through a prologue (RMSNorm, SwiGLU computed while loading; loads that do not feed the
dot directly are not software-pipelined, so each K step waits for them); loading the first weight
tile into registers before the PDL wait (the one-row int4 loop too: 8B int4 step 2.95 vs 2.87 ms;
fp8 2.93 vs 2.94, within noise); issuing the whole pipeline prologue before the wait (a wait
inside the loop keeps Triton from pipelining it at all); a SwiGLU epilogue
with two streams (each program streaming its gate rows, then the matching up rows); and an
add+RMSNorm epilogue (the last program to finish a tile normalising the whole rows): each saves a
launch but serialises more than the launch cost.

File shape (STYLE.md 11): the ``@triton.jit`` kernel with its epilogue (the quantized K loops it
calls are in :mod:`.gemv_loops`), the launch heuristics :func:`_pick_config` / :func:`_pick_quant_config`, the split-K
:class:`GemvWorkspace`, the public wrapper :func:`gemv`.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError
from graphdsl.quant import INT4_BLOCK_BYTES, code_rows

from ..device import triton_interprets
from .gemv_loops import (_f12, _f16, _fp8_row_loop, _int4_k_loop, _int4_loads, _int4_row,
                         _int4_step_dp4a, _int4_step_dp4a_quads, _int4_step_float, _kb_words, _pack_tile, _x_quad_loads)
from .pdl import hopper, pdl_launch, pdl_trigger, pdl_wait, prefetch_l2
from .splitk import arrive, depart, sum_partials
from .tp_carry import GemvPush, GemvTPIn, carry_args, push_tile, sum_norm_rows

__all__ = ["gemv", "gemv_supported", "packs_rows", "GemvWorkspace", "GemvLoRA", "GemvRmsOut", "GemvRmsIn", "GemvPush",
           "GemvTPIn", "MAX_ROWS", "weight_kind"]

MAX_ROWS = 16
# _pick_config's constants (benchmarks/decode_ab.py patches them for in-model A/B; on the H200 each
# alternative was slower in the model: _WIDE_K 128, _STAGES 4 or 3, _SPLIT_BELOW 2, _MIN_SPLIT_STEPS 4)
_WIDE_K = 256              # K step of grids of at most half the SMs' tiles
_STAGES = 5                # software-pipeline depth
_SPLIT_BELOW = 4           # split K when the tiles cover less than 1/_SPLIT_BELOW of the SMs ...
_MIN_SPLIT_STEPS = 8       # ... into slices of at least this many K steps
_DTYPES = (torch.float16, torch.bfloat16)
# weight kinds (``WKIND``): plain fp16/bf16, then the schemes of graphdsl.quant (W_FP8_A8: fp8 with dynamic
# activation scales, the only one that quantizes the activations too)
W_FLOAT, W_INT8, W_INT4, W_INT4_ZP, W_FP8, W_FP8_A8 = 0, 1, 2, 3, 4, 5
# quantized tiles (benchmarks/quant.py --sweep, H200, weights from HBM): see _pick_quant_config
_QUANT_BLOCK_N = 64
_QUANT_STAGES = 4
# one int4 row through integer dot products (_int4_step_dp4a) instead of float FMAs (_int4_step_float):
# faster on the H200 (benchmarks/quant.py --sweep; _pick_quant_config), False for the A/B
_INT4_INT_DOT = True
# one int4 row through integer dots: each step's scales and (X_WIDE) activations loaded in the shape and layout of
# the accumulator's quads (_int4_loads SC_QUAD, _x_quad_loads), so the loop converts no layout through shared
# memory (12 BAR.SYNC a step before, none after; sm_90 SASS, benchmarks/loop_sass.py). In-model A/B (H200, µs a
# batch-1 step, two builds each): 8B int4 2080 -> 2041 (the scales alone, which clears the packed gate/up loop:
# 2050), 1B int4 631 -> 620. False for the A/B
_QUADS = True
# the one-row int4 and fp8 loops read their activations as int64 words, four 16-bit inputs each, where
# aligned (_int4_loads, _fp8_row_loop): fewer instructions in loops bound by them. In-model A/B (H200, µs a
# batch-1 step, two builds each): int4 8B 2194 -> 2156, 1B 677 -> 640 (with the planes' stride below). False: the A/B
_X_WIDE = True
_CONFIG_KEYS = {"BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages", "INT_DOT"}
# K steps of each program's weight slab prefetched into L2 before the PDL wait (pdl.prefetch_l2; 0: none):
# fp16/bf16 weights, and the int4 / fp8 one-row loops by weight kind. In-model A/B on an H100
# (benchmarks/decode_ab.py, µs a batch-1 step, none -> 1 / 2 / 4 steps): 8B bf16 5615 -> 5545 / 5554,
# 1B bf16 1139 -> 1134 / 1117 / 1151; 8B int4 2859 -> 2836 / 2829 / 2904, fp8 3549 -> 3511 / 3585 / 3692
_PREFETCH_STEPS = 2
_PREFETCH_STEPS_QUANT = {W_INT4: 2, W_INT4_ZP: 2, W_FP8: 1}
# a carried RMSNorm (GemvRmsIn / GemvRmsOut): its partials and residual read before the K loop, not after
_RMS_EARLY = True
# fp8 with dynamic activation scales (W8A8) through this GEMV (W_FP8_A8) rather than quant_linear's
# dequantize-in-GEMM kernel (False: the A/B); _pick_a8_config's pipeline depth for 256-code K steps
_A8_GEMV = True
_A8_STAGES = 6


@triton.jit
def _lora_term(acc, p_ptr, b_ptr, idx_ptr, pid_n, M, N, LORA_S, LORA_R, LORA_SPLITS, SWIGLU: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    """``acc[i, m] += Σ_r v[m, r] · B[row(i), s, r]`` for every row ``m < M`` with slot
    ``s = idx[m] >= 0``, ``v[m] = Σ_j p[m, j]`` (the shrink's float32 split-K partials ``[M, splits,
    R]``), ``B [rows, S, R]``. ``row(i)`` is the weight row of tile row ``i``: ``pid_n · BLOCK_N + i``,
    or with ``SWIGLU`` gate row ``c`` / up row ``N + c`` of column ``c = pid_n · BLOCK_N / 2 + i // 2``
    (the K loop's interleave). The slots come in one vector load; per adapted row one
    ``[BLOCK_SPLITS, BLOCK_R]`` load of its partials and one ``[BLOCK_N, BLOCK_R]`` gather of B,
    independent of each other (a batch-1 step pays about one L2 round trip)."""
    i = tl.arange(0, BLOCK_N)
    if SWIGLU:
        col = pid_n * (BLOCK_N // 2) + i // 2
        row = col + (i % 2) * N
    else:
        col = pid_n * BLOCK_N + i
        row = col
    b_rows = b_ptr + row.to(tl.int64)[:, None] * (LORA_S * LORA_R)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < LORA_R
    b_ok = (col < N)[:, None] & r_ok[None, :]
    j = tl.arange(0, BLOCK_SPLITS)
    p_ok = (j < LORA_SPLITS)[:, None] & r_ok[None, :]
    rm = tl.arange(0, BLOCK_M)
    slots = tl.load(idx_ptr + rm, mask=rm < M, other=-1)
    for m in range(0, M):
        s = tl.sum(tl.where(rm == m, slots, 0), axis=0).to(tl.int64)
        if s >= 0:
            part = tl.load(p_ptr + (m * LORA_SPLITS + j)[:, None] * LORA_R + r[None, :], mask=p_ok, other=0.0)
            b = tl.load(b_rows + s * LORA_R + r[None, :], mask=b_ok, other=0.0).to(tl.float32)
            term = tl.sum(b * tl.sum(part, axis=0)[None, :], axis=1)
            acc += tl.where(rm[None, :] == m, term[:, None], 0.0)
    return acc


@triton.jit
def rin_tile(rin_ptr, rm, m_ok, RIN_CHUNKS, RIN_BLOCK: tl.constexpr, CG: tl.constexpr = False):
    """A consumer's ``[RIN_BLOCK, BLOCK_M]`` tile of its producer's partial sums (0 past the end);
    ``CG``: read from L2, past the SM's L1."""
    j = tl.arange(0, RIN_BLOCK)
    return tl.load(rin_ptr + rm[None, :] * RIN_CHUNKS + j[:, None], mask=(j < RIN_CHUNKS)[:, None] & m_ok[None, :],
                   other=0.0, cache_modifier=".cg" if CG else "")


@triton.jit
def rms_factor(rin_part, rin_inv_n, rin_eps):
    """The carried norm's ``[BLOCK_M]`` row factors ``rsqrt(Σ_j part[j, m] / n + eps)`` from a
    :func:`rin_tile` (:class:`GemvRmsIn`; the GGUF GEMVs compute it the same way)."""
    return tl.rsqrt(tl.sum(rin_part, axis=0) * rin_inv_n + rin_eps)


@triton.jit
def _finish(acc, add_ptr, out_ptr, pid_n, rm, m_ok, N, stride_am, stride_om, HAS_ADD: tl.constexpr,
            SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
            lora_p_ptr, lora_b_ptr, lora_idx_ptr, M, LORA_S, LORA_R, LORA_SPLITS,
            HAS_LORA: tl.constexpr, LORA_BLOCK_R: tl.constexpr, LORA_BLOCK_SPLITS: tl.constexpr,
            rms_g, rms_scaled_ptr, rms_part_ptr, RMS_CHUNKS, RMS_OUT: tl.constexpr,
            rin_part, rin_ptr, RIN_CHUNKS, rin_inv_n, rin_eps, RMS_IN: tl.constexpr, RIN_BLOCK: tl.constexpr,
            add_tile, EARLY: tl.constexpr, pack_ptr=None, PACK: tl.constexpr = False,
            PACK_GROUP: tl.constexpr = 128, push_ptrs=None, cnt_ptrs=None, calls_ptr=None, TP_REGION=0,
            PUSH: tl.constexpr = False, TP_W: tl.constexpr = 1, TP_RANK: tl.constexpr = 0,
            ON_GPU: tl.constexpr = False):
    """Store the transposed output tile ``acc [BLOCK_N, BLOCK_M]`` of column tile ``pid_n``:
    ``out[m, n] = acc[n, m] + add`` or, with ``SWIGLU``, ``out[m, c] = silu(g) * u`` where rows
    ``2i, 2i + 1`` of the tile hold gate and up of column ``c = pid_n * BLOCK_N / 2 + i``. g and u
    are rounded to the output dtype first and silu(g) after, as the matmul and ``silu_mul``
    kernels it replaces round them. With ``HAS_LORA`` each row's adapter term joins ``acc`` first
    (:func:`_lora_term`), before the add or the SwiGLU split.

    ``RMS_IN``: the rows are a producer's ``y · weight`` whose RMSNorm scale is still to come, so
    ``acc[:, m] *= rsqrt(Σ_j part[m, j] / n + eps)`` first (``part``: its ``RIN_CHUNKS`` sums of
    ``y²`` a row; ``rin_inv_n = 1 / n``). ``RMS_OUT`` (not with ``SWIGLU``): besides ``y`` (rounded
    to its dtype, ``ŷ``) also store ``ŷ · weight`` rounded, into ``[M, N]`` rows of ``N``, and the
    tile's float32 sums of ``ŷ²`` over each 32 columns into ``part[m, n // 32]`` (rows of
    ``RMS_CHUNKS``) — what the next GEMV's ``RMS_IN`` reads. ``rms_g``: the norm weight of the
    tile's columns, read before the PDL wait; with ``EARLY`` the kernel read ``rin_part`` (the
    partials) and, with ``RMS_OUT``, ``add_tile`` (the residual) before its K loop, so their
    latency hides behind it, else they are read here. ``PACK`` (with ``RMS_OUT``, one row): also
    store row 0's ``ŷ · weight`` as the next int4 GEMV's packed activations (:func:`_pack_tile`,
    groups of ``PACK_GROUP``; planes of ``N / 8`` words at ``pack_ptr``), so it needs no launch to
    make them. ``PUSH`` (a plain product): the tile goes to every rank's carry buffer instead of
    ``out`` (:func:`.tp_carry.push_tile`)."""
    if RMS_IN:
        if not EARLY:
            rin_part = rin_tile(rin_ptr, rm, m_ok, RIN_CHUNKS, RIN_BLOCK)
        acc = acc * rms_factor(rin_part, rin_inv_n, rin_eps)[None, :]
    if HAS_LORA:
        acc = _lora_term(acc, lora_p_ptr, lora_b_ptr, lora_idx_ptr, pid_n, M, N, LORA_S, LORA_R, LORA_SPLITS, SWIGLU,
                         BLOCK_N, BLOCK_M, LORA_BLOCK_R, LORA_BLOCK_SPLITS)
    if SWIGLU:
        HALF: tl.constexpr = BLOCK_N // 2
        gate, up = tl.split(tl.permute(tl.reshape(acc, [HALF, 2, BLOCK_M]), (0, 2, 1)))
        dt = out_ptr.dtype.element_ty
        gate = gate.to(dt).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
        y = act * up.to(dt).to(tl.float32)
        rn = pid_n * HALF + tl.arange(0, HALF)
    else:
        y = acc
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rn < N)[:, None] & m_ok[None, :]
    if HAS_ADD:
        if EARLY and RMS_OUT:
            a = add_tile
        else:
            a = tl.load(add_ptr + rm[None, :] * stride_am + rn[:, None], mask=mask, other=0.0)
        y += a.to(tl.float32)
    if PUSH:
        push_tile(y, mask, rm, rn, pid_n, N, out_ptr, push_ptrs, cnt_ptrs, calls_ptr, TP_REGION, BLOCK_N, TP_W, TP_RANK,
                  ON_GPU)
    else:
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], y.to(out_ptr.dtype.element_ty), mask=mask)
    if RMS_OUT:
        yr = tl.where(mask, y.to(out_ptr.dtype.element_ty).to(tl.float32), 0.0)
        scaled = (yr * rms_g.to(tl.float32)[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(rms_scaled_ptr + rm[None, :] * N + rn[:, None], scaled, mask=mask)
        if PACK:
            _pack_tile(tl.sum(tl.where((rm == 0)[None, :], scaled.to(tl.float32), 0.0), axis=1), pack_ptr, N // 8,
                       pid_n, N, BLOCK_N, PACK_GROUP)
        CH: tl.constexpr = BLOCK_N // 32
        sq = tl.sum(tl.reshape(yr * yr, [CH, 32, BLOCK_M]), axis=1)
        ch = pid_n * CH + tl.arange(0, CH)
        tl.store(rms_part_ptr + rm[None, :] * RMS_CHUNKS + ch[:, None], sq,
                 mask=(ch < RMS_CHUNKS)[:, None] & m_ok[None, :])


@triton.jit
def _a8_row_scales(x_ptr, rm, M, K, stride_xm, KP: tl.constexpr):
    """W8A8 (``W_FP8_A8``): the ``[BLOCK_M]`` per-row activation scales ``s = max(max_k |x[m, k]| / 448,
    1e-12)`` and their reciprocals, both correctly rounded, as :func:`graphdsl.quant.quantize_fp8_rows`
    makes them (rows past ``M``: ``1e-12``). One ``[KP]`` load a row (``KP``: ``K`` padded to a power
    of two), before the K loop."""
    kk = tl.arange(0, KP)
    amax = tl.zeros(rm.shape, tl.float32)
    for m in range(0, M):
        v = tl.load(x_ptr + m * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        amax = tl.where(rm == m, tl.max(tl.abs(v), axis=0), amax)
    s = tl.maximum(tl.math.div_rn(amax, tl.full(rm.shape, 448.0, tl.float32)), 1e-12)
    return s, tl.math.div_rn(tl.full(rm.shape, 1.0, tl.float32), s)


@triton.jit
def _scale_sums(acc, s_ptr, rn, n_ok, stride_sn, a8_s, WKIND: tl.constexpr):
    """The per-channel / per-tensor weight scale of int8 and fp8 on the ``[BLOCK_N, BLOCK_M]`` float32
    sums (``s_ptr``, ``stride_sn`` 0 for one scale), and for W8A8 each row's activation scale ``a8_s``
    too; other kinds are scaled inside their K loops and pass through."""
    if WKIND == 1 or WKIND == 4 or WKIND == 5:
        acc = acc * tl.load(s_ptr + rn.to(tl.int64) * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if WKIND == 5:
        acc = acc * a8_s[None, :]
    return acc


@triton.jit
def _to_e4m3(v, EMULATE: tl.constexpr):
    """``v`` (float32, ``|v| <= 448``) rounded to float8 e4m3 (to nearest, ties to even). The CPU
    interpreter's own cast drops the carry when rounding up crosses a power of two, so there it is
    rounded in float32 first: the 3-bit mantissa by adding half an ulp (plus the tie bit) to the raw
    bits, the subnormals (``|v| < 2^-6``, steps of ``2^-9``) by adding and subtracting ``2^14``."""
    if EMULATE:
        bits = v.to(tl.int32, bitcast=True)
        r = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        sub = tl.abs(v) < 0.015625
        t = (tl.abs(v) + 16384.0) - 16384.0
        t = tl.where(bits < 0, -t, t)                 # the sign kept, -0 included
        v = tl.where(sub, t, r)
    return v.to(tl.float8e4nv)


@triton.jit
def _gemv_kernel(
    x_ptr,          # [M, K] rows, last dim contiguous
    w_ptr,          # [N, K] weight, row-major contiguous (HF [out, in] layout); quantized: the codes
                    # ([N, K] int8 / fp8, or [N, K / 2] bytes of two int4 each, even k low)
    s_ptr,          # quantized: scales [N, K / GROUP] (int4) / [N, 1] or [1, 1] (int8, fp8); else unused
    z_ptr,          # W_INT4_ZP: zero points [N, K / GROUP]; else unused
    add_ptr,        # [M, N] residual / [N] bias (HAS_ADD) or unused
    out_ptr,        # [M, N] output, last dim contiguous
    part_ptr,       # [SPLIT_K, n_tiles, BLOCK_N, BLOCK_M] float32 partial tiles (SPLIT)
    lock_ptr,       # [n_tiles] int32 arrival counters, zero between launches (SPLIT)
    M, N, K, SPLIT_K, K_SPLIT,   # sizes (N: output columns); K_SPLIT = K elements per slice (a multiple of BLOCK_K)
    N2, W_ROW, K_SPLIT_W,        # one-row loops: weight rows, int32 words a row (K / 8 int4, K / 4 fp8), a slice
    stride_xm, stride_am, stride_om, stride_sn,
    M12, M16, M0F,               # 0xF000, 0xF0000: the int4 row loop's nibble masks (_f12, _f16); 0x0F0F0F0F
    WKIND: tl.constexpr,         # W_FLOAT, W_INT8, W_INT4, W_INT4_ZP, W_FP8 or W_FP8_A8 (module constants)
    GROUP: tl.constexpr,         # int4: inputs per scale (a divisor or a multiple of BLOCK_K)
    ONE_ROW: tl.constexpr,       # M == 1, int4 (BLOCK_K a multiple of GROUP, EVEN_K) or fp8 (EVEN_K): the CUDA-core
                                 # loops (_int4_row, _fp8_row_loop) over int32 words of W_ROW a row
    ONE_PART_ROW: tl.constexpr,  # SPLIT and M == 1: the partials are [BLOCK_N] row sums, not padded tiles
    HAS_ADD: tl.constexpr,
    SWIGLU: tl.constexpr,        # w is [2N, K] = [gate | up]; out = silu(x @ gate.T) * (x @ up.T)
    SPLIT: tl.constexpr,         # SPLIT_K > 1
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,        # K % BLOCK_K == 0
    EVEN_N: tl.constexpr,        # N % (output columns per tile) == 0
    DOT_F32: tl.constexpr,       # the CPU interpreter's dot mishandles bfloat16: multiply in float32
    USE_PDL: tl.constexpr,       # launched with programmatic dependent launch (kernels/pdl.py)
    LATE_LAUNCH: tl.constexpr,   # let the next kernel launch after the K loop, not after the wait
    lora_p_ptr,     # HAS_LORA: [M, LORA_SPLITS, LORA_R] float32 shrink partials (kernels/lora.py); else unused
    lora_b_ptr,     # HAS_LORA: [rows of w, LORA_S, LORA_R] B factors, scaling folded in; else unused
    lora_idx_ptr,   # HAS_LORA: [M] int32 adapter slot of each row (< 0: none); else unused
    LORA_S, LORA_R, LORA_SPLITS,  # slots, slot width, shrink K slices
    rms_w_ptr, rms_scaled_ptr, rms_part_ptr, RMS_CHUNKS,  # RMS_OUT: norm weight [N], y·weight [M, N], Σy² [M, chunks]
    rin_ptr, RIN_CHUNKS, rin_inv_n, rin_eps,              # RMS_IN: the producer's Σy² [M, chunks], 1 / n, eps
    perm_ptr,       # PERM: int32 [K], input k of the int4 groups is x[:, perm[k]] (act-order); else unused
    HAS_LORA: tl.constexpr = False,     # add each row's LoRA term in the epilogue (_lora_term)
    LORA_BLOCK_R: tl.constexpr = 16,    # LORA_R padded to a power of two >= 16
    LORA_BLOCK_SPLITS: tl.constexpr = 2,  # LORA_SPLITS padded to a power of two >= 2
    INT_DOT: tl.constexpr = False,      # one int4 row: integer dot products (_int4_step_dp4a), not float FMAs
    EMULATE: tl.constexpr = False,      # the CPU interpreter: dp4a as byte arithmetic
    XPACK: tl.constexpr = False,        # one int4 row: x_ptr holds the activations' packed bytes (.int4_acts)
    PREFETCH: tl.constexpr = 0,         # fp16/bf16 weights and the one-row loops: 128-byte lines a row
                                        # prefetched into L2 before the PDL wait (pdl.prefetch_l2)
    RMS_OUT: tl.constexpr = False,      # also store y·weight and Σy² per 32 columns (_finish; GemvRmsOut)
    RMS_IN: tl.constexpr = False,       # scale each row's sums by its RMSNorm factor first (_finish; GemvRmsIn)
    RIN_BLOCK: tl.constexpr = 1,        # RIN_CHUNKS padded to a power of two
    RMS_EARLY: tl.constexpr = True,     # read the partials / residual of RMS_IN / RMS_OUT before the K loop
    PERM: tl.constexpr = False,         # int4: the activations read through perm_ptr
    X_WIDE: tl.constexpr = False,       # one int4 / fp8 row: the 16-bit activations read as int64 words (aligned)
    pack_ptr=None,                      # PACK: int32 [6, N / 8], the next int4 GEMV's packed activations
    PACK: tl.constexpr = False,         # RMS_OUT, one row: also store row 0's y·weight packed (_pack_tile)
    PACK_GROUP: tl.constexpr = 128,     # PACK: the int4 group of the GEMV that reads it
    A8_KP: tl.constexpr = 16,           # W_FP8_A8: K padded to a power of two (the row-scale pass's width)
    QUADS: tl.constexpr = False,        # one int4 row, integer dots: operands loaded in the accumulator's layout
    KB: tl.constexpr = False,           # int4 codes stored in blocks of 128 inputs (scheme.blocked, _kb_words)
    # a tensor-parallel all-reduce carried by the GEMVs around it (.tp_carry): PUSH, the producer's tiles to every
    # rank's buffer (push_ptrs, cnt_ptrs: int64 [TP_W] pointers); TP_IN, the consumer's rows made first from the
    # ranks' partials in its own buffer (tp_buf_ptr, tp_cnt_ptr), the residual, the norm weight (sum to tp_sum_ptr);
    # calls_ptr: this rank's int64 [2] call numbers; TP_REGION: elements of a (slot, rank) region
    push_ptrs=None, cnt_ptrs=None, calls_ptr=None, TP_REGION=0, PUSH: tl.constexpr = False,
    tp_buf_ptr=None, tp_cnt_ptr=None, tp_res_ptr=None, tp_g_ptr=None, tp_sum_ptr=None, tp_stride_rm=0,
    tp_stride_sm=0, tp_eps=0.0, TP_IN: tl.constexpr = False, TP_W: tl.constexpr = 1, TP_RANK: tl.constexpr = 0,
    TP_BLOCK: tl.constexpr = 16,        # TP_IN: K padded to a power of two (a program holds a row)
    ON_GPU: tl.constexpr = False,       # PUSH / TP_IN: system-scope release / acquire (else the interpreter's atomics)
):
    """out[m, n] = sum_k x[m, k] * w[n, k] (+ add[m, n]), float32 accumulation. With ``SWIGLU`` the
    tile's rows are the gate and up rows of ``BLOCK_N / 2`` output columns, interleaved (row ``2i``
    is gate row ``c``, row ``2i + 1`` up row ``N + c``), so one slab stream feeds both halves."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = tl.arange(0, BLOCK_N)
    if SWIGLU:
        col = pid_n * (BLOCK_N // 2) + r // 2
        n_ok = col < N
        rn = col + (r % 2) * N
    else:
        rn = pid_n * BLOCK_N + r
        n_ok = rn < N
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    INT4: tl.constexpr = WKIND == 2 or WKIND == 3
    x_rows = x_ptr + rm[:, None] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    w_lo = pid_k * K_SPLIT_W                        # the one-row loops' slice, in int32 words of W_ROW a row
    w_hi = tl.minimum(w_lo + K_SPLIT_W, W_ROW)
    if PREFETCH > 0 and USE_PDL:       # the slab's first lines into L2 while the previous kernel ends
        if ONE_ROW and KB:             # the first block of the slice: its rows' lines lie side by side
            prefetch_l2(w_ptr + tl.minimum(rn, N2 - 1).to(tl.int64)[:, None] * 16,
                        (w_lo // 16) * N2 * 16, N2 * W_ROW + N2 * 16, 1, 32)
        elif ONE_ROW:
            prefetch_l2(w_ptr + tl.minimum(rn, N2 - 1).to(tl.int64)[:, None] * W_ROW, w_lo, w_hi, PREFETCH, 32)
        elif WKIND == 0 or WKIND == 5:
            prefetch_l2(w_ptr + tl.minimum(rn, N2 - 1).to(tl.int64)[:, None] * K, k_lo, k_hi, PREFETCH,
                         1024 // w_ptr.dtype.element_ty.primitive_bitwidth)
    if RMS_OUT:                        # the norm weight: no kernel of a step writes it
        rms_g = tl.load(rms_w_ptr + rn, mask=n_ok, other=0.0)
    else:
        rms_g = 0.0
    pdl_wait(USE_PDL, not LATE_LAUNCH)
    if TP_IN:                          # the rows: every rank's partials summed, + residual, normalised
        sum_norm_rows(x_ptr, stride_xm, M, K, tp_buf_ptr, tp_cnt_ptr, calls_ptr, tp_res_ptr, tp_stride_rm, tp_g_ptr,
                      tp_sum_ptr, tp_stride_sm, tp_eps, TP_REGION, (pid_n == 0) & (pid_k == 0), TP_W, TP_BLOCK,
                      ON_GPU)
    if RMS_IN and RMS_EARLY:           # read now, used after the K loop (_finish)
        rin_part = rin_tile(rin_ptr, rm, m_ok, RIN_CHUNKS, RIN_BLOCK)
    else:
        rin_part = 0.0
    if RMS_OUT and RMS_EARLY and HAS_ADD:
        add_tile = tl.load(add_ptr + rm[None, :] * stride_am + rn[:, None], mask=n_ok[:, None] & m_ok[None, :],
                           other=0.0)
    else:
        add_tile = 0.0
    if WKIND == 5:                     # W8A8: each row's activation scale, from all of its K inputs
        a8_s, a8_inv = _a8_row_scales(x_ptr, rm, M, K, stride_xm, A8_KP)
    else:
        a8_s = 1.0
    if INT4 and ONE_ROW:
        row = _int4_row(x_ptr, w_ptr, s_ptr, z_ptr, rn, N2, w_lo, w_hi, W_ROW, stride_sn,
                        M12, M16, M0F, BLOCK_N, WKIND == 3, GROUP, BLOCK_K // GROUP, INT_DOT, EMULATE, XPACK,
                        W_ROW, perm_ptr, PERM, X_WIDE, QUADS, KB)
        acc = tl.where((rm == 0)[None, :], row[:, None], 0.0)
    elif WKIND == 4 and ONE_ROW:
        row = _fp8_row_loop(x_ptr, w_ptr, rn, N2, w_lo, w_hi, W_ROW, BLOCK_N,
                            BLOCK_K // 4, X_WIDE) * 1.329227995784916e36          # 2^120
        acc = tl.where((rm == 0)[None, :], row[:, None], 0.0)
    elif INT4:
        acc = _int4_k_loop(acc, x_rows, w_ptr, s_ptr, z_ptr, rn, n_ok, m_ok, k_lo, k_hi, K, stride_sn,
                           WKIND == 3, GROUP, BLOCK_K, DOT_F32, perm_ptr, PERM, KB, N2)
    else:
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + rk
            if EVEN_K and EVEN_N:
                w = tl.load(w_rows + kk[None, :])
                a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
            else:
                w_ok = n_ok[:, None] & (kk < K)[None, :]
                if WKIND == 5:      # (read as bytes: masked lanes 0, a float8 zero)
                    w = tl.load(w_rows + kk[None, :], mask=w_ok, other=0)
                elif WKIND == 4:      # fp8 has no literal zero for ``other``: zero masked lanes after the cast
                    w = tl.where(w_ok, tl.load(w_rows + kk[None, :], mask=w_ok).to(tl.float32), 0.0)
                else:
                    w = tl.load(w_rows + kk[None, :], mask=w_ok, other=0.0)
                a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            if WKIND == 5:      # W8A8: the rows quantized as quantize_fp8_rows does, then e4m3 tensor cores
                w = w.to(tl.float8e4nv, bitcast=True)            # (the codes come as bytes: w_ptr is uint8)
                aq = _to_e4m3(a.to(tl.float32) * a8_inv[:, None], EMULATE)
                if EMULATE:
                    acc += tl.dot(w.to(tl.float32), tl.trans(aq.to(tl.float32)))
                else:
                    acc += tl.dot(w, tl.trans(aq))
            elif DOT_F32:
                acc += tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)))
            else:
                acc += tl.dot(w.to(a.dtype), tl.trans(a))     # int8 / fp8 e4m3 codes are exact in fp16/bf16
    if LATE_LAUNCH:
        pdl_trigger(USE_PDL)
    if SPLIT:
        n_tiles = tl.num_programs(0)
        rt = tl.arange(0, BLOCK_N)
        if ONE_PART_ROW:        # one row: store and sum its [BLOCK_N] sums, not the padded tile
            if ONE_ROW:
                part_row = row
            else:
                part_row = tl.sum(tl.where((rm == 0)[None, :], acc, 0.0), axis=1)
            slab = part_ptr + rt
            tl.store(slab + (pid_k * n_tiles + pid_n).to(tl.int64) * BLOCK_N, part_row)
        else:
            slab = part_ptr + rt[:, None] * BLOCK_M + rm[None, :]
            tl.store(slab + (pid_k * n_tiles + pid_n).to(tl.int64) * (BLOCK_N * BLOCK_M), acc)
        if arrive(lock_ptr, pid_n, SPLIT_K):
            acc = sum_partials(slab, pid_n, n_tiles, SPLIT_K, BLOCK_N, BLOCK_M, ONE_PART_ROW, rm)
            depart(lock_ptr, pid_n)
            acc = _scale_sums(acc, s_ptr, rn, n_ok, stride_sn, a8_s, WKIND)
            _finish(acc, add_ptr, out_ptr, pid_n, rm, m_ok, N, stride_am, stride_om, HAS_ADD, SWIGLU, BLOCK_N,
                    BLOCK_M, lora_p_ptr, lora_b_ptr, lora_idx_ptr, M, LORA_S, LORA_R, LORA_SPLITS, HAS_LORA,
                    LORA_BLOCK_R, LORA_BLOCK_SPLITS, rms_g, rms_scaled_ptr, rms_part_ptr, RMS_CHUNKS, RMS_OUT,
                    rin_part, rin_ptr, RIN_CHUNKS, rin_inv_n, rin_eps, RMS_IN, RIN_BLOCK,
                    add_tile, RMS_EARLY, pack_ptr, PACK, PACK_GROUP, push_ptrs, cnt_ptrs, calls_ptr, TP_REGION, PUSH,
                    TP_W, TP_RANK, ON_GPU)
    else:
        acc = _scale_sums(acc, s_ptr, rn, n_ok, stride_sn, a8_s, WKIND)
        _finish(acc, add_ptr, out_ptr, pid_n, rm, m_ok, N, stride_am, stride_om, HAS_ADD, SWIGLU, BLOCK_N, BLOCK_M,
                lora_p_ptr, lora_b_ptr, lora_idx_ptr, M, LORA_S, LORA_R, LORA_SPLITS, HAS_LORA, LORA_BLOCK_R,
                LORA_BLOCK_SPLITS, rms_g, rms_scaled_ptr, rms_part_ptr, RMS_CHUNKS, RMS_OUT,
                rin_part, rin_ptr, RIN_CHUNKS, rin_inv_n, rin_eps, RMS_IN, RIN_BLOCK,
                add_tile, RMS_EARLY, pack_ptr, PACK, PACK_GROUP, push_ptrs, cnt_ptrs, calls_ptr, TP_REGION, PUSH, TP_W,
                TP_RANK, ON_GPU)


def _prefetch_lines(kind: int, one_row: bool, block_k: int, k_split: int) -> int:
    """128-byte lines a weight row that :func:`.pdl.prefetch_l2` asks for: the first ``_PREFETCH_STEPS``
    (the quantized one-row loops: ``_PREFETCH_STEPS_QUANT[kind]``) K steps of the slice, rounded up
    to a power of two (0: no prefetch; the other quantized paths take none)."""
    if kind in (W_FLOAT, W_FP8_A8):
        steps, bits = _PREFETCH_STEPS, 16 if kind == W_FLOAT else 8
    elif one_row:
        steps, bits = _PREFETCH_STEPS_QUANT.get(kind, 0), 4 if kind in (W_INT4, W_INT4_ZP) else 8
    else:
        return 0
    nbytes = min(steps * block_k, k_split) * bits // 8
    return 0 if nbytes == 0 else _pow2(-(-nbytes // 128))


def _check_xpack(xpack: torch.Tensor, m: int, k: int, kind: int, group: int) -> None:
    want = (6, k // 8)
    if kind not in (W_INT4, W_INT4_ZP) or m != 1 or k % group:
        raise GraphDSLError(f"gemv: xpack is for one row of an int4 weight, got {m} rows, weight kind {kind}")
    if tuple(xpack.shape) != want or xpack.dtype != torch.int32 or not xpack.is_contiguous():
        raise GraphDSLError(f"gemv: xpack must be a contiguous int32 {list(want)} (pack_int4_activations of x), got "
                            f"{xpack.dtype} {list(xpack.shape)}")


def _check_perm(perm: torch.Tensor, k: int, kind: int, packed: bool, device: torch.device) -> None:
    if kind not in (W_INT4, W_INT4_ZP) or packed:
        raise GraphDSLError("gemv: perm is for int4 weights whose activations are not packed (an xpack holds them "
                            f"in perm's order already), got weight kind {kind}, xpack given: {packed}")
    if tuple(perm.shape) != (k,) or perm.dtype != torch.int32 or not perm.is_contiguous() or perm.device != device:
        raise GraphDSLError(f"gemv: perm must be a contiguous int32 [{k}] on {device}, got {perm.dtype} "
                            f"{list(perm.shape)} on {perm.device}")


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    """SM count of CUDA device ``index``, read once (every launch picks its config from it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pick_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """The launch for ``[m, k] @ [n, k].T``, from the H200 sweeps of ``benchmarks/gemv.py --sweep``
    (CUDA-graph replay, weights from HBM): 64-column tiles, five pipeline stages; 128-element K
    steps once there are more column tiles than half the SMs (Llama-3-8B qkv: 13.7 µs vs 15.8 with
    256), else 256 (8B o: 10.5 vs 11.6 µs). K is split (in one launch) only when the tiles cover
    less than a quarter of the SMs, into at most 4 slices of at least 8 steps each (Llama-3.2-1B's
    down projection, 32 tiles: 11.5 µs at split 4, 10.9 with 128-element steps); elsewhere the
    partial-tile round trip costs more than the extra parallelism brings (8B o: 11.2 µs at split 2
    vs 10.5 unsplit). Between one and four waves of tiles over a short K (<= 2048), 64-element
    steps (1B gate_up)."""
    sms = _num_sms(device)
    block_n = 64
    tiles = triton.cdiv(n, block_n)
    block_k = 128 if tiles > sms // 2 else _WIDE_K
    if sms < tiles <= 4 * sms and k <= 2048:
        block_k = 64                     # a few waves of short slabs (1B gate_up: 16.5 vs 16.9 µs)
    if k < 4 * block_k:
        block_k = max(16, min(128, _pow2(k)))
    steps = triton.cdiv(k, block_k)
    split = 1
    if tiles < sms // _SPLIT_BELOW:
        while split < 4 and steps // (split * 2) >= _MIN_SPLIT_STEPS:
            split *= 2
        if split > 1 and block_k > 128:  # split slices stream in 128-wide steps (1B down: 10.9 vs 11.4 µs)
            block_k = 128
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=_STAGES)


def _pick_a8_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """The launch for W8A8 fp8 (``W_FP8_A8``), from an H200 sweep of the Llama-3-8B projections (one
    row, CUDA-graph replay, weights from HBM; ``probe``-style, see docs/quantization-log.md): 64-column
    tiles; 256-code K steps six stages deep while the tiles fit one wave (qkv 10.55 µs; 512-code steps
    at four stages 10.96), 128-code steps four deep beyond (gate_up 34.9 µs; five stages 36.1); K split
    in two when the tiles cover at most half the SMs (o 8.2 µs against 9.4 unsplit with 512-code
    steps, down 20.4 against 25.4)."""
    sms = _num_sms(device)
    block_n = 64
    tiles = triton.cdiv(n, block_n)
    block_k = 128 if tiles > sms else 256
    block_k = max(32, min(block_k, _pow2(k)))
    split = 2 if tiles <= sms // 2 and k // (2 * block_k) >= 2 else 1
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4,
                num_stages=_A8_STAGES if block_k >= 256 else 4)


_INT4_PROGRAMS_PER_SM = 2    # one-row int4: K split until the grid has this many programs a SM


def _pick_quant_config(m: int, n: int, k: int, wkind: int, group: int, device: torch.device) -> dict:
    """The launch for a quantized weight, from the H200 sweeps of ``benchmarks/quant.py --sweep``
    (CUDA graphs over HBM-resident copies of the Llama-3-8B projections, one row).

    int4, one row: the integer-dot loop (:func:`_int4_step_dp4a`) with everything a step reads
    issued one step ahead (:func:`_int4_loads`), 256-row tiles, one group a step (``BLOCK_K`` =
    the group, at least 128: wider steps were slower), K split into as many slices as keep the grid
    within ``_INT4_PROGRAMS_PER_SM`` (two) programs a SM — any count, not only powers of two, so
    the grid fills the SMs evenly: a one-row GEMV runs as long as its busiest SM (H200,
    ``benchmarks/gguf_gemv.py --busiest-sm``: a Q4_K GEMV of 396 tiles 19.7 µs, of 406 tiles 23.1),
    and with slices of powers of two the 8B qkv ran 192 programs (60 SMs with two, 72 with one) and
    the 1B down 128 (H200, decode_ab two builds: 8B int4 1942, 1941 -> 1916, 1918 µs with the qkv
    in 11 slices; 1B 606, 604 -> 584, 585 with the down in 32). The sweeps of powers of two before
    that: qkv 9.2 µs at split 8, o 7.2 at 16, gate_up 30.2 at 2, down 15.6 at 16 (47% of copy on
    gate_up and down; the float loop with the same prefetch: 9.4, 7.5, 35.4, 18.4).
    Before the prefetch both loops ran at 10.0-11.0, 7.3-7.7, 33-34 and 17.4-18.0 µs: the
    scale load inside the step stalled it by a memory latency. With the step's operands loaded in
    the accumulator's layout (``_QUADS``: :func:`_int4_step_dp4a_quads`) the same launches stayed
    best in the model (128-row tiles, or up to four programs a SM, slower; docs/performance-log.md), and
    again with the codes in blocks (``KB``: 8B step 1937 µs; within four a SM 1982, within one 2149,
    128-row tiles 2127; docs/quantization-log.md).

    int4, more rows (the ``tl.dot`` path): 128-row tiles, K split until there are about four
    programs per SM, 256-input steps while the split is at most 4 (else 128).

    fp8, one row (the CUDA-core :func:`_fp8_row_loop`): 32-row tiles when 64-row ones would
    outnumber half the SMs, K split while the grid stays within four programs a SM, 512-input
    steps when the K is split into slices of at least four of them, else 256 (qkv 11.2 µs at 32
    rows / split 2 / 512, against 12.7 at 256; o 8.5 and down 20.5 at 64 / split 8 / 256, where
    512 gave 12.2 and 29.7; gate_up 35.6 at 32 / unsplit / 256, 39.6 at 512: 47-78% of copy).

    fp8 / int8, more rows (the ``tl.dot`` path): 64-row tiles, 128-input steps, 3 stages, K split
    up to 16 while the programs stay within about 12 a SM and each slice keeps 2 steps (one-row
    timings from before the row loop: qkv 14.6 µs at split 16 vs 16.2 at split 8 with 4 stages;
    o 11.2 vs 12.3; gate_up 49.8 at split 2 vs 57.4 unsplit; down 26.2 at split 16 vs 32.5 at
    split 8 with 256-input steps)."""
    sms = _num_sms(device)
    if wkind in (W_INT4, W_INT4_ZP) and m == 1 and k % max(group, 128) == 0:    # the one-row loops
        block_n, block_k = 256, max(group, 128)
        tiles = triton.cdiv(n, block_n)
        split = max(1, min(k // block_k, _INT4_PROGRAMS_PER_SM * sms // tiles))
        return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=2, INT_DOT=_INT4_INT_DOT)
    if wkind in (W_INT4, W_INT4_ZP):
        block_n = 128
        tiles = triton.cdiv(n, block_n)
        split = 1
        while split < 16 and tiles * split < 4 * sms and k // (split * 2) >= max(group, 128):
            split *= 2
        block_k = 256 if split <= 4 and k // split >= 256 and 256 % group == 0 else max(group, 128)
        return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=_QUANT_STAGES)
    if wkind == W_FP8 and m == 1 and k % 256 == 0:     # the CUDA-core row loop (_fp8_row_loop)
        block_n = 32 if triton.cdiv(n, 64) > sms // 2 else 64
        tiles = triton.cdiv(n, block_n)
        split = 1
        while split < 16 and tiles * split * 2 <= 4 * sms and k // (split * 2) >= 512:
            split *= 2
        wide = split > 1 and k % (split * 512) == 0 and k // split >= 2048
        return dict(BLOCK_N=block_n, BLOCK_K=512 if wide else 256, SPLIT_K=split, num_warps=4, num_stages=3)
    block_n = _QUANT_BLOCK_N
    block_k = 128
    while block_k > 32 and k % block_k:
        block_k //= 2
    tiles = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    split = 1
    while split < 16 and tiles * split * 2 <= 12 * sms and steps // (split * 2) >= 2:
        split *= 2
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=3)


def _pick_xpack_config(n: int, k: int, group: int, device: torch.device) -> dict:
    """One int4 row with packed activations (``xpack``): with no activation bytes to make, a program
    has the registers for 64-row tiles of two groups a step (H200, the probe in docs/quantization-log.md:
    gate_up 23.5 µs against 30.3 for the 256-row, one-group loop); K split while the grid stays
    within two programs a SM, as the one-row loop's."""
    block_n = 64
    block_k = 2 * group if k % (2 * group) == 0 else group
    tiles = triton.cdiv(n, block_n)
    split = 1
    while split < 16 and tiles * split * 2 <= 2 * _num_sms(device) and k // (split * 2) >= block_k:
        split *= 2
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=2, INT_DOT=True)


def weight_kind(scheme) -> int | None:
    """``WKIND`` of a :mod:`graphdsl.quant` scheme the GEMV runs (``None``: it cannot: int4 groups
    under 64 inputs — a nibble plane of a group must give ``tl.dot`` 16 inputs —, foreign block
    formats; ``quant_linear``'s kernel takes those). fp8 with dynamic activation scales is
    ``W_FP8_A8``: the rows are quantized in the kernel and multiply the codes on e4m3 tensor cores."""
    from graphdsl.quant import Fp8Scheme, IntScheme
    if scheme is None:
        return W_FLOAT
    if isinstance(scheme, IntScheme):
        if scheme.bits == 8 and scheme.group_size is None:
            return W_INT8
        if scheme.bits == 4 and scheme.group_size is not None and scheme.group_size % 64 == 0:
            return W_INT4_ZP if scheme.zero_point else W_INT4
        return None
    if isinstance(scheme, Fp8Scheme):
        return (W_FP8_A8 if _A8_GEMV else None) if scheme.dynamic_activations else W_FP8
    return None


class GemvLoRA(NamedTuple):
    """The LoRA term :func:`gemv` adds in its epilogue: ``partials [M, splits, R]`` float32 from
    :func:`~graphdsl.runtime.kernels.lora.lora_shrink` (launched just before), ``b [rows of w, S, R]``
    (contiguous, w's dtype) and ``indices [M]`` int32 (``< 0``: no adapter)."""

    partials: torch.Tensor
    b: torch.Tensor
    indices: torch.Tensor


def _check_lora(lora: GemvLoRA, m: int, n: int, dtype: torch.dtype) -> None:
    p, b, idx = lora
    ok = (p.dim() == 3 and p.shape[0] == m and p.shape[2] == b.shape[-1] and p.dtype == torch.float32
          and p.is_contiguous() and b.dim() == 3 and b.shape[0] == n and b.dtype == dtype and b.is_contiguous()
          and idx.shape == (m,) and idx.dtype == torch.int32 and idx.is_contiguous())
    if not ok:
        raise GraphDSLError(f"gemv: lora needs contiguous partials [{m}, splits, R] float32, b [{n}, S, R] {dtype} and "
                            f"indices [{m}] int32, got partials {list(p.shape)} {p.dtype}, b {list(b.shape)} {b.dtype}, "
                            f"indices {list(idx.shape)} {idx.dtype}")


class GemvWorkspace:
    """Split-K scratch for :func:`gemv` (and the GGUF GEMVs): per (device, tiles, slices, tile
    size) one float32 partial buffer and one zeroed counter array, allocated on first use and kept
    (a captured CUDA graph holds their addresses). Kernels run one at a time on a stream leave the
    counters at zero, so one workspace serves every GEMV of an engine."""

    def __init__(self):
        self._buffers: dict = {}

    def get(self, device: torch.device, n_tiles: int, split: int, block_n: int, beside: bool = False,
            rows: int = MAX_ROWS):
        """``(partials, counters)`` for a launch of ``n_tiles`` x ``split`` programs of ``block_n`` x
        ``rows`` tiles; ``beside``: a GEMV that runs beside another (:func:`.gguf_linear.gguf_gemv`)
        gets buffers no sequential launch shares."""
        key = (str(device), n_tiles, split, block_n, beside, rows)
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = self._buffers[key] = (
                torch.empty(split * n_tiles * block_n * rows, dtype=torch.float32, device=device),
                torch.zeros(n_tiles, dtype=torch.int32, device=device))
        return bufs

    def planes(self, device: torch.device, k: int):
        """The int8 activation planes ``[16, k]`` and two ``[k / 32]`` float32 vectors of the one-row
        GGUF tensor-core GEMV (:func:`.gguf_mma.activation_planes`), one set per (device, k): each
        GEMV rewrites them before reading, one at a time on a stream."""
        from .gguf_mma import empty_planes
        key = ("planes", str(device), k)
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = self._buffers[key] = empty_planes(k, device)
        return bufs

    def q6k_planes(self, device: torch.device, k: int):
        """The int8 activation planes ``[16, k]`` and the ``[k / 16]`` float32 ``a_s`` of the one-row
        Q6_K tensor-core GEMV (:func:`.gguf_mma_q6k.q6k_activation_planes`), one set per (device, k)."""
        key = ("q6k_planes", str(device), k)
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = self._buffers[key] = (torch.empty(16, k, dtype=torch.int8, device=device),
                                         torch.empty(k // 16, dtype=torch.float32, device=device))
        return bufs

    def rows_planes(self, device: torch.device, k: int):
        """The rows' operands and ``a_m``, ``S_ms`` of the several-row GGUF tensor-core GEMV
        (:func:`.gguf_mma_rows.empty_rows_planes`: room for 32 rows), one set per (device, k)."""
        from .gguf_mma_rows import empty_rows_planes
        key = ("rows_planes", str(device), k)
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = self._buffers[key] = empty_rows_planes(k, device)
        return bufs

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for bufs in self._buffers.values() for t in bufs)


class GemvRmsOut(NamedTuple):
    """The next projection's RMSNorm, prepared by a residual GEMV ``y = x @ w.T + residual`` whose
    output feeds ``rms_norm(y, weight)`` and then only GEMVs: besides ``y`` its epilogue stores
    ``scaled = ŷ · weight`` (``ŷ``: y rounded to its dtype; rounded again) and ``partials[m, j] =
    Σ ŷ[m, n]²`` over the columns ``32j <= n < 32j + 32``. Since ``rms_norm(y, w) ≈ (ŷ · w) · r``
    with ``r = rsqrt(Σ_n ŷ² / N + eps)`` a row, the next GEMV reads ``scaled`` and multiplies its
    sums by ``r`` (:class:`GemvRmsIn`): the norm's own launch goes. (The norm's reference rounds
    ``ŷ · r`` before the weight; this rounds ``ŷ · w`` instead: the same error, another place.)"""

    weight: torch.Tensor     # [N], y's dtype
    scaled: torch.Tensor     # [M, N] contiguous, y's dtype
    partials: torch.Tensor   # [M, cdiv(N, 32)] contiguous float32
    # one row: ``scaled`` also as the packed activations of the int4 GEMV that reads it next
    # (int32 [6, N / 8], .int4_acts; its ``xpack``) for int4 groups of ``pack_group`` inputs;
    # the tiles must hold whole groups (:func:`packs_rows`)
    packed: torch.Tensor | None = None
    pack_group: int = 0
    # one row, a GGUF tensor-core producer (:func:`.gguf_linear.gguf_gemv`): ``scaled`` also as the
    # Q4_K tensor-core A operand of the GEMVs that read it next (three buffers: ``[16, N]`` int8,
    # ``a_s`` and ``S_s`` ``[N / 32]`` float32, :func:`.gguf_mma.activation_planes` of ``scaled``)
    planes: tuple | None = None


class GemvRmsIn(NamedTuple):
    """The RMSNorm factor still owed to ``x`` (a producer's :class:`GemvRmsOut` ``scaled``):
    ``out = (x @ w.T) · rsqrt(Σ_j partials[m, j] / n + eps)`` per row, before the epilogue."""

    partials: torch.Tensor   # [M, cdiv(n, 32)] contiguous float32
    n: int                   # the normalised row length (the producer's N, this GEMV's K)
    eps: float


RMS_CHUNK = 32               # columns a GemvRmsOut partial sums


def _rms_args(rms_out: GemvRmsOut | None, rms_in: GemvRmsIn | None, m: int, n: int, k: int, block_n: int,
              silu_mul: bool, out: torch.Tensor) -> dict:
    """The kernel's RMS_OUT / RMS_IN arguments (pointers to ``out`` where unused), each checked."""
    args = dict(rms_w_ptr=out, rms_scaled_ptr=out, rms_part_ptr=out, RMS_CHUNKS=1, RMS_OUT=False,
                rin_ptr=out, RIN_CHUNKS=1, rin_inv_n=1.0, rin_eps=0.0, RMS_IN=False, RIN_BLOCK=1,
                RMS_EARLY=_RMS_EARLY, pack_ptr=out, PACK=False, PACK_GROUP=128)
    if rms_out is not None:
        w, scaled, part, packed, group = rms_out[:5]
        chunks = check_rms_out("gemv", rms_out, m, n, block_n, silu_mul, out)
        if rms_out.planes is not None:
            raise GraphDSLError("gemv: rms_out.planes (a Q4_K A operand) is written by the GGUF tensor-core GEMVs "
                                "(gguf_linear.gguf_gemv), not by this GEMV")
        if packed is not None:
            if m != 1 or group < 8 or group & (group - 1) or block_n % group or n % group:
                raise GraphDSLError(f"gemv: rms_out.packed needs one row and tiles of whole groups, got {m} rows, "
                                    f"pack_group {group}, BLOCK_N {block_n}, N {n}")
            if tuple(packed.shape) != (6, n // 8) or packed.dtype != torch.int32 or not packed.is_contiguous() \
                    or packed.device != out.device:
                raise GraphDSLError(f"gemv: rms_out.packed must be a contiguous int32 [6, {n // 8}] on {out.device}, "
                                    f"got {packed.dtype} {list(packed.shape)} on {packed.device}")
            args.update(pack_ptr=packed, PACK=True, PACK_GROUP=group)
        args.update(rms_w_ptr=w, rms_scaled_ptr=scaled, rms_part_ptr=part, RMS_CHUNKS=chunks, RMS_OUT=True)
    if rms_in is not None:
        args.update(rms_in_args("gemv", rms_in, m, k))
    return args


def check_rms_out(fn: str, rms_out: GemvRmsOut, m: int, n: int, block_n: int, silu_mul: bool,
                  out: torch.Tensor) -> int:
    """Check a producer's :class:`GemvRmsOut` against its product ``out [m, n]`` in tiles of ``block_n``
    columns; returns the partial sums a row (``cdiv(n, 32)``)."""
    chunks = triton.cdiv(n, RMS_CHUNK)
    if silu_mul or block_n % RMS_CHUNK:
        raise GraphDSLError(f"{fn}: rms_out needs a plain product in tiles of a multiple of {RMS_CHUNK} columns, "
                            f"got silu_mul={silu_mul}, BLOCK_N {block_n}")
    for name, t, shape, dtype in (("weight", rms_out.weight, (n,), out.dtype),
                                  ("scaled", rms_out.scaled, (m, n), out.dtype),
                                  ("partials", rms_out.partials, (m, chunks), torch.float32)):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != out.device:
            raise GraphDSLError(f"{fn}: rms_out.{name} must be a contiguous {list(shape)} {dtype} on "
                                f"{out.device}, got {list(t.shape)} {t.dtype} on {t.device}")
    return chunks


def rms_in_args(fn: str, rms_in: GemvRmsIn, m: int, k: int) -> dict:
    """A consumer's ``RMS_IN`` launch keywords (``rin_ptr``, ``RIN_CHUNKS``, ``rin_inv_n``, ``rin_eps``,
    ``RIN_BLOCK``; this GEMV's and the GGUF ones'), ``rms_in`` checked against its rows ``[m, k]``."""
    part, rn, eps = rms_in
    chunks = triton.cdiv(k, RMS_CHUNK)
    if rn != k or tuple(part.shape) != (m, chunks) or part.dtype != torch.float32 or not part.is_contiguous():
        raise GraphDSLError(f"{fn}: rms_in needs n = K = {k} and contiguous partials [{m}, {chunks}] float32, got "
                            f"n {rn}, partials {list(part.shape)} {part.dtype}")
    return dict(rin_ptr=part, RIN_CHUNKS=chunks, rin_inv_n=1.0 / k, rin_eps=float(eps), RMS_IN=True,
                RIN_BLOCK=_pow2(chunks))


def _lora_args(lora: GemvLoRA | None, dummy: torch.Tensor) -> dict:
    """The kernel's LoRA arguments (pointers to ``dummy`` and ``HAS_LORA=False`` without ``lora``)."""
    if lora is None:
        return dict(lora_p_ptr=dummy, lora_b_ptr=dummy, lora_idx_ptr=dummy, LORA_S=1, LORA_R=1, LORA_SPLITS=1,
                    HAS_LORA=False)
    p, b, idx = lora
    from .lora import block_r_of
    return dict(lora_p_ptr=p, lora_b_ptr=b, lora_idx_ptr=idx, LORA_S=b.shape[1], LORA_R=b.shape[2],
                LORA_SPLITS=p.shape[1], HAS_LORA=True, LORA_BLOCK_R=block_r_of(b.shape[2]),
                LORA_BLOCK_SPLITS=max(2, triton.next_power_of_2(p.shape[1])))


def gemv_supported(x: torch.Tensor, w: torch.Tensor, scheme=None) -> bool:
    """Whether :func:`gemv` takes these operands (the backend uses cuBLAS, or the quantized GEMM,
    otherwise). ``scheme``: ``w`` holds the codes of that :mod:`graphdsl.quant` scheme."""
    if not (x.dim() == 2 and w.dim() in (2, 3) and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES
            and w.is_contiguous() and x.stride(1) == 1):
        return False
    kind = weight_kind(scheme)
    if kind is None:
        return False
    if w.dim() == 3 and kind not in (W_INT4, W_INT4_ZP):
        return False
    if kind == W_FLOAT:
        return w.dtype == x.dtype and x.shape[1] == w.shape[1]
    if kind in (W_INT4, W_INT4_ZP):
        k = x.shape[1]
        stored = (-(-k // 128), -1, INT4_BLOCK_BYTES) if scheme.blocked else (-1, k // 2)
        return (w.dtype == torch.uint8 and w.dim() == len(stored) and k % scheme.group_size == 0
                and all(s in (-1, d) for s, d in zip(stored, w.shape)))
    if kind == W_FP8_A8 and x.device.type == "cuda" and not hopper(x.device):
        return False            # no e4m3 tensor cores for W8A8 before Hopper: quant_linear's kernel takes it
    return w.shape[1] == x.shape[1]


def packs_rows(x: torch.Tensor, w: torch.Tensor, scheme, group: int) -> bool:
    """Whether :func:`gemv` of these operands (no ``config``, no ``silu_mul``) can store its
    :class:`GemvRmsOut` rows packed for int4 groups of ``group``: one row, and tiles of whole groups."""
    if not gemv_supported(x, w, scheme) or x.shape[0] != 1 or group < 8 or group & (group - 1):
        return False
    kind = weight_kind(scheme)
    m, k = x.shape
    n = code_rows(w)
    wgroup = scheme.group_size if kind in (W_INT4, W_INT4_ZP) else 1
    cfg = _pick_config(m, n, k, x.device) if kind == W_FLOAT else _pick_quant_config(m, n, k, kind, wgroup, x.device)
    return n % group == 0 and cfg["BLOCK_N"] % group == 0


def gemv(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None, *, silu_mul: bool = False,
         out: torch.Tensor | None = None, workspace: GemvWorkspace | None = None,
         config: dict | None = None, scheme=None, scales: torch.Tensor | None = None,
         zeros: torch.Tensor | None = None, lora: GemvLoRA | None = None,
         xpack: torch.Tensor | None = None, rms_out: GemvRmsOut | None = None,
         rms_in: GemvRmsIn | None = None, perm: torch.Tensor | None = None, push: GemvPush | None = None,
         tp_in: GemvTPIn | None = None) -> torch.Tensor:
    """``x @ w.T (+ add)`` for ``x [M <= 16, K]`` and ``w [N, K]`` of one dtype (fp16/bf16); ``add``
    is a bias ``[N]`` or a residual ``[M, N]``. With ``silu_mul``, ``w`` is a packed ``[gate | up]``
    ``[2I, K]`` and the result is ``silu(x @ gate.T) * (x @ up.T)`` ``[M, I]`` (the ``silu_mul`` op
    of the product, without writing the product). ``workspace`` holds split-K scratch (a private
    one is made per call if omitted); ``config`` overrides the launch heuristic (``BLOCK_N,
    BLOCK_K, SPLIT_K, num_warps, num_stages``; benchmarks sweep it).

    Quantized weights (``scheme``, a weight-only :mod:`graphdsl.quant` scheme): ``w`` holds the codes
    (``[N, K]`` int8 / fp8 e4m3, or ``[N, K/2]`` uint8 of two int4; a ``-kb`` int4 scheme's in blocks,
    ``[ceil(K/128), N, 64]``: :func:`graphdsl.quant.int4_blocks`), ``scales`` the scales
    (``[N, K/group]`` for int4, ``[N, 1]`` or ``[1, 1]`` per channel / tensor) and ``zeros`` int4's
    zero points: ``W = (q - z) * s`` dequantized in registers (:func:`_int4_k_loop`; 8-bit codes are
    exact in the activation dtype and the per-row scale multiplies the float32 sums).

    ``lora`` (:class:`GemvLoRA`): each row's adapter term ``Σ_r v[m, r]·B[n, s, r]`` joins the
    float32 sums before the add or SwiGLU (``B``'s rows are ``w``'s: with ``silu_mul`` the packed
    gate and up rows), added once per tile by the program that stores it.

    ``xpack``: for one row and an int4 weight, the row's activations already in the integer-dot
    loop's bytes (:func:`.int4_acts.pack_int4_activations` of ``x``, ``[6, K / 8]`` int32); the loop
    reads them instead of making them every step, with the launch of :func:`_pick_xpack_config`.
    The result is the same bits as without.

    ``rms_out`` (:class:`GemvRmsOut`) / ``rms_in`` (:class:`GemvRmsIn`): the RMSNorm between this
    GEMV and the next one carried by their epilogues instead of a launch of its own.

    ``perm`` (int4 act-order, contiguous int32 ``[K]``): the product of ``x[:, perm]``, read through
    ``perm`` instead of gathered first; the same bits as ``gemv(x[:, perm], ...)``. With ``xpack``
    the packed bytes are already in that order (``pack_int4_activations(x, group, perm=perm)``) and
    ``perm`` is not given again.

    ``push`` (:class:`.tp_carry.GemvPush`) / ``tp_in`` (:class:`.tp_carry.GemvTPIn`): a
    tensor-parallel all-reduce carried by this GEMV and the next (:mod:`.tp_carry`). With ``push``
    the product goes to every rank's carry buffer, not ``out`` (a plain product: no ``add``,
    ``silu_mul``, ``rms_out`` or ``lora``); with ``tp_in`` the kernel first makes its rows ``x``
    (scratch it writes) from the ranks' partials, the residual and the norm."""
    if not gemv_supported(x, w, scheme):
        want = "a contiguous w [N, K] of one dtype" if scheme is None else f"the codes of {scheme.name}"
        raise GraphDSLError(f"gemv: needs x [M<= {MAX_ROWS}, K] in {[str(d) for d in _DTYPES]} and {want}, got x "
                            f"{list(x.shape)} {x.dtype} strides {x.stride()}, w {list(w.shape)} {w.dtype} "
                            f"contiguous={w.is_contiguous()}")
    kind = weight_kind(scheme)
    if kind != W_FLOAT and (scales is None or not scales.is_contiguous()
                            or (kind == W_INT4_ZP and (zeros is None or not zeros.is_contiguous()))):
        raise GraphDSLError(f"gemv: scheme {scheme.name} needs contiguous scales"
                            + (" and zero points" if kind == W_INT4_ZP else ""))
    m, k = x.shape
    blocked = w.dim() == 3                       # int4 codes in blocks (scheme.blocked): [blocks, N, 64]
    n = code_rows(w)
    cols = n
    if silu_mul:
        if n % 2 or add is not None:
            raise GraphDSLError(f"gemv: silu_mul needs a packed [gate | up] weight with an even row count and no "
                                f"add, got w {list(w.shape)}, add {None if add is None else list(add.shape)}")
        cols = n // 2
    if out is None:
        out = torch.empty(m, cols, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (m, cols) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise GraphDSLError(f"gemv: out must be [{m}, {cols}] {x.dtype} with a contiguous last dim, got "
                            f"{list(out.shape)} {out.dtype} strides {out.stride()}")
    if add is not None and tuple(add.shape) not in ((n,), (m, n)):
        raise GraphDSLError(f"gemv: add must be a bias [{n}] or a residual [{m}, {n}], got {list(add.shape)}")
    if add is not None and add.stride(-1) != 1:
        raise GraphDSLError(f"gemv: add must have a contiguous last dim, got strides {add.stride()}")
    group = scheme.group_size if kind in (W_INT4, W_INT4_ZP) else 1
    if perm is not None:
        _check_perm(perm, k, kind, xpack is not None, x.device)
    if xpack is not None:
        _check_xpack(xpack, m, k, kind, group)
        config = config or _pick_xpack_config(n, k, group, x.device)
    cfg = dict(config or (_pick_config(m, n, k, x.device) if kind == W_FLOAT
                          else _pick_a8_config(m, n, k, x.device) if kind == W_FP8_A8
                          else _pick_quant_config(m, n, k, kind, group, x.device)))
    if config and (set(cfg) - _CONFIG_KEYS or {"BLOCK_N", "BLOCK_K", "SPLIT_K"} - set(cfg)):   # a caller's
        raise GraphDSLError(f"gemv: config takes BLOCK_N, BLOCK_K, SPLIT_K and optionally "
                            f"{sorted(_CONFIG_KEYS - {'BLOCK_N', 'BLOCK_K', 'SPLIT_K'})}, got {sorted(cfg)}")
    block_n, block_k, split = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K")
    steps = triton.cdiv(k, block_k)
    split = max(1, min(split, steps))
    k_split = triton.cdiv(steps, split) * block_k
    split = triton.cdiv(k, k_split)                  # no empty slices
    tile_cols = block_n // 2 if silu_mul else block_n
    n_tiles = triton.cdiv(cols, tile_cols)
    if split > 1:
        part, lock = (workspace or GemvWorkspace()).get(x.device, n_tiles, split, block_n)
    else:
        part = lock = out
    one_row = kind == W_FP8 and m == 1 and k % block_k == 0 and block_k % 4 == 0
    if one_row:
        w = w.view(torch.int32)                                  # four codes a word: _fp8_row_loop
    if kind in (W_INT4, W_INT4_ZP):
        if block_k % group and group % block_k:
            raise GraphDSLError(f"gemv: BLOCK_K {block_k} and the group size {group} must divide one another")
        one_row = m == 1 and block_k % group == 0 and k % block_k == 0     # whole steps of BLOCK_K / GROUP groups
        w = w.view(torch.int32 if one_row else torch.int16)      # nibbles a word: _int4_row / _int4_k_loop
    if xpack is not None and not (one_row and cfg.get("INT_DOT")):
        raise GraphDSLError(f"gemv: xpack needs the one-row integer-dot loop (BLOCK_K a multiple of the group "
                            f"{group} dividing K = {k}, INT_DOT), got the launch {dict(cfg, BLOCK_K=block_k)}")
    if kind == W_FP8_A8:
        w = w.view(torch.uint8)                                  # masked loads' 0 is a float8 zero
    per_word = 4 if kind == W_FP8 else 8                          # codes an int32 word holds (one-row loops)
    if lora is not None:
        _check_lora(lora, m, n, x.dtype)
    if push is not None and (add is not None or silu_mul or rms_out is not None or lora is not None):
        raise GraphDSLError("gemv: push takes a plain product (no add, silu_mul, rms_out or lora)")
    if tp_in is not None and (xpack is not None or rms_in is not None):
        raise GraphDSLError("gemv: tp_in makes the rows itself (no xpack or rms_in)")
    stride_am = 0 if add is None or add.dim() == 1 else add.stride(0)
    interpret = triton_interprets()
    s_t = scales if scales is not None else out
    stride_sn = 0 if kind == W_FLOAT or s_t.shape[0] == 1 else s_t.stride(0)
    _gemv_kernel[(n_tiles, split)](
        x if xpack is None else xpack, w, s_t, zeros if zeros is not None else s_t, add if add is not None else out,
        out, part, lock,
        m, cols, k, split, k_split, n, k // per_word, k_split // per_word, x.stride(0), stride_am, out.stride(0),
        stride_sn, 0xF000, 0xF0000, 0x0F0F0F0F, WKIND=kind, GROUP=group, ONE_ROW=one_row, ONE_PART_ROW=split > 1 and m == 1,
        LATE_LAUNCH=n_tiles * split > _num_sms(x.device),
        HAS_ADD=add is not None, SWIGLU=silu_mul, SPLIT=split > 1, BLOCK_M=MAX_ROWS, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, EVEN_N=cols % tile_cols == 0,
        DOT_F32=x.dtype == torch.bfloat16 and interpret, EMULATE=interpret,
        PREFETCH=0 if interpret else _prefetch_lines(kind, one_row, block_k, k_split), XPACK=xpack is not None,
        perm_ptr=perm if perm is not None else out, PERM=perm is not None,
        X_WIDE=_X_WIDE and xpack is None and perm is None and x.stride(-1) == 1 and x.data_ptr() % 8 == 0,
        A8_KP=_pow2(k) if kind == W_FP8_A8 else 16, QUADS=_QUADS, KB=blocked,
        **pdl_launch(x.device),
        **_lora_args(lora, out), **_rms_args(rms_out, rms_in, m, cols, k, block_n, silu_mul, out),
        **carry_args(push, tp_in, x, out, x.is_cuda), **cfg)
    return out
