"""The gate/up projection with its SwiGLU in the epilogue, for decode batches of 17..256 rows.

``out[m, c] = silu(g) · u`` with ``g = Σ_k x[m, k] · w[c, k]`` and ``u = Σ_k x[m, k] · w[I + c, k]``
for ``x [M, K]`` and the packed ``w [2I, K] = [gate | up]`` (the ``matmul_silu_mul`` op). Below 17
rows the decode GEMV does this (:mod:`.gemv`); above 256, cuBLAS and the ``silu_mul`` kernel. In
between, the backend takes this kernel only for the row counts where it measured faster than cuBLAS
then ``silu_mul`` (:func:`launch_for`): 64 and 128 rows (the decode batch buckets), 256 with K ≤ 2048.

Between them cuBLAS pays twice: its tiles leave SMs idle on these shapes, and the product
``[M, 2I]`` makes one more round trip through memory for the ``silu_mul`` kernel. Here each program
computes one ``[BLOCK_M, BLOCK_N]`` output tile from two accumulators — the gate rows' and the
matching up rows' — over the whole K (``tl.dot``, float32), and writes only ``silu(g) · u``. g and u
are rounded to the output dtype first and ``silu(g)`` after, as the product and the ``silu_mul``
kernel round them, so the result differs from the two-kernel path only by the order of the float32
sums. The row tiles of one column tile are neighbours in the grid (``program_id(0)``), so they read
the same weight tile from L2 together and every weight byte streams from memory once.

The kernel waits for the previous kernel with programmatic dependent launch (:mod:`.pdl`) and asks
L2 for its first weight lines before that wait.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

from ..device import triton_interprets
from .pdl import pdl_launch, pdl_wait, prefetch_l2

__all__ = ["swiglu_gemm", "swiglu_gemm_supported", "launch_for", "MIN_ROWS", "MAX_ROWS"]

MIN_ROWS = 17          # fewer rows: the decode GEMV's SwiGLU epilogue (gemv.MAX_ROWS = 16)
MAX_ROWS = 256         # more rows: cuBLAS then silu_mul (not measured above the largest decode bucket)
_DTYPES = (torch.float16, torch.bfloat16)
_PREFETCH_LINES = 2    # 128-byte lines of each gate and up row asked of L2 before the PDL wait


@triton.jit
def _swiglu_gemm_kernel(x_ptr, w_ptr, out_ptr, M, I, K, stride_xm, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, STAGES: tl.constexpr, DOT_F32: tl.constexpr,
                        PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < I
    rn_safe = tl.where(n_ok, rn, 0).to(tl.int64)
    gate = w_ptr + rn_safe[None, :] * K + rk[:, None]                      # [BLOCK_K, BLOCK_N]
    up = gate + I.to(tl.int64) * K
    if PREFETCH:               # weights: no kernel of a step writes them, so before the wait
        prefetch_l2(w_ptr + rn_safe[:, None] * K, 0, K, PREFETCH, 64)
        prefetch_l2(w_ptr + (rn_safe[:, None] + I) * K, 0, K, PREFETCH, 64)
    pdl_wait(USE_PDL)
    xs = x_ptr + tl.where(m_ok, rm, 0).to(tl.int64)[:, None] * stride_xm + rk[None, :]    # [BLOCK_M, BLOCK_K]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            a = tl.load(xs + k)
            bg = tl.load(gate + k)
            bu = tl.load(up + k)
        else:
            k_ok = (k + rk) < K
            a = tl.load(xs + k, mask=k_ok[None, :], other=0.0)
            bg = tl.load(gate + k, mask=k_ok[:, None], other=0.0)
            bu = tl.load(up + k, mask=k_ok[:, None], other=0.0)
        if DOT_F32:            # the CPU interpreter's dot mishandles bfloat16
            a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
    dt = out_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    y = act * acc_u.to(dt).to(tl.float32)
    dst = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(dst, y.to(dt), mask=m_ok[:, None] & n_ok[None, :])


_TILE64 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, STAGES=3, num_warps=4)
_TILE128 = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, STAGES=3, num_warps=4)
_TILE128_WIDE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4, num_warps=8)
# (fewest rows, most rows, largest K or None, launch): where the tiled GEMM beat cuBLAS + silu_mul in
# ``python benchmarks/gemv.py --only 1b.gate_up,8b.gate_up --mid-rows 17,32,64,96,128,192,256 --mid-sweep``
# (H100; docs/performance-log.md). Rows that leave a row tile partly empty (96, 192) and 32 rows lost;
# at 256 rows it won only with K = 2048 (1B), cuBLAS being faster with K = 4096 (8B).
_WINS = ((49, 64, None, _TILE64), (113, 128, None, _TILE128), (225, 256, 2048, _TILE128_WIDE))


def launch_for(m: int, k: int) -> dict | None:
    """The launch for ``m`` rows of ``k`` inputs where it beats cuBLAS + ``silu_mul``, else None."""
    for lo, hi, k_max, cfg in _WINS:
        if lo <= m <= hi and (k_max is None or k <= k_max):
            return dict(cfg)
    return None


def swiglu_gemm_supported(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether :func:`swiglu_gemm` takes ``silu_mul(x @ w.T)`` into ``out``: CUDA (or the Triton
    interpreter), ``MIN_ROWS <= M <= MAX_ROWS`` fp16/bf16 rows with a unit last stride, a contiguous
    packed weight ``[2I, K]`` of the same dtype, ``out [M, I]`` of that dtype."""
    interpreting = triton_interprets()
    return ((x.device.type == "cuda" or interpreting) and x.dim() == 2 and w.dim() == 2
            and MIN_ROWS <= x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES and w.dtype == x.dtype
            and out.dtype == x.dtype and x.stride(-1) == 1 and w.is_contiguous() and w.shape[0] % 2 == 0
            and w.shape[1] == x.shape[1] and tuple(out.shape) == (x.shape[0], w.shape[0] // 2)
            and out.stride(-1) == 1)


def swiglu_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``x [M, K]`` (``MIN_ROWS <= M <= MAX_ROWS``) and the
    packed ``w [2I, K] = [gate | up]``, into ``out [M, I]`` (made when omitted). ``config`` overrides
    the launch (``BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps``; the benchmark sweeps it)."""
    m = x.shape[0] if x.dim() == 2 else -1
    if out is None and x.dim() == 2 and w.dim() == 2:
        out = torch.empty(m, w.shape[0] // 2, dtype=x.dtype, device=x.device)
    if out is None or not swiglu_gemm_supported(x, w, out):
        raise GraphDSLError(
            f"swiglu_gemm: needs x [M, K] with {MIN_ROWS} <= M <= {MAX_ROWS} in "
            f"{[str(d) for d in _DTYPES]} (unit last stride), a contiguous w [2I, K] of that dtype and out "
            f"[M, I] of that dtype; got x {list(x.shape)} {x.dtype} strides {x.stride()}, w {list(w.shape)} "
            f"{w.dtype} contiguous={w.is_contiguous()}, out "
            f"{None if out is None else (list(out.shape), str(out.dtype), out.stride())}")
    k, i = x.shape[1], w.shape[0] // 2
    cfg = dict(config or launch_for(m, k) or (_TILE64 if m <= 64 else _TILE128))
    block_m, block_n, block_k = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    interpret = triton_interprets()
    grid = (triton.cdiv(m, block_m), triton.cdiv(i, block_n))
    _swiglu_gemm_kernel[grid](x, w, out, m, i, k, x.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_K=block_k, EVEN_K=k % block_k == 0, DOT_F32=interpret and x.dtype == torch.bfloat16,
                              PREFETCH=0 if interpret else _PREFETCH_LINES,
                              **pdl_launch(x.device), **cfg)
    return out
