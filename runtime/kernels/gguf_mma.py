"""One-row GGUF GEMV on the int8 tensor cores: ``out = x @ dequant(W).T (+ add)`` for Q4_K, ``x [1, K]``.

The CUDA-core one-row path (:func:`.gguf_tiles.row_dot`) spends about six instructions a weight on
nibble extraction, int->float tricks and FMAs, so it is bound by instruction issue, not bytes
(docs/gguf-kernels.md). Here the arithmetic goes to ``mma.sync`` (``tl.dot`` of int8 tiles) and the
per-weight work is three bit operations per eight weights:

* **Activations** (:func:`_planes_kernel`, one small launch per GEMV, unless the kernel before made
  them: :func:`norm_planes`, or a SwiGLU GEMV's epilogue, ``planes_out``): per sub-block ``s`` of 32
  inputs, 16-bit fixed point ``xq = round(x / a_s)``, ``a_s = max|x_s| / 32639``, split into a signed
  high and low byte, ``xq = 256 h + l`` (error at most ``a_s / 2`` an input: 2^-16 of the sub-block's
  largest, below the 16-bit activations' own rounding). They are written as the dot's A operand
  ``[16, K]`` int8, block diagonal: row ``r = 8 p + s`` holds the ``h`` (``p = 0``) or ``l``
  (``p = 1``) bytes of sub-block ``s`` and zeros elsewhere, so each of the 16 rows of the ``[16,
  BLOCK_N]`` product is one sub-block's partial. Within super-block ``b`` columns ``256 b + j``,
  ``j < 128``, face the low nibbles of code byte ``j`` (sub-block ``2 (j // 32)``, value ``j % 32``),
  ``256 b + 128 + j`` its high nibbles (sub-block ``2 (j // 32) + 1``). Also per sub-block: ``a_s``
  and ``S_s = a_s sum xq``; a sub-block holding a NaN or an infinity gets ``a_s`` NaN, so every
  output is NaN (as a float dot would give NaN or infinities), never a silent finite value.
* **Weights** (:func:`_q4k_kernel`): a super-block's 128 code bytes of ``BLOCK_N`` rows load as one
  ``[BLOCK_N, 128]`` uint8 tile (16-byte loads, software-pipelined through shared memory by
  ``tl.dot``); the low-nibble plane is ``((c << 4) & 0xF0) ^ 0x80`` bytewise, the high one
  ``(c & 0xF0) ^ 0x80``: signed bytes ``16 (q - 8)``, two LOP3 and a shift per four bytes
  (:func:`_nibbles`). Two int8 dots give ``V [16, BLOCK_N]`` (int32, exact).
* **Scales**: for row ``n`` and sub-block ``s`` (``d``, ``dmin`` and the 6-bit ``sc``, ``m`` of the
  block header), ``sum_k x_k w_k = d sc_s (a_s (256 V_h + V_l) / 16 + 8 S_s) - dmin m_s S_s``: each
  sub-block's two rows of ``V`` (``h`` and ``l``, in the same thread of an ``mma`` tile) are joined
  as ``256 V_h + V_l`` in int32 (below 2^27: exact), so the accumulator keeps one float row a
  sub-block, ``[8, BLOCK_N]``, which takes that times ``d sc_s a_s / 16`` plus the ``S_s`` term;
  the 8 rows are summed once, after the K loop (``_PAIR``; H200, decode_ab two builds: 8B Q4_K_M
  2469 -> 2448 µs).

Split-K slices meet in the launch (:mod:`.splitk`), the last program adding the residual or bias.
Both launches use programmatic dependent launch (:mod:`.pdl`): each starts while its predecessor
finishes and waits for it before touching memory; the GEMV, whose grid is larger than the SMs,
lets its successor launch only after its K loop, as the bf16 GEMV does.
Compiled for sm_90: about 2 SASS instructions a weight in the K loop, against ~6 on the CUDA-core
path; on an H100 1.2-1.6x faster on the Llama-3-8B projections, the activation launch included
(docs/gguf-kernels.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError
from graphdsl.quant import code_rows

from ..device import triton_interprets
from .gemv import rin_tile, rms_factor
from .gguf_tiles import layout_args
from .pdl import pdl_launch, pdl_trigger, pdl_wait, prefetch_l2
from .splitk import meet_rows

__all__ = ["MMA_QTYPES", "MMA_MIN_ROWS", "gguf_gemv_mma", "activation_planes", "empty_planes", "norm_planes",
           "pick_mma_config", "split_for", "swiglu_planes_possible", "sub_blocks_planes"]

MMA_QTYPES = ("Q4_K",)
MMA_MIN_ROWS = 2048             # fewer weight rows stay on the CUDA cores by default (gguf_linear.mma_eligible)
_SUPER = 256                    # values per super-block
_ROWS = 16                      # the dot's M: 8 sub-blocks x (high, low) byte
_CONFIG_KEYS = {"BLOCK_N", "SPLIT_K", "num_warps", "num_stages"}
# 128-byte lines of each row's first super-block asked of L2 before the PDL wait (pdl.prefetch_l2;
# a super-block is 144 bytes), while the activation-planes launch before it runs; 0: none
_PREFETCH_LINES = 2
_BLOCK_N = 64                   # weight rows a tile (pick_mma_config)
_STAGES = 3                     # pipeline stages of the K loop (pick_mma_config)
_PROGRAMS_PER_SM = 2            # K is split until the grid has this many programs a SM (split_for) ...
_MIN_SLICE = 1                  # ... while each slice keeps at least this many super-blocks (H200, decode_ab two
                                # builds: 3 -> 2, 8B Q4_K_M 2508 -> 2487 µs, its o split 4 -> 8, 1B 762 -> 738;
                                # 2 -> 1, the 1B's o and qkv split 8: 1B 729 -> 725, no 8B grid changes)
# each K step's header words and activation scales loaded a step ahead: Triton pipelines only the
# loads feeding the dots (codes, A operand), so these waited on L2 every step (H200, 8B Q4_K_M
# decode_ab, two builds: 2734 -> 2714 µs; the same for the Q6_K GEMV's scales gained nothing, 2709)
_AHEAD = True
# the accumulator keeps one row per sub-block: the high and low bytes' int32 sums joined as
# 256 V_h + V_l before the float scales (half the float work a step), instead of 16 rows
_PAIR = True
_NORM_EARLY = True              # norm_planes: the weight read before the PDL wait, own inputs with the row


@triton.jit
def _planes_kernel(x_ptr, a_ptr, xa_ptr, xs_ptr, K, USE_PDL: tl.constexpr):
    """Super-block ``program_id(0)`` of the row ``x [K]``: its ``[16, 256]`` columns of the A operand,
    ``a_s`` and ``S_s`` of its 8 sub-blocks (module docstring). Row ``r`` quantizes its own sub-block
    ``r % 8`` (rows ``r`` and ``r + 8`` compute the same ``xq``, keeping the high or low byte)."""
    pdl_wait(USE_PDL)
    b = tl.program_id(0)
    x = tl.load(x_ptr + _column_inputs(b)).to(tl.float32)               # [1, 256]
    _write_planes(x, b, a_ptr, xa_ptr, xs_ptr, K)


@triton.jit
def _column_inputs(b):
    """``[1, 256]``: the input index of each column of super-block ``b``'s A operand (module docstring)."""
    c = tl.arange(0, 256)[None, :]
    j = c % 128
    return b * 256 + 32 * (2 * (j // 32) + c // 128) + j % 32


@triton.jit
def _write_planes(x, b, a_ptr, xa_ptr, xs_ptr, K):
    """Store super-block ``b``'s ``[16, 256]`` A columns, ``a_s`` and ``S_s`` of its 8 sub-blocks
    from its inputs ``x [1, 256]`` (float32, in column order: :func:`_column_inputs`)."""
    r = tl.arange(0, 16)[:, None]
    c = tl.arange(0, 256)[None, :]
    j = c % 128
    sub = 2 * (j // 32) + c // 128                                       # the column's sub-block
    own = sub == r % 8
    amax = tl.max(tl.where(own, tl.abs(x), 0.0), axis=1)                # [16]
    inv = tl.where(amax > 0, 32639.0 / tl.maximum(amax, 1e-30), 0.0)   # |xq| <= 32639: h fits a byte
    xq = tl.where(own, tl.floor(x * inv[:, None] + 0.5), 0.0).to(tl.int32)
    h = (xq + 128) >> 8                                                 # xq = 256 h + l, l in [-128, 127]
    tl.store(a_ptr + r * K + b * 256 + c, tl.where(r < 8, h, xq - 256 * h).to(tl.int8))
    rr = tl.arange(0, 16)
    a = amax / 32639.0 + tl.sum(tl.where(own, x - x, 0.0), axis=1)      # NaN if the sub-block has a NaN or inf
    tl.store(xa_ptr + b * 8 + rr, a, mask=rr < 8)
    tl.store(xs_ptr + b * 8 + rr, a * tl.sum(xq, axis=1).to(tl.float32), mask=rr < 8)


@triton.jit
def _sub_block_planes(y, sub, a_ptr, xa_ptr, xs_ptr, K):
    """Sub-block ``sub`` of a row's A operand (module docstring) from its 32 inputs ``y [32]``
    (float32, in input order): :func:`sub_blocks_planes` of one sub-block."""
    sub_blocks_planes(tl.reshape(y, [1, 32]), sub, tl.full([1], 1, tl.int1), a_ptr, xa_ptr, xs_ptr, K)


@triton.jit
def sub_blocks_planes(y, sub0, ok, a_ptr, xa_ptr, xs_ptr, K):
    """Sub-blocks ``sub0 + i`` (``ok[i]``) of a row's A operand (module docstring) from their inputs
    ``y [S, 32]`` (float32, row ``i`` the 32 inputs of sub-block ``sub0 + i`` in input order): their
    32 columns of all 16 rows (the high / low bytes on rows ``sub % 8`` / ``8 + sub % 8``, zeros on
    the others), ``a_s`` and ``S_s`` — what :func:`_write_planes` stores for these inputs."""
    S: tl.constexpr = y.shape[0]
    sub = sub0 + tl.arange(0, S)
    s = sub % 8
    first = (sub // 8) * 256 + (s // 2) * 32 + (s % 2) * 128          # _column_inputs, inverted
    col = first[:, None] + tl.arange(0, 32)[None, :]
    amax = tl.max(tl.abs(y), axis=1)
    inv = tl.where(amax > 0, 32639.0 / tl.maximum(amax, 1e-30), 0.0)
    xq = tl.floor(y * inv[:, None] + 0.5).to(tl.int32)
    h = (xq + 128) >> 8
    r = tl.arange(0, 16)[None, :, None]
    own = s[:, None, None]
    val = tl.where(r == own, h[:, None, :], tl.where(r == own + 8, (xq - 256 * h)[:, None, :], 0))
    tl.store(a_ptr + r * K + col[:, None, :], val.to(tl.int8), mask=ok[:, None, None])
    a = amax / 32639.0 + tl.sum(y - y, axis=1)                          # NaN if an input is not finite
    tl.store(xa_ptr + sub, a, mask=ok)
    tl.store(xs_ptr + sub, a * tl.sum(xq, axis=1).to(tl.float32), mask=ok)


@triton.jit
def _q6k_columns_planes(y, j, a_ptr, xa_ptr, K):
    """Inputs ``[32 j, 32 j + 32)`` of a row's A operand in the Q6_K GEMV's format
    (:func:`.gguf_mma_q6k._planes_kernel`: columns in input order, 16-input sub-blocks) from their
    values ``y [32]`` (float32): their 32 columns of all 16 rows and the two sub-blocks' ``a_s`` —
    what that launch stores for these inputs."""
    ys = tl.reshape(y, [2, 16])
    amax = tl.max(tl.abs(ys), axis=1)
    inv = tl.where(amax > 0, 32639.0 / tl.maximum(amax, 1e-30), 0.0)
    xq = tl.reshape(tl.floor(ys * inv[:, None] + 0.5).to(tl.int32), [1, 32])
    hi = (xq + 128) >> 8
    r = tl.arange(0, 16)[:, None]
    c = tl.arange(0, 32)[None, :]
    own = ((32 * j) % 128 + c) // 16 == r % 8
    tl.store(a_ptr + r * K + 32 * j + c, tl.where(own, tl.where(r < 8, hi, xq - 256 * hi), 0).to(tl.int8))
    tl.store(xa_ptr + 2 * j + tl.arange(0, 2), amax / 32639.0 + tl.sum(ys - ys, axis=1))


@triton.jit
def _norm_planes_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, a_ptr, xa_ptr, xs_ptr, K, eps,
                        BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr = True):
    """``add_rms_norm`` of one row and the A operand of its normed values, in one launch: program
    ``b`` reads the whole row ``s = x + residual`` (rounded to its dtype) for ``r = rsqrt(mean(s²) +
    eps)``, stores super-block ``b``'s ``s`` and ``normed = w · (s · r)`` (each rounded as the
    generated kernel rounds them) and that super-block's planes (:func:`_write_planes`). With
    ``EARLY`` the norm weight is read before the PDL wait (no kernel of a step writes it) and the
    super-block's own inputs with the whole row, so the loads after the wait make one round trip."""
    b = tl.program_id(0)
    cols = _column_inputs(b)
    if EARLY:
        wv = tl.load(w_ptr + cols).to(tl.float32)
    pdl_wait(USE_PDL)
    dt = out_ptr.dtype.element_ty
    k = tl.arange(0, BLOCK_K)
    ok = k < K
    if EARLY:
        s = (tl.load(x_ptr + cols).to(tl.float32) + tl.load(res_ptr + cols).to(tl.float32)).to(dt)
    s_all = (tl.load(x_ptr + k, mask=ok, other=0.0).to(tl.float32)
             + tl.load(res_ptr + k, mask=ok, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    r = tl.rsqrt(tl.sum(s_all * s_all, axis=0) / K + eps)
    if not EARLY:
        s = (tl.load(x_ptr + cols).to(tl.float32) + tl.load(res_ptr + cols).to(tl.float32)).to(dt)
        wv = tl.load(w_ptr + cols).to(tl.float32)
    normed = (wv * (s.to(tl.float32) * r).to(dt).to(tl.float32)).to(dt)
    tl.store(sum_ptr + cols, s)
    tl.store(out_ptr + cols, normed)
    _write_planes(normed.to(tl.float32), b, a_ptr, xa_ptr, xs_ptr, K)


# _nibbles' PTX, low then high nibbles: the nibble into the byte's top half, its top bit flipped ((t & 0xF0) ^ 0x80)
_NIBBLES_ASM = tl.constexpr(("{ .reg .b32 t; shl.b32 t, $1, 4; lop3.b32 $0, t, 0xF0F0F0F0, 0x80808080, 0x6a; }",
                             "lop3.b32 $0, $1, 0xF0F0F0F0, 0x80808080, 0x6a;"))


@triton.jit
def _nibbles(c, HIGH: tl.constexpr, EMULATE: tl.constexpr):
    """The low (or ``HIGH``) nibbles ``q`` of the code bytes ``c`` as int8 ``16 (q - 8)``: the nibble
    in the top half of the byte, its top bit flipped; four bytes per instruction (``EMULATE``: int32
    arithmetic, for the CPU interpreter, which runs no PTX; ``tests/kernels/test_packed_ptx.py``
    runs the PTX through an interpreter against it)."""
    if EMULATE:
        q = (c.to(tl.int32) >> 4) & 15 if HIGH else c.to(tl.int32) & 15
        return ((q ^ 8) << 28 >> 24).to(tl.int8)
    return tl.inline_asm_elementwise(_NIBBLES_ASM[HIGH], "=r,r", [c], dtype=tl.int8, is_pure=True, pack=4)


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
def _pair_rows(v, BLOCK_N: tl.constexpr):
    """``(v[0:8], v[8:16])`` of an accumulator-layout ``v [16, BLOCK_N]``: rows ``s`` and ``8 + s`` of
    an ``mma`` tile sit in the same thread, so this moves no data."""
    return tl.split(tl.permute(tl.reshape(v, [2, 8, BLOCK_N]), (1, 2, 0)))


@triton.jit
def _q4k_kernel(
    a_ptr, xa_ptr, xs_ptr,   # activation planes [16, K] int8, a_s and S_s [K / 32] float32
    w_ptr,                   # uint8 Q4_K blocks: rows [N, ROW_BYTES], or block-major [K / 256, N, 144] (KB)
    add_ptr,                 # HAS_ADD: [N] residual row or bias, contiguous
    out_ptr,                 # [N] output row
    part_ptr, lock_ptr,      # SPLIT: [SPLIT_K, n_tiles, BLOCK_N] float32 partials, [n_tiles] counters
    N, K, ROW_BYTES, PER,    # sizes (N: output columns); PER super-blocks per K slice
    SPLIT_K,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_ADD: tl.constexpr, EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr, LATE_LAUNCH: tl.constexpr,   # (:mod:`.pdl`) the next kernel launches after the K loop
    SWIGLU: tl.constexpr = False,   # w is [2N, K] = [gate | up]; out = silu(x @ gate.T) * (x @ up.T)
    PREFETCH: tl.constexpr = 0,     # 128-byte lines a row asked of L2 before the PDL wait (pdl.prefetch_l2)
    pa_ptr=None, pxa_ptr=None, pxs_ptr=None,   # PLANES: out's own A operand [16, N], a_s, S_s [N / 32]
    PLANES: tl.constexpr = False,   # SWIGLU with 32 outputs a tile: also write out's A operand (_sub_block_planes)
    PLANES_Q6K: tl.constexpr = False,   # ... in the Q6_K GEMV's format instead (gguf_mma_q6k; pxs_ptr unused)
    KB: tl.constexpr = False, BYTES: tl.constexpr = 144, KB_STRIDE=0,   # block-major (gguf_tiles.layout_args)
    AHEAD: tl.constexpr = False,    # load each step's headers and activation scales a step ahead (_head)
    PAIR: tl.constexpr = False,     # each sub-block's high and low rows joined in int32 before the scales (_PAIR)
    rin_ptr=None, RIN_CHUNKS=1, rin_inv_n=1.0, rin_eps=0.0,   # RMS_IN: the producer's Σy² partials, 1 / K, eps
    RMS_IN: tl.constexpr = False, RIN_BLOCK: tl.constexpr = 1,   # the sums times the carried norm's factor (GemvRmsIn)
    g_ptr=None, scaled_ptr=None, rpart_ptr=None,   # RMS_OUT: norm weight [N], y · weight [N], Σy² [N / 32]
    RMS_OUT: tl.constexpr = False,  # also the next norm's operands (_carry_norm; GemvRmsOut; PLANES: its A operand)
):
    """out[n] = sum_k x[k] dequant(w)[n, k] (+ add[n]) for ``BLOCK_N`` rows over super-blocks
    ``[pid_s PER, (pid_s + 1) PER)`` (module docstring); rows past ``N`` read row ``N - 1``
    (never stored), so the code loads carry no mask. With ``SWIGLU`` tile rows ``2 i, 2 i + 1`` are
    the gate and up rows of output column ``pid_n BLOCK_N / 2 + i`` (as the bf16 GEMV's epilogue)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    if SWIGLU:
        rt = tl.arange(0, BLOCK_N)
        rn = tl.minimum(pid_n * (BLOCK_N // 2) + rt // 2, N - 1) + (rt % 2) * N
    else:
        rn = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    rows = w_ptr + rn.to(tl.int64) * ROW_BYTES
    BS = KB_STRIDE if KB else BYTES                        # bytes between a row's super-blocks
    if PREFETCH > 0 and USE_PDL:         # the slice's first code lines into L2 while the planes launch runs
        end = pid_s * PER * BS + BYTES if KB else tl.minimum(pid_s * PER + PER, K // 256) * BYTES
        prefetch_l2(rows[:, None], pid_s * PER * BS, end, PREFETCH, 128)
    g = _norm_weight(g_ptr, pid_n, N, BLOCK_N, RMS_OUT)
    pdl_wait(USE_PDL, not LATE_LAUNCH)
    rs = _rms_in_factor(rin_ptr, RIN_CHUNKS, rin_inv_n, rin_eps, RMS_IN, RIN_BLOCK)
    b_lo = pid_s * PER
    sums = q4k_sums(rows, BS, b_lo, tl.minimum(b_lo + PER, K // 256), a_ptr, xa_ptr, xs_ptr, K, BLOCK_N, EMULATE,
                    AHEAD, PAIR)
    if LATE_LAUNCH:
        pdl_trigger(USE_PDL)
    _finish(sums, pid_n, pid_s, add_ptr, out_ptr, part_ptr, lock_ptr, N, SPLIT_K, BLOCK_N, SPLIT,
            HAS_ADD, SWIGLU, pa_ptr, pxa_ptr, pxs_ptr, PLANES, PLANES_Q6K, rs, RMS_IN, g, scaled_ptr, rpart_ptr,
            RMS_OUT)


@triton.jit
def q4k_sums(rows, BS, b_lo, b_hi, a_ptr, xa_ptr, xs_ptr, K, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr,
             AHEAD: tl.constexpr, PAIR: tl.constexpr):
    """``[BLOCK_N]`` float32: ``Σ_k x[k] dequant(W)[n, k]`` over super-blocks ``[b_lo, b_hi)`` of the Q4_K
    rows ``rows`` (``BLOCK_N`` row pointers, ``BS`` bytes between a row's super-blocks) against the A
    operand ``a_ptr [16, K]`` and its ``a_s``, ``S_s`` (module docstring) — :func:`_q4k_kernel`'s K
    loop, shared with the MoE experts' (:mod:`.moe_gguf_mma`)."""
    rj = tl.arange(0, 128)
    r = tl.arange(0, 16)
    i4 = tl.arange(0, 4)
    part_w = tl.where(r < 8, 16.0, 1.0 / 16.0)            # 256 / 16 on the high bytes' rows, 1 / 16 on the low
    if PAIR:
        arow = tl.arange(0, 8)                             # the accumulator's rows: one a sub-block
        acc = tl.zeros([8, BLOCK_N], tl.float32)
    else:
        arow = r
        acc = tl.zeros([16, BLOCK_N], tl.float32)
    if AHEAD:
        n0, n1, n2, n3, nxa, nxs = _head(rows, b_lo, BS, xa_ptr, xs_ptr, arow)
    for b in range(b_lo, b_hi):
        blk = rows + b * BS                                # d, dmin @0; scales[12] @4; qs[128] @16
        codes = tl.load(blk[:, None] + (16 + rj)[None, :])
        a_lo = tl.load(a_ptr + r[:, None] * K + (b * 256 + rj)[None, :])
        a_hi = tl.load(a_ptr + r[:, None] * K + (b * 256 + 128 + rj)[None, :])
        v = tl.dot(a_lo, tl.trans(_nibbles(codes, False, EMULATE)), out_dtype=tl.int32)
        v = tl.dot(a_hi, tl.trans(_nibbles(codes, True, EMULATE)), v, out_dtype=tl.int32)
        if AHEAD:                                          # this step's, loaded last step; then the next step's
            dd, w1, w2, w3, xa, xs = n0, n1, n2, n3, nxa, nxs
            n0, n1, n2, n3, nxa, nxs = _head(rows, tl.minimum(b + 1, b_hi - 1), BS, xa_ptr, xs_ptr, arow)
        else:
            dd, w1, w2, w3, xa, xs = _head(rows, b, BS, xa_ptr, xs_ptr, arow)
        b0, b1, b2 = _bytes(w1, i4), _bytes(w2, i4), _bytes(w3, i4)
        d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (dd >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        # 6-bit scale / min of sub-block s: s < 4 from bytes s / s + 4, s >= 4 split over bytes s + 4 and s - 4 / s
        # (gguf_tiles._k_scales_mins unpacks the same from byte loads; here the header's four int32 words)
        sc = tl.reshape(tl.permute(tl.join(b0 & 63, (b2 & 15) | ((b0 >> 6) << 4)), (0, 2, 1)), [BLOCK_N, 8])
        mn = tl.reshape(tl.permute(tl.join(b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4)), (0, 2, 1)), [BLOCK_N, 8])
        f1 = d[:, None] * sc.to(tl.float32)
        f2 = 8.0 * f1 - dmin[:, None] * mn.to(tl.float32)
        if PAIR:                                           # |256 V_h + V_l| < 2^27: exact in int32
            vh, vl = _pair_rows(v, BLOCK_N)
            acc += ((vh * 256 + vl).to(tl.float32) * tl.trans(f1) * (xa * (1.0 / 16.0))[:, None]
                    + tl.trans(f2) * xs[:, None])
        else:
            xs = tl.where(r < 8, xs, 0.0)
            acc += v.to(tl.float32) * _rows16(f1, BLOCK_N) * (xa * part_w)[:, None] + _rows16(f2, BLOCK_N) * xs[:, None]
    return tl.sum(acc, axis=0)


@triton.jit
def _head(rows, b, BS, xa_ptr, xs_ptr, r):
    """Super-block ``b``'s header words of each row (``d, dmin``; ``scales[12]`` as three words) and
    its activation scales ``a_s``, ``S_s`` on the 16 rows of the A operand (:func:`_q4k_kernel`)."""
    words = (rows + b * BS).to(tl.pointer_type(tl.int32))
    return (tl.load(words), tl.load(words + 1), tl.load(words + 2), tl.load(words + 3),
            tl.load(xa_ptr + b * 8 + r % 8), tl.load(xs_ptr + b * 8 + r % 8))


@triton.jit
def _norm_weight(g_ptr, pid_n, N, BLOCK_N: tl.constexpr, RMS_OUT: tl.constexpr):
    """With ``RMS_OUT`` the norm weight of the tile's ``BLOCK_N`` output columns (read before the
    PDL wait: no kernel of a step writes it), else 0."""
    if RMS_OUT:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        g = tl.load(g_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    else:
        g = 0.0
    return g


@triton.jit
def _rms_in_factor(rin_ptr, RIN_CHUNKS, rin_inv_n, rin_eps, RMS_IN: tl.constexpr, RIN_BLOCK: tl.constexpr):
    """With ``RMS_IN`` the carried norm's row factor ``rsqrt(Σ_j part[j] / n + eps)`` as a ``[1]``
    tensor (:class:`~.gemv.GemvRmsIn`, as the bf16 GEMV computes it), else 1. Read right after the
    PDL wait by every program, so its latency hides behind the K loop."""
    if RMS_IN:
        rm = tl.arange(0, 1)
        rs = rms_factor(rin_tile(rin_ptr, rm, rm < 1, RIN_CHUNKS, RIN_BLOCK), rin_inv_n, rin_eps)
    else:
        rs = 1.0
    return rs


@triton.jit
def _carry_norm(y, g, pid_n, N, scaled_ptr, rpart_ptr, pa_ptr, pxa_ptr, pxs_ptr, BLOCK_N: tl.constexpr,
                PLANES: tl.constexpr, dt: tl.constexpr):
    """A producer's share of the next RMSNorm (:class:`~.gemv.GemvRmsOut`) for its tile's sums ``y
    [BLOCK_N]`` (the residual added): ``ŷ · g`` rounded (``ŷ``: y rounded to ``dt``), the sums of
    ``ŷ²`` over each 32 columns, and with ``PLANES`` the Q4_K A operand of ``ŷ · g``, one sub-block
    per 32 columns (:func:`sub_blocks_planes`; N a multiple of 256). The consumers multiply their
    sums by the row's factor ``r``: the operand of ``ŷ · g · r`` is this one with ``a_s`` scaled by ``r``."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    yr = tl.where(ok, y.to(dt).to(tl.float32), 0.0)
    scaled = (yr * g).to(dt)
    tl.store(scaled_ptr + cols, scaled, mask=ok)
    CH: tl.constexpr = BLOCK_N // 32
    ch = pid_n * CH + tl.arange(0, CH)
    tl.store(rpart_ptr + ch, tl.sum(tl.reshape(yr * yr, [CH, 32]), axis=1), mask=ch * 32 < N)
    if PLANES:
        sub_blocks_planes(tl.reshape(scaled.to(tl.float32), [CH, 32]), pid_n * CH, ch * 32 < N, pa_ptr, pxa_ptr,
                          pxs_ptr, N)


@triton.jit
def _finish(row, pid_n, pid_s, add_ptr, out_ptr, part_ptr, lock_ptr, N, SPLIT_K, BLOCK_N: tl.constexpr,
            SPLIT: tl.constexpr, HAS_ADD: tl.constexpr, SWIGLU: tl.constexpr, pa_ptr, pxa_ptr, pxs_ptr,
            PLANES: tl.constexpr, PLANES_Q6K: tl.constexpr = False, rs=1.0, RMS_IN: tl.constexpr = False, g=0.0,
            scaled_ptr=None, rpart_ptr=None, RMS_OUT: tl.constexpr = False):
    """The program's ``[BLOCK_N]`` row sums: with ``SPLIT`` stored as its slice's partial, the last
    slice to arrive summing them in slice order (:mod:`.splitk`); with ``RMS_IN`` times the carried
    norm's factor ``rs``; then ``+ add`` or, with ``SWIGLU``, ``silu(g) * u`` of each (gate, up)
    row pair, g and u rounded to the output dtype first and ``silu(g)`` after, as the matmul and
    ``silu_mul`` kernels it replaces round them; the store. ``PLANES`` with ``SWIGLU``: the output's
    own A operand too; ``RMS_OUT`` (no ``SWIGLU``): the next norm's operands (:func:`_carry_norm`,
    with ``PLANES`` theirs)."""
    tile, last = meet_rows(row, part_ptr, lock_ptr, pid_n, pid_s, SPLIT_K, BLOCK_N, SPLIT)
    if last:
        dt = out_ptr.dtype.element_ty
        if RMS_IN:
            tile = tile * rs
        if SWIGLU:
            HALF: tl.constexpr = BLOCK_N // 2
            gate, up = tl.split(tl.reshape(tl.sum(tile, axis=1), [HALF, 2]))
            gate = gate.to(dt).to(tl.float32)
            y = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)
            cols = pid_n * HALF + tl.arange(0, HALF)
            tl.store(out_ptr + cols, y.to(dt), mask=cols < N)
            if PLANES:                 # HALF = 32: the tile's outputs are sub-block pid_n of the row
                if PLANES_Q6K:
                    _q6k_columns_planes(y.to(dt).to(tl.float32), pid_n, pa_ptr, pxa_ptr, N)
                else:
                    _sub_block_planes(y.to(dt).to(tl.float32), pid_n, pa_ptr, pxa_ptr, pxs_ptr, N)
        else:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            y = tl.sum(tile, axis=1)
            if HAS_ADD:
                y += tl.load(add_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            tl.store(out_ptr + cols, y.to(dt), mask=cols < N)
            if RMS_OUT:
                _carry_norm(y, g, pid_n, N, scaled_ptr, rpart_ptr, pa_ptr, pxa_ptr, pxs_ptr, BLOCK_N, PLANES, dt)


def empty_planes(k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised buffers for the A operand of a row of ``k`` inputs: ``[16, k]`` int8, ``a_s`` and
    ``S_s`` ``[k / 32]`` float32 (module docstring)."""
    return (torch.empty(_ROWS, k, dtype=torch.int8, device=device),
            torch.empty(k // 32, dtype=torch.float32, device=device),
            torch.empty(k // 32, dtype=torch.float32, device=device))


def activation_planes(x: torch.Tensor, planes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """The A operand ``[16, K]`` int8 and per-sub-block ``a_s``, ``S_s`` ``[K / 32]`` float32 of the row
    ``x [K]`` (module docstring), written into ``planes`` when given (a workspace's buffers)."""
    k = x.numel()
    if planes is None:
        planes = empty_planes(k, x.device)
    _planes_kernel[(k // _SUPER,)](x, *planes, k, **pdl_launch(x.device))
    return planes


def norm_planes(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                residual_out: torch.Tensor, planes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
    """``add_rms_norm`` of one row (``out = rms_norm(x + residual, weight)``, ``residual_out = x +
    residual``; ``[K]`` or ``[1, K]``, fp16/bf16, K a multiple of 256) that also writes ``planes``
    (:func:`activation_planes` of ``out``) — the launch before a Q4_K GEMV of the normed row made
    by the norm's own. Returns ``planes``."""
    k = x.shape[-1]
    _norm_planes_kernel[(k // _SUPER,)](x, residual, weight, out, residual_out, *planes, k, float(eps),
                                       BLOCK_K=triton.next_power_of_2(k), EARLY=_NORM_EARLY, **pdl_launch(x.device))
    return planes


def pick_mma_config(n: int, k: int, sms: int) -> dict:
    """Launch of :func:`gguf_gemv_mma`. H100 sweep (``probe``; BLOCK_N 64/128, 4/8 warps, 2-4 stages,
    split 1-8) at the 8B shapes: 64 rows, 4 warps, 3 stages everywhere; the best splits (o 4, qkv 4,
    gate 2, down 8) are those that bring the grid to about two programs per SM: K is split in two
    while the grid has fewer and each slice keeps at least ``_MIN_SLICE`` super-blocks. Alone on the
    H100 the o took 7.7 µs in 4 slices of 4, 7.9 in 8 of 2; in the model on an H200 slices of 2
    (o in 8; the 1B's o, qkv and down split twice as far) made the step faster, and slices of one
    (the 1B's o and qkv in 8) a little faster again, so 1 it is."""
    return dict(BLOCK_N=_BLOCK_N, SPLIT_K=split_for(triton.cdiv(n, _BLOCK_N), k // _SUPER, sms), num_warps=4,
                num_stages=_STAGES)


def slices(blocks: int, split: int) -> tuple[int, int]:
    """``(per, split)``: ``blocks`` super-blocks in slices of ``per`` for about ``split`` slices asked, no
    slice empty (the tensor-core GEMVs' K split)."""
    per = triton.cdiv(blocks, max(1, min(split, blocks)))
    return per, triton.cdiv(blocks, per)


def split_for(tiles: int, blocks: int, sms: int) -> int:
    """K slices for a tensor-core GEMV of ``tiles`` row tiles over ``blocks`` super-blocks: doubled
    while the grid has fewer than ``_PROGRAMS_PER_SM`` programs a SM and each slice keeps at least
    ``_MIN_SLICE`` super-blocks (:func:`pick_mma_config`, :func:`.gguf_mma_q6k.pick_q6k_config`)."""
    split = 1
    while tiles * split < _PROGRAMS_PER_SM * sms and blocks // (split * 2) >= _MIN_SLICE:
        split *= 2
    return split


def gguf_gemv_mma(x: torch.Tensor, data: torch.Tensor, qtype: str, add: torch.Tensor | None, out: torch.Tensor,
                  workspace, config: dict | None, sms: int, silu_mul: bool = False, planes=None,
                  planes_out=None, rms_out=None, rms_in=None, early_launch: bool = False) -> torch.Tensor:
    """``out [1, N] = x [1, K] @ dequant(data).T (+ add)`` on the tensor cores (``qtype`` in
    :data:`MMA_QTYPES`, x fp16/bf16); the operands were checked by :func:`.gguf_linear.gguf_gemv`,
    which calls this. ``workspace``: a :class:`~.gemv.GemvWorkspace` (planes, split-K partials).
    ``silu_mul``: ``data`` holds ``[gate | up]`` (``2 N`` rows) and ``out [1, N]`` gets
    ``silu(x @ gate.T) * (x @ up.T)``, no ``add``. ``planes``: x's A operand already made (by
    :func:`norm_planes`), so no activation launch. ``planes_out`` (``silu_mul``, N a multiple of
    256, :func:`swiglu_planes_possible`): buffers that also receive the output row's own A operand
    (:func:`activation_planes` of ``out``, bit for bit; or, given two buffers, the Q6_K GEMV's
    :func:`.gguf_mma_q6k.q6k_activation_planes`), written by each tile's epilogue, so the projection
    reading it (``down``) needs no activation launch either. ``rms_out`` / ``rms_in``: a carried
    RMSNorm (:class:`~.gemv.GemvRmsOut` — its ``planes`` the Q4_K A operand of ``scaled`` — and
    :class:`~.gemv.GemvRmsIn`; :func:`rms_args`). ``early_launch``: the next kernel launches right after
    the PDL wait, however large the grid (:func:`.gguf_linear.gguf_gemv`'s ``beside``)."""
    from .gemv import GemvWorkspace
    row_stride, layout = layout_args(data, qtype)
    n, k = code_rows(data), x.shape[1]
    cfg = dict(config or pick_mma_config(n, k, sms))
    block_n, split = cfg.pop("BLOCK_N"), cfg.pop("SPLIT_K")
    per, split = slices(k // _SUPER, split)
    ws = workspace or GemvWorkspace()
    if planes is None:
        planes = activation_planes(x[0], ws.planes(x.device, k))
    n_tiles = triton.cdiv(n, block_n)
    part, lock = ws.get(x.device, n_tiles, split, block_n) if split > 1 else (out, out)
    _q4k_kernel[(n_tiles, split)](
        *planes, data, add if add is not None else out, out, part, lock, n // 2 if silu_mul else n, k,
        row_stride, per, split, BLOCK_N=block_n, SPLIT=split > 1, HAS_ADD=add is not None,
        EMULATE=triton_interprets(), LATE_LAUNCH=n_tiles * split > sms and not early_launch,
        SWIGLU=silu_mul,
        PREFETCH=_PREFETCH_LINES, **_planes_args(planes_out, silu_mul, n, block_n), **pdl_launch(x.device), **layout,
        AHEAD=_AHEAD, PAIR=_PAIR,
        **rms_args("gguf_gemv", rms_out, rms_in, n // 2 if silu_mul else n, k, block_n, silu_mul, out), **cfg)
    return out


def rms_args(fn: str, rms_out, rms_in, n: int, k: int, block_n: int, silu_mul: bool, out: torch.Tensor) -> dict:
    """Launch keywords of a carried RMSNorm for the one-row tensor-core GEMVs (this module's and
    :mod:`.gguf_mma_q6k`'s), each checked: ``rms_out`` (:class:`~.gemv.GemvRmsOut`, no ``packed``;
    ``planes``, if any, three buffers for ``N`` a multiple of 256) and ``rms_in``
    (:class:`~.gemv.GemvRmsIn`)."""
    from .gemv import check_rms_out, rms_in_args
    args = {}
    if rms_out is not None:
        check_rms_out(fn, rms_out, 1, n, block_n, silu_mul, out)
        if rms_out.packed is not None or n % block_n:
            raise GraphDSLError(f"{fn}: rms_out on the tensor cores takes no packed int4 rows and whole tiles of "
                                f"{block_n} columns, got packed={rms_out.packed is not None}, N {n}")
        args.update(g_ptr=rms_out.weight, scaled_ptr=rms_out.scaled, rpart_ptr=rms_out.partials, RMS_OUT=True)
        if rms_out.planes is not None:
            _check_planes(fn, "rms_out.planes", rms_out.planes, n, out.device)
            a, xa, xs = rms_out.planes
            args.update(pa_ptr=a, pxa_ptr=xa, pxs_ptr=xs, PLANES=True)
    if rms_in is not None:
        args.update(rms_in_args(fn, rms_in, 1, k))
    return args


def _check_planes(fn: str, name: str, planes, n: int, device) -> None:
    """``planes`` must be the Q4_K A operand buffers of an ``n``-input row (n a multiple of 256)."""
    want = ((16, n), torch.int8), ((n // 32,), torch.float32), ((n // 32,), torch.float32)
    if n % _SUPER or len(planes) != 3 or any(tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous()
                                             or t.device != device for t, (shape, dtype) in zip(planes, want)):
        raise GraphDSLError(f"{fn}: {name} must be the Q4_K A operand of a row of {n} inputs (a multiple of "
                            f"{_SUPER}): contiguous int8 [16, {n}], float32 [{n // 32}] x 2 on {device}; got "
                            f"{[(t.dtype, list(t.shape)) for t in planes]}")


def swiglu_planes_possible(n: int, block_n: int | None = None) -> bool:
    """Whether a SwiGLU tensor-core GEMV of ``n`` outputs (``2 n`` weight rows) in tiles of ``block_n``
    weight rows can write its output's A operand: each tile's ``block_n / 2`` outputs one 32-input
    sub-block, and whole 256-input super-blocks (``block_n``: :func:`pick_mma_config`'s by default)."""
    return (block_n or _BLOCK_N) == 64 and n % 256 == 0


def _planes_args(planes_out, silu_mul: bool, n: int, block_n: int) -> dict:
    """Launch keywords for ``planes_out``: three buffers (A, ``a_s``, ``S_s``) are this module's
    format, two (A, ``a_s``) the Q6_K GEMV's (:func:`.gguf_mma_q6k.q6k_activation_planes`)."""
    if planes_out is None:
        return {}
    if not silu_mul or not swiglu_planes_possible(n // 2, block_n):
        raise GraphDSLError(f"gguf_gemv_mma: planes_out needs silu_mul with BLOCK_N 64 and a multiple of 256 "
                            f"outputs, got silu_mul={silu_mul}, BLOCK_N {block_n}, {n // 2 if silu_mul else n} outputs")
    if len(planes_out) == 2:
        a, xa = planes_out
        return dict(pa_ptr=a, pxa_ptr=xa, pxs_ptr=xa, PLANES=True, PLANES_Q6K=True)
    a, xa, xs = planes_out
    return dict(pa_ptr=a, pxa_ptr=xa, pxs_ptr=xs, PLANES=True)
