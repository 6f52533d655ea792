"""Sampling kernels: penalties + temperature, the truncation threshold, and a seeded Gumbel-max draw.

``penalize`` (one launch, rows cut into slices): ``x = penalised(l) / T`` with the HF repetition
penalty on tokens seen in the prompt or generated and the OpenAI presence/frequency penalties on
generated tokens (counts per request slot, kept on the device).

``threshold`` (one program per row): from each row's sorted prefix (``torch.topk``), the cut
``thr`` of min-p, top-k and top-p (see ``graphdsl.runtime.serving.sampler`` for the math).

``argmax``: a row argmax spread over the GPU, optionally advancing decode inputs (the decode
graph's greedy epilogue).

``gumbel_argmax``: for row ``r`` of ``x[R, V]`` and ``thr[r]`` (it can also write the tokens into
the next step's inputs and count them for the penalties)::

    token[r] = argmax_{t : x[r, t] >= thr[r]}  x[r, t] + g(seed[r], counter[r], t)
    g = -log(-log(u)),  u = (hash32(seed, counter, t) >> 9 + 0.5) / 2**23   in (0, 1)

(23 bits: with 24, the largest value plus 0.5 rounds up to 2**24 in float32, u = 1 and g = +inf.)

which draws ``t`` with probability ``softmax(x)`` restricted to the kept tokens. ``hash32`` is a
counter-based integer hash (:func:`hash_uniform` is the same function in torch): the noise of a
token depends only on the request's seed, the position being drawn (``counter``) and the token id,
so a request's draws are independent of its batch neighbours and replay after a preemption.
Ties in the score go to the lowest token id. Each row is cut into slices, one program per slice
(so a batch of one still fills the GPU); the last slice of a row to finish (an arrival counter)
reduces the slices' winners, so a draw is one launch.
Integer arithmetic is done in int64 on values below 2**32, with products split in 16-bit halves
so nothing overflows, in both implementations.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

from .pdl import pdl_launch, pdl_wait
from .splitk import arrive, depart

__all__ = ["gumbel_argmax", "hash_uniform", "gumbel_argmax_reference", "penalize", "threshold", "argmax"]

_M1, _M2, _GOLDEN = 0x7FEB352D, 0x846CA68B, 0x9E3779B9
_MASK = 0xFFFFFFFF


@triton.jit
def _mul32(x, c: tl.constexpr):
    """``x * c mod 2**32`` for int64 ``0 <= x < 2**32`` without overflowing int64."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & 0xFFFFFFFF


@triton.jit
def _mix(x):
    """A 32-bit integer finaliser (xor-shift / multiply rounds) on int64 values below 2**32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


@triton.jit
def _noise(idx, ctr, s_hi, s_lo):
    """g(seed, counter, t) of the module docstring for the token ids ``idx`` (float32)."""
    h = _mix((idx.to(tl.int64) + 0x9E3779B9) & 0xFFFFFFFF)
    h = _mix(h ^ ctr)
    h = _mix(h ^ s_hi)
    h = _mix(h ^ s_lo)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _gumbel_scores(x, idx, inside, thr, ctr, s_hi, s_lo):
    """``x + g(t)`` for the kept tokens ``t = idx`` (``inside`` and ``x >= thr``), -inf elsewhere."""
    return tl.where(inside & (x >= thr), x + _noise(idx, ctr, s_hi, s_lo), float("-inf"))


@triton.jit
def _running_best(best, best_i, score, start):
    """``(best, best_i)`` after a block of scores for tokens ``start ...``: the block's first
    maximum replaces them only when strictly larger, so earlier (lower) ids keep ties."""
    bmax = tl.max(score, axis=0)
    take = bmax > best
    return tl.where(take, bmax, best), tl.where(take, start + tl.argmax(score, axis=0).to(tl.int64), best_i)


@triton.jit
def _row_seed(row, seed_ptr, ctr_ptr):
    """Row ``row``'s ``(counter, seed's high word, seed's low word)`` as the noise takes them."""
    seed = tl.load(seed_ptr + row)
    return tl.load(ctr_ptr + row) & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


@triton.jit
def _gumbel_argmax_kernel(
    x_ptr,            # float32 [R, V] (row stride x_stride): processed logits (any float dtype without NOISE)
    x_stride,
    thr_ptr,          # float32 [R]: keep tokens with x >= thr
    seed_ptr,         # int64 [R]: per-row seed
    ctr_ptr,          # int64 [R]: per-row RNG counter (the position being drawn)
    best_ptr,         # float32 [R, S]: best score of each slice of the row
    arg_ptr,          # int64 [R, S]: its token id (lowest on ties)
    arrive_ptr,       # int32 [R]: arrival counters, zero between launches (the last slice resets its row's)
    V,                # vocabulary size
    SLICE,            # tokens per program (a multiple of BLOCK)
    S,                # slices per row
    temp_ptr,         # MIXED: float32 [R] temperatures; rows at 0 take the plain argmax of x
    out_ptr,          # int64 [R]: the row's token, written
    ids_ptr,          # int64 [R]: decode inputs written (ADVANCE, IDS) (else unused)
    pos_ptr,          # int64 [R]
    lens_ptr,         # int32 [R]
    slot_ptr,         # RECORD: int64 [R] penalty slot of each row (< 0: none)
    counts_ptr,       # RECORD: int32 [slots, V] generated-token counts
    NOISE: tl.constexpr,   # False: a plain argmax of x (thr, seed and counter unused)
    BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr,  # S padded to a power of two
    MIXED: tl.constexpr = False,
    ADVANCE: tl.constexpr = False,
    IDS: tl.constexpr = False,
    RECORD: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """Program ``(r, j)``: the best score of slice ``j`` of row ``r`` (``SLICE`` tokens) and its
    lowest token id, stored as the slice's partial; the last slice of the row to arrive (an
    acquire/release counter) picks the best partial, lowest slice first on ties, and emits the
    token (:func:`_finish_row`)."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    pdl_wait(USE_PDL)
    if NOISE:
        greedy = False
        if MIXED:
            greedy = tl.load(temp_ptr + row) == 0.0
        thr = tl.load(thr_ptr + row)
        ctr, s_hi, s_lo = _row_seed(row, seed_ptr, ctr_ptr)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int64) + sl * SLICE
    for start in range(sl * SLICE, tl.minimum(sl * SLICE + SLICE, V), BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inside = idx < V
        x = tl.load(x_ptr + row * x_stride + idx, mask=inside, other=float("-inf")).to(tl.float32)
        if NOISE:
            score = _gumbel_scores(x, idx, inside, thr, ctr, s_hi, s_lo)
            if MIXED:
                score = tl.where(greedy, x, score)
        else:
            score = x
        best, best_i = _running_best(best, best_i, score, start)
    tl.store(best_ptr + row * S + sl, best)
    tl.store(arg_ptr + row * S + sl, best_i)
    if arrive(arrive_ptr, row, S):      # the row's last slice (kernels/splitk.py's counter)
        _finish_row(row, best_ptr, arg_ptr, S, out_ptr, ids_ptr, pos_ptr, lens_ptr, slot_ptr, counts_ptr, V,
                    ADVANCE, BLOCK_S, IDS, RECORD)
        depart(arrive_ptr, row)


@triton.jit
def _row_penalties(row, temp_ptr, slot_ptr, rep_ptr, pres_ptr, freq_ptr, V):
    """Row ``row``'s ``(1 / T or 1, slot, rho, presence, frequency, tokens below which the
    penalties apply)``: the second-to-last is 0 without a slot."""
    t = tl.load(temp_ptr + row)
    slot = tl.load(slot_ptr + row)
    return (1.0 / tl.where(t > 0, t, 1.0), slot, tl.load(rep_ptr + row), tl.load(pres_ptr + row),
            tl.load(freq_ptr + row), tl.where(slot >= 0, V, 0))


@triton.jit
def _penalized(l_ptr, l_stride, row, idx, inside, inv_t, slot, rho, pres, freq, end_pen, counts_ptr, mask_ptr, V,
               PENALTIES: tl.constexpr):
    """x = penalised(l) / T over the tokens ``idx`` of row ``row`` (``_penalize_kernel``'s math;
    float32, -inf outside the vocabulary)."""
    l = tl.load(l_ptr + row * l_stride + idx, mask=inside, other=float("-inf")).to(tl.float32)
    if PENALTIES:
        on = idx < end_pen
        s = tl.maximum(slot, 0)
        cnt = tl.load(counts_ptr + s * V + idx, mask=on, other=0)
        seen = (tl.load(mask_ptr + s * V + idx, mask=on, other=0) != 0) | (cnt > 0)
        l = tl.where(on & seen, tl.where(l > 0, l / rho, l * rho), l)
        l = tl.where(on, l - (freq * cnt.to(tl.float32) + pres * (cnt > 0).to(tl.float32)), l)
    return l * inv_t


@triton.jit
def _penalize_kernel(
    l_ptr,            # float32, bfloat16 or float16 [R, V] (row stride l_stride): logits, read
    l_stride,
    x_ptr,            # float32 [R, V] contiguous: processed logits, written
    temp_ptr,         # float32 [R]: temperature (0 => greedy: no division)
    slot_ptr,         # int64 [R]: penalty slot, -1 => none
    rep_ptr,          # float32 [R]: repetition penalty (HF)
    pres_ptr,         # float32 [R]: presence penalty (OpenAI)
    freq_ptr,         # float32 [R]: frequency penalty (OpenAI)
    counts_ptr,       # int32 [S, V]: generated-token counts per slot
    mask_ptr,         # int8 [S, V]: prompt-token mask per slot
    V,
    SLICE,            # tokens per program (a multiple of BLOCK)
    PENALTIES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """x = penalised(l) / T: l_t / rho or l_t * rho (rho: repetition, on tokens seen in the prompt or
    generated), minus freq * count_t + pres * [count_t > 0]; rows with T == 0 are not divided."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    inv_t, slot, rho, pres, freq, end_pen = _row_penalties(row, temp_ptr, slot_ptr, rep_ptr, pres_ptr, freq_ptr, V)
    for start in range(sl * SLICE, tl.minimum(sl * SLICE + SLICE, V), BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inside = idx < V
        x = _penalized(l_ptr, l_stride, row, idx, inside, inv_t, slot, rho, pres, freq, end_pen, counts_ptr,
                       mask_ptr, V, PENALTIES)
        tl.store(x_ptr + row * V + idx, x, mask=inside)


@triton.jit
def _threshold_of(v, j, W, min_p, k, p, EXTRA: tl.constexpr):
    """thr = max(min-p cut, k-th largest, top-p cut) of one row from ``v``, its W largest x in
    descending order (``v[j]``, -inf at ``j >= W``). Top-p keeps the tokens whose strictly larger
    kept tokens hold < p of the kept mass: with e the kept probabilities in descending order and c
    the exclusive prefix sums, J = #{j: c_j < p * sum(e)} and the cut is v[J - 1] (a tie group
    straddling J - 1 is kept whole)."""
    inside = j < W
    m = tl.max(v, axis=0)
    neg = float("-inf")
    thr = tl.where(min_p > 0, m + tl.log(tl.maximum(min_p, 1e-30)), neg)
    kth = tl.max(tl.where(j == tl.minimum(tl.maximum(k - 1, 0), W - 1), v, neg), axis=0)
    thr = tl.where((k > 0) & (k <= W), tl.maximum(thr, kth), thr)
    limit = tl.where(k > 0, k + EXTRA, W)
    kept = inside & (v >= thr) & (j < limit)
    e = tl.where(kept, tl.exp(v - m), 0.0)
    c = tl.cumsum(e, axis=0) - e
    z = tl.sum(e, axis=0)
    J = tl.sum((kept & (c < p * z)).to(tl.int32), axis=0)
    t_p = tl.max(tl.where(j == tl.maximum(J - 1, 0), v, neg), axis=0)
    return tl.where(p < 1.0, tl.maximum(thr, t_p), thr)


@triton.jit
def _threshold_kernel(
    vals_ptr,         # float32 [R, W]: each row's W largest x, descending (W <= BLOCK_W)
    W,
    min_p_ptr,        # float32 [R]
    k_ptr,            # int64 [R]: top-k, 0 => off
    p_ptr,            # float32 [R]: top-p, 1 => off
    thr_ptr,          # float32 [R]: the threshold, written (keep x >= thr)
    EXTRA: tl.constexpr,   # ties past the k-th value counted into the top-p mass
    BLOCK_W: tl.constexpr,
):
    """thr of each row from its sorted prefix (``_threshold_of``)."""
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK_W)
    v = tl.load(vals_ptr + row * W + j, mask=j < W, other=float("-inf"))
    thr = _threshold_of(v, j, W, tl.load(min_p_ptr + row), tl.load(k_ptr + row), tl.load(p_ptr + row), EXTRA)
    tl.store(thr_ptr + row, thr)


# blocks a program at least (benchmarks/decode_ab.py patches it): at 8, the batch-1 draw's programs
# loaded their blocks one after another, 8.8 µs after the lm_head in the Llama-3.2-1B step against
# 4.0 at 1 (H200, decode_timeline.py)
_SLICE_BLOCKS = 1


def _slices(R: int, V: int, block: int) -> tuple[int, int]:
    """(tokens per program, programs per row): ``_SLICE_BLOCKS`` blocks a program at batch 1 (one
    load a program), whole rows at large batch, so one launch fills the GPU either way."""
    slice_ = block * max(_SLICE_BLOCKS, triton.cdiv(triton.cdiv(V, block), max(1, 1024 // max(R, 1))))
    return slice_, triton.cdiv(V, slice_)


def penalize(logits: torch.Tensor, temperature, slot, repetition, presence, frequency, counts, prompt_mask):
    """``_penalize_kernel`` on ``logits`` ([R, V], float32 or the model's 16-bit dtype: read as
    float32, an exact cast); ``counts``/``prompt_mask`` None skip the penalties. Returns the new
    float32 [R, V] tensor."""
    R, V = logits.shape
    x = torch.empty(R, V, dtype=torch.float32, device=logits.device)
    if R == 0:
        return x
    block = 1024
    slice_, S = _slices(R, V, block)
    pen = counts is not None
    if not pen:
        counts = prompt_mask = logits        # unused pointers
    else:
        prompt_mask = prompt_mask.view(torch.int8)
    _penalize_kernel[(R, S)](logits, logits.stride(0), x, temperature, slot, repetition, presence, frequency,
                             counts, prompt_mask, V, slice_, PENALTIES=pen, BLOCK=block, num_warps=4)
    return x


def threshold(vals: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              extra: int) -> torch.Tensor:
    """``_threshold_kernel`` over sorted prefixes ``vals`` [R, W] (W <= 4096)."""
    R, W = vals.shape
    if W > 4096:
        raise GraphDSLError(f"threshold: the sorted prefix must be at most 4096 wide, got {W}")
    thr = torch.empty(R, dtype=torch.float32, device=vals.device)
    if R:
        _threshold_kernel[(R,)](vals, W, min_p, top_k, top_p, thr, EXTRA=extra,
                                BLOCK_W=max(16, triton.next_power_of_2(W)), num_warps=4)
    return thr


def _check(x: torch.Tensor, thr: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        raise GraphDSLError(f"gumbel_argmax: x must be a float32 [R, V] tensor with unit stride in V, got "
                            f"{tuple(x.shape)} {x.dtype} strides {tuple(x.stride())}")
    R = x.shape[0]
    for name, t, dt in (("thr", thr, torch.float32), ("seed", seed, torch.int64), ("counter", counter, torch.int64)):
        if t.shape != (R,) or t.dtype != dt or t.device != x.device or (R and t.stride(0) != 1):
            raise GraphDSLError(f"gumbel_argmax: {name} must be a contiguous {dt} [{R}] on {x.device}, got "
                                f"{t.dtype} {list(t.shape)} (stride {t.stride()}) on {t.device}")


def gumbel_argmax(x: torch.Tensor, thr: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor, *,
                  temperature: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                  record: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The draw of the module docstring on ``x``'s device: int64 ``[R]``, in one launch (the
    slices' programs, the last of a row to finish picking the best slice). ``temperature``
    (float32 ``[R]``): rows at 0 take the plain argmax of ``x`` instead. Optionally ``ids`` (int64
    ``[R]``) receives the tokens too (the next decode step's inputs), and ``record = (slot [R]
    int64, counts [slots, V] int32)`` adds one to ``counts[slot[r], token[r]]`` for rows with
    ``slot[r] >= 0`` (each slot at most one row)."""
    _check(x, thr, seed, counter)
    return _draw(x, noise=(thr, seed, counter), temperature=temperature, ids=ids, record=record)


def check_outputs(R: int, V: int, ids: torch.Tensor | None, record: tuple | None) -> None:
    """The ``ids`` / ``record`` arguments of a draw (see :func:`gumbel_argmax`), or an error naming them."""
    for name, t, dt in (("ids", ids, torch.int64), ("record's slot", None if record is None else record[0],
                                                    torch.int64)):
        if t is not None and (t.shape != (R,) or t.dtype != dt or t.stride(0) != 1):
            raise GraphDSLError(f"sampling: {name} must be a contiguous {dt} [{R}], got {t.dtype} {list(t.shape)}")
    if record is not None and (record[1].dim() != 2 or record[1].shape[1] != V or record[1].dtype != torch.int32
                               or not record[1].is_contiguous()):
        raise GraphDSLError(f"sampling: record's counts must be a contiguous int32 [slots, {V}], got "
                            f"{record[1].dtype} {list(record[1].shape)}")


def _draw(x: torch.Tensor, *, noise: tuple | None = None, temperature=None, advance=None, ids=None,
          record=None) -> torch.Tensor:
    """One launch of ``_gumbel_argmax_kernel`` over ``x [R, V]`` (``noise = (thr, seed, counter)``,
    None: a plain argmax): int64 ``[R]``; ``advance``, ``ids`` and ``record`` as the callers say."""
    R, V = x.shape
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R == 0:
        return out
    check_outputs(R, V, ids, record)
    block = 1024
    slice_, S = _slices(R, V, block)
    best = torch.empty(R, S, dtype=torch.float32, device=x.device)
    arg = torch.empty(R, S, dtype=torch.int64, device=x.device)
    thr, seed, counter = noise if noise is not None else (x, x, x)
    adv_ids, pos, lens = advance if advance is not None else (ids if ids is not None else out, out, out)
    slot, counts = record if record is not None else (out, out)
    _gumbel_argmax_kernel[(R, S)](x, x.stride(0), thr, seed, counter, best, arg, _arrivals(x.device, R), V, slice_,
                                  S, x if temperature is None else temperature, out, adv_ids, pos, lens, slot, counts,
                                  NOISE=noise is not None, BLOCK=block, BLOCK_S=max(2, triton.next_power_of_2(S)),
                                  MIXED=temperature is not None, ADVANCE=advance is not None, IDS=ids is not None,
                                  RECORD=record is not None, num_warps=4, **pdl_launch(x.device))
    return out


_ARRIVALS: dict[str, list[torch.Tensor]] = {}


def _arrivals(device: torch.device, rows: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for a draw of ``rows`` rows on ``device``: the first ``rows`` of
    a kept buffer of at least 1024 (each launch leaves its counters at zero, so draws of any batch
    share one; a bigger batch adds a bigger buffer, and none is freed: a captured CUDA graph holds
    its address). Draws run one at a time on a stream, as the engine's kernels do."""
    kept = _ARRIVALS.setdefault(str(device), [])
    for buf in kept:
        if buf.numel() >= rows:
            return buf[:rows]
    kept.append(torch.zeros(max(rows, 1024), dtype=torch.int32, device=device))
    return kept[-1][:rows]


@triton.jit
def _finish_row(row, best_ptr, arg_ptr, S, out_ptr, ids_ptr, pos_ptr, lens_ptr, slot_ptr, counts_ptr, V,
                ADVANCE: tl.constexpr, BLOCK_S: tl.constexpr, IDS: tl.constexpr, RECORD: tl.constexpr):
    """Row ``row``'s token = the lowest id of its best slice (partials ``best``/``arg`` ``[R, S]``,
    written by other programs: read from L2). ADVANCE: the next decode step's inputs, input_ids <-
    token, and positions, seq_lens + 1 where seq_lens > 0 (padding rows stay); IDS: input_ids <-
    token only; RECORD: counts[slot, token] += 1 where slot >= 0 (one row a slot, so no atomics)."""
    j = tl.arange(0, BLOCK_S)
    b = tl.load(best_ptr + row * S + j, mask=j < S, other=float("-inf"), cache_modifier=".cg")
    pick = tl.argmax(b, axis=0)
    tok = tl.load(arg_ptr + row * S + pick, cache_modifier=".cg")
    _emit(row, tok, out_ptr, ids_ptr, slot_ptr, counts_ptr, V, ADVANCE or IDS, RECORD)
    if ADVANCE:
        n = tl.load(lens_ptr + row)
        step = (n > 0).to(tl.int32)
        tl.store(lens_ptr + row, n + step)
        tl.store(pos_ptr + row, tl.load(pos_ptr + row) + step.to(tl.int64))


@triton.jit
def _emit(row, tok, out_ptr, ids_ptr, slot_ptr, counts_ptr, V, IDS: tl.constexpr, RECORD: tl.constexpr):
    """Row ``row`` drew ``tok``: ``out[row] = tok``; IDS: ``ids[row] = tok`` (the next step's input);
    RECORD: ``counts[slot, tok] += 1`` where ``slot[row] >= 0`` (one row a slot, so no atomics)."""
    tl.store(out_ptr + row, tok)
    if IDS:
        tl.store(ids_ptr + row, tok)
    if RECORD:
        slot = tl.load(slot_ptr + row)
        if slot >= 0:
            c = counts_ptr + slot * V + tok
            tl.store(c, tl.load(c) + 1)


def argmax(x: torch.Tensor, advance: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *,
           ids: torch.Tensor | None = None, record: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Row argmax of ``x`` [R, V] (float32, bfloat16 or float16; lowest id on ties) in one launch
    that fills the GPU even at R = 1 (``torch.argmax`` reduces a row in one block). A 16-bit row
    gives the token its float32 cast would: the cast is exact. ``advance = (input_ids, positions,
    seq_lens)`` ([R] each, contiguous) also moves decode inputs to the next step, as
    :func:`_finish_row` says (the decode graph's epilogue); ``ids`` and ``record`` as for
    :func:`gumbel_argmax`."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.stride(1) != 1:
        raise GraphDSLError(f"argmax: x must be a float32, bfloat16 or float16 [R, V] tensor with unit stride in V, "
                            f"got {tuple(x.shape)} {x.dtype} strides {tuple(x.stride())}")
    R, V = x.shape
    if R == 0:
        return torch.empty(R, dtype=torch.int64, device=x.device)
    if advance is not None:
        for name, t, dt in zip(("input_ids", "positions", "seq_lens"), advance,
                               (torch.int64, torch.int64, torch.int32)):
            if t.shape != (R,) or t.dtype != dt or t.stride(0) != 1:
                raise GraphDSLError(f"argmax: advance's {name} must be a contiguous {dt} [{R}], got {t.dtype} "
                                    f"{list(t.shape)}")
    return _draw(x, advance=advance, ids=ids, record=record)


# -- the same function in torch -------------------------------------------------------------------
def _mul32_t(x: torch.Tensor, c: int) -> torch.Tensor:
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK


def _mix_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32_t(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32_t(x, _M2)
    return x ^ (x >> 16)


def hash_uniform(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """``u[r, t]`` in (0, 1), float32 ``[R, vocab]``: the kernel's uniform noise, in torch."""
    t = torch.arange(vocab, dtype=torch.int64, device=seed.device)
    h = _mix_t((t + _GOLDEN) & _MASK)[None, :]
    h = _mix_t(h ^ (counter & _MASK)[:, None])
    h = _mix_t(h ^ ((seed >> 32) & _MASK)[:, None])
    h = _mix_t(h ^ (seed & _MASK)[:, None])
    return bits_to_unit(h)


def bits_to_unit(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash (int64 values below 2**32) to float32 in (0, 1), as the kernel does it."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def gumbel_argmax_reference(x: torch.Tensor, thr: torch.Tensor, seed: torch.Tensor,
                            counter: torch.Tensor) -> torch.Tensor:
    """:func:`gumbel_argmax` in torch (any device)."""
    _check(x, thr, seed, counter)
    g = -torch.log(-torch.log(hash_uniform(seed, counter, x.shape[1])))
    score = torch.where(x >= thr[:, None], x + g, torch.full_like(x, float("-inf")))
    return score.argmax(dim=1)
