"""RoPE in Triton (``functional.attention.rope``): the rotation terms every q/k-rotating kernel shares,
and the ``rope`` op's own launch.

For dim ``d`` of a head and a token's ``cos``/``sin`` rows, :func:`rope_coeffs` gives the partner
dim and the two factors of ``x'[d] = x[d] * c + x[partner] * ss``: NEOX pairs ``(i, i + HALF)``,
GPT-J pairs ``(2i, 2i + 1)``, dims ``>= 2 * HALF`` unrotated. :func:`rotate_tile` applies them to a
token's ``[H, D]`` heads. :func:`rope` rotates q and k in one launch, one program a token (the op
where it is not fused with the cache write, ``codegen/rope_cache.py``: MLA's decoupled ``q_pe`` and
``k_pe``), computed in float32 and rounded once, as the op's torch reference.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError
from graphdsl.functional.attention import RopeLayout

from .pdl import pdl_launch, pdl_wait

__all__ = ["rope_coeffs", "rotate_tile", "rope", "rope_unsupported"]


@triton.jit
def rope_coeffs(cos_ptr, sin_ptr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, GPTJ: tl.constexpr):
    """Per dim ``d`` of a head: its rotation partner, ``c = cos[f]`` and ``ss = sign * sin[f]``, so that
    ``x'[d] = x[d] * c + x[partner] * ss`` (``functional.attention.rope``): NEOX pairs ``(i, i + HALF)``,
    GPT-J pairs ``(2i, 2i + 1)``; dims ``>= 2 * HALF`` pass through (partner = d, c = 1, ss = 0)."""
    d = tl.arange(0, HEAD_DIM)
    rot = d < 2 * HALF
    if GPTJ:
        partner = tl.where(d % 2 == 0, d + 1, d - 1)
        freq = d // 2
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    else:
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        freq = tl.where(first, d, d - HALF)
        sign = tl.where(first, -1.0, 1.0)
    partner = tl.where(rot, partner, d)
    c = tl.load(cos_ptr + freq, mask=rot, other=1.0).to(tl.float32)
    ss = sign * tl.load(sin_ptr + freq, mask=rot, other=0.0).to(tl.float32)
    return partner, c, ss


@triton.jit
def rotate_tile(x_ptr, tok_off, head_stride, h, d, partner, c, ss, H: tl.constexpr, D: tl.constexpr,
                ROT: tl.constexpr = 0):
    """``(x', mask)``: ``x' = x * c + x[partner] * ss`` over a token's ``[H, D]`` heads (``h``, ``d``:
    the tile's head and dim indices; :func:`rope_coeffs`), float32. ``ROT > 0``: dims ``>= ROT`` are
    ``x`` itself (an infinity there stays one, not ``inf * 0``)."""
    m = (h[:, None] < H) & (d[None, :] < D)
    base = x_ptr + tok_off + h[:, None] * head_stride
    x = tl.load(base + d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=m, other=0.0).to(tl.float32)
    out = x * c[None, :] + xp * ss[None, :]
    if ROT > 0:
        out = tl.where(d[None, :] < ROT, out, x)
    return out, m


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr,             # [T, HQ, D] / [T, HK, D] (last dim contiguous)
    cos_ptr, sin_ptr,         # [T, HALF]
    qo_ptr, ko_ptr,           # rotated q, k out (contiguous)
    q_st, q_sh, k_st, k_sh, cs_st,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, GPTJ: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Token ``program_id(0)``: ``q'``, ``k'`` of all its heads; dims ``>= 2 HALF`` copied as they are."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    partner, c, ss = rope_coeffs(cos_ptr + t * cs_st, sin_ptr + t * cs_st, BLOCK_D, HALF, GPTJ)
    hq = tl.arange(0, BLOCK_HQ)
    xq, mq = rotate_tile(q_ptr, t * q_st, q_sh, hq, d, partner, c, ss, HQ, D, 2 * HALF)
    tl.store(qo_ptr + t * (HQ * D) + hq[:, None] * D + d[None, :], xq.to(qo_ptr.dtype.element_ty), mask=mq)
    hk = tl.arange(0, BLOCK_HK)
    xk, mk = rotate_tile(k_ptr, t * k_st, k_sh, hk, d, partner, c, ss, HK, D, 2 * HALF)
    tl.store(ko_ptr + t * (HK * D) + hk[:, None] * D + d[None, :], xk.to(ko_ptr.dtype.element_ty), mask=mk)


_MAX_TILE = 65536            # elements of one program's q tile


def rope_unsupported(q, k, cos, sin, q_out, k_out) -> str | None:
    """Why :func:`rope` cannot take these operands (the op's torch reference runs instead), or None."""
    if q.dtype != q_out.dtype or k.dtype != k_out.dtype or q.dtype not in (torch.float16, torch.bfloat16,
                                                                           torch.float32):
        return f"dtypes q {q.dtype} -> {q_out.dtype}, k {k.dtype} -> {k_out.dtype}"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or not q_out.is_contiguous() or not k_out.is_contiguous():
        return "a q/k without a contiguous last dim, or a strided output"
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        return f"cos/sin strides {cos.stride()} and {sin.stride()}"
    if q.shape[2] != k.shape[2]:
        return f"q head_dim {q.shape[2]} != k head_dim {k.shape[2]}"
    if _pow2(q.shape[1]) * _pow2(q.shape[2]) > _MAX_TILE:
        return f"{q.shape[1]} heads x head_dim {q.shape[2]} exceed one program's tile ({_MAX_TILE} elements)"
    return None


def _pow2(n: int) -> int:
    return 1 << math.ceil(math.log2(max(n, 1)))


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor,
         k_out: torch.Tensor, layout: RopeLayout = RopeLayout.NEOX) -> tuple[torch.Tensor, torch.Tensor]:
    """``functional.attention.rope`` of ``q [T, HQ, D]`` and ``k [T, HK, D]`` into ``q_out``, ``k_out``
    (contiguous), one launch; operands :func:`rope_unsupported` refuses raise."""
    why = rope_unsupported(q, k, cos, sin, q_out, k_out)
    if why is not None:
        raise GraphDSLError(f"rope: unsupported operands ({why})")
    t, hq, d = q.shape
    if t:
        _rope_kernel[(t,)](q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           cos.stride(0), HQ=hq, HK=k.shape[1], D=d, HALF=cos.shape[-1],
                           GPTJ=layout is RopeLayout.GPTJ, BLOCK_HQ=_pow2(hq), BLOCK_HK=_pow2(k.shape[1]),
                           BLOCK_D=_pow2(d), num_warps=4, **pdl_launch(q.device))
    return q_out, k_out
