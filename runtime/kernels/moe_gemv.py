"""Quantized MoE experts at decode sizes: one (token, expert) pair a program row, no tensor cores.

:func:`graphdsl.runtime.kernels.moe.quant_moe_experts` sends few pairs here (``P = T·k`` up to
:data:`MAX_PAIRS_PER_EXPERT` times the experts for a kind of codes). Each program finds its pair's
expert ``e`` and routing weight in the routing row itself (:func:`_choice`: no top-k launch, no
align step), reads expert ``e``'s codes for ``BLOCK_N`` output rows once, as a decode GEMV does,
and multiplies them by pair ``p``'s input row:

* gate/up: ``h[p, n] = act(Σ_k x[t, k] · gate_e[n, k], Σ_k x[t, k] · up_e[n, k])`` for token
  ``t = p // k``;
* down: ``y[s, p, n] = weight(p) · Σ_{k in slice s} h[p, k] · down_e[n, k]`` in float32;
* finish (:func:`_finish_kernel`): ``out[t] = Σ_s Σ_j y[s, t·k + j]`` in a fixed order, cast.

int4 stacks (groups of 64 or 128), fp8 and int8 stacks with 16-bit activations run the decode
GEMV's one-row loops (:func:`_gate_up_words_kernel`, :func:`_down_words_kernel`, each program
running :func:`_word_rows` on its pair's expert): the codes as int32 words — eight nibbles, each
group's activations in 16-bit fixed point against four ``dp4a`` a word
(:func:`.gemv_loops._int4_row`); four e4m3 codes turned into float32 bits by shifts
(:func:`.gemv_loops._fp8_row_loop`); four int8 codes made the mantissas of floats in [1, 2)
(:func:`.gemv_loops._int8_row_loop`) —, the next step's words loaded before this one's math; gate
and up rows interleaved in a tile (one stream feeds both halves of the activation), down's K split
into slices. The rest (int4 groups of 32, float32 activations) run a float loop of the
same shape (:func:`_gate_up_kernel`, :func:`_down_kernel`), the codes read as the grouped kernels
read them: per-channel codes summed, then times ``s[n]``; int4 bytes whose low and high nibbles,
less the zero point, multiply the even and odd inputs, each K step one group, its sum times the
group's scale. It converts every code to float (``I2F``, an eighth of the FMA rate on Hopper):
Mixtral's int4 experts at one token took 198.5 µs there against 95.6 in the word loop (H200).

Pairs that share an expert read its codes once each; the grouped kernels, which read a shared
expert once, take more pairs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv_loops import _fp8_row_loop, _int4_row, _int8_row_loop
from .paged_attention import _sm_count

__all__ = ["gemv_experts", "finish", "MAX_PAIRS_PER_EXPERT", "code_kind", "one_pair_by_default", "words_step"]

# the most pairs an expert, on average, each kind of codes (:func:`code_kind`) takes here by default: a pair
# reads its expert's codes alone, so a stack of E experts runs here up to E times this many pairs; more run the
# grouped kernels, which read a shared expert once. H200 (benchmarks/moe.py), µs here against the grouped kernels:
# Mixtral-8x7B (8 experts, top-2) int4-g128 at 2 pairs 91.2 vs 320.7, 16 pairs 403.2 vs 691.1, 32 pairs 760.6 vs
# 848.4, 64 pairs 1435.5 vs 1099.8; fp8 per channel at 2 pairs 111.4 vs 150.6, 4 pairs 182.1 vs 210.4, 8 pairs
# 360.1 vs 319.5; DeepSeek-V2-Lite (64 experts, top-6) int4 at 384 pairs 438.5 vs 645.0, 768 pairs 840.7 vs
# 806.1; fp8 at 6 pairs 37.3 vs 41.2, 48 pairs 132.4 vs 123.5; int8 per channel at Mixtral's 2 pairs 103.0 vs 141.5,
# 4 pairs 170.5 vs 201.1, 8 pairs 337.2 vs 313.7, DeepSeek's 6 pairs 27.1 vs 31.5, 48 pairs 153.2 vs 114.5.
MAX_PAIRS_PER_EXPERT = {"int8": 0.5, "fp8": 0.5, "int4": 4}


@triton.jit
def _act(g, u, GEGLU: tl.constexpr):
    """``silu(g) · u`` or ``gelu_tanh(g) · u`` (float32)."""
    if GEGLU:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (2.0 * tl.sigmoid(2.0 * z)) * u     # 1 + tanh(z) = 2 sigmoid(2z)
    return g * tl.sigmoid(g) * u


@triton.jit
def _block_of_pairs(rows_ptr, blk_e_ptr, P, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A grouped program's share (the grouped kernels of :mod:`.moe` and :mod:`.moe_gguf`, which take
    their shared helpers from here), ``(e, pairs, valid, n, n_ok)``: block ``program_id(0)``'s expert
    (``E`` past the last block: the program exits) and ``BLOCK_M`` pair indices (``P``: padding), and
    its ``BLOCK_N`` output columns ``program_id(1) · BLOCK_N ...`` of ``N``."""
    b = tl.program_id(0)
    pairs = tl.load(rows_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(blk_e_ptr + b), pairs, pairs < P, n, n < N


@triton.jit
def _choice(r_ptr, sr, p, E, TOP_K: tl.constexpr, E_PAD: tl.constexpr):
    """Pair ``p``'s expert and routing weight, ``(e, w)``: token ``t = p // TOP_K``'s ``(p % TOP_K)``-th
    largest routing weight and its index (the lowest index among equal weights), found by
    ``TOP_K`` rounds of max over the ``E`` weights of ``routing[t]`` — the top-k this launch needs,
    with no launch of its own. The index stays in ``[0, E)`` whatever the weights (NaN included)."""
    lanes = tl.arange(0, E_PAD)
    r = tl.load(r_ptr + (p // TOP_K).to(tl.int64) * sr + lanes, mask=lanes < E, other=float("-inf")).to(tl.float32)
    j = p % TOP_K
    e = 0
    w = 0.0
    for i in tl.static_range(TOP_K):
        m = tl.max(r, axis=0)
        idx = tl.minimum(tl.min(tl.where(r == m, lanes, E_PAD), axis=0), E - 1)
        e = tl.where(i == j, idx, e)
        w = tl.where(i == j, m, w)
        r = tl.where(lanes == idx, float("-inf"), r)
    return e.to(tl.int64), w


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
    r_ptr, sr, E,              # routing [T, E] (inner stride 1), row stride, experts (_choice)
    H, I, TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GEGLU: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr,
):
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e, _ = _choice(r_ptr, sr, p, E, TOP_K, E_PAD)
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
    y_ptr,                     # out: weighted expert outputs per pair [1, P, H], float32
    r_ptr, sr, E,              # routing [T, E]
    H, I, TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr,
):
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e, wt = _choice(r_ptr, sr, p, E, TOP_K, E_PAD)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    w_e, s_e, z_e = w_ptr + e * swe, s_ptr + e * sse, z_ptr + e * sse
    h_row = h_ptr + p.to(tl.int64) * I
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        xa, xb = _row_step(h_row, k0, I, BLOCK_K, QUANT)
        acc = _codes_step(acc, xa, xb, w_e, s_e, z_e, n, n_ok, swn, ssn, k0, I, BLOCK_K, QUANT, GROUP, ZP)
    acc = _channel_scale(acc, s_e, n, n_ok, ssn, QUANT) * wt
    tl.store(y_ptr + p.to(tl.int64) * H + n, acc, mask=n_ok)


@triton.jit
def _word_rows(x_row, w_e, s_e, z_e, rn, N, w_lo, w_hi, W_ROW, ssn, M12, M16, M0F, M8, BLOCK_N: tl.constexpr,
               CODES: tl.constexpr, STEP: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr, EMULATE: tl.constexpr,
               X_WIDE: tl.constexpr):
    """``Σ_k x[k] · W[n, k]`` over the words ``[w_lo, w_hi)`` of rows ``rn`` (float32 ``[BLOCK_N]``,
    scales applied; rows past ``N`` read row ``N - 1``, never stored): the one-row loop of the
    stack's codes (``CODES``, :data:`_WORD_CODES`), ``STEP`` inputs a step — int4
    (:func:`.gemv_loops._int4_row`, integer dots), int8 (:func:`.gemv_loops._int8_row_loop`, its
    ``2^-8`` taken off after) or fp8 (:func:`.gemv_loops._fp8_row_loop`, its ``2^-120``), then the
    row scale."""
    if CODES == 0:
        row = _int4_row(x_row, w_e, s_e, z_e, rn, N, w_lo, w_hi, W_ROW, ssn, M12, M16, M0F, BLOCK_N, ZP, GROUP,
                        STEP // GROUP, True, EMULATE, False, 0, x_row, False, X_WIDE, True)
    else:
        s = tl.load(s_e + tl.minimum(rn, N - 1).to(tl.int64) * ssn).to(tl.float32)
        if CODES == 1:
            row = _int8_row_loop(x_row, w_e, rn, N, w_lo, w_hi, W_ROW, M8, BLOCK_N, STEP // 4, X_WIDE) * (256.0 * s)
        else:
            row = _fp8_row_loop(x_row, w_e, rn, N, w_lo, w_hi, W_ROW, BLOCK_N, STEP // 4, X_WIDE) \
                * (1.329227995784916e36 * s)              # 2^120
    return row


@triton.jit
def _gate_up_words_kernel(
    x_ptr, sx,                 # tokens [T, H] 16-bit, row stride (8-byte aligned rows with X_WIDE)
    w_ptr, swe, W_ROW,         # gate_up codes as int32 words [E, 2I, H / (8 or 4)]: expert stride, words a row
    s_ptr, z_ptr, sse, ssn,    # scales and zero points [E, 2I, groups]: expert and row strides
    h_ptr,                     # out: act(gate)·up per pair [P, I], contiguous
    r_ptr, sr, E,              # routing [T, E] (inner stride 1), row stride, experts (_choice)
    I, M12, M16, M0F, M8,      # the loops' masks, passed as arguments (gemv's kernel takes the same)
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CODES: tl.constexpr, STEP: tl.constexpr,
    GROUP: tl.constexpr, ZP: tl.constexpr, GEGLU: tl.constexpr, EMULATE: tl.constexpr, X_WIDE: tl.constexpr,
):
    """``h[p, c] = act(gate_e[c] · x[t], up_e[c] · x[t])`` for ``BLOCK_N / 2`` columns ``c``: the tile's
    rows are gate row ``c`` and up row ``I + c`` in turn, one stream of words for both."""
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e, _ = _choice(r_ptr, sr, p, E, TOP_K, E_PAD)
    r = tl.arange(0, BLOCK_N)
    rn = pid_n * (BLOCK_N // 2) + r // 2 + (r % 2) * I
    row = _word_rows(x_ptr + (p // TOP_K).to(tl.int64) * sx, w_ptr + e * swe, s_ptr + e * sse, z_ptr + e * sse, rn,
                     2 * I, 0, W_ROW, W_ROW, ssn, M12, M16, M0F, M8, BLOCK_N, CODES, STEP, GROUP, ZP, EMULATE,
                     X_WIDE)
    g, u = tl.split(tl.reshape(row, [BLOCK_N // 2, 2]))
    c = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(h_ptr + p.to(tl.int64) * I + c, _act(g, u, GEGLU).to(h_ptr.dtype.element_ty), mask=c < I)


@triton.jit
def _down_words_kernel(
    h_ptr,                     # act(gate)·up per pair [P, I] 16-bit, contiguous
    w_ptr, swe, W_ROW,         # down codes as int32 words [E, H, I / (8 or 4)]
    s_ptr, z_ptr, sse, ssn,    # scales and zero points [E, H, groups]
    y_ptr,                     # out: each K slice's weighted partial per pair [S, P, H], float32
    r_ptr, sr, E,              # routing [T, E]
    P, H, I, SLICE_W, M12, M16, M0F, M8,   # SLICE_W: words of a K slice (whole steps)
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CODES: tl.constexpr, STEP: tl.constexpr,
    GROUP: tl.constexpr, ZP: tl.constexpr, EMULATE: tl.constexpr, X_WIDE: tl.constexpr,
):
    """``y[s, p, n] = weight(p) · Σ_{k in slice s} h[p, k] · down_e[n, k]``."""
    p, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e, wt = _choice(r_ptr, sr, p, E, TOP_K, E_PAD)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_lo = pid_k * SLICE_W
    row = _word_rows(h_ptr + p.to(tl.int64) * I, w_ptr + e * swe, s_ptr + e * sse, z_ptr + e * sse, rn, H, w_lo,
                     tl.minimum(w_lo + SLICE_W, W_ROW), W_ROW, ssn, M12, M16, M0F, M8, BLOCK_N, CODES, STEP, GROUP,
                     ZP, EMULATE, X_WIDE)
    tl.store(y_ptr + (pid_k * P + p).to(tl.int64) * H + rn, row * wt, mask=rn < H)


@triton.jit
def _finish_kernel(y_ptr, out_ptr, so, T, H, S: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t, n] = Σ_s Σ_j y[s, t·TOP_K + j, n]`` in a fixed order (slices outer, choices inner),
    cast to ``out``'s dtype: the sum and the cast in one launch."""
    t, pid = tl.program_id(0), tl.program_id(1)
    n = pid * BLOCK + tl.arange(0, BLOCK)
    ok = n < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(S):
        for j in tl.static_range(TOP_K):
            acc += tl.load(y_ptr + ((s * T + t) * TOP_K + j).to(tl.int64) * H + n, mask=ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * so + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


_WORDS_PER_SM = 2          # the dense one-row GEMVs' programs a SM, which down's K split fills


def code_kind(stack) -> str:
    """``"int4"``, ``"int8"`` or ``"fp8"``: the kind of codes of a quantized ``moe._Stack``."""
    if stack.quant == 2:
        return "int4"
    return "fp8" if stack.codes.dtype == torch.float8_e4m3fn else "int8"


def one_pair_by_default(up, down, pairs: int, experts: int) -> bool:
    """Whether ``pairs`` (token, expert) pairs over stacks ``up`` and ``down`` (``moe._Stack``) of
    ``experts`` experts run here by default: at most :data:`MAX_PAIRS_PER_EXPERT` (the smaller of
    the two stacks' kinds of codes) times the experts."""
    return pairs <= min(MAX_PAIRS_PER_EXPERT[code_kind(st)] for st in (up, down)) * experts


def words_step(stack, x_dtype: torch.dtype, k: int) -> int | None:
    """The K step (inputs) of the word loop for ``stack`` (a ``moe._Stack``) over ``k`` inputs of
    ``x_dtype``, or None when it cannot take them: int4 in groups of 64 or 128 (whole groups a step
    of at least 128 inputs), int8 and fp8 (256 inputs a step), the step dividing ``k``; 16-bit
    activations."""
    kind = code_kind(stack)
    step = max(stack.group, 128) if kind == "int4" else 256
    if (kind == "int4" and stack.group % 64) or k % step or x_dtype not in (torch.float16, torch.bfloat16):
        return None
    return step


# the word loops' ``CODES`` constexpr for each kind of codes
_WORD_CODES = {"int4": 0, "int8": 1, "fp8": 2}


def _words_block_n(stack, down: bool, underfilled: bool = False) -> int:
    """Rows a program of the word loop: the dense one-row GEMVs' tiles (``gemv._pick_quant_config``:
    int4 256; fp8 32 for gate/up's many rows, 64 for down's fewer, whose K is split; int8 as fp8).
    int4 gate/up takes 128 rows where 256-row tiles leave SMs without a program (``underfilled``):
    H200, DeepSeek-V2-Lite's experts at one token (6 pairs x 11 tiles on 132 SMs) 26.6 -> 23.6 µs;
    where they fill the SMs 256 stays (Mixtral, one token: 83.9 against 85.5 µs; 8 tokens 413.6
    against 453.0)."""
    if stack.quant == 2:
        return 128 if underfilled and not down else 256
    return 64 if down else 32


def _block_n(pairs: int, rows: int, device: torch.device) -> int:
    """The widest of 128, 64, 32 and 16 rows a program that still gives every SM four programs
    (latency is hidden by programs in flight: the loop has no pipeline stages), else 16."""
    for bn in (128, 64, 32):
        if pairs * triton.cdiv(rows, bn) >= 4 * _sm_count(device):
            return bn
    return 16


def gemv_experts(x: torch.Tensor, routing: torch.Tensor, up, down, inter: int, top_k: int, geglu: bool,
                 interp: bool, out: torch.Tensor) -> torch.Tensor:
    """``out [T, H]`` (``x``'s dtype) ``= Σ_j routing[t, e_j] · mlp_{e_j}(x[t])`` over each token's
    ``top_k`` largest routing weights (module docstring), each kernel finding its pair's expert
    (:func:`_choice`); ``up``, ``down`` the stacks as ``moe._Stack`` (codes, scales, zero points,
    kind, group). Each stack takes the word loop when :func:`words_step` allows, else the float
    loop; the partials' sum and cast are one more launch (:func:`_finish_kernel`)."""
    t, hidden = x.shape
    e = routing.shape[1]
    pairs = t * top_k
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    masks = dict(M12=0xF000, M16=0xF0000, M0F=0x0F0F0F0F, M8=0x7F8000)
    route = dict(r_ptr=routing, sr=routing.stride(0), E=e, TOP_K=top_k, E_PAD=triton.next_power_of_2(e))
    stages = 1 if interp else 2

    def words(stack, step, block_n):
        codes = stack.codes.view(torch.int32)           # int4: input 8c + i in bits 4i..; int8, fp8: 4c + i, byte i
        return dict(w_ptr=codes, swe=codes.stride(0), W_ROW=codes.stride(1), s_ptr=stack.scale, z_ptr=stack.zero,
                    sse=stack.scale.stride(0), ssn=stack.scale.stride(1), CODES=_WORD_CODES[code_kind(stack)],
                    STEP=step, GROUP=stack.group, ZP=stack.zero_point, EMULATE=interp, BLOCK_N=block_n, num_warps=4,
                    num_stages=stages, **masks, **route)

    def consts(stack, rows):
        return dict(BLOCK_N=_block_n(pairs, rows, x.device), BLOCK_K=stack.group if stack.quant == 2 else 128,
                    QUANT=stack.quant, GROUP=stack.group, ZP=stack.zero_point, num_warps=4, num_stages=stages,
                    **route)

    step = words_step(up, x.dtype, hidden)
    if step:
        bn = _words_block_n(up, False, pairs * triton.cdiv(2 * inter, 256) < _sm_count(x.device))
        _gate_up_words_kernel[(pairs, triton.cdiv(2 * inter, bn))](
            x, x.stride(0), h_ptr=h, I=inter, GEGLU=geglu, X_WIDE=_x_wide(x), **words(up, step, bn))
    else:
        cu = consts(up, inter)
        _gate_up_kernel[(pairs, triton.cdiv(inter, cu["BLOCK_N"]))](
            x, x.stride(0), *up.args(), h, H=hidden, I=inter, GEGLU=geglu, **cu)
    step = words_step(down, x.dtype, inter)
    if step:
        bn = _words_block_n(down, True)
        tiles = triton.cdiv(hidden, bn)
        steps = inter // step
        split = max(1, min(steps, _WORDS_PER_SM * _sm_count(x.device) // (pairs * tiles)))
        slice_steps = triton.cdiv(steps, split)
        split = triton.cdiv(steps, slice_steps)                  # no empty slices
        y = torch.empty((split, pairs, hidden), dtype=torch.float32, device=x.device)
        _down_words_kernel[(pairs, tiles, split)](
            h, y_ptr=y, P=pairs, H=hidden, I=inter, SLICE_W=slice_steps * step // (8 if down.quant == 2 else 4),
            X_WIDE=_x_wide(h), **words(down, step, bn))
    else:
        y = torch.empty((1, pairs, hidden), dtype=torch.float32, device=x.device)
        cd = consts(down, hidden)
        _down_kernel[(pairs, triton.cdiv(hidden, cd["BLOCK_N"]))](h, *down.args(), y, H=hidden, I=inter, **cd)
    return finish(y, out, top_k)


def finish(y: torch.Tensor, out: torch.Tensor, top_k: int) -> torch.Tensor:
    """``out [T, H] = Σ_s Σ_j y[s, t·top_k + j]`` cast to ``out``'s dtype, one launch
    (:func:`_finish_kernel`); ``y [S, P, H]`` float32, contiguous."""
    t, hidden = out.shape
    dst = out if out.stride(-1) == 1 else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    _finish_kernel[(t, triton.cdiv(hidden, _FINISH_BLOCK))](y, dst, dst.stride(0), t, hidden, S=y.shape[0],
                                                            TOP_K=top_k, BLOCK=_FINISH_BLOCK)
    return out if dst is out else out.copy_(dst)


_FINISH_BLOCK = 1024


def _x_wide(x: torch.Tensor) -> bool:
    """Whether every row of the 16-bit ``x`` starts 8-byte aligned: the word loop then reads four
    activations an int64 (``X_WIDE``)."""
    return x.stride(-1) == 1 and x.data_ptr() % 8 == 0 and (x.stride(0) * x.element_size()) % 8 == 0
