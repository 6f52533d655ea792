"""A tensor-parallel all-reduce carried by the two decode GEMVs around it: no launch of its own.

In a TP decoder layer the row-parallel o (or down) projection makes a partial row on every rank;
the ranks sum them, add the residual and normalise, and the next column-parallel projection (qkv,
gate|up, the LM head) reads the normed row. The one-shot all-reduce (:mod:`.allreduce`) does the
sum in a launch between the two GEMVs. Here the GEMVs do it (:func:`.gemv.gemv` ``push=`` /
``tp_in=``):

* **push** (the producer, :class:`GemvPush`): the program that finishes an output tile stores the
  tile, rounded to the output dtype as the plain GEMV stores it, into region ``[slot, RANK]`` of
  every rank's buffer (stores cross NVLink, loads never do), then, after a CTA barrier, adds the
  tile's column count to every rank's counter (release, system scope). It never waits for a peer.
* **sum + norm** (the first GEMV reading the normed rows, :class:`GemvTPIn`): after its PDL wait
  each program waits until its own counter holds every rank's columns of the call (``e · N · W``,
  acquire polls), sums the ``W`` partial rows in rank order in float32, rounds, adds the residual
  (rounded), normalises (``weight · (s · rsqrt(mean(s²) + eps))``, in the order of
  :func:`graphdsl.functional.rms_norm` and of the one-shot kernel, so the bits equal that path's),
  stores the normed rows where its K loop reads them and, program 0, the new residual ``s``; then
  its GEMV runs as usual. Every program stores the same normed rows; each reads them only after
  its own stores and a barrier.

The call number ``e`` lives on the device (int64 ``calls [2]``), so CUDA-graph replays keep
counting: a producer reads ``calls[0]`` (``e - 1``) and stores ``e`` into ``calls[1]``; the
consumer reads ``calls[1]`` and stores it into ``calls[0]``. Every program stores the same value,
and no kernel reads a slot that another program of the same launch writes: the PDL waits put
the producer's stores before the consumer's reads and the other way round. Counters count
columns, not tiles, so the launches may tile differently from call to call; they are int64 (no
wrap in any server's life). The slot is ``e mod 2``: a rank pushes into a slot again two calls
later, after its own consumer of the call between waited for every peer's columns of that call,
which each peer pushed only after its consumer of this call was done with the slot.

Every rank must take this path for the same calls in the same order (the ranks run the same
graph on the same shapes, so their backends decide alike), and the first call of a group
exchanges the buffers (:func:`..distributed.collectives.carry_buffers`). Under the CPU interpreter
the release and acquire are atomics on the same addresses, and tests run every rank's producer
before any rank's consumer.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .allreduce import _wait_for

__all__ = ["GemvPush", "GemvTPIn", "CarryBuffers", "local_carry_buffers", "carry_args"]


class CarryBuffers(NamedTuple):
    """One rank's view of a group's carried all-reduce memory: ``buf_ptrs`` / ``cnt_ptrs`` (int64
    ``[W]`` on the device: each rank's data buffer and int64 column counter), this rank's own
    ``buf`` (``2 · W · region`` elements of the rows' dtype) and ``counter`` (int64 ``[2]``, element
    0 counted), its ``calls`` (int64 ``[2]``, zero at first), ``rank``, ``world_size`` and
    ``region`` (elements of one ``(slot, rank)`` area: up to ``region / N`` rows of ``N``)."""

    buf_ptrs: torch.Tensor
    cnt_ptrs: torch.Tensor
    buf: torch.Tensor
    counter: torch.Tensor
    calls: torch.Tensor
    rank: int
    world_size: int
    region: int

    def rows_fit(self, m: int, n: int) -> bool:
        """Whether ``m`` rows of ``n`` fit one region."""
        return m * n <= self.region


class GemvPush(NamedTuple):
    """A producer GEMV's push (module docstring): its tiles go to every rank of ``bufs``."""

    bufs: CarryBuffers


class GemvTPIn(NamedTuple):
    """A consumer GEMV's sum + norm (module docstring): ``sum_out = Σ_ranks part + residual`` and the
    GEMV's rows ``x = rms_norm(sum_out, weight, eps)``, made before its K loop; ``x`` is scratch the
    kernel writes. ``first``: store ``sum_out`` (the first consumer of a call)."""

    bufs: CarryBuffers
    residual: torch.Tensor   # [M, K], x's dtype, contiguous last dim
    weight: torch.Tensor     # [K], contiguous
    sum_out: torch.Tensor    # [M, K], contiguous last dim
    eps: float


@triton.jit
def _count(ptr, n, ON_GPU: tl.constexpr):
    """Add ``n`` to the int64 at ``ptr`` (any rank's memory), release at system scope."""
    if ON_GPU:
        tl.atomic_add(ptr, n, sem="release", scope="sys")
    else:
        tl.atomic_add(ptr, n, sem="release")


@triton.jit
def push_tile(y, mask, rm, rn, pid_n, N, out_ptr, push_ptrs, cnt_ptrs, calls_ptr, REGION,
              BLOCK_N: tl.constexpr, TP_W: tl.constexpr, TP_RANK: tl.constexpr, ON_GPU: tl.constexpr):
    """The producer's epilogue: tile ``y [BLOCK_N, BLOCK_M]`` (columns ``rn``, rows ``rm``) rounded
    to the output's dtype into region ``[slot, TP_RANK]`` of every rank's buffer, then its column
    count on every rank's counter."""
    dt = out_ptr.dtype.element_ty
    e = tl.load(calls_ptr) + 1
    at = ((e % 2) * TP_W + TP_RANK) * REGION + rm[None, :] * N + rn[:, None]
    yv = y.to(dt)
    for q in tl.static_range(TP_W):
        dst = tl.load(push_ptrs + q).to(tl.pointer_type(dt))
        tl.store(dst + at, yv, mask=mask)
    tl.store(calls_ptr + 1, e)
    tl.debug_barrier()                          # every thread's stores are out before the counts
    cols = tl.minimum(N - pid_n * BLOCK_N, BLOCK_N).to(tl.int64)
    for q in tl.static_range(TP_W):
        _count(tl.load(cnt_ptrs + q).to(tl.pointer_type(tl.int64)), cols, ON_GPU)


@triton.jit
def sum_norm_rows(x_ptr, stride_xm, M, K, buf_ptr, cnt_ptr, calls_ptr, res_ptr, stride_rm, g_ptr, sum_ptr,
                  stride_sm, eps, REGION, FIRST, TP_W: tl.constexpr, TP_BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    """The consumer's prologue (after its PDL wait): wait for every rank's columns of the call,
    then rows ``x[m] = g · rms_norm(s[m])`` with ``s[m] = Σ_r part_r[m] + residual[m]``; ``FIRST``
    (one program) also stores ``s``. Ends with a CTA barrier, so the K loop reads the rows stored."""
    e = tl.load(calls_ptr + 1)
    _wait_for(cnt_ptr, e * K * TP_W, ON_GPU)
    dt = x_ptr.dtype.element_ty
    cols = tl.arange(0, TP_BLOCK)
    ok = cols < K
    g = tl.load(g_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    for m in range(M):
        acc = tl.zeros([TP_BLOCK], tl.float32)
        for r in tl.static_range(TP_W):
            acc += tl.load(buf_ptr + ((e % 2) * TP_W + r) * REGION + m * K + cols, mask=ok, other=0.0,
                           cache_modifier=".cg").to(tl.float32)
        s = (acc.to(dt).to(tl.float32)
             + tl.load(res_ptr + m * stride_rm + cols, mask=ok, other=0.0).to(tl.float32)).to(dt)
        sf = s.to(tl.float32)
        normed = (sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / K + eps)).to(dt)
        if FIRST:
            tl.store(sum_ptr + m * stride_sm + cols, s, mask=ok)
        tl.store(x_ptr + m * stride_xm + cols, (g * normed.to(tl.float32)).to(dt), mask=ok)
    tl.store(calls_ptr, e)
    tl.debug_barrier()


def _check_bufs(fn: str, bufs: CarryBuffers, m: int, n: int, dtype: torch.dtype, device) -> None:
    if bufs.buf.dtype != dtype or bufs.buf.device != device:
        raise ValueError(f"{fn}: the carry buffers hold {bufs.buf.dtype} on {bufs.buf.device}, the rows are "
                         f"{dtype} on {device}")
    if not bufs.rows_fit(m, n):
        raise ValueError(f"{fn}: {m} rows of {n} exceed a region of the carry buffers ({bufs.region} elements)")


def carry_args(push: GemvPush | None, tp_in: GemvTPIn | None, x: torch.Tensor, out: torch.Tensor,
               on_gpu: bool) -> dict:
    """The GEMV kernel's ``PUSH`` / ``TP_IN`` keywords (unused pointers None: no launch arguments),
    ``push`` checked against the product ``out [m, n]``, ``tp_in`` against the rows ``x [m, k]``."""
    args = dict(push_ptrs=None, cnt_ptrs=None, calls_ptr=None, TP_REGION=0, PUSH=False, tp_buf_ptr=None,
                tp_cnt_ptr=None, tp_res_ptr=None, tp_g_ptr=None, tp_sum_ptr=None, tp_stride_rm=0, tp_stride_sm=0,
                tp_eps=0.0, TP_IN=False, TP_W=1, TP_RANK=0, TP_BLOCK=16, ON_GPU=on_gpu)
    if push is not None and tp_in is not None:
        raise ValueError("gemv: push and tp_in belong to two GEMVs (the row-parallel producer, the column-parallel "
                         "consumer), not to one")
    if push is not None:
        bufs = push.bufs
        _check_bufs("gemv push", bufs, out.shape[0], out.shape[1], out.dtype, out.device)
        args.update(push_ptrs=bufs.buf_ptrs, cnt_ptrs=bufs.cnt_ptrs, calls_ptr=bufs.calls, TP_REGION=bufs.region,
                    PUSH=True, TP_W=bufs.world_size, TP_RANK=bufs.rank)
    if tp_in is not None:
        bufs, res, g, s, eps = tp_in
        m, k = x.shape
        _check_bufs("gemv tp_in", bufs, m, k, x.dtype, x.device)
        for name, t in (("residual", res), ("sum_out", s)):
            if tuple(t.shape) != (m, k) or t.dtype != x.dtype or t.stride(-1) != 1:
                raise ValueError(f"gemv tp_in: {name} must be [{m}, {k}] {x.dtype} with a contiguous last dim, got "
                                 f"{list(t.shape)} {t.dtype} strides {t.stride()}")
        if tuple(g.shape) != (k,) or g.dtype != x.dtype or not g.is_contiguous():
            raise ValueError(f"gemv tp_in: weight must be a contiguous [{k}] {x.dtype}, got {list(g.shape)} "
                             f"{g.dtype}")
        if not x.is_contiguous():
            raise ValueError("gemv tp_in: the rows it makes (x) must be contiguous")
        args.update(tp_buf_ptr=bufs.buf, tp_cnt_ptr=bufs.counter, calls_ptr=bufs.calls, TP_REGION=bufs.region,
                    tp_res_ptr=res, tp_g_ptr=g, tp_sum_ptr=s, tp_stride_rm=res.stride(0), tp_stride_sm=s.stride(0),
                    tp_eps=float(eps), TP_IN=True, TP_W=bufs.world_size, TP_BLOCK=triton.next_power_of_2(k))
    return args


def local_carry_buffers(world_size: int, region: int, dtype: torch.dtype, device) -> list[CarryBuffers]:
    """``world_size`` ranks' :class:`CarryBuffers` over memory of this process (the ranks of a test,
    run one after another under the interpreter: every producer before any consumer)."""
    bufs = [torch.zeros(2 * world_size * region, dtype=dtype, device=device) for _ in range(world_size)]
    cnts = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(world_size)]
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
    cnt_ptrs = torch.tensor([c.data_ptr() for c in cnts], dtype=torch.int64, device=device)
    return [CarryBuffers(buf_ptrs, cnt_ptrs, bufs[r], cnts[r], torch.zeros(2, dtype=torch.int64, device=device), r,
                         world_size, region) for r in range(world_size)]
