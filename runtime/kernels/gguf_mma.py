"""One-row GGUF GEMV on the int8 tensor cores: ``out = x @ dequant(W).T (+ add)`` for Q4_K, ``x [1, K]``.

The CUDA-core one-row path (:func:`.gguf_tiles.row_dot`) spends about six instructions a weight on
nibble extraction, int->float tricks and FMAs, so it is bound by instruction issue, not bytes
(docs/gguf-kernels.md). Here the arithmetic goes to ``mma.sync`` (``tl.dot`` of int8 tiles) and the
per-weight work is three bit operations per eight weights:

* **Activations** (:func:`_planes_kernel`, one small launch per GEMV): per sub-block ``s`` of 32
  inputs, 16-bit fixed point ``xq = round(x / a_s)``, ``a_s = max|x_s| / 32639``, split into a signed
  high and low byte, ``xq = 256 h + l`` (error at most ``a_s / 2`` an input: 2^-16 of the sub-block's
  largest, below the 16-bit activations' own rounding). They are written as the dot's A operand
  ``[16, K]`` int8, block diagonal: row ``r = 8 p + s`` holds the ``h`` (``p = 0``) or ``l``
  (``p = 1``) bytes of sub-block ``s`` and zeros elsewhere, so each of the 16 rows of the ``[16,
  BLOCK_N]`` product is one sub-block's partial. Within super-block ``b`` columns ``256 b + j``,
  ``j < 128``, face the low nibbles of code byte ``j`` (sub-block ``2 (j // 32)``, value ``j % 32``),
  ``256 b + 128 + j`` its high nibbles (sub-block ``2 (j // 32) + 1``). Also per sub-block: ``a_s``
  and ``S_s = a_s sum xq``.
* **Weights** (:func:`_q4k_kernel`): a super-block's 128 code bytes of ``BLOCK_N`` rows load as one
  ``[BLOCK_N, 128]`` uint8 tile (16-byte loads, software-pipelined through shared memory by
  ``tl.dot``); the low-nibble plane is ``((c << 4) & 0xF0) ^ 0x80`` bytewise, the high one
  ``(c & 0xF0) ^ 0x80``: signed bytes ``16 (q - 8)``, two LOP3 and a shift per four bytes
  (:func:`_nibbles`). Two int8 dots give ``V [16, BLOCK_N]`` (int32, exact).
* **Scales**: for row ``n`` and sub-block ``s`` (``d``, ``dmin`` and the 6-bit ``sc``, ``m`` of the
  block header), ``sum_k x_k w_k = d sc_s (a_s (256 V_h + V_l) / 16 + 8 S_s) - dmin m_s S_s``: each
  accumulator row takes ``V`` times ``d sc_s a_s`` (x 16 or / 16) plus, on the ``h`` rows, the
  ``S_s`` term; the 16 rows are summed once, after the K loop.

Split-K slices meet in the launch (:mod:`.splitk`), the last program adding the residual or bias.
Both launches use programmatic dependent launch (:mod:`.pdl`): each starts while its predecessor
finishes and waits for it before touching memory; the GEMV, whose grid is larger than the SMs,
lets its successor launch only after its K loop, as the bf16 GEMV does.
Compiled for sm_90: about 2 SASS instructions a weight in the K loop, against ~6 on the CUDA-core
path; on an H100, 1.6-1.9x faster on the Llama-3-8B projections (docs/gguf-kernels.md).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_trigger, pdl_wait
from .splitk import arrive, depart, sum_partials

__all__ = ["MMA_QTYPES", "gguf_gemv_mma", "activation_planes", "pick_mma_config"]

_SUB = {"Q4_K": 32, "Q6_K": 16}  # inputs per sub-block (one scale); a step is 8 sub-blocks
MMA_QTYPES = tuple(_SUB)
_ROWS = 16                      # the dot's M: 8 sub-blocks x (high, low) byte
_CONFIG_KEYS = {"BLOCK_N", "SPLIT_K", "num_warps", "num_stages"}


@triton.jit
def _planes_kernel(x_ptr, a_ptr, xa_ptr, xs_ptr, K, SUB: tl.constexpr, USE_PDL: tl.constexpr):
    """Step ``program_id(0)`` (``8 SUB`` inputs: a Q4_K super-block, ``SUB`` 32, or half a Q6_K one,
    ``SUB`` 16) of the row ``x [K]``: its ``[16, 8 SUB]`` columns of the A operand, ``a_s`` and
    ``S_s`` of its 8 sub-blocks (module docstring). Q4_K's columns follow the code bytes' nibble
    planes, Q6_K's the inputs. Row ``r`` quantizes its own sub-block ``r % 8`` (rows ``r`` and
    ``r + 8`` compute the same ``xq``, keeping the high or low byte)."""
    pdl_wait(USE_PDL)
    STEP: tl.constexpr = 8 * SUB
    b = tl.program_id(0)
    r = tl.arange(0, 16)[:, None]
    c = tl.arange(0, STEP)[None, :]
    if SUB == 32:
        j = c % 128
        sub = 2 * (j // 32) + c // 128                                   # the column's sub-block
        idx = 32 * sub + j % 32
    else:
        sub = c // SUB
        idx = c
    x = tl.load(x_ptr + b * STEP + idx).to(tl.float32)                 # [1, STEP]
    own = sub == r % 8
    amax = tl.max(tl.where(own, tl.abs(x), 0.0), axis=1)                # [16]
    inv = tl.where(amax > 0, 32639.0 / tl.maximum(amax, 1e-30), 0.0)   # |xq| <= 32639: h fits a byte
    xq = tl.where(own, tl.floor(x * inv[:, None] + 0.5), 0.0).to(tl.int32)
    h = (xq + 128) >> 8                                                 # xq = 256 h + l, l in [-128, 127]
    tl.store(a_ptr + r * K + b * STEP + c, tl.where(r < 8, h, xq - 256 * h).to(tl.int8))
    rr = tl.arange(0, 16)
    a = amax / 32639.0
    tl.store(xa_ptr + b * 8 + rr, a, mask=rr < 8)
    tl.store(xs_ptr + b * 8 + rr, a * tl.sum(xq, axis=1).to(tl.float32), mask=rr < 8)


@triton.jit
def _nibbles(c, HIGH: tl.constexpr, EMULATE: tl.constexpr):
    """The low (or ``HIGH``) nibbles ``q`` of the code bytes ``c`` as int8 ``16 (q - 8)``: the nibble
    in the top half of the byte, its top bit flipped; four bytes per instruction (``EMULATE``: int32
    arithmetic, for the CPU interpreter, which runs no PTX)."""
    if EMULATE:
        q = (c.to(tl.int32) >> 4) & 15 if HIGH else c.to(tl.int32) & 15
        return ((q ^ 8) << 28 >> 24).to(tl.int8)
    if HIGH:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF0F0F0F0, 0x80808080, 0x6a;", "=r,r", [c],
                                         dtype=tl.int8, is_pure=True, pack=4)
    return tl.inline_asm_elementwise("{ .reg .b32 t; shl.b32 t, $1, 4; lop3.b32 $0, t, 0xF0F0F0F0, 0x80808080, 0x6a; }",
                                     "=r,r", [c], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _bytes(w, i):
    """``[BLOCK_N, 4]``: the bytes of the int32 words ``w [BLOCK_N]``."""
    return (w[:, None] >> (8 * i[None, :])) & 255


@triton.jit
def _rows16(f, BLOCK_N: tl.constexpr):
    """``f [BLOCK_N, 8]`` (per sub-block) as the accumulator's ``[16, BLOCK_N]``: row ``r`` holds ``f[:, r % 8]``."""
    t = tl.trans(f)
    return tl.reshape(tl.permute(tl.join(t, t), (2, 0, 1)), [16, BLOCK_N])


@triton.jit
def _finish(row, rn, pid_n, pid_s, add_ptr, out_ptr, part_ptr, lock_ptr, N, SPLIT_K, BLOCK_N: tl.constexpr,
            SPLIT: tl.constexpr, HAS_ADD: tl.constexpr):
    """The program's ``[BLOCK_N]`` sums: with ``SPLIT`` stored as its slice's partial, the last slice
    to arrive summing them in slice order (:mod:`.splitk`); then ``+ add`` and the store."""
    rt = tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 1)
    tile = tl.expand_dims(row, 1)
    if SPLIT:
        n_tiles = tl.num_programs(0)
        slab = part_ptr + rt
        tl.store(slab + (pid_s * n_tiles + pid_n).to(tl.int64) * BLOCK_N, row)
        last = arrive(lock_ptr, pid_n, SPLIT_K)
        if last:
            tile = sum_partials(slab, pid_n, n_tiles, SPLIT_K, BLOCK_N, 1, True, rm)
            depart(lock_ptr, pid_n)
    else:
        last = pid_s == 0
    if last:
        ok = (rn < N)[:, None] & (rm < 1)[None, :]
        if HAS_ADD:
            tile += tl.load(add_ptr + rn[:, None] + rm[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn[:, None] + rm[None, :], tile.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _q4k_kernel(
    a_ptr, xa_ptr, xs_ptr,   # activation planes [16, K] int8, a_s and S_s [K / 32] float32
    w_ptr,                   # [N, ROW_BYTES] uint8 Q4_K blocks
    add_ptr,                 # HAS_ADD: [N] residual row or bias, contiguous
    out_ptr,                 # [N] output row
    part_ptr, lock_ptr,      # SPLIT: [SPLIT_K, n_tiles, BLOCK_N] float32 partials, [n_tiles] counters
    N, K, ROW_BYTES, PER,    # sizes; PER super-blocks per K slice
    SPLIT_K,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_ADD: tl.constexpr, EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr, LATE_LAUNCH: tl.constexpr,   # (:mod:`.pdl`) the next kernel launches after the K loop
):
    """out[n] = sum_k x[k] dequant(w)[n, k] (+ add[n]) for ``BLOCK_N`` rows over super-blocks
    ``[pid_s PER, (pid_s + 1) PER)`` (module docstring); rows past ``N`` read row ``N - 1``
    (never stored), so the code loads carry no mask."""
    pdl_wait(USE_PDL, not LATE_LAUNCH)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * ROW_BYTES
    rj = tl.arange(0, 128)
    r = tl.arange(0, 16)
    i4 = tl.arange(0, 4)
    part_w = tl.where(r < 8, 16.0, 1.0 / 16.0)            # 256 / 16 on the high bytes' rows, 1 / 16 on the low
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    b_lo = pid_s * PER
    b_hi = tl.minimum(b_lo + PER, K // 256)
    for b in range(b_lo, b_hi):
        blk = rows + b * 144                               # d, dmin @0; scales[12] @4; qs[128] @16
        codes = tl.load(blk[:, None] + (16 + rj)[None, :])
        a_lo = tl.load(a_ptr + r[:, None] * K + (b * 256 + rj)[None, :])
        a_hi = tl.load(a_ptr + r[:, None] * K + (b * 256 + 128 + rj)[None, :])
        v = tl.dot(a_lo, tl.trans(_nibbles(codes, False, EMULATE)), out_dtype=tl.int32)
        v = tl.dot(a_hi, tl.trans(_nibbles(codes, True, EMULATE)), v, out_dtype=tl.int32)
        words = blk.to(tl.pointer_type(tl.int32))
        dd = tl.load(words)
        b0, b1, b2 = _bytes(tl.load(words + 1), i4), _bytes(tl.load(words + 2), i4), _bytes(tl.load(words + 3), i4)
        d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (dd >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        # 6-bit scale / min of sub-block s: s < 4 from bytes s / s + 4, s >= 4 split over bytes s + 4 and s - 4 / s
        sc = tl.reshape(tl.permute(tl.join(b0 & 63, (b2 & 15) | ((b0 >> 6) << 4)), (0, 2, 1)), [BLOCK_N, 8])
        mn = tl.reshape(tl.permute(tl.join(b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4)), (0, 2, 1)), [BLOCK_N, 8])
        f1 = d[:, None] * sc.to(tl.float32)
        f2 = 8.0 * f1 - dmin[:, None] * mn.to(tl.float32)
        xa = tl.load(xa_ptr + b * 8 + r % 8)
        xs = tl.where(r < 8, tl.load(xs_ptr + b * 8 + r % 8), 0.0)
        acc += v.to(tl.float32) * _rows16(f1, BLOCK_N) * (xa * part_w)[:, None] + _rows16(f2, BLOCK_N) * xs[:, None]
    if LATE_LAUNCH:
        pdl_trigger(USE_PDL)
    _finish(tl.sum(acc, axis=0), rn, pid_n, pid_s, add_ptr, out_ptr, part_ptr, lock_ptr, N, SPLIT_K, BLOCK_N,
            SPLIT, HAS_ADD)


@triton.jit
def _q6_plane(low, qh, QH_SHIFT: tl.constexpr, EMULATE: tl.constexpr):
    """Q6_K value plane ``i = 3 - QH_SHIFT / 2`` as int8 ``4 (q - 32)``, ``q = nibble | crumb << 4``: the
    low (planes 0, 1) or high (2, 3) nibble of the ``ql`` bytes ``low`` moved to bits 2..5, the crumb
    (bits ``2 i, 2 i + 1``) of the ``qh`` bytes moved to bits 6..7 (``qh << QH_SHIFT``), the top bit
    flipped; per four bytes two shifts and two LOP3 (``EMULATE``: int32 arithmetic)."""
    if EMULATE:
        lo = low.to(tl.int32)
        nib = (lo & 15) if QH_SHIFT >= 4 else (lo >> 4)
        crumb = (qh.to(tl.int32) >> (6 - QH_SHIFT)) & 3
        return (((nib | (crumb << 4)) << 26) >> 24 ^ -128).to(tl.int8)
    # per plane: the nibble to bits 2..5, the crumb to bits 6..7 (one literal each: jit code builds no strings)
    if QH_SHIFT == 6:
        return tl.inline_asm_elementwise("{ .reg .b32 a, c; shl.b32 a, $1, 2; shl.b32 c, $2, 6; lop3.b32 c, c, 0xC0C0C0C0, 0x80808080, 0x6a; "
               "lop3.b32 $0, a, 0x3C3C3C3C, c, 0xea; }", "=r,r,r", [low, qh],
            dtype=tl.int8, is_pure=True, pack=4)
    elif QH_SHIFT == 4:
        return tl.inline_asm_elementwise("{ .reg .b32 a, c; shl.b32 a, $1, 2; shl.b32 c, $2, 4; lop3.b32 c, c, 0xC0C0C0C0, 0x80808080, 0x6a; "
               "lop3.b32 $0, a, 0x3C3C3C3C, c, 0xea; }", "=r,r,r", [low, qh],
            dtype=tl.int8, is_pure=True, pack=4)
    elif QH_SHIFT == 2:
        return tl.inline_asm_elementwise("{ .reg .b32 a, c; shr.b32 a, $1, 2; shl.b32 c, $2, 2; lop3.b32 c, c, 0xC0C0C0C0, 0x80808080, 0x6a; "
               "lop3.b32 $0, a, 0x3C3C3C3C, c, 0xea; }", "=r,r,r", [low, qh],
            dtype=tl.int8, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise("{ .reg .b32 a, c; shr.b32 a, $1, 2; lop3.b32 c, $2, 0xC0C0C0C0, 0x80808080, 0x6a; "
               "lop3.b32 $0, a, 0x3C3C3C3C, c, 0xea; }", "=r,r,r", [low, qh],
            dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _q6k_kernel(
    a_ptr, xa_ptr,           # activation planes [16, K] int8 (inputs in order), a_s [K / 16] float32
    w_ptr,                   # [N, ROW_BYTES] uint8 Q6_K blocks
    add_ptr, out_ptr, part_ptr, lock_ptr,       # as _q4k_kernel
    N, K, ROW_BYTES, PER,    # sizes; PER half super-blocks per K slice
    SPLIT_K,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_ADD: tl.constexpr, EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr, LATE_LAUNCH: tl.constexpr,
):
    """out[n] = sum_k x[k] dequant(w)[n, k] (+ add[n]), a step being half a super-block (128 inputs,
    8 sub-blocks of 16). Q6_K (210 B: ``ql[128] @0, qh[64] @128, scales[16] int8 @192, d f16 @208``):
    in half ``hf`` input ``32 i + l`` (``i`` 0..3) has the low (``i`` 0, 1) or high (2, 3) nibble of
    ``ql[64 hf + 32 (i % 2) + l]`` and bits ``2 i, 2 i + 1`` of ``qh[32 hf + l]``; sub-block ``s`` has
    scale ``d * scales[8 hf + s]``, no minimum. Four int8 dots of 32 inputs, one per plane
    (:func:`_q6_plane`); ``sum_k x_k w_k = d sc_s a_s (256 V_h + V_l) / 4``. Blocks are 210 bytes,
    so an odd block's fields are only 2-byte aligned: its loads stay narrow."""
    pdl_wait(USE_PDL, not LATE_LAUNCH)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * ROW_BYTES
    l32 = tl.arange(0, 32)
    r = tl.arange(0, 16)
    s8 = tl.arange(0, 8)
    part_w = tl.where(r < 8, 64.0, 0.25)                  # 256 / 4 on the high bytes' rows, 1 / 4 on the low
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    t_lo = pid_s * PER
    t_hi = tl.minimum(t_lo + PER, K // 128)
    for t in range(t_lo, t_hi):
        hf = t % 2
        blk = rows + (t // 2) * 210
        ql_a = tl.load(blk[:, None] + (64 * hf + l32)[None, :])
        ql_b = tl.load(blk[:, None] + (64 * hf + 32 + l32)[None, :])
        qh = tl.load(blk[:, None] + (128 + 32 * hf + l32)[None, :])
        a_row = a_ptr + r[:, None] * K + (128 * t + l32)[None, :]
        v = tl.dot(tl.load(a_row), tl.trans(_q6_plane(ql_a, qh, 6, EMULATE)), out_dtype=tl.int32)
        v = tl.dot(tl.load(a_row + 32), tl.trans(_q6_plane(ql_b, qh, 4, EMULATE)), v, out_dtype=tl.int32)
        v = tl.dot(tl.load(a_row + 64), tl.trans(_q6_plane(ql_a, qh, 2, EMULATE)), v, out_dtype=tl.int32)
        v = tl.dot(tl.load(a_row + 96), tl.trans(_q6_plane(ql_b, qh, 0, EMULATE)), v, out_dtype=tl.int32)
        sc = tl.load(blk[:, None] + (192 + 8 * hf + s8)[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
        d = tl.load((blk + 208).to(tl.pointer_type(tl.int16))).to(tl.float16, bitcast=True).to(tl.float32)
        xa = tl.load(xa_ptr + t * 8 + r % 8)
        acc += v.to(tl.float32) * _rows16(d[:, None] * sc, BLOCK_N) * (xa * part_w)[:, None]
    if LATE_LAUNCH:
        pdl_trigger(USE_PDL)
    _finish(tl.sum(acc, axis=0), rn, pid_n, pid_s, add_ptr, out_ptr, part_ptr, lock_ptr, N, SPLIT_K, BLOCK_N,
            SPLIT, HAS_ADD)


def activation_planes(x: torch.Tensor, qtype: str, planes: tuple[torch.Tensor, ...] | None = None):
    """The A operand ``[16, K]`` int8 and per-sub-block ``a_s``, ``S_s`` (float32, ``[K / 16]``, the
    first ``K / sub-block`` used) of the row ``x [K]`` for ``qtype``'s kernel (module docstring),
    written into ``planes`` when given (a workspace's buffers)."""
    k = x.numel()
    if planes is None:
        planes = (torch.empty(_ROWS, k, dtype=torch.int8, device=x.device),
                  torch.empty(k // 16, dtype=torch.float32, device=x.device),
                  torch.empty(k // 16, dtype=torch.float32, device=x.device))
    sub = _SUB[qtype]
    _planes_kernel[(k // (8 * sub),)](x, *planes, k, SUB=sub, **pdl_launch(x.device))
    return planes


def pick_mma_config(n: int, k: int, qtype: str, sms: int) -> dict:
    """Launch of :func:`gguf_gemv_mma`. H100 sweep of the Q4_K kernel (``BLOCK_N`` 64/128, 4/8 warps,
    2-4 stages, split 1-8) at the 8B shapes: 64 rows, 4 warps, 3 stages everywhere; the best splits
    (o 4, qkv 4, gate 2, down 8) are those that bring the grid to about two programs per SM: K is
    split in two while the grid has fewer and each slice keeps at least 3 steps (o: 4 slices of 4
    took 7.7 µs, 8 of 2 7.9). Q6_K (steps of half a super-block) takes the same rule."""
    tiles, steps, split = triton.cdiv(n, 64), k // (8 * _SUB[qtype]), 1
    while tiles * split < 2 * sms and steps // (split * 2) >= 3:
        split *= 2
    return dict(BLOCK_N=64, SPLIT_K=split, num_warps=4, num_stages=3)


def gguf_gemv_mma(x: torch.Tensor, data: torch.Tensor, qtype: str, add: torch.Tensor | None, out: torch.Tensor,
                  workspace, config: dict | None, sms: int) -> torch.Tensor:
    """``out [1, N] = x [1, K] @ dequant(data).T (+ add)`` on the tensor cores (``qtype`` in
    :data:`MMA_QTYPES`, x fp16/bf16); the operands were checked by :func:`.gguf_linear.gguf_gemv`,
    which calls this. ``workspace``: a :class:`~.gemv.GemvWorkspace` (planes, split-K partials)."""
    from .gemv import GemvWorkspace
    n, k = data.shape[0], x.shape[1]
    cfg = dict(config or pick_mma_config(n, k, qtype, sms))
    block_n, split = cfg.pop("BLOCK_N"), cfg.pop("SPLIT_K")
    steps = k // (8 * _SUB[qtype])
    per = triton.cdiv(steps, max(1, min(split, steps)))
    split = triton.cdiv(steps, per)                        # no empty slices
    ws = workspace or GemvWorkspace()
    a, xa, xs = activation_planes(x[0], qtype, ws.planes(x.device, k))
    n_tiles = triton.cdiv(n, block_n)
    part, lock = ws.get(x.device, n_tiles, split, block_n) if split > 1 else (out, out)
    rest = (data, add if add is not None else out, out, part, lock, n, k, data.shape[1], per, split)
    keys = dict(BLOCK_N=block_n, SPLIT=split > 1, HAS_ADD=add is not None,
                EMULATE=os.environ.get("TRITON_INTERPRET") == "1", LATE_LAUNCH=n_tiles * split > sms,
                **pdl_launch(x.device), **cfg)
    if qtype == "Q4_K":
        _q4k_kernel[(n_tiles, split)](a, xa, xs, *rest, **keys)
    else:
        _q6k_kernel[(n_tiles, split)](a, xa, *rest, **keys)
    return out
