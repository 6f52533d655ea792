"""One-row Q6_K GEMV on the int8 tensor cores: ``out = x @ dequant(W).T (+ add)``, ``x [1, K]``.

The CUDA-core Q6_K loop (:func:`.gguf_tiles.row_dot`) is bound by its instructions and by loads
that stay single bytes (a 210-byte block leaves every odd block 2-byte aligned): 23-27% of copy
bandwidth on the H200 (docs/gguf-kernels.md). This path is :mod:`.gguf_mma`'s design for Q6_K,
over the **stored layout's 224-byte blocks** (:func:`graphdsl.runtime.gguf_blocks.to_stored`: the
210 file bytes, then 14 zero bytes), so every field starts 16-byte aligned and loads as vectors.

Block (file order): ``ql[128] @0, qh[64] @128, scales[16] int8 @192, d f16 @208``. Half ``h`` of a
super-block (values ``128 h + i``) reads ``ql[64 h:64 h + 64]`` and ``qh[32 h:32 h + 32]``; for
``l < 32`` its four value planes are

* ``i = l``:      ``ql[l] & 15``       with ``qh[l]`` bits 0-1 on top,
* ``i = 32 + l``: ``ql[32 + l] & 15``  with bits 2-3,
* ``i = 64 + l``: ``ql[l] >> 4``       with bits 4-5,
* ``i = 96 + l``: ``ql[32 + l] >> 4``  with bits 6-7,

each a 6-bit ``q``; the weight is ``d · sc[8 h + i // 16] · (q - 32)``.

* **Weights**: each plane becomes signed bytes ``4 (q - 32) = ((q << 2) ^ 0x80)`` — the nibble
  shifted to bits 2-5, the two high bits to bits 6-7 — four bytes per two shifts and two LOP3
  (:func:`_plane`), the B operand of an int8 ``tl.dot`` with ``K = 32``.
* **Activations** (:func:`_planes_kernel`, one small launch): per 16 inputs (a weight sub-block)
  16-bit fixed point ``xq = round(x / a_s)``, ``a_s = max|x_s| / 32639``, split ``xq = 256 hi +
  lo``, written as the A operand ``[16, K]`` int8, block diagonal by sub-block within each half:
  row ``8 p + s`` holds the high (``p = 0``) or low byte of the inputs ``k`` with ``(k % 128) // 16
  == s``, zeros elsewhere, so row ``8 p + s`` of a half's ``[16, BLOCK_N]`` product is sub-block
  ``8 h + s``'s partial. Columns are in input order. A sub-block holding a NaN or an infinity gets
  ``a_s`` NaN (every output NaN, never a silent finite value).
* **Scales**: ``Σ_k x_k w_k = d sc_s a_s Σ xq (q − 32) = d sc_s a_s (64 V_hi + V_lo / 4)``, with
  ``V`` the int32 dot of ``xq``'s bytes and ``4 (q − 32)`` (exact), joined as ``256 V_hi + V_lo``
  in int32 (below 2^26) so the accumulator keeps one row a sub-block (``_PAIR``, as
  :mod:`.gguf_mma`'s); its rows are summed once after the K loop. No ``S_s`` term: Q6_K has no
  minimum. The block's last 32 bytes (``scales``, ``d``, padding) load as one ``[BLOCK_N, 32]``
  tile and reach the accumulator's layout through four more int8 dots with 0/1 selectors
  (:func:`_selector`: ``scales[8 h + r % 8]`` for each half, ``d``'s two bytes), exact; since they
  feed dots, Triton pipelines those loads with the codes (H200, decode_ab two builds: 8B Q4_K_M
  2489 -> 2483 µs, 1B 735 -> 728; ``_SCALE_DOT``).

Split-K, the epilogue, PDL and the L2 prefetch before the wait are :mod:`.gguf_mma`'s.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdsl.quant import code_rows

from ..device import triton_interprets
from ..gguf_blocks import STORED_BLOCK_BYTES
from .gguf_mma import (_bytes, _finish, _norm_weight, _pair_rows, _rms_in_factor, _rows16, rms_args, slices,
                       split_for)
from .gguf_tiles import layout_args
from .pdl import pdl_launch, pdl_trigger, pdl_wait, prefetch_l2

__all__ = ["q6k_activation_planes", "gguf_gemv_q6k", "pick_q6k_config"]

_STRIDE: tl.constexpr = tl.constexpr(STORED_BLOCK_BYTES["Q6_K"])    # bytes a stored Q6_K block (224)
_SUPER = 256
_CONFIG_KEYS = {"BLOCK_N", "SPLIT_K", "num_warps", "num_stages"}
_PREFETCH_LINES = 2             # 128-byte lines of each row's first block asked of L2 before the PDL wait
_BLOCK_N = 64                   # weight rows a tile (pick_q6k_config)
_STAGES = 2                     # pipeline stages of the K loop (pick_q6k_config)
# each block's scales and d reach the accumulator's layout through int8 dots with 0/1 selectors
# (_selector): their loads feed dots, so Triton pipelines them with the codes; otherwise plain loads
# each step, unpacked and moved into that layout by shuffles (_step_scales)
_SCALE_DOT = True
_PAIR = True                    # with _SCALE_DOT: one accumulator row a sub-block (gguf_mma._PAIR)


@triton.jit
def _planes_kernel(x_ptr, a_ptr, xa_ptr, K, USE_PDL: tl.constexpr):
    """Super-block ``program_id(0)`` of the row ``x [K]``: its ``[16, 256]`` A columns and the ``a_s``
    of its 16 sub-blocks (module docstring)."""
    pdl_wait(USE_PDL)
    b = tl.program_id(0)
    write_q6k_planes(tl.load(x_ptr + b * 256 + tl.arange(0, 256)).to(tl.float32), b, a_ptr, xa_ptr, K)


@triton.jit
def write_q6k_planes(x, b, a_ptr, xa_ptr, K):
    """Store super-block ``b``'s ``[16, 256]`` A columns and its 16 sub-blocks' ``a_s`` from its inputs
    ``x [256]`` (float32, in input order; module docstring)."""
    xs = tl.reshape(x, [16, 16])                                         # [sub-block, value]
    amax = tl.max(tl.abs(xs), axis=1)
    inv = tl.where(amax > 0, 32639.0 / tl.maximum(amax, 1e-30), 0.0)   # |xq| <= 32639: hi fits a byte
    xq = tl.reshape(tl.floor(xs * inv[:, None] + 0.5).to(tl.int32), [1, 256])
    hi = (xq + 128) >> 8                                                 # xq = 256 hi + lo, lo in [-128, 127]
    r = tl.arange(0, 16)[:, None]
    c = tl.arange(0, 256)[None, :]
    own = (c % 128) // 16 == r % 8
    val = tl.where(own, tl.where(r < 8, hi, xq - 256 * hi), 0)
    tl.store(a_ptr + r * K + b * 256 + c, val.to(tl.int8))
    a = amax / 32639.0 + tl.sum(xs - xs, axis=1)                         # NaN if a sub-block has a NaN or inf
    tl.store(xa_ptr + b * 16 + tl.arange(0, 16), a)


# _plane's PTX for plane I: bits 2-5 the nibble (shl 2 for the low one, shr 2 for the high one); bits 6-7 qh bits 2I,
# 2I+1 moved up by 6 - 2I; then bit 7 flipped: (q << 2) ^ 0x80 = 4 (q - 32) as a signed byte
_PLANE_ASM = tl.constexpr(tuple(
    "{ .reg .b32 t, u; " + shifts
    + " lop3.b32 u, u, 0xC0C0C0C0, 0x80808080, 0x6a; lop3.b32 $0, t, 0x3C3C3C3C, u, 0xea; }"
    for shifts in ("shl.b32 t, $1, 2; shl.b32 u, $2, 6;", "shl.b32 t, $1, 2; shl.b32 u, $2, 4;",
                   "shr.b32 t, $1, 2; shl.b32 u, $2, 2;", "shr.b32 t, $1, 2; mov.b32 u, $2;")))


@triton.jit
def _plane(ql, qh, I: tl.constexpr, EMULATE: tl.constexpr):
    """Value plane ``I`` (module docstring) of a half's ``ql`` bytes (``ql[l]`` for planes 0 and 2,
    ``ql[32 + l]`` for 1 and 3) and ``qh`` bytes ``[BLOCK_N, 32]`` as int8 ``4 (q - 32)``
    (``EMULATE``: int32 arithmetic for the CPU interpreter, which runs no PTX; ``_PLANE_ASM`` runs
    through a PTX interpreter against it in ``tests/kernels/test_packed_ptx.py``)."""
    if EMULATE:
        lo = (ql.to(tl.int32) >> 4) if I >= 2 else (ql.to(tl.int32) & 15)
        q = lo | (((qh.to(tl.int32) >> (2 * I)) & 3) << 4)
        return (4 * q - 128).to(tl.int8)
    return tl.inline_asm_elementwise(_PLANE_ASM[I], "=r,r,r", [ql, qh], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _selector(r, c, base: tl.constexpr, PER_ROW: tl.constexpr):
    """``[16, 32]`` int8: 1 where column ``c`` is ``base + r % 8`` (``PER_ROW``) or ``base``, else 0.
    ``dot(selector, trans(bytes [BLOCK_N, 32]))`` is then ``bytes[n, base + r % 8]`` (or ``bytes[n,
    base]``) as int32 at ``[r, n]``, the accumulator's layout, exactly."""
    want = base + (r % 8 if PER_ROW else 0 * r)
    return tl.where(c[None, :] == want[:, None], 1, 0).to(tl.int8)


@triton.jit
def _step_scales(words, h, i4, BLOCK_N: tl.constexpr):
    """Half ``h``'s eight int8 scales of each row as ``[BLOCK_N, 8]`` float32, from the block's scale
    words (plain loads)."""
    s0 = _bytes(tl.load(words + 48 + 2 * h), i4)            # scales[8 h .. 8 h + 8) as [BLOCK_N, 4] x 2
    s1 = _bytes(tl.load(words + 49 + 2 * h), i4)
    sc = tl.reshape(tl.join(s0, s1), [BLOCK_N, 4, 2])
    sc = tl.reshape(tl.permute(sc, (0, 2, 1)), [BLOCK_N, 8])
    return ((sc ^ 128) - 128).to(tl.float32)                # int8


@triton.jit
def _q6k_kernel(
    a_ptr, xa_ptr,           # activation planes [16, K] int8, a_s [K / 16] float32
    w_ptr,                   # uint8 stored Q6_K blocks (224 B): rows [N, ROW_BYTES], or block-major (KB)
    add_ptr,                 # HAS_ADD: [N] residual row or bias, contiguous
    out_ptr,                 # [N] output row
    part_ptr, lock_ptr,      # SPLIT: [SPLIT_K, n_tiles, BLOCK_N] float32 partials, [n_tiles] counters
    N, K, ROW_BYTES, PER,    # sizes (N: output columns); PER super-blocks per K slice
    SPLIT_K,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_ADD: tl.constexpr, EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr, LATE_LAUNCH: tl.constexpr,   # (:mod:`.pdl`) the next kernel launches after the K loop
    PREFETCH: tl.constexpr = 0,
    KB: tl.constexpr = False, BYTES: tl.constexpr = _STRIDE, KB_STRIDE=0,   # block-major (gguf_tiles.layout_args)
    rin_ptr=None, RIN_CHUNKS=1, rin_inv_n=1.0, rin_eps=0.0,   # a carried RMSNorm (gguf_mma._q4k_kernel's)
    RMS_IN: tl.constexpr = False, RIN_BLOCK: tl.constexpr = 1,
    g_ptr=None, scaled_ptr=None, rpart_ptr=None, RMS_OUT: tl.constexpr = False,
    pa_ptr=None, pxa_ptr=None, pxs_ptr=None, PLANES: tl.constexpr = False,   # RMS_OUT: the Q4_K A operand too
    SCALE_DOT: tl.constexpr = False,   # scales and d through selector dots (_SCALE_DOT)
    PAIR: tl.constexpr = False,        # SCALE_DOT: one accumulator row a sub-block (gguf_mma._PAIR)
):
    """out[n] = sum_k x[k] dequant(w)[n, k] (+ add[n]) for ``BLOCK_N`` rows over super-blocks
    ``[pid_s PER, (pid_s + 1) PER)``; rows past ``N`` read row ``N - 1`` (never stored)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    rows = w_ptr + rn.to(tl.int64) * ROW_BYTES
    BS = KB_STRIDE if KB else BYTES                        # bytes between a row's super-blocks
    if PREFETCH > 0 and USE_PDL:
        end = pid_s * PER * BS + BYTES if KB else tl.minimum(pid_s * PER + PER, K // 256) * BYTES
        prefetch_l2(rows[:, None], pid_s * PER * BS, end, PREFETCH, 128)
    g = _norm_weight(g_ptr, pid_n, N, BLOCK_N, RMS_OUT)
    pdl_wait(USE_PDL, not LATE_LAUNCH)
    rs = _rms_in_factor(rin_ptr, RIN_CHUNKS, rin_inv_n, rin_eps, RMS_IN, RIN_BLOCK)
    b_lo = pid_s * PER
    sums = q6k_sums(rows, BS, b_lo, tl.minimum(b_lo + PER, K // 256), a_ptr, xa_ptr, K, BLOCK_N, EMULATE, SCALE_DOT,
                    PAIR)
    if LATE_LAUNCH:
        pdl_trigger(USE_PDL)
    _finish(sums, pid_n, pid_s, add_ptr, out_ptr, part_ptr, lock_ptr, N, SPLIT_K, BLOCK_N, SPLIT,
            HAS_ADD, False, pa_ptr, pxa_ptr, pxs_ptr, PLANES, False, rs, RMS_IN, g, scaled_ptr, rpart_ptr, RMS_OUT)


@triton.jit
def q6k_sums(rows, BS, b_lo, b_hi, a_ptr, xa_ptr, K, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr,
             SCALE_DOT: tl.constexpr, PAIR: tl.constexpr):
    """``[BLOCK_N]`` float32: ``Σ_k x[k] dequant(W)[n, k]`` over super-blocks ``[b_lo, b_hi)`` of the
    stored Q6_K rows ``rows`` (``BLOCK_N`` row pointers, ``BS`` bytes between a row's blocks) against
    the A operand ``a_ptr [16, K]`` and its ``a_s`` (module docstring) — :func:`_q6k_kernel`'s K loop,
    shared with the MoE experts' (:mod:`.moe_gguf_mma`)."""
    j = tl.arange(0, 32)
    r = tl.arange(0, 16)
    i4 = tl.arange(0, 4)
    part_w = tl.where(r < 8, 64.0, 0.25)                  # 256 / 4 on the high bytes' rows, 1 / 4 on the low
    if PAIR:
        acc = tl.zeros([8, BLOCK_N], tl.float32)
        arow = tl.arange(0, 8)
    else:
        acc = tl.zeros([16, BLOCK_N], tl.float32)
        arow = r
    if SCALE_DOT:                                          # bytes 192.. of a block: scales[16], d, padding
        sel_lo = _selector(r, j, 16, False)
        sel_hi = _selector(r, j, 17, False)
        sel_h0 = _selector(r, j, 0, True)
        sel_h1 = _selector(r, j, 8, True)
        nxa0 = tl.load(xa_ptr + b_lo * 16 + arow % 8)        # the activation scales a step ahead
        nxa1 = tl.load(xa_ptr + b_lo * 16 + 8 + arow % 8)
    for b in range(b_lo, b_hi):
        blk = rows[:, None] + b * BS
        words = (rows + b * BS).to(tl.pointer_type(tl.int32))
        if SCALE_DOT:
            tail = tl.trans(tl.load(blk + (192 + j)[None, :]).to(tl.int8, bitcast=True))
            d_lo = tl.dot(sel_lo, tail, out_dtype=tl.int32)
            d_hi = tl.dot(sel_hi, tail, out_dtype=tl.int32)
            if PAIR:                                       # rows s and 8 + s hold the same bytes
                d_lo, _ = _pair_rows(d_lo, BLOCK_N)
                d_hi, _ = _pair_rows(d_hi, BLOCK_N)
            d16 = ((d_hi & 255) << 8) | (d_lo & 255)
            d16 = d16.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)   # d at [r, n]
            xa0, xa1 = nxa0, nxa1
            nb = tl.minimum(b + 1, b_hi - 1)
            nxa0 = tl.load(xa_ptr + nb * 16 + arow % 8)
            nxa1 = tl.load(xa_ptr + nb * 16 + 8 + arow % 8)
        else:
            d = (tl.load(words + 52) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        for h in tl.static_range(2):
            ql0 = tl.load(blk + (64 * h + j)[None, :])
            ql1 = tl.load(blk + (64 * h + 32 + j)[None, :])
            qh = tl.load(blk + (128 + 32 * h + j)[None, :])
            col = a_ptr + r[:, None] * K + (b * 256 + 128 * h + j)[None, :]
            v = tl.dot(tl.load(col), tl.trans(_plane(ql0, qh, 0, EMULATE)), out_dtype=tl.int32)
            v = tl.dot(tl.load(col + 32), tl.trans(_plane(ql1, qh, 1, EMULATE)), v, out_dtype=tl.int32)
            v = tl.dot(tl.load(col + 64), tl.trans(_plane(ql0, qh, 2, EMULATE)), v, out_dtype=tl.int32)
            v = tl.dot(tl.load(col + 96), tl.trans(_plane(ql1, qh, 3, EMULATE)), v, out_dtype=tl.int32)
            if SCALE_DOT:
                if h == 0:
                    sc = tl.dot(sel_h0, tail, out_dtype=tl.int32)   # scales[8 h + r % 8]
                    xa = xa0
                else:
                    sc = tl.dot(sel_h1, tail, out_dtype=tl.int32)
                    xa = xa1
                if PAIR:                                   # |256 V_h + V_l| < 2^26: exact in int32
                    sc, _ = _pair_rows(sc, BLOCK_N)
                    vh, vl = _pair_rows(v, BLOCK_N)
                    acc += (vh * 256 + vl).to(tl.float32) * (d16 * sc.to(tl.float32)) * (xa * 0.25)[:, None]
                else:
                    acc += v.to(tl.float32) * (d16 * sc.to(tl.float32)) * (xa * part_w)[:, None]
            else:
                xa = tl.load(xa_ptr + b * 16 + 8 * h + r % 8)
                sc = _step_scales(words, h, i4, BLOCK_N)
                acc += v.to(tl.float32) * _rows16(d[:, None] * sc, BLOCK_N) * (xa * part_w)[:, None]
    return tl.sum(acc, axis=0)


def q6k_activation_planes(x: torch.Tensor, planes: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The A operand ``[16, K]`` int8 and per-16-input ``a_s`` ``[K / 16]`` float32 of the row ``x [K]``
    (module docstring), written into ``planes`` when given."""
    k = x.numel()
    if planes is None:
        planes = (torch.empty(16, k, dtype=torch.int8, device=x.device),
                  torch.empty(k // 16, dtype=torch.float32, device=x.device))
    _planes_kernel[(k // _SUPER,)](x, *planes, k, **pdl_launch(x.device))
    return planes


def pick_q6k_config(n: int, k: int, sms: int) -> dict:
    """Launch of :func:`gguf_gemv_q6k`: :func:`.gguf_mma.pick_mma_config`'s rule (64 rows, 4 warps;
    K split in two while the grid has fewer than two programs a SM and each slice keeps at least
    ``gguf_mma._MIN_SLICE`` super-blocks), 2 stages (3 measured no faster in the model on an H200).
    H100 sweep (BLOCK_N 32/64/128, 4/8 warps, 2-4 stages, split 1-8; CUDA graph over HBM-resident
    copies): that launch was the best or within 3% on o, qkv, gate and down (down 29.8 µs against
    49.8 on the CUDA cores)."""
    return dict(BLOCK_N=_BLOCK_N, SPLIT_K=split_for(triton.cdiv(n, _BLOCK_N), k // _SUPER, sms), num_warps=4,
                num_stages=_STAGES)


def gguf_gemv_q6k(x: torch.Tensor, data: torch.Tensor, add: torch.Tensor | None, out: torch.Tensor,
                  workspace, config: dict | None, sms: int, planes=None, rms_out=None, rms_in=None,
                  early_launch: bool = False) -> torch.Tensor:
    """``out [1, N] = x [1, K] @ dequant(data).T (+ add)`` for stored Q6_K blocks (``data [N, K / 256 *
    224]``, or block-major ``[K / 256, N, 224]``), x fp16/bf16; operands checked by
    :func:`.gguf_linear.gguf_gemv`, which calls this. ``workspace``: a :class:`~.gemv.GemvWorkspace`
    (activation planes, split-K partials). ``planes``: x's A operand and ``a_s`` already made (by a
    Q4_K SwiGLU GEMV's epilogue, :func:`.gguf_mma.gguf_gemv_mma`'s ``planes_out``), so no activation
    launch. ``rms_out`` / ``rms_in``: a carried RMSNorm, ``early_launch`` the next kernel let in at its
    wait, as :func:`.gguf_mma.gguf_gemv_mma`'s."""
    from .gemv import GemvWorkspace
    row_stride, layout = layout_args(data, "Q6_K")
    n, k = code_rows(data), x.shape[1]
    cfg = dict(config or pick_q6k_config(n, k, sms))
    block_n, split = cfg.pop("BLOCK_N"), cfg.pop("SPLIT_K")
    per, split = slices(k // _SUPER, split)
    ws = workspace or GemvWorkspace()
    if planes is None:
        planes = q6k_activation_planes(x[0], ws.q6k_planes(x.device, k))
    n_tiles = triton.cdiv(n, block_n)
    part, lock = ws.get(x.device, n_tiles, split, block_n) if split > 1 else (out, out)
    _q6k_kernel[(n_tiles, split)](
        *planes, data, add if add is not None else out, out, part, lock, n, k, row_stride, per, split,
        BLOCK_N=block_n, SPLIT=split > 1, HAS_ADD=add is not None, EMULATE=triton_interprets(),
        LATE_LAUNCH=n_tiles * split > sms and not early_launch, PREFETCH=_PREFETCH_LINES, SCALE_DOT=_SCALE_DOT,
        PAIR=_SCALE_DOT and _PAIR, **pdl_launch(x.device), **layout,
        **rms_args("gguf_gemv", rms_out, rms_in, n, k, block_n, False, out), **cfg)
    return out
