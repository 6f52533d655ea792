"""Triton tile decoders for GGUF block formats, read straight from the file's block bytes.

Each ``_tile_<type>(rows, n_ok, blk0, SB)`` decodes, for ``BLOCK_N`` weight rows at once (``rows``:
``[BLOCK_N]`` uint8 pointers to the rows' first byte; ``n_ok``: which of them exist), the ``SB``
consecutive blocks starting at block ``blk0`` of every row and returns

- ``w``: float32 ``[BLOCK_N, SB * values_per_block]``, the dequantized values in *tile order*: the
  order that falls out of loading the packed bytes contiguously and splitting each byte into its
  nibbles (``tl.join``), which is not the order of K;
- ``koff``: int32 ``[SB * values_per_block]``, the K offset (from ``blk0 * values_per_block``) of
  each tile position.

So a consumer reads the activations at ``koff`` (GEMV: a gather from a row that sits in L1/L2) or
stores the tile at ``koff`` (dequantize), and the weight bytes are read once, in order. The math per
format is the one of :mod:`.gguf_dequant` (the reference these tiles are tested against); the
byte offsets used are written next to each load.

Float16 fields are assembled from two byte loads (blocks of 18, 34 or 210 bytes leave them only
2-byte aligned), then bitcast.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gguf_dequant import GGUF_BLOCKS, KERNEL_QTYPES as _NAMES

__all__ = ["KERNEL_QTYPES", "decode_tile"]

# GGML types with a Triton tile decoder: name -> (values per block, bytes per block)
KERNEL_QTYPES: dict[str, tuple[int, int]] = {name: GGUF_BLOCKS[name] for name in _NAMES}


@triton.jit
def _f16_at(ptr, mask):
    """float32 of the little-endian float16 at byte pointers ``ptr`` (any shape)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _tile_q4_0(rows, n_ok, blk0, SB: tl.constexpr):
    """Q4_0, 18 B: ``d f16 @0, qs[16] @2``; value ``b`` is ``qs[b] & 15``, value ``b + 16`` is
    ``qs[b] >> 4``; ``y = d * (q - 8)``. Tile ``[BLOCK_N, SB, 16, 2]`` (block, byte, nibble)."""
    g = tl.arange(0, SB)
    b = tl.arange(0, 16)
    h = tl.arange(0, 2)
    blk = (blk0 + g).to(tl.int64) * 18
    byte = tl.load(rows[:, None, None] + (blk[:, None] + 2 + b[None, :])[None, :, :],
                   mask=n_ok[:, None, None], other=0).to(tl.int32)
    q = tl.join(byte & 15, byte >> 4).to(tl.float32)                            # [BN, SB, 16, 2]
    d = _f16_at(rows[:, None] + blk[None, :], n_ok[:, None])                    # [BN, SB]
    w = d[:, :, None, None] * (q - 8.0)
    koff = g[:, None, None] * 32 + b[None, :, None] + 16 * h[None, None, :]
    return tl.reshape(w, [w.shape[0], SB * 32]), tl.reshape(koff, [SB * 32])


@triton.jit
def _tile_q4_1(rows, n_ok, blk0, SB: tl.constexpr):
    """Q4_1, 20 B: ``d f16 @0, m f16 @2, qs[16] @4``; nibbles as Q4_0; ``y = d * q + m``."""
    g = tl.arange(0, SB)
    b = tl.arange(0, 16)
    h = tl.arange(0, 2)
    blk = (blk0 + g).to(tl.int64) * 20
    byte = tl.load(rows[:, None, None] + (blk[:, None] + 4 + b[None, :])[None, :, :],
                   mask=n_ok[:, None, None], other=0).to(tl.int32)
    q = tl.join(byte & 15, byte >> 4).to(tl.float32)
    d = _f16_at(rows[:, None] + blk[None, :], n_ok[:, None])
    m = _f16_at(rows[:, None] + blk[None, :] + 2, n_ok[:, None])
    w = d[:, :, None, None] * q + m[:, :, None, None]
    koff = g[:, None, None] * 32 + b[None, :, None] + 16 * h[None, None, :]
    return tl.reshape(w, [w.shape[0], SB * 32]), tl.reshape(koff, [SB * 32])


@triton.jit
def _tile_q8_0(rows, n_ok, blk0, SB: tl.constexpr):
    """Q8_0, 34 B: ``d f16 @0, q[32] int8 @2``; ``y = d * q``. Tile ``[BLOCK_N, SB, 32]`` in K order."""
    g = tl.arange(0, SB)
    j = tl.arange(0, 32)
    blk = (blk0 + g).to(tl.int64) * 34
    byte = tl.load(rows[:, None, None] + (blk[:, None] + 2 + j[None, :])[None, :, :],
                   mask=n_ok[:, None, None], other=0)
    q = byte.to(tl.int8, bitcast=True).to(tl.float32)
    d = _f16_at(rows[:, None] + blk[None, :], n_ok[:, None])
    w = d[:, :, None] * q
    koff = g[:, None] * 32 + j[None, :]
    return tl.reshape(w, [w.shape[0], SB * 32]), tl.reshape(koff, [SB * 32])


@triton.jit
def _k_scales_mins(rows, n_ok, blk0, SB: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """Q4_K/Q5_K: ``d·sc_j`` and ``dmin·mn_j`` of the 8 sub-blocks of ``SB`` super-blocks,
    ``[BLOCK_N, SB * 8]``. ``d @0, dmin @2`` (f16), ``scales[12] @4``: for ``j < 4``
    ``sc = s[j] & 63, mn = s[j+4] & 63``; for ``j >= 4`` ``sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4``,
    ``mn = (s[j+4] >> 4) | (s[j] >> 6) << 4``."""
    u = tl.arange(0, SB * 8)
    j = u % 8
    base = (blk0 + u // 8).to(tl.int64) * BLOCK_BYTES
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
def _tile_q4_k(rows, n_ok, blk0, SB: tl.constexpr):
    """Q4_K, 144 B: ``qs[128] @16``; chunk ``c`` (64 values) is ``qs[32c : 32c + 32]``, low nibbles
    sub-block ``2c``, high nibbles ``2c + 1``; ``y = d·sc·q − dmin·mn``. Tile ``[BLOCK_N, SB*4, 32, 2]``
    (super-block·chunk ``t``, byte ``l``, nibble ``h``) at K offset ``64t + 32h + l``."""
    t = tl.arange(0, SB * 4)
    l = tl.arange(0, 32)
    h = tl.arange(0, 2)
    off = (blk0 + t // 4).to(tl.int64) * 144 + 16 + 32 * (t % 4)
    byte = tl.load(rows[:, None, None] + (off[:, None] + l[None, :])[None, :, :],
                   mask=n_ok[:, None, None], other=0).to(tl.int32)
    q = tl.join(byte & 15, byte >> 4).to(tl.float32)                            # [BN, T, 32, 2]
    scale, mins = _k_scales_mins(rows, n_ok, blk0, SB, 144)                     # [BN, SB*8], j = 2c + h
    scale = tl.expand_dims(tl.reshape(scale, [scale.shape[0], SB * 4, 2]), 2)
    mins = tl.expand_dims(tl.reshape(mins, [mins.shape[0], SB * 4, 2]), 2)
    w = scale * q - mins
    koff = 64 * t[:, None, None] + l[None, :, None] + 32 * h[None, None, :]
    return tl.reshape(w, [w.shape[0], SB * 256]), tl.reshape(koff, [SB * 256])


@triton.jit
def _tile_q5_k(rows, n_ok, blk0, SB: tl.constexpr):
    """Q5_K, 176 B: as Q4_K with ``qh[32] @16``, ``qs[128] @48``; the fifth bit of value ``l`` of
    sub-block ``j`` is bit ``j`` of ``qh[l]``."""
    t = tl.arange(0, SB * 4)
    l = tl.arange(0, 32)
    h = tl.arange(0, 2)
    sb = (blk0 + t // 4).to(tl.int64) * 176
    msk = n_ok[:, None, None]
    byte = tl.load(rows[:, None, None] + (sb + 48 + 32 * (t % 4))[None, :, None] + l[None, None, :],
                   mask=msk, other=0).to(tl.int32)
    qh = tl.load(rows[:, None, None] + (sb + 16)[None, :, None] + l[None, None, :],
                 mask=msk, other=0).to(tl.int32)                                # [BN, T, 32]
    shift = (2 * (t % 4))[:, None, None] + h[None, None, :]                     # sub-block j = 2c + h
    high = (tl.expand_dims(qh, 3) >> shift) & 1
    q = (tl.join(byte & 15, byte >> 4) | (high << 4)).to(tl.float32)
    scale, mins = _k_scales_mins(rows, n_ok, blk0, SB, 176)
    scale = tl.expand_dims(tl.reshape(scale, [scale.shape[0], SB * 4, 2]), 2)
    mins = tl.expand_dims(tl.reshape(mins, [mins.shape[0], SB * 4, 2]), 2)
    w = scale * q - mins
    koff = 64 * t[:, None, None] + l[None, :, None] + 32 * h[None, None, :]
    return tl.reshape(w, [w.shape[0], SB * 256]), tl.reshape(koff, [SB * 256])


@triton.jit
def _tile_q6_k(rows, n_ok, blk0, SB: tl.constexpr):
    """Q6_K, 210 B: ``ql[128] @0, qh[64] @128, scales[16] int8 @192, d f16 @208``. Value
    ``128·hf + 32k + l`` (``k`` 0..3, ``l`` 0..31) is ``(ql[64hf + 32(k%2) + l] >> 4(k//2)) & 15 |
    ((qh[32hf + l] >> 2k) & 3) << 4``, minus 32, times ``d·scales[8hf + 2k + l//16]``.

    Tile ``[BLOCK_N, SB*8, 16, 2]``: group ``i = 4hf + 2a + l2`` (``a = k % 2``, ``l = 16·l2 + l1``)
    reads ``ql[16i + l1]`` contiguously, nibble ``b = k // 2``; its scale index is
    ``8hf + 2a + l2 + 4b = i + 4(i//4) + 4b``."""
    t = tl.arange(0, SB * 8)
    l1 = tl.arange(0, 16)
    b = tl.arange(0, 2)
    i = t % 8
    sb = (blk0 + t // 8).to(tl.int64) * 210
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
def decode_tile(rows, n_ok, blk0, QTYPE: tl.constexpr, SB: tl.constexpr):
    """``(w [BLOCK_N, SB * values_per_block] float32, koff)`` of GGML type ``QTYPE`` (a name in
    :data:`KERNEL_QTYPES`); see the module docstring."""
    if QTYPE == "Q4_0":
        w, koff = _tile_q4_0(rows, n_ok, blk0, SB)
    elif QTYPE == "Q4_1":
        w, koff = _tile_q4_1(rows, n_ok, blk0, SB)
    elif QTYPE == "Q8_0":
        w, koff = _tile_q8_0(rows, n_ok, blk0, SB)
    elif QTYPE == "Q4_K":
        w, koff = _tile_q4_k(rows, n_ok, blk0, SB)
    elif QTYPE == "Q5_K":
        w, koff = _tile_q5_k(rows, n_ok, blk0, SB)
    else:
        tl.static_assert(QTYPE == "Q6_K", "decode_tile: unsupported GGML type")
        w, koff = _tile_q6_k(rows, n_ok, blk0, SB)
    return w, koff
