"""Lowerings of the collective graph ops onto the engine's planned buffers (``dst``), for the
triton backend: ``all_reduce`` reduces in place in its output slot, ``all_gather`` gathers straight
into it when the gathered dim is the leading one, ``reduce_scatter`` scatters into it. On CUDA these
are NCCL calls on the current stream; the torch references (:mod:`graphdsl.functional.collective`)
stay the semantics and the CPU path."""
from __future__ import annotations

import torch

from graphdsl.errors import GraphDSLError

__all__ = ["COLLECTIVE_LOWERINGS"]


def _dist(world_size: int):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise GraphDSLError("collectives with world_size > 1 need torch.distributed initialised (launch with torchrun "
                            "or LLM(tensor_parallel_size=N))")
    return dist


def _all_reduce(be, node, ins, attrs, dsts):
    x, dst = ins[0], dsts[0]
    if attrs.get("world_size", 1) == 1:
        return [dst.copy_(x) if dst is not None else x.clone()]
    if dst is None:
        dst = torch.empty_like(x)
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
