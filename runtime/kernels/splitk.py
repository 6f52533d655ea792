"""In-launch split-K for the decode GEMVs (:mod:`.gemv`, :mod:`.gguf_linear`).

A GEMV over few rows has too few output tiles to fill the SMs, so program ``(n, s)`` reduces
only the ``s``-th of ``SPLIT_K`` slices of K for column tile ``n``. Instead of a second kernel
summing the slices, each program stores its float32 partial tile, then bumps tile ``n``'s counter
(release/acquire, :func:`arrive`); the program that arrives last sums every slice's partial in
slice order (:func:`sum_partials`, deterministic: the same bits however the programs were
scheduled), applies the epilogue, stores, and puts the counter back to zero for the next launch
(:func:`depart`). Partial tiles live at ``part[(s · n_tiles + n) · TILE]``; counters ``[n_tiles]``
int32 are zeroed once when allocated (a captured CUDA graph keeps them).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["slice_ok", "sum_partials", "arrive", "depart", "meet_rows"]


@triton.jit
def slice_ok(s, count, like):
    """``s < count`` broadcast to ``like``'s shape (the interpreter takes no scalar mask for a tile)."""
    return tl.full(like.shape, 0, tl.int32) + s < count


@triton.jit
def arrive(lock_ptr, tile, SPLIT_K):
    """After this program stored its partial: count it in for ``tile``; True for the last slice."""
    tl.debug_barrier()                  # every thread's partial stores come before the release
    return tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1


@triton.jit
def depart(lock_ptr, tile):
    """The last program: reset ``tile``'s counter (read again only by a later launch)."""
    tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed")


@triton.jit
def sum_partials(slab, pid_n, n_tiles, SPLIT_K, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 ONE_PART_ROW: tl.constexpr, rm):
    """Σ_s of the slices' partials of column tile ``pid_n`` (``slab``: a tile's offsets: ``[BLOCK_N]``
    row sums with ``ONE_PART_ROW``, else ``[BLOCK_N, BLOCK_M]``), added in slice order, returned as
    a ``[BLOCK_N, BLOCK_M]`` tile (row sums in column ``rm == 0``). The loads go out 8 (row sums)
    or 4 (tiles) slices at a time: a plain loop waits one L2 round trip per slice (SASS: each
    iteration's loads were issued after the previous iteration's adds), which cost an int4 GEMV
    split 16 ways most of its time. Masked-off slices add zeros, so the sum is bit-identical to
    the one-by-one loop."""
    if ONE_PART_ROW:
        row = tl.zeros([BLOCK_N], tl.float32)
        for s0 in range(0, SPLIT_K, 8):
            for i in tl.static_range(8):        # straight-line code: the loads are issued together
                t = (s0 + i) * n_tiles + pid_n
                row += tl.load(slab + t.to(tl.int64) * BLOCK_N, mask=slice_ok(s0 + i, SPLIT_K, row), other=0.0,
                               cache_modifier=".cg")
        total = tl.where((rm == 0)[None, :], row[:, None], 0.0)
    else:
        total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for s0 in range(0, SPLIT_K, 4):
            for i in tl.static_range(4):
                t = (s0 + i) * n_tiles + pid_n
                total += tl.load(slab + t.to(tl.int64) * (BLOCK_N * BLOCK_M), mask=slice_ok(s0 + i, SPLIT_K, total),
                                 other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def meet_tile(tile, part_ptr, lock_ptr, pid_n, pid_s, SPLIT_K, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
              SPLIT: tl.constexpr):
    """The meeting of a GEMV's slices for a ``[BLOCK_N, BLOCK_M]`` tile of sums (column tile ``pid_n``,
    slice ``pid_s``; several activation rows). Returns ``(tile, last)``: with ``SPLIT`` the tile is
    stored as the slice's partial and the last slice to arrive gets their sum in slice order (the
    others get ``last`` False); without, the tile itself and True."""
    if SPLIT:
        n_tiles = tl.num_programs(0)
        rm = tl.arange(0, BLOCK_M)
        slab = part_ptr + tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rm[None, :]
        tl.store(slab + (pid_s * n_tiles + pid_n).to(tl.int64) * (BLOCK_N * BLOCK_M), tile)
        last = arrive(lock_ptr, pid_n, SPLIT_K)
        if last:
            tile = sum_partials(slab, pid_n, n_tiles, SPLIT_K, BLOCK_N, BLOCK_M, False, rm)
            depart(lock_ptr, pid_n)
    else:
        last = pid_s == 0
    return tile, last


@triton.jit
def meet_rows(row, part_ptr, lock_ptr, pid_n, pid_s, SPLIT_K, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """The one-row meeting of a GEMV's slices: ``row`` is this program's ``[BLOCK_N]`` sums of
    column tile ``pid_n`` over slice ``pid_s``. Returns ``(tile, last)``: with ``SPLIT`` the row is
    stored as the slice's partial and the last slice to arrive gets their sum in slice order as a
    ``[BLOCK_N, 1]`` tile (the others get ``last`` False); without, the row itself and True."""
    rm = tl.arange(0, 1)
    tile = tl.expand_dims(row, 1)
    if SPLIT:
        n_tiles = tl.num_programs(0)
        slab = part_ptr + tl.arange(0, BLOCK_N)
        tl.store(slab + (pid_s * n_tiles + pid_n).to(tl.int64) * BLOCK_N, row)
        last = arrive(lock_ptr, pid_n, SPLIT_K)
        if last:
            tile = sum_partials(slab, pid_n, n_tiles, SPLIT_K, BLOCK_N, 1, True, rm)
            depart(lock_ptr, pid_n)
    else:
        last = pid_s == 0
    return tile, last
