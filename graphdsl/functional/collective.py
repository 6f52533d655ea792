"""Collectives as graph ops. The world size is a node attribute (no global state): at world
size 1 they are the identity; above it they call ``torch.distributed`` on its default process
group (NCCL on GPU, gloo on CPU), which the launcher initialises (``torchrun``, or
``LLM(tensor_parallel_size=N)``). Every rank records the same graph, so every rank issues the same
collectives in the same order.

With ``x_r`` rank ``r``'s input and ``W`` the world size:

* ``all_reduce(x)       = Σ_r x_r``                                   (same shape)
* ``all_gather(x, dim)  = cat([x_0, ..., x_{W-1}], dim)``             (``dim`` grows ``W``×)
* ``reduce_scatter(x, dim)`` on rank ``r`` = chunk ``r`` of ``Σ_r x_r`` split in ``W`` equal
  parts along ``dim``                                                 (``dim`` shrinks ``W``×)

The references here are the semantics and the CPU path; ``graphdsl.runtime.distributed`` lowers
them onto the engine's planned buffers on GPU.
"""
from __future__ import annotations

import torch

from ..errors import GraphDSLError
from ..opdef import OpCategory, Spec, check, register_op
from ._rules import norm_dim

__all__ = ["all_reduce", "all_gather", "reduce_scatter"]


def _dist(op: str, world_size: int):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise GraphDSLError(f"{op} with world_size > 1 needs torch.distributed initialised (launch with torchrun)")
    if dist.get_world_size() != world_size:
        raise GraphDSLError(f"{op}: the node's world_size is {world_size}, but torch.distributed's default group "
                            f"has {dist.get_world_size()} ranks")
    return dist


def _check_ws(op: str, world_size) -> None:
    check(isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1, op,
          f"world_size must be an int >= 1, got {world_size!r}")


def _ar_rule(x: Spec, *, world_size=1):
    _check_ws("all_reduce", world_size)
    return x


@register_op("all_reduce", category=OpCategory.COLLECTIVE, shape=_ar_rule)
def all_reduce(x, *, world_size=1):
    """Σ over ranks of x (identity at world size 1)."""
    if world_size == 1:
        return x.clone()
    out = x.clone()
    _dist("all_reduce", world_size).all_reduce(out)
    return out


def _ag_rule(x: Spec, *, dim=0, world_size=1):
    _check_ws("all_gather", world_size)
    d = norm_dim(dim, len(x.shape), "all_gather")
    return Spec(x.shape[:d] + (x.shape[d] * world_size,) + x.shape[d + 1:], x.dtype)


@register_op("all_gather", category=OpCategory.COLLECTIVE, shape=_ag_rule)
def all_gather(x, *, dim=0, world_size=1):
    """Concatenation over ranks of x along ``dim`` (identity at world size 1)."""
    if world_size == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    _dist("all_gather", world_size).all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _rs_rule(x: Spec, *, dim=0, world_size=1):
    _check_ws("reduce_scatter", world_size)
    d = norm_dim(dim, len(x.shape), "reduce_scatter")
    size = x.shape[d]
    if isinstance(size, int):
        check(size % world_size == 0, "reduce_scatter",
              f"dim {dim} has size {size}, not a multiple of world_size={world_size}")
    elif world_size > 1:
        raise GraphDSLError(f"reduce_scatter: dim {dim} is the symbolic {size}; scatter a dim of fixed size")
    return Spec(x.shape[:d] + (size // world_size,) + x.shape[d + 1:], x.dtype)


@register_op("reduce_scatter", category=OpCategory.COLLECTIVE, shape=_rs_rule)
def reduce_scatter(x, *, dim=0, world_size=1):
    """This rank's chunk (along ``dim``) of the sum over ranks of x (identity at world size 1)."""
    if world_size == 1:
        return x.clone()
    dist = _dist("reduce_scatter", world_size)
    rank = dist.get_rank()
    if dist.get_backend() == "gloo":          # gloo has no reduce-scatter: all-reduce, keep our chunk
        total = x.clone()
        dist.all_reduce(total)
        return total.chunk(world_size, dim)[rank].contiguous()
    chunks = [c.contiguous() for c in x.chunk(world_size, dim)]
    out = torch.empty_like(chunks[rank])
    dist.reduce_scatter(out, chunks)
    return out
