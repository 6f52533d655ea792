"""Views and data movement: reshape, permute, slice, expand, split, cat, gather, embedding.

VIEW ops return tensors that may alias their input's storage; DATA_MOVEMENT ops copy.
``gather(x, dim, index)`` follows the seed: it *takes* whole slices of ``x`` along ``dim`` at
``index`` (``torch.index_select`` generalised to any index rank), not ``torch.gather``.
"""
from __future__ import annotations

import builtins

import torch

from ..dim import DimExpr, minimum, numel, same_extent, shape_str
from ..errors import GraphDSLError
from ..opdef import OpCategory, Spec, check, register_op
from ._rules import at_user_line, norm_dim

__all__ = ["reshape", "permute", "transpose", "unsqueeze", "squeeze", "slice", "expand", "split", "cat",
           "gather", "embedding", "getitem", "index_mask", "transfer"]

V, M = OpCategory.VIEW, OpCategory.DATA_MOVEMENT


def _reshape_rule(x: Spec, *, shape=()):
    shape = tuple(shape)
    holes = [i for i, s in enumerate(shape) if isinstance(s, int) and s == -1]
    check(len(holes) <= 1, "reshape", f"at most one -1 allowed, got {list(shape)}")
    for s in shape:
        check(isinstance(s, DimExpr) or (isinstance(s, int) and s >= -1), "reshape",
              f"shape entries must be ints >= 0, -1 or Dims, got {list(shape)}")
    total = numel(x.shape)
    if holes:
        rest = numel([s for i, s in enumerate(shape) if i != holes[0]])
        if isinstance(total, int) and isinstance(rest, int):
            check(rest > 0 and total % rest == 0, "reshape",
                  f"cannot view {shape_str(x.shape)} as {list(shape)}")
        fill = total // rest if isinstance(total, int) and isinstance(rest, int) else DimExpr._make("//", total, rest)
        shape = tuple(fill if i == holes[0] else s for i, s in enumerate(shape))
    want = numel(shape)
    check(same_extent(total, want) is not False, "reshape",
          f"cannot view {shape_str(x.shape)} ({total} elements) as {shape_str(shape)} ({want} elements)")
    return Spec(shape, x.dtype)


@register_op("reshape", category=V, shape=_reshape_rule)
def _reshape(x, *, shape=()):
    """x viewed with a new shape of equal element count (one -1 is inferred)."""
    return x.reshape(shape)


def reshape(x, shape):
    return _reshape(x, shape=tuple(shape))


def _permute_rule(x: Spec, *, dims=()):
    n = len(x.shape)
    d = tuple(norm_dim(i, n, "permute") for i in dims)
    check(sorted(d) == list(range(n)), "permute", f"dims {list(dims)} are not a permutation of rank {n}")
    return Spec(tuple(x.shape[i] for i in d), x.dtype)


@register_op("permute", category=V, shape=_permute_rule)
def _permute(x, *, dims=()):
    """out.shape[i] = x.shape[dims[i]]"""
    return x.permute(dims)


def permute(x, dims):
    return _permute(x, dims=tuple(dims))


@at_user_line
def transpose(x, dim0: int, dim1: int):
    """Swap two dims (a permute)."""
    n = x.ndim
    d0, d1 = norm_dim(dim0, n, "transpose"), norm_dim(dim1, n, "transpose")
    order = list(range(n))
    order[d0], order[d1] = order[d1], order[d0]
    return permute(x, order)


def _unsqueeze_rule(x: Spec, *, dim=0):
    d = norm_dim(dim, len(x.shape) + 1, "unsqueeze")
    return Spec(x.shape[:d] + (1,) + x.shape[d:], x.dtype)


@register_op("unsqueeze", category=V, shape=_unsqueeze_rule)
def unsqueeze(x, *, dim=0):
    """insert a size-1 dim at ``dim``"""
    return x.unsqueeze(dim)


def _squeeze_rule(x: Spec, *, dim=0):
    d = norm_dim(dim, len(x.shape), "squeeze")
    check(same_extent(x.shape[d], 1) is not False, "squeeze", f"dim {dim} has size {x.shape[d]}, not 1")
    return Spec(x.shape[:d] + x.shape[d + 1:], x.dtype)


@register_op("squeeze", category=V, shape=_squeeze_rule)
def squeeze(x, *, dim=0):
    """remove the size-1 dim ``dim``"""
    return x.squeeze(dim)


def _slice_bounds(size, start, end, step):
    if isinstance(start, int) and start < 0:
        start = size + start if isinstance(size, int) else DimExpr._make("+", size, start)
    if end is None:
        end = size
    elif isinstance(end, int) and end < 0:
        end = size + end if isinstance(size, int) else DimExpr._make("+", size, end)
    if isinstance(size, int) and isinstance(start, int) and isinstance(end, int):
        start, end = builtins.max(0, builtins.min(start, size)), builtins.max(0, builtins.min(end, size))
        end = builtins.max(start, end)
    elif isinstance(end, int):           # symbolic size: clamp like Python slicing does
        end = minimum(size, end)
    return start, end


def _slice_rule(x: Spec, *, dim=0, start=0, end=None, step=1):
    d = norm_dim(dim, len(x.shape), "slice")
    check(isinstance(step, int) and step >= 1, "slice", f"step must be a positive int, got {step!r}")
    start, end = _slice_bounds(x.shape[d], start, end, step)
    length = end - start
    if step != 1:
        length = (length + step - 1) // step
    return Spec(x.shape[:d] + (length,) + x.shape[d + 1:], x.dtype)


@register_op("slice", category=V, shape=_slice_rule)
def slice(x, *, dim=0, start=0, end=None, step=1):  # noqa: A001 - seed name
    """x[..., start:end:step, ...] along ``dim`` (negative bounds count from the end)."""
    idx = [builtins.slice(None)] * x.ndim
    idx[dim] = builtins.slice(start, end, step)
    return x[tuple(idx)]


def _expand_rule(x: Spec, *, shape=()):
    shape = tuple(shape)
    check(len(shape) >= len(x.shape), "expand", f"cannot expand {shape_str(x.shape)} to fewer dims {list(shape)}")
    lead = len(shape) - len(x.shape)
    out = []
    for i, s in enumerate(shape):
        src = x.shape[i - lead] if i >= lead else 1
        if isinstance(s, int) and s == -1:
            check(i >= lead, "expand", "-1 is not allowed for new leading dims")
            out.append(src)
        else:
            check(isinstance(src, int) and src == 1 or same_extent(src, s) is not False, "expand",
                  f"cannot expand {shape_str(x.shape)} to {list(shape)} (dim {i}: {src} -> {s})")
            out.append(s)
    return Spec(tuple(out), x.dtype)


@register_op("expand", category=V, shape=_expand_rule)
def _expand(x, *, shape=()):
    """broadcast size-1 dims of x to ``shape`` (-1 keeps a dim) without copying"""
    return x.expand(shape)


def expand(x, shape):
    return _expand(x, shape=tuple(shape))


def _split_count(attrs) -> int:
    s = attrs["sections"]
    return s if isinstance(s, int) else len(s)


def _split_rule(x: Spec, *, sections=2, dim=-1):
    d = norm_dim(dim, len(x.shape), "split")
    size = x.shape[d]
    if isinstance(sections, int):
        check(sections >= 1, "split", f"sections must be >= 1, got {sections}")
        if isinstance(size, int):
            check(size % sections == 0, "split", f"dim {dim} of size {size} does not split into {sections} equal parts")
        sizes = [size // sections] * sections
    else:
        sizes = list(sections)
        check(all(isinstance(s, (int, DimExpr)) for s in sizes), "split", f"sizes must be ints, got {sizes}")
        total = builtins.sum(sizes[1:], sizes[0])
        check(same_extent(total, size) is not False, "split", f"sizes {sizes} sum to {total}, dim {dim} is {size}")
    return tuple(Spec(x.shape[:d] + (s,) + x.shape[d + 1:], x.dtype) for s in sizes)


@register_op("split", category=V, shape=_split_rule, num_outputs=_split_count)
def _split(x, *, sections=2, dim=-1):
    """Split along ``dim``: an int is a number of equal parts, a tuple the part sizes."""
    if isinstance(sections, int):
        if x.shape[dim] % sections:
            raise GraphDSLError(f"split: dim {dim} of size {x.shape[dim]} does not split into {sections} equal parts")
        sections = [x.shape[dim] // sections] * sections
    return torch.split(x, list(sections), dim=dim)


def split(x, sections, dim: int = -1):
    """Split ``x`` along ``dim`` into ``sections`` equal parts (int) or parts of the given sizes."""
    return _split(x, sections=sections if isinstance(sections, int) else tuple(sections), dim=dim)


def _cat_rule(*xs: Spec, dim=0):
    check(len(xs) >= 1, "cat", "needs at least one tensor")
    n = len(xs[0].shape)
    d = norm_dim(dim, n, "cat")
    for x in xs[1:]:
        check(len(x.shape) == n, "cat", f"ranks differ: {shape_str(xs[0].shape)} vs {shape_str(x.shape)}")
        check(x.dtype == xs[0].dtype, "cat", f"dtypes differ: {xs[0].dtype} vs {x.dtype}")
        for i in range(n):
            if i != d:
                check(same_extent(x.shape[i], xs[0].shape[i]) is not False, "cat",
                      f"shapes {shape_str(xs[0].shape)} and {shape_str(x.shape)} differ outside dim {dim}")
    total = builtins.sum((x.shape[d] for x in xs[1:]), xs[0].shape[d])
    return Spec(xs[0].shape[:d] + (total,) + xs[0].shape[d + 1:], xs[0].dtype)


@register_op("cat", category=M, shape=_cat_rule)
def _cat(*xs, dim=0):
    """concatenate along ``dim``"""
    return torch.cat(xs, dim=dim)


def cat(tensors, dim: int = 0):
    return _cat(*tensors, dim=dim)


def _gather_rule(x: Spec, index: Spec, *, dim=0):
    d = norm_dim(dim, len(x.shape), "gather")
    check(index.dtype in (torch.int32, torch.int64), "gather", f"index must be int32/int64, got {index.dtype}")
    return Spec(x.shape[:d] + tuple(index.shape) + x.shape[d + 1:], x.dtype)


@register_op("gather", category=M, shape=_gather_rule)
def _gather(x, index, *, dim=0):
    """out = x[:, ..., index, ...] with ``index`` (any rank) placed at ``dim``."""
    dim = dim % x.ndim
    flat = torch.index_select(x, dim, index.reshape(-1).long())
    return flat.reshape(x.shape[:dim] + index.shape + x.shape[dim + 1:])


def gather(x, dim: int, index):
    """Seed signature ``gather(x, dim, index)``: take slices of ``x`` at ``index`` along ``dim``."""
    return _gather(x, index, dim=dim)


def _index_mask_rule(ids: Spec, *, size=None):
    check(ids.dtype in (torch.int32, torch.int64), "index_mask", f"ids must be int32/int64, got {ids.dtype}")
    check(len(ids.shape) >= 1, "index_mask", f"ids must have a last dim of indices, got {shape_str(ids.shape)}")
    check(isinstance(size, int) and size > 0, "index_mask", f"size must be a positive int, got {size!r}")
    return Spec(tuple(ids.shape[:-1]) + (size,), torch.bool)


@register_op("index_mask", category=M, shape=_index_mask_rule)
def _index_mask(ids, *, size=None):
    """``mask[..., j] = j in ids[..., :]``: which of ``0 .. size-1`` each row's indices name (a
    top-k's chosen set as a dense mask). Indices must lie in ``[0, size)``."""
    mask = torch.zeros(ids.shape[:-1] + (size,), dtype=torch.bool, device=ids.device)
    return mask.scatter_(-1, ids.long(), True)


def index_mask(ids, size: int):
    """``[..., size]`` bool: whether ``j`` is among the row's ``ids [..., k]``."""
    return _index_mask(ids, size=size)


def _embedding_rule(ids: Spec, table: Spec):
    check(ids.dtype in (torch.int32, torch.int64), "embedding", f"ids must be int32/int64, got {ids.dtype}")
    check(len(table.shape) == 2, "embedding", f"table must be 2-D [vocab, hidden], got {shape_str(table.shape)}")
    return Spec(tuple(ids.shape) + (table.shape[1],), table.dtype)


@register_op("embedding", category=M, shape=_embedding_rule)
def embedding(ids, table):
    """out[i] = table[ids[i]]"""
    return torch.nn.functional.embedding(ids.long(), table)


def getitem(x, idx):
    """``x[idx]`` with ints, slices, None, Ellipsis, or one integer Tensor (a gather)."""
    from ..tensor import Tensor
    idx = idx if isinstance(idx, tuple) else (idx,)
    if builtins.sum(1 for i in idx if i is Ellipsis) > 1:
        raise GraphDSLError("an index can have only one Ellipsis (...)")
    if builtins.sum(1 for i in idx if isinstance(i, Tensor)) > 1:
        raise GraphDSLError("an index can have only one Tensor index (torch pairs several tensor indices "
                            "elementwise; use F.gather per dim for that)")
    n_real = builtins.sum(1 for i in idx if i is not None and i is not Ellipsis)
    if Ellipsis in idx:
        e = idx.index(Ellipsis)
        idx = idx[:e] + (builtins.slice(None),) * (x.ndim - n_real) + idx[e + 1:]
    if n_real > x.ndim:
        raise GraphDSLError(f"too many indices ({n_real}) for tensor '{x.name}' of rank {x.ndim}")
    out, d = x, 0
    for i in idx:
        if i is None:
            out = unsqueeze(out, dim=d)
            d += 1
        elif isinstance(i, builtins.slice):
            if i != builtins.slice(None):
                out = slice(out, dim=d, start=i.start or 0, end=i.stop, step=i.step or 1)
            d += 1
        elif isinstance(i, Tensor):
            out = gather(out, d, i)
            d += len(i.shape) if i.shape is not None else 1
        elif isinstance(i, int) and not isinstance(i, bool):
            out = squeeze(slice(out, dim=d, start=i, end=i + 1 if i != -1 else None), dim=d)
        else:
            raise GraphDSLError(f"unsupported index {i!r} ({type(i).__name__}); use ints, slices, None, ... or a Tensor")
    return out


@register_op("transfer", category=M, shape=lambda x, *, device="cpu": Spec(x.shape, x.dtype))
def transfer(x, *, device: str = "cpu"):
    """``x`` copied to ``device`` (a device string: ``cpu``, ``cuda:1``). A partitioned graph
    (:mod:`graphdsl.passes.partition`) holds one at every edge between parts on different devices;
    the part boundary is where it runs."""
    return x.to(torch.device(device).type if torch.device(device).type == "cpu" else device)
