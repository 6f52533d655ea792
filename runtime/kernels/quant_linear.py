"""Triton dequantize-in-GEMV/GEMM for ``quant_linear``: ``out = x @ W.T``, ``W`` stored quantized.

One kernel serves the weight-only schemes of :mod:`graphdsl.quant` (int8 per-channel, int4
group-wise symmetric or with zero points, fp8 e4m3 per-tensor or per-channel) for prefill and for
what the decode GEMV (:mod:`.gemv`, which dequantizes in registers with split-K, PDL and the
SwiGLU / residual epilogues; :func:`quant_linear` hands it up to 16 fp16/bf16 rows, fp8 with
dynamic activation scales included) does not take: float32 rows, and fp8 with dynamic activation
scales off Hopper or past 16 rows where ``torch._scaled_mm`` does not take them:

* **Tiles.** Program ``(n, m)`` owns ``BLOCK_N`` output columns and ``BLOCK_M`` rows (padded with
  masked loads; decode uses ``BLOCK_M = 16``, the smallest ``tl.dot``; prefill larger tiles, so
  the same kernel is the dequantize-in-GEMM). It streams its ``[BLOCK_N, K]`` slab of stored
  weights in ``[BLOCK_N, BLOCK_K]`` tiles.
* **Dequantize in registers.** int4 tiles load ``BLOCK_K / 2`` bytes per row and split the nibbles
  (``tl.interleave(lo, hi)``: even ``k`` low, odd ``k`` high); group-wise weights become
  ``(q - z) * s`` per group in registers (a tile holds ``BLOCK_K / GROUP`` groups, or lies inside
  one) and enter ``tl.dot`` in the activation dtype; per-channel / per-tensor codes (int8 exact in
  bf16, fp8 e4m3 exact in bf16/fp16) enter as they are and the scale multiplies the float32 result.
* fp8 with dynamic per-token activations (``-dyn``) quantizes the rows first (the op's semantics)
  and feeds the dequantized rows as float32.

Files shape (STYLE.md 11): the kernel, :func:`_pick_config`, :func:`quant_linear_supported` and the
wrapper :func:`quant_linear`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError
from graphdsl.quant import Fp8Scheme, IntScheme, QuantScheme, quantize_fp8_rows

from ..device import triton_interprets
from .gemv_loops import _kb_words

__all__ = ["quant_linear", "quant_linear_supported", "KIND_INT8", "KIND_INT4", "KIND_INT4_ZP", "KIND_FP8"]

KIND_INT8, KIND_INT4, KIND_INT4_ZP, KIND_FP8 = 0, 1, 2, 3
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DECODE_K = 512            # K step of the decode tiles (benchmarks/quant.py --sweep: 512 beat 256 and 1024)
_DECODE_STAGES = 4


@triton.jit
def _quant_linear_kernel(
    x_ptr,          # [M, K] rows, last dim contiguous
    q_ptr,          # [N, K] int8 / fp8 codes, or [N, K/2] int4 bytes (row-major, contiguous; KB: in blocks)
    s_ptr,          # [N, G] scales (G = K / GROUP), or [1, 1] for per-tensor (stride_sn = 0)
    z_ptr,          # [N, G] zero points (KIND_INT4_ZP) or unused
    out_ptr,        # [M, N] output, last dim contiguous
    M, N, K,
    stride_xm, stride_sn, stride_om,
    KIND: tl.constexpr,          # KIND_INT8 / KIND_INT4 / KIND_INT4_ZP / KIND_FP8
    GROUPED: tl.constexpr,       # one scale per GROUP inputs (else one per row, applied at the end)
    GROUP: tl.constexpr,         # inputs per scale when GROUPED (a multiple or a divisor of BLOCK_K)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,        # K % BLOCK_K == 0
    DOT_F32: tl.constexpr,       # multiply in float32 (float32 rows, or the CPU interpreter's bf16 dot)
    KB: tl.constexpr = False,    # int4 bytes in blocks of 64 a row (scheme.blocked: graphdsl.quant.int4_blocks)
):
    """out[m, n] = sum_k x[m, k] * W[n, k], W[n, k] = (q[n, k] - z[n, k // GROUP]) * s[n, k // GROUP]
    (z = 8 for symmetric int4, 0 otherwise), float32 accumulation."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    HALF: tl.constexpr = BLOCK_K // 2
    rh = tl.arange(0, HALF)
    rn64 = rn.to(tl.int64)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        if EVEN_K:
            a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        else:
            a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if KIND == 1 or KIND == 2:
            kh = k0 // 2 + rh
            if KB:          # byte kh of row n at [kh // 64, n, kh % 64]
                q_at = q_ptr + rn64[:, None] * 64 + _kb_words(kh, N, 64)[None, :]
            else:
                q_at = q_ptr + rn64[:, None] * (K // 2) + kh[None, :]
            b = tl.load(q_at, mask=n_ok[:, None] & (kh < K // 2)[None, :], other=0).to(tl.int32)
            q = tl.interleave(b & 15, (b >> 4) & 15).to(tl.float32)
        else:
            # no ``other=``: fp8 has no literal zero here; masked lanes are zeroed after the cast
            q_ok = n_ok[:, None] & k_ok[None, :]
            q = tl.where(q_ok, tl.load(q_ptr + rn64[:, None] * K + kk[None, :], mask=q_ok).to(tl.float32), 0.0)
        if GROUPED:
            # per group: W = (q - z) * s, in registers; NG groups per tile (or one group spans tiles)
            NG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1
            gi = k0 // GROUP + tl.arange(0, NG)
            g_ok = n_ok[:, None] & (gi < (K + GROUP - 1) // GROUP)[None, :]
            s = tl.load(s_ptr + rn64[:, None] * stride_sn + gi[None, :], mask=g_ok, other=0.0).to(tl.float32)
            if KIND == 2:
                z = tl.load(z_ptr + rn64[:, None] * stride_sn + gi[None, :], mask=g_ok, other=0.0).to(tl.float32)
            elif KIND == 1:
                z = tl.full([BLOCK_N, NG], 8.0, tl.float32)
            else:
                z = tl.zeros([BLOCK_N, NG], tl.float32)
            q3 = tl.reshape(q, [BLOCK_N, NG, BLOCK_K // NG])
            q = tl.reshape((q3 - z[:, :, None]) * s[:, :, None], [BLOCK_N, BLOCK_K])
        if DOT_F32:       # float32 rows are float32 math (a GPU's default tf32 keeps 10 mantissa bits)
            acc += tl.dot(q, tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(q.to(a.dtype), tl.trans(a))
    if not GROUPED:
        s = tl.load(s_ptr + rn64 * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
        acc = acc * s[:, None]
    out = out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def _kind(scheme: QuantScheme) -> int | None:
    if isinstance(scheme, IntScheme):
        return KIND_INT8 if scheme.bits == 8 else (KIND_INT4_ZP if scheme.zero_point else KIND_INT4)
    if isinstance(scheme, Fp8Scheme):
        return KIND_FP8
    return None


def _pick_config(m: int, n: int, k: int, scheme: QuantScheme, device: torch.device) -> dict:
    """Tiles: decode (M <= 16) takes 16 x 32 x 512 tiles, 4 stages (the best total over the
    Llama-3-8B projections of the H200 sweep in ``benchmarks/quant.py --sweep``); prefill 64 x 64 x 64."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=_DECODE_K, num_warps=4, num_stages=_DECODE_STAGES)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


def quant_linear_supported(x: torch.Tensor, scheme: QuantScheme, stored: list[torch.Tensor]) -> str | None:
    """Why :func:`quant_linear` cannot take these operands (``None``: it can)."""
    if _kind(scheme) is None:
        return f"no Triton kernel for scheme {scheme.name}"
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in _DTYPES:
        return f"x must be 2-D, float, last dim contiguous; got {list(x.shape)} {x.dtype} strides {x.stride()}"
    if not all(t.is_contiguous() for t in stored):
        return "stored tensors must be contiguous"
    if isinstance(scheme, IntScheme) and scheme.bits == 4 and x.shape[1] % 32:
        return f"int4 needs K % 32 == 0, got K={x.shape[1]}"
    if isinstance(scheme, IntScheme) and scheme.bits == 4 and stored[0].dim() != (3 if scheme.blocked else 2):
        return (f"{scheme.name} codes must be {'[blocks, N, 64]' if scheme.blocked else '[N, K / 2]'}, got "
                f"{list(stored[0].shape)}")
    return None


def quant_linear(x: torch.Tensor, stored: list[torch.Tensor], scheme: QuantScheme, out_features: int, *,
                 out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``x [M, K]`` with ``W [out_features, K]`` stored in ``scheme`` (companions in the
    scheme's order), the result in ``x``'s dtype. ``config`` overrides :func:`_pick_config`."""
    why = quant_linear_supported(x, scheme, stored)
    if why is not None:
        raise GraphDSLError(f"quant_linear kernel ({scheme.name}): {why}")
    m, k = x.shape
    n = out_features
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise GraphDSLError(f"quant_linear: out must be [{m}, {n}] {x.dtype} with a contiguous last dim, got "
                            f"{list(out.shape)} {out.dtype} strides {out.stride()}")
    if m == 0:
        return out
    if config is None and m <= 16 and x.dtype != torch.float32:
        from .gemv import gemv, gemv_supported
        if gemv_supported(x, stored[0], scheme):      # decode: the GEMV dequantizing in registers
            return gemv(x, stored[0], out=out, scheme=scheme, scales=stored[1],
                        zeros=stored[2] if len(stored) > 2 else None)
    if isinstance(scheme, Fp8Scheme) and scheme.dynamic_activations:
        xq, sx = quantize_fp8_rows(x)
        x = xq.float() * sx
    kind = _kind(scheme)
    q, s = stored[0], stored[1]
    z = stored[2] if kind == KIND_INT4_ZP else s
    cfg = dict(config or _pick_config(m, n, k, scheme, x.device))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    grouped = isinstance(scheme, IntScheme) and scheme.group_size is not None
    group = scheme.group_size if grouped else bk
    if grouped and group % bk and bk % group:
        raise GraphDSLError(f"quant_linear: BLOCK_K {bk} and the group size {group} must divide one another")
    interp = triton_interprets()
    _quant_linear_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        x, q, s, z, out, m, n, k, x.stride(0), s.stride(0) if s.shape[0] > 1 else 0, out.stride(0),
        KIND=kind, GROUPED=grouped, GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        DOT_F32=x.dtype == torch.float32 or (interp and x.dtype == torch.bfloat16),
        KB=isinstance(scheme, IntScheme) and scheme.blocked, **cfg)
    return out
