"""Triton tile decoders for GGUF block formats, read straight from the file's block bytes.

Each ``_tile_<type>(rows, n_ok, blk0, BS, SB)`` decodes, for ``BLOCK_N`` weight rows at once (``rows``:
``[BLOCK_N]`` uint8 pointers to the rows' first byte; ``n_ok``: which of them exist), the ``SB``
consecutive blocks starting at block ``blk0`` of every row (block ``b`` of a row ``BS · b`` bytes
after its first: the block bytes for stored rows, ``N`` times them block-major,
:func:`graphdsl.runtime.gguf_blocks.strides`) and returns

- ``w``: float32 ``[BLOCK_N, SB * values_per_block]``, the dequantized values in *tile order*: the
  order that falls out of loading the packed bytes contiguously and splitting each byte into its
  nibbles (``tl.join``), which is not the order of K;
- ``koff``: int32 ``[SB * values_per_block]``, the K offset (from ``blk0 * values_per_block``) of
  each tile position.

So a consumer reads the activations at ``koff`` (GEMV: a gather from a row that sits in L1/L2) or
stores the tile at ``koff`` (dequantize), and the weight bytes are read once, in order. The math per
format is the one of :mod:`graphdsl.runtime.gguf_blocks` (the reference these tiles are tested against); the
byte offsets used are written next to each load.

The rows are in the stored layout (:func:`graphdsl.runtime.gguf_blocks.to_stored`): the file's
blocks, Q6_K's padded from 210 to 224 bytes (:data:`KERNEL_QTYPES` has the stored sizes), row by
row or block-major. Float16 fields are assembled from two byte loads (blocks of 18 or 34 bytes
leave them only 2-byte aligned), then bitcast.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..gguf_blocks import GGUF_BLOCKS, STORED_BLOCK_BYTES
from ..gguf_blocks import KERNEL_QTYPES as _NAMES
from ..gguf_blocks import strides

__all__ = ["KERNEL_QTYPES", "decode_tile", "row_codes", "row_dot", "row_total", "row_zeros", "layout_args",
           "q4k_planes", "q4k_planes_dt", "q6k_plane", "q6k_plane_dt", "q8_0_plane", "k_planes", "q6k_plane_of",
           "PLANE_QTYPES"]

# GGML types with a Triton tile decoder: name -> (values per block, bytes per stored block)
KERNEL_QTYPES: dict[str, tuple[int, int]] = {
    name: (GGUF_BLOCKS[name][0], STORED_BLOCK_BYTES.get(name, GGUF_BLOCKS[name][1])) for name in _NAMES}
# the types with a 32-value plane decoder in K order (q4k_planes, q6k_plane, q8_0_plane)
PLANE_QTYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")


def layout_args(data, qtype: str) -> tuple[int, dict]:
    """A GGUF kernel's view of the blocks ``data`` of ``qtype`` (stored rows ``[N, row_bytes]`` or
    block-major ``[blocks, N, bytes]``): the row stride in bytes, and the launch keywords ``KB``
    (block-major), ``BYTES`` (a stored block's size) and ``KB_STRIDE`` (block-major: the bytes
    between a row's blocks). A kernel's ``BS`` is ``KB_STRIDE if KB else BYTES``: a constant for
    stored rows."""
    row, blk = strides(data, qtype)
    return row, dict(KB=data.dim() == 3, BYTES=KERNEL_QTYPES[qtype][1], KB_STRIDE=blk)


@triton.jit
def _f16_at(ptr, mask=None):
    """float32 of the little-endian float16 at byte pointers ``ptr`` (any shape; ``mask``: which to read)."""
    if mask is None:
        lo = tl.load(ptr).to(tl.uint16)
        hi = tl.load(ptr + 1).to(tl.uint16)
    else:
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble_blocks(rows, n_ok, blk0, BS, SB: tl.constexpr, QS_AT: tl.constexpr):
    """The Q4_0 / Q4_1 nibble layout: block byte offsets ``[SB]``, the codes ``[BLOCK_N, SB, 16, 2]``
    (float32; value ``b`` is ``qs[b] & 15``, value ``b + 16`` is ``qs[b] >> 4``, ``qs`` at byte
    ``QS_AT`` of each block) and their K offsets in the tile."""
    g = tl.arange(0, SB)
    b = tl.arange(0, 16)
    h = tl.arange(0, 2)
    blk = (blk0 + g).to(tl.int64) * BS
    byte = tl.load(rows[:, None, None] + (blk[:, None] + QS_AT + b[None, :])[None, :, :],
                   mask=n_ok[:, None, None], other=0).to(tl.int32)
    q = tl.join(byte & 15, byte >> 4).to(tl.float32)
    koff = g[:, None, None] * 32 + b[None, :, None] + 16 * h[None, None, :]
    return blk, q, koff


@triton.jit
def _tile_q4_0(rows, n_ok, blk0, BS, SB: tl.constexpr):
    """Q4_0, 18 B: ``d f16 @0, qs[16] @2``; value ``b`` is ``qs[b] & 15``, value ``b + 16`` is
    ``qs[b] >> 4``; ``y = d * (q - 8)``. Tile ``[BLOCK_N, SB, 16, 2]`` (block, byte, nibble)."""
    blk, q, koff = _nibble_blocks(rows, n_ok, blk0, BS, SB, 2)                 # q: [BN, SB, 16, 2]
    d = _f16_at(rows[:, None] + blk[None, :], n_ok[:, None])                    # [BN, SB]
    w = d[:, :, None, None] * (q - 8.0)
    return tl.reshape(w, [w.shape[0], SB * 32]), tl.reshape(koff, [SB * 32])


@triton.jit
def _tile_q4_1(rows, n_ok, blk0, BS, SB: tl.constexpr):
    """Q4_1, 20 B: ``d f16 @0, m f16 @2, qs[16] @4``; nibbles as Q4_0; ``y = d * q + m``."""
    blk, q, koff = _nibble_blocks(rows, n_ok, blk0, BS, SB, 4)
    d = _f16_at(rows[:, None] + blk[None, :], n_ok[:, None])
    m = _f16_at(rows[:, None] + blk[None, :] + 2, n_ok[:, None])
    w = d[:, :, None, None] * q + m[:, :, None, None]
    return tl.reshape(w, [w.shape[0], SB * 32]), tl.reshape(koff, [SB * 32])


@triton.jit
def _fifth_bits(rows, n_ok, blk, QH_AT: tl.constexpr):
    """Q5_0 / Q5_1: the little-endian u32 ``qh`` at byte ``QH_AT`` of blocks ``blk`` (byte offsets
    ``[SB]``) as the fifth bit of each value, ``[BLOCK_N, SB, 16, 2]`` (value ``b`` takes bit ``b``,
    value ``b + 16`` bit ``b + 16``), int32."""
    byte = tl.load(rows[:, None, None] + (blk[:, None] + QH_AT + tl.arange(0, 4)[None, :])[None, :, :],
                   mask=n_ok[:, None, None], other=0).to(tl.int32)              # [BN, SB, 4]
    qh = tl.sum(byte << (8 * tl.arange(0, 4))[None, None, :], axis=2)          # the four bytes' bits do not overlap
    at = tl.arange(0, 16)[:, None] + 16 * tl.arange(0, 2)[None, :]             # [16, 2]
    return (qh[:, :, None, None] >> at[None, None, :, :]) & 1


@triton.jit
def _tile_q5(rows, n_ok, blk0, BS, SB: tl.constexpr, HAS_MIN: tl.constexpr):
    """Q5_0, 22 B: ``d f16 @0, qh u32 @2, qs[16] @6``, ``y = d * (q - 16)``; Q5_1 (``HAS_MIN``), 24 B:
    ``d @0, m @2, qh @4, qs @8``, ``y = d * q + m``; ``q`` is the Q4 nibble plus 16 times its fifth
    bit. Tile ``[BLOCK_N, SB, 16, 2]`` as Q4_0's."""
    blk, q, koff = _nibble_blocks(rows, n_ok, blk0, BS, SB, 8 if HAS_MIN else 6)
    q = q + 16.0 * _fifth_bits(rows, n_ok, blk, 4 if HAS_MIN else 2).to(tl.float32)
    d = _f16_at(rows[:, None] + blk[None, :], n_ok[:, None])
    if HAS_MIN:
        w = d[:, :, None, None] * q + _f16_at(rows[:, None] + blk[None, :] + 2, n_ok[:, None])[:, :, None, None]
    else:
        w = d[:, :, None, None] * (q - 16.0)
    return tl.reshape(w, [w.shape[0], SB * 32]), tl.reshape(koff, [SB * 32])


@triton.jit
def _tile_q8_0(rows, n_ok, blk0, BS, SB: tl.constexpr):
    """Q8_0, 34 B: ``d f16 @0, q[32] int8 @2``; ``y = d * q``. Tile ``[BLOCK_N, SB, 32]`` in K order."""
    g = tl.arange(0, SB)
    j = tl.arange(0, 32)
    blk = (blk0 + g).to(tl.int64) * BS
    byte = tl.load(rows[:, None, None] + (blk[:, None] + 2 + j[None, :])[None, :, :],
                   mask=n_ok[:, None, None], other=0)
    q = byte.to(tl.int8, bitcast=True).to(tl.float32)
    d = _f16_at(rows[:, None] + blk[None, :], n_ok[:, None])
    w = d[:, :, None] * q
    koff = g[:, None] * 32 + j[None, :]
    return tl.reshape(w, [w.shape[0], SB * 32]), tl.reshape(koff, [SB * 32])


@triton.jit
def _k_scales_mins(rows, n_ok, blk0, BS, SB: tl.constexpr):
    """Q4_K/Q5_K: ``d·sc_j`` and ``dmin·mn_j`` of the 8 sub-blocks of ``SB`` super-blocks,
    ``[BLOCK_N, SB * 8]``. ``d @0, dmin @2`` (f16), ``scales[12] @4``: for ``j < 4``
    ``sc = s[j] & 63, mn = s[j+4] & 63``; for ``j >= 4`` ``sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4``,
    ``mn = (s[j+4] >> 4) | (s[j] >> 6) << 4``."""
    u = tl.arange(0, SB * 8)
    j = u % 8
    base = (blk0 + u // 8).to(tl.int64) * BS
    lowj = j < 4
    p = rows[:, None] + base[None, :] + 4
    msk = n_ok[:, None]
    a = tl.load(p + tl.where(lowj, j, j + 4)[None, :], mask=msk, other=0).to(tl.int32)
    b = tl.load(p + tl.where(lowj, j + 4, j - 4)[None, :], mask=msk, other=0).to(tl.int32)
    c = tl.load(p + j[None, :], mask=msk, other=0).to(tl.int32)
    sc = tl.where(lowj[None, :], a & 63, (a & 15) | ((b >> 6) << 4)).to(tl.float32)
    mn = tl.where(lowj[None, :], b & 63, (a >> 4) | ((c >> 6) << 4)).to(tl.float32)
    d = _f16_at(rows[:, None] + base[None, :], msk)
    dmin = _f16_at(rows[:, None] + base[None, :] + 2, msk)
    return d * sc, dmin * mn


@triton.jit
def _k_scaled(q, rows, n_ok, blk0, BS, SB: tl.constexpr):
    """Q4_K / Q5_K: the codes ``q [BN, SB*4, 32, 2]`` (32-byte chunk ``t``, byte ``l``, nibble ``h``;
    sub-block ``j = 2(t % 4) + h``) scaled ``d·sc[j]·q - dmin·m[j]``, as the tile ``[BN, SB*256]``
    and its K offsets ``64t + l + 32h``."""
    t = tl.arange(0, SB * 4)
    l = tl.arange(0, 32)
    h = tl.arange(0, 2)
    scale, mins = _k_scales_mins(rows, n_ok, blk0, BS, SB)             # [BN, SB*8], j = 2c + h
    scale = tl.expand_dims(tl.reshape(scale, [scale.shape[0], SB * 4, 2]), 2)
    mins = tl.expand_dims(tl.reshape(mins, [mins.shape[0], SB * 4, 2]), 2)
    w = scale * q - mins
    koff = 64 * t[:, None, None] + l[None, :, None] + 32 * h[None, None, :]
    return tl.reshape(w, [w.shape[0], SB * 256]), tl.reshape(koff, [SB * 256])


@triton.jit
def _tile_q4_k(rows, n_ok, blk0, BS, SB: tl.constexpr):
    """Q4_K, 144 B: ``qs[128] @16``; chunk ``c`` (64 values) is ``qs[32c : 32c + 32]``, low nibbles
    sub-block ``2c``, high nibbles ``2c + 1``; ``y = d·sc·q − dmin·mn``. Tile ``[BLOCK_N, SB*4, 32, 2]``
    (super-block·chunk ``t``, byte ``l``, nibble ``h``) at K offset ``64t + 32h + l``."""
    t = tl.arange(0, SB * 4)
    l = tl.arange(0, 32)
    off = (blk0 + t // 4).to(tl.int64) * BS + 16 + 32 * (t % 4)
    byte = tl.load(rows[:, None, None] + (off[:, None] + l[None, :])[None, :, :],
                   mask=n_ok[:, None, None], other=0).to(tl.int32)
    q = tl.join(byte & 15, byte >> 4).to(tl.float32)                            # [BN, T, 32, 2]
    return _k_scaled(q, rows, n_ok, blk0, BS, SB)


@triton.jit
def _tile_q5_k(rows, n_ok, blk0, BS, SB: tl.constexpr):
    """Q5_K, 176 B: as Q4_K with ``qh[32] @16``, ``qs[128] @48``; the fifth bit of value ``l`` of
    sub-block ``j`` is bit ``j`` of ``qh[l]``."""
    t = tl.arange(0, SB * 4)
    l = tl.arange(0, 32)
    h = tl.arange(0, 2)
    sb = (blk0 + t // 4).to(tl.int64) * BS
    msk = n_ok[:, None, None]
    byte = tl.load(rows[:, None, None] + (sb + 48 + 32 * (t % 4))[None, :, None] + l[None, None, :],
                   mask=msk, other=0).to(tl.int32)
    qh = tl.load(rows[:, None, None] + (sb + 16)[None, :, None] + l[None, None, :],
                 mask=msk, other=0).to(tl.int32)                                # [BN, T, 32]
    shift = (2 * (t % 4))[:, None, None] + h[None, None, :]                     # sub-block j = 2c + h
    high = (tl.expand_dims(qh, 3) >> shift) & 1
    q = (tl.join(byte & 15, byte >> 4) | (high << 4)).to(tl.float32)
    return _k_scaled(q, rows, n_ok, blk0, BS, SB)


@triton.jit
def _tile_q6_k(rows, n_ok, blk0, BS, SB: tl.constexpr):
    """Q6_K, 210 B (stored in 224): ``ql[128] @0, qh[64] @128, scales[16] int8 @192, d f16 @208``. Value
    ``128·hf + 32k + l`` (``k`` 0..3, ``l`` 0..31) is ``(ql[64hf + 32(k%2) + l] >> 4(k//2)) & 15 |
    ((qh[32hf + l] >> 2k) & 3) << 4``, minus 32, times ``d·scales[8hf + 2k + l//16]``.

    Tile ``[BLOCK_N, SB*8, 16, 2]``: group ``i = 4hf + 2a + l2`` (``a = k % 2``, ``l = 16·l2 + l1``)
    reads ``ql[16i + l1]`` contiguously, nibble ``b = k // 2``; its scale index is
    ``8hf + 2a + l2 + 4b = i + 4(i//4) + 4b``."""
    t = tl.arange(0, SB * 8)
    l1 = tl.arange(0, 16)
    b = tl.arange(0, 2)
    i = t % 8
    sb = (blk0 + t // 8).to(tl.int64) * BS
    msk = n_ok[:, None, None]
    ql = tl.load(rows[:, None, None] + (sb + 16 * i)[None, :, None] + l1[None, None, :],
                 mask=msk, other=0).to(tl.int32)                                # [BN, T, 16]
    qh = tl.load(rows[:, None, None] + (sb + 128 + 32 * (i // 4) + 16 * (i % 2))[None, :, None]
                 + l1[None, None, :], mask=msk, other=0).to(tl.int32)
    shift = (2 * ((i // 2) % 2))[:, None, None] + 4 * b[None, None, :]          # 2k
    high = (tl.expand_dims(qh, 3) >> shift) & 3
    q = (tl.join(ql & 15, ql >> 4) | (high << 4)).to(tl.float32) - 32.0       # [BN, T, 16, 2]
    sidx = (sb + 192 + i + 4 * (i // 4))[:, None] + 4 * b[None, :]              # [T, 2]
    sc = tl.load(rows[:, None, None] + sidx[None, :, :], mask=msk, other=0)
    sc = sc.to(tl.int8, bitcast=True).to(tl.float32)                            # [BN, T, 2]
    d = _f16_at(rows[:, None] + (sb + 208)[None, :], n_ok[:, None])             # [BN, T]
    w = tl.expand_dims(d[:, :, None] * sc, 2) * q
    koff = (256 * (t // 8) + 128 * (i // 4) + 32 * ((i // 2) % 2) + 16 * (i % 2))[:, None, None] \
        + l1[None, :, None] + 64 * b[None, None, :]
    return tl.reshape(w, [w.shape[0], SB * 256]), tl.reshape(koff, [SB * 256])


@triton.jit
def decode_tile(rows, n_ok, blk0, BS, QTYPE: tl.constexpr, SB: tl.constexpr):
    """``(w [BLOCK_N, SB * values_per_block] float32, koff)`` of GGML type ``QTYPE`` (a name in
    :data:`KERNEL_QTYPES`), blocks ``BS`` bytes apart; see the module docstring."""
    if QTYPE == "Q4_0":
        w, koff = _tile_q4_0(rows, n_ok, blk0, BS, SB)
    elif QTYPE == "Q4_1":
        w, koff = _tile_q4_1(rows, n_ok, blk0, BS, SB)
    elif QTYPE == "Q5_0" or QTYPE == "Q5_1":
        w, koff = _tile_q5(rows, n_ok, blk0, BS, SB, QTYPE == "Q5_1")
    elif QTYPE == "Q8_0":
        w, koff = _tile_q8_0(rows, n_ok, blk0, BS, SB)
    elif QTYPE == "Q4_K":
        w, koff = _tile_q4_k(rows, n_ok, blk0, BS, SB)
    elif QTYPE == "Q5_K":
        w, koff = _tile_q5_k(rows, n_ok, blk0, BS, SB)
    else:
        tl.static_assert(QTYPE == "Q6_K", "decode_tile: unsupported GGML type")
        w, koff = _tile_q6_k(rows, n_ok, blk0, BS, SB)
    return w, koff


# --------------------------------------------------------------------------- 32-value planes in K order
# A K-type super-block decoded a 32-value plane at a time, straight into K order: Q4_K's 32-byte chunk
# holds one sub-block in its low nibbles and the next in its high ones; a Q6_K half holds four planes.
# Small enough to keep in registers beside a matmul's accumulator (the MoE plane kernels,
# moe_gguf_mma), and stored contiguously by the dequantize kernel.


@triton.jit
def _word_f16(w, HIGH: tl.constexpr):
    """float32 of the low (or ``HIGH``) float16 of the int32 words ``w``."""
    return ((w >> 16) if HIGH else (w & 0xFFFF)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4k_scale_min(dd, w1, w2, w3, j):
    """``(d·sc_j, dmin·m_j)`` of Q4_K sub-block ``j`` (0..7) from a super-block's header words (``d, dmin``;
    ``scales[12]`` as three words): 6-bit ``sc, m``; ``j < 4`` bytes ``j``, ``j + 4``; else split over
    bytes ``j + 4`` and ``j − 4`` (:mod:`.gguf_tiles`' ``_k_scales_mins``)."""
    sh = 8 * (j % 4)
    b1, b2, b3 = (w1 >> sh) & 255, (w2 >> sh) & 255, (w3 >> sh) & 255
    low = j < 4
    sc = tl.where(low, b1 & 63, (b3 & 15) | ((b1 >> 6) << 4)).to(tl.float32)
    mn = tl.where(low, b2 & 63, (b3 >> 4) | ((b2 >> 6) << 4)).to(tl.float32)
    return _word_f16(dd, False) * sc, _word_f16(dd, True) * mn


@triton.jit
def q4k_planes(rows, kc, BS, FIVE: tl.constexpr = False):
    """The Q4_K rows' weights of 64-input chunk ``kc`` (32 code bytes of super-block ``kc // 4``, ``BS``
    bytes between a row's super-blocks) as two float32 ``[BLOCK_N, 32]`` planes in K order: inputs
    ``64 kc + l`` (the low nibbles, sub-block ``2 (kc % 4)``) and ``64 kc + 32 + l`` (the high ones,
    the next sub-block). ``FIVE``: Q5_K (176 B: ``qh[32] @16``, ``qs @48``), value ``l`` of sub-block
    ``j`` adding 16 times bit ``j`` of ``qh[l]``. Loads carry no mask: every row pointer must be a row's."""
    j = tl.arange(0, 32)
    c = kc % 4
    blk = rows + (kc // 4) * BS                             # d, dmin @0; scales[12] @4; qs[128] @16 (Q5_K @48)
    words = blk.to(tl.pointer_type(tl.int32))
    dd, w1, w2, w3 = tl.load(words), tl.load(words + 1), tl.load(words + 2), tl.load(words + 3)
    codes = tl.load(blk[:, None] + ((48 if FIVE else 16) + 32 * c + j)[None, :]).to(tl.int32)
    lo, hi = codes & 15, codes >> 4
    if FIVE:
        qh = tl.load(blk[:, None] + (16 + j)[None, :]).to(tl.int32)
        lo = lo | (((qh >> (2 * c)) & 1) << 4)
        hi = hi | (((qh >> (2 * c + 1)) & 1) << 4)
    s0, m0 = _q4k_scale_min(dd, w1, w2, w3, 2 * c)
    s1, m1 = _q4k_scale_min(dd, w1, w2, w3, 2 * c + 1)
    return lo.to(tl.float32) * s0[:, None] - m0[:, None], hi.to(tl.float32) * s1[:, None] - m1[:, None]


# packed fp16/bf16 constants (two lanes a register): 2^k and its negation, the magic of the codes' values; 1.0, -0.0
_PACKED = {"bf16x2": dict(magic="0x43004300", neg="0xC300C300", neg_q6="0xC320C320", one="0x3F803F80"),
           "f16x2": dict(magic="0x64006400", neg="0xE400E400", neg_q6="0xE420E420", one="0x3C003C00")}


def _nibble_fma_asm(op: str, high: bool) -> str:
    """:func:`_nibble_fma`'s PTX for one packed type (``bf16x2`` / ``f16x2``) and the low (or ``high``)
    nibbles: ``$2`` four code bytes, ``$3, $4`` the scales and ``$5, $6`` the negated mins (two values
    a register); ``$0, $1`` the four values. Only ``fma`` arithmetic (``x·1 − 2^k`` for the
    subtraction, exact): ``sub`` / ``mul`` on ``bf16x2`` need sm_90, ``fma`` sm_80."""
    c = _PACKED[op]
    shift = " shr.b32 a, a, 4; shr.b32 b, b, 4;" if high else ""
    half = " lop3.b32 t, {src}, 0x000F000F, k, 0xEA; fma.rn.%s t, t, o, n; fma.rn.%s {dst}, t, {s}, {m};" % (op, op)
    return ("{ .reg .b32 a, b, t, k, n, o, z; mov.b32 k, %s; mov.b32 n, %s; mov.b32 o, %s; mov.b32 z, 0;"
            % (c["magic"], c["neg"], c["one"])
            + " prmt.b32 a, $2, z, 0x4140; prmt.b32 b, $2, z, 0x4342;" + shift
            + half.format(src="a", dst="$0", s="$3", m="$5") + half.format(src="b", dst="$1", s="$4", m="$6") + " }")


# 2^7 + q (bf16) and 2^10 + q (fp16): exact for 4-bit q; low nibbles, high nibbles
_NIBBLES_BF16 = tl.constexpr(tuple(_nibble_fma_asm("bf16x2", high) for high in (False, True)))
_NIBBLES_FP16 = tl.constexpr(tuple(_nibble_fma_asm("f16x2", high) for high in (False, True)))


@triton.jit
def _nibble_fma(codes, s, m, HIGH: tl.constexpr, DT: tl.constexpr):
    """``s·q − m`` in ``DT`` (bf16 / fp16) for the low (or ``HIGH``) nibbles ``q`` of the code bytes
    ``codes`` (uint8), four bytes an instance of packed PTX: each nibble ORed into the mantissa of
    ``2^7`` (bf16) or ``2^10`` (fp16) — the value ``2^k + q``, exact — the ``2^k`` subtracted
    (exact), then one ``fma`` (one rounding) with the scale and the negated min; two values an
    instruction. ``s, m``: tensors in ``DT`` of ``codes``' shape."""
    if DT.is_bf16():
        w = tl.inline_asm_elementwise(_NIBBLES_BF16[HIGH], "=r,=r,r,r,r,r,r", [codes, s, -m], dtype=tl.bfloat16,
                                      is_pure=True, pack=4)
    else:
        w = tl.inline_asm_elementwise(_NIBBLES_FP16[HIGH], "=r,=r,r,r,r,r,r", [codes, s, -m], dtype=tl.float16,
                                      is_pure=True, pack=4)
    return w


@triton.jit
def q4k_planes_dt(rows, kc, BS, DT: tl.constexpr):
    """:func:`q4k_planes` (Q4_K only) straight in the activations' dtype ``DT`` (bf16 / fp16): the
    nibbles to values by :func:`_nibble_fma`, packed PTX — GPU only (the CPU interpreter, which runs
    no PTX, takes :func:`q4k_planes`). The scale and min rounded to ``DT`` first, then one rounding
    of ``s·q − m``: within the dtype's rounding of the float32 planes rounded once."""
    j = tl.arange(0, 32)
    c = kc % 4
    blk = rows + (kc // 4) * BS
    words = blk.to(tl.pointer_type(tl.int32))
    dd, w1, w2, w3 = tl.load(words), tl.load(words + 1), tl.load(words + 2), tl.load(words + 3)
    codes = tl.load(blk[:, None] + (16 + 32 * c + j)[None, :])
    s0, m0 = _q4k_scale_min(dd, w1, w2, w3, 2 * c)
    s1, m1 = _q4k_scale_min(dd, w1, w2, w3, 2 * c + 1)
    z = tl.zeros_like(codes).to(DT)
    return (_nibble_fma(codes, z + s0.to(DT)[:, None], z + m0.to(DT)[:, None], False, DT),
            _nibble_fma(codes, z + s1.to(DT)[:, None], z + m1.to(DT)[:, None], True, DT))


@triton.jit
def q8_0_plane(rows, kp, BS):
    """The Q8_0 rows' weights of block ``kp`` (34 B: ``d f16 @0, q[32] int8 @2``; ``BS`` bytes between a
    row's blocks) as float32 ``[BLOCK_N, 32]``: ``w = d·q``. ``d`` from two byte loads (blocks of 34
    bytes leave it 2-byte aligned at best). Loads carry no mask."""
    j = tl.arange(0, 32)
    blk = rows + kp * BS
    q = tl.load(blk[:, None] + (2 + j)[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
    return q * _f16_at(blk)[:, None]


def _q6k_values_asm(op: str, pl: int) -> str:
    """:func:`q6k_plane_dt`'s PTX (``bf16x2`` / ``f16x2``) for plane ``pl`` (0..3) of a half: ``$2`` four
    ``ql`` bytes, ``$3`` four ``qh`` bytes, ``$4, $5`` the scales (two values a register); ``$0, $1``
    four values ``s·(q − 32)``, ``q = (ql >> 4 (pl // 2)) & 15 | ((qh >> 2 pl) & 3) << 4`` byte by
    byte; ``fma`` arithmetic only (as :func:`_nibble_fma_asm`; ``+ (−0)`` for the product)."""
    c = _PACKED[op]
    hi = f"shl.b32 b, $3, {4 - 2 * pl};" if pl < 2 else ("mov.b32 b, $3;" if pl == 2 else "shr.b32 b, $3, 2;")
    lo = "mov.b32 a, $2;" if pl < 2 else "shr.b32 a, $2, 4;"
    return ("{ .reg .b32 a, b, q, k, n, o, z, m0; "
            + f"mov.b32 k, {c['magic']}; mov.b32 n, {c['neg_q6']}; mov.b32 o, {c['one']}; mov.b32 z, 0; "
            + "mov.b32 m0, 0x80008000; " + lo + " " + hi
            + " and.b32 q, a, 0x0F0F0F0F; lop3.b32 q, b, 0x30303030, q, 0xEA;"     # (b & 0x30..) | q
            + " prmt.b32 a, q, z, 0x4140; prmt.b32 b, q, z, 0x4342; or.b32 a, a, k; or.b32 b, b, k;"
            + f" fma.rn.{op} a, a, o, n; fma.rn.{op} b, b, o, n;"
            + f" fma.rn.{op} $0, a, $4, m0; fma.rn.{op} $1, b, $5, m0; }}")


_Q6K_BF16 = tl.constexpr(tuple(_q6k_values_asm("bf16x2", pl) for pl in range(4)))
_Q6K_FP16 = tl.constexpr(tuple(_q6k_values_asm("f16x2", pl) for pl in range(4)))


@triton.jit
def q6k_plane_dt(rows, sb, P: tl.constexpr, BS, DT: tl.constexpr):
    """:func:`q6k_plane` of plane ``P`` (0..7) of super-block ``sb`` straight in the activations' dtype
    ``DT`` (bf16 / fp16): the codes to ``2^k + q`` (exact), ``2^k + 32`` subtracted (exact), times
    ``d·sc`` rounded to ``DT`` (one rounding), four values an instance of packed PTX — GPU only (the
    CPU interpreter takes :func:`q6k_plane`)."""
    j = tl.arange(0, 32)
    blk = rows + sb * BS
    h: tl.constexpr = P // 4
    pl: tl.constexpr = P % 4
    ql = tl.load(blk[:, None] + (64 * h + 32 * (pl % 2) + j)[None, :])
    qh = tl.load(blk[:, None] + (128 + 32 * h + j)[None, :])
    words = (blk + 192).to(tl.pointer_type(tl.int32))
    sw = tl.load(words + 2 * h + pl // 2)
    sh: tl.constexpr = 16 * (pl % 2)
    sc0 = (((sw >> sh) & 255) ^ 128) - 128
    sc1 = (((sw >> (sh + 8)) & 255) ^ 128) - 128
    d = _word_f16(tl.load(words + 4), False)
    s = tl.where(j[None, :] < 16, (d * sc0.to(tl.float32))[:, None], (d * sc1.to(tl.float32))[:, None]).to(DT)
    if DT.is_bf16():
        w = tl.inline_asm_elementwise(_Q6K_BF16[pl], "=r,=r,r,r,r,r", [ql, qh, s], dtype=tl.bfloat16,
                                      is_pure=True, pack=4)
    else:
        w = tl.inline_asm_elementwise(_Q6K_FP16[pl], "=r,=r,r,r,r,r", [ql, qh, s], dtype=tl.float16,
                                      is_pure=True, pack=4)
    return w


@triton.jit
def q6k_plane(rows, kp, BS):
    """The stored Q6_K rows' weights (224-byte blocks: ``ql[128] @0, qh[64] @128, scales[16] int8 @192,
    d @208``; ``BS`` bytes between a row's blocks) of 32-input plane ``kp`` (inputs ``32 kp + l``:
    super-block ``kp // 8``, half ``h``, plane ``pl`` of the half) as float32 ``[BLOCK_N, 32]`` in K
    order: ``q`` from ``ql``'s nibble ``pl // 2`` and ``qh``'s bits ``2 pl``, ``2 pl + 1``;
    ``w = d·sc·(q − 32)``, ``sc`` the first 16 inputs' or the second's. Loads carry no mask."""
    j = tl.arange(0, 32)
    blk = rows + (kp // 8) * BS
    h, pl = (kp // 4) % 2, kp % 4
    ql = tl.load(blk[:, None] + (64 * h + 32 * (pl % 2) + j)[None, :]).to(tl.int32)
    qh = tl.load(blk[:, None] + (128 + 32 * h + j)[None, :]).to(tl.int32)
    q = ((ql >> (4 * (pl // 2))) & 15) | (((qh >> (2 * pl)) & 3) << 4)
    words = (blk + 192).to(tl.pointer_type(tl.int32))       # the 16 int8 scales as four words, then d
    sw = tl.load(words + 2 * h + pl // 2)                   # scales 8 h + 2 pl, + 1: bytes 2 (pl % 2), + 1
    sh = 16 * (pl % 2)
    sc0 = (((sw >> sh) & 255) ^ 128) - 128
    sc1 = (((sw >> (sh + 8)) & 255) ^ 128) - 128
    d = _word_f16(tl.load(words + 4), False)
    sc = tl.where(j[None, :] < 16, sc0[:, None], sc1[:, None]).to(tl.float32)
    return (q - 32).to(tl.float32) * (d[:, None] * sc)


@triton.jit
def k_planes(rows, kc, BS, FIVE: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr):
    """:func:`q4k_planes` (``FIVE``: Q5_K) of chunk ``kc``; with ``FAST`` (a GPU, Q4_K) straight in
    ``DT`` by packed PTX (:func:`q4k_planes_dt`): the one choice the plane loops make."""
    if FAST and not FIVE:
        w0, w1 = q4k_planes_dt(rows, kc, BS, DT)
    else:
        w0, w1 = q4k_planes(rows, kc, BS, FIVE)
    return w0, w1


@triton.jit
def q6k_plane_of(rows, sb, P: tl.constexpr, BS, FAST: tl.constexpr, DT: tl.constexpr):
    """Plane ``P`` (0..7) of super-block ``sb``: :func:`q6k_plane`, or with ``FAST`` (a GPU)
    :func:`q6k_plane_dt`."""
    if FAST:
        w = q6k_plane_dt(rows, sb, P, BS, DT)
    else:
        w = q6k_plane(rows, sb * 8 + P, BS)
    return w


# --------------------------------------------------------------------------- one activation row
# ``row_dot`` adds, for BLOCK_N weight rows, the products of ``SB`` blocks with one activation row
# into an accumulator (:func:`row_zeros`, reduced by :func:`row_total` after the K loop) without
# building a dequantized tile: each nibble plane (low / high nibbles, which sit 16 or 32 values
# apart in K) is multiplied by its own contiguous slice of x. Q6_K scales each value
# (``d·sc·q``) into an accumulator the shape of the step's values, reduced once after the K loop;
# the other types sum each sub-block's products first and apply its scale (and min:
# ``- dmin·mn·sum(x)``) to the sum, the accumulator holding the rows' running sums. Measured on
# the H200 (``benchmarks/gguf_gemv.py``, one run): per value, Q6_K's GEMVs took 42.1 µs instead of
# 48.2 on 8b.gate, 49.0 instead of 53.9 on 8b.down, while Q4_K's took 36.1 instead of 29.8 on
# 8b.gate — the per-step lane reductions (half of the Q4_K step's sm_90 SASS) are not what bounds
# it. Integers become floats through the exponent trick ``float(0x4B000000 | q) - 2^23 = q``
# (exact for ``q < 2^23``; one integer OR and one float add instead of an int-to-float convert,
# which Hopper issues at a quarter of the FMA rate), with the format's offset folded into the
# subtraction.


@triton.jit
def _i2f(q, OFFSET: tl.constexpr):
    """float32 ``q - OFFSET`` for int32 ``0 <= q < 2^23`` (exponent trick, exact)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _xload(x_ptr, offs, CG: tl.constexpr = False):
    """float32 activations; ``CG``: read from L2, past the SM's L1 (:func:`row_dot`)."""
    return tl.load(x_ptr + offs, cache_modifier=".cg" if CG else "").to(tl.float32)


@triton.jit
def _bytes_q4(rows, n_ok, blk0, BS, SB: tl.constexpr, HAS_MIN: tl.constexpr):
    """Q4_0 / Q4_1: the ``qs`` bytes ``[BN, SB, 16]`` of ``SB`` blocks from ``blk0``."""
    blk = (blk0 + tl.arange(0, SB)).to(tl.int64) * BS
    QS: tl.constexpr = 4 if HAS_MIN else 2
    return tl.load(rows[:, None, None] + (blk[:, None] + QS + tl.arange(0, 16)[None, :])[None, :, :],
                   mask=n_ok[:, None, None], other=0)


@triton.jit
def _row_dot_q4(acc, qs, rows, n_ok, blk0, BS, x_ptr, SB: tl.constexpr, HAS_MIN: tl.constexpr,
                CG: tl.constexpr = False):
    """Q4_0 (18 B: ``d, qs[16]``, ``y = d(q - 8)``) and Q4_1 (20 B: ``d, m, qs[16]``, ``y = dq + m``);
    ``qs`` from :func:`_bytes_q4`, ``acc [BN, 1, 1]``."""
    g = tl.arange(0, SB)
    b = tl.arange(0, 16)
    blk = (blk0 + g).to(tl.int64) * BS
    byte = qs.to(tl.int32)                                                      # [BN, SB, 16]
    koff = (blk0 + g)[:, None] * 32 + b[None, :]                                # [SB, 16]
    x_lo = _xload(x_ptr, koff, CG)
    x_hi = _xload(x_ptr, koff + 16, CG)
    d = _f16_at(rows[:, None] + blk[None, :], n_ok[:, None])                    # [BN, SB]
    if HAS_MIN:
        s = tl.sum(_i2f(byte & 15, 0.0) * x_lo[None] + _i2f(byte >> 4, 0.0) * x_hi[None], axis=2)
        m = _f16_at(rows[:, None] + blk[None, :] + 2, n_ok[:, None])
        y = d * s + m * tl.sum(x_lo + x_hi, axis=1)[None, :]
    else:
        s = tl.sum(_i2f(byte & 15, 8.0) * x_lo[None] + _i2f(byte >> 4, 8.0) * x_hi[None], axis=2)
        y = d * s
    return acc + tl.sum(y, axis=1)[:, None, None]


@triton.jit
def _bytes_q5(rows, n_ok, blk0, BS, SB: tl.constexpr, HAS_MIN: tl.constexpr):
    """Q5_0 / Q5_1: the ``qs`` bytes ``[BN, SB, 16]`` and the ``qh`` bytes ``[BN, SB, 4]`` of ``SB``
    blocks from ``blk0``."""
    blk = (blk0 + tl.arange(0, SB)).to(tl.int64) * BS
    QH: tl.constexpr = 4 if HAS_MIN else 2
    qs = tl.load(rows[:, None, None] + (blk[:, None] + QH + 4 + tl.arange(0, 16)[None, :])[None, :, :],
                 mask=n_ok[:, None, None], other=0)
    qh = tl.load(rows[:, None, None] + (blk[:, None] + QH + tl.arange(0, 4)[None, :])[None, :, :],
                 mask=n_ok[:, None, None], other=0)
    return qs, qh


@triton.jit
def _row_dot_q5(acc, qs, qh, rows, n_ok, blk0, BS, x_ptr, SB: tl.constexpr, HAS_MIN: tl.constexpr,
                CG: tl.constexpr = False):
    """Q5_0 (``y = d(q - 16)``) and Q5_1 (``y = dq + m``): :func:`_row_dot_q4` with each nibble's
    fifth bit from the block's ``qh`` (bit ``b`` for value ``b``, bit ``b + 16`` for value ``b + 16``);
    ``qs, qh`` from :func:`_bytes_q5`."""
    g = tl.arange(0, SB)
    b = tl.arange(0, 16)
    blk = (blk0 + g).to(tl.int64) * BS
    byte = qs.to(tl.int32)                                                      # [BN, SB, 16]
    high = tl.sum(qh.to(tl.int32) << (8 * tl.arange(0, 4))[None, None, :], axis=2)[:, :, None]   # [BN, SB, 1]
    lo = (byte & 15) | (((high >> b[None, None, :]) & 1) << 4)
    hi = (byte >> 4) | (((high >> (b + 16)[None, None, :]) & 1) << 4)
    koff = (blk0 + g)[:, None] * 32 + b[None, :]                                # [SB, 16]
    x_lo = _xload(x_ptr, koff, CG)
    x_hi = _xload(x_ptr, koff + 16, CG)
    d = _f16_at(rows[:, None] + blk[None, :], n_ok[:, None])                    # [BN, SB]
    if HAS_MIN:
        s = tl.sum(_i2f(lo, 0.0) * x_lo[None] + _i2f(hi, 0.0) * x_hi[None], axis=2)
        m = _f16_at(rows[:, None] + blk[None, :] + 2, n_ok[:, None])
        y = d * s + m * tl.sum(x_lo + x_hi, axis=1)[None, :]
    else:
        s = tl.sum(_i2f(lo, 16.0) * x_lo[None] + _i2f(hi, 16.0) * x_hi[None], axis=2)
        y = d * s
    return acc + tl.sum(y, axis=1)[:, None, None]


@triton.jit
def _bytes_q8_0(rows, n_ok, blk0, BS, SB: tl.constexpr):
    """Q8_0: the ``q`` bytes ``[BN, SB, 32]`` of ``SB`` blocks from ``blk0``."""
    blk = (blk0 + tl.arange(0, SB)).to(tl.int64) * BS
    return tl.load(rows[:, None, None] + (blk[:, None] + 2 + tl.arange(0, 32)[None, :])[None, :, :],
                   mask=n_ok[:, None, None], other=0)


@triton.jit
def _row_dot_q8_0(acc, qs, rows, n_ok, blk0, BS, x_ptr, SB: tl.constexpr, CG: tl.constexpr = False):
    """Q8_0 (34 B: ``d, q[32] int8``): int8 ``q`` read as ``(byte ^ 0x80) - 128``; ``qs`` from
    :func:`_bytes_q8_0`, ``acc [BN, 1, 1]``."""
    g = tl.arange(0, SB)
    j = tl.arange(0, 32)
    blk = (blk0 + g).to(tl.int64) * BS
    byte = qs.to(tl.int32)
    xv = _xload(x_ptr, (blk0 + g)[:, None] * 32 + j[None, :], CG)
    s = tl.sum(_i2f(byte ^ 0x80, 128.0) * xv[None], axis=2)
    d = _f16_at(rows[:, None] + blk[None, :], n_ok[:, None])
    return acc + tl.sum(d * s, axis=1)[:, None, None]


@triton.jit
def _k_scale_pair(rows, n_ok, base, j):
    """``(sc_j, mn_j)`` as float32 ``[BN, T]`` for per-column sub-block index ``j`` ``[T]`` and super-block
    byte offset ``base`` ``[T]`` (Q4_K/Q5_K packing, see :func:`_k_scales_mins`)."""
    lowj = j < 4
    p = rows[:, None] + base[None, :] + 4
    msk = n_ok[:, None]
    a = tl.load(p + tl.where(lowj, j, j + 4)[None, :], mask=msk, other=0).to(tl.int32)
    b = tl.load(p + tl.where(lowj, j + 4, j - 4)[None, :], mask=msk, other=0).to(tl.int32)
    c = tl.load(p + j[None, :], mask=msk, other=0).to(tl.int32)
    sc = tl.where(lowj[None, :], a & 63, (a & 15) | ((b >> 6) << 4))
    mn = tl.where(lowj[None, :], b & 63, (a >> 4) | ((c >> 6) << 4))
    return _i2f(sc, 0.0), _i2f(mn, 0.0)


@triton.jit
def _bytes_q45_k(rows, n_ok, blk0, BS, SB: tl.constexpr, FIVE: tl.constexpr):
    """Q4_K / Q5_K: the ``qs`` bytes ``[BN, SB * 4, 32]`` (chunk ``t``, byte ``l``) of ``SB``
    super-blocks from ``blk0``, and Q5_K's ``qh [BN, SB * 4, 32]`` (``qh`` repeated per chunk; Q4_K:
    ``qs`` again)."""
    QS: tl.constexpr = 48 if FIVE else 16
    t = tl.arange(0, SB * 4)
    l = tl.arange(0, 32)
    base = (blk0 + t // 4).to(tl.int64) * BS
    msk = n_ok[:, None, None]
    qs = tl.load(rows[:, None, None] + (base + QS + 32 * (t % 4))[None, :, None] + l[None, None, :], mask=msk, other=0)
    if FIVE:
        qh = tl.load(rows[:, None, None] + (base + 16)[None, :, None] + l[None, None, :], mask=msk, other=0)
    else:
        qh = qs
    return qs, qh


@triton.jit
def _row_dot_q45_k(acc, qs, qh, rows, n_ok, blk0, BS, x_ptr, SB: tl.constexpr, FIVE: tl.constexpr,
                   CG: tl.constexpr = False):
    """Q4_K (144 B) / Q5_K (176 B, ``FIVE``): chunk ``t`` (64 values) of byte row ``l``: low nibble
    is sub-block ``2c`` at K ``64t + l``, high nibble ``2c + 1`` at ``64t + 32 + l``; ``qs``, ``qh``
    from :func:`_bytes_q45_k`, ``acc [BN, 1, 1]``."""
    t = tl.arange(0, SB * 4)
    l = tl.arange(0, 32)
    c = t % 4
    base = (blk0 + t // 4).to(tl.int64) * BS                                  # [T]
    byte = qs.to(tl.int32)                                                      # [BN, T, 32]
    lo = byte & 15
    hi = byte >> 4
    if FIVE:
        qh = qh.to(tl.int32)
        sh = (2 * c)[None, :, None]
        lo = lo | (((qh >> sh) & 1) << 4)
        hi = hi | (((qh >> (sh + 1)) & 1) << 4)
    koff = (blk0 * 256 + 64 * t)[:, None] + l[None, :]                          # [T, 32]
    x_lo = _xload(x_ptr, koff, CG)
    x_hi = _xload(x_ptr, koff + 32, CG)
    s_lo = tl.sum(_i2f(lo, 0.0) * x_lo[None], axis=2)                           # [BN, T]
    s_hi = tl.sum(_i2f(hi, 0.0) * x_hi[None], axis=2)
    sc_lo, mn_lo = _k_scale_pair(rows, n_ok, base, 2 * c)
    sc_hi, mn_hi = _k_scale_pair(rows, n_ok, base, 2 * c + 1)
    sb = (blk0 + tl.arange(0, SB)).to(tl.int64) * BS                          # d, dmin once per super-block
    d = _f16_at(rows[:, None] + sb[None, :], n_ok[:, None])                     # [BN, SB]
    dmin = _f16_at(rows[:, None] + sb[None, :] + 2, n_ok[:, None])
    ys = tl.reshape(sc_lo * s_lo + sc_hi * s_hi, [s_lo.shape[0], SB, 4])
    ym = tl.reshape(mn_lo * tl.sum(x_lo, axis=1)[None, :] + mn_hi * tl.sum(x_hi, axis=1)[None, :],
                    [s_lo.shape[0], SB, 4])
    return acc + tl.sum(d * tl.sum(ys, axis=2) - dmin * tl.sum(ym, axis=2), axis=1)[:, None, None]


@triton.jit
def _bytes_q6_k(rows, n_ok, blk0, BS, SB: tl.constexpr):
    """Q6_K: the ``ql`` and ``qh`` bytes ``[BN, SB * 8, 16]`` (group ``t``, byte ``l1``) of ``SB``
    super-blocks from ``blk0`` (layout: :func:`_row_dot_q6_k`)."""
    t = tl.arange(0, SB * 8)
    l1 = tl.arange(0, 16)
    i = t % 8
    base = (blk0 + t // 8).to(tl.int64) * BS
    msk = n_ok[:, None, None]
    ql = tl.load(rows[:, None, None] + (base + 16 * i)[None, :, None] + l1[None, None, :], mask=msk, other=0)
    qh = tl.load(rows[:, None, None] + (base + 128 + 32 * (i // 4) + 16 * (i % 2))[None, :, None]
                 + l1[None, None, :], mask=msk, other=0)
    return ql, qh


@triton.jit
def _row_dot_q6_k(acc, ql, qh, rows, n_ok, blk0, BS, x_ptr, SB: tl.constexpr, CG: tl.constexpr = False):
    """Q6_K (210 B, stored in 224): group ``i = 4hf + 2a + l2`` reads ``ql[16i + l1]``; its low nibble is ``k = a``
    (K ``128hf + 32a + 16l2 + l1``), high nibble ``k = a + 2`` (64 further), each with its own
    2 bits of ``qh`` and int8 scale (see :func:`_tile_q6_k`); ``ql``, ``qh`` from
    :func:`_bytes_q6_k`, ``acc [BN, SB * 8, 16]``."""
    t = tl.arange(0, SB * 8)
    l1 = tl.arange(0, 16)
    i = t % 8
    base = (blk0 + t // 8).to(tl.int64) * BS
    ql = ql.to(tl.int32)                                                         # [BN, T, 16]
    qh = qh.to(tl.int32)
    sh = (2 * ((i // 2) % 2))[None, :, None]
    q0 = (ql & 15) | (((qh >> sh) & 3) << 4)
    q1 = (ql >> 4) | (((qh >> (sh + 4)) & 3) << 4)
    koff = (256 * (blk0 + t // 8) + 128 * (i // 4) + 32 * ((i // 2) % 2) + 16 * (i % 2))[:, None] + l1[None, :]
    sidx = base + 192 + i + 4 * (i // 4)
    sc0 = tl.load(rows[:, None] + sidx[None, :], mask=n_ok[:, None], other=0).to(tl.int8, bitcast=True)
    sc1 = tl.load(rows[:, None] + (sidx + 4)[None, :], mask=n_ok[:, None], other=0).to(tl.int8, bitcast=True)
    d = _f16_at(rows[:, None] + (base + 208)[None, :], n_ok[:, None])           # [BN, T]: d of t's block
    s0 = (d * sc0.to(tl.float32))[:, :, None]
    s1 = (d * sc1.to(tl.float32))[:, :, None]
    return (acc + s0 * _i2f(q0, 32.0) * _xload(x_ptr, koff, CG)[None]
            + s1 * _i2f(q1, 32.0) * _xload(x_ptr, koff + 64, CG)[None])


@triton.jit
def row_zeros(BLOCK_N: tl.constexpr, QTYPE: tl.constexpr, SB: tl.constexpr):
    """The zero accumulator of :func:`row_dot` for ``BLOCK_N`` rows, ``SB`` blocks of ``QTYPE`` a step."""
    if QTYPE == "Q6_K":
        z = tl.zeros([BLOCK_N, SB * 8, 16], tl.float32)
    else:
        z = tl.zeros([BLOCK_N, 1, 1], tl.float32)
    return z


@triton.jit
def row_codes(rows, n_ok, blk0, BS, QTYPE: tl.constexpr, SB: tl.constexpr):
    """The code bytes :func:`row_dot` reads for the ``SB`` blocks from ``blk0`` — most of a step's
    bytes, so a loop can load the next step's before this one's math — as two uint8 tensors (the
    types with one give it twice)."""
    if QTYPE == "Q4_0" or QTYPE == "Q4_1":
        b0 = _bytes_q4(rows, n_ok, blk0, BS, SB, QTYPE == "Q4_1")
        b1 = b0
    elif QTYPE == "Q5_0" or QTYPE == "Q5_1":
        b0, b1 = _bytes_q5(rows, n_ok, blk0, BS, SB, QTYPE == "Q5_1")
    elif QTYPE == "Q8_0":
        b0 = _bytes_q8_0(rows, n_ok, blk0, BS, SB)
        b1 = b0
    elif QTYPE == "Q4_K" or QTYPE == "Q5_K":
        b0, b1 = _bytes_q45_k(rows, n_ok, blk0, BS, SB, QTYPE == "Q5_K")
    else:
        tl.static_assert(QTYPE == "Q6_K", "row_codes: unsupported GGML type")
        b0, b1 = _bytes_q6_k(rows, n_ok, blk0, BS, SB)
    return b0, b1


@triton.jit
def row_dot(acc, b0, b1, rows, n_ok, blk0, BS, x_ptr, QTYPE: tl.constexpr, SB: tl.constexpr,
            CG: tl.constexpr = False):
    """``acc`` (:func:`row_zeros`) plus ``x[k] * dequant(w)[n, k]`` for the ``SB`` blocks from ``blk0`` of
    the rows ``rows`` of GGML type ``QTYPE`` (blocks ``BS`` bytes apart), their code bytes ``b0``, ``b1`` from :func:`row_codes`;
    ``x_ptr`` points at the activation row's element 0. :func:`row_total` gives the rows' sums.
    ``CG``: x is read from L2, never from the SM's L1 (a GEMV launched beside its predecessor reads
    an input no wait has made visible to it: :func:`.gguf_linear.gguf_gemv`'s ``beside``)."""
    if QTYPE == "Q4_0":
        acc = _row_dot_q4(acc, b0, rows, n_ok, blk0, BS, x_ptr, SB, False, CG)
    elif QTYPE == "Q4_1":
        acc = _row_dot_q4(acc, b0, rows, n_ok, blk0, BS, x_ptr, SB, True, CG)
    elif QTYPE == "Q5_0" or QTYPE == "Q5_1":
        acc = _row_dot_q5(acc, b0, b1, rows, n_ok, blk0, BS, x_ptr, SB, QTYPE == "Q5_1", CG)
    elif QTYPE == "Q8_0":
        acc = _row_dot_q8_0(acc, b0, rows, n_ok, blk0, BS, x_ptr, SB, CG)
    elif QTYPE == "Q4_K":
        acc = _row_dot_q45_k(acc, b0, b1, rows, n_ok, blk0, BS, x_ptr, SB, False, CG)
    elif QTYPE == "Q5_K":
        acc = _row_dot_q45_k(acc, b0, b1, rows, n_ok, blk0, BS, x_ptr, SB, True, CG)
    else:
        tl.static_assert(QTYPE == "Q6_K", "row_dot: unsupported GGML type")
        acc = _row_dot_q6_k(acc, b0, b1, rows, n_ok, blk0, BS, x_ptr, SB, CG)
    return acc


@triton.jit
def row_total(acc):
    """float32 ``[BLOCK_N]``: the rows' sums of a :func:`row_dot` accumulator."""
    return tl.sum(tl.sum(acc, axis=2), axis=1)
