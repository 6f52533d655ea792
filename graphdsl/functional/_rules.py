"""Shared shape/dtype rules for the functional ops (used by several op files)."""
from __future__ import annotations

import functools

import torch

from ..dim import DimExpr, same_extent, shape_str
from ..errors import ShapeError, user_frame
from ..opdef import Spec, check

__all__ = ["at_user_line", "norm_dim", "broadcast_shapes", "promote", "binary_rule", "unary_float_rule", "float_dtype"]


def norm_dim(d: int, ndim: int, op: str) -> int:
    check(isinstance(d, int) and not isinstance(d, bool), op, f"dim must be an int, got {d!r}")
    check(-ndim <= d < max(ndim, 1), op, f"dim {d} is out of range for a tensor of rank {ndim}")
    return d % ndim if ndim else 0


def broadcast_shapes(shapes: list[tuple], op: str) -> tuple:
    """numpy/torch broadcasting; symbolic extents broadcast against 1 and against themselves."""
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        ext = 1
        for s in shapes:
            e = s[axis - rank + len(s)] if axis - rank + len(s) >= 0 else 1
            if isinstance(e, int) and e == 1:
                continue
            if isinstance(ext, int) and ext == 1:
                ext = e
                continue
            if same_extent(ext, e) is False:       # the message only when it is raised: plans call this per node
                check(False, op, "shapes " + " and ".join(shape_str(x) for x in shapes)
                      + f" do not broadcast (axis {axis}: {ext} vs {e})")
        out.append(ext)
    return tuple(out)


def promote(dtypes: list[torch.dtype]) -> torch.dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def float_dtype(d: torch.dtype) -> torch.dtype:
    return d if d.is_floating_point else torch.float32


def binary_rule(op: str, *, true_div: bool = False, out_dtype: torch.dtype | None = None):
    def rule(*specs: Spec, **_):
        shape = broadcast_shapes([s.shape for s in specs], op)
        if out_dtype is not None:
            return Spec(shape, out_dtype)
        dt = _promote_weak(specs)
        return Spec(shape, float_dtype(dt) if true_div else dt)
    return rule


def _promote_weak(specs) -> torch.dtype:
    """torch's rule: a 0-d operand promotes the result only when it is of a higher category
    (bool < integer < floating) than the dimensioned operands."""
    full = [s.dtype for s in specs if len(s.shape) > 0]
    zero = [s.dtype for s in specs if len(s.shape) == 0]
    if not full:
        return promote(zero)
    dt = promote(full)
    higher = [z for z in zero if _category(z) > _category(dt)]
    return promote(higher) if higher else dt


def _category(d: torch.dtype) -> int:
    return 2 if d.is_floating_point else 0 if d == torch.bool else 1


def unary_float_rule(op: str):
    def rule(x: Spec, **_):
        return Spec(x.shape, float_dtype(x.dtype))
    return rule


def is_static(x) -> bool:
    return isinstance(x, int) and not isinstance(x, DimExpr)


def at_user_line(fn):
    """Decorate a functional wrapper whose own checks run before any op is recorded, so its
    ShapeErrors name the user's ``file:line`` like shape-rule errors do."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ShapeError as e:
            if " (at " in str(e):
                raise
            raise ShapeError(f"{e} (at {user_frame()})") from None
    return wrapper
