"""A one-shot all-reduce over peer-mapped buffers, optionally with the residual add and RMSNorm that
follow it in a tensor-parallel decoder layer, in one launch.

Each of the ``W`` ranks holds one buffer that every rank can address (mapped by CUDA IPC handles, :mod:`..distributed.ipc`: the
device pointers of all ranks' buffers, ``buf_ptrs [W]``, and of their flag arrays, ``flag_ptrs
[W]``). A call reduces ``x [M, H]``; program ``p`` owns row ``p``:

1. ``e = epoch[p] + 1`` (a counter in this rank's memory, one a program, advanced by every call, so
   all ranks agree on it without talking) picks slot ``e mod 2`` of every buffer. Epochs and flags
   are int64: at the 8B TP2 decode's 25,600 calls a second an int32 epoch would wrap within a day,
   and a wrapped epoch passes every flag test at once (the sums of a server running that long would
   silently be wrong).
2. It **pushes** its row into region ``[slot, RANK, p]`` of every rank's buffer (its own included):
   stores, not loads, cross the link, so nothing waits on a remote read.
3. After a CTA barrier it writes ``e`` into ``flags[RANK, p]`` of every other rank with a
   system-scope release store, and polls its own ``flags[q, p]`` (system-scope acquire) until every
   other rank ``q`` has written ``e``: then all ``W`` rows are in its own buffer.
4. It sums the ``W`` rows in rank order, in float32 (every rank adds in the same order, so every
   rank gets the same bits), and rounds to ``x``'s dtype: ``y = Σ_r x_r``.
5. ``NORM``: ``s = y + residual`` (rounded), ``normed = weight · (s · rsqrt(mean(s²) + eps))`` with
   the normalisation in float32, rounded before the weight multiply (the order of
   ``graphdsl.functional.rms_norm``); it stores ``normed`` and ``s``. Otherwise it stores ``y``.

Two slots make one exchange a call enough: a rank writes slot ``s`` again at call ``e + 2`` only
after call ``e + 1``'s flags from every peer, which each peer sends only once its call ``e`` (its
last read of slot ``s``) has finished. That holds program by program, so every call of a group
must give row ``p`` the same place: the buffers take one row width, the first call's
(:attr:`PeerBuffers.width`); calls may differ in their number of rows. No NVLink multicast, no
``multimem`` instructions.

Under the CPU interpreter the release and acquire are atomics on the same addresses (tests run
the ranks one after another, seeding the flags of those not run yet).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_wait

__all__ = ["PeerBuffers", "one_shot_all_reduce", "local_peers", "MAX_ROWS", "MAX_WIDTH"]

MAX_ROWS = 1024            # programs (rows) a call; the flag arrays hold [W, MAX_ROWS]
MAX_WIDTH = 16384          # elements a row (one program holds a row)


@dataclass
class PeerBuffers:
    """One rank's view of the peer-mapped memory of a group: ``buf_ptrs`` / ``flag_ptrs`` (int64
    ``[W]`` on the device: each rank's data buffer and int64 flag array ``[W, MAX_ROWS]``), this
    rank's ``epoch`` counters (int64 ``[MAX_ROWS]``, zero at first), its ``rank`` and the
    ``region`` (elements) of one ``(slot, source rank)`` area. Every rank's buffer holds
    ``2 · W · region`` elements of ``dtype``; the flags start at zero on every rank before any
    rank's first call. ``width``: the row width of every call, set by the first (module
    docstring)."""

    buf_ptrs: torch.Tensor
    flag_ptrs: torch.Tensor
    epoch: torch.Tensor
    rank: int
    world_size: int
    region: int
    dtype: torch.dtype
    width: int | None = None

    def takes(self, width: int) -> bool:
        """Whether a call with rows of ``width`` may use these buffers."""
        return self.width is None or self.width == width


@triton.jit
def _signal(ptr, value, ON_GPU: tl.constexpr):
    """Write ``value`` to the int64 at ``ptr`` (another rank's memory) with release semantics at
    system scope: everything this CTA stored before its barrier is visible to whoever reads it."""
    if ON_GPU:
        tl.inline_asm_elementwise("st.release.sys.global.b64 [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,l", [ptr, value],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_xchg(ptr, value, sem="release")


@triton.jit
def _wait_for(ptr, value, ON_GPU: tl.constexpr):
    """Spin until the int64 at ``ptr`` reaches ``value`` (acquire, system scope)."""
    if ON_GPU:
        while tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
                                        is_pure=False, pack=1) < value:
            pass
    else:
        while tl.atomic_add(ptr, 0, sem="acquire") < value:
            pass


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, res_ptr, sum_ptr, w_ptr, buf_ptrs, flag_ptrs, epoch_ptr, H, REGION,
                     x_stride, out_stride, res_stride, sum_stride, eps, RANK: tl.constexpr, W: tl.constexpr,
                     NORM: tl.constexpr, BLOCK: tl.constexpr, FLAG_ROWS: tl.constexpr, ON_GPU: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """Row ``program_id`` of the module docstring's all-reduce (and norm)."""
    p = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    dt = x_ptr.dtype.element_ty
    pdl_wait(USE_PDL)
    e = tl.load(epoch_ptr + p) + 1
    slot = e % 2
    x = tl.load(x_ptr + p * x_stride + cols, mask=ok, other=0.0)
    mine = (slot * W + RANK) * REGION + p * H
    for q in tl.static_range(W):
        dst = tl.load(buf_ptrs + q).to(tl.pointer_type(dt))
        tl.store(dst + mine + cols, x, mask=ok)
    tl.debug_barrier()                                # every thread's rows are out before the flags
    for q in tl.static_range(W):
        if q != RANK:
            _signal(tl.load(flag_ptrs + q).to(tl.pointer_type(tl.int64)) + RANK * FLAG_ROWS + p, e, ON_GPU)
    flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int64))
    for q in tl.static_range(W):
        if q != RANK:
            _wait_for(flags + q * FLAG_ROWS + p, e, ON_GPU)
    own = tl.load(buf_ptrs + RANK).to(tl.pointer_type(dt))
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(W):
        acc += tl.load(own + (slot * W + r) * REGION + p * H + cols, mask=ok, other=0.0,
                       cache_modifier=".cg").to(tl.float32)
    y = acc.to(dt)
    if NORM:
        s = (y.to(tl.float32) + tl.load(res_ptr + p * res_stride + cols, mask=ok, other=0.0).to(tl.float32)).to(dt)
        tl.store(sum_ptr + p * sum_stride + cols, s, mask=ok)
        sf = s.to(tl.float32)
        normed = (sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)).to(dt)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + p * out_stride + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(dt), mask=ok)
    else:
        tl.store(out_ptr + p * out_stride + cols, y, mask=ok)
    tl.store(epoch_ptr + p, e)


def one_shot_all_reduce(x: torch.Tensor, peers: PeerBuffers, out: torch.Tensor, *, residual: torch.Tensor | None = None,
                        weight: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
                        eps: float = 1e-6) -> None:
    """``out = Σ_ranks x`` (``x [M, H]``, every rank calling with its own ``x``), or with
    ``residual``, ``weight`` and ``sum_out``: ``sum_out = Σ x + residual`` and ``out =
    rms_norm(sum_out, weight, eps)`` (the module docstring). Rows must be contiguous in their last
    dim; ``M <= MAX_ROWS``, ``H <= MAX_WIDTH``, ``M · H <= peers.region``; all tensors of ``x``'s
    dtype, the buffers' dtype."""
    if x.dim() != 2 or out.shape != x.shape:
        raise ValueError(f"one_shot_all_reduce: x and out must be [rows, width] alike, got {list(x.shape)} and "
                         f"{list(out.shape)}")
    m, h = x.shape
    norm = residual is not None
    if norm and (weight is None or sum_out is None):
        raise ValueError("one_shot_all_reduce: residual needs weight and sum_out too")
    tensors = [x, out] + ([residual, sum_out] if norm else [])
    if any(t.dtype != peers.dtype for t in tensors + ([weight] if norm else [])):
        raise ValueError(f"one_shot_all_reduce: every tensor must be {peers.dtype}, got "
                         f"{[t.dtype for t in tensors + ([weight] if norm else [])]}")
    if any(t.shape != (m, h) or t.stride(-1) != 1 for t in tensors):
        raise ValueError("one_shot_all_reduce: x, out (and residual, sum_out) must be [rows, width] with "
                         "contiguous rows")
    if m > MAX_ROWS or h > MAX_WIDTH or m * h > peers.region:
        raise ValueError(f"one_shot_all_reduce: {m} rows of {h} exceed the buffers (at most {MAX_ROWS} rows, "
                         f"{MAX_WIDTH} a row, {peers.region} elements in all)")
    if not peers.takes(h):
        raise ValueError(f"one_shot_all_reduce: these buffers take rows of {peers.width} (their first call's), "
                         f"got rows of {h}")
    if m == 0:
        return
    peers.width = h
    res, s, w = (residual, sum_out, weight) if norm else (x, out, x)
    block = triton.next_power_of_2(h)
    _one_shot_kernel[(m,)](x, out, res, s, w, peers.buf_ptrs, peers.flag_ptrs, peers.epoch, h, peers.region,
                           x.stride(0), out.stride(0), res.stride(0), s.stride(0), float(eps),
                           RANK=peers.rank, W=peers.world_size, NORM=norm, BLOCK=block, FLAG_ROWS=MAX_ROWS,
                           ON_GPU=x.is_cuda,
                           num_warps=8 if block >= 4096 else 4, **pdl_launch(x.device))


def local_peers(world_size: int, region: int, dtype: torch.dtype, device) -> list[PeerBuffers]:
    """``world_size`` ranks' :class:`PeerBuffers` over buffers in this process's own memory (one
    device): the ranks of a test, run one after another under the interpreter or side by side on
    streams of one GPU. The buffers are kept alive by the returned objects (``_keep``)."""
    bufs = [torch.zeros(2 * world_size * region, dtype=dtype, device=device) for _ in range(world_size)]
    flags = [torch.zeros(world_size * MAX_ROWS, dtype=torch.int64, device=device) for _ in range(world_size)]
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=device)
    out = []
    for r in range(world_size):
        peers = PeerBuffers(buf_ptrs, flag_ptrs, torch.zeros(MAX_ROWS, dtype=torch.int64, device=device), r,
                            world_size, region, dtype)
        peers._keep = (bufs, flags)
        out.append(peers)
    return out
