"""The embedding lookup as one Triton launch: ``out[t, :] = table[ids[t], :]``.

Under the torch reference a step's lookup was two launches (``index_select`` into a fresh tensor,
then a copy into the node's arena slot), and neither waits for its predecessor the way the
engine's Triton kernels do: each cost a launch gap on a decode step's critical path. This kernel
gathers straight into the slot and launches with programmatic dependent launch
(:mod:`.pdl`), so its launch overlaps the step prologue before it.

Program ``(i, j)`` copies rows ``[i * BLOCK_T, (i + 1) * BLOCK_T)`` of ``out``, columns
``[j * BLOCK_H, (j + 1) * BLOCK_H)``. The copy is exact (any dtype). An id outside ``[0, V)`` gives
a row of NaN (float tables), visible in the logits, where torch would stop the process with a
device-side assert; the serving layer refuses such ids before they reach a step.

File shape (STYLE.md 11): the kernel, :func:`embedding_supported`, the wrapper :func:`embedding`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

from .pdl import pdl_launch, pdl_wait

__all__ = ["embedding", "embedding_supported"]

_BLOCK_H = 1024


@triton.jit
def _embedding_kernel(ids_ptr, table_ptr, out_ptr, T, H, V, stride_t, stride_o,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = rt < T
    h_ok = rh < H
    pdl_wait(USE_PDL)                       # the ids are the previous step's tokens
    ids = tl.load(ids_ptr + rt, mask=t_ok, other=0).to(tl.int64)
    known = (ids >= 0) & (ids < V)
    ok = t_ok[:, None] & h_ok[None, :]
    row = table_ptr + tl.where(known, ids, 0)[:, None] * stride_t + rh[None, :]
    vals = tl.load(row, mask=ok & known[:, None], other=float("nan"))
    tl.store(out_ptr + rt.to(tl.int64)[:, None] * stride_o + rh[None, :], vals, mask=ok)


def embedding_supported(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> str | None:
    """Why :func:`embedding` cannot take these operands (``None``: it can; ``out`` None: not checked)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous():
        return f"ids must be a contiguous 1-D int32/int64 tensor, got {tuple(ids.shape)} {ids.dtype}"
    if table.dim() != 2 or table.stride(1) != 1:
        return f"table must be 2-D with unit stride in its last dim, got {tuple(table.shape)} strides {table.stride()}"
    if out is not None and (out.shape != (ids.shape[0], table.shape[1]) or out.dtype != table.dtype
                            or out.stride(-1) != 1):
        return (f"out must be [{ids.shape[0]}, {table.shape[1]}] {table.dtype} with unit stride in its last dim, "
                f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if ids.device != table.device or (out is not None and out.device != table.device):
        where = (out if out is not None else table).device
        return f"ids, table and out must share a device, got {ids.device}, {table.device}, {where}"
    if not table.dtype.is_floating_point:
        return f"table must be floating point (an unknown id reads NaN), got {table.dtype}"
    return None


def embedding(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = table[ids[t]]`` for ``ids [T]`` and ``table [V, H]``: ``out [T, H]`` in the table's
    dtype (made when None). Module docstring: ids outside ``[0, V)``."""
    if out is None:
        out = torch.empty(ids.shape[0] if ids.dim() == 1 else 0, table.shape[-1], dtype=table.dtype,
                          device=table.device)
    why = embedding_supported(ids, table, out)
    if why is not None:
        raise GraphDSLError(f"embedding kernel: {why}")
    T, H = out.shape
    if T == 0 or H == 0:
        return out
    block_t = min(16, triton.next_power_of_2(T))
    block_h = min(_BLOCK_H, triton.next_power_of_2(H))
    _embedding_kernel[(triton.cdiv(T, block_t), triton.cdiv(H, block_h))](
        ids, table, out, T, H, table.shape[0], table.stride(0), out.stride(0), BLOCK_T=block_t, BLOCK_H=block_h,
        num_warps=4, **pdl_launch(out.device))
    return out
