"""MoE experts kept in GGUF blocks on the tensor cores: Q4_K / Q6_K one (token, expert) pair a program row
on the int8 ones (decode); Q4_K, Q5_K, Q6_K, Q8_0 in the plane loop of the grouped kernels (prefill).

The CUDA-core decode path of :mod:`.moe_gguf` runs :func:`.gguf_tiles.row_dot` on the CUDA cores, bound by its
instructions (about six a weight) rather than by the blocks' bytes; this is the dense one-row
tensor-core GEMVs' loop (:func:`.gguf_mma.q4k_sums`, :func:`.gguf_mma_q6k.q6k_sums`: two or three
bit operations per four weights, the arithmetic in ``mma.sync``) offset to each pair's expert:

    h[p]   = act(gate_e · x[t], up_e · x[t])                        (t = p // k, e = p's expert)
    out[t] = Σ_j routing[t, e_j] · down_e · h[t·k + j]

* **Token planes** (:func:`_token_planes_kernel`, one launch): each token's A operand in the gate/up
  stack's format (:mod:`.gguf_mma`'s ``[16, H]`` int8 with ``a_s``, ``S_s`` for Q4_K; :mod:`.gguf_mma_q6k`'s
  with ``a_s`` per 16 inputs for Q6_K): 16-bit fixed point per sub-block, error at most 2^-16 of
  the sub-block's largest input.
* **gate/up** (:func:`_gate_up_kernel`): pair ``p``'s expert from its routing row (``moe_gemv._choice``),
  64 weight rows a program, gate row ``c`` and up row ``I + c`` side by side; the epilogue applies
  the activation to its 32 outputs, rounds them to the activations' dtype (as the CUDA-core path
  stores ``h``) and writes them straight into pair ``p``'s A operand for down, in down's format —
  32 outputs are one Q4_K sub-block or two Q6_K ones, so ``h`` itself is never stored.
* **down** (:func:`_down_kernel`): 64 rows of pair ``p``'s expert over a slice of the K super-blocks,
  times the pair's routing weight, into ``y [S, P, H]`` float32; :func:`.moe_gemv.finish` sums the
  slices and the ``k`` choices of each token.

**Grouped by expert** (prefill; :func:`rows_dot`, the K loop of :mod:`.moe_gguf`'s grouped kernels
with ``PLANES``): the pairs in blocks of ``BLOCK_M`` of one expert (``moe.moe_align``), as for the
other types, but a K step is one 32-value plane of the blocks, not a whole super-block decoded to
a float32 tile (whose ``[BLOCK_N, 256]`` tiles spilled): the plane's ``[BLOCK_N, 32]`` codes and
its scales (Q4_K / Q5_K: ``w = d·sc·q − dmin·m``; Q6_K: ``w = d·sc·(q − 32)``, two 16-value
sub-blocks a plane; Q8_0: ``w = d·q``, a block a plane) become weights in the activations' dtype in
registers, and one ``tl.dot`` takes them with the activations of the plane's 32 inputs — contiguous
in ``x`` (a K-type's low nibbles of a 32-byte chunk are one sub-block, the high ones the next), so
no gather by K offset. Taken for :data:`PLANE_QTYPES` (:func:`planes_eligible`).

The one-pair path is taken by :func:`.moe_gguf.gguf_experts` when :func:`eligible` (both stacks
Q4_K or Q6_K, ``H`` and ``I`` multiples of 256, fp16/bf16 activations).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import triton_interprets
from .gguf_mma import _column_inputs, _q6k_columns_planes, _sub_block_planes, _write_planes, q4k_sums, split_for
from .gguf_mma_q6k import q6k_sums, write_q6k_planes
from .gguf_tiles import KERNEL_QTYPES, PLANE_QTYPES, k_planes, q6k_plane_of, q8_0_plane
from .moe_gemv import _act, _choice, finish
from .paged_attention import _mm, _sm_count

__all__ = ["MMA_QTYPES", "PLANE_QTYPES", "eligible", "planes_eligible", "mma_experts", "rows_dot", "grouped_config"]

MMA_QTYPES = ("Q4_K", "Q6_K")
_SCALES = {"Q4_K": 32, "Q6_K": 16}      # inputs an activation scale a_s
_BLOCK_N = 64                           # weight rows a program: 32 gate/up outputs, one Q4_K sub-block of h
_STAGES = {"Q4_K": 3, "Q6_K": 2}        # the dense GEMVs' pipeline depths (pick_mma_config, pick_q6k_config)


@triton.jit
def _token_planes_kernel(x_ptr, sx, a_ptr, xa_ptr, xs_ptr, K, QTYPE: tl.constexpr):
    """Super-block ``program_id(0)`` of token ``program_id(1)``'s A operand in ``QTYPE``'s format."""
    b, t = tl.program_id(0), tl.program_id(1).to(tl.int64)
    a_row = a_ptr + t * 16 * K
    if QTYPE == "Q4_K":
        x = tl.load(x_ptr + t * sx + _column_inputs(b)).to(tl.float32)
        _write_planes(x, b, a_row, xa_ptr + t * (K // 32), xs_ptr + t * (K // 32), K)
    else:
        x = tl.load(x_ptr + t * sx + b * 256 + tl.arange(0, 256)).to(tl.float32)
        write_q6k_planes(x, b, a_row, xa_ptr + t * (K // 16), K)


@triton.jit
def _row_sums(rows, b_lo, b_hi, a_ptr, xa_ptr, xs_ptr, K, BLOCK_N: tl.constexpr, QTYPE: tl.constexpr,
              EMULATE: tl.constexpr):
    """``[BLOCK_N]`` sums of the ``QTYPE`` rows over super-blocks ``[b_lo, b_hi)`` against one A operand."""
    if QTYPE == "Q4_K":
        s = q4k_sums(rows, 144, b_lo, b_hi, a_ptr, xa_ptr, xs_ptr, K, BLOCK_N, EMULATE, True, True)
    else:
        s = q6k_sums(rows, 224, b_lo, b_hi, a_ptr, xa_ptr, K, BLOCK_N, EMULATE, True, True)
    return s


@triton.jit
def _gate_up_kernel(
    a_ptr, xa_ptr, xs_ptr,     # token planes [T, 16, H] int8, a_s [T, H / SC_UP], S_s [T, H / 32] (Q4_K)
    w_ptr, swe, row_bytes,     # gate_up blocks [E, 2I, row_bytes] uint8
    pa_ptr, pxa_ptr, pxs_ptr,  # out: each pair's A operand of h in DOWN's format [P, 16, I], a_s, S_s
    r_ptr, sr, E,              # routing [T, E] (inner stride 1), row stride, experts (moe_gemv._choice)
    H, I, TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, QTYPE: tl.constexpr,
    DOWN: tl.constexpr, SC_UP: tl.constexpr, SC_DOWN: tl.constexpr, GEGLU: tl.constexpr, EMULATE: tl.constexpr,
    DT: tl.constexpr,
):
    """Outputs ``[pid_n · BLOCK_N / 2, (pid_n + 1) · BLOCK_N / 2)`` of ``h[p]`` (module docstring),
    written only as down's A operand."""
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e, _ = _choice(r_ptr, sr, p, E, TOP_K, E_PAD)
    t = (p // TOP_K).to(tl.int64)
    rt = tl.arange(0, BLOCK_N)
    rows = w_ptr + e * swe + (pid_n * (BLOCK_N // 2) + rt // 2 + (rt % 2) * I).to(tl.int64) * row_bytes
    sums = _row_sums(rows, 0, H // 256, a_ptr + t * 16 * H, xa_ptr + t * (H // SC_UP), xs_ptr + t * (H // 32), H,
                     BLOCK_N, QTYPE, EMULATE)
    g, u = tl.split(tl.reshape(sums, [BLOCK_N // 2, 2]))
    y = _act(g, u, GEGLU).to(DT).to(tl.float32)                        # h as the CUDA-core path stores it
    pp = p.to(tl.int64)
    if DOWN == "Q4_K":
        _sub_block_planes(y, pid_n, pa_ptr + pp * 16 * I, pxa_ptr + pp * (I // SC_DOWN), pxs_ptr + pp * (I // 32), I)
    else:
        _q6k_columns_planes(y, pid_n, pa_ptr + pp * 16 * I, pxa_ptr + pp * (I // SC_DOWN), I)


@triton.jit
def _down_kernel(
    a_ptr, xa_ptr, xs_ptr,     # each pair's A operand of h [P, 16, I], a_s [P, I / SC], S_s [P, I / 32] (Q4_K)
    w_ptr, swe, row_bytes,     # down blocks [E, H, row_bytes] uint8
    y_ptr,                     # out: each K slice's weighted partial per pair [S, P, H], float32
    r_ptr, sr, E,
    P, H, I, PER,              # PER: super-blocks a K slice
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, QTYPE: tl.constexpr, SC: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """``y[s, p, n] = weight(p) · Σ_{k in slice s} h[p, k] · down_e[n, k]`` for ``BLOCK_N`` rows ``n``."""
    p, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e, wt = _choice(r_ptr, sr, p, E, TOP_K, E_PAD)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + e * swe + tl.minimum(n, H - 1).to(tl.int64) * row_bytes    # rows past H: never stored
    pp = p.to(tl.int64)
    b_lo = pid_s * PER
    sums = _row_sums(rows, b_lo, tl.minimum(b_lo + PER, I // 256), a_ptr + pp * 16 * I, xa_ptr + pp * (I // SC),
                     xs_ptr + pp * (I // 32), I, BLOCK_N, QTYPE, EMULATE)
    tl.store(y_ptr + (pid_s * P + pp) * H + n, sums * wt, mask=n < H)


def _stacks_of(qtypes, up, down, hidden: int, inter: int, dtype: torch.dtype) -> bool:
    """Both stacks (``moe._Stack``) in ``qtypes``, their rows whole stored blocks of ``hidden`` /
    ``inter`` inputs, fp16/bf16 activations."""
    def whole(stack, k: int) -> bool:
        values, nbytes = KERNEL_QTYPES[stack.qtype]
        return k % values == 0 and stack.codes.stride(1) == k // values * nbytes
    return (up.qtype in qtypes and down.qtype in qtypes and dtype in (torch.float16, torch.bfloat16)
            and whole(up, hidden) and whole(down, inter))


def eligible(up, down, hidden: int, inter: int, dtype: torch.dtype) -> bool:
    """Whether :func:`mma_experts` takes these stacks: both in :data:`MMA_QTYPES` (:func:`_stacks_of`)."""
    return _stacks_of(MMA_QTYPES, up, down, hidden, inter, dtype)


def planes_eligible(up, down, hidden: int, inter: int, dtype: torch.dtype) -> bool:
    """Whether :mod:`.moe_gguf`'s grouped kernels take these stacks a plane a step (:func:`rows_dot`):
    both in :data:`PLANE_QTYPES` (:func:`_stacks_of`)."""
    return _stacks_of(PLANE_QTYPES, up, down, hidden, inter, dtype)


def _planes(rows: int, k: int, qtype: str, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised A operands of ``rows`` rows of ``k`` inputs in ``qtype``'s format (``S_s`` unused for Q6_K)."""
    return (torch.empty(rows, 16, k, dtype=torch.int8, device=device),
            torch.empty(rows, k // _SCALES[qtype], dtype=torch.float32, device=device),
            torch.empty(rows, k // 32 if qtype == "Q4_K" else 1, dtype=torch.float32, device=device))


def mma_experts(x: torch.Tensor, routing: torch.Tensor, up, down, inter: int, top_k: int, geglu: bool,
                out: torch.Tensor) -> torch.Tensor:
    """``out [T, H]`` over the GGUF stacks ``up [E, 2I, ...]`` and ``down [E, H, ...]`` (``moe._Stack``,
    :func:`eligible`), one pair a program row (module docstring). Four launches: token planes,
    gate/up, down, the sum of slices and choices."""
    t, hidden = x.shape
    e = routing.shape[1]
    pairs = t * top_k
    emulate = triton_interprets()
    route = dict(r_ptr=routing, sr=routing.stride(0), E=e, TOP_K=top_k, E_PAD=triton.next_power_of_2(e))
    xp = _planes(t, hidden, up.qtype, x.device)
    _token_planes_kernel[(hidden // 256, t)](x, x.stride(0), *xp, hidden, QTYPE=up.qtype)
    hp = _planes(pairs, inter, down.qtype, x.device)
    _gate_up_kernel[(pairs, 2 * inter // _BLOCK_N)](
        *xp, up.codes, up.codes.stride(0), up.codes.stride(1), *hp, H=hidden, I=inter, BLOCK_N=_BLOCK_N,
        QTYPE=up.qtype, DOWN=down.qtype, SC_UP=_SCALES[up.qtype], SC_DOWN=_SCALES[down.qtype], GEGLU=geglu,
        EMULATE=emulate, DT=tl.float16 if x.dtype == torch.float16 else tl.bfloat16, **route,
        num_warps=4, num_stages=1 if emulate else _STAGES[up.qtype])
    tiles = triton.cdiv(hidden, _BLOCK_N)
    blocks = inter // 256
    per = triton.cdiv(blocks, split_for(pairs * tiles, blocks, _sm_count(x.device)))
    split = triton.cdiv(blocks, per)                     # no empty slices
    y = torch.empty((split, pairs, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(pairs, tiles, split)](
        *hp, down.codes, down.codes.stride(0), down.codes.stride(1), y, P=pairs, H=hidden, I=inter, PER=per,
        BLOCK_N=_BLOCK_N, QTYPE=down.qtype, SC=_SCALES[down.qtype], EMULATE=emulate, **route,
        num_warps=4, num_stages=1 if emulate else _STAGES[down.qtype])
    return finish(y, out, top_k)


# ----------------------------------------------------------------------------------------------- grouped
@triton.jit
def _plane_dot(acc, a_rows, a_ok, w, k0, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc + A[:, k0:k0 + 32] @ wᵀ``: the activations (``[BLOCK_M]`` row pointers) of 32 inputs against
    a ``[BLOCK_N, 32]`` weight plane rounded to their dtype."""
    a = tl.load(a_rows[:, None] + (k0 + tl.arange(0, 32))[None, :], mask=a_ok[:, None], other=0.0)
    return acc + _mm(a, tl.trans(w.to(a.dtype)), DOT_PREC, DOT_F32)


@triton.jit
def rows_dot(acc, a_rows, a_ok, rows, K, QTYPE: tl.constexpr, BS: tl.constexpr, DOT_PREC: tl.constexpr,
             DOT_F32: tl.constexpr, FAST: tl.constexpr = False):
    """``acc + A @ dequant(W)ᵀ`` over all ``K`` inputs of the ``QTYPE`` (:data:`PLANE_QTYPES`, stored
    rows, ``BS`` bytes a block) rows ``rows``, a plane a step (module docstring): the K loop of
    :mod:`.moe_gguf`'s grouped kernels with ``PLANES``. ``FAST`` (a GPU, fp16/bf16 activations): Q4_K
    and Q6_K planes decoded in the activations' dtype by packed PTX (:func:`.gguf_tiles.q4k_planes_dt`,
    :func:`.gguf_tiles.q6k_plane_dt`), as the dense GEMV of several rows does."""
    dt = a_rows.dtype.element_ty
    if QTYPE == "Q4_K" or QTYPE == "Q5_K":
        for kc in range(0, K // 64):
            w0, w1 = k_planes(rows, kc, BS, QTYPE == "Q5_K", FAST, dt)
            acc = _plane_dot(acc, a_rows, a_ok, w0, 64 * kc, DOT_PREC, DOT_F32)
            acc = _plane_dot(acc, a_rows, a_ok, w1, 64 * kc + 32, DOT_PREC, DOT_F32)
    elif QTYPE == "Q6_K":
        for sb in range(0, K // 256):
            for p in tl.static_range(8):
                acc = _plane_dot(acc, a_rows, a_ok, q6k_plane_of(rows, sb, p, BS, FAST, dt), 256 * sb + 32 * p,
                                 DOT_PREC, DOT_F32)
    else:
        tl.static_assert(QTYPE == "Q8_0", "rows_dot: Q4_K, Q5_K, Q6_K or Q8_0")
        for kp in range(0, K // 32):
            acc = _plane_dot(acc, a_rows, a_ok, q8_0_plane(rows, kp, BS), 32 * kp, DOT_PREC, DOT_F32)
    return acc


def grouped_config(pairs: int):
    """The grouped kernels' launch, a ``moe.MoeConfig`` (per kernel ``(BLOCK_N, 32, num_warps,
    num_stages)``: a K step is one 32-value plane): 64 pairs a block and 64-row tiles of 4 warps, 2
    stages (compiled for sm_90 without spills: 128 registers for gate/up, 80 for down; Mixtral's
    experts at 64 tokens 1620 µs on an H200); beyond 512 pairs 128 pairs a block, gate/up in
    128-row tiles and 3 stages (the H200 sweep of ``benchmarks/moe.py --sweep`` at Mixtral's size,
    512 tokens: 3756 µs in the 64-pair launch, 3129 in this one); 16 pairs a block for a few."""
    from .moe import MoeConfig
    if pairs > 512:
        return MoeConfig(128, (128, 32, 4, 3), (64, 32, 4, 3))
    return MoeConfig(16 if pairs <= 64 else 64, (64, 32, 4, 2), (64, 32, 4, 2))
