"""Collectives as graph ops. The world size is a node attribute (no global state): at world
size 1 they are the identity; above it they call ``torch.distributed`` (NCCL on GPU, gloo on CPU),
which must be initialised by the launcher (``torchrun``)."""
from __future__ import annotations

import torch

from ..errors import GraphDSLError
from ..opdef import OpCategory, Spec, check, register_op
from ._rules import norm_dim

__all__ = ["all_reduce", "all_gather"]


def _dist(op: str):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise GraphDSLError(f"{op} with world_size > 1 needs torch.distributed initialised (launch with torchrun)")
    return dist


def _ar_rule(x: Spec, *, world_size=1):
    check(isinstance(world_size, int) and world_size >= 1, "all_reduce", f"world_size must be >= 1, got {world_size!r}")
    return x


@register_op("all_reduce", category=OpCategory.COLLECTIVE, shape=_ar_rule)
def all_reduce(x, *, world_size=1):
    """Σ over ranks of x (identity at world size 1)."""
    if world_size == 1:
        return x.clone()
    out = x.clone()
    _dist("all_reduce").all_reduce(out)
    return out


def _ag_rule(x: Spec, *, dim=0, world_size=1):
    check(isinstance(world_size, int) and world_size >= 1, "all_gather", f"world_size must be >= 1, got {world_size!r}")
    d = norm_dim(dim, len(x.shape), "all_gather")
    return Spec(x.shape[:d] + (x.shape[d] * world_size,) + x.shape[d + 1:], x.dtype)


@register_op("all_gather", category=OpCategory.COLLECTIVE, shape=_ag_rule)
def all_gather(x, *, dim=0, world_size=1):
    """Concatenation over ranks of x along ``dim`` (identity at world size 1)."""
    if world_size == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    _dist("all_gather").all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
