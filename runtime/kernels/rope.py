"""RoPE rotation terms shared by the Triton kernels that rotate q/k (``functional.attention.rope``).

For dim ``d`` of a head and a token's ``cos``/``sin`` rows, :func:`rope_coeffs` gives the partner
dim and the two factors of ``x'[d] = x[d] * c + x[partner] * ss``: NEOX pairs ``(i, i + HALF)``,
GPT-J pairs ``(2i, 2i + 1)``, dims ``>= 2 * HALF`` unrotated.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rope_coeffs"]


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
