"""Two to 32 rows of a Q4_K, Q5_K, Q6_K or Q8_0 GEMV (one row of Q5_K and Q8_0 too) on the int8 tensor cores:
``out = x @ dequant(W).T (+ add)``.

The one-row kernel (:mod:`.gguf_mma`) lays a row's 8 sub-blocks block-diagonally on the 16 rows of
the dot's activation operand; with M rows that would multiply its dots by M. Here each 32-input
sub-block ``s`` is its own ``tl.dot`` (``mma.sync``: 32 weight rows, under the 64 of a ``wgmma``),
so a tile's dots cost what the one-row kernel's do for up to 8 rows:

* **Activations** (:func:`_rows_planes_kernel`, one launch per GEMV, or the RMSNorm before it,
  :func:`norm_rows_planes`): per row ``m`` and super-block
  (256 inputs) one scale ``a_m = max|x| / 32639`` and 16-bit fixed point ``xq = round(x / a_m) = 256 h
  + l``. Sub-block ``s``'s operand is ``[2 R, 32]`` int8, stored contiguously (``[K / 32, 2 R, 32]``,
  ``R`` = 8, 16, ...): per group of 8 rows, row ``m``'s high bytes ``h`` then its low bytes ``l``
  (zeros for ``m >= M``); the dot reads it transposed, as its B operand ``[32, 2 R]``. Also ``a_m``
  (for each of the block's sub-blocks) and ``S_ms = a_m Σ_{k in s} xq`` (``[K / 32, R]``); a block
  holding a NaN or an infinity gets ``a_m`` NaN, so that row's outputs are NaN.
* **Weights**: a super-block's 128 code bytes of ``BLOCK_N`` rows load as four ``[BLOCK_N, 32]``
  tiles; the low nibbles of tile ``g`` are sub-block ``2 g``, the high ones ``2 g + 1``, as int8 ``q``
  (0..15, :func:`_codes`: one or two instructions a word): the dot's A operand. It gives ``V
  [BLOCK_N, 2 R]`` (int32, exact). The weights on A, not B, put 2 weight rows in a thread of the
  ``mma`` tile (as B, 4 columns), so each thread unpacks half as many scales (H200, 8 rows of the 8B
  gate: 22.5 µs against 26.1 at their best launches).
* **Scales**: columns ``m`` and ``8 + m`` of an ``mma`` tile sit in one thread. As ``a_m`` is the
  block's, each row's 6-bit ``sc_s`` (:func:`_scale_min_words`: four bytes an instruction) multiplies
  the high and the low sums as integers, which add up over the 8 sub-blocks (``|V| < 2^16``, ``Σ_s
  sc_s |V| < 2^25``); the mins are float32 per sub-block:

      Σ_k x_mk w_nk = d a_m (256 Σ_s sc_s V_h + Σ_s sc_s V_l) - dmin Σ_s m_s S_ms   (a super-block)

  so a sub-block costs each accumulator element two integer multiply-adds and one fma; sm_90 issues
  422 SASS instructions a super-block step for 8 rows and 567 for 16 in 32-row tiles of 2 warps
  (session 49's float32 sums a sub-block, a scale per sub-block and row: 556 and 811).
* **Q5_K** (176-byte blocks: ``qs`` at byte 48 after ``qh[32]``): as Q4_K, each code ``q`` (0..31) taking
  bit ``s`` of its ``qh`` byte as its fifth (:func:`_codes5`; sm_90: 487 SASS instructions a step for
  8 rows, 685 for 16, against 1581 for the plane loop). Q5_K has no one-row tensor-core kernel, so
  its one row runs here too (the operands' other 7 rows zeros): H200, the 8B gate 23.6 µs at 2 rows
  against 53.3 a plane a dot (``gguf_linear._MMA_ROWS_Q5K`` switches both off).
* **Q8_0** (:func:`q8_0_rows_sums`, 34-byte blocks, 2-byte aligned): the rows' super-block is 8 blocks;
  each block's 32 int8 codes are the dot's A operand as they are (two to a 16-bit load), and its
  float16 ``d`` scales its sums in float32 (605 SASS instructions a step for 8 rows, against 2086
  for the plane loop). Q8_0 has no one-row tensor-core kernel either, so its 1-16 rows run here by
  default (``gguf_linear._MMA_ROWS_Q8_0``): H200, the 8B gate 28.9 µs at 1-2 rows against 72.6 on the
  CUDA cores and 78.6 a plane a dot; the 8B Q8_0 step 4.265 ms against 9.331.
* **9-16 rows** hold two groups of 8 in the rows' operand (``[32, 32]``), so the pairs stay in one
  thread: twice the dots and the scaling, the weights decoded once. **17-32 rows** hold four
  (``[64, 32]``), by default (``ROWS_BY_DEFAULT``) for Q4_K, Q5_K and Q8_0; Q6_K's 17-32 rows run a plane a
  dot (``Q6K_ROWS_BY_DEFAULT``). H200, 32 rows of the 8B gate: Q4_K 37.2 µs against 44.3 a plane a dot,
  Q5_K 42.1 against 61.7, Q8_0 68.4 against 79.2; Q6_K 53.8 against 47.0.
* **Q6_K** (:func:`q6k_rows_sums`, the stored 224-byte blocks): the same operands of the rows; each
  32-value plane of the weights (:func:`.gguf_mma_q6k._plane`: ``4 (q - 32)``) is dotted twice, with
  the rows' operand masked to its first and its last 16 inputs, and each int8 weight scale
  ``sc_j`` multiplies its sums as integers (``16 · 128 · 128 · 128 · 16 = 2^29`` at most): ``Σ = d a_m (256
  Σ_j sc_j V_h + Σ_j sc_j V_l) / 4`` (no minimum; 479 and 687 instructions a step for 8 and 16 rows,
  against 654 and 1018).

Split-K slices meet in the launch (:mod:`.splitk`); the last adds the residual or bias, or with
``SWIGLU`` (``W = [gate | up]``, tile rows ``2 i, 2 i + 1`` the gate and up rows of output ``i``)
stores ``silu(gate) * up``, rounded as the one-row epilogue rounds it; ``RMS_IN`` multiplies each
row's sums by its carried norm's factor first. Both launches use programmatic dependent launch
(:mod:`.pdl`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import triton_interprets
from .gemv import rin_tile, rms_factor
from .gguf_mma import _SUPER, slices
from .gguf_mma_q6k import _plane
from .gguf_tiles import layout_args
from .pdl import pdl_launch, pdl_trigger, pdl_wait
from .splitk import meet_tile

__all__ = ["MMA_ROWS", "ROWS_BY_DEFAULT", "Q6K_ROWS_BY_DEFAULT", "CONFIG_KEYS", "gguf_gemv_mma_rows", "rows_planes", "empty_rows_planes",
           "norm_rows_planes", "is_rows_planes", "pick_rows_config", "split_for_rows", "rows_sums"]

MMA_ROWS = 32                   # activation rows a launch takes: the rows' operand holds (high, low) bytes x 8 x 4
ROWS_BY_DEFAULT = 32            # gguf_gemv takes the kernel by default up to this many rows (gguf_linear.mma_eligible)
# ... and up to this many of Q6_K: its 17-32 rows run a plane a dot. H200, 32 rows (--many --sweep), µs at the
# sweep's best launch against a plane a dot: gate 53.8 vs 47.0, qkv 28.6 vs 26.7, o 18.9 vs 18.1, down 49.5 vs 52.2
Q6K_ROWS_BY_DEFAULT = 16
CONFIG_KEYS = {"BLOCK_N", "SPLIT_K", "num_warps", "num_stages"}
# the launch by the rows the operands hold (pick_rows_config): weight rows a tile, warps, and the programs a SM
# that K is split towards (split_for_rows)
# 17-32 rows: H200, Q4_K's sweep (--many --sweep --rows 32), µs, against a plane a dot: gate 37.2 (1 slice) vs 44.3,
# qkv 18.6 (4 slices) vs 26.2, down 40.9 (64-row tiles, 2 warps, 8 slices) vs 47.1; 32-row tiles of 2 warps took
# 85.4, 41.4 and 77.1. Q5_K at this launch: o 19.4 vs 22.8, qkv 20.5 vs 31.7, gate 42.1 vs 61.7, down 48.6 vs 63.0
_TILES = {8: (32, 2, 12), 16: (64, 4, 3), 32: (64, 4, 1.5)}
# ... where a type's rows take other launches (H200, --many --sweep, µs against _TILES' launch): 16 rows in 32-row
# tiles of 2 warps, Q5_K qkv 16.6 vs 20.6, gate 30.1 vs 30.8; Q8_0 gate 33.6 vs 51.3, down 35.1 vs 49.0; 32 rows of
# Q8_0 in 64-row tiles of 2 warps towards 3 programs a SM, o 22.3 vs 26.5, gate 68.4 vs 88.6, down 63.1 vs 82.2
# (qkv's best was 4 warps in 4 slices, 27.1; a plane a dot: o 24.0, qkv 40.5, gate 79.2, down 81.4)
_TILES_BY_TYPE = {("Q5_K", 16): (32, 2, 5), ("Q8_0", 16): (32, 2, 12), ("Q8_0", 32): (64, 2, 3)}
_WIDE_PROGRAMS_PER_SM = 4       # 64-row tiles take 2 warps, not 4, past this many programs a SM
_STAGES = 2                     # pipeline stages of the K loop
_MIN_SLICE = 2                  # K slices keep at least this many super-blocks (split_for_rows)


@triton.jit
def _store_operands(x, rows, b, a_ptr, xa_ptr, xs_ptr, R: tl.constexpr, ROWS: tl.constexpr):
    """Super-block ``b`` of the rows ``rows [ROWS]`` whose float32 inputs are ``x [ROWS, 8, 32]`` (zeros
    for rows past M): their bytes in the 8 sub-blocks' ``[2 R, 32]`` operands, ``a_m`` and ``S_ms``
    (module docstring)."""
    m = rows[:, None, None]
    s = tl.arange(0, 8)[None, :, None]
    c = tl.arange(0, 32)[None, None, :]
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)                    # [ROWS]: one scale a super-block
    inv = tl.where(amax > 0, 32639.0 / tl.maximum(amax, 1e-30), 0.0)   # |xq| <= 32639: h fits a byte
    xq = tl.floor(x * inv[:, None, None] + 0.5).to(tl.int32)
    h = (xq + 128) >> 8                                                 # xq = 256 h + l, l in [-128, 127]
    a_sub = a_ptr + ((b * 8 + s) * 2 * R + 16 * (m // 8) + m % 8) * 32 + c   # row m's high bytes in sub-block s
    tl.store(a_sub, h.to(tl.int8))
    tl.store(a_sub + 8 * 32, (xq - 256 * h).to(tl.int8))
    a = amax[:, None] / 32639.0 + tl.sum(tl.sum(x - x, axis=2), axis=1)[:, None] + tl.zeros([ROWS, 8], tl.float32)
    at = (b * 8 + tl.arange(0, 8)[None, :]) * R + rows[:, None]
    tl.store(xa_ptr + at, a)
    tl.store(xs_ptr + at, a * tl.sum(xq, axis=2).to(tl.float32))


@triton.jit
def _rows_planes_kernel(x_ptr, stride_xm, M, a_ptr, xa_ptr, xs_ptr, R: tl.constexpr, USE_PDL: tl.constexpr):
    """Super-block ``program_id(0)`` of the rows ``x [M, K]``: its 8 sub-blocks' ``[2 R, 32]`` operands
    and each row's ``a_m``, ``S_ms`` (module docstring; ``R`` rows, 8, 16 or 32)."""
    pdl_wait(USE_PDL)
    b = tl.program_id(0)
    m = tl.arange(0, R)[:, None, None]
    s = tl.arange(0, 8)[None, :, None]
    c = tl.arange(0, 32)[None, None, :]
    x = tl.load(x_ptr + m * stride_xm + b * 256 + s * 32 + c, mask=m < M, other=0.0).to(tl.float32)
    _store_operands(x, tl.arange(0, R), b, a_ptr, xa_ptr, xs_ptr, R, R)


@triton.jit
def _norm_rows_planes_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, a_ptr, xa_ptr, xs_ptr, M, K, eps,
                             R: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """``add_rms_norm`` of row ``m = program_id(1)`` of ``x, residual [M, K]`` (contiguous) and the rows'
    operands of super-block ``b = program_id(0)`` of its normed values, in one launch: the program reads
    the whole row ``s = x + residual`` (rounded to its dtype) for ``r = rsqrt(mean(s²) + eps)``, stores its
    super-block's ``s`` and ``normed = w · (s · r)`` rounded as the generated kernel (and
    :func:`.gguf_mma._norm_planes_kernel`) rounds them, and row ``m``'s bytes, ``a_m`` and ``S_ms`` of the
    super-block as :func:`_rows_planes_kernel` makes them from ``normed``. Programs ``m >= M`` (up to
    ``R``) store the zeros of the rows past M. The norm weight is read before the PDL wait: no kernel of
    a step writes it."""
    b = tl.program_id(0)
    m = tl.program_id(1)
    lim = K * (m < M).to(tl.int32)                                     # no input past M
    sub = tl.arange(0, 8)[:, None]
    c = tl.arange(0, 32)[None, :]
    cols = b * 256 + sub * 32 + c                                      # [8 sub-blocks, 32]
    wv = tl.load(w_ptr + cols).to(tl.float32)
    pdl_wait(USE_PDL)
    dt = out_ptr.dtype.element_ty
    k = tl.arange(0, BLOCK_K)
    row = m.to(tl.int64) * K
    ok = k < lim
    s_all = (tl.load(x_ptr + row + k, mask=ok, other=0.0).to(tl.float32)
             + tl.load(res_ptr + row + k, mask=ok, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    r = tl.rsqrt(tl.sum(s_all * s_all, axis=0) / K + eps)
    mine = cols < lim
    s = (tl.load(x_ptr + row + cols, mask=mine, other=0.0).to(tl.float32)
         + tl.load(res_ptr + row + cols, mask=mine, other=0.0).to(tl.float32)).to(dt)
    normed = (wv * (s.to(tl.float32) * r).to(dt).to(tl.float32)).to(dt)
    tl.store(sum_ptr + row + cols, s, mask=mine)
    tl.store(out_ptr + row + cols, normed, mask=mine)
    y = tl.reshape(normed.to(tl.float32), [1, 8, 32])                 # zeros past M
    _store_operands(y, m + tl.zeros([1], tl.int32), b, a_ptr, xa_ptr, xs_ptr, R, 1)


_CODES_ASM = tl.constexpr(("and.b32 $0, $1, 0x0F0F0F0F;",
                           "{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }"))


@triton.jit
def _codes(c, HIGH: tl.constexpr, EMULATE: tl.constexpr):
    """The low (or ``HIGH``) nibbles ``q`` of the code bytes ``c`` as int8 ``q`` (0..15), four bytes an
    instruction (``EMULATE``: int32 arithmetic, for the CPU interpreter, which runs no PTX)."""
    if EMULATE:
        return ((c.to(tl.int32) >> 4) & 15 if HIGH else c.to(tl.int32) & 15).to(tl.int8)
    return tl.inline_asm_elementwise(_CODES_ASM[HIGH], "=r,r", [c], dtype=tl.int8, is_pure=True, pack=4)


def _fifth_bit_asm(s: int) -> str:
    """PTX for :func:`_codes5`: sub-block ``s``'s 4-bit codes (low nibbles for even ``s``, high for odd)
    with bit ``s`` of the ``qh`` bytes as their fifth bit, four bytes a word."""
    nib = "and.b32 u, $1, 0x0F0F0F0F;" if s % 2 == 0 else "shr.b32 u, $1, 4; and.b32 u, u, 0x0F0F0F0F;"
    move = f"shl.b32 t, $2, {4 - s};" if s < 4 else "mov.b32 t, $2;" if s == 4 else f"shr.b32 t, $2, {s - 4};"
    return "{ .reg .b32 t, u; " + nib + " " + move + " and.b32 t, t, 0x10101010; or.b32 $0, u, t; }"


_CODES5_ASM = tl.constexpr(tuple(_fifth_bit_asm(s) for s in range(8)))


@triton.jit
def _codes5(c, qh, S: tl.constexpr, EMULATE: tl.constexpr):
    """Q5_K's 5-bit codes ``q`` (0..31) of sub-block ``S`` as int8: the low (even ``S``) or high nibbles of
    the code bytes ``c`` and bit ``S`` of the ``qh`` bytes (``EMULATE``: int32 arithmetic, for the CPU
    interpreter)."""
    if EMULATE:
        nib = (c.to(tl.int32) >> (4 * (S % 2))) & 15
        return (nib | (((qh.to(tl.int32) >> S) & 1) << 4)).to(tl.int8)
    return tl.inline_asm_elementwise(_CODES5_ASM[S], "=r,r,r", [c, qh], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _scale_min_words(w1, w2, w3):
    """A Q4_K header's 6-bit scales and mins (``scales[12]`` as three int32 words ``w1, w2, w3``: bytes
    0-3, 4-7, 8-11) as four words of one value a byte: the scales of sub-blocks 0-3 (the low 6 bits of
    bytes 0-3) and 4-7 (the low nibbles of bytes 8-11 with the top 2 bits of bytes 0-3), the mins
    likewise from bytes 4-7 and the high nibbles of 8-11."""
    sc_lo = w1 & 0x3F3F3F3F
    mn_lo = w2 & 0x3F3F3F3F
    sc_hi = (w3 & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030)
    mn_hi = ((w3 >> 4) & 0x0F0F0F0F) | ((w2 >> 2) & 0x30303030)
    return sc_lo, sc_hi, mn_lo, mn_hi


@triton.jit
def _byte(w, i: tl.constexpr):
    """Byte ``i`` of the int32 words ``w`` as float32."""
    return ((w >> (8 * i)) & 255).to(tl.float32)


@triton.jit
def _pair(v, BLOCK_N: tl.constexpr, R: tl.constexpr):
    """``(V_h, V_l)`` ``[BLOCK_N, R]`` of a product ``v [BLOCK_N, 2 R]`` whose columns are, per 8 rows, their
    high then their low bytes (columns ``c`` and ``c + 8`` of an ``mma`` tile sit in one thread)."""
    hi, lo = tl.split(tl.permute(tl.reshape(v, [BLOCK_N, R // 8, 2, 8]), (0, 1, 3, 2)))
    return tl.reshape(hi, [BLOCK_N, R]), tl.reshape(lo, [BLOCK_N, R])


@triton.jit
def q4k_rows_sums(rows, BS, b_lo, b_hi, a_ptr, xa_ptr, xs_ptr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr,
                  R: tl.constexpr, Q5: tl.constexpr = False):
    """``[BLOCK_N, R]`` float32: ``Σ_k x[m, k] dequant(W)[n, k]`` over super-blocks ``[b_lo, b_hi)`` of the
    Q4_K rows ``rows`` (``BLOCK_N`` row pointers, ``BS`` bytes between a row's super-blocks) against
    the rows' operands and ``a_m``, ``S_ms`` (module docstring): each sub-block's weights are the
    dot's A operand ``[BLOCK_N, 32]``, the rows' operand its B ``[32, 2 R]``. ``Q5``: Q5_K rows (176-byte
    blocks, ``qh[32]`` at byte 16 giving each code its fifth bit, :func:`_codes5`; ``|V| < 2^17``)."""
    c = tl.arange(0, 32)
    r = tl.arange(0, 2 * R)
    m = tl.arange(0, R)
    acc = tl.zeros([BLOCK_N, R], tl.float32)
    for b in range(b_lo, b_hi):
        blk = rows + b * BS                                # d, dmin @0; scales[12] @4; qs[128] @16 (Q5_K: qh, qs @48)
        words = blk.to(tl.pointer_type(tl.int32))
        dd, w1, w2, w3 = tl.load(words), tl.load(words + 1), tl.load(words + 2), tl.load(words + 3)
        d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (dd >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        sc_lo, sc_hi, mn_lo, mn_hi = _scale_min_words(w1, w2, w3)
        ph = tl.zeros([BLOCK_N, R], tl.int32)             # Σ_s sc_s V_h and Σ_s sc_s V_l: one activation scale
        pl = tl.zeros([BLOCK_N, R], tl.int32)             # a block, so the sub-blocks' sums add up as integers
        if Q5:
            qh = tl.load(blk[:, None] + (16 + c)[None, :])                       # [BLOCK_N, 32]: Q5_K's fifth bits
        for g in tl.static_range(4):
            codes = tl.load(blk[:, None] + ((48 if Q5 else 16) + 32 * g + c)[None, :])   # [BLOCK_N, 32]
            for hi in tl.static_range(2):
                s = 2 * g + hi
                a = tl.load(a_ptr + ((b * 8 + s) * 2 * R + r[None, :]) * 32 + c[:, None])   # [32, 2 R]
                # the sub-block as an expression: the name s is no constexpr here, and _codes5 indexes its PTX by it
                w = _codes5(codes, qh, 2 * g + hi, EMULATE) if Q5 else _codes(codes, hi == 1, EMULATE)
                v = tl.dot(w, a, out_dtype=tl.int32)                                   # [BLOCK_N, 2 R]
                vh, vl = _pair(v, BLOCK_N, R)
                sc = ((sc_lo if s < 4 else sc_hi) >> (8 * (s % 4))) & 255
                ph += vh * sc[:, None]
                pl += vl * sc[:, None]
                xs = tl.load(xs_ptr + (b * 8 + s) * R + m)
                acc -= (dmin * _byte(mn_lo if s < 4 else mn_hi, s % 4))[:, None] * xs[None, :]
        xa = tl.load(xa_ptr + b * 8 * R + m)                # a_m, the same for the block's 8 sub-blocks
        acc += (ph.to(tl.float32) * 256.0 + pl.to(tl.float32)) * (d[:, None] * xa[None, :])
    return acc


@triton.jit
def q6k_rows_sums(rows, BS, b_lo, b_hi, a_ptr, xa_ptr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr,
                  R: tl.constexpr):
    """``[BLOCK_N, R]`` float32: ``Σ_k x[m, k] dequant(W)[n, k]`` over super-blocks ``[b_lo, b_hi)`` of the
    stored Q6_K rows ``rows`` (224-byte blocks: ``ql[128]``, ``qh[64]``, ``scales[16]`` int8, ``d``;
    :mod:`.gguf_mma_q6k`'s layout) against the rows' operands (:func:`rows_planes`: the Q4_K format,
    32 inputs a sub-block). Value plane ``P`` of half ``h`` (inputs ``128 h + 32 P + l``) is one
    32-input operand ``4 (q - 32)`` (:func:`.gguf_mma_q6k._plane`), dotted twice with the rows'
    operand masked to its first and last 16 inputs, one weight scale each:
    ``Σ = d a_m Σ_j sc_j (256 V_h + V_l) / 4``."""
    c = tl.arange(0, 32)
    r = tl.arange(0, 2 * R)
    m = tl.arange(0, R)
    first = (c < 16)[:, None]                              # the operand's rows: inputs l < 16 of the plane
    acc = tl.zeros([BLOCK_N, R], tl.float32)
    for b in range(b_lo, b_hi):
        blk = rows[:, None] + b * BS
        words = (rows + b * BS).to(tl.pointer_type(tl.int32))
        d4 = 0.25 * (tl.load(words + 52) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        ph = tl.zeros([BLOCK_N, R], tl.int32)             # Σ_j sc_j V_h and Σ_j sc_j V_l (one activation scale a
        pl = tl.zeros([BLOCK_N, R], tl.int32)             # block): |V| <= 16 * 128 * 128, 16 |sc| <= 128: <= 2^29
        for h in tl.static_range(2):
            ql0 = tl.load(blk + (64 * h + c)[None, :])
            ql1 = tl.load(blk + (64 * h + 32 + c)[None, :])
            qh = tl.load(blk + (128 + 32 * h + c)[None, :])
            sw0 = tl.load(words + 48 + 2 * h)              # scales[8 h .. 8 h + 4)
            sw1 = tl.load(words + 49 + 2 * h)              # scales[8 h + 4 .. 8 h + 8)
            for P in tl.static_range(4):
                s = b * 8 + 4 * h + P                      # the rows' 32-input sub-block
                w = _plane(ql0 if P % 2 == 0 else ql1, qh, P, EMULATE)                    # [BLOCK_N, 32]
                for j in tl.static_range(2):               # sub-block 2 P + j of the half: scales[8 h + 2 P + j]
                    # the operand [32, 16] loaded masked (zeros), so the load feeds the dot straight
                    a = tl.load(a_ptr + (s * 2 * R + r[None, :]) * 32 + c[:, None], mask=first if j == 0 else ~first,
                                other=0)
                    v = tl.dot(w, a, out_dtype=tl.int32)
                    vh, vl = _pair(v, BLOCK_N, R)
                    sc = ((sw0 if P < 2 else sw1) << (24 - 8 * ((2 * P + j) % 4))) >> 24     # scales[8 h + 2 P + j], signed
                    ph += vh * sc[:, None]
                    pl += vl * sc[:, None]
        xa = tl.load(xa_ptr + b * 8 * R + m)                # a_m, the same for the block's 8 sub-blocks
        acc += (ph.to(tl.float32) * 256.0 + pl.to(tl.float32)) * (d4[:, None] * xa[None, :])
    return acc


@triton.jit
def q8_0_rows_sums(rows, BS, b_lo, b_hi, a_ptr, xa_ptr, BLOCK_N: tl.constexpr, R: tl.constexpr):
    """``[BLOCK_N, R]`` float32: ``Σ_k x[m, k] dequant(W)[n, k]`` over the rows' super-blocks ``[b_lo, b_hi)``
    (8 Q8_0 blocks each) of the Q8_0 rows ``rows`` (34-byte blocks: ``d`` float16, ``qs[32]`` int8;
    ``BS`` bytes between a row's blocks) against the rows' operands (:func:`rows_planes`: 32 inputs a
    sub-block, one a Q8_0 block). The codes are the dot's A operand as they are; each block's float
    ``d`` scales its sums: ``Σ = a_m Σ_s d_s (256 V_h + V_l)`` (``|V| <= 32 · 128 · 128 = 2^19``)."""
    c = tl.arange(0, 32)
    r = tl.arange(0, 2 * R)
    m = tl.arange(0, R)
    acc = tl.zeros([BLOCK_N, R], tl.float32)
    for b in range(b_lo, b_hi):
        t = tl.zeros([BLOCK_N, R], tl.float32)
        for s in tl.static_range(8):
            blk = rows + (b * 8 + s) * BS                  # 2-byte aligned: d @0, qs @2
            d = tl.load(blk.to(tl.pointer_type(tl.int16))).to(tl.float16, bitcast=True).to(tl.float32)
            hw = tl.load((blk + 2).to(tl.pointer_type(tl.int16))[:, None] + tl.arange(0, 16)[None, :])   # code pairs
            w = tl.reshape(tl.join(hw.to(tl.int8), (hw >> 8).to(tl.int8)), [BLOCK_N, 32])            # [BLOCK_N, 32]
            a = tl.load(a_ptr + ((b * 8 + s) * 2 * R + r[None, :]) * 32 + c[:, None])            # [32, 2 R]
            vh, vl = _pair(tl.dot(w, a, out_dtype=tl.int32), BLOCK_N, R)
            t += d[:, None] * (vh * 256 + vl).to(tl.float32)
        acc += t * tl.load(xa_ptr + b * 8 * R + m)[None, :]   # a_m, the same for the super-block's 8 blocks
    return acc


@triton.jit
def rows_sums(rows, BS, b_lo, b_hi, a_ptr, xa_ptr, xs_ptr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr,
              R: tl.constexpr, QTYPE: tl.constexpr):
    """``[BLOCK_N, R]`` float32 sums of the ``QTYPE`` rows (Q4_K, Q5_K, Q6_K or Q8_0) over super-blocks
    ``[b_lo, b_hi)`` against the rows' operands: :func:`q4k_rows_sums`, :func:`q6k_rows_sums` or
    :func:`q8_0_rows_sums` (the K loop of :func:`_rows_kernel` and of :mod:`.moe_gguf_rows`' kernels)."""
    if QTYPE == "Q6_K":
        s = q6k_rows_sums(rows, BS, b_lo, b_hi, a_ptr, xa_ptr, BLOCK_N, EMULATE, R)
    elif QTYPE == "Q8_0":
        s = q8_0_rows_sums(rows, BS, b_lo, b_hi, a_ptr, xa_ptr, BLOCK_N, R)
    else:
        s = q4k_rows_sums(rows, BS, b_lo, b_hi, a_ptr, xa_ptr, xs_ptr, BLOCK_N, EMULATE, R, QTYPE == "Q5_K")
    return s


@triton.jit
def _rows_kernel(
    a_ptr, xa_ptr, xs_ptr,   # activation operands [K / 32, 2 R, 32] int8, a_m and S_ms [K / 32, R] float32
    w_ptr,                   # uint8 Q4_K / stored Q6_K blocks: rows [N, ROW_BYTES], or block-major (KB)
    add_ptr,                 # HAS_ADD: [M, N] residual (stride_am) or [N] bias (stride_am 0), last dim contiguous
    out_ptr,                 # [M, N] output, last dim contiguous
    part_ptr, lock_ptr,      # SPLIT: [SPLIT_K, n_tiles, BLOCK_N, R] float32 partials, [n_tiles] counters
    M, N, ROW_BYTES, PER,    # sizes (N: output columns); PER super-blocks per K slice
    SPLIT_K, BLOCKS, stride_om, stride_am,
    QTYPE: tl.constexpr,     # "Q4_K", "Q5_K", "Q6_K" or "Q8_0"
    R: tl.constexpr,         # activation rows the operands hold: 8, 16 or 32 (MMA_ROWS)
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_ADD: tl.constexpr, EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr, LATE_LAUNCH: tl.constexpr,   # (:mod:`.pdl`) the next kernel launches after the K loop
    SWIGLU: tl.constexpr = False,   # w is [2N, K] = [gate | up]; out = silu(x @ gate.T) * (x @ up.T)
    KB: tl.constexpr = False, BYTES: tl.constexpr = 144, KB_STRIDE=0,   # the layout (gguf_tiles.layout_args)
    rin_ptr=None, RIN_CHUNKS=1, rin_inv_n=1.0, rin_eps=0.0,   # RMS_IN: the producer's Σy² partials [M, chunks]
    RMS_IN: tl.constexpr = False, RIN_BLOCK: tl.constexpr = 1,   # the sums times the carried norm's factor (GemvRmsIn)
):
    """out[m, n] = Σ_k x[m, k] dequant(w)[n, k] (+ add) for ``BLOCK_N`` weight rows and every activation
    row over super-blocks ``[pid_s PER, (pid_s + 1) PER)`` (module docstring); weight rows past the
    last read it (never stored), so the code loads carry no mask."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rt = tl.arange(0, BLOCK_N)
    if SWIGLU:
        rn = tl.minimum(pid_n * (BLOCK_N // 2) + rt // 2, N - 1) + (rt % 2) * N
    else:
        rn = tl.minimum(pid_n * BLOCK_N + rt, N - 1)
    rows = w_ptr + rn.to(tl.int64) * ROW_BYTES
    BS = KB_STRIDE if KB else BYTES                        # bytes between a row's super-blocks
    pdl_wait(USE_PDL, not LATE_LAUNCH)
    b_lo = pid_s * PER
    tile = rows_sums(rows, BS, b_lo, tl.minimum(b_lo + PER, BLOCKS), a_ptr, xa_ptr, xs_ptr, BLOCK_N, EMULATE, R, QTYPE)
    if LATE_LAUNCH:
        pdl_trigger(USE_PDL)
    tile, last = meet_tile(tile, part_ptr, lock_ptr, pid_n, pid_s, SPLIT_K, BLOCK_N, R, SPLIT)
    rm = tl.arange(0, R)
    if last:
        dt = out_ptr.dtype.element_ty
        if RMS_IN:
            tile = tile * rms_factor(rin_tile(rin_ptr, rm, rm < M, RIN_CHUNKS, RIN_BLOCK), rin_inv_n, rin_eps)[None, :]
        if SWIGLU:
            HALF: tl.constexpr = BLOCK_N // 2
            gate, up = tl.split(tl.permute(tl.reshape(tile, [HALF, 2, R]), (0, 2, 1)))
            gate = gate.to(dt).to(tl.float32)
            y = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)
            cols = pid_n * HALF + tl.arange(0, HALF)
        else:
            cols = pid_n * BLOCK_N + rt
            y = tile
        ok = (cols < N)[:, None] & (rm < M)[None, :]
        if HAS_ADD:
            y += tl.load(add_ptr + rm[None, :] * stride_am + cols[:, None], mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rm[None, :] * stride_om + cols[:, None], y.to(dt), mask=ok)


def empty_rows_planes(k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised buffers for the operands of up to ``MMA_ROWS`` (32) rows of ``k`` inputs: ``[k / 32,
    64, 32]`` int8, ``a_m`` and ``S_ms`` ``[k / 32, 32]`` float32 (module docstring). The operands of
    ``R`` = 8 or 16 rows fill their start as ``[k / 32, 2 R, 32]`` and ``[k / 32, R]``."""
    return (torch.empty(k // 32, 2 * MMA_ROWS, 32, dtype=torch.int8, device=device),
            torch.empty(k // 32, MMA_ROWS, dtype=torch.float32, device=device),
            torch.empty(k // 32, MMA_ROWS, dtype=torch.float32, device=device))


def rows_planes(x: torch.Tensor, planes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> tuple:
    """The operands and ``a_m``, ``S_ms`` of the rows ``x [M, K]`` (M <= ``MMA_ROWS``, unit inner
    stride; module docstring), for 8 rows (M <= 8), 16 or 32, written into ``planes`` when given (a
    workspace's buffers)."""
    m, k = x.shape
    if planes is None:
        planes = empty_rows_planes(k, x.device)
    _rows_planes_kernel[(k // _SUPER,)](x, x.stride(0), m, *planes, R=_rows_for(m), **pdl_launch(x.device))
    return planes


def norm_rows_planes(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                     residual_out: torch.Tensor, planes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple:
    """``add_rms_norm`` of 1..``MMA_ROWS`` rows (``out = rms_norm(x + residual, weight)``, ``residual_out = x
    + residual``; ``[M, K]`` contiguous fp16/bf16, K a multiple of 256) that also writes ``planes``
    (:func:`rows_planes` of ``out``, a workspace's buffers) — the launch before a rows GEMV of the normed
    rows made by the norm's own. Returns ``planes``."""
    m, k = x.shape
    _norm_rows_planes_kernel[(k // _SUPER, _rows_for(m))](
        x, residual, weight, out, residual_out, *planes, m, k, float(eps), R=_rows_for(m),
        BLOCK_K=triton.next_power_of_2(k), **pdl_launch(x.device))
    return planes


def is_rows_planes(planes) -> bool:
    """Whether ``planes`` are the rows' operands (:func:`empty_rows_planes`: ``[K / 32, 64, 32]`` int8
    first), not a one-row tensor-core GEMV's (``[16, K]``)."""
    return planes is not None and len(planes) == 3 and planes[0].dim() == 3


def _rows_for(m: int) -> int:
    """The operands' rows for ``m`` activation rows: 8, 16 past 8, 32 past 16."""
    return 8 if m <= 8 else 16 if m <= 16 else 32


def pick_rows_config(n: int, k: int, sms: int, m: int = 8, qtype: str = "Q4_K") -> dict:
    """Launch of :func:`gguf_gemv_mma_rows` for ``m`` activation rows of ``qtype`` (``_TILES``): up to 8
    rows, tiles of 32 weight rows in 2 warps; 9-16 rows, 64 in 4 warps, or 2 when the grid has more than
    ``_WIDE_PROGRAMS_PER_SM`` programs a SM (Q5_K and Q8_0: 32 in 2 warps, ``_TILES_BY_TYPE``); 17-32
    rows as 16, K split towards fewer programs (Q4_K's sweep; Q8_0 in 2 warps); 2 stages; K split by
    :func:`split_for_rows`. H200,
    ``benchmarks/gguf_gemv.py --many --sweep``, µs: 8 rows of the 8B gate
    (14336 x 4096) 34.8 unsplit (448 programs), 21.1 in 4 slices; 16 rows of it 32.2 in 32-row
    tiles (4 slices), 29.2 in 64-row tiles of 4 warps (2 slices); 16 rows of the 8B down 33.4 against
    28.3, of a Q6_K down 40.7 against 31.7; of qkv (768 programs) 18.8 in 4 warps, 14.6 in 2."""
    rr = _rows_for(m)
    block_n, warps, per_sm = _TILES_BY_TYPE.get((qtype, rr), _TILES[rr])
    split = split_for_rows(triton.cdiv(n, block_n), k // _SUPER, sms, per_sm)
    if warps == 4 and triton.cdiv(n, block_n) * split > _WIDE_PROGRAMS_PER_SM * sms:
        warps = 2
    return dict(BLOCK_N=block_n, SPLIT_K=split, num_warps=warps, num_stages=_STAGES)


def split_for_rows(tiles: int, blocks: int, sms: int, per_sm: int = _TILES[8][2]) -> int:
    """K slices for ``tiles`` row tiles over ``blocks`` super-blocks: doubled while the grid has fewer
    than ``per_sm`` programs a SM and each slice keeps at least ``_MIN_SLICE`` super-blocks. A
    program of 32 rows holds few bytes in flight, so the SMs need many of them at once. H200, 8 rows,
    session 49's float32 sums, µs by slices (``gguf_gemv.py --many --sweep``): 8B o 11.0 in 8 (slices of 2), 12.8 in 16; qkv
    13.5 in 8, 16.0 in 16; gate 22.5 in 4, 25.7 in 8; down 28.2 in 8, 23.3 in 16 asked (14 slices of 4)."""
    split = 1
    while tiles * split < per_sm * sms and blocks // (split * 2) >= _MIN_SLICE:
        split *= 2
    return split


def gguf_gemv_mma_rows(x: torch.Tensor, data: torch.Tensor, qtype: str, add: torch.Tensor | None, out: torch.Tensor,
                       workspace, config: dict | None, sms: int, silu_mul: bool = False,
                       early_launch: bool = False, rms_in_args: dict | None = None, planes=None) -> torch.Tensor:
    """``out [M, N] = x [M, K] @ dequant(data).T (+ add)`` for 2..32 (Q5_K, Q8_0: 1..32) fp16/bf16 rows of a
    Q4_K, Q5_K, Q8_0 or (stored) Q6_K weight on the tensor cores; the operands were checked by
    :func:`.gguf_linear.gguf_gemv`, which calls this. ``workspace``: a :class:`~.gemv.GemvWorkspace`
    (operands, split-K partials). ``silu_mul`` (Q4_K, Q5_K, Q8_0): ``data`` holds ``[gate | up]`` (``2 N`` rows) and ``out`` gets ``silu(x @
    gate.T) * (x @ up.T)``, no ``add``. ``early_launch``: the next kernel launches right after the PDL
    wait (a row part run beside the next: :func:`.gguf_linear.gguf_gemv`). ``rms_in_args``: the launch
    keywords of a carried norm's factor (:func:`.gemv.rms_in_args`; x is a producer's ``y · weight``,
    each row's sums multiplied by its factor before the epilogue). ``planes``: the rows' operands of ``x``,
    already made (:func:`norm_rows_planes`); else this launch makes them (:func:`rows_planes`)."""
    from .gemv import GemvWorkspace
    row_stride, layout = layout_args(data, qtype)
    m, k = x.shape
    n = out.shape[1]
    rows_n = 2 * n if silu_mul else n
    cfg = dict(config or pick_rows_config(rows_n, k, sms, m, qtype))
    block_n, split = cfg.pop("BLOCK_N"), cfg.pop("SPLIT_K")
    blocks = k // _SUPER
    per, split = slices(blocks, split)
    ws = workspace or GemvWorkspace()
    if planes is None:
        planes = rows_planes(x, ws.rows_planes(x.device, k))
    n_tiles = triton.cdiv(rows_n, block_n)
    rr = _rows_for(m)
    part, lock = ws.get(x.device, n_tiles, split, block_n, rows=rr) if split > 1 else (out, out)
    _rows_kernel[(n_tiles, split)](
        *planes, data, add if add is not None else out, out, part, lock, m, n, row_stride, per, split, blocks,
        out.stride(0), 0 if add is None or add.dim() == 1 else add.stride(0),
        QTYPE=qtype, R=rr, BLOCK_N=block_n, SPLIT=split > 1, HAS_ADD=add is not None,
        EMULATE=triton_interprets(), LATE_LAUNCH=n_tiles * split > sms and not early_launch,
        SWIGLU=silu_mul, **layout, **pdl_launch(x.device),
        **(rms_in_args or {}), **cfg)
    return out
