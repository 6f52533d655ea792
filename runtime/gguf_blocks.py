"""GGUF (GGML) block formats: their table, the torch reference decoder on raw block bytes, and
the :class:`GGUFBlockWeight` record of a weight kept in them.

The decoder is the semantics of every GGUF kernel (:mod:`graphdsl.runtime.kernels.gguf_linear`) and
what the GGUF loader dequantizes with. This module is plain torch and sits in the runtime core (not
in ``runtime/kernels``, whose package import decorates Triton kernels) so that loaders, backends and
kernels can all import it. :func:`dequantize_blocks` takes one tensor's rows as they are stored in the
file: a uint8 tensor ``[rows, bytes_per_row]`` (CPU or CUDA), each row ``K / values_per_block``
consecutive blocks, and returns float32 ``[rows, K]``.

**Stored layout.** A weight kept in blocks on the device (a ``gguf-<type>`` companion, what the
kernels read) holds the file's blocks byte for byte, except that a type in
:data:`STORED_BLOCK_BYTES` has each block padded with zeros to a 16-byte multiple: Q6_K's 210-byte
blocks leave every odd block only 2-byte aligned, so its fields could only be loaded a byte at a
time; at 224 bytes each field loads as 16-byte vectors (the tensor-core Q6_K GEMV,
:mod:`graphdsl.runtime.kernels.gguf_mma_q6k`). :func:`to_stored` / :func:`from_stored` convert,
:func:`stored_row_bytes` is a stored row's width.

**Block-major layout.** A bind on CUDA stores the blocks ``[K / values_per_block, N, stored block
bytes]``: block ``b`` of row ``r`` at ``[b, r]``, so block ``b`` of all rows lies side by side
(:func:`block_major` / :func:`row_major`; the schemes' ``-kb`` suffix). A decode GEMV step over many
rows then reads one contiguous piece instead of one block a row apart; the kernels address a
block as ``row_stride · r + block_stride · b`` in either layout (:func:`strides`).

Block formats (little endian; ``d``, ``m``, ``dmin`` are float16; ``y`` is the output):

- ``Q8_0`` (32 values, 34 B): ``d, q[32] int8`` → ``y = d·q``.
- ``Q4_0`` (32, 18 B): ``d, qs[16]``; value ``j < 16`` is the low nibble of ``qs[j]``, value
  ``j + 16`` the high nibble → ``y = d·(nibble − 8)``.
- ``Q4_1`` (32, 20 B): ``d, m, qs[16]`` → ``y = d·nibble + m``.
- ``Q5_0`` (32, 22 B): ``d, qh u32, qs[16]``; bit ``j`` of ``qh`` is the fifth bit of value ``j``
  → ``y = d·(q − 16)``.  ``Q5_1`` (32, 24 B): ``d, m, qh, qs`` → ``y = d·q + m``.
- ``Q4_K`` (256, 144 B): ``d, dmin, scales[12], qs[128]``: eight sub-blocks of 32 with 6-bit
  scale ``sc`` and min ``mn`` packed in ``scales``; chunk ``c`` (64 values) reads ``qs[32c:32c+32]``,
  low nibbles for sub-block ``2c``, high nibbles for ``2c+1`` → ``y = d·sc·q − dmin·mn``.
- ``Q5_K`` (256, 176 B): ``d, dmin, scales[12], qh[32], qs[128]``; as Q4_K plus a fifth bit from
  ``qh[l]`` bit ``2c`` (low half of chunk ``c``) or ``2c+1`` (high half).
- ``Q2_K`` (256, 84 B): ``scales[16], qs[64], d, dmin``; sixteen sub-blocks of 16, each with
  a 4-bit scale (low nibble) and 4-bit min (high nibble); sub-block ``8h + 2j + s`` takes bits
  ``2j..2j+1`` of ``qs[32h + 16s + l]`` → ``y = d·sc·q − dmin·mn``.
- ``Q3_K`` (256, 110 B): ``hmask[32], qs[64], scales[12], d``; 2-bit values as in Q2_K, minus 4
  unless bit ``4h + j`` of ``hmask[16s + l]`` is set; sixteen signed 6-bit scales (``−32``)
  → ``y = d·sc·q``.
- ``Q6_K`` (256, 210 B): ``ql[128], qh[64], scales[16] int8, d``; two halves of 128; in half ``h``
  value ``l + 32k`` (``k`` = 0..3) takes 4 bits from ``ql`` (low nibble of ``ql[l]``/``ql[l+32]``
  for k = 0/1, high for k = 2/3) and 2 bits ``(qh[l] >> 2k) & 3``, minus 32, times
  ``d·scales[8h + l//16 + 2k]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdsl.errors import GraphDSLError

__all__ = ["GGUF_BLOCKS", "KERNEL_QTYPES", "STORED_BLOCK_BYTES", "GGUFBlockWeight", "dequantize_blocks", "row_bytes",
           "stored_row_bytes", "to_stored", "from_stored", "block_major", "row_major", "strides"]


GGUF_BLOCKS: dict[str, tuple[int, int]] = {   # name -> (values per block, bytes per block)
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}

# the block types with Triton kernels (runtime/kernels/gguf_tiles.py, gguf_linear.py)
KERNEL_QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# bytes a block of these types takes in the stored layout (the file's bytes, then zeros; module docstring)
STORED_BLOCK_BYTES: dict[str, int] = {"Q6_K": 224}


# The decoders below take ``b``: a uint8 torch tensor ``[n_blocks, bytes_per_block]`` (CPU or
# CUDA) and return float32 ``[n_blocks, values_per_block]``.

def _f16(b: torch.Tensor) -> torch.Tensor:
    """``[n, 2]`` bytes → ``[n, 1]`` float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` bytes → ``[n, 32]``: low nibbles then high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _deq_q8_0(b):
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _deq_q4_0(b):
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).float() - 8.0)


def _deq_q4_1(b):
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _fifth_bits(qh_bytes: torch.Tensor) -> torch.Tensor:
    """``[n, 4]`` bytes of a little-endian u32 → ``[n, 32]`` bits (bit j for value j).
    (Read as int32: an arithmetic shift still leaves bit 31 in place for ``& 1``.)"""
    qh = qh_bytes.contiguous().view(torch.int32)                         # [n, 1]
    shifts = torch.arange(32, dtype=torch.int32, device=qh.device)
    return ((qh >> shifts) & 1).to(torch.uint8)


def _deq_q5_0(b):
    q = _nibbles(b[:, 6:]) | (_fifth_bits(b[:, 2:6]) << 4)
    return _f16(b[:, :2]) * (q.float() - 16.0)


def _deq_q5_1(b):
    q = _nibbles(b[:, 8:]) | (_fifth_bits(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack ``[n, 12]`` Q4_K/Q5_K scale bytes → 6-bit scales and mins, each ``[n, 8]``:
    j < 4: ``s[j] & 63``, ``s[j+4] & 63``; j >= 4: low 4 bits from ``s[j+4]`` (low/high nibble),
    high 2 bits from the top of ``s[j-4]`` / ``s[j]``."""
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return sc.float(), mn.float()


def _k_apply(d, dmin, sc, mn, q):
    """``q [n, 8, 32]`` with per-sub-block scale/min → ``[n, 256]``."""
    y = (d * sc)[:, :, None] * q.float() - (dmin * mn)[:, :, None]
    return y.reshape(q.shape[0], 256)


def _k_low_high(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 128]`` bytes → ``[n, 8, 32]`` 4-bit values in sub-block order."""
    chunks = qs.reshape(-1, 4, 32)
    return torch.stack([chunks & 0x0F, chunks >> 4], dim=2).reshape(-1, 8, 32)


def _deq_q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return _k_apply(d, dmin, sc, mn, _k_low_high(b[:, 16:144]))


def _deq_q5_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]                                                     # [n, 32]
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)         # sub-block j reads bit j
    high = (qh[:, None, :] >> shifts[None, :, None]) & 1                 # [n, 8, 32]
    q = _k_low_high(b[:, 48:176]) | (high << 4)
    return _k_apply(d, dmin, sc, mn, q)


def _deq_q6_k(b):
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 8)
    d = _f16(b[:, 208:210]).reshape(n, 1, 1, 1, 1)
    low = torch.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F,
                       ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], dim=2)             # [n, 2, 4, 32]
    high = torch.stack([(qh >> (2 * k)) & 3 for k in range(4)], dim=2)             # [n, 2, 4, 32]
    q = (low | (high << 4)).float() - 32.0
    # scale index within the half: 2k + l // 16, laid out over (k, l // 16)
    s = sc.reshape(n, 2, 4, 2, 1)
    y = d * s * q.reshape(n, 2, 4, 2, 16)
    return y.reshape(n, 256)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 64]`` Q2_K/Q3_K bytes → ``[n, 2, 4, 2, 16]`` 2-bit values indexed (half, shift j,
    sub, l): byte ``qs[32·half + 16·sub + l]``, bits ``2j..2j+1``; flattening gives value order."""
    q = qs.reshape(-1, 2, 1, 2, 16)
    shifts = (2 * torch.arange(4, dtype=torch.uint8, device=qs.device)).reshape(1, 1, 4, 1, 1)
    return (q >> shifts) & 3


def _deq_q2_k(b):
    n = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = _crumbs(b[:, 16:80]).reshape(n, 16, 16).float()
    scale = d * (sc & 0x0F).float()
    mins = dmin * (sc >> 4).float()
    return (scale[:, :, None] * q - mins[:, :, None]).reshape(n, 256)


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """``[n, 12]`` → ``[n, 16]`` signed 6-bit scales: low 4 bits from ``s[i]`` (i < 8) or
    ``s[i-8] >> 4``, high 2 bits ``(s[8 + i % 4] >> 2·(i // 4)) & 3``; minus 32."""
    low = torch.cat([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], dim=1)
    hi_src = s[:, 8:12].repeat(1, 4)                                     # s[8 + i % 4]
    hi_shift = (2 * (torch.arange(16, device=s.device) // 4)).to(torch.uint8)
    high = (hi_src >> hi_shift) & 3
    return (low | (high << 4)).float() - 32.0


def _deq_q3_k(b):
    n = b.shape[0]
    hmask = b[:, 0:32].reshape(n, 1, 1, 2, 16)                           # hm[16·sub + l]
    bit = (4 * torch.arange(2, device=b.device).reshape(1, 2, 1, 1, 1)
           + torch.arange(4, device=b.device).reshape(1, 1, 4, 1, 1)).to(torch.uint8)
    high = (hmask >> bit) & 1                                            # [n, 2, 4, 2, 16]
    q = _crumbs(b[:, 32:96]).float() - 4.0 * (1 - high).float()
    scale = _f16(b[:, 108:110]) * _q3_k_scales(b[:, 96:108])             # [n, 16]
    return (scale[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)


_DECODERS = {"Q8_0": _deq_q8_0, "Q4_0": _deq_q4_0, "Q4_1": _deq_q4_1, "Q5_0": _deq_q5_0,
            "Q5_1": _deq_q5_1, "Q2_K": _deq_q2_k, "Q3_K": _deq_q3_k, "Q4_K": _deq_q4_k,
            "Q5_K": _deq_q5_k, "Q6_K": _deq_q6_k}


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of ``k`` values of GGML type ``qtype`` (``k`` a whole number of blocks)."""
    if qtype not in GGUF_BLOCKS:
        raise GraphDSLError(f"GGML tensor type {qtype!r} is not supported; supported: {list(GGUF_BLOCKS)}")
    per, nbytes = GGUF_BLOCKS[qtype]
    if k <= 0 or k % per:
        raise GraphDSLError(f"a {qtype} row needs a positive multiple of {per} values, got K={k}")
    return k // per * nbytes


def stored_row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of ``k`` values of ``qtype`` in the stored layout (module docstring)."""
    nbytes = row_bytes(qtype, k)
    return nbytes // GGUF_BLOCKS[qtype][1] * STORED_BLOCK_BYTES.get(qtype, GGUF_BLOCKS[qtype][1])


def to_stored(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """File rows ``uint8 [rows, row_bytes]`` of ``qtype`` in the stored layout: each block padded with
    zeros to :data:`STORED_BLOCK_BYTES` (a new tensor), or ``data`` itself for the other types."""
    size = STORED_BLOCK_BYTES.get(qtype)
    if size is None:
        return data
    nbytes = GGUF_BLOCKS[qtype][1]
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % nbytes:
        raise GraphDSLError(f"to_stored: data must be uint8 [rows, a multiple of {nbytes}] ({qtype} file blocks), got "
                            f"{data.dtype} {list(data.shape)}")
    rows, blocks = data.shape[0], data.shape[1] // nbytes
    out = torch.zeros(rows, blocks, size, dtype=torch.uint8, device=data.device)
    out[:, :, :nbytes] = data.reshape(rows, blocks, nbytes)
    return out.reshape(rows, blocks * size)


def from_stored(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """Stored rows (:func:`to_stored`) back to the file's blocks (a view's copy, or ``data`` itself)."""
    size = STORED_BLOCK_BYTES.get(qtype)
    if size is None:
        return data
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % size:
        raise GraphDSLError(f"from_stored: data must be uint8 [rows, a multiple of {size}] (stored {qtype} blocks), "
                            f"got {data.dtype} {list(data.shape)}")
    rows, blocks = data.shape[0], data.shape[1] // size
    return data.reshape(rows, blocks, size)[:, :, :GGUF_BLOCKS[qtype][1]].reshape(rows, -1)


def block_major(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """Stored rows ``uint8 [N, stored_row_bytes]`` of ``qtype`` → ``[K / values_per_block, N, stored block
    bytes]``, block ``b`` of row ``r`` at ``[b, r]`` (a new contiguous tensor; module docstring)."""
    size = STORED_BLOCK_BYTES.get(qtype, GGUF_BLOCKS[qtype][1])
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % size:
        raise GraphDSLError(f"block_major: data must be uint8 [rows, a multiple of {size}] (stored {qtype} blocks), "
                            f"got {data.dtype} {list(data.shape)}")
    return data.reshape(data.shape[0], -1, size).transpose(0, 1).contiguous()


def row_major(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """Inverse of :func:`block_major`: ``[blocks, N, stored block bytes]`` → stored rows ``[N, blocks · bytes]``."""
    size = STORED_BLOCK_BYTES.get(qtype, GGUF_BLOCKS[qtype][1])
    if data.dtype != torch.uint8 or data.dim() != 3 or data.shape[2] != size:
        raise GraphDSLError(f"row_major: data must be uint8 [blocks, rows, {size}] (block-major {qtype} blocks), got "
                            f"{data.dtype} {list(data.shape)}")
    return data.transpose(0, 1).reshape(data.shape[1], -1).contiguous()


def strides(data: torch.Tensor, qtype: str) -> tuple[int, int]:
    """``(row_stride, block_stride)`` in bytes of the ``qtype`` blocks in ``data``: stored rows ``[N,
    row bytes]`` (block ``b`` of row ``r`` at ``r · row_bytes + b · block_bytes``) or block-major
    ``[blocks, N, block_bytes]`` (at ``r · block_bytes + b · N · block_bytes``)."""
    size = STORED_BLOCK_BYTES.get(qtype, GGUF_BLOCKS[qtype][1])
    return (size, data.shape[1] * size) if data.dim() == 3 else (data.shape[1], size)


def dequantize_blocks(data: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """``data`` uint8 ``[rows, row_bytes(qtype, k)]`` (the rows' raw GGML bytes) → float32 ``[rows, k]``.

    ``qtype`` is the GGML type name (``"Q4_K"``, ...; see :data:`GGUF_BLOCKS`). Runs where ``data``
    lives."""
    want = row_bytes(qtype, k)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != want:
        raise GraphDSLError(f"dequantize_blocks: data must be uint8 [rows, {want}] ({qtype}, K={k}), got "
                            f"{data.dtype} {list(data.shape)}")
    rows = data.shape[0]
    per, nbytes = GGUF_BLOCKS[qtype]
    raw = data.contiguous()
    if qtype == "F32":
        return raw.view(torch.float32).clone()
    if qtype == "F16":
        return raw.view(torch.float16).float()
    if qtype == "BF16":
        return raw.view(torch.bfloat16).float()
    return _DECODERS[qtype](raw.reshape(-1, nbytes)).reshape(rows, k)


@dataclass(frozen=True)
class GGUFBlockWeight:
    """A linear weight kept in its GGUF block format: what a quantized ``Parameter`` binds.

    - ``qtype``: the GGML type name (``"Q4_K"``, ``"Q6_K"``, ...; a key of :data:`GGUF_BLOCKS`);
      a Q4_K_M-style file mixes types, so it is per tensor;
    - ``shape``: the logical ``(N, K)`` = ``(out_features, in_features)``, HF order;
    - ``data``: uint8 ``[N, row_bytes(qtype, K)]``, each row its K values as consecutive blocks,
      byte for byte as in the file (after the loader's row reorders, e.g. llama's q/k un-permute).

    ``dequantize()`` gives the dense weight (the reference);
    :func:`graphdsl.runtime.kernels.gguf_linear.gguf_linear`
    multiplies with ``(data, qtype)`` directly.
    """

    qtype: str
    shape: tuple[int, int]
    data: torch.Tensor

    def __post_init__(self):
        if len(self.shape) != 2:
            raise GraphDSLError(f"GGUFBlockWeight: shape must be (N, K), got {self.shape}")
        want = (self.shape[0], row_bytes(self.qtype, self.shape[1]))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise GraphDSLError(f"GGUFBlockWeight: {self.qtype} {list(self.shape)} needs data uint8 {list(want)}, "
                                f"got {self.data.dtype} {list(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device) -> "GGUFBlockWeight":
        return GGUFBlockWeight(self.qtype, self.shape, self.data.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[N, K]`` weight in ``dtype``."""
        return dequantize_blocks(self.data, self.qtype, self.shape[1]).to(dtype)
