"""Triton LoRA kernels over a per-token adapter index (BGMV): ``shrink`` then ``expand``.

``lora_apply`` computes ``out[t] = y[t] + (x[t]·A[s]ᵀ)·B[s]ᵀ`` with ``s = indices[t]`` (``s < 0``:
no adapter, ``out[t] = y[t]``), ``A [S, R, K]``, ``B [S, N, R]`` (scaling folded into B), in two
launches:

* **shrink** — program ``t`` streams ``x[t]`` and ``A[s]`` in ``[BLOCK_R, BLOCK_K]`` tiles and
  writes ``v[t] = x[t]·A[s]ᵀ`` (float32, ``R`` values) to a small workspace;
* **expand** — program ``(t, n)`` reads ``v[t]`` and the ``[BLOCK_N, R]`` tile of ``B[s]`` and
  writes ``out[t, n-block] = y[t, n-block] + B·v``.

Each token gathers its own adapter (the "batched gather matrix-vector" of Punica/vLLM), so one
launch serves a batch mixing adapters and base rows, decode and prefill alike. At decode sizes
the kernels read ``R·(K + N)`` adapter values a row (about 1 % of the base weight at rank 16),
mostly from L2 when rows share an adapter. A prefill of many tokens rereads the factors per token
(from L2); a segmented GEMM over tokens grouped by adapter would do better there (not built yet).

File shape (STYLE.md 11): the two ``@triton.jit`` kernels, the launch heuristic :func:`_blocks`,
the public wrapper :func:`lora_apply` and :func:`lora_supported`.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

__all__ = ["lora_apply", "lora_supported", "MAX_RANK"]

MAX_RANK = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _shrink_kernel(x_ptr,        # [T, K] activations, row stride stride_x, unit inner stride
                   a_ptr,        # [S, R, K] contiguous A factors of every slot
                   idx_ptr,      # [T] int slot of each token (< 0: none)
                   v_ptr,        # [T, R] float32 out: v[t] = x[t] · A[s]ᵀ
                   K, R, stride_x,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """v[t, r] = Σ_k x[t, k] · A[s, r, k]; rows without an adapter write zeros."""
    t = tl.program_id(0)
    s = tl.load(idx_ptr + t).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if s >= 0:
        a_row = a_ptr + s * R * K + r[:, None].to(tl.int64) * K
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            ak = tl.load(a_row + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(ak * xk[None, :], axis=1)
    tl.store(v_ptr + t.to(tl.int64) * R + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(v_ptr,        # [T, R] float32 from the shrink
                   b_ptr,        # [S, N, R] contiguous B factors (scaling folded in)
                   idx_ptr,      # [T] int slot of each token (< 0: none)
                   y_ptr,        # [T, N] base output, row stride stride_y
                   out_ptr,      # [T, N] out = y + v · B[s]ᵀ, row stride stride_o
                   N, R, stride_y, stride_o,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[t, n] = y[t, n] + Σ_r v[t, r] · B[s, n, r] (out[t] = y[t] when s < 0)."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.load(idx_ptr + t).to(tl.int64)
    y = tl.load(y_ptr + t.to(tl.int64) * stride_y + n, mask=n < N, other=0.0)
    acc = y.to(tl.float32)
    if s >= 0:
        r = tl.arange(0, BLOCK_R)
        v = tl.load(v_ptr + t.to(tl.int64) * R + r, mask=r < R, other=0.0)
        b = tl.load(b_ptr + s * N * R + n[:, None].to(tl.int64) * R + r[None, :],
                    mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
        acc += tl.sum(b * v[None, :], axis=1)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


def _blocks(rank: int, interpreted: bool) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_K, BLOCK_N)``: the rank padded to a power of two (>= 16); K and N tiles
    of about 4K float32 values a program (smaller under the interpreter)."""
    block_r = max(16, triton.next_power_of_2(rank))
    budget = 1024 if interpreted else 8192
    tile = max(16, min(256, budget // block_r))
    return block_r, tile, tile


def lora_supported(y, x, a, b, indices) -> str | None:
    """Why the kernels cannot take this call (None: they can)."""
    if x.dtype not in _DTYPES or a.dtype != x.dtype or b.dtype != x.dtype or y.dtype not in _DTYPES:
        return f"dtypes x {x.dtype}, a {a.dtype}, b {b.dtype}, y {y.dtype}"
    if a.shape[1] > MAX_RANK:
        return f"rank {a.shape[1]} > {MAX_RANK}"
    if not (a.is_contiguous() and b.is_contiguous() and indices.is_contiguous()):
        return "non-contiguous factors or indices"
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        return "non-unit inner strides"
    return None


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, indices: torch.Tensor, *,
               out: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """``out = y + (x·A[idx]ᵀ)·B[idx]ᵀ`` per token (see the module docstring). ``workspace``: a
    float32 buffer of at least ``T·R`` values for the shrink result (allocated when omitted)."""
    why = lora_supported(y, x, a, b, indices)
    if why is not None:
        raise GraphDSLError(f"lora_apply kernel: unsupported operands: {why}")
    t, k = x.shape
    _, r, _ = a.shape
    n = b.shape[1]
    out = torch.empty_like(y) if out is None else out
    if t == 0:
        return out
    if workspace is None or workspace.numel() < t * r:
        workspace = torch.empty(t * r, dtype=torch.float32, device=x.device)
    block_r, block_k, block_n = _blocks(r, os.environ.get("TRITON_INTERPRET") == "1")
    _shrink_kernel[(t,)](x, a, indices, workspace, k, r, x.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
    _expand_kernel[(t, triton.cdiv(n, block_n))](workspace, b, indices, y, out, n, r, y.stride(0), out.stride(0),
                                                 BLOCK_N=block_n, BLOCK_R=block_r)
    return out
