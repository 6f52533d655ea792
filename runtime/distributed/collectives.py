"""Lowerings of the collective graph ops onto the engine's planned buffers (``dst``), for the
triton backend: ``all_reduce`` reduces in place in its output slot, ``all_gather`` gathers straight
into it when the gathered dim is the leading one, ``reduce_scatter`` scatters into it. On CUDA these
are NCCL calls on the current stream; the torch references (:mod:`graphdsl.functional.collective`)
stay the semantics and the CPU path.

Small CUDA all-reduces may take the one-shot path instead (``GRAPHDSL_ALLREDUCE=symm_mem``; the
default, ``nccl``, sends them all to NCCL): the input is copied into a torch symmetric-memory buffer
every rank maps, and each rank sums all ranks' buffers with peer-to-peer loads in one kernel
(``symm_mem.one_shot_all_reduce_copy_out``) — one launch instead of NCCL's ring or tree steps; no
NVLink multicast involved. On two H200s it gave the Llama-3-8B shape's TP2 decode (with decode
graphs) 2.868 ms a token against 3.024 with NCCL; it is not the default because a second
tensor-parallel ``LLM`` in the same process hung in the buffer's rendezvous there
(docs/distributed.md). Messages above ``GRAPHDSL_ONESHOT_MAX_BYTES`` (default 512 KiB) stay on NCCL."""
from __future__ import annotations

import os

import torch

from graphdsl.errors import GraphDSLError

__all__ = ["COLLECTIVE_LOWERINGS", "release_collective_buffers"]


def _dist(world_size: int):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise GraphDSLError("collectives with world_size > 1 need torch.distributed initialised (launch with torchrun "
                            "or LLM(tensor_parallel_size=N))")
    return dist


_SYMM_BUFFERS: dict = {}          # (device, dtype, group name) -> rendezvoused symmetric buffer


def release_collective_buffers() -> None:
    """Drop the symmetric buffers rendezvoused over the current group (before it is destroyed: a
    later group of the same name must rendezvous its own)."""
    _SYMM_BUFFERS.clear()


def _one_shot_limit() -> int:
    """Bytes up to which all-reduces take the one-shot path (0: never)."""
    mode = os.environ.get("GRAPHDSL_ALLREDUCE", "nccl").strip().lower()
    if mode not in ("symm_mem", "nccl"):
        raise GraphDSLError(f"GRAPHDSL_ALLREDUCE must be 'symm_mem' or 'nccl', got {mode!r}")
    if mode != "symm_mem":
        return 0
    return int(os.environ.get("GRAPHDSL_ONESHOT_MAX_BYTES", 512 * 1024))


def _symm_buffer(dist, device: torch.device, dtype: torch.dtype, limit: int) -> tuple[torch.Tensor, str]:
    """The symmetric buffer of ``dtype`` on ``device`` (made and rendezvoused on first use: every
    rank reaches its first all-reduce together, so the collective rendezvous lines up)."""
    import torch.distributed._symmetric_memory as symm_mem
    group = dist.group.WORLD.group_name
    key = (device, dtype, group)
    buf = _SYMM_BUFFERS.get(key)
    if buf is None:
        elem = torch.empty((), dtype=dtype).element_size()
        buf = symm_mem.empty(limit // elem, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group)
        _SYMM_BUFFERS[key] = buf
    return buf, group


def _all_reduce(be, node, ins, attrs, dsts):
    x, dst = ins[0], dsts[0]
    if attrs.get("world_size", 1) == 1:
        return [dst.copy_(x) if dst is not None else x.clone()]
    if dst is None:
        dst = torch.empty_like(x)
    limit = _one_shot_limit()
    if (limit and x.is_cuda and x.dtype in (torch.bfloat16, torch.float32) and dst.is_contiguous()
            and x.numel() * x.element_size() <= limit):
        buf, group = _symm_buffer(_dist(attrs["world_size"]), x.device, x.dtype, limit)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[:x.numel()], x.contiguous().view(-1), "sum", group,
                                                        dst.view(-1))
        return [dst]
    if dst.data_ptr() != x.data_ptr():
        dst.copy_(x)
    _dist(attrs["world_size"]).all_reduce(dst)
    return [dst]


def _all_gather(be, node, ins, attrs, dsts):
    x, dst, w = ins[0], dsts[0], attrs.get("world_size", 1)
    if w == 1:
        return [dst.copy_(x)]
    dim = attrs.get("dim", 0) % x.dim()
    dist = _dist(w)
    if dim == 0 and dst.is_contiguous():
        dist.all_gather_into_tensor(dst, x.contiguous())
        return [dst]
    stacked = torch.empty((w,) + tuple(x.shape), dtype=x.dtype, device=x.device)   # [W, ..., n, ...]
    dist.all_gather_into_tensor(stacked, x.contiguous())
    dst.copy_(stacked.movedim(0, dim).reshape(dst.shape))
    return [dst]


def _reduce_scatter(be, node, ins, attrs, dsts):
    x, dst, w = ins[0], dsts[0], attrs.get("world_size", 1)
    if w == 1:
        return [dst.copy_(x)]
    dim = attrs.get("dim", 0) % x.dim()
    src = x.movedim(dim, 0).contiguous() if dim else x.contiguous()
    out = dst if dim == 0 and dst.is_contiguous() else torch.empty_like(src[: src.shape[0] // w])
    _dist(w).reduce_scatter_tensor(out, src)
    if out is not dst:
        dst.copy_(out.movedim(0, dim))
    return [dst]


COLLECTIVE_LOWERINGS = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter}
