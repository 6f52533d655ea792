"""One decode row's activations in the bytes of the int4 GEMV's integer-dot loop, made once.

The one-row int4 GEMV (:func:`.gemv_loops._int4_step_dp4a`) turns each group of ``G`` inputs into 16-bit
fixed point, ``x ≈ a · xq`` with ``a = max|x_g| / 32767`` and ``xq = round(x / a)``, and packs
the bytes for ``dp4a``. Every program does this for every step of its K slice, so the same bytes
are made once per program. Here one small launch makes them once for the row, and the GEMV reads
them (``gemv(..., xpack=)``). That frees the loop's registers and instructions for wider steps.

Layout, int32 ``[6, K / 8]``: for word ``c`` (inputs ``8c .. 8c + 7``), plane 0 holds the high
bytes of the even inputs ``8c, 8c + 2, 8c + 4, 8c + 6`` and plane 1 of the odd ones. Planes 2 and
3 hold the low bytes of the same inputs, plane 4 the sum ``Σ_i xq[8c + i]``. Plane 5's first
``K / G`` words are the groups' ``a``, as float32 bits. The arithmetic is the loop's own
(:func:`.gemv_loops._pack_store`, :func:`.gemv_loops._group_amax`), so the GEMV's sums are the same bits with
or without it; a residual GEMV carrying the next RMSNorm stores the same bytes in its epilogue
(:class:`.gemv.GemvRmsOut` ``packed``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError

from ..device import triton_interprets
from .gemv_loops import _group_amax, _pack_store, _x_at
from .pdl import pdl_launch, pdl_wait

__all__ = ["pack_int4_activations", "pack_int4_activations_reference"]


@triton.jit
def _input(x_ptr, perm_ptr, k, PERM: tl.constexpr):
    """``x[k]`` (``x[perm[k]]`` with ``PERM``) as float32."""
    return _x_at(x_ptr, perm_ptr, k, PERM).to(tl.float32)


@triton.jit
def _pack_kernel(x_ptr, perm_ptr, out_ptr, W_X, GROUP: tl.constexpr, PERM: tl.constexpr, USE_PDL: tl.constexpr):
    """Program ``g``: group ``g``'s ``GROUP / 8`` words (of ``x[perm]`` with ``PERM``)."""
    g = tl.program_id(0)
    C: tl.constexpr = GROUP // 8
    c = g * C + tl.arange(0, C)
    pdl_wait(USE_PDL)
    k = 8 * c
    x0, x1 = _input(x_ptr, perm_ptr, k, PERM), _input(x_ptr, perm_ptr, k + 1, PERM)
    x2, x3 = _input(x_ptr, perm_ptr, k + 2, PERM), _input(x_ptr, perm_ptr, k + 3, PERM)
    x4, x5 = _input(x_ptr, perm_ptr, k + 4, PERM), _input(x_ptr, perm_ptr, k + 5, PERM)
    x6, x7 = _input(x_ptr, perm_ptr, k + 6, PERM), _input(x_ptr, perm_ptr, k + 7, PERM)
    amax = _group_amax(x0, x1, x2, x3, x4, x5, x6, x7, 0)
    _pack_store(out_ptr, W_X, c, x0, x1, x2, x3, x4, x5, x6, x7, amax, c >= 0)
    tl.store(out_ptr + 5 * W_X + g, (amax * (1.0 / 32767.0)).to(tl.int32, bitcast=True))


def _check(x: torch.Tensor, group: int) -> int:
    if x.dim() == 2 and x.shape[0] == 1:
        x = x[0]
    k = x.shape[-1] if x.dim() >= 1 else 0
    if x.dim() != 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.stride(-1) != 1:
        raise GraphDSLError(f"pack_int4_activations: x must be one row [K] or [1, K] of float16/bfloat16/float32 "
                            f"with a unit stride, got {x.dtype} {list(x.shape)} strides {x.stride()}")
    if group % 8 or group & (group - 1) or k % group:
        raise GraphDSLError(f"pack_int4_activations: group must be a power of two >= 8 dividing K = {k}, got {group}")
    return k


def pack_int4_activations(x: torch.Tensor, group: int, out: torch.Tensor | None = None, *,
                          perm: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (one row ``[K]`` or ``[1, K]``) as the int4 GEMV's activation bytes (module docstring)
    for int4 groups of ``group`` inputs: int32 ``[6, K / 8]``, into ``out`` when given. ``perm``
    (act-order, contiguous int32 ``[K]``): the bytes of ``x[perm]``, gathered as they are read."""
    k = _check(x, group)
    x = x.reshape(k)
    if perm is not None and (tuple(perm.shape) != (k,) or perm.dtype != torch.int32 or not perm.is_contiguous()
                             or perm.device != x.device):
        raise GraphDSLError(f"pack_int4_activations: perm must be a contiguous int32 [{k}] on {x.device}, got "
                            f"{perm.dtype} {list(perm.shape)} on {perm.device}")
    if out is None:
        out = torch.empty(6, k // 8, dtype=torch.int32, device=x.device)
    if tuple(out.shape) != (6, k // 8) or out.dtype != torch.int32 or not out.is_contiguous():
        raise GraphDSLError(f"pack_int4_activations: out must be a contiguous int32 [6, {k // 8}], got "
                            f"{out.dtype} {list(out.shape)}")
    if x.device.type != "cuda" and not triton_interprets():
        return out.copy_(pack_int4_activations_reference(x if perm is None else x[perm.long()], group))
    _pack_kernel[(k // group,)](x, perm if perm is not None else x, out, k // 8, GROUP=group, PERM=perm is not None,
                                **pdl_launch(x.device), num_warps=1)
    return out


def pack_int4_activations_reference(x: torch.Tensor, group: int, *, fused: bool = False) -> torch.Tensor:
    """:func:`pack_int4_activations` in torch, float32 math as the kernel's. ``fused``: round
    ``x · inv + 1.5 · 2^23`` once, as the compiled kernel's fused multiply-add does (the CPU
    interpreter rounds the product first)."""
    k = _check(x, group)
    xf = x.reshape(k // group, group).to(torch.float32)
    amax = xf.abs().amax(dim=1)
    amax = torch.where(xf.isnan().any(dim=1) | xf.isinf().any(dim=1), torch.full_like(amax, float("nan")), amax)
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))
    if fused:
        t = (xf.double() * inv.double()[:, None] + 12582912.0).float()
    else:
        t = xf * inv[:, None] + 12582912.0
    y = t.view(torch.int32) - 0x4B400000                 # round half to even, as gemv_loops._fixed16_bits
    q = y.reshape(k // 8, 8).to(torch.int64)

    def bytes4(b0, b1, b2, b3):
        v = (b0 & 255) | ((b1 & 255) << 8) | ((b2 & 255) << 16) | ((b3 & 255) << 24)
        return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)
    out = torch.zeros(6, k // 8, dtype=torch.int32, device=x.device)
    out[0] = bytes4(q[:, 0] >> 8, q[:, 2] >> 8, q[:, 4] >> 8, q[:, 6] >> 8)
    out[1] = bytes4(q[:, 1] >> 8, q[:, 3] >> 8, q[:, 5] >> 8, q[:, 7] >> 8)
    out[2] = bytes4(q[:, 0], q[:, 2], q[:, 4], q[:, 6])
    out[3] = bytes4(q[:, 1], q[:, 3], q[:, 5], q[:, 7])
    out[4] = q.sum(dim=1).to(torch.int32)
    out[5, :k // group] = (amax * (1.0 / 32767.0)).view(torch.int32)
    return out
