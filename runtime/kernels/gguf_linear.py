"""``gguf_linear``: ``out = x @ dequant(W).T`` with ``W`` kept in its GGUF block bytes on the device.

``W`` is ``data``, uint8 ``[N, row_bytes]``: each of the N output rows is the row's K values as
``K / values_per_block`` consecutive GGML blocks, byte for byte as in the file (types:
:data:`~.gguf_tiles.KERNEL_QTYPES`); or the same blocks block-major, ``[K / values_per_block, N,
block bytes]`` (:func:`graphdsl.runtime.gguf_blocks.block_major`, what a bind on CUDA stores), which
every kernel here reads as well (:func:`.gguf_tiles.layout_args`). The math is
:func:`graphdsl.runtime.gguf_blocks.dequantize_blocks` followed by a matmul; the kernels never
write the dequantized weight for decode.

* **Decode (``M <=`` :func:`gemv_rows`: 16 rows, 64 for :data:`~.gguf_tiles.PLANE_QTYPES`):
  dequantize-in-GEMV.** Program ``(n, s)`` owns ``BLOCK_N`` rows and the ``s``-th of ``SPLIT_K``
  slices of the blocks. Several rows of a plane type (``PLANES``, :func:`_planes_step`) decode one
  32-value plane of the rows at a time in K order and ``tl.dot`` it with the rows' 32 contiguous
  inputs; Q4_K and Q6_K planes in fp16/bf16 straight from the code bytes by packed PTX
  (``q4k_planes_dt``, ``q6k_plane_dt``: ``2^k + q`` in a mantissa, two values an instruction).
  Otherwise a step decodes ``SB`` blocks of each row (:func:`.gguf_tiles.decode_tile`: one
  contiguous pass over the bytes, values in tile order) and gathers the matching activations, then
  ``tl.dot``\\ s the tile (cast to the activation dtype) with the ``[SB·values, 16]`` activation
  slice. With one row (``M == 1``, the decode case that matters most) it skips the tile:
  :func:`.gguf_tiles.row_dot` multiplies each nibble plane with its contiguous activation slice into
  an accumulator reduced after the K loop (Q6_K scales each value; the other types sum per
  sub-block and scale the sums).
  Split-K slices meet in the same launch (:mod:`.splitk`: the last program per row tile sums
  the partials in slice order, deterministic), which adds the residual or bias and stores into
  the caller's ``out`` — a column slice of a fused projection's product works.
* **Prefill (more rows): dequantize then cuBLAS.** :func:`gguf_dequantize` writes the weight in
  the activation dtype (one pass over the bytes, stored in K order) and
  ``torch.nn.functional.linear`` multiplies (docs/gguf-kernels.md has the H200 tables).

One fp16/bf16 row of Q4_K or Q6_K over at least ``MMA_MIN_ROWS`` weight rows runs on the int8
tensor cores instead (:mod:`.gguf_mma`, :mod:`.gguf_mma_q6k`, :func:`mma_eligible`): on an H100
1.2-1.7x faster than the CUDA-core loop, which is instruction-bound (15-33% of copy bandwidth on
the H200, about the bf16 cuBLAS GEMV's time; docs/gguf-kernels.md has the tables and the next steps).
So do 2..32 rows of Q4_K, Q5_K and Q8_0, 2..16 of Q6_K, and one row of Q5_K and Q8_0
(:mod:`.gguf_mma_rows`: a sub-block a dot, the rows on the dot's other operand; ``_MMA_ROWS``); Q6_K's 17-32
rows only by ``config`` (a plane a dot was faster).

``data`` is in the stored layout (:func:`graphdsl.runtime.gguf_blocks.to_stored`: Q6_K blocks
padded to 224 bytes; the other types as in the file).

File shape (STYLE.md 11): the ``@triton.jit`` kernels, the launch heuristic :func:`_pick_config`,
the public wrappers :func:`gguf_gemv`, :func:`gguf_dequantize`, :func:`gguf_linear`.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from graphdsl.errors import GraphDSLError
from graphdsl.quant import code_rows

from ..device import triton_interprets
from ..gguf_blocks import GGUF_BLOCKS
from .gemv import rin_tile, rms_factor, rms_in_args
from .gguf_mma import _CONFIG_KEYS as _MMA_CONFIG_KEYS
from .gguf_mma import MMA_MIN_ROWS, MMA_QTYPES, gguf_gemv_mma
from .gguf_mma_q6k import gguf_gemv_q6k
from .gguf_mma_rows import CONFIG_KEYS as _ROWS_CONFIG_KEYS
from .gguf_mma_rows import MMA_ROWS, Q6K_ROWS_BY_DEFAULT, ROWS_BY_DEFAULT, gguf_gemv_mma_rows, is_rows_planes
from .pdl import pdl_launch, pdl_trigger, pdl_wait
from .gguf_tiles import (KERNEL_QTYPES, PLANE_QTYPES, decode_tile, k_planes, layout_args, q4k_planes, q6k_plane,
                         q6k_plane_of, q8_0_plane, row_codes, row_dot, row_total, row_zeros)
from .splitk import meet_rows, meet_tile

__all__ = ["gguf_linear", "gguf_gemv", "gguf_dequantize", "mma_eligible", "on_rows_kernel", "gemv_rows",
           "KERNEL_QTYPES", "MAX_GEMV_ROWS", "MAX_PLANE_ROWS", "SWIGLU_QTYPES"]

MAX_GEMV_ROWS = 16    # rows gguf_gemv takes for any type
MAX_PLANE_ROWS = 64   # the most it takes for a PLANE_QTYPES weight (a plane a dot; gemv_rows); beyond, gguf_linear
                      # dequantizes + cuBLAS
_PLANE_ROWS = True    # several rows of a PLANE_QTYPES weight a plane a dot (False: the decoded tile; A/B)
_FAST_PLANES = True   # their Q4_K / Q6_K planes decoded in fp16/bf16 by packed PTX (False: float32 math; A/B)
_Q6K_MMA = True       # one Q6_K row on the tensor cores by default (False: CUDA cores; decode_ab.py's A/B)
_MMA_ROWS = True      # 2..32 GGUF rows on the tensor cores by default (gguf_mma_rows; False: a plane a dot)
_MMA_ROWS_Q6K = True  # ... Q6_K among them (False: Q6_K a plane a dot; quant.py's A/B)
_MMA_ROWS_Q5K = True  # ... Q5_K among them, and its one row (False: one row on the CUDA cores, 2-32 a plane a dot;
                      # quant.py's A/B)
_MMA_ROWS_Q8_0 = True # ... Q8_0 among them, and its one row (False: one row on the CUDA cores, 2-32 a plane a dot;
                      # H200, the 8B Q8_0 step 4.265 ms against 9.331: quant.py --gguf-q8_0-off)
_ONE_ROW_ON_ROWS = ("Q5_K", "Q8_0")   # types with no one-row tensor-core kernel: their one row runs the rows kernel
SWIGLU_QTYPES = ("Q4_K", "Q5_K", "Q8_0")   # types whose tensor-core GEMVs take silu_mul
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dot_tile(acc, w, xt, DOT_F32: tl.constexpr):
    """``acc + w @ xt``: float32 rows in float32 math (a GPU's default tf32 keeps 10 mantissa bits; the
    interpreter's dot mishandles bfloat16), else the weights rounded to the activations' dtype."""
    if DOT_F32:
        return acc + tl.dot(w, xt.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(w.to(xt.dtype), xt)


@triton.jit
def _planes_step(acc, rows, blk0, BS, x_cols, m_ok, QTYPE: tl.constexpr, SB: tl.constexpr, DOT_F32: tl.constexpr,
                 BESIDE: tl.constexpr, FAST: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M] + dequant(W) @ xᵀ`` over blocks ``blk0 .. blk0 + SB`` of the rows ``rows``, a
    32-value plane at a time in K order (:func:`.gguf_tiles.q4k_planes`, ``q6k_plane``, ``q8_0_plane``;
    with ``FAST`` on a GPU, Q4_K and Q6_K in the activations' fp16/bf16 by packed PTX,
    ``q4k_planes_dt`` / ``q6k_plane_dt``), each ``tl.dot`` with the plane's 32 contiguous inputs of
    every activation row (``x_cols``: the rows' pointers ``[1, BLOCK_M]``)."""
    j = tl.arange(0, 32)
    dt = x_cols.dtype.element_ty
    if QTYPE == "Q4_K" or QTYPE == "Q5_K":
        for c in tl.static_range(4 * SB):
            kc = blk0 * 4 + c
            w0, w1 = k_planes(rows, kc, BS, QTYPE == "Q5_K", FAST and not DOT_F32, dt)
            for h in tl.static_range(2):
                xt = tl.load(x_cols + (64 * kc + 32 * h + j)[:, None], mask=m_ok[None, :], other=0.0,
                             cache_modifier=".cg" if BESIDE else "")
                acc = _dot_tile(acc, w0 if h == 0 else w1, xt, DOT_F32)
    else:
        for p in tl.static_range(8 * SB if QTYPE == "Q6_K" else SB):
            kp = blk0 * (8 if QTYPE == "Q6_K" else 1) + p
            if QTYPE == "Q6_K":
                w = q6k_plane_of(rows, blk0 + p // 8, p % 8, BS, FAST and not DOT_F32, dt)
            else:
                tl.static_assert(QTYPE == "Q8_0", "_planes_step: Q4_K, Q5_K, Q6_K or Q8_0")
                w = q8_0_plane(rows, kp, BS)
            xt = tl.load(x_cols + (32 * kp + j)[:, None], mask=m_ok[None, :], other=0.0,
                         cache_modifier=".cg" if BESIDE else "")
            acc = _dot_tile(acc, w, xt, DOT_F32)
    return acc


@triton.jit
def _gguf_gemv_kernel(
    x_ptr,          # [M, K] activations, last dim contiguous
    w_ptr,          # uint8 GGML blocks: stored rows [N, row bytes], or block-major [blocks, N, BYTES] (KB)
    add_ptr,        # HAS_ADD: [M, N] residual (stride_am) or [N] bias (stride_am 0), last dim contiguous
    out_ptr,        # [M, N] output, last dim contiguous
    part_ptr,       # SPLIT: [SPLIT_K, n_tiles, BLOCK_N, BLOCK_M] float32 partials (one row: [.., BLOCK_N])
    lock_ptr,       # SPLIT: [n_tiles] int32 arrival counters, zero between launches
    M, N, K,        # sizes
    row_bytes,      # bytes from one weight row's first block to the next row's (gguf_tiles.layout_args)
    steps_per_split,  # SB-block steps per K slice
    SPLIT_K,        # K slices (programs along axis 1)
    stride_xm, stride_om, stride_am,   # row strides of x, out, add
    QTYPE: tl.constexpr,         # GGML type name
    VALUES: tl.constexpr,        # values per block
    SB: tl.constexpr,            # blocks per step
    BLOCK_N: tl.constexpr,       # weight rows per program
    BLOCK_M: tl.constexpr,       # activation rows padded (dot path)
    USE_DOT: tl.constexpr,       # M > 1: tl.dot; M == 1: elementwise
    PLANES: tl.constexpr,        # USE_DOT: a 32-value plane a dot (_planes_step; PLANE_QTYPES), not a decoded tile
    FAST: tl.constexpr,          # PLANES: Q4_K / Q6_K planes decoded in the activations' dtype by packed PTX
    SPLIT: tl.constexpr,         # SPLIT_K > 1: the slices meet in this launch (:mod:`.splitk`)
    HAS_ADD: tl.constexpr,
    DOT_F32: tl.constexpr,       # the CPU interpreter's dot mishandles bfloat16: multiply in float32
    PREFETCH: tl.constexpr = False,  # one row: load each step's code bytes a step ahead (row_codes)
    KB: tl.constexpr = False, BYTES: tl.constexpr = 0, KB_STRIDE=0,   # the layout (gguf_tiles.layout_args)
    rin_ptr=None, RIN_CHUNKS=1, rin_inv_n=1.0, rin_eps=0.0,   # RMS_IN: the producer's Σy² partials [M, chunks]
    RMS_IN: tl.constexpr = False, RIN_BLOCK: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False, LATE_LAUNCH: tl.constexpr = False,   # (:mod:`.pdl`) the next launches after the loop
    BESIDE: tl.constexpr = False,   # runs beside the kernel launched before it (gguf_gemv's beside)
):
    """out[m, n] = sum_k x[m, k] * dequant(w)[n, k] (+ add[m, n]), float32 accumulation; with
    ``SPLIT`` each program sums its K slice and the last to arrive per row tile adds the slices in
    slice order and stores (:mod:`.splitk`). ``RMS_IN``: x is a producer's ``y · weight`` whose
    RMSNorm factor is still owed, so row ``m``'s sums are multiplied by it before the add
    (:class:`~.gemv.GemvRmsIn`). ``BESIDE``: no wait before the first read (its inputs were complete
    when it launched) and none of them from L1, the next kernel let in at once, and the wait for
    the kernel before it last, so that kernel's successor sees both finished."""
    if BESIDE:
        pdl_trigger(USE_PDL)
    else:
        pdl_wait(USE_PDL, not LATE_LAUNCH)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rows = w_ptr + rn.to(tl.int64) * row_bytes
    BS = KB_STRIDE if KB else BYTES                # bytes between a row's blocks
    n_steps = K // (VALUES * SB)
    s_lo = pid_k * steps_per_split
    s_hi = tl.minimum(s_lo + steps_per_split, n_steps)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        if PLANES:            # the planes' loads carry no mask: rows past N read row N - 1
            prow = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * row_bytes
            for s in range(s_lo, s_hi):
                acc = _planes_step(acc, prow, s * SB, BS, x_ptr + rm[None, :] * stride_xm, m_ok, QTYPE, SB,
                                   DOT_F32, BESIDE, FAST)
        else:
            for s in range(s_lo, s_hi):
                blk0 = s * SB
                w, koff = decode_tile(rows, n_ok, blk0, BS, QTYPE, SB)
                xt = tl.load(x_ptr + rm[None, :] * stride_xm + (blk0 * VALUES + koff)[:, None], mask=m_ok[None, :],
                             other=0.0, cache_modifier=".cg" if BESIDE else "")
                acc = _dot_tile(acc, w, xt, DOT_F32)
        acc, last = meet_tile(acc, part_ptr, lock_ptr, pid_n, pid_k, SPLIT_K, BLOCK_N, BLOCK_M, SPLIT)
    else:
        vals = row_zeros(BLOCK_N, QTYPE, SB)
        if PREFETCH:            # the first step's code bytes
            n0, n1 = row_codes(rows, n_ok, tl.maximum(tl.minimum(s_lo, s_hi - 1), 0) * SB, BS, QTYPE, SB)
        for s in range(s_lo, s_hi):
            if PREFETCH:        # this step's code bytes were loaded last step; load the next step's
                b0, b1 = n0, n1
                n0, n1 = row_codes(rows, n_ok, tl.minimum(s + 1, s_hi - 1) * SB, BS, QTYPE, SB)
            else:
                b0, b1 = row_codes(rows, n_ok, s * SB, BS, QTYPE, SB)
            vals = row_dot(vals, b0, b1, rows, n_ok, s * SB, BS, x_ptr, QTYPE, SB, BESIDE)
        rm = tl.arange(0, 1)
        m_ok = rm < 1
        # [BLOCK_N, 1] (M == 1): the row sums, reduced once after the K loop, met across slices
        acc, last = meet_rows(row_total(vals), part_ptr, lock_ptr, pid_n, pid_k, SPLIT_K, BLOCK_N, SPLIT)
    if LATE_LAUNCH and not BESIDE:
        pdl_trigger(USE_PDL)
    if last:
        ok = n_ok[:, None] & m_ok[None, :]
        if RMS_IN:
            acc = acc * rms_factor(rin_tile(rin_ptr, rm, m_ok, RIN_CHUNKS, RIN_BLOCK, BESIDE), rin_inv_n,
                                   rin_eps)[None, :]
        if HAS_ADD:
            acc += tl.load(add_ptr + rm[None, :] * stride_am + rn[:, None], mask=ok, other=0.0,
                           cache_modifier=".cg" if BESIDE else "").to(tl.float32)
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=ok)
    if BESIDE:
        pdl_wait(USE_PDL, False)


@triton.jit
def _gguf_dequant_kernel(
    w_ptr,          # uint8 GGML blocks, stored rows or block-major (KB; gguf_tiles.layout_args)
    out_ptr,        # [N, K] output, row-major
    N, K, row_bytes,
    QTYPE: tl.constexpr, VALUES: tl.constexpr, SB: tl.constexpr, BLOCK_N: tl.constexpr,
    KB: tl.constexpr = False, BYTES: tl.constexpr = 0, KB_STRIDE=0, K_ORDER: tl.constexpr = True,
):
    """out[n, k] = dequant(w)[n, k] for BLOCK_N rows and SB blocks per program, stored in K order with
    ``K_ORDER``: Q4_K, Q6_K and Q8_0 decode a 32-value plane at a time, already in K order
    (:func:`.gguf_tiles.q4k_planes`, ``q6k_plane``, ``q8_0_plane``), the other types their tile
    (:func:`.gguf_tiles.decode_tile`) permuted into K order in registers. Without, the tile is stored
    at its K offsets (2-byte stores scattered over the row)."""
    pid_n = tl.program_id(0)
    blk0 = tl.program_id(1) * SB
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    BS = KB_STRIDE if KB else BYTES
    dt = out_ptr.dtype.element_ty
    if K_ORDER and (QTYPE == "Q4_K" or QTYPE == "Q6_K" or QTYPE == "Q8_0"):
        rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * row_bytes       # the planes' loads carry no mask
        dst = out_ptr + rn.to(tl.int64)[:, None] * K + tl.arange(0, 32)[None, :]
        for i in tl.static_range(SB if QTYPE == "Q8_0" else 8 * SB):        # 32-value planes, in K order
            if QTYPE == "Q4_K":
                if i % 2 == 0:
                    w0, w1 = q4k_planes(rows, blk0 * 4 + i // 2, BS)
                    w = w0
                else:
                    w = w1
            elif QTYPE == "Q6_K":
                w = q6k_plane(rows, blk0 * 8 + i, BS)
            else:
                w = q8_0_plane(rows, blk0 + i, BS)
            tl.store(dst + (blk0 * VALUES + 32 * i), w.to(dt), mask=n_ok[:, None])
    else:
        w, koff = decode_tile(w_ptr + rn.to(tl.int64) * row_bytes, n_ok, blk0, BS, QTYPE, SB)
        if K_ORDER:                       # the tile's (block, byte, nibble) order to K's (block, nibble, byte)
            if QTYPE == "Q5_K":
                w = tl.permute(tl.reshape(w, [BLOCK_N, SB * 4, 32, 2]), (0, 1, 3, 2))
            else:                        # Q4_0, Q4_1, Q5_0, Q5_1
                w = tl.permute(tl.reshape(w, [BLOCK_N, SB, 16, 2]), (0, 1, 3, 2))
            w = tl.reshape(w, [BLOCK_N, SB * VALUES])
            koff = tl.arange(0, SB * VALUES)
        dst = out_ptr + rn.to(tl.int64)[:, None] * K + (blk0 * VALUES + koff)[None, :]
        tl.store(dst, w.to(dt), mask=n_ok[:, None])


# the dequantize kernel's stores in K order, contiguous (False: each tile at its K offsets; A/B)
_DEQUANT_K_ORDER = True
# the launch keys gguf_gemv's ``config`` takes (a typo is an error, not a silently ignored key)
_CONFIG_KEYS = {"SB", "BLOCK_N", "SPLIT_K", "num_warps", "num_stages", "USE_DOT", "PREFETCH", "MMA", "PLANES"}


def gemv_rows(qtype: str) -> int:
    """The most activation rows :func:`gguf_gemv` takes for a ``qtype`` weight (more: dequantize +
    cuBLAS): :data:`MAX_PLANE_ROWS` for Q4_K and Q6_K (their planes decoded by packed PTX), 32 for
    the other :data:`~.gguf_tiles.PLANE_QTYPES`, :data:`MAX_GEMV_ROWS` for the rest. H200, the 8B
    projections (``benchmarks/gguf_gemv.py --many``, docs/gguf-kernels.md): at 64 rows the Q4_K / Q6_K
    planes took 21-67 µs against 22-88 for dequantize + cuBLAS; Q5_K's float32 planes 30.3 against
    23.4 on the o projection (4096 x 4096), where at 32 rows they won everywhere (22.7 against 24.9)."""
    if qtype not in PLANE_QTYPES or not _PLANE_ROWS:
        return MAX_GEMV_ROWS
    return MAX_PLANE_ROWS if qtype in ("Q4_K", "Q6_K") else 32


def _sb_for(n_blocks: int, want: int) -> int:
    """The largest power of two <= ``want`` dividing ``n_blocks`` (steps never straddle the row end)."""
    sb = 1
    while sb * 2 <= want and n_blocks % (sb * 2) == 0:
        sb *= 2
    return sb


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def _pick_config(m: int, n: int, k: int, qtype: str, device: torch.device) -> dict:
    """Launch for ``[m, k] @ dequant([n, k]).T``. One row (H200 sweep of ``benchmarks/gguf_gemv.py
    --sweep`` at 8B shapes): 512 values a step (16 blocks of 32 or two super-blocks), 8 rows a
    program, 2 warps (4 for Q6_K, whose step holds more integer work); the split of K hardly
    mattered there. More rows: 256 values a step; a plane type a plane a dot (``PLANES``) in 64-row
    tiles, 128 beyond 32 activation rows, 2 stages (H200, 8B shapes, Q4_K / Q6_K: 128-row tiles
    took 21-62 µs at 64 rows against 24-67, 16-52 at 16 rows against 15-43; the ``--many --sweep``
    grid of tiles, warps, stages and slices gained little elsewhere), the other types 32-row
    decoded tiles. K is split until the grid has about four programs per SM, keeping at least 2
    steps a slice."""
    values = KERNEL_QTYPES[qtype][0]
    n_blocks = k // values
    one = m == 1
    planes = not one and qtype in PLANE_QTYPES and _PLANE_ROWS
    sb = _sb_for(n_blocks, (512 if one else 256) // values)
    block_n = 8 if one else (128 if m > 32 else 64) if planes else 32
    warps = 4 if (not one or qtype == "Q6_K") else 2
    tiles = triton.cdiv(n, block_n)
    steps = n_blocks // sb
    split = 1
    while tiles * split < 4 * _num_sms(device) and steps // (split * 2) >= 2:
        split *= 2
    return dict(SB=sb, BLOCK_N=block_n, SPLIT_K=split, num_warps=warps, num_stages=2 if planes else 1,
                **({"PLANES": True} if planes else {}))


def _check(data: torch.Tensor, qtype: str, x: torch.Tensor | None = None) -> int:
    """Validate the operands; returns K."""
    if qtype not in KERNEL_QTYPES:
        raise GraphDSLError(f"gguf kernels: GGML type {qtype!r} has no kernel; supported: {list(KERNEL_QTYPES)}")
    values, nbytes = KERNEL_QTYPES[qtype]
    shaped = (data.dim() == 2 and data.shape[1] % nbytes == 0) or (data.dim() == 3 and data.shape[2] == nbytes)
    if data.dtype != torch.uint8 or not shaped or not data.is_contiguous():
        layout = " in the stored layout, gguf_blocks.to_stored" if nbytes != GGUF_BLOCKS[qtype][1] else ""
        raise GraphDSLError(f"gguf kernels: data must be contiguous uint8 [N, K / {values} * {nbytes}] ({qtype} "
                            f"blocks{layout}) or block-major [K / {values}, N, {nbytes}] (gguf_blocks.block_major), "
                            f"got {data.dtype} {list(data.shape)} contiguous={data.is_contiguous()}")
    k = (data.shape[0] if data.dim() == 3 else data.shape[1] // nbytes) * values
    if x is not None and (x.dim() != 2 or x.shape[1] != k or x.dtype not in _DTYPES or x.stride(1) != 1):
        raise GraphDSLError(f"gguf kernels: x must be [M, {k}] in {[str(d) for d in _DTYPES]} with a contiguous "
                            f"last dim, got {list(x.shape)} {x.dtype} strides {x.stride()}")
    if x is not None and x.device != data.device:
        raise GraphDSLError(f"gguf kernels: x is on {x.device}, data on {data.device}")
    return k


def _mma_possible(x: torch.Tensor, data: torch.Tensor, qtype: str) -> bool:
    """The tensor-core kernels (:mod:`.gguf_mma` for the types in ``MMA_QTYPES``, :mod:`.gguf_mma_q6k`
    for Q6_K) take one fp16/bf16 row over 4-byte aligned blocks (they read block headers as int32
    words)."""
    return (x.shape[0] == 1 and (qtype in MMA_QTYPES or qtype == "Q6_K") and x.dtype != torch.float32
            and data.data_ptr() % 4 == 0)


def _rows_possible(x: torch.Tensor, data: torch.Tensor, qtype: str) -> bool:
    """The several-row tensor-core kernel (:mod:`.gguf_mma_rows`) takes 2..``MMA_ROWS`` (32) fp16/bf16
    rows (unit inner stride) of Q4_K, Q5_K, Q6_K or Q8_0 over 4-byte aligned blocks; one row of a type
    with no one-row tensor-core kernel (``_ONE_ROW_ON_ROWS``: Q5_K, Q8_0). Its K loop steps a
    super-block of 256 inputs, so Q8_0 (blocks of 32) needs K a multiple of 256 (Qwen2.5-0.5B's 896
    is not)."""
    low = 1 if qtype in _ONE_ROW_ON_ROWS else 2
    types = ("Q4_K", "Q5_K", "Q8_0") + (("Q6_K",) if _MMA_ROWS_Q6K else ())
    return (low <= x.shape[0] <= MMA_ROWS and qtype in types and x.shape[1] % 256 == 0
            and x.dtype != torch.float32 and x.stride(-1) == 1 and data.data_ptr() % 4 == 0)


def mma_eligible(x: torch.Tensor, data: torch.Tensor, qtype: str) -> bool:
    """Whether :func:`gguf_gemv` runs ``x @ dequant(data).T`` on the tensor cores by default: when
    :func:`_mma_possible` (one row) or, with ``_MMA_ROWS``, :func:`_rows_possible` up to
    ``ROWS_BY_DEFAULT`` (32) rows, Q6_K up to ``Q6K_ROWS_BY_DEFAULT`` (16) (Q5_K with ``_MMA_ROWS_Q5K``,
    Q8_0 with ``_MMA_ROWS_Q8_0``; one row included), and the
    weight has at least ``MMA_MIN_ROWS`` rows (on the H100 a 1024-row Q4_K GEMV took 6.4 µs on CUDA
    cores, 7.5 on the tensor cores with its activation launch; 4096 rows 12.8 against 11.0; Q6_K's
    1024 rows 6.6 against 6.7-8.5, 4096 rows 16.9 against 12.9)."""
    return ((_mma_possible(x, data, qtype)
             or _MMA_ROWS and x.shape[0] <= min(ROWS_BY_DEFAULT, Q6K_ROWS_BY_DEFAULT if qtype == "Q6_K" else MMA_ROWS)
             and (qtype != "Q5_K" or _MMA_ROWS_Q5K)
             and (qtype != "Q8_0" or _MMA_ROWS_Q8_0)
             and _rows_possible(x, data, qtype))
            and code_rows(data) >= MMA_MIN_ROWS and (qtype != "Q6_K" or _Q6K_MMA))


def on_rows_kernel(x: torch.Tensor, data: torch.Tensor, qtype: str) -> bool:
    """Whether :func:`gguf_gemv` runs ``x @ dequant(data).T`` on the rows kernel (:mod:`.gguf_mma_rows`) by
    default, which reads the rows' operands (:func:`.gguf_mma_rows.norm_rows_planes` can make them):
    :func:`mma_eligible` with 2..32 rows (Q6_K: 2..16), or one row of Q5_K or Q8_0."""
    return (x.shape[0] > 1 or qtype in _ONE_ROW_ON_ROWS) and mma_eligible(x, data, qtype)


def gguf_gemv(x: torch.Tensor, data: torch.Tensor, qtype: str, add: torch.Tensor | None = None, *,
              silu_mul: bool = False, out: torch.Tensor | None = None, workspace=None,
              config: dict | None = None, planes=None, planes_out=None, rms_out=None, rms_in=None,
              early_launch: bool = False, beside: bool = False) -> torch.Tensor:
    """``x @ dequant(data).T (+ add)`` for ``x [M, K]`` (``M <=`` :func:`gemv_rows`) and GGML blocks ``data`` of type
    ``qtype`` (stored rows ``[N, row_bytes]`` or block-major ``[blocks, N, bytes]``), in one launch;
    the result has x's dtype. ``add``: a residual ``[M, N]`` or a bias ``[N]`` (unit inner stride), added in float32 before the store. ``out``: ``[M, N]`` with a
    unit inner stride (a column slice of a wider product works). ``workspace``: a
    :class:`~.gemv.GemvWorkspace` holding the split-K partials and counters (a private one per
    call if omitted; an engine passes its own so a captured graph keeps the addresses).
    ``config`` overrides the launch (``SB, BLOCK_N, SPLIT_K, num_warps, num_stages``, optionally
    ``USE_DOT`` to take the tile + ``tl.dot`` path with one row, ``PLANES`` (several rows of a
    :data:`~.gguf_tiles.PLANE_QTYPES` weight; the default there) a plane a dot instead of the decoded
    tile, required beyond 16 rows, ``PREFETCH`` to load one row's
    code bytes a step ahead — off by default: on the H200 it gained on short Q4_K GEMVs only, 4-7%,
    docs/gguf-kernels.md; benchmarks sweep both). One fp16/bf16 row of a type in
    :data:`~.gguf_mma.MMA_QTYPES` runs on the int8 tensor cores (:mod:`.gguf_mma`) unless ``config``
    picks a CUDA-core launch (:func:`mma_eligible`); ``config={"MMA": True, "BLOCK_N": ..,
    "SPLIT_K": ..}`` (optionally ``num_warps``, ``num_stages``) sets the tensor-core launch.
    ``silu_mul`` (tensor-core paths only: 1..32 fp16/bf16 rows of Q4_K, Q5_K or Q8_0, no ``add``): ``data`` holds
    ``[gate | up]`` (``2 I`` rows) and the result ``[M, I]`` is ``silu(x @ gate.T) * (x @ up.T)``,
    the ``silu_mul`` op fused. 2..32 fp16/bf16 rows of Q4_K, Q5_K or Q8_0 (Q6_K: 2..16) run on the tensor cores
    too by default (:mod:`.gguf_mma_rows`, :func:`mma_eligible`), and so does one row of Q5_K or Q8_0,
    which have no one-row tensor-core kernel.
    ``planes``: x's tensor-core A operand, already made (Q4_K: :func:`.gguf_mma.norm_planes`, three
    buffers; Q6_K: a SwiGLU epilogue's ``planes_out``, two; 2..32 rows: the rows' operands,
    :func:`.gguf_mma_rows.norm_rows_planes`); the tensor-core path then skips its activation launch
    (the CUDA-core path reads x itself).
    ``planes_out`` (``silu_mul``): buffers that also receive the result's own A operand
    (:func:`.gguf_mma.gguf_gemv_mma`; two buffers: the Q6_K format), for the projection that reads
    it next. ``rms_out`` (tensor-core path only: one row, no ``silu_mul``): the epilogue also
    prepares the next RMSNorm (:class:`~.gemv.GemvRmsOut`, its ``planes`` the Q4_K A operand of
    ``scaled``); ``rms_in``: x is such a ``scaled`` and the sums are multiplied by its norm's
    factor (:class:`~.gemv.GemvRmsIn`), on either path.

    Two GEMVs of one input with no data between them (the row parts of a mixed-type weight) can
    run side by side under PDL (:mod:`.pdl`): the first with ``early_launch`` lets the next kernel
    launch right after its wait, even with more programs than SMs; the second, with ``beside``
    (CUDA-core path only), then launches while the first runs. It does not wait before reading —
    the first passed its wait before letting it in, so the kernels before both are finished — and
    reads its inputs from L2, not L1; it waits for the first at its very end, so the kernel after
    it, which waits for it, finds both finished. The caller keeps the contract: a ``beside`` GEMV
    reads nothing the GEMV before it writes, and writes nothing it reads. Its split-K scratch is
    its own (``GemvWorkspace.get(..., beside=True)``). Without PDL both are plain launches."""
    from .gemv import GemvWorkspace
    k = _check(data, qtype, x)
    m, n = x.shape[0], code_rows(data)
    if not 1 <= m <= gemv_rows(qtype):
        raise GraphDSLError(f"gguf_gemv: x needs 1..{gemv_rows(qtype)} rows for {qtype} (gemv_rows), got {m}")
    rows_mma = (m > 1 or qtype in _ONE_ROW_ON_ROWS) and (config.get("MMA", False) if config
                                                          else (silu_mul or mma_eligible(x, data, qtype)))
    if silu_mul:
        if (qtype not in SWIGLU_QTYPES or not (_mma_possible(x, data, qtype) or _rows_possible(x, data, qtype))
                or add is not None or n % 2 or (config and not config.get("MMA"))):
            raise GraphDSLError(f"gguf_gemv: silu_mul runs on the tensor-core paths only: 1..{MMA_ROWS} fp16/bf16 "
                                f"rows of {list(SWIGLU_QTYPES)} with an even row count, no add and a config (if any) "
                                f"with MMA=True; got {m} {x.dtype} rows, {qtype} [{n}, {k}], add={add is not None}, "
                                f"config={config}")
        n //= 2
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise GraphDSLError(f"gguf_gemv: out must be [{m}, {n}] {x.dtype} with a unit inner stride, got "
                            f"{list(out.shape)} {out.dtype} strides {out.stride()}")
    if add is not None and (tuple(add.shape) not in ((n,), (m, n)) or add.stride(-1) != 1):
        raise GraphDSLError(f"gguf_gemv: add must be a bias [{n}] or a residual [{m}, {n}] with a unit inner "
                            f"stride, got {list(add.shape)} strides {add.stride()}")
    if rows_mma:
        return _mma_rows(x, data, qtype, add, out, workspace, config, silu_mul, planes, planes_out, rms_out, rms_in,
                         early_launch, beside)
    if config is None and (silu_mul or mma_eligible(x, data, qtype)) or config and config.get("MMA"):
        if beside:
            raise GraphDSLError(f"gguf_gemv: beside runs on the CUDA-core path only, got the tensor-core path for "
                                f"{m} {x.dtype} row(s) of {qtype} [{n}, {k}] (config={config})")
        return _mma(x, data, qtype, add, out, workspace, config, silu_mul, planes, planes_out, rms_out, rms_in,
                    early_launch)
    if rms_out is not None:
        raise GraphDSLError(f"gguf_gemv: rms_out is written by the tensor-core path only (one fp16/bf16 row of "
                            f"{MMA_MIN_ROWS}+ weight rows of {list(MMA_QTYPES) + ['Q6_K']}), got {m} {x.dtype} rows of "
                            f"{qtype} [{n}, {k}]")
    values = KERNEL_QTYPES[qtype][0]
    cfg = dict(config or _pick_config(m, n, k, qtype, x.device))
    cfg.pop("MMA", None)
    if config and (set(cfg) - _CONFIG_KEYS or {"SB", "BLOCK_N", "SPLIT_K"} - set(cfg)):       # a caller's
        raise GraphDSLError(f"gguf_gemv: config takes SB, BLOCK_N, SPLIT_K and optionally "
                            f"{sorted(_CONFIG_KEYS - {'SB', 'BLOCK_N', 'SPLIT_K'})}, got {sorted(cfg)}")
    sb, block_n, split = cfg.pop("SB"), cfg.pop("BLOCK_N"), cfg.pop("SPLIT_K")
    use_dot = cfg.pop("USE_DOT", m > 1)
    planes_dot = cfg.pop("PLANES", False)
    if (k // values) % sb:
        raise GraphDSLError(f"gguf_gemv: SB={sb} blocks a step must divide the {k // values} blocks of a row")
    if planes_dot and (qtype not in PLANE_QTYPES or not use_dot):
        raise GraphDSLError(f"gguf_gemv: config PLANES=True needs a type in {list(PLANE_QTYPES)} and the tl.dot path "
                            f"(USE_DOT, the default beyond one row), got {qtype} with USE_DOT={use_dot}")
    if m > MAX_GEMV_ROWS and not planes_dot:
        raise GraphDSLError(f"gguf_gemv: more than {MAX_GEMV_ROWS} rows ({m}) run a plane a dot only: config "
                            f"PLANES=True, got {config}")
    block_m = max(MAX_GEMV_ROWS, triton.next_power_of_2(m)) if use_dot else MAX_GEMV_ROWS
    steps = k // values // sb
    per = triton.cdiv(steps, max(1, min(split, steps)))
    split = triton.cdiv(steps, per)                        # no empty slices
    n_tiles = triton.cdiv(n, block_n)
    part, lock = ((workspace or GemvWorkspace()).get(x.device, n_tiles, split, block_n, beside=beside, rows=block_m)
                  if split > 1 else (out, out))
    interp = triton_interprets()
    row_stride, layout = layout_args(data, qtype)
    pdl = pdl_launch(x.device)
    _gguf_gemv_kernel[(n_tiles, split)](
        x, data, add if add is not None else out, out, part, lock, m, n, k, row_stride, per, split,
        x.stride(0), out.stride(0), 0 if add is None or add.dim() == 1 else add.stride(0),
        QTYPE=qtype, VALUES=values, SB=sb, BLOCK_N=block_n, BLOCK_M=block_m, USE_DOT=use_dot, PLANES=planes_dot,
        FAST=_FAST_PLANES and not interp,
        SPLIT=split > 1, HAS_ADD=add is not None, DOT_F32=interp or x.dtype == torch.float32, **layout,
        **({} if rms_in is None else rms_in_args("gguf_gemv", rms_in, m, k)),
        LATE_LAUNCH=n_tiles * split > _num_sms(x.device) and not early_launch, BESIDE=beside, **pdl, **cfg)
    return out


def _mma(x, data, qtype, add, out, workspace, config, silu_mul, planes=None, planes_out=None, rms_out=None,
         rms_in=None, early_launch=False):
    """:func:`gguf_gemv` on the tensor cores (:mod:`.gguf_mma`), its ``config`` checked."""
    if not _mma_possible(x, data, qtype):
        raise GraphDSLError(f"gguf_gemv: config MMA=True needs one fp16/bf16 row, a type in {list(MMA_QTYPES) + ['Q6_K']} "
                            f"and 4-byte aligned data, got {x.shape[0]} {x.dtype} rows of {qtype} at "
                            f"address {data.data_ptr():#x}")
    cfg = _mma_config(config, _MMA_CONFIG_KEYS, "")
    want = 2 if qtype == "Q6_K" else 3                    # the planes' format: gguf_mma_q6k's or gguf_mma's
    if planes is not None and (len(planes) != want or is_rows_planes(planes)):
        got = "the rows' operands (gguf_mma_rows)" if is_rows_planes(planes) else len(planes)
        raise GraphDSLError(f"gguf_gemv: planes for {qtype} are {want} buffers (its tensor-core GEMV's activation "
                            f"operand), got {got}")
    if qtype == "Q6_K":
        if planes_out is not None:
            raise GraphDSLError("gguf_gemv: planes_out is written by a Q4_K SwiGLU GEMV's epilogue, not by Q6_K's")
        return gguf_gemv_q6k(x, data, add, out, workspace, cfg, _num_sms(x.device), planes, rms_out, rms_in,
                             early_launch)
    return gguf_gemv_mma(x, data, qtype, add, out, workspace, cfg, _num_sms(x.device), silu_mul, planes, planes_out,
                         rms_out, rms_in, early_launch)


def _mma_config(config: dict | None, keys: set, what: str) -> dict | None:
    """A caller's tensor-core launch (``MMA`` dropped), checked against the kernel's ``keys``."""
    if not config:
        return None
    cfg = {key: v for key, v in config.items() if key != "MMA"}
    if set(cfg) - keys or {"BLOCK_N", "SPLIT_K"} - set(cfg):
        raise GraphDSLError(f"gguf_gemv: config with MMA=True{what} takes BLOCK_N, SPLIT_K and optionally "
                            f"{sorted(keys - {'BLOCK_N', 'SPLIT_K'})}, got {sorted(cfg)}")
    return cfg


def _mma_rows(x, data, qtype, add, out, workspace, config, silu_mul, planes, planes_out, rms_out, rms_in,
              early_launch, beside):
    """:func:`gguf_gemv` of 2..32 rows (Q5_K, Q8_0: 1..32) on the tensor cores (:mod:`.gguf_mma_rows`), its
    arguments checked: ``planes`` must be the rows' operands (:func:`.gguf_mma_rows.norm_rows_planes`);
    ``planes_out``, ``rms_out`` and ``beside`` are the one-row and CUDA-core paths' only."""
    m, k = x.shape
    if not _rows_possible(x, data, qtype):
        raise GraphDSLError(f"gguf_gemv: config MMA=True with several rows needs 2..{MMA_ROWS} fp16/bf16 rows of "
                            f"Q4_K, Q5_K, Q6_K or Q8_0 (Q5_K, Q8_0: 1..{MMA_ROWS}; unit inner stride; K a multiple "
                            f"of 256) and 4-byte aligned data, got {m} {x.dtype} rows of {qtype}, K={k}, at address "
                            f"{data.data_ptr():#x}")
    if planes is not None and not (is_rows_planes(planes) and planes[0].shape[0] == k // 32):
        raise GraphDSLError(f"gguf_gemv: planes for {m} rows are the rows' operands of K={k} inputs "
                            f"(empty_rows_planes: [{k // 32}, {2 * MMA_ROWS}, 32] int8 first), got {len(planes)} buffers, the "
                            f"first {list(planes[0].shape)}")
    given = [name for name, v in (("planes_out", planes_out), ("rms_out", rms_out)) if v is not None]
    if given or beside:
        raise GraphDSLError(f"gguf_gemv: {', '.join(given + ['beside'] * beside)} take the one-row tensor-core "
                            f"kernels (one row of Q4_K or Q6_K) or the CUDA-core path; got {m} row(s) of {qtype} on "
                            f"the rows kernel")
    cfg = _mma_config(config, _ROWS_CONFIG_KEYS, " and several rows")
    return gguf_gemv_mma_rows(x, data, qtype, add, out, workspace, cfg, _num_sms(x.device), silu_mul, early_launch,
                              None if rms_in is None else rms_in_args("gguf_gemv", rms_in, m, k), planes)


def gguf_dequantize(data: torch.Tensor, qtype: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight ``[N, K]`` in ``dtype`` from its GGML blocks ``data`` (stored rows ``[N, row_bytes]``
    or block-major; Triton, one pass)."""
    k = _check(data, qtype)
    n = code_rows(data)
    values = KERNEL_QTYPES[qtype][0]
    sb = _sb_for(k // values, 256 // values)
    out = torch.empty(n, k, dtype=dtype, device=data.device)
    block_n = 16
    row_stride, layout = layout_args(data, qtype)
    _gguf_dequant_kernel[(triton.cdiv(n, block_n), k // values // sb)](
        data, out, n, k, row_stride, QTYPE=qtype, VALUES=values, SB=sb, BLOCK_N=block_n, num_warps=4,
        K_ORDER=_DEQUANT_K_ORDER, **layout)
    return out


def gguf_linear(x: torch.Tensor, data: torch.Tensor, qtype: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(data).T (+ bias)`` for ``x [..., K]``: the GEMV kernel for at most
    :func:`gemv_rows` rows, else dequantize to x's dtype and matmul."""
    k = _check(data, qtype)
    if x.shape[-1] != k:
        raise GraphDSLError(f"gguf_linear: x's last dim must be K={k} (the {qtype} weight's), got {list(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if 1 <= x2.shape[0] <= gemv_rows(qtype):
        bias = bias if bias is None or bias.stride(-1) == 1 else bias.contiguous()
        out = gguf_gemv(x2, data, qtype, None if bias is None else bias.to(x2.dtype))
    else:
        _check(data, qtype, x2)
        out = torch.nn.functional.linear(x2, gguf_dequantize(data, qtype, x2.dtype), bias)
    return out.reshape(*lead, code_rows(data))
