"""The sampled draw of rows that all have a top-k, in two launches and without ``torch.topk``.

For row ``r``, ``W = min(max top-k of the batch + extra, V)``: the kept set of a row with a top-k
(``x >= thr``, ``thr >= the k-th largest x``; :mod:`graphdsl.runtime.serving.sampler`) lies among
its ``W`` largest entries, so the draw never needs the rest of the row:

1. ``_slice_kernel`` (grid ``R x S``, ``S`` slices of ``SLICE`` tokens): ``x = penalised(l) / T``
   for its slice (stored, for the fallback below), then the slice's ``W`` largest ``x`` with their
   token ids: a bitwise search over order-preserving uint32 keys of ``x`` (32 counts, MSB first)
   finds the key of the ``W``-th largest exactly, and the entries above it, then those equal to it
   by lowest id, are compacted in token order.
2. ``_row_kernel`` (one program a row): the same select over the ``S x W`` candidates gives the
   row's ``W`` largest ``x`` (the multiset ``torch.topk`` returns). Sorted, they give ``thr`` by
   ``kernels.sampling``'s own threshold code, so it is the threshold kernel's bits. The Gumbel-max
   draw runs over the candidates with the full-row draw's noise of each token id; ties go to the
   lowest id, as the candidates stay in token order. The token is written, copied into the next
   inputs and counted as :func:`graphdsl.runtime.kernels.sampling.gumbel_argmax` does.

The candidates hold every kept token when ``thr`` exceeds the row's ``W``-th largest ``x``. When
``thr`` equals it (more than ``extra`` tokens tied at the k-th value), tokens tied at ``thr``
outside the candidates could be kept, so that row's program draws over the whole stored row
instead. Greedy rows (temperature 0) take the lowest-id maximum, which is always a candidate.

File shape (STYLE.md 11): the select helpers, the two kernels, the launch sizes
(:func:`_slice_tokens`), the public wrapper :func:`draw_top_k`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

from .sampling import (_emit, _gumbel_scores, _penalized, _row_penalties, _row_seed, _running_best, _threshold_of,
                       check_outputs)

__all__ = ["draw_top_k", "MAX_WIDTH"]

MAX_WIDTH = 256              # widest W (top-k + extra) the two launches take; wider rows use torch.topk
_CANDIDATES = 8192           # S x WB candidates a row program selects from, at most
_FALLBACK_BLOCK = 1024


@triton.jit
def _keys(x):
    """uint32 keys in the order of float32 ``x`` (-0.0 keyed as +0.0): sign bit set for x >= 0,
    every bit flipped for x < 0."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def _kth_key(key, valid, need):
    """``(T, ties)``: ``T`` the ``need``-th largest of the ``valid`` keys (1 <= need <= their count;
    need == 0 gives a ``T`` nothing valid needs), ``ties`` how many keys equal to ``T`` the ``need``
    largest hold. An MSB-first bitwise search: bit ``b`` of ``T`` is set when at least ``need`` keys
    reach ``T`` with it set (32 counts; a radix histogram of 8-bit digits measured slower)."""
    T = tl.full((), 0, tl.uint32)
    for b in tl.static_range(32):
        cand = T | (tl.full((), 1, tl.uint32) << (31 - b))
        T = tl.where(tl.sum((valid & (key >= cand)).to(tl.int32), axis=0) >= need, cand, T)
    return T, need - tl.sum((valid & (key > T)).to(tl.int32), axis=0)


@triton.jit
def _top(key, valid, need):
    """``(take, pos, taken)``: the ``need`` largest valid keys, ties at the last one taken in index
    order; ``pos`` each taken entry's place in index order; ``taken`` their count."""
    T, ties = _kth_key(key, valid, need)
    eq = valid & (key == T)
    take = (valid & (key > T)) | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= ties))
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    return take, pos, tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _slice_kernel(
    l_ptr, l_stride,  # [R, V] logits (float32 or 16-bit), read
    x_ptr,            # float32 [R, V]: penalised(l) / T, written
    temp_ptr, slot_ptr, rep_ptr, pres_ptr, freq_ptr, counts_ptr, mask_ptr,   # as kernels.sampling.penalize
    cv_ptr,           # float32 [R, S, WB]: each slice's W largest x in token order, then -inf
    ci_ptr,           # int64 [R, S, WB]: their token ids, then V
    V, W, S,
    PENALTIES: tl.constexpr,
    SLICE: tl.constexpr,
    WB: tl.constexpr,
):
    row = tl.program_id(0)
    sl = tl.program_id(1)
    inv_t, slot, rho, pres, freq, end_pen = _row_penalties(row, temp_ptr, slot_ptr, rep_ptr, pres_ptr, freq_ptr, V)
    idx = sl * SLICE + tl.arange(0, SLICE)
    inside = idx < V
    x = _penalized(l_ptr, l_stride, row, idx, inside, inv_t, slot, rho, pres, freq, end_pen, counts_ptr, mask_ptr,
                   V, PENALTIES)
    tl.store(x_ptr + row * V + idx, x, mask=inside)
    take, pos, taken = _top(_keys(x), inside, tl.minimum(W, tl.sum(inside.to(tl.int32), axis=0)))
    base = (row * S + sl).to(tl.int64) * WB
    j = tl.arange(0, WB)
    tl.store(cv_ptr + base + j, float("-inf"), mask=j >= taken)
    tl.store(ci_ptr + base + j, V, mask=j >= taken)
    tl.store(cv_ptr + base + pos, x, mask=take)
    tl.store(ci_ptr + base + pos, idx.to(tl.int64), mask=take)


@triton.jit
def _row_kernel(
    cv_ptr, ci_ptr,   # the slices' candidates (_slice_kernel), NC = S x WB a row
    x_ptr,            # float32 [R, V]: the stored x (the fallback draw)
    wv_ptr, wi_ptr,   # float32 / int64 [R, BLOCK_W] scratch: the row's W largest, token order
    min_p_ptr, k_ptr, p_ptr,                  # as kernels.sampling.threshold
    seed_ptr, ctr_ptr, temp_ptr,              # as kernels.sampling.gumbel_argmax
    out_ptr, ids_ptr, slot_ptr, counts_ptr,   # as kernels.sampling._gumbel_argmax_kernel
    V, W, NC,
    EXTRA: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK: tl.constexpr,
    MIXED: tl.constexpr,   # some rows are greedy (temperature 0)
    IDS: tl.constexpr,
    RECORD: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    cand = row.to(tl.int64) * NC + c
    cid = tl.load(ci_ptr + cand, mask=c < NC, other=V)
    valid = cid < V
    cv = tl.load(cv_ptr + cand, mask=valid, other=float("-inf"))
    take, pos, taken = _top(_keys(cv), valid, tl.minimum(W, tl.sum(valid.to(tl.int32), axis=0)))
    j = tl.arange(0, BLOCK_W)
    base = row.to(tl.int64) * BLOCK_W
    tl.store(wv_ptr + base + j, float("-inf"), mask=j >= taken)
    tl.store(wi_ptr + base + j, V, mask=j >= taken)
    tl.store(wv_ptr + base + pos, cv, mask=take)
    tl.store(wi_ptr + base + pos, cid, mask=take)
    tl.debug_barrier()
    v = tl.load(wv_ptr + base + j)             # the row's W largest x, token order
    t = tl.load(wi_ptr + base + j)
    desc = tl.sort(v, descending=True)
    thr = _threshold_of(desc, j, W, tl.load(min_p_ptr + row), tl.load(k_ptr + row), tl.load(p_ptr + row), EXTRA)
    ctr, s_hi, s_lo = _row_seed(row, seed_ptr, ctr_ptr)
    score = _gumbel_scores(v, t, t < V, thr, ctr, s_hi, s_lo)
    last = tl.min(tl.where(j < W, desc, float("inf")), axis=0)      # the row's W-th largest x
    fallback = (thr <= last) & (W < V)            # kept ties may lie outside the candidates
    if MIXED:
        sampled = tl.load(temp_ptr + row) != 0.0
        score = tl.where(sampled, score, tl.where(t < V, v, float("-inf")))
        fallback = fallback & sampled
    tok = tl.min(tl.where(j == tl.argmax(score, axis=0), t, V), axis=0)
    if fallback:
        best = tl.full((), float("-inf"), tl.float32)
        tok = tl.full((), 0, tl.int64)
        for start in range(0, V, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            inside = idx < V
            x = tl.load(x_ptr + row * V + idx, mask=inside, other=float("-inf"))
            best, tok = _running_best(best, tok, _gumbel_scores(x, idx, inside, thr, ctr, s_hi, s_lo), start)
    _emit(row, tok, out_ptr, ids_ptr, slot_ptr, counts_ptr, V, IDS, RECORD)


def _slice_tokens(V: int, wb: int, rows: int) -> int:
    """Tokens a slice program covers: a power of two of at least 16 x WB (so a row's candidates
    stay within ``_CANDIDATES``), 4096 below 32 rows (fewer candidates for the one program a row,
    which then bounds the time) and 2048 from 32 rows (more programs to spread), and no more than V
    needs (H100, W = 114: 29 / 39 µs a call at 1 row, 199 / 158 µs at 64)."""
    return min(max(4096 if rows < 32 else 2048, 16 * wb), max(wb, triton.next_power_of_2(V)))


def draw_top_k(logits: torch.Tensor, temperature, slot, repetition, presence, frequency, counts, prompt_mask,
               width: int, min_p, top_k, top_p, extra: int, seed, counter, *, mixed: bool,
               ids: torch.Tensor | None = None, record: tuple[torch.Tensor, torch.Tensor] | None = None,
               slice_tokens: int | None = None) -> torch.Tensor:
    """The sampler's steps 2-9 (:mod:`graphdsl.runtime.serving.sampler`) for rows that each have a
    top-k or are greedy: int64 ``[R]`` tokens. ``logits`` [R, V] (float32 or the model's 16-bit
    dtype); the per-row tensors are ``SamplingTensors``' fields and ``counts``/``prompt_mask``
    ``PenaltyState``'s (None: no penalties); ``width`` = min(max top-k + ``extra``, V) <=
    :data:`MAX_WIDTH`; ``mixed``: some rows are greedy; ``ids`` and ``record`` as for
    ``gumbel_argmax``; ``slice_tokens`` overrides the slice size (a power of two; tests)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise GraphDSLError(f"draw_top_k: logits must be [R, V] with unit stride in V, got {tuple(logits.shape)} "
                            f"strides {tuple(logits.stride())}")
    R, V = logits.shape
    if not 1 <= width <= min(V, MAX_WIDTH):
        raise GraphDSLError(f"draw_top_k: width must be in [1, min(V, {MAX_WIDTH})] = [1, {min(V, MAX_WIDTH)}], "
                            f"got {width}")
    check_outputs(R, V, ids, record)
    dev = logits.device
    out = torch.empty(R, dtype=torch.int64, device=dev)
    if R == 0:
        return out
    wb = max(16, triton.next_power_of_2(width))
    slice_ = slice_tokens or _slice_tokens(V, wb, R)
    S = triton.cdiv(V, slice_)
    if S * wb > _CANDIDATES:
        raise GraphDSLError(f"draw_top_k: {S} slices of {wb} candidates exceed {_CANDIDATES}; raise slice_tokens "
                            f"(got {slice_})")
    x = torch.empty(R, V, dtype=torch.float32, device=dev)
    cv = torch.empty(R, S, wb, dtype=torch.float32, device=dev)
    ci = torch.empty(R, S, wb, dtype=torch.int64, device=dev)
    pen = counts is not None
    cnt, mask = (counts, prompt_mask.view(torch.int8)) if pen else (logits, logits)
    _slice_kernel[(R, S)](logits, logits.stride(0), x, temperature, slot, repetition, presence, frequency, cnt, mask,
                          cv, ci, V, width, S, PENALTIES=pen, SLICE=slice_, WB=wb, num_warps=8 if slice_ > 2048 else 4)
    wv = torch.empty(R, wb, dtype=torch.float32, device=dev)
    wi = torch.empty(R, wb, dtype=torch.int64, device=dev)
    slot_r, counts_r = record if record is not None else (out, out)
    _row_kernel[(R,)](cv, ci, x, wv, wi, min_p, top_k, top_p, seed, counter, temperature,
                      out, ids if ids is not None else out, slot_r, counts_r, V, width, S * wb,
                      EXTRA=extra, BLOCK_C=max(16, triton.next_power_of_2(S * wb)), BLOCK_W=wb,
                      BLOCK=_FALLBACK_BLOCK, MIXED=mixed, IDS=ids is not None, RECORD=record is not None,
                      num_warps=8)
    return out
