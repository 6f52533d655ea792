"""LoRA over a per-token adapter index: Triton BGMV kernels for a few rows, slot-dense cuBLAS for many.

``lora_apply`` computes ``out[t] = y[t] + (x[t]·A[s]ᵀ)·B[:, s]ᵀ`` with ``s = indices[t]`` (``s < 0``:
no adapter, ``out[t] = y[t]``), ``A [S, R, K]``, ``B [N, S, R]`` (scaling folded into B), for a
batch that mixes adapters and base rows:

* **few rows** (``T <= MAX_BGMV_ROWS``: decode) — two launches of the "batched gather
  matrix-vector" kind (Punica/vLLM's BGMV): the **shrink** program ``(t, k-slice)`` reduces
  ``x[t]`` against its adapter's ``A[s]`` over one ``LORA_SPLIT_K`` slice of K and writes ``R``
  float32 partial sums (split-K: a batch-1 shrink of a 14336-wide input spreads over 28 programs
  instead of one streaming 460 KB); the **expand** program ``(t, n-block)`` sums the partials into
  ``v[t]`` and writes ``y[t, n-block] + B[n-block, s]·v[t]``. Each row reads only its own adapter.
* **many rows** (prefill, large decode batches) — slot-dense: ``V = x·A_allᵀ`` over every slot's
  A at once (one cuBLAS GEMM, ``[T, S·R]``), a mask kernel zeroing each row's columns of other
  slots (all of them for base rows), then ``out = y + V·B_allᵀ`` (one cuBLAS ``addmm``; ``B`` is
  output-major so ``B_all = B.view(N, S·R)``). It reads every slot's factors once per call (a few
  MB per layer at rank 16) instead of once per token, and its GEMMs run at matmul rate. The
  wasted work is ``(S - 1)/S`` of a rank-``S·R`` product, small next to the base GEMM. (A
  segmented GEMM over tokens grouped by adapter, as Punica's SGMV, avoids even that; not built.)

File shape (STYLE.md 11): the ``@triton.jit`` kernels, the launch heuristic :func:`_blocks`,
:func:`lora_supported` and the public wrapper :func:`lora_apply`.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError
from graphdsl.functional.lora import LORA_SPLIT_K

__all__ = ["lora_apply", "lora_supported", "MAX_RANK", "MAX_BGMV_ROWS"]

MAX_RANK = 256          # slot width (parts · rank) the kernels take
MAX_BGMV_ROWS = 16      # rows up to which the per-token kernels run (beyond: slot-dense GEMMs)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _shrink_kernel(x_ptr,        # [T, K] activations, row stride stride_x, unit inner stride
                   a_ptr,        # [S, R, K] contiguous A factors of every slot
                   idx_ptr,      # [T] int slot of each token (< 0: none)
                   p_ptr,        # [T, SPLITS, R] float32 out: partial sums of x[t] · A[s]ᵀ per K slice
                   K, R, SPLITS, stride_x,
                   SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """p[t, j, r] = Σ_{k in slice j} x[t, k] · A[s, r, k]; rows without an adapter write nothing."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.load(idx_ptr + t).to(tl.int64)
    if s >= 0:
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        a_row = a_ptr + s * R * K + r[:, None].to(tl.int64) * K
        for k0 in range(j * SPLIT_K, j * SPLIT_K + SPLIT_K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            ak = tl.load(a_row + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(ak * xk[None, :], axis=1)
        tl.store(p_ptr + (t.to(tl.int64) * SPLITS + j) * R + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(p_ptr,        # [T, SPLITS, R] float32 partials from the shrink
                   b_ptr,        # [N, S, R] contiguous B factors (scaling folded in)
                   idx_ptr,      # [T] int slot of each token (< 0: none)
                   y_ptr,        # [T, N] base output, row stride stride_y
                   out_ptr,      # [T, N] out = y + B[:, s] · v, row stride stride_o
                   N, S, R, SPLITS, stride_y, stride_o,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """v[t] = Σ_j p[t, j]; out[t, n] = y[t, n] + Σ_r v[t, r] · B[n, s, r] (out[t] = y[t] when s < 0)."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.load(idx_ptr + t).to(tl.int64)
    y = tl.load(y_ptr + t.to(tl.int64) * stride_y + n, mask=n < N, other=0.0)
    acc = y.to(tl.float32)
    if s >= 0:
        r = tl.arange(0, BLOCK_R)
        v = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for j in range(0, SPLITS):
            v += tl.load(p_ptr + (t.to(tl.int64) * SPLITS + j) * R + r, mask=r < R, other=0.0)
        b = tl.load(b_ptr + n[:, None].to(tl.int64) * S * R + s * R + r[None, :],
                    mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
        acc += tl.sum(b * v[None, :], axis=1)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _mask_kernel(v_ptr,          # [T, S·R] every slot's shrink product (in place)
                 idx_ptr,        # [T] int slot of each token (< 0: none)
                 SR, R,
                 BLOCK: tl.constexpr):
    """v[t, c] = 0 unless column c belongs to the token's own slot (c // R == s)."""
    t = tl.program_id(0)
    s = tl.load(idx_ptr + t)
    for c0 in range(0, SR, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        keep = (c // R) == s
        ptr = v_ptr + t.to(tl.int64) * SR + c
        v = tl.load(ptr, mask=c < SR, other=0.0)
        tl.store(ptr, tl.where(keep, v, tl.zeros_like(v)), mask=c < SR)


def _blocks(rank: int, interpreted: bool) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_K, BLOCK_N)``: the slot width padded to a power of two (>= 16); K and N tiles
    of about 8K float32 products a program (1K under the interpreter); BLOCK_K divides LORA_SPLIT_K."""
    block_r = max(16, triton.next_power_of_2(rank))
    budget = 1024 if interpreted else 8192
    tile = max(16, min(256, budget // block_r))
    return block_r, min(tile, LORA_SPLIT_K), tile


def lora_supported(y, x, a, b, indices) -> str | None:
    """Why the kernels cannot take this call (None: they can)."""
    if x.dtype not in _DTYPES or a.dtype != x.dtype or b.dtype != x.dtype or y.dtype != x.dtype:
        return f"dtypes x {x.dtype}, a {a.dtype}, b {b.dtype}, y {y.dtype}"
    if a.shape[1] > MAX_RANK:
        return f"slot width {a.shape[1]} > {MAX_RANK}"
    if not (a.is_contiguous() and b.is_contiguous() and indices.is_contiguous()):
        return "non-contiguous factors or indices"
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        return "non-unit inner strides"
    return None


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, indices: torch.Tensor, *,
               out: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
               dense: bool | None = None) -> torch.Tensor:
    """``out = y + (x·A[idx]ᵀ)·B[:, idx]ᵀ`` per token (module docstring). ``workspace``: float32 scratch
    of at least ``T·R·max(splits, S)`` values (the op's workspace rule; allocated when omitted).
    ``dense`` forces the path (default: slot-dense above ``MAX_BGMV_ROWS`` rows)."""
    why = lora_supported(y, x, a, b, indices)
    if why is not None:
        raise GraphDSLError(f"lora_apply kernel: unsupported operands: {why}")
    t, k = x.shape
    slots, r, _ = a.shape
    n = b.shape[0]
    out = torch.empty_like(y) if out is None else out
    if t == 0:
        return out
    splits = triton.cdiv(k, LORA_SPLIT_K)
    need = t * r * max(splits, slots)
    if workspace is None or workspace.numel() < need:
        workspace = torch.empty(need, dtype=torch.float32, device=x.device)
    dense = t > MAX_BGMV_ROWS if dense is None else dense
    if dense:
        v = workspace.view(x.dtype)[:t * slots * r].view(t, slots * r)
        torch.matmul(x, a.view(slots * r, k).T, out=v)
        _mask_kernel[(t,)](v, indices, slots * r, r, BLOCK=min(1024, triton.next_power_of_2(slots * r)))
        torch.addmm(y, v, b.view(n, slots * r).T, out=out)
        return out
    block_r, block_k, block_n = _blocks(r, os.environ.get("TRITON_INTERPRET") == "1")
    _shrink_kernel[(t, splits)](x, a, indices, workspace, k, r, splits, x.stride(0),
                                SPLIT_K=LORA_SPLIT_K, BLOCK_R=block_r, BLOCK_K=block_k)
    _expand_kernel[(t, triton.cdiv(n, block_n))](workspace, b, indices, y, out, n, slots, r, splits, y.stride(0),
                                                 out.stride(0), BLOCK_N=block_n, BLOCK_R=block_r)
    return out
