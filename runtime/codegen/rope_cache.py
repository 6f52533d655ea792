"""``rope_cache``: rotary embedding of q and k, and the paged KV-cache write of k and v, in one kernel.

The rotated k never goes to memory except into its cache slot, and q is read and written once.
One program handles one token: all its query heads, then all its key/value heads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError
from graphdsl.functional.attention import RopeLayout

from ..kernels.pdl import pdl_launch, pdl_wait
from ..kernels.rope import rope_coeffs, rotate_tile
from .fused import launch_config

__all__ = ["rope_cache", "prepare_rope_cache", "RopeCacheKernel"]


@triton.jit
def _rotate_halves(x_ptr, tok_off, head_stride, h, j, c, s, H: tl.constexpr, HALF: tl.constexpr):
    """NEOX over the whole head: (x1, x2) = (x[:HALF], x[HALF:]) -> (x1 c - x2 s, x2 c + x1 s) on an [H, HALF] tile."""
    m = (h[:, None] < H) & (j[None, :] < HALF)
    base = x_ptr + tok_off + h[:, None] * head_stride + j[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    return x1 * c[None, :] - x2 * s[None, :], x2 * c[None, :] + x1 * s[None, :], m


@triton.jit
def _rope_cache_kernel(
    q_ptr,            # [T, HQ, D] query (last dim contiguous)
    k_ptr,            # [T, HK, D] key
    v_ptr,            # [T, HK, D] value
    kc_ptr,           # [num_blocks, block_size, HK, D] key cache (contiguous), written in place
    vc_ptr,           # [num_blocks, block_size, HK, D] value cache (contiguous), written in place
    cos_ptr,          # [T, HALF] cos of position * frequency
    sin_ptr,          # [T, HALF] sin
    slot_ptr,         # [T] int slot = block * block_size + offset; < 0: padding, not written
    qo_ptr,           # [T, HQ, D] rotated query out (contiguous)
    q_st, q_sh,       # q token / head strides
    k_st, k_sh,       # k token / head strides
    v_st, v_sh,       # v token / head strides
    cs_st,            # cos/sin token stride
    HQ: tl.constexpr, HK: tl.constexpr,        # query / key-value heads
    D: tl.constexpr,                           # head dim
    HALF: tl.constexpr,                        # rotary dim / 2 (dims >= 2*HALF pass through)
    GPTJ: tl.constexpr,                        # pairs (2i, 2i+1) instead of (i, i + HALF)
    HALVES: tl.constexpr,                      # NEOX rotating the whole head: load the two halves once each
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,                     # launched with programmatic dependent launch (kernels/pdl.py)
):
    """For token t, head h, rotating pair (a, b) with frequency i:
        x'[a] = x[a] cos[t, i] - x[b] sin[t, i],   x'[b] = x[b] cos[t, i] + x[a] sin[t, i]
    NEOX: a = i, b = i + HALF;  GPT-J: a = 2i, b = 2i + 1.  Computed in float32.
    q_out[t] = q'[t];  key_cache.flat[slot[t]] = k'[t];  value_cache.flat[slot[t]] = v[t]  (slot >= 0)."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    hq = tl.arange(0, BLOCK_HQ)
    hk = tl.arange(0, BLOCK_HK)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if HALVES:
        j = tl.arange(0, BLOCK_HALF)
        cj = tl.load(cos_ptr + t * cs_st + j, mask=j < HALF, other=1.0).to(tl.float32)
        sj = tl.load(sin_ptr + t * cs_st + j, mask=j < HALF, other=0.0).to(tl.float32)
        q1, q2, mq = _rotate_halves(q_ptr, t * q_st, q_sh, hq, j, cj, sj, HQ, HALF)
        qo = qo_ptr + t * (HQ * D) + hq[:, None] * D + j[None, :]
        tl.store(qo, q1.to(qo_ptr.dtype.element_ty), mask=mq)
        tl.store(qo + HALF, q2.to(qo_ptr.dtype.element_ty), mask=mq)
        k1, k2, mk = _rotate_halves(k_ptr, t * k_st, k_sh, hk, j, cj, sj, HK, HALF)
        mk = mk & ((tl.zeros([BLOCK_HK, BLOCK_HALF], tl.int64) + slot) >= 0)
        kd = kc_ptr + slot * (HK * D) + hk[:, None] * D + j[None, :]
        tl.store(kd, k1.to(kc_ptr.dtype.element_ty), mask=mk)
        tl.store(kd + HALF, k2.to(kc_ptr.dtype.element_ty), mask=mk)
    else:
        _rope_cache_pairs(q_ptr, k_ptr, kc_ptr, cos_ptr, sin_ptr, qo_ptr, t, slot, q_st, q_sh, k_st, k_sh, cs_st,
                          hq, hk, d, HQ, HK, D, HALF, GPTJ, BLOCK_HK, BLOCK_D)
    mv = (hk[:, None] < HK) & (d[None, :] < D) & ((tl.zeros([BLOCK_HK, BLOCK_D], tl.int64) + slot) >= 0)
    v = tl.load(v_ptr + t * v_st + hk[:, None] * v_sh + d[None, :], mask=mv, other=0.0)
    tl.store(vc_ptr + slot * (HK * D) + hk[:, None] * D + d[None, :], v.to(vc_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _rope_cache_pairs(q_ptr, k_ptr, kc_ptr, cos_ptr, sin_ptr, qo_ptr, t, slot, q_st, q_sh, k_st, k_sh, cs_st,
                      hq, hk, d, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                      GPTJ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    """General layout (GPT-J pairs, or a partial rotary dim): each element reads its partner."""
    partner, c, ss = rope_coeffs(cos_ptr + t * cs_st, sin_ptr + t * cs_st, BLOCK_D, HALF, GPTJ)
    qr, mq = rotate_tile(q_ptr, t * q_st, q_sh, hq, d, partner, c, ss, HQ, D)
    tl.store(qo_ptr + t * (HQ * D) + hq[:, None] * D + d[None, :], qr.to(qo_ptr.dtype.element_ty), mask=mq)
    kr, mk = rotate_tile(k_ptr, t * k_st, k_sh, hk, d, partner, c, ss, HK, D)
    mk = mk & ((tl.zeros([BLOCK_HK, BLOCK_D], tl.int64) + slot) >= 0)
    tl.store(kc_ptr + slot * (HK * D) + hk[:, None] * D + d[None, :], kr.to(kc_ptr.dtype.element_ty), mask=mk)


@dataclass
class RopeCacheKernel:
    """A validated launch of :func:`_rope_cache_kernel` for one operand signature (reuse it per call)."""

    grid: tuple
    strides: tuple
    meta: dict

    def __call__(self, q, k, v, key_cache, value_cache, cos, sin, slot_mapping, q_out) -> None:
        if self.grid[0]:
            _rope_cache_kernel[self.grid](q, k, v, key_cache, value_cache, cos, sin, slot_mapping, q_out,
                                          *self.strides, **self.meta)


def prepare_rope_cache(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, q_out, layout: RopeLayout,
                       num_warps: int | None = None) -> RopeCacheKernel:
    """Check the operands and pick the launch (tile sizes from the shapes, warps from the shared heuristic)."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    half = cos.shape[-1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise GraphDSLError(f"rope_cache: {name} must have a contiguous last dim, got strides {x.stride()}")
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache), ("q_out", q_out)):
        if not x.is_contiguous():
            raise GraphDSLError(f"rope_cache: {name} must be contiguous, got strides {x.stride()}")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise GraphDSLError(f"rope_cache: cos/sin must share strides with a contiguous last dim, got "
                            f"{cos.stride()} and {sin.stride()}")
    if 2 * half > D:
        raise GraphDSLError(f"rope_cache: rotary dim {2 * half} exceeds head_dim {D}")
    block_d = 1 << math.ceil(math.log2(max(D, 1)))
    bhq, bhk = (1 << math.ceil(math.log2(max(h, 1))) for h in (HQ, HK))
    if bhq * block_d > 65536:
        raise GraphDSLError(f"rope_cache: {HQ} heads x head_dim {D} exceed one program's tile (65536 elements)")
    _, warps = launch_config(bhq * block_d, reduction=True)
    meta = dict(HQ=HQ, HK=HK, D=D, HALF=half, GPTJ=layout is RopeLayout.GPTJ,
                HALVES=layout is RopeLayout.NEOX and 2 * half == D, BLOCK_HQ=bhq, BLOCK_HK=bhk, BLOCK_D=block_d,
                BLOCK_HALF=1 << math.ceil(math.log2(max(half, 1))), num_warps=num_warps or min(warps, 8),
                **pdl_launch(q.device))
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0))
    return RopeCacheKernel((T,), strides, meta)


def _launch(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, q_out, layout: RopeLayout,
            num_warps: int | None = None) -> None:
    prepare_rope_cache(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, q_out, layout, num_warps)(
        q, k, v, key_cache, value_cache, cos, sin, slot_mapping, q_out)


def rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, *, layout=RopeLayout.NEOX,
               q_out: torch.Tensor | None = None):
    """Rotate q and k, write k' and v into the paged caches; returns (q', key_cache, value_cache)."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    _launch(q, k, v, key_cache, value_cache, cos, sin, slot_mapping, q_out, layout)
    return q_out, key_cache, value_cache
