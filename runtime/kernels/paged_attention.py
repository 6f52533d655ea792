"""Triton kernels for ``paged_attention``: varlen causal prefill and split-K flash-decoding.

Semantics (``graphdsl.functional.attention.paged_attention``, whose torch reference defines them):
sequence ``s`` has context length ``L = seq_lens[s]`` (including this step's tokens) and ``n`` new
queries, packed in ``q[query_start_loc[s] : query_start_loc[s + 1]]``; query ``i`` sits at position
``p = L - n + i`` and attends over the cached keys ``0..p`` (only those with ``k > p - window``
when ``sliding_window`` is set)::

    score[k] = q · key[k] * scale                 (float32)
    score[k] = cap * tanh(score[k] / cap)         (when soft_cap = cap > 0)
    score[k] = score[k] + m_h * (k - p)           (ALiBi: slope m_h of query head h, when given)
    out      = sum_k softmax(score)[k] * value[k]  (float32, stored in q's dtype)

Matrix products multiply q's dtype exactly into float32 accumulators (float32 inputs as 3xTF32,
~1e-6 relative); the probabilities enter ``P·V`` rounded to q's dtype, as in flash-attention.
One addition to the reference: a sequence with no visible key (``seq_lens[s] == 0``, a padded
decode slot of a CUDA-graph batch) gets a zero output where the reference's softmax gives NaN.

Query head ``h`` reads KV head ``h // (num_heads / num_kv_heads)`` (GQA). Key/value ``k`` of
sequence ``s`` lives in block ``block_tables[s, k // block_size]`` at offset ``k % block_size`` of
the caches ``[num_blocks, block_size, num_kv_heads, head_dim]``.

Both kernels are GQA-aware: one program serves all ``group = num_heads / num_kv_heads`` query heads
of one KV head, so each K/V tile is loaded once per group. The softmax is the online (flash)
softmax in base 2: scores are scaled by ``log2(e)`` and exponentiated with ``exp2``; a running max
``m`` starts at ``-1e30`` (finite, so a row whose tile is fully masked gets weight ``exp2(-inf) = 0``
and never ``inf - inf``).

* prefill (:func:`paged_attention_prefill`): grid ``(kv_heads, num_tokens // BLOCK_Q + num_seqs)``,
  tiles taken in reverse order (heaviest causal tiles first).
  Sequence ``s`` owns tile indices ``[b_s, b_s + cdiv(n_s, BLOCK_Q))`` with
  ``b_s = query_start_loc[s] // BLOCK_Q + s``; these ranges are disjoint and below the grid size, so
  a program finds its sequence by binary search over ``b`` without any host synchronisation. A tile
  holds ``BLOCK_Q`` queries x ``GROUP_PAD`` heads as its ``BLOCK_M`` rows.
* decode (:func:`paged_attention_decode`): one launch, grid ``(kv_heads, num_seqs, num_splits)`` (the
  KV heads of a sequence, whose keys share cache blocks, launch side by side: Llama-3.2-1B's batch-256
  step 3443 -> 3328 µs against sequences first, in-model A/B on an H100);
  split ``j`` covers a contiguous ``BLOCK_N``-aligned part of the keys ``[lo, L)`` and writes its
  unnormalised ``acc``, max ``m`` and sum ``l`` (float32); the last split of a (sequence, KV head)
  to finish (an arrival counter) combines them::

      M = max_j m_j,   out = sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) l_j

  (a context that fits one split's tiles is normalised and stored by that split alone). Fused
  with ``rope_cache`` (:class:`DecodeRopeCache`) it also rotates q and writes this step's key and
  value into the caches, saving a launch per layer.

File shape (STYLE.md 11): the ``@triton.jit`` kernels, one shared heuristic (:func:`_pick_config`)
used by the launchers, which check every argument and raise a :class:`GraphDSLError` naming it,
and the thin public wrappers. No autotuning: a CUDA-graph-captured engine must not benchmark on its
first call, so tile sizes come from the heuristic alone.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError
from graphdsl.functional.attention import RopeLayout

from .gguf_mma import sub_blocks_planes
from .pdl import pdl_launch, pdl_wait
from .rope import rope_coeffs

__all__ = ["paged_attention", "paged_attention_prefill", "paged_attention_decode", "decode_num_splits",
           "decode_widths", "decode_workspace", "DecodeWorkspace", "DecodeRopeCache"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _mm(a, b, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """``a @ b`` accumulated in float32; ``DOT_F32`` first upcasts both operands (set only under
    the CPU interpreter, whose bfloat16 ``tl.dot`` returns garbage in triton 3.9)."""
    if DOT_F32:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision=DOT_PREC)
    return r


@triton.jit
def _load_tile(table, kstart, stop, k_cache_ptr, v_cache_ptr, kvh, stride_kb, stride_ks, stride_kh, stride_vb,
               stride_vs, stride_vh, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               CHECK_STOP: tl.constexpr):
    """Keys and values ``[kstart, kstart + BLOCK_N)`` through the block table (zeros at ``>= stop``
    when ``CHECK_STOP``); returns ``(k, v, kpos)``."""
    dims = tl.arange(0, HEAD_DIM)
    kpos = kstart + tl.arange(0, BLOCK_N)
    if CHECK_STOP:
        kvalid = kpos < stop
        blk = tl.load(table + kpos // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
    else:
        blk = tl.load(table + kpos // BLOCK_SIZE).to(tl.int64)
    slot = kpos % BLOCK_SIZE
    k_ptrs = k_cache_ptr + (blk * stride_kb + slot * stride_ks + kvh * stride_kh)[:, None] + dims[None, :]
    v_ptrs = v_cache_ptr + (blk * stride_vb + slot * stride_vs + kvh * stride_vh)[:, None] + dims[None, :]
    if CHECK_STOP:
        k = tl.load(k_ptrs, mask=kvalid[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=kvalid[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return k, v, kpos


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k, v, kpos, qpos, slope, stop, scale, soft_cap, sliding_window,
                 USE_CAP: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, CHECK_STOP: tl.constexpr,
                 USE_ALIBI: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """One online-softmax step over the key tile ``k, v`` at positions ``kpos`` (see :func:`_attend`)."""
    sc = _mm(q, tl.trans(k), DOT_PREC, DOT_F32) * scale
    if USE_CAP:
        sc = soft_cap * (1.0 - 2.0 / (tl.exp2(sc * (2.0 * 1.4426950408889634 / soft_cap)) + 1.0))
    if USE_ALIBI:
        sc = sc + slope[:, None] * (kpos[None, :] - qpos[:, None]).to(tl.float32)
    sc = sc * 1.4426950408889634
    if CAUSAL:
        keep = kpos[None, :] <= qpos[:, None]
        if USE_WINDOW:
            keep = keep & (kpos[None, :] > qpos[:, None] - sliding_window)
        if CHECK_STOP:
            keep = keep & (kpos < stop)[None, :]
        sc = tl.where(keep, sc, float("-inf"))
    elif CHECK_STOP:
        sc = tl.where((kpos < stop)[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, DOT_PREC, DOT_F32)
    return acc, m_new, l_i


@triton.jit
def _attend(
    acc, m_i, l_i,      # running [ROWS, HEAD_DIM] output, [ROWS] max and [ROWS] sum (float32)
    q,                  # [ROWS, HEAD_DIM] queries of the program (their heads share one KV head)
    qpos,               # [ROWS] absolute position of each row's query (read when CAUSAL or USE_ALIBI)
    slope,              # [ROWS] float32 ALiBi slope of each row's head (read when USE_ALIBI)
    start, stop,        # key positions [start, stop) to visit, BLOCK_N at a time from start
    table,              # pointer to this sequence's block-table row
    k_cache_ptr, v_cache_ptr, kvh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    scale, soft_cap, sliding_window,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_CAP: tl.constexpr,      # soft-cap the scores
    CAUSAL: tl.constexpr,       # mask keys after qpos (and outside the window when USE_WINDOW)
    USE_WINDOW: tl.constexpr,
    CHECK_STOP: tl.constexpr,   # mask keys >= stop (the last tile may overhang)
    USE_ALIBI: tl.constexpr,    # add slope * (key position - query position)
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Online-softmax steps over keys ``[start, stop)``: for each tile of ``BLOCK_N`` keys (read
    through the block table) ``S = log2(e) * (cap * tanh(q kᵀ * scale / cap) + slope * (kpos - qpos))``
    (no tanh without a cap, no bias without ALiBi), masked to ``-inf``; ``m' = max(m, rowmax S)``, ``P = 2^(S - m')``,
    ``l = l 2^(m - m') + rowsum P``, ``acc = acc 2^(m - m') + P v``. Tiles wholly visible to every
    row skip the masks (``CAUSAL = CHECK_STOP = False``). ``tanh(x) = 1 - 2 / (e^(2x) + 1)``, exact at
    both tails."""
    for kstart in range(start, stop, BLOCK_N):
        k, v, kpos = _load_tile(table, kstart, stop, k_cache_ptr, v_cache_ptr, kvh, stride_kb, stride_ks, stride_kh,
                                stride_vb, stride_vs, stride_vh, BLOCK_SIZE, HEAD_DIM, BLOCK_N, CHECK_STOP)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, kpos, qpos, slope, stop, scale, soft_cap,
                                     sliding_window, USE_CAP, CAUSAL, USE_WINDOW, CHECK_STOP, USE_ALIBI, DOT_PREC,
                                     DOT_F32)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["soft_cap", "sliding_window", "num_seqs", "search_steps"])
def _prefill_kernel(
    q_ptr,              # [num_tokens, num_heads, head_dim] packed queries (head_dim contiguous)
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim] key cache
    v_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim] value cache
    out_ptr,            # [num_tokens, num_heads, head_dim] output, q's dtype
    block_tables_ptr,   # [num_seqs, max_blocks] int32/int64 cache block of each sequence's j-th block
    seq_lens_ptr,       # [num_seqs] context length L of each sequence, new tokens included
    qsl_ptr,            # [num_seqs + 1] query_start_loc: sequence s's queries are q[qsl[s]:qsl[s+1]]
    alibi_ptr,          # [num_heads] float32 ALiBi slopes (read only when USE_ALIBI)
    scale,              # float, multiplies q·k
    soft_cap,           # float, cap of cap*tanh(s/cap) (read only when USE_CAP)
    sliding_window,     # int, keep keys k > p - window (read only when USE_WINDOW)
    num_seqs,           # int, number of sequences
    search_steps,       # int, ceil(log2(num_seqs)): binary-search steps to find a tile's sequence (SEQ_VEC 0)
    stride_qt, stride_qh,              # q strides (tokens, heads), elements
    stride_ot, stride_oh,              # out strides (tokens, heads)
    stride_kb, stride_ks, stride_kh,   # key cache strides (block, slot, head)
    stride_vb, stride_vs, stride_vh,   # value cache strides (block, slot, head)
    stride_bt,                         # block_tables stride between sequences
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens per block)
    GROUP: tl.constexpr,       # query heads per KV head
    GROUP_PAD: tl.constexpr,   # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,    # head_dim (power of two)
    BLOCK_Q: tl.constexpr,     # queries per tile; the tile has BLOCK_Q * GROUP_PAD rows
    BLOCK_N: tl.constexpr,     # keys per inner step
    USE_CAP: tl.constexpr,     # soft_cap > 0
    USE_WINDOW: tl.constexpr,  # sliding_window > 0
    USE_ALIBI: tl.constexpr,   # add the ALiBi bias slope[head] * (key position - query position)
    DOT_PREC: tl.constexpr,    # tl.dot input_precision ("tf32x3" for float32 inputs)
    DOT_F32: tl.constexpr,     # upcast dot operands to float32 (interpreter only, see _mm)
    USE_PDL: tl.constexpr,     # launched with programmatic dependent launch (kernels/pdl.py)
    SEQ_VEC: tl.constexpr = 0,  # > 0: a power of two >= num_seqs: find the tile's sequence in one load
):
    """Rows ``r`` of tile ``t`` of sequence ``s``: query ``i = t * BLOCK_Q + r // GROUP_PAD``, head
    ``kvh * GROUP + r % GROUP_PAD``, position ``p = L - n + i``. Keys run over
    ``[lo, hi)`` with ``hi = min(L - n + (t + 1) * BLOCK_Q, L)`` (the tile's last query + 1) and
    ``lo = max(0, L - n + t * BLOCK_Q - window + 1)`` with a window (else 0), ``BLOCK_N`` at a time::

        m' = max(m, rowmax(S));  P = 2^(S - m');  l = l * 2^(m - m') + rowsum(P)
        acc = acc * 2^(m - m') + P V;  m = m'          and finally  out = acc / l
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    pdl_wait(USE_PDL)
    kvh = tl.program_id(0)
    # heaviest tiles (last queries of the last sequences) first: less tail imbalance under causality
    tile = tl.num_programs(1) - 1 - tl.program_id(1)

    # Sequence of this tile: the largest s with qsl[s] // BLOCK_Q + s <= tile (increasing in s).
    if SEQ_VEC > 0:        # every qsl[s] in one load: one L2 round trip instead of log2(num_seqs)
        s_all = tl.arange(0, SEQ_VEC)
        bases = tl.load(qsl_ptr + s_all, mask=s_all < num_seqs, other=0).to(tl.int32) // BLOCK_Q + s_all
        seq = tl.sum(((bases <= tile) & (s_all < num_seqs)).to(tl.int32), 0) - 1
    else:
        lo_s = tl.program_id(1) * 0
        hi_s = lo_s + num_seqs
        for _ in range(search_steps):
            mid = (lo_s + hi_s) // 2
            b_mid = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
            go_right = b_mid <= tile
            lo_s = tl.where(go_right, mid, lo_s)
            hi_s = tl.where(go_right, hi_s, mid)
        seq = lo_s
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    n_new = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    t = tile - (q_start // BLOCK_Q + seq)
    if t * BLOCK_Q < n_new:
        ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)
        rows = tl.arange(0, BLOCK_M)
        qi = t * BLOCK_Q + rows // GROUP_PAD
        g = rows % GROUP_PAD
        head = kvh * GROUP + g
        row_ok = (qi < n_new) & (g < GROUP)
        qpos = ctx - n_new + qi
        dims = tl.arange(0, HEAD_DIM)
        token = (q_start + qi).to(tl.int64)

        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        slope = tl.zeros([BLOCK_M], tl.float32)
        if USE_ALIBI:
            slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)

        first = ctx - n_new + t * BLOCK_Q          # position of the tile's first query
        hi = tl.minimum(first + BLOCK_Q, ctx)      # one past its last query's position
        lo = first * 0
        full_lo = lo                               # keys >= full_lo are inside every row's window
        if USE_WINDOW:
            lo = tl.maximum(first - sliding_window + 1, 0)
            full_lo = tl.minimum(tl.maximum(hi - sliding_window, 0), first + 1)
        # keys [full_lo, full_hi) are visible to every row: no masks there
        full_hi = full_lo + (first + 1 - full_lo) // BLOCK_N * BLOCK_N

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, qpos, slope, full_lo, full_hi, table, k_cache_ptr, v_cache_ptr, kvh,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale, soft_cap, sliding_window,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, USE_CAP, False, USE_WINDOW, False, USE_ALIBI, DOT_PREC, DOT_F32)
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, qpos, slope, full_hi, hi, table, k_cache_ptr, v_cache_ptr, kvh,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale, soft_cap, sliding_window,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, USE_CAP, True, USE_WINDOW, True, USE_ALIBI, DOT_PREC, DOT_F32)
        if USE_WINDOW:
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q, qpos, slope, lo, full_lo, table, k_cache_ptr, v_cache_ptr, kvh,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale, soft_cap,
                sliding_window, BLOCK_SIZE, HEAD_DIM, BLOCK_N, USE_CAP, True, USE_WINDOW, True, USE_ALIBI,
                DOT_PREC, DOT_F32)

        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_splits(part_acc_ptr, part_ml_ptr, out_ptr, seq, kvh, used, num_seqs, stride_ot, stride_oh,
                    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, CHUNK: tl.constexpr, pa_ptr, pxa_ptr, pxs_ptr, PLANES: tl.constexpr):
    """For the query heads of KV head ``kvh`` at once: ``M = max_j m_j``, ``w_j = 2^(m_j - M)``,
    ``out = sum_j w_j acc_j / sum_j w_j l_j`` over the ``used`` splits, ``CHUNK`` splits per step
    with the running max rescaled between steps (one step, so one round of loads, up to ``CHUNK``
    splits). Loads are ``.cg``: other programs wrote them. 0 when no split saw a key."""
    g = tl.arange(0, GROUP_PAD)
    j = tl.arange(0, CHUNK)
    dims = tl.arange(0, HEAD_DIM)
    head = kvh * GROUP + g
    g_ok = g < GROUP
    rows = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS
    l_base = part_ml_ptr + num_seqs * NUM_HEADS * NUM_SPLITS
    m_run = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    den = tl.zeros([GROUP_PAD], tl.float32)
    o = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for j0 in range(0, used, CHUNK):
        ok = g_ok[:, None] & (j0 + j < used)[None, :]
        r = rows[:, None] + (j0 + j)[None, :]
        m = tl.load(part_ml_ptr + r, mask=ok, other=-1.0e30, cache_modifier=".cg")
        l = tl.load(l_base + r, mask=ok, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_acc_ptr + r[:, :, None] * HEAD_DIM + dims[None, None, :], mask=ok[:, :, None],
                      other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 1))
        alpha = tl.exp2(m_run - m_new)
        w = tl.where(ok, tl.exp2(m - m_new[:, None]), 0.0)
        den = den * alpha + tl.sum(w * l, 1)
        o = o * alpha[:, None] + tl.sum(acc * w[:, :, None], 1)
        m_run = m_new
    o = o / tl.where(den == 0.0, 1.0, den)[:, None]
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    _heads_planes(o, kvh, pa_ptr, pxa_ptr, pxs_ptr, out_ptr.dtype.element_ty, NUM_HEADS, GROUP, HEAD_DIM, PLANES)


@triton.jit
def _heads_planes(o, kvh, pa_ptr, pxa_ptr, pxs_ptr, dt: tl.constexpr, NUM_HEADS: tl.constexpr,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PLANES: tl.constexpr):
    """With ``PLANES`` (one sequence): the Q4_K tensor-core A operand (:mod:`.gguf_mma`) of the output
    heads of KV head ``kvh`` (``o [rows, HEAD_DIM]``, rows past ``GROUP`` padding), as the GEMV
    reading the output row next (``o_proj``) would make it: its activation launch goes."""
    if PLANES:
        ROWS: tl.constexpr = o.shape[0]
        PER: tl.constexpr = HEAD_DIM // 32                     # sub-blocks a head
        y = tl.reshape(o.to(dt).to(tl.float32), [ROWS * PER, 32])
        i = tl.arange(0, ROWS * PER)
        sub_blocks_planes(y, kvh * GROUP * PER, i // PER < GROUP, pa_ptr, pxa_ptr, pxs_ptr, NUM_HEADS * HEAD_DIM)


@triton.jit
def _split_range(ctx, split, sliding_window, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 USE_WINDOW: tl.constexpr):
    """``(start, end, used)``: split ``split``'s keys ``[start, end)`` and how many splits have keys
    (see :func:`_decode_kernel`)."""
    lo = ctx * 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - sliding_window, 0)
    tiles = tl.cdiv(ctx - lo, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(tiles, NUM_SPLITS), 1)
    used = tl.cdiv(tiles, tiles_per_split)
    start = lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx)
    return start, end, used


@triton.jit
def _read_step(seq, split, seq_lens_ptr, cos_ptr, sin_ptr, slot_ptr, stride_cs, sliding_window,
               BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, ROPE: tl.constexpr,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr, GPTJ: tl.constexpr):
    """What a decode program reads of the step's inputs: ``(L, start, end, used)`` of its split
    (:func:`_split_range`) and, with ``ROPE``, the rotation terms (:func:`~.rope.rope_coeffs`) of the
    query's position and the new key's cache slot (identity rotation and slot -1 without)."""
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start, end, used = _split_range(ctx, split, sliding_window, BLOCK_N, NUM_SPLITS, USE_WINDOW)
    if ROPE:
        partner, c, ss = rope_coeffs(cos_ptr + seq.to(tl.int64) * stride_cs, sin_ptr + seq.to(tl.int64) * stride_cs,
                                      HEAD_DIM, HALF, GPTJ)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
    else:
        partner = tl.arange(0, HEAD_DIM)
        c = tl.full([HEAD_DIM], 1.0, tl.float32)
        ss = tl.zeros([HEAD_DIM], tl.float32)
        slot = ctx.to(tl.int64) * 0 - 1
    return ctx, start, end, used, partner, c, ss, slot


@triton.jit(do_not_specialize=["soft_cap", "sliding_window", "num_seqs"])
def _decode_kernel(
    q_ptr,              # [num_seqs, num_heads, head_dim] one query per sequence (un-rotated when ROPE)
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim] key cache
    v_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim] value cache
    out_ptr,            # [num_seqs, num_heads, head_dim] output, q's dtype
    part_acc_ptr,       # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32 unnormalised acc per split
    part_ml_ptr,        # [2, num_seqs, num_heads, NUM_SPLITS] float32 running max m (0) and sum l (1)
    count_ptr,          # [num_seqs, num_kv_heads] int32 arrival counters, zero between launches
    block_tables_ptr,   # [num_seqs, max_blocks] cache block of each sequence's j-th block
    seq_lens_ptr,       # [num_seqs] context length L (the query sits at position L - 1)
    k_new_ptr,          # ROPE: [num_seqs, num_kv_heads, head_dim] this step's un-rotated keys
    v_new_ptr,          # ROPE: [num_seqs, num_kv_heads, head_dim] this step's values
    cos_ptr, sin_ptr,   # ROPE: [num_seqs, HALF] rotary cos/sin of each query's position
    slot_ptr,           # ROPE: [num_seqs] cache slot of the new key/value (< 0: padding, not written)
    alibi_ptr,          # [num_heads] float32 ALiBi slopes (read only when USE_ALIBI)
    scale,              # float, multiplies q·k
    soft_cap,           # float, cap of cap*tanh(s/cap) (read only when USE_CAP)
    sliding_window,     # int, keep keys k >= L - window (read only when USE_WINDOW)
    num_seqs,           # int, number of sequences
    stride_qt, stride_qh,              # q strides (sequences, heads)
    stride_ot, stride_oh,              # out strides (sequences, heads)
    stride_kb, stride_ks, stride_kh,   # key cache strides (block, slot, head)
    stride_vb, stride_vs, stride_vh,   # value cache strides (block, slot, head)
    stride_bt,                         # block_tables stride between sequences
    stride_knt, stride_knh,            # ROPE: new keys' strides (sequences, heads)
    stride_vnt, stride_vnh,            # ROPE: new values' strides
    stride_cs,                         # ROPE: cos/sin stride between sequences
    NUM_HEADS: tl.constexpr,   # query heads
    BLOCK_SIZE: tl.constexpr,  # cache block size
    GROUP: tl.constexpr,       # query heads per KV head
    GROUP_PAD: tl.constexpr,   # GROUP padded to a power of two (the combine's rows)
    BLOCK_H: tl.constexpr,     # GROUP padded to a power of two >= 16 (tl.dot's smallest M)
    HEAD_DIM: tl.constexpr,    # head_dim (power of two)
    BLOCK_N: tl.constexpr,     # keys per inner step
    NUM_SPLITS: tl.constexpr,  # partitions of each sequence's keys
    CHUNK: tl.constexpr,       # splits combined per step (_combine_chunk)
    USE_CAP: tl.constexpr,     # soft_cap > 0
    USE_WINDOW: tl.constexpr,  # sliding_window > 0
    USE_ALIBI: tl.constexpr,   # add the ALiBi bias slope[head] * (key position - (L - 1))
    ROPE: tl.constexpr,        # rotate q and the new key, write the new key/value into the caches first
    HALF: tl.constexpr,        # ROPE: rotary dim / 2
    GPTJ: tl.constexpr,        # ROPE: GPT-J pairs (2i, 2i + 1) instead of NEOX (i, i + HALF)
    INPUTS_READY: tl.constexpr,  # seq_lens, block_tables (and the ROPE inputs) are not written by earlier kernels
    PREFETCH: tl.constexpr,    # ROPE and INPUTS_READY, and no earlier kernel writes the caches: load tile 0 early
    DOT_PREC: tl.constexpr,    # tl.dot input_precision
    DOT_F32: tl.constexpr,     # upcast dot operands to float32 (interpreter only, see _mm)
    USE_PDL: tl.constexpr,     # launched with programmatic dependent launch (kernels/pdl.py)
    pa_ptr=None, pxa_ptr=None, pxs_ptr=None,   # PLANES: the output row's Q4_K A operand [16, H·D], a_s, S_s
    PLANES: tl.constexpr = False,   # one sequence: also write those (_heads_planes), for the GEMV after
):
    """Program ``(kvh, s, j)``: keys ``[lo, L)`` with ``lo = max(0, L - window)`` (0 without a
    window) are cut into ``T = cdiv(L - lo, BLOCK_N)`` tiles; split ``j`` takes tiles
    ``[j * c, (j + 1) * c)``, ``c = cdiv(T, NUM_SPLITS)``, so ``U = cdiv(T, c)`` splits have keys
    and the rest exit. Each runs the online softmax of the ``GROUP`` query heads of KV head ``kvh``
    over its keys (module docstring; every key in range is visible: the query is the last
    position). With ``U <= 1`` split 0 stores ``acc / l`` (zeros when ``L = 0``); otherwise each
    stores ``acc, m, l`` and bumps the counter of ``(s, kvh)`` (release/acquire), and the last to
    arrive combines the ``U`` partials (:func:`_combine_splits`) and resets the counter to 0.

    ``ROPE`` (the fused ``rope_cache_attention`` op): q is rotated in registers, and split ``U - 1``
    (the one holding position ``L - 1``) first writes the rotated new key and the new value of
    ``kvh`` to cache slot ``slot[s]`` (when ``>= 0``), then syncs its threads before reading the
    cache. The slot must be position ``L - 1``'s (the scheduler's decode contract). With
    ``PREFETCH`` each split loads its first key tile before the PDL wait (the cache changes only at
    ``L - 1`` in this step, and that key and value are put into the tile from registers)."""
    kvh = tl.program_id(0)          # the grid's fastest axis: a sequence's KV heads launch together
    seq = tl.program_id(1)
    split = tl.program_id(2)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if INPUTS_READY:                       # step inputs: read them while the previous kernel finishes
        ctx, start, end, used, partner, c, ss, slot = _read_step(
            seq, split, seq_lens_ptr, cos_ptr, sin_ptr, slot_ptr, stride_cs, sliding_window, BLOCK_N, NUM_SPLITS,
            USE_WINDOW, ROPE, HEAD_DIM, HALF, GPTJ)
        if PREFETCH:                       # and this split's first keys: no kernel of the step writes them
            k0, v0, kpos0 = _load_tile(table, start, end, k_cache_ptr, v_cache_ptr, kvh, stride_kb, stride_ks,
                                       stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, HEAD_DIM, BLOCK_N,
                                       True)
    pdl_wait(USE_PDL)
    if not INPUTS_READY:
        ctx, start, end, used, partner, c, ss, slot = _read_step(
            seq, split, seq_lens_ptr, cos_ptr, sin_ptr, slot_ptr, stride_cs, sliding_window, BLOCK_N, NUM_SPLITS,
            USE_WINDOW, ROPE, HEAD_DIM, HALF, GPTJ)
    if split < tl.maximum(used, 1):
        h = tl.arange(0, BLOCK_H)
        head = kvh * GROUP + h
        head_ok = h < GROUP
        dims = tl.arange(0, HEAD_DIM)
        q_rows = q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_rows + dims[None, :], mask=head_ok[:, None], other=0.0)
        if ROPE:
            qp = tl.load(q_rows + partner[None, :], mask=head_ok[:, None], other=0.0)
            q = (q.to(tl.float32) * c[None, :] + qp.to(tl.float32) * ss[None, :]).to(q_ptr.dtype.element_ty)
            kn = k_new_ptr + seq.to(tl.int64) * stride_knt + kvh * stride_knh
            k_new = (tl.load(kn + dims).to(tl.float32) * c
                     + tl.load(kn + partner).to(tl.float32) * ss).to(k_cache_ptr.dtype.element_ty)
            v_new = tl.load(v_new_ptr + seq.to(tl.int64) * stride_vnt + kvh * stride_vnh + dims).to(
                v_cache_ptr.dtype.element_ty)
            if (split == used - 1) & (slot >= 0):
                blk = slot // BLOCK_SIZE
                off = slot % BLOCK_SIZE
                tl.store(k_cache_ptr + blk * stride_kb + off * stride_ks + kvh * stride_kh + dims, k_new)
                tl.store(v_cache_ptr + blk * stride_vb + off * stride_vs + kvh * stride_vh + dims, v_new)
            tl.debug_barrier()             # this program's threads read the new key back below

        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        qpos = h * 0 + ctx - 1                 # every row's query is the sequence's last position
        slope = tl.zeros([BLOCK_H], tl.float32)
        if USE_ALIBI:
            slope = tl.load(alibi_ptr + head, mask=head_ok, other=0.0)
        if PREFETCH:                       # the first tile came before the wait: put this step's key in
            new = ((kpos0 == ctx - 1) & (slot >= 0))[:, None]
            k0 = tl.where(new, k_new[None, :], k0)
            v0 = tl.where(new, v_new[None, :], v0)
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k0, v0, kpos0, qpos, slope, end, scale, soft_cap,
                                         sliding_window, USE_CAP, False, False, True, USE_ALIBI, DOT_PREC, DOT_F32)
            start += BLOCK_N
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, qpos, slope, start, end, table, k_cache_ptr, v_cache_ptr, kvh,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale, soft_cap, sliding_window,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, USE_CAP, False, False, True, USE_ALIBI, DOT_PREC, DOT_F32)

        alone = used <= 1
        if NUM_SPLITS == 1:      # (no workspace: the split code below must not even be compiled)
            alone = True
        if alone:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
            _heads_planes(o, kvh, pa_ptr, pxa_ptr, pxs_ptr, out_ptr.dtype.element_ty, NUM_HEADS, GROUP, HEAD_DIM,
                          PLANES)
        elif NUM_SPLITS > 1:
            row = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + split
            tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_ok[:, None])
            tl.store(part_ml_ptr + row, m_i, mask=head_ok)
            tl.store(part_ml_ptr + num_seqs * NUM_HEADS * NUM_SPLITS + row, l_i, mask=head_ok)
            tl.debug_barrier()
            counter = count_ptr + seq * (NUM_HEADS // GROUP) + kvh
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == used - 1:
                _combine_splits(part_acc_ptr, part_ml_ptr, out_ptr, seq, kvh, used, num_seqs, stride_ot,
                                stride_oh, NUM_HEADS, GROUP, GROUP_PAD, HEAD_DIM, NUM_SPLITS, CHUNK, pa_ptr, pxa_ptr,
                                pxs_ptr, PLANES)
                tl.atomic_xchg(counter, 0, sem="relaxed")   # read again only by a later launch


# --------------------------------------------------------------------------------------------------
# launchers


class _Config(NamedTuple):
    block_m: int        # prefill rows per tile (queries x padded group)
    block_n: int        # keys per inner step
    num_warps: int
    num_stages: int


def _pick_config(head_dim: int, group_pad: int, *, decode: bool, prefetch_splits: bool = False,
                 wide_grid: bool = False, one_tile: bool = False) -> _Config:
    """The one tile heuristic of both kernels (from ``benchmarks/attention.py --sweep`` on an H200,
    32/8 heads, head_dim 128, bf16). Prefill: 64 rows x 64 keys, 4 warps, 3 stages (275 TFLOP/s
    causal at 2048 tokens; 128x64/8 warps 268, 128x128/8 warps 275, 64x32 210); head_dim 256 takes
    32 keys and 8 warps so the float32 accumulator stays in registers; the tile grows to hold at
    least one query's whole group. Decode: 64 keys per step (32 for head_dim 256), 4 warps,
    2 stages (within 6% of the best swept config at batch 1/8/64, context 4096), rows = the group
    padded to >= 16 (``tl.dot``'s smallest M). A split decode that reads its first tile before the
    PDL wait (``prefetch_splits``) takes 32 keys per tile: more splits, each wholly read early
    (Llama-3-8B batch 1, context 512, in the model: 4218 vs 4278 µs a step with 64 keys). So does
    a one-split grid of more than ``_WIDE_GRID_PER_SM`` programs a SM (``wide_grid``,
    ``_WIDE_GRID_KEYS``): at batch 256, context 640, 32/8 heads, on an H100, 120.3 vs 123.2 µs
    (head_dim 64) and 232.0 vs 235.3 µs (head_dim 128) a launch; at batch 64 (3.9 programs a SM)
    the 1B step lost 4% with them. A split decode whose splits are one early-read tile each
    (``one_tile``, :func:`_default_splits`) takes ``_SPLIT_TILE_KEYS`` keys, ``_SPLIT_STAGES``
    stages and, at head_dim >= 128, ``_SPLIT_WARPS_WIDE`` warps: a sweep of the batch-1 launch
    (context 512, 32/8 heads, 32 chained launches, H100) found 8 splits of 64 keys, 8 warps, 1
    stage at 4.72 µs (head_dim 128) and 4 warps at 3.92 µs (head_dim 64), against 8.52 and
    6.55 µs for 5 splits of 128 keys in 32-key tiles, 4 warps, 2 stages."""
    big = head_dim > 128
    if decode:
        if one_tile and not big:
            return _Config(block_m=max(16, group_pad), block_n=_SPLIT_TILE_KEYS, num_stages=_SPLIT_STAGES,
                           num_warps=_SPLIT_WARPS_WIDE if head_dim >= 128 else _DECODE_WARPS)
        narrow = big or prefetch_splits or (wide_grid and _WIDE_GRID_KEYS == 32)
        return _Config(block_m=max(16, group_pad), block_n=32 if narrow else 64,
                       num_warps=_DECODE_WARPS, num_stages=2)
    return _Config(block_m=max(64, group_pad), block_n=32 if big else 64,
                   num_warps=8 if big else 4, num_stages=2 if big else 3)


def _interpreted(kernel) -> bool:
    """True when triton built ``kernel`` for its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def _dot_args(dtype: torch.dtype, kernel) -> dict:
    """float32 inputs multiply as 3xTF32 on the tensor cores (error ~1e-6 relative, float32 class;
    plain tf32 would be ~1e-3 and "ieee" compiles to slow FMA loops); the interpreter upcasts."""
    return dict(DOT_PREC="tf32x3" if dtype == torch.float32 else "tf32", DOT_F32=_interpreted(kernel))


def _fail(fn: str, arg: str, expected: str, actual) -> None:
    raise GraphDSLError(f"{fn}: {arg} must be {expected}, got {actual}")


def _desc(x) -> str:
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def _check_common(fn, q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                  soft_cap, alibi_slopes, out, kernel):
    """Validate what prefill and decode share; return (num_heads, kv_heads, head_dim, block_size)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        _fail(fn, "q", "a [num_tokens, num_heads, head_dim] tensor", _desc(q))
    if q.dtype not in _DTYPES:
        _fail(fn, "q.dtype", "float16, bfloat16 or float32", q.dtype)
    if q.stride(2) != 1:
        _fail(fn, "q.stride(2)", "1 (head_dim contiguous)", q.stride(2))
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            _fail(fn, name, "a [num_blocks, block_size, num_kv_heads, head_dim] tensor", _desc(c))
        if c.dtype != q.dtype:
            _fail(fn, f"{name}.dtype", f"q's dtype {q.dtype}", c.dtype)
        if c.stride(3) != 1:
            _fail(fn, f"{name}.stride(3)", "1 (head_dim contiguous)", c.stride(3))
    if tuple(key_cache.shape) != tuple(value_cache.shape):
        _fail(fn, "value_cache.shape", f"key_cache's {tuple(key_cache.shape)}", tuple(value_cache.shape))
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if key_cache.shape[3] != dim:
        _fail(fn, "key_cache.shape[3] (head_dim)", f"q's head_dim {dim}", key_cache.shape[3])
    if dim < 16 or dim > 256 or dim & (dim - 1):
        _fail(fn, "head_dim", "a power of two in [16, 256]", dim)
    if kv_heads == 0 or heads % kv_heads:
        _fail(fn, "num_heads", f"a multiple of num_kv_heads {kv_heads}", heads)
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 \
            or block_tables.dtype not in (torch.int32, torch.int64):
        _fail(fn, "block_tables", "a [num_seqs, max_blocks] int32/int64 tensor", _desc(block_tables))
    if block_tables.stride(1) != 1:
        _fail(fn, "block_tables.stride(1)", "1", block_tables.stride(1))
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 \
            or seq_lens.dtype not in (torch.int32, torch.int64) or not seq_lens.is_contiguous():
        _fail(fn, "seq_lens", "a contiguous [num_seqs] int32/int64 tensor", _desc(seq_lens))
    if block_tables.shape[0] != seq_lens.shape[0]:
        _fail(fn, "block_tables.shape[0]", f"num_seqs = len(seq_lens) = {seq_lens.shape[0]}", block_tables.shape[0])
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        _fail(fn, "scale", "a float", repr(scale))
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 0:
        _fail(fn, "sliding_window", "an int >= 0", repr(sliding_window))
    if not isinstance(soft_cap, (int, float)) or isinstance(soft_cap, bool) or soft_cap < 0:
        _fail(fn, "soft_cap", "a float >= 0", repr(soft_cap))
    if alibi_slopes is not None and (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32
                                     or tuple(alibi_slopes.shape) != (heads,) or not alibi_slopes.is_contiguous()):
        _fail(fn, "alibi_slopes", f"None or a contiguous [{heads}] float32 tensor (one slope per query head)",
              _desc(alibi_slopes))
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
            _fail(fn, "out", f"a {tuple(q.shape)} {q.dtype} tensor", _desc(out))
        if out.stride(2) != 1:
            _fail(fn, "out.stride(2)", "1", out.stride(2))
    tensors = [q, key_cache, value_cache, block_tables, seq_lens] + [x for x in (out, alibi_slopes) if x is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        _fail(fn, "all tensors", "on one device", sorted(str(d) for d in devices))
    if q.device.type != "cuda" and not _interpreted(kernel):
        _fail(fn, "device", "cuda (or TRITON_INTERPRET=1 set before triton was imported)", q.device)
    return heads, kv_heads, dim, block_size


def _cache_strides(key_cache, value_cache):
    return (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2))


def _launch_prefill(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    sliding_window, soft_cap, out, config: _Config | None = None, alibi_slopes=None):
    fn = "paged_attention_prefill"
    heads, kv_heads, dim, block_size = _check_common(
        fn, q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, alibi_slopes, out,
        _prefill_kernel)
    num_seqs = seq_lens.shape[0]
    if not isinstance(query_start_loc, torch.Tensor) or query_start_loc.dim() != 1 \
            or query_start_loc.dtype not in (torch.int32, torch.int64) or not query_start_loc.is_contiguous() \
            or query_start_loc.shape[0] != num_seqs + 1:
        _fail(fn, "query_start_loc", f"a contiguous [{num_seqs + 1}] int32/int64 tensor (num_seqs + 1)",
              _desc(query_start_loc))
    if query_start_loc.device != q.device:
        _fail(fn, "query_start_loc.device", str(q.device), query_start_loc.device)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    cfg = config or _pick_config(dim, group_pad, decode=False)   # config: benchmarks' sweeps only
    block_q = cfg.block_m // group_pad
    grid = (kv_heads, q.shape[0] // block_q + num_seqs)
    seq_vec = triton.next_power_of_2(num_seqs) if 1 < num_seqs <= _SEQ_VEC_MAX else 0
    _prefill_kernel[grid](
        q, key_cache, value_cache, out, block_tables, seq_lens, query_start_loc,
        q if alibi_slopes is None else alibi_slopes,
        float(scale), float(soft_cap), int(sliding_window), num_seqs, max(num_seqs - 1, 0).bit_length(),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(key_cache, value_cache), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=dim,
        BLOCK_Q=block_q, BLOCK_N=cfg.block_n, USE_CAP=soft_cap > 0, USE_WINDOW=sliding_window > 0,
        USE_ALIBI=alibi_slopes is not None, **_dot_args(q.dtype, _prefill_kernel), **pdl_launch(q.device),
        SEQ_VEC=seq_vec, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


# a prefill program finds its sequence with one vector load of query_start_loc up to this many
# sequences (a binary search of log2(num_seqs) dependent loads past it): 8 loads cost the
# Llama-3-8B prefill attention ~4 us a layer at 256 sequences (the serving loop's padded steps)
_SEQ_VEC_MAX = 1024
_MAX_SPLITS = 64
_DECODE_WARPS = 4          # decode warps (in-model A/B on the H200: 2 and 8 lose on Llama-3.2-1B)
_MIN_KEYS_PER_SPLIT = 128
# one-tile splits (_default_splits, _pick_config's one_tile): when the grid has room, a decode with
# its first tile read before the PDL wait splits the keys into tiles of _SPLIT_TILE_KEYS, one a split,
# each launched with _SPLIT_STAGES stages and, at head_dim >= 128, _SPLIT_WARPS_WIDE warps
_ONE_TILE_SPLITS = True
_SPLIT_TILE_KEYS = 64
_SPLIT_STAGES = 1
_SPLIT_WARPS_WIDE = 8
_PREFETCH_WIDE_TILE = 8192   # keys x head_dim of a tile too large to hold across the PDL wait in many waves
_WIDE_GRID_KEYS = 32         # keys a tile of a one-split grid of more than _WIDE_GRID_PER_SM programs a SM (64: as
_WIDE_GRID_PER_SM = 8        # the others). In-model A/B on an H100 (µs a step, 64 -> 32 keys): batch 256 1B 3104 ->
                             # 3084, 8B 13978 -> 13774; batch 64 (3.9 programs a SM) 1B 1683 -> 1751, 8B 7567 -> 7558


def _prefetch_first_tile(num_seqs: int, kv_heads: int, num_splits: int, dim: int, group: int,
                         device: torch.device) -> bool:
    """Whether a fused rope/cache decode loads its first key tile before the PDL wait. Not for a
    one-split grid of more than two programs per SM whose tile has ``>= _PREFETCH_WIDE_TILE`` key
    elements (64 keys x head_dim 128): holding that tile (K and V, 64 registers a thread) across the
    wait lowers occupancy, and only the first wave overlaps the previous kernel anyway. In-model A/B
    on an H100: Llama-3-8B batch 64 8014 -> 7839 µs, batch 256 14577 -> 14112 µs without it; batch
    1 (one wave) and head_dim 64 keep it (Llama-3.2-1B batch 256: 3403 µs without, 3319 with)."""
    if num_splits > 1 or num_seqs * kv_heads <= 2 * _sm_count(device):
        return True
    return _pick_config(dim, triton.next_power_of_2(group), decode=True).block_n * dim < _PREFETCH_WIDE_TILE


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _default_splits(num_seqs: int, kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Enough splits for about two programs per SM, but no split shorter than 128 keys (the
    longest possible context, from the block table's width, bounds this without reading seq_lens);
    or, where the grid has room for it, one ``_SPLIT_TILE_KEYS``-key tile a split (``_ONE_TILE_SPLITS``:
    each split's keys are then all read before the PDL wait, see :func:`_pick_config`)."""
    sms = _sm_count(device)
    want = triton.cdiv(2 * sms, max(num_seqs * kv_heads, 1))
    one_tile = triton.cdiv(max_keys, _SPLIT_TILE_KEYS)
    if _ONE_TILE_SPLITS and one_tile <= min(want, _MAX_SPLITS):
        return max(1, one_tile)
    return max(1, min(want, triton.cdiv(max_keys, _MIN_KEYS_PER_SPLIT), _MAX_SPLITS))


def _table_keys(max_blocks: int, block_size: int, sliding_window: int) -> int:
    """The most keys a decode can read through a table ``max_blocks`` wide (a window caps them)."""
    keys = max_blocks * block_size
    return min(keys, sliding_window) if sliding_window else keys


def _one_tile(max_keys: int, num_splits: int) -> bool:
    """Whether ``num_splits`` splits of ``max_keys`` keys are one ``_SPLIT_TILE_KEYS``-key tile each."""
    return _ONE_TILE_SPLITS and num_splits > 1 and triton.cdiv(max_keys, num_splits) <= _SPLIT_TILE_KEYS


def decode_num_splits(num_seqs: int, kv_heads: int, max_blocks: int, block_size: int, sliding_window: int,
                      device: torch.device) -> int:
    """The split count :func:`paged_attention_decode` picks when ``num_splits`` is omitted: it depends
    on shapes only (the block table's width bounds the context), so a caller can size ``workspace``."""
    return _default_splits(num_seqs, kv_heads, _table_keys(max_blocks, block_size, sliding_window), device)


WIDTH_FLOOR_KEYS = 512   # the narrowest block table decode_widths offers, in keys


def _grid_of(num_seqs: int, kv_heads: int, max_blocks: int, block_size: int, sliding_window: int,
             device) -> tuple[int, bool]:
    """``(splits, one_tile)``: the decode grid's split count at this block-table width and whether
    each split is one ``_SPLIT_TILE_KEYS``-key tile (read before the PDL wait)."""
    splits = decode_num_splits(num_seqs, kv_heads, max_blocks, block_size, sliding_window, device)
    return splits, _one_tile(_table_keys(max_blocks, block_size, sliding_window), splits)


def decode_widths(num_seqs: int, kv_heads: int, max_blocks: int, block_size: int, sliding_windows, device,
                  floor_keys: int | None = None) -> tuple[int, ...]:
    """The block-table widths worth a decode graph of their own at ``num_seqs`` rows, ascending and
    ending with ``max_blocks``.

    The decode grid is sized to the table's width, the longest context it could meet: ``(kv_heads,
    num_seqs, splits)`` programs, of which a step at context ``L`` uses ``cdiv(L, keys a split)``
    splits; the others launch, wait and exit. At one row and a 2049-token table that is 33 splits
    where context 512 uses 8, and a 512-key table gave the Llama-3-8B step 1.2% (H200;
    docs/performance-log.md). Candidates are ``floor_keys / block_size`` blocks doubled up to
    ``max_blocks`` (``floor_keys`` None: :data:`WIDTH_FLOOR_KEYS`); a narrower one is kept when, for some attention of the model (one per entry of
    ``sliding_windows``, 0 for none), it turns the splits into one-tile splits or at most halves
    them against the next wider width kept, so rows and widths that launch the same grid share a
    graph."""
    floor = max(1, -(-(WIDTH_FLOOR_KEYS if floor_keys is None else floor_keys) // block_size))
    windows = tuple(sliding_windows) or (0,)
    grid = lambda w: [_grid_of(num_seqs, kv_heads, w, block_size, win, device) for win in windows]  # noqa: E731
    candidates = []
    while floor < max_blocks:
        candidates.append(floor)
        floor *= 2
    kept, wider = [max_blocks], grid(max_blocks)
    for w in reversed(candidates):
        mine = grid(w)
        if any((one and not one_w) or 2 * s <= s_w for (s, one), (s_w, one_w) in zip(mine, wider)):
            kept.append(w)
            wider = mine
    return tuple(sorted(kept))


def _combine_chunk(num_splits: int, group: int, head_dim: int) -> int:
    """Splits the combine reads per step: all of them (one round of loads) while the
    ``[group, chunk, head_dim]`` float32 tile stays within 8192 elements (64 registers a thread)."""
    cap = max(1, 8192 // (triton.next_power_of_2(group) * head_dim))
    return min(triton.next_power_of_2(num_splits), 1 << (cap.bit_length() - 1))


class DecodeWorkspace(NamedTuple):
    """Scratch of a split decode (``workspace=``): per-split partial results and one arrival counter
    per (sequence, KV head), zero between launches (the combining program resets it, so CUDA-graph
    replays need no memset). Make it with :func:`decode_workspace`."""

    part_acc: torch.Tensor   # [num_seqs, num_heads, num_splits, head_dim] float32
    part_ml: torch.Tensor    # [2, num_seqs, num_heads, num_splits] float32
    counters: torch.Tensor   # [num_seqs, num_kv_heads] int32, zeros


def decode_workspace(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int,
                     device) -> DecodeWorkspace:
    """Allocate the :class:`DecodeWorkspace` of a decode of these sizes (counters zeroed)."""
    f32 = dict(dtype=torch.float32, device=device)
    return DecodeWorkspace(torch.empty(num_seqs, num_heads, num_splits, head_dim, **f32),
                           torch.empty(2, num_seqs, num_heads, num_splits, **f32),
                           torch.zeros(num_seqs, num_kv_heads, dtype=torch.int32, device=device))


class DecodeRopeCache(NamedTuple):
    """This step's un-rotated keys and values, for a decode that also does ``rope_cache`` (the fused
    ``rope_cache_attention`` op): q is passed un-rotated too. The kernel rotates q and the key in
    float32 (rounded to their dtype, as ``functional.attention.rope``), writes ``key'``/``value`` to
    cache slot ``slot_mapping[s]`` (skipped when negative), then attends."""

    key: torch.Tensor            # [num_seqs, num_kv_heads, head_dim], head_dim contiguous
    value: torch.Tensor          # [num_seqs, num_kv_heads, head_dim], head_dim contiguous
    cos: torch.Tensor            # [num_seqs, rotary_dim / 2]
    sin: torch.Tensor            # [num_seqs, rotary_dim / 2], cos's strides
    slot_mapping: torch.Tensor   # [num_seqs] int32/int64: slot of position seq_lens[s] - 1
    layout: RopeLayout


def _check_rope_cache(fn: str, rc, q, key_cache, kv_heads: int, dim: int) -> None:
    if not isinstance(rc, DecodeRopeCache):
        _fail(fn, "rope_cache", "None or a DecodeRopeCache", type(rc).__name__)
    n = q.shape[0]
    for name, x in (("rope_cache.key", rc.key), ("rope_cache.value", rc.value)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (n, kv_heads, dim):
            _fail(fn, name, f"a [{n}, {kv_heads}, {dim}] tensor (num_seqs, kv_heads, head_dim)", _desc(x))
        if x.dtype not in _DTYPES or x.stride(2) != 1:
            _fail(fn, name, "float16/bfloat16/float32 with a contiguous last dim",
                  f"{x.dtype} strides {tuple(x.stride())}")
    for name, x in (("rope_cache.cos", rc.cos), ("rope_cache.sin", rc.sin)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != n or x.stride(1) != 1:
            _fail(fn, name, f"a [{n}, rotary_dim / 2] tensor with a contiguous last dim", _desc(x))
    if tuple(rc.sin.shape) != tuple(rc.cos.shape) or rc.sin.stride() != rc.cos.stride():
        _fail(fn, "rope_cache.sin", f"cos's shape {tuple(rc.cos.shape)} and strides {rc.cos.stride()}",
              f"{tuple(rc.sin.shape)} strides {rc.sin.stride()}")
    if 2 * rc.cos.shape[1] > dim:
        _fail(fn, "rope_cache.cos.shape[1]", f"<= head_dim / 2 = {dim // 2}", rc.cos.shape[1])
    s = rc.slot_mapping
    if not isinstance(s, torch.Tensor) or tuple(s.shape) != (n,) or s.dtype not in (torch.int32, torch.int64) \
            or not s.is_contiguous():
        _fail(fn, "rope_cache.slot_mapping", f"a contiguous [{n}] int32/int64 tensor", _desc(s))
    if not isinstance(rc.layout, RopeLayout):
        _fail(fn, "rope_cache.layout", "a RopeLayout", repr(rc.layout))
    devices = {x.device for x in (rc.key, rc.value, rc.cos, rc.sin, s)}
    if devices != {q.device}:
        _fail(fn, "rope_cache tensors", f"on q's device {q.device}", sorted(str(d) for d in devices))


def _check_workspace(fn: str, workspace, want: tuple, device) -> DecodeWorkspace:
    if not isinstance(workspace, DecodeWorkspace):
        _fail(fn, "workspace", "None or a DecodeWorkspace (decode_workspace())", type(workspace).__name__)
    dtypes = (torch.float32, torch.float32, torch.int32)
    for name, x, shape, dtype in zip(DecodeWorkspace._fields, workspace, want, dtypes):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype != dtype \
                or not x.is_contiguous() or x.device != device:
            _fail(fn, f"workspace.{name}", f"a contiguous {shape} {dtype} tensor on {device}", _desc(x))
    return workspace


def _launch_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap,
                   out, num_splits, config: _Config | None = None, workspace=None, rope_cache=None,
                   inputs_ready: bool = False, cache_ready: bool = False, alibi_slopes=None, planes=None):
    fn = "paged_attention_decode"
    heads, kv_heads, dim, block_size = _check_common(
        fn, q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, alibi_slopes, out,
        _decode_kernel)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] != num_seqs:
        _fail(fn, "q.shape[0]", f"num_seqs = len(seq_lens) = {num_seqs} (one query per sequence)", q.shape[0])
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, kv_heads, block_tables.shape[1], block_size, sliding_window,
                                       q.device)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= 256:
        _fail(fn, "num_splits", "None or an int in [1, 256]", repr(num_splits))
    if rope_cache is not None:
        _check_rope_cache(fn, rope_cache, q, key_cache, kv_heads, dim)
    planes_args = _planes_args(fn, planes, num_seqs, heads * dim, dim, q.device)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    if num_seqs > 65535:                    # the grid's second axis
        _fail(fn, "seq_lens", "at most 65535 sequences a launch", num_seqs)
    group = heads // kv_heads
    prefetch = (bool(inputs_ready and cache_ready) and rope_cache is not None
                and _prefetch_first_tile(num_seqs, kv_heads, num_splits, dim, group, q.device))
    wide = num_splits == 1 and num_seqs * kv_heads > _WIDE_GRID_PER_SM * _sm_count(q.device)
    one_tile = prefetch and _one_tile(_table_keys(block_tables.shape[1], block_size, sliding_window), num_splits)
    cfg = config or _pick_config(dim, triton.next_power_of_2(group), decode=True,
                                 prefetch_splits=prefetch and num_splits > 1, wide_grid=wide, one_tile=one_tile)
    if num_splits > 1:
        if workspace is None:
            workspace = decode_workspace(num_seqs, heads, kv_heads, dim, num_splits, q.device)
        want = ((num_seqs, heads, num_splits, dim), (2, num_seqs, heads, num_splits), (num_seqs, kv_heads))
        part_acc, part_ml, counters = _check_workspace(fn, workspace, want, q.device)
    else:
        part_acc = part_ml = counters = out     # not read or written with one split
    rc = rope_cache
    if rc is None:
        rope_args, rope_meta = (q, q, q, q, q) + (0,) * 5, dict(ROPE=False, HALF=1, GPTJ=False)
    else:
        rope_args = (rc.key, rc.value, rc.cos, rc.sin, rc.slot_mapping, rc.key.stride(0), rc.key.stride(1),
                     rc.value.stride(0), rc.value.stride(1), rc.cos.stride(0))
        rope_meta = dict(ROPE=True, HALF=rc.cos.shape[1], GPTJ=rc.layout is RopeLayout.GPTJ)
    k_new, v_new, cos, sin, slots, *rope_strides = rope_args
    _decode_kernel[(kv_heads, num_seqs, num_splits)](
        q, key_cache, value_cache, out, part_acc, part_ml, counters, block_tables, seq_lens,
        k_new, v_new, cos, sin, slots, q if alibi_slopes is None else alibi_slopes,
        float(scale), float(soft_cap), int(sliding_window), num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(key_cache, value_cache), block_tables.stride(0), *rope_strides,
        NUM_HEADS=heads, BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_H=cfg.block_m, HEAD_DIM=dim, BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits,
        CHUNK=_combine_chunk(num_splits, group, dim),
        USE_CAP=soft_cap > 0, USE_WINDOW=sliding_window > 0, USE_ALIBI=alibi_slopes is not None,
        INPUTS_READY=bool(inputs_ready),
        PREFETCH=prefetch, **rope_meta,
        **_dot_args(q.dtype, _decode_kernel), **pdl_launch(q.device), **planes_args,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def planes_possible(heads: int, dim: int) -> bool:
    """Whether a one-sequence decode of ``heads`` heads of ``dim`` can write its output row's Q4_K
    A operand (``planes=``): whole 256-input super-blocks, heads of whole 32-input sub-blocks."""
    return (heads * dim) % 256 == 0 and dim % 32 == 0


def _planes_args(fn: str, planes, num_seqs: int, k: int, dim: int, device) -> dict:
    """Launch keywords for ``planes`` (the output row's Q4_K A operand, :mod:`.gguf_mma`), checked:
    one sequence, a row of whole super-blocks, heads of whole 32-input sub-blocks."""
    if planes is None:
        return {}
    want = ((16, k), torch.int8), ((k // 32,), torch.float32), ((k // 32,), torch.float32)
    if num_seqs != 1 or not planes_possible(k // dim, dim) or len(planes) != 3 or any(
            tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != device
            for t, (shape, dtype) in zip(planes, want)):
        _fail(fn, "planes", f"for one sequence, heads x head_dim a multiple of 256 and head_dim of 32: the Q4_K A "
                            f"operand (contiguous int8 [16, {k}], float32 [{k // 32}] x 2 on {device})",
              f"{num_seqs} sequences, head_dim {dim}, {[(t.dtype, list(t.shape)) for t in planes]}")
    a, xa, xs = planes
    return dict(pa_ptr=a, pxa_ptr=xa, pxs_ptr=xs, PLANES=True)


# --------------------------------------------------------------------------------------------------
# public wrappers


def paged_attention_prefill(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *,
                            scale: float, sliding_window: int = 0, soft_cap: float = 0.0, out=None,
                            alibi_slopes: torch.Tensor | None = None):
    """Varlen causal attention of packed queries ``q [num_tokens, num_heads, head_dim]`` over the
    paged caches (cached prefix + this step's keys, already written); ``query_start_loc[s]`` is where
    sequence ``s``'s queries start (``num_seqs + 1`` entries, last = num_tokens) and ``seq_lens[s]``
    its context length including them. ``alibi_slopes``: ``[num_heads]`` float32 ALiBi slopes on q's
    device, or None. Returns ``out`` (allocated when omitted)."""
    return _launch_prefill(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                           sliding_window, soft_cap, out, alibi_slopes=alibi_slopes)


def paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, *, scale: float,
                           sliding_window: int = 0, soft_cap: float = 0.0, out=None,
                           num_splits: int | None = None, workspace: DecodeWorkspace | None = None,
                           rope_cache: DecodeRopeCache | None = None, inputs_ready: bool = False,
                           cache_ready: bool = False, alibi_slopes: torch.Tensor | None = None, planes=None):
    """One query per sequence (``q [num_seqs, num_heads, head_dim]``, position ``seq_lens[s] - 1``)
    over the paged caches, split-K over ``num_splits`` partitions of the context (a heuristic from
    the SM count and the block table's width when omitted), in one launch. ``alibi_slopes``:
    ``[num_heads]`` float32 ALiBi slopes on q's device, or None.

    ``workspace``: the split scratch (:func:`decode_workspace`) to use instead of allocating it per
    call (what a CUDA-graph capture needs). ``rope_cache``: also rotate q and this step's key and
    write the key and value into the caches first (:class:`DecodeRopeCache`). ``inputs_ready``:
    ``seq_lens``, ``block_tables`` and the ``rope_cache`` cos/sin/slots are step inputs no kernel
    launched just before writes, so with PDL they are read before waiting for that kernel.
    ``cache_ready`` (with ``rope_cache`` and ``inputs_ready``): no kernel launched before writes the
    caches either (this launch writes the step's key and value), so each split also reads its
    first key/value tile before the wait. ``planes`` (one sequence): three buffers that also receive
    the output row's (``[1, num_heads · head_dim]``) Q4_K tensor-core A operand
    (:func:`.gguf_mma.activation_planes` of it, bit for bit), for a GGUF GEMV reading the row next.
    Returns ``out``."""
    return _launch_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                          soft_cap, out, num_splits, workspace=workspace, rope_cache=rope_cache,
                          inputs_ready=inputs_ready, cache_ready=cache_ready, alibi_slopes=alibi_slopes, planes=planes)


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *,
                    scale: float | None = None, sliding_window: int = 0, soft_cap: float = 0.0, out=None,
                    alibi_slopes: torch.Tensor | None = None):
    """The ``paged_attention`` op's signature: prefill when ``query_start_loc`` is given, decode
    otherwise; ``scale`` defaults to ``1/sqrt(head_dim)``."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, out=out, alibi_slopes=alibi_slopes)
    if query_start_loc is None:
        return paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, **kw)
    return paged_attention_prefill(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, **kw)
