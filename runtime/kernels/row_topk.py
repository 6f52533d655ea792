"""The ``topk`` op along the last dim of short rows (MoE routing: a row of expert scores) in one launch,
and the ``index_mask`` that turns the chosen indices into a dense mask, in one more.

``values, indices = topk(x [R, N], k)``: each row's ``k`` largest entries, sorted descending, with
their int64 positions — ``torch.topk(x, k, dim=-1, largest=True, sorted=True)``. One program a
row finds them in ``k`` rounds: the largest remaining entry and the lowest position holding it (a
NaN counts as larger than every number, as in torch, and the first NaN goes first), stored at once,
then taken out of the row. Under the torch reference a routing step's top-k was four launches (a
radix select, a sort, and a copy of each output into its arena slot: 10.3 µs a Mixtral layer in
the H200 decode timeline of the int4 model); this is one, launched with
programmatic dependent launch (:mod:`.pdl`) like the engine's other kernels. Equal entries come
lowest position first; torch leaves their order unspecified.

``mask = index_mask(ids [R, k], size)``: ``mask[r, j] = j in ids[r]``, bool ``[R, size]``; one
program a row compares its ``size`` lanes with the row's ``k`` indices. The torch reference is
three launches (a zero fill, a scatter, a copy into the arena slot: 3.4 µs of a Mixtral layer's
decode step on the H200).

File shape (STYLE.md 11): the two kernels, :func:`row_topk_supported`, the wrappers :func:`row_topk`
and :func:`index_mask`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

from .pdl import pdl_launch, pdl_wait

__all__ = ["row_topk", "row_topk_supported", "index_mask", "index_mask_supported", "MAX_COLS", "MAX_K"]

MAX_COLS = 4096        # a row is one program's registers
MAX_K = 64             # rounds a program runs (unrolled)


@triton.jit
def _row_topk_kernel(x_ptr, sx, v_ptr, i_ptr, so, N, K: tl.constexpr, N_PAD: tl.constexpr,
                     USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, N_PAD)
    alive = lanes < N
    pdl_wait(USE_PDL)                       # the scores come from the kernel before
    x = tl.load(x_ptr + row * sx + lanes, mask=alive, other=0.0).to(tl.float32)
    nan = x != x
    for j in tl.static_range(K):
        any_nan = tl.max((nan & alive).to(tl.int32), axis=0) > 0
        m = tl.max(tl.where(alive & ~nan, x, float("-inf")), axis=0)
        pick = tl.where(any_nan, nan & alive, alive & (x == m))
        idx = tl.min(tl.where(pick, lanes, N_PAD), axis=0)
        value = tl.sum(tl.where(lanes == idx, x, 0.0), axis=0)
        tl.store(v_ptr + row * so + j, value.to(v_ptr.dtype.element_ty))
        tl.store(i_ptr + row * so + j, idx.to(tl.int64))
        alive = alive & (lanes != idx)


@triton.jit
def _index_mask_kernel(ids_ptr, m_ptr, SIZE, K: tl.constexpr, SIZE_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, SIZE_PAD)
    pdl_wait(USE_PDL)                       # the indices come from the kernel before
    hit = lanes < 0
    for j in tl.static_range(K):
        hit = hit | (lanes == tl.load(ids_ptr + row * K + j))
    tl.store(m_ptr + row * SIZE + lanes, hit, mask=lanes < SIZE)


def row_topk_supported(x: torch.Tensor, k: int) -> str | None:
    """Why :func:`row_topk` cannot take ``x`` and ``k`` (``None``: it can)."""
    if not x.dtype.is_floating_point or x.dtype == torch.float64:
        return f"dtype {x.dtype}"
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] > MAX_COLS:
        return f"rows of {x.shape[-1] if x.dim() else 0} entries (1 to {MAX_COLS})"
    if not 1 <= k <= min(MAX_K, x.shape[-1]):
        return f"k={k} (1 to {min(MAX_K, x.shape[-1])})"
    if not x.is_contiguous():
        return f"strides {x.stride()} (contiguous rows)"
    return None


def row_topk(x: torch.Tensor, k: int, values: torch.Tensor | None = None,
             indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)``, each ``[..., k]``, of ``x [..., N]`` (module docstring); ``values`` in
    ``x``'s dtype and int64 ``indices`` are written in place when given (contiguous)."""
    why = row_topk_supported(x, k)
    if why is not None:
        raise GraphDSLError(f"row_topk: unsupported operands ({why})")
    shape = (*x.shape[:-1], k)
    values = torch.empty(shape, dtype=x.dtype, device=x.device) if values is None else values
    indices = torch.empty(shape, dtype=torch.int64, device=x.device) if indices is None else indices
    for name, t, dtype in (("values", values, x.dtype), ("indices", indices, torch.int64)):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != x.device:
            raise GraphDSLError(f"row_topk: {name} must be a contiguous {list(shape)} {dtype} tensor on {x.device}, "
                                f"got {list(t.shape)} {t.dtype} strides {t.stride()} on {t.device}")
    rows = x.numel() // x.shape[-1]
    if rows:
        n = x.shape[-1]
        _row_topk_kernel[(rows,)](x, n, values, indices, k, n, K=k, N_PAD=triton.next_power_of_2(n),
                                  num_warps=4 if n > 512 else 1, **pdl_launch(x.device))
    return values, indices


def index_mask_supported(ids: torch.Tensor, size: int) -> str | None:
    """Why :func:`index_mask` cannot take these operands (``None``: it can)."""
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() < 1 or not ids.is_contiguous():
        return f"ids {ids.dtype} {list(ids.shape)} strides {ids.stride()} (contiguous int32/int64 rows)"
    if not 1 <= ids.shape[-1] <= MAX_K or not 1 <= size <= MAX_COLS:
        return f"{ids.shape[-1]} indices a row into {size} (1 to {MAX_K} into 1 to {MAX_COLS})"
    return None


def index_mask(ids: torch.Tensor, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[..., j] = j in ids[..., :]`` (bool ``[..., size]``, written in place when given:
    contiguous) for ``ids [..., k]`` (module docstring); an index outside ``[0, size)`` marks nothing."""
    why = index_mask_supported(ids, size)
    if why is not None:
        raise GraphDSLError(f"index_mask: unsupported operands ({why})")
    shape = (*ids.shape[:-1], size)
    out = torch.empty(shape, dtype=torch.bool, device=ids.device) if out is None else out
    if tuple(out.shape) != shape or out.dtype != torch.bool or not out.is_contiguous() or out.device != ids.device:
        raise GraphDSLError(f"index_mask: out must be a contiguous {list(shape)} torch.bool tensor on {ids.device}, "
                            f"got {list(out.shape)} {out.dtype} strides {out.stride()} on {out.device}")
    rows = ids.numel() // ids.shape[-1]
    if rows:
        _index_mask_kernel[(rows,)](ids, out, size, K=ids.shape[-1], SIZE_PAD=triton.next_power_of_2(size),
                                    num_warps=1, **pdl_launch(ids.device))
    return out
