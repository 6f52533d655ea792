"""MoE experts kept in GGUF blocks, one (token, expert) pair a program row on the int8 tensor cores through
the dense rows kernel's K loop (:func:`.gguf_mma_rows.rows_sums`): the decode path for the stacks that
:mod:`.moe_gguf_mma` has no one-pair kernel for (a Q5_K or Q8_0 stack, alone or beside Q4_K / Q6_K).

The math is :mod:`.moe_gguf`'s:

    h[p]   = act(gate_e · x[t], up_e · x[t])                        (t = p // k, e = p's expert)
    out[t] = Σ_j routing[t, e_j] · down_e · h[t·k + j]

* **Operands** (:func:`.gguf_mma_rows.rows_planes`): the rows kernel's activation operands of all ``T``
  tokens at once (one group of 8 rows, 16-bit fixed point a super-block), so no launch of its own per
  pair.
* **gate/up** (:func:`_gate_up_kernel`): pair ``p``'s expert from its routing row (``moe_gemv._choice``),
  ``BLOCK_N`` weight rows a program, gate row ``c`` and up row ``I + c`` side by side; the K loop gives
  ``[BLOCK_N, 8]`` sums against every token's operand and the program keeps token ``t``'s column (the
  ``mma`` tile has 8 columns, so up to 8 tokens cost what one does). The epilogue applies the
  activation and stores ``h[p]`` in the activations' dtype, as the CUDA-core path does.
* **down** (:func:`_down_kernel`): the operands of ``h``'s ``P`` rows (:func:`~.gguf_mma_rows.rows_planes`
  again), then ``BLOCK_N`` rows of pair ``p``'s expert over a slice of the K super-blocks, pair ``p``'s
  column times its routing weight, into ``y [S, P, H]`` float32; :func:`.moe_gemv.finish` sums the
  slices and the ``k`` choices of each token.

Five launches. Taken by :func:`.moe_gguf.gguf_experts` when :func:`eligible`: both stacks Q4_K, Q5_K,
Q6_K or Q8_0 (not both Q4_K / Q6_K: :mod:`.moe_gguf_mma` takes those), ``H`` and ``I`` multiples of 256,
fp16/bf16 activations, at most ``MAX_PAIRS`` (8) pairs. H200, Mixtral-8x7B's experts (``benchmarks/moe.py``),
µs against the CUDA-core one-pair loop: Q5_K gate/up and Q6_K down, 1 token 143.3 vs 223.6, 4 tokens 471.6 vs
821.2; Q8_0, 226.9 vs 253.4 and 847.9 vs 934.9. With 32 pairs in operands of 32 rows (the dots four times
as many, built that way first) 16 tokens took 4690 µs against 3119 on the CUDA cores, so the path stops at
one group of 8.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import triton_interprets
from .gguf_mma_rows import rows_planes, rows_sums, split_for_rows
from .gguf_tiles import KERNEL_QTYPES
from .moe_gemv import _act, _choice, finish
from .paged_attention import _sm_count

__all__ = ["ROWS_QTYPES", "MAX_PAIRS", "eligible", "rows_experts"]

ROWS_QTYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
MAX_PAIRS = 8          # (token, expert) pairs a call: the operands' one group of 8 rows (module docstring)
_R = 8                 # the operands' rows
_BLOCK_N = 32          # weight rows a program: the dense rows kernel's tile for up to 8 rows (_TILES[8])
_WARPS = 2
_STAGES = 2
_PROGRAMS_PER_SM = 12  # down's K is split until its grid gives every SM this many programs (_TILES[8])


@triton.jit
def _column(sums, j, R: tl.constexpr):
    """Column ``j`` of ``sums [BLOCK_N, R]``."""
    return tl.sum(tl.where(tl.arange(0, R)[None, :] == j, sums, 0.0), axis=1)


@triton.jit
def _gate_up_kernel(
    a_ptr, xa_ptr, xs_ptr,     # the tokens' operands [H / 32, 2 R, 32] int8, a_m and S_ms [H / 32, R] (R = 8)
    w_ptr, swe, row_bytes,     # gate_up blocks [E, 2I, row_bytes] uint8: expert stride, bytes a row
    h_ptr,                     # out: act(gate)·up per pair [P, I], contiguous
    r_ptr, sr, E,              # routing [T, E] (inner stride 1), row stride, experts (moe_gemv._choice)
    H, I, TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, QTYPE: tl.constexpr,
    BS: tl.constexpr, R: tl.constexpr, GEGLU: tl.constexpr, EMULATE: tl.constexpr,
):
    """``h[p, c] = act(gate_e[c] · x[t], up_e[c] · x[t])`` for ``BLOCK_N / 2`` columns ``c``: the tile's
    rows are gate row ``c`` and up row ``I + c`` in turn."""
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e, _ = _choice(r_ptr, sr, p, E, TOP_K, E_PAD)
    rt = tl.arange(0, BLOCK_N)
    rows = w_ptr + e * swe + (pid_n * (BLOCK_N // 2) + rt // 2 + (rt % 2) * I).to(tl.int64) * row_bytes
    sums = rows_sums(rows, BS, 0, H // 256, a_ptr, xa_ptr, xs_ptr, BLOCK_N, EMULATE, R, QTYPE)
    g, u = tl.split(tl.reshape(_column(sums, p // TOP_K, R), [BLOCK_N // 2, 2]))
    cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(h_ptr + p.to(tl.int64) * I + cols, _act(g, u, GEGLU).to(h_ptr.dtype.element_ty))


@triton.jit
def _down_kernel(
    a_ptr, xa_ptr, xs_ptr,     # the pairs' operands of h [I / 32, 2 R, 32] int8, a_m and S_ms [I / 32, R]
    w_ptr, swe, row_bytes,     # down blocks [E, H, row_bytes] uint8
    y_ptr,                     # out: each K slice's weighted partial per pair [S, P, H], float32
    r_ptr, sr, E,
    P, H, I, PER,              # PER: super-blocks a K slice
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, QTYPE: tl.constexpr, BS: tl.constexpr,
    R: tl.constexpr, EMULATE: tl.constexpr,
):
    """``y[s, p, n] = weight(p) · Σ_{k in slice s} h[p, k] · down_e[n, k]`` for ``BLOCK_N`` rows ``n``."""
    p, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e, wt = _choice(r_ptr, sr, p, E, TOP_K, E_PAD)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + e * swe + tl.minimum(n, H - 1).to(tl.int64) * row_bytes    # rows past H: never stored
    b_lo = pid_s * PER
    sums = rows_sums(rows, BS, b_lo, tl.minimum(b_lo + PER, I // 256), a_ptr, xa_ptr, xs_ptr, BLOCK_N, EMULATE, R,
                     QTYPE)
    tl.store(y_ptr + (pid_s * P + p.to(tl.int64)) * H + n, _column(sums, p, R) * wt, mask=n < H)


def eligible(up, down, hidden: int, inter: int, dtype: torch.dtype, tokens: int, top_k: int) -> bool:
    """Whether :func:`rows_experts` takes these stacks (``moe._Stack``) for ``tokens`` tokens: both in
    :data:`ROWS_QTYPES`, their rows whole stored blocks of ``hidden`` / ``inter`` inputs (multiples of
    256), fp16/bf16 activations, at most :data:`MAX_PAIRS` pairs."""
    def whole(stack, k: int) -> bool:
        values, nbytes = KERNEL_QTYPES[stack.qtype]
        return k % 256 == 0 and stack.codes.stride(1) == k // values * nbytes
    return (up.qtype in ROWS_QTYPES and down.qtype in ROWS_QTYPES and dtype in (torch.float16, torch.bfloat16)
            and tokens * top_k <= MAX_PAIRS and whole(up, hidden) and whole(down, inter))


def rows_experts(x: torch.Tensor, routing: torch.Tensor, up, down, inter: int, top_k: int, geglu: bool,
                 out: torch.Tensor) -> torch.Tensor:
    """``out [T, H]`` over the GGUF stacks ``up [E, 2I, ...]`` and ``down [E, H, ...]`` (``moe._Stack``,
    :func:`eligible`), one pair a program row (module docstring)."""
    t, hidden = x.shape
    e = routing.shape[1]
    pairs = t * top_k
    emulate = triton_interprets()
    route = dict(r_ptr=routing, sr=routing.stride(0), E=e, TOP_K=top_k, E_PAD=triton.next_power_of_2(e))
    launch = dict(EMULATE=emulate, num_warps=_WARPS, num_stages=1 if emulate else _STAGES)

    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(pairs, 2 * inter // _BLOCK_N)](
        *rows_planes(x), up.codes, up.codes.stride(0), up.codes.stride(1), h, H=hidden, I=inter, BLOCK_N=_BLOCK_N,
        QTYPE=up.qtype, BS=KERNEL_QTYPES[up.qtype][1], R=_R, GEGLU=geglu, **route, **launch)
    tiles = triton.cdiv(hidden, _BLOCK_N)
    blocks = inter // 256
    per = triton.cdiv(blocks, split_for_rows(pairs * tiles, blocks, _sm_count(x.device), _PROGRAMS_PER_SM))
    split = triton.cdiv(blocks, per)                     # no empty slices
    y = torch.empty((split, pairs, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(pairs, tiles, split)](
        *rows_planes(h), down.codes, down.codes.stride(0), down.codes.stride(1), y, P=pairs, H=hidden, I=inter,
        PER=per, BLOCK_N=_BLOCK_N, QTYPE=down.qtype, BS=KERNEL_QTYPES[down.qtype][1], R=_R, **route,
        **launch)
    return finish(y, out, top_k)
