"""A persistent decode chain without grid barriers: tiles claimed from one queue in order, each
waiting only for the projection it reads, against the engine's chained GEMVs.

    python benchmarks/dataflow.py [--layers 32] [--shapes 8b,1b] [--configs 64x256x4x5,...]
        [--narrow 0,1] [--backoff 0,64] [--ahead 2,4] [--without-waits]

``benchmarks/persistent.py`` found that a persistent grid with a barrier between projections costs
what the launches do: each barrier waits for the slowest program (every program owns fixed rows)
and then releases everyone at once (docs/performance-log.md, "A persistent kernel with the engine's
streams"). Its streams without the barriers were 10% faster than the engine's launches on the 8B
shape, which is what a step could gain if the dependencies cost nothing. This asks how much of that
a schedule keeps where no program waits for work it does not need:

* **One queue of tiles.** The layers' projections are cut into row tiles (``BLOCK_N`` rows, all of
  ``K``; o and down ``BLOCK_N / 2`` rows of ``2 · BLOCK_K`` steps with ``--narrow 1``) and numbered in
  execution order: layer by layer, qkv, o, gate/up, down. A program takes the next number with one
  atomic add, computes that tile, and takes another, so the SMs that finish early take the next
  tiles and no program owns more of a projection than it can stream.
* **Completion counts instead of barriers.** After a tile's stores a program adds 1 to its
  projection's count (release). A tile waits (load-acquire polls, optionally ``nanosleep`` between
  them) only until the projection before its own has counted every tile; before that it asks L2 for
  its first two K steps (weights never depend on the step). No deadlock: the tiles a tile waits for
  were taken before it, by programs that are running (the grid is resident at once) and wait only
  for earlier projections.

Write-after-read is safe by the same order: a projection overwrites a buffer (``qkv``, ``act``,
``h``, ``hg``) only after the projection it waits for has finished, and that one started only after
every earlier reader had finished.

The arithmetic is ``benchmarks/persistent.py``'s (its ``Layers``, ``reference`` and stores): each
normed projection multiplies its sums by ``rsqrt(mean(h²) + eps)`` computed from the whole ``h``.
Printed: µs a layer against the weight bytes at the measured copy bandwidth, beside the engine's
chain and persistent.py's barrier-free streams (``--without-waits`` also times this schedule with
its waits left out: results wrong, the queue's own cost). Each configuration is checked against
the float32 reference of two layers before it is timed. Under the interpreter one program runs the
queue, which is how the tests check its arithmetic.
"""
from __future__ import annotations

import functools
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import graph_ms  # noqa: E402
from persistent import (EPS, SHAPES, Layers, _ints, _poll, _store, chain_arguments, resident,  # noqa: E402
                        shape_rows, start_table)

from graphdsl.runtime.kernels.pdl import prefetch_l2  # noqa: E402


@triton.jit
def _sleep(ns):
    """``nanosleep`` for about ``ns`` nanoseconds (a hint: the SM may wake it sooner)."""
    return tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.u32 $0, 0;", "=r,r", [ns], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _wait_count(ptr, want, BACKOFF: tl.constexpr, ON_GPU: tl.constexpr):
    """Spin until the int32 count at ``ptr`` reaches ``want`` (acquire): load-acquires on a GPU,
    ``BACKOFF`` ns of ``nanosleep`` between them (0: none); atomic adds of 0 under the interpreter."""
    if ON_GPU:
        while _poll(ptr) < want:
            if BACKOFF > 0:
                _sleep(BACKOFF)
    else:
        while tl.atomic_add(ptr, 0, sem="acquire") < want:
            pass


@triton.jit
def _row_tile(w_ptr, K, row0, N, x_ptr, h_ptr, y_ptr, yg_ptr, g_ptr, eps, H: tl.constexpr, NORM: tl.constexpr,
              SWIGLU: tl.constexpr, ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              STAGES: tl.constexpr, ON_GPU: tl.constexpr):
    """Rows ``row0 ..`` (``< N``) of ``w [N, K] · x``: the pipelined ``tl.dot`` loop of the engine's
    GEMV (the row in column 0 of a ``[BLOCK_K, 16]`` tile) over all of ``K``, stored as
    persistent.py's ``_store`` stores (the same bits). ``NORM``: the sums times
    ``rsqrt(mean(h²) + eps)`` of the whole ``h [H]``; ``ADD``: added to the rows of ``y``. Both read
    what they need before the loop and use it after, so those reads wait behind the weight stream
    instead of ahead of it."""
    rows = row0 + tl.arange(0, BLOCK_N)
    ok = rows < N
    if NORM:
        hv = tl.load(h_ptr + tl.arange(0, H), cache_modifier=".cg")
    if ADD:
        resid = tl.load(y_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg")
    m = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for ks in tl.range(0, K // BLOCK_K, num_stages=STAGES):
        cols = ks * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=ok[:, None], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptr + cols[:, None] + m[None, :] * 0, mask=(m == 0)[None, :], other=0.0, cache_modifier=".cg")
        if not ON_GPU:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, x, acc)
    y = tl.sum(acc, axis=1)
    if NORM:
        y = y * tl.rsqrt(tl.sum(hv * hv, axis=0) / H + eps)
    else:
        y = y * 1.0
    if ADD:
        h = resid + y
        tl.store(y_ptr + rows, h, mask=ok)
        tl.store(yg_ptr + rows, (h * tl.load(g_ptr + rows, mask=ok, other=0.0).to(tl.float32)).to(tl.bfloat16),
                 mask=ok)
    else:
        _store(y, row0, N, y_ptr, yg_ptr, g_ptr, SWIGLU, False, BLOCK_N)


@triton.jit
def _ask_l2(w_ptr, K, row0, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr,
            ON_GPU: tl.constexpr):
    """Ask L2 for the first ``AHEAD`` ``BLOCK_K`` steps of rows ``row0 ..`` of ``w [N, K]`` (not
    under the interpreter, which runs no PTX)."""
    if ON_GPU:
        rows = tl.minimum(row0 + tl.arange(0, BLOCK_N), N - 1)
        prefetch_l2(w_ptr + rows.to(tl.int64)[:, None] * K, 0, K, BLOCK_K * 2 * AHEAD // 128, 64)


@triton.jit
def _queue(h_ptr, hg_ptr, qkv_ptr, act_ptr, g1_ptr, g2_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, done_ptr, ticket_ptr,
           LAYERS, eps, H: tl.constexpr, QKV: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ON_GPU: tl.constexpr, NARROW: tl.constexpr,
           BACKOFF: tl.constexpr, AHEAD: tl.constexpr, WAIT: tl.constexpr):
    """The module docstring's queue over ``LAYERS`` layers. ``done [4 · LAYERS]`` counts each
    projection's finished tiles and ``ticket [1]`` numbers the tiles taken; both zero at launch.
    ``WAIT`` False leaves the waits out (a timing of the queue alone; results wrong)."""
    BN_O: tl.constexpr = BLOCK_N >> NARROW
    BK_O: tl.constexpr = BLOCK_K << NARROW
    T_Q: tl.constexpr = (QKV + BLOCK_N - 1) // BLOCK_N
    T_O: tl.constexpr = (H + BN_O - 1) // BN_O
    T_G: tl.constexpr = (2 * INTER + BLOCK_N - 1) // BLOCK_N
    PER: tl.constexpr = T_Q + T_O + T_G + T_O
    total = PER * LAYERS
    t = tl.atomic_add(ticket_ptr, 1)
    while t < total:
        layer = t // PER
        r = t - layer * PER
        lw = tl.cast(layer, tl.int64)
        if r < T_Q:                                  # qkv: waits for the last layer's down
            j = 4 * layer
            row0 = r * BLOCK_N
            w = wqkv_ptr + lw * QKV * H
            _ask_l2(w, H, row0, QKV, BLOCK_N, BLOCK_K, AHEAD, ON_GPU)
            if WAIT and j > 0:
                _wait_count(done_ptr + j - 1, T_O, BACKOFF, ON_GPU)
            _row_tile(w, H, row0, QKV, hg_ptr, h_ptr, qkv_ptr, hg_ptr, g1_ptr, eps, H, True, False, False,
                      BLOCK_N, BLOCK_K, STAGES, ON_GPU)
        elif r < T_Q + T_O:                          # o: reads the q rows
            j = 4 * layer + 1
            row0 = (r - T_Q) * BN_O
            w = wo_ptr + lw * H * H
            _ask_l2(w, H, row0, H, BN_O, BK_O, AHEAD, ON_GPU)
            if WAIT:
                _wait_count(done_ptr + j - 1, T_Q, BACKOFF, ON_GPU)
            _row_tile(w, H, row0, H, qkv_ptr, h_ptr, h_ptr, hg_ptr, g2_ptr, eps, H, False, False, True, BN_O, BK_O,
                      STAGES, ON_GPU)
        elif r < T_Q + T_O + T_G:                    # gate/up + SwiGLU
            j = 4 * layer + 2
            row0 = (r - T_Q - T_O) * BLOCK_N
            w = wgu_ptr + lw * 2 * INTER * H
            _ask_l2(w, H, row0, 2 * INTER, BLOCK_N, BLOCK_K, AHEAD, ON_GPU)
            if WAIT:
                _wait_count(done_ptr + j - 1, T_O, BACKOFF, ON_GPU)
            _row_tile(w, H, row0, 2 * INTER, hg_ptr, h_ptr, act_ptr, hg_ptr, g2_ptr, eps, H, True, True, False,
                      BLOCK_N, BLOCK_K, STAGES, ON_GPU)
        else:                                        # down
            j = 4 * layer + 3
            row0 = (r - T_Q - T_O - T_G) * BN_O
            w = wd_ptr + lw * H * INTER
            _ask_l2(w, INTER, row0, H, BN_O, BK_O, AHEAD, ON_GPU)
            if WAIT:
                _wait_count(done_ptr + j - 1, T_G, BACKOFF, ON_GPU)
            _row_tile(w, INTER, row0, H, act_ptr, h_ptr, h_ptr, hg_ptr, g1_ptr, eps, H, False, False, True, BN_O,
                      BK_O, STAGES, ON_GPU)
        tl.debug_barrier()                           # every thread's stores issued before the count
        tl.atomic_add(done_ptr + j, 1, sem="release")
        t = tl.atomic_add(ticket_ptr, 1)


def tiles_per_layer(shape: tuple[int, int, int], block_n: int, narrow: int) -> tuple[int, int, int, int]:
    """Row tiles of qkv, o, gate/up and down in one layer (``_queue``'s ``T_Q, T_O, T_G, T_O``)."""
    h, q, inter = shape
    bn_o = block_n >> narrow
    return -(-q // block_n), -(-h // bn_o), -(-2 * inter // block_n), -(-h // bn_o)


def run_queue(lay: Layers, programs: int, block_n: int, block_k: int, warps: int, stages: int, *, narrow: int = 0,
              backoff: int = 0, ahead: int = 2, wait: bool = True, done: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`_queue` once over ``lay`` (counts zeroed first) and return the ``done`` counts.
    On a GPU the grid must be resident at once (a tile may wait for any earlier one): more programs
    than fit raise ``ValueError``; so do block sizes that do not divide the shape."""
    h, q, inter = lay.shape
    lay.check_tiles(block_n, block_k, narrow)
    if stages < 1:
        raise ValueError(f"the queue runs the pipelined tl.dot loop: STAGES must be at least 1, got {stages}")
    if ahead < 1 or ahead & (ahead - 1) or (lay.h.is_cuda and ahead * block_k < 64):
        raise ValueError(f"the K steps asked of L2 ahead must be a power of two covering at least one 128-byte line "
                         f"(ahead x BLOCK_K >= 64), got {ahead} with BLOCK_K {block_k}")
    if done is None:
        done = torch.zeros(4 * lay.layers + 1, dtype=torch.int32, device=lay.h.device)
    args = (lay.h, lay.hg, lay.qkv, lay.act, lay.g1, lay.g2, lay.wqkv, lay.wo, lay.wgu, lay.wd, done,
            done[4 * lay.layers:], lay.layers, EPS)
    meta = dict(H=h, QKV=q, INTER=inter, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, ON_GPU=lay.h.is_cuda,
                NARROW=narrow, BACKOFF=backoff, AHEAD=ahead, WAIT=wait, num_warps=warps)
    if lay.h.is_cuda:
        fits = resident(_queue.warmup(*args, grid=(programs,), **meta), warps)
        if programs > fits:
            raise ValueError(f"{programs} programs do not fit the GPU at once ({fits} do): a wait could hang")
    done.zero_()
    _queue[(programs,)](*args, **meta)
    return done


def main(argv=None) -> int:
    ap = chain_arguments(__doc__, [(64, 256, 4, 5), (32, 256, 4, 5)],
                         "tiles and loops, comma-separated BLOCK_NxBLOCK_KxWARPSxSTAGES", [0, 1])
    ap.add_argument("--backoff", type=_ints(0), default=[0], help="ns of nanosleep between polls, comma-separated "
                                                                   "(default 0)")
    ap.add_argument("--ahead", type=_ints(1), default=[2],
                    help="K steps of a tile's weights asked of L2 before its wait, comma-separated (default 2)")
    ap.add_argument("--without-waits", action="store_true",
                    help="also time each configuration with its waits left out (the queue alone; results wrong)")
    args = ap.parse_args(argv)
    started = start_table("dataflow.py", args.layers)
    if started is None:
        return 2
    sms, copy = started
    for name in args.shapes:
        lay, row, small, want = shape_rows(name, args.layers, copy)
        done = torch.zeros(4 * args.layers + 1, dtype=torch.int32, device="cuda")
        for per_sm, narrow, (bn, bk, warps, stages), backoff, ahead in itertools.product(
                args.per_sm, args.narrow, args.configs, args.backoff, args.ahead):
            label = (f"queue {bn}x{bk}{' (o, down halved)' if narrow else ''} {stages} stages, {warps} warps, "
                     f"{per_sm}/SM, backoff {backoff} ns, {ahead} steps asked ahead")
            small.reset()
            try:
                got = run_queue(small, sms * per_sm, bn, bk, warps, stages, narrow=narrow, backoff=backoff,
                                ahead=ahead)
            except ValueError as e:
                print(f"| {name} | {label} | skipped: {e} | | | |", flush=True)
                continue
            err = ((small.h - want).norm() / want.norm()).item()
            counts = got[:8].tolist()
            expect = list(tiles_per_layer(SHAPES[name], bn, narrow)) * 2
            if not err < 1e-2 or counts != expect:
                print(f"| {name} | {label} | wrong: relative error {err:.3g}, counts {counts} (want {expect}) | | | |",
                      flush=True)
                continue
            launch = functools.partial(run_queue, lay, sms * per_sm, bn, bk, warps, stages, narrow=narrow,
                                       backoff=backoff, ahead=ahead, done=done)
            row(label, graph_ms(launch) * 1e3 / args.layers)
            if args.without_waits:
                nowait = functools.partial(launch, wait=False)
                row(label + ", no waits (timing only: results wrong)", graph_ms(nowait) * 1e3 / args.layers)
        del lay, small
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
