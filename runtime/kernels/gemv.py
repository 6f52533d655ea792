"""Triton GEMV for decode: ``out = x @ w.T (+ add)`` for a few rows ``x`` (M <= 16).

At decode batch sizes a projection reads its whole weight ``w [N, K]`` to produce a handful of
rows, so the op is bound by the bytes of ``w``. One program owns ``BLOCK_N`` output columns: it
streams its ``[BLOCK_N, K]`` slab of ``w`` once, in ``[BLOCK_N, BLOCK_K]`` tiles contiguous along K
(16-byte loads), multiplies each tile by the matching ``[M, BLOCK_K]`` slice of ``x`` and reduces
over K in float32; the optional addend (a bias ``[N]`` or a residual ``[M, N]``) is added before
the one store.

Status (measured, ``benchmarks/gemv.py`` on an H200): at M = 1 the best tiles only match cuBLAS
(qkv 50% vs 53% of copy bandwidth, gate_up 73% vs 79%, lm_head 87% vs 96%), and at M = 8 the
broadcast-reduce inner product is ~10x slower than cuBLAS, so the Triton backend does not use this
kernel yet. Next: split-K over more programs (more loads in flight for the narrow projections) and
``tl.dot`` for M >= 8.

File shape (STYLE.md 11): the ``@triton.jit`` kernel, a launcher that checks operands and picks the
tile with :func:`_pick_config`, the thin public wrapper :func:`gemv`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

__all__ = ["gemv", "gemv_supported", "MAX_ROWS"]

MAX_ROWS = 16
_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _gemv_kernel(
    x_ptr,          # [M, K] input rows (last dim contiguous)
    w_ptr,          # [N, K] weight, row-major contiguous (HF [out, in] layout)
    add_ptr,        # [M, N] residual, [N] bias, or unused (HAS_ADD = False)
    out_ptr,        # [M, N] output (last dim contiguous)
    M, N, K,        # sizes
    stride_xm,      # x row stride (elements)
    stride_am,      # addend row stride (0 for a bias)
    stride_om,      # out row stride
    HAS_ADD: tl.constexpr,
    BLOCK_M: tl.constexpr,   # next power of two >= M
    BLOCK_N: tl.constexpr,   # output columns per program
    BLOCK_K: tl.constexpr,   # reduction tile
    EVEN_K: tl.constexpr,    # K % BLOCK_K == 0: no masks along K
):
    """out[m, n] = sum_k x[m, k] * w[n, k] (+ add[m, n]), accumulated in float32."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        else:
            k_ok = kk < K
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        acc += tl.sum(prod, axis=2)
    mask = m_ok[:, None] & n_ok[None, :]
    if HAS_ADD:
        a = tl.load(add_ptr + rm[:, None] * stride_am + rn[None, :], mask=mask, other=0.0)
        acc += a.to(tl.float32)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pick_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """Tile and warps from the H200 sweep of ``benchmarks/gemv.py --sweep`` (M = 1): ``BLOCK_N`` 8
    and ``BLOCK_K`` 512, five stages, were best or within a few percent on every Llama projection
    but the lm head (16); the [M, N, K] tile product stays <= 8192 elements per step (registers)."""
    block_m = _pow2(m)
    block_n = 16 if n >= 65536 else 8
    block_k = max(32, min(512, 8192 // (block_m * block_n), _pow2(k)))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=5)


def gemv_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes these operands (the backend falls back to cuBLAS otherwise)."""
    return (x.dim() == 2 and w.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES
            and w.dtype == x.dtype and w.is_contiguous() and x.stride(1) == 1 and x.shape[1] == w.shape[1])


def gemv(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
         config: dict | None = None) -> torch.Tensor:
    """``x @ w.T (+ add)`` for ``x [M <= 16, K]``, ``w [N, K]`` (fp16/bf16); ``add`` is ``[N]`` or
    ``[M, N]``. ``config`` overrides the tile heuristic (benchmarks sweep it)."""
    if not gemv_supported(x, w):
        raise GraphDSLError(f"gemv: needs x [M<= {MAX_ROWS}, K] and a contiguous w [N, K] of one dtype in "
                            f"{[str(d) for d in _DTYPES]}, got x {list(x.shape)} {x.dtype} strides {x.stride()}, "
                            f"w {list(w.shape)} {w.dtype} contiguous={w.is_contiguous()}")
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.stride(1) != 1:
        raise GraphDSLError(f"gemv: out must be [{m}, {n}] with a contiguous last dim, got {list(out.shape)} "
                            f"strides {out.stride()}")
    if add is not None and tuple(add.shape) not in ((n,), (m, n)):
        raise GraphDSLError(f"gemv: add must be a bias [{n}] or a residual [{m}, {n}], got {list(add.shape)}")
    if add is not None and add.stride(-1) != 1:
        raise GraphDSLError(f"gemv: add must have a contiguous last dim, got strides {add.stride()}")
    cfg = dict(config or _pick_config(m, n, k, x.device))
    stride_am = 0 if add is None or add.dim() == 1 else add.stride(0)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    _gemv_kernel[grid](x, w, add if add is not None else out, out, m, n, k, x.stride(0), stride_am, out.stride(0),
                       HAS_ADD=add is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, **cfg)
    return out
