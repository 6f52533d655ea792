"""Quantized MoE experts at decode sizes: one (token, expert) pair a program row, no tensor cores.

:func:`graphdsl.runtime.kernels.moe.quant_moe_experts` sends few pairs here (``P = T·k`` up to
:data:`MAX_PAIRS` for a kind of codes). Each program reads expert ``e = ids[p]``'s codes for
``BLOCK_N`` output rows once, as a decode GEMV does, and multiplies them by pair ``p``'s input row
with float32 FMAs and a sum along K:

* gate/up (:func:`_gate_up_kernel`): ``h[p, n] = act(Σ_k x[t, k] · gate_e[n, k], Σ_k x[t, k] · up_e[n, k])``
  for token ``t = p // k``;
* down (:func:`_down_kernel`): ``y[p, n] = weight(p) · Σ_k h[p, k] · down_e[n, k]`` in float32.

The codes are read as the grouped kernels read them (``moe`` module docstring): per-channel codes
summed, then times ``s[n]``; int4 bytes whose low and high nibbles, less the zero point, multiply
the even and odd inputs, each K step one group, its sum times the group's scale. Pairs that share
an expert read its codes once each (few pairs share one at decode; the grouped kernels, which read
a shared expert once, take more pairs). No align step: ``ids`` comes straight from the top-k.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import _sm_count

__all__ = ["gemv_experts", "MAX_PAIRS"]

# the most pairs each kind of codes (the kernels' QUANT: 1 per channel, 2 int4) takes here by default.
# H200, Mixtral-8x7B's experts (benchmarks/moe.py), µs here against the grouped kernels: int4-g128 at
# 1 token (2 pairs) 198.5 vs 363.8, at 8 tokens (16 pairs) 865.5 vs 977.7; fp8 per channel 181.5 vs
# 149.6 and 730.8 vs 423.3, so per-channel codes stay grouped (``gemv=True`` still runs them here).
# Between 16 and 128 int4 pairs nothing was measured: 32 keeps the shared experts' repeated reads few.
MAX_PAIRS = {1: 0, 2: 32}


@triton.jit
def _act(g, u, GEGLU: tl.constexpr):
    """``silu(g) · u`` or ``gelu_tanh(g) · u`` (float32)."""
    if GEGLU:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (2.0 * tl.sigmoid(2.0 * z)) * u     # 1 + tanh(z) = 2 sigmoid(2z)
    return g * tl.sigmoid(g) * u


@triton.jit
def _row_step(row_ptr, k0, K, BLOCK_K: tl.constexpr, QUANT: tl.constexpr):
    """One K step of an input row in float32, ``(xa, xb)``: ``x[k0:k0 + BLOCK_K]`` twice, or for int4
    codes (``QUANT == 2``) the step's even and odd inputs (``BLOCK_K / 2`` each)."""
    if QUANT == 2:
        kk = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        xa = tl.load(row_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        xb = tl.load(row_ptr + kk + 1, mask=kk < K, other=0.0).to(tl.float32)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        xa = tl.load(row_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        xb = xa
    return xa, xb


@triton.jit
def _codes_step(acc, xa, xb, w_e, s_e, z_e, n, n_ok, swn, ssn, k0, K, BLOCK_K: tl.constexpr,
                QUANT: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr):
    """``acc[n] + Σ_k x[k] · W[n, k]`` over one K step of rows ``n`` (per-channel codes: unscaled;
    int4: the step's group scale applied)."""
    rows = n[:, None].to(tl.int64) * swn
    if QUANT == 2:         # (one return at the end: Triton compiles what follows a return in a static if)
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(w_e + rows + j[None, :], mask=n_ok[:, None] & (j < K // 2)[None, :], other=0).to(tl.int32)
        g = k0 // GROUP
        if ZP:
            z = tl.load(z_e + n.to(tl.int64) * ssn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            lo = (byte & 15).to(tl.float32) - z
            hi = (byte >> 4).to(tl.float32) - z
        else:
            lo = ((byte & 15) - 8).to(tl.float32)
            hi = ((byte >> 4) - 8).to(tl.float32)
        s = tl.load(s_e + n.to(tl.int64) * ssn + g, mask=n_ok, other=0.0).to(tl.float32)
        acc = acc + tl.sum(lo * xa[None, :] + hi * xb[None, :], axis=1) * s
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_e + rows + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
        acc = acc + tl.sum(w * xa[None, :], axis=1)
    return acc


@triton.jit
def _channel_scale(acc, s_e, n, n_ok, ssn, QUANT: tl.constexpr):
    """``acc · s[n]`` for per-channel codes (``QUANT == 1``; ``acc [..., BLOCK_N]``, one pair's row
    or a block's rows); ``acc`` otherwise."""
    if QUANT == 1:
        acc = acc * tl.load(s_e + n.to(tl.int64) * ssn, mask=n_ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, sx,                 # tokens [T, H] (inner stride 1), row stride
    w_ptr, swe, swn,           # gate_up codes [E, 2I, ...]: expert and row strides
    s_ptr, z_ptr, sse, ssn,    # scales and zero points [E, 2I, G]: expert and row strides
    h_ptr,                     # out: act(gate)·up per pair [P, I], contiguous
    ids_ptr,                   # expert of each pair [P]
    H, I, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GEGLU: tl.constexpr,
    QUANT: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr,
):
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    w_e, s_e, z_e = w_ptr + e * swe, s_ptr + e * sse, z_ptr + e * sse
    x_row = x_ptr + (p // TOP_K).to(tl.int64) * sx
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        xa, xb = _row_step(x_row, k0, H, BLOCK_K, QUANT)
        acc_g = _codes_step(acc_g, xa, xb, w_e, s_e, z_e, n, n_ok, swn, ssn, k0, H, BLOCK_K, QUANT, GROUP, ZP)
        acc_u = _codes_step(acc_u, xa, xb, w_e, s_e, z_e, n + I, n_ok, swn, ssn, k0, H, BLOCK_K, QUANT, GROUP, ZP)
    h = _act(_channel_scale(acc_g, s_e, n, n_ok, ssn, QUANT), _channel_scale(acc_u, s_e, n + I, n_ok, ssn, QUANT),
             GEGLU)
    tl.store(h_ptr + p.to(tl.int64) * I + n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_kernel(
    h_ptr,                     # act(gate)·up per pair [P, I], contiguous
    w_ptr, swe, swn,           # down codes [E, H, ...]: expert and row strides
    s_ptr, z_ptr, sse, ssn,    # scales and zero points [E, H, G]
    wt_ptr,                    # routing weight per pair [P], float32
    y_ptr,                     # out: weighted expert outputs per pair [P, H], float32
    ids_ptr,
    H, I, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
    ZP: tl.constexpr,
):
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    w_e, s_e, z_e = w_ptr + e * swe, s_ptr + e * sse, z_ptr + e * sse
    h_row = h_ptr + p.to(tl.int64) * I
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        xa, xb = _row_step(h_row, k0, I, BLOCK_K, QUANT)
        acc = _codes_step(acc, xa, xb, w_e, s_e, z_e, n, n_ok, swn, ssn, k0, I, BLOCK_K, QUANT, GROUP, ZP)
    acc = _channel_scale(acc, s_e, n, n_ok, ssn, QUANT) * tl.load(wt_ptr + p)
    tl.store(y_ptr + p.to(tl.int64) * H + n, acc, mask=n_ok)


def _block_n(pairs: int, rows: int, device: torch.device) -> int:
    """The widest of 128, 64, 32 and 16 rows a program that still gives every SM four programs
    (latency is hidden by programs in flight: the loop has no pipeline stages), else 16."""
    for bn in (128, 64, 32):
        if pairs * triton.cdiv(rows, bn) >= 4 * _sm_count(device):
            return bn
    return 16


def gemv_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, up, down, inter: int, top_k: int,
                 geglu: bool, interp: bool) -> torch.Tensor:
    """``y [P, H]`` float32: each pair's weighted expert output (module docstring); ``ids``,
    ``weights`` ``[T, k]`` from the routing's top-k; ``up``, ``down`` the stacks as
    ``moe._Stack`` (codes, scales, zero points, kind, group)."""
    t, hidden = x.shape
    pairs = t * top_k
    flat_ids = ids.reshape(-1).contiguous()
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)

    def consts(stack, rows):
        return dict(BLOCK_N=_block_n(pairs, rows, x.device), BLOCK_K=stack.group if stack.quant == 2 else 128,
                    QUANT=stack.quant, GROUP=stack.group, ZP=stack.zero_point, num_warps=4,
                    num_stages=1 if interp else 2)

    cu = consts(up, inter)
    _gate_up_kernel[(pairs, triton.cdiv(inter, cu["BLOCK_N"]))](
        x, x.stride(0), *up.args(), h, flat_ids, hidden, inter, TOP_K=top_k, GEGLU=geglu, **cu)
    cd = consts(down, hidden)
    _down_kernel[(pairs, triton.cdiv(hidden, cd["BLOCK_N"]))](
        h, *down.args(), weights.reshape(-1).contiguous(), y, flat_ids, hidden, inter, **cd)
    return y
