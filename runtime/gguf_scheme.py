"""GGUF block types as quantization schemes: ``gguf-q4_0``, ``gguf-q4_1``, ``gguf-q5_0``, ``gguf-q5_1``,
``gguf-q8_0``, ``gguf-q4_k``, ``gguf-q5_k``, ``gguf-q6_k`` (the types with Triton kernels, :data:`KERNEL_QTYPES`),
and :class:`GGUFMixScheme` for a packed weight whose row ranges keep different types
(``gguf-q4_k.5120+q6_k.1024``: one companion per part).

A weight ``W [N, K]`` in scheme ``gguf-<type>`` stores one companion, ``<param>_packed``: uint8
``[N, stored_row_bytes(type, K)]``, each row its ``K`` values as consecutive GGML blocks in the
stored layout: byte for byte as in a GGUF file, Q6_K's blocks padded to 224 bytes
(:mod:`graphdsl.runtime.gguf_blocks` has the layouts; :func:`~graphdsl.runtime.gguf_blocks.to_stored`).
``dequantize`` is :func:`~graphdsl.runtime.gguf_blocks.dequantize_blocks` of the file blocks (the
semantics of the GGUF kernels, and the CPU reference of ``quant_linear``). The language room cannot import the runtime, so this family
registers itself with :func:`graphdsl.quant.register_scheme` when ``graphdsl.runtime`` is imported.

A ``-kb`` scheme (``gguf-q4_k-kb``, ``gguf-q4_k.5120+q6_k.1024-kb``; ``blocked``) holds the same
blocks block-major, ``[K / values_per_block, N, stored block bytes]``
(:func:`~graphdsl.runtime.gguf_blocks.block_major`): what a bind on CUDA stores
(:func:`graphdsl.layers.quantize.store_codes_in_blocks`); checkpoints and loaders keep rows.

``quantize`` writes the blocks from a float weight. Each block's (K types: sub-block's) step, and
for the types with a min its low, come from :mod:`graphdsl.quant_fit`'s weighted least-squares
search over candidate codes; its candidates include llama.cpp's reference rules (round to nearest
on the block's range; Q4_0 / Q5_0's largest value on the lowest level), so its pick has no larger
weighted error than theirs. llama.cpp searches the K types' steps too, by its own rule and weights.
The K types then round the steps onto 6-bit (Q4_K / Q5_K) or signed 8-bit (Q6_K) multiples of a
float16 super-block scale. Files quantized by llama.cpp keep their own blocks
(``LLM(path.gguf, quantization="gguf")``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdsl.errors import GraphDSLError
from graphdsl.quant import Companion, QuantScheme, register_scheme
from graphdsl.quant_fit import fit_affine, fit_symmetric, safe_div

from .gguf_blocks import (GGUF_BLOCKS, KERNEL_QTYPES, STORED_BLOCK_BYTES, block_major, dequantize_blocks, from_stored,
                          row_bytes, row_major, stored_row_bytes, to_stored)

__all__ = ["GGUFScheme", "GGUFMixScheme", "gguf_scheme", "quantize_blocks"]


@dataclass(frozen=True)
class GGUFScheme(QuantScheme):
    """A weight kept in GGML block type ``qtype`` (``"Q4_K"``, ...; one of :data:`KERNEL_QTYPES`);
    ``blocked``: block-major (module docstring)."""

    qtype: str = "Q4_K"
    blocked: bool = False

    def __post_init__(self):
        if self.qtype not in KERNEL_QTYPES:
            raise GraphDSLError(f"gguf scheme: block type must be one of {list(KERNEL_QTYPES)}, got {self.qtype!r}")

    @property
    def name(self) -> str:
        return f"gguf-{self.qtype.lower()}{'-kb' if self.blocked else ''}"

    def with_blocks(self, blocked: bool = True) -> "GGUFScheme":
        return GGUFScheme(self.qtype, blocked)

    @property
    def stackable(self) -> bool:
        """Expert stacks keep their rows' blocks row by row (``[experts, N, stored_row_bytes]``:
        :mod:`graphdsl.runtime.kernels.moe_gguf`), never block-major."""
        return not self.blocked

    @property
    def block_values(self) -> int:
        return GGUF_BLOCKS[self.qtype][0]

    def check(self, name, shape):
        super().check(name, shape)
        if shape[1] % self.block_values:
            raise GraphDSLError(f"quantization scheme {self.name!r}: parameter {name!r} has {shape[1]} inputs, not a "
                                f"multiple of the {self.qtype} block of {self.block_values} values")

    def companions(self, out_features, in_features):
        return (_packed("_packed", self.qtype, out_features, in_features, self.blocked),)

    def dequantize(self, tensors, out_features, in_features, dtype):
        return _dequantize(tensors[0], self.qtype, in_features, dtype)

    def quantize(self, weight, dtype=None):
        return [_stored(quantize_blocks(weight, self.qtype), self.qtype, self.blocked)]

    def in_layout(self, tensors, in_features):
        return [_layout(tensors[0], self.qtype, self.blocked)]

    def row_parts(self, out_features: int) -> list[tuple[str, int, int]]:
        """``[(GGML type, first row, end row)]`` of the stored companions, in order."""
        return [(self.qtype, 0, out_features)]


@dataclass(frozen=True)
class GGUFMixScheme(QuantScheme):
    """A packed weight whose row ranges keep different GGML block types: ``parts`` is
    ``((type, rows), ...)`` top to bottom (a Q4_K_M ``qkv_proj``: ``(("Q4_K", q + k rows), ("Q6_K",
    v rows))``). Part ``i`` is stored as ``<param>_packed`` (``i == 0``) or ``<param>_packed<i>``,
    uint8 ``[rows, stored_row_bytes(type, in)]`` (``blocked``: block-major, module docstring); ``W``
    is the parts' rows stacked. Named ``gguf-q4_k.5120+q6_k.1024``."""

    parts: tuple[tuple[str, int], ...] = ()
    blocked: bool = False

    def __post_init__(self):
        if len(self.parts) < 2 or any(q not in KERNEL_QTYPES or not isinstance(r, int) or r <= 0
                                      for q, r in self.parts):
            raise GraphDSLError(f"gguf mix scheme: parts must be two or more (type, rows > 0) with types in "
                                f"{list(KERNEL_QTYPES)}, got {self.parts!r}")

    @property
    def name(self) -> str:
        return "gguf-" + "+".join(f"{q.lower()}.{r}" for q, r in self.parts) + ("-kb" if self.blocked else "")

    def with_blocks(self, blocked: bool = True) -> "GGUFMixScheme":
        return GGUFMixScheme(self.parts, blocked)

    def row_parts(self, out_features: int) -> list[tuple[str, int, int]]:
        out, r0 = [], 0
        for q, r in self.parts:
            out.append((q, r0, r0 + r))
            r0 += r
        return out

    def check(self, name, shape):
        super().check(name, shape)
        rows = sum(r for _, r in self.parts)
        if rows != shape[0]:
            raise GraphDSLError(f"quantization scheme {self.name!r}: parameter {name!r} has {shape[0]} rows, its "
                                f"parts {rows}")
        for q, _ in self.parts:
            GGUFScheme(q).check(name, shape)

    def companions(self, out_features, in_features):
        return tuple(_packed(f"_packed{i or ''}", q, r1 - r0, in_features, self.blocked)
                     for i, (q, r0, r1) in enumerate(self.row_parts(out_features)))

    def dequantize(self, tensors, out_features, in_features, dtype):
        return torch.cat([_dequantize(t, q, in_features, dtype) for t, (q, _) in zip(tensors, self.parts)])

    def quantize(self, weight, dtype=None):
        return [_stored(quantize_blocks(weight[r0:r1], q), q, self.blocked)
                for q, r0, r1 in self.row_parts(weight.shape[0])]

    def in_layout(self, tensors, in_features):
        return [_layout(t, q, self.blocked) for t, (q, _) in zip(tensors, self.parts)]


def _packed(suffix: str, qtype: str, rows: int, in_features: int, blocked: bool) -> Companion:
    """The companion of ``rows`` rows of ``qtype`` blocks: stored rows, or block-major (``blocked``)."""
    if blocked:
        size = STORED_BLOCK_BYTES.get(qtype, GGUF_BLOCKS[qtype][1])
        return Companion(suffix, (in_features // GGUF_BLOCKS[qtype][0], rows, size), torch.uint8, per_row=False)
    return Companion(suffix, (rows, stored_row_bytes(qtype, in_features)), torch.uint8)


def _stored(file_rows: torch.Tensor, qtype: str, blocked: bool) -> torch.Tensor:
    """File block rows in the stored layout, block-major if ``blocked``."""
    data = to_stored(file_rows, qtype)
    return block_major(data, qtype) if blocked else data


def _layout(data: torch.Tensor, qtype: str, blocked: bool) -> torch.Tensor:
    """Stored blocks in either layout (block-major when 3-D) → block-major (``blocked``) or rows."""
    if (data.dim() == 3) == blocked:
        return data
    return block_major(data, qtype) if blocked else row_major(data, qtype)


def _dequantize(data: torch.Tensor, qtype: str, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    rows = row_major(data, qtype) if data.dim() == 3 else data
    return dequantize_blocks(from_stored(rows, qtype), qtype, in_features).to(dtype)


def gguf_scheme(qtype: str | list[tuple[str, int]]) -> GGUFScheme | GGUFMixScheme:
    """The scheme of GGML type ``qtype`` (a name such as ``"Q6_K"``), or of row parts
    ``[(type, rows), ...]`` top to bottom: adjacent parts of one type merge, and a single type
    left is a plain :class:`GGUFScheme`."""
    if isinstance(qtype, str):
        return GGUFScheme(qtype.upper())
    merged: list[list] = []
    for q, rows in qtype:
        if merged and merged[-1][0] == q.upper():
            merged[-1][1] += rows
        else:
            merged.append([q.upper(), rows])
    if len(merged) == 1:
        return GGUFScheme(merged[0][0])
    return GGUFMixScheme(tuple((q, r) for q, r in merged))


def _parse(name: str) -> QuantScheme:
    body = name.split("-", 1)[1] if "-" in name else ""
    blocked = body.endswith("-kb")
    body = body[:-3] if blocked else body
    if body.upper() in KERNEL_QTYPES:
        return GGUFScheme(body.upper(), blocked)
    items = [p.split(".") for p in body.split("+")]
    if len(items) >= 2 and all(len(i) == 2 and i[0].upper() in KERNEL_QTYPES and i[1].isdigit() for i in items):
        return GGUFMixScheme(tuple((q.upper(), int(r)) for q, r in items), blocked)
    raise GraphDSLError(f"unknown gguf scheme {name!r}: gguf-<type> with type one of "
                        f"{[q.lower() for q in KERNEL_QTYPES]}, or row parts such as gguf-q4_k.5120+q6_k.1024, "
                        f"either with -kb for block-major blocks")


register_scheme("gguf", _parse)


# -- round-to-nearest encoders: float32 [n_blocks, values] -> uint8 [n_blocks, bytes] ---------------
def _f16_bytes(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v [n]`` -> (its float16 rounding as float32 ``[n]``, the little-endian bytes ``[n, 2]``)."""
    h = v.to(torch.float16)
    return h.float(), h.reshape(-1, 1).view(torch.uint8)


def _pack_nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (lo.to(torch.uint8) & 15) | ((hi.to(torch.uint8) & 15) << 4)


def _enc_q8_0(x):
    d, db = _f16_bytes(fit_symmetric(x, -127, 127))
    q = torch.round(safe_div(x, d[:, None])).clamp(-127, 127).to(torch.int8)
    return torch.cat([db, q.view(torch.uint8)], 1)


def _enc_q4_0(x):
    # llama.cpp's reference: d = (the value of largest magnitude) / -8, the search's shift-0 candidate
    d, db = _f16_bytes(fit_symmetric(x, -8, 7))
    q = (torch.round(safe_div(x, d[:, None])) + 8).clamp(0, 15)
    return torch.cat([db, _pack_nibbles(q[:, :16], q[:, 16:])], 1)


def _enc_q4_1(x):
    step, low = fit_affine(x, 15, any_low=True)
    d, db = _f16_bytes(step)
    m, mb = _f16_bytes(-low)
    q = torch.round(safe_div(x - m[:, None], d[:, None])).clamp(0, 15)
    return torch.cat([db, mb, _pack_nibbles(q[:, :16], q[:, 16:])], 1)


def _qh_bytes(q: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1: the fifth bits of ``q [n, 32]`` (values 0..31) as the little-endian u32 ``qh``,
    bit ``j`` for value ``j``: ``[n, 4]`` bytes."""
    bits = (q.to(torch.int64) >> 4) & 1
    word = (bits << torch.arange(32, device=q.device)).sum(1)
    return torch.stack([(word >> (8 * i)) & 255 for i in range(4)], 1).to(torch.uint8)


def _enc_q5_0(x):
    # as Q4_0: llama.cpp's d = (the value of largest magnitude) / -16 is the shift-0 candidate
    d, db = _f16_bytes(fit_symmetric(x, -16, 15))
    q = (torch.round(safe_div(x, d[:, None])) + 16).clamp(0, 31)
    return torch.cat([db, _qh_bytes(q), _pack_nibbles(q[:, :16], q[:, 16:])], 1)


def _enc_q5_1(x):
    step, low = fit_affine(x, 31, any_low=True)
    d, db = _f16_bytes(step)
    m, mb = _f16_bytes(-low)
    q = torch.round(safe_div(x - m[:, None], d[:, None])).clamp(0, 31)
    return torch.cat([db, mb, _qh_bytes(q), _pack_nibbles(q[:, :16], q[:, 16:])], 1)


def _k_super(x, levels: int):
    """Q4_K/Q5_K scales: per sub-block of 32, ``y = d·sc·q - dmin·mn`` with ``q`` in 0..levels and
    ``sc, mn`` 6-bit (each sub-block's step and low from :func:`~graphdsl.quant_fit.fit_affine`, then rounded onto the
    super-block's ``d / dmin``); returns (d, dmin f16 bytes, sc, mn uint8 ``[n, 8]``, q ``[n, 8, 32]``)."""
    xs = x.reshape(-1, 8, 32)
    scales, mins = fit_affine(xs, levels)                              # mn·dmin >= 0 (min <= 0)
    d, db = _f16_bytes(scales.amax(1) / 63.0)
    dmin, dminb = _f16_bytes(mins.amax(1) / 63.0)
    sc = torch.round(safe_div(scales, d[:, None])).clamp(0, 63)
    mn = torch.round(safe_div(mins, dmin[:, None])).clamp(0, 63)
    step, low = d[:, None] * sc, dmin[:, None] * mn                     # what the decoder will use
    q = torch.round(safe_div(xs + low[..., None], step[..., None].expand_as(xs))).clamp(0, levels)
    return db, dminb, sc.to(torch.uint8), mn.to(torch.uint8), q.to(torch.uint8)


def _k_scale_bytes(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Inverse of ``gguf_blocks._k_scales``: 6-bit ``sc, mn [n, 8]`` -> ``[n, 12]`` bytes."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return torch.cat([first, second, third], 1)


def _k_nibble_bytes(q: torch.Tensor) -> torch.Tensor:
    """``[n, 8, 32]`` 4-bit values -> ``[n, 128]``: chunk ``c`` holds sub-block ``2c`` low, ``2c+1`` high."""
    return _pack_nibbles(q[:, 0::2], q[:, 1::2]).reshape(-1, 128)


def _enc_q4_k(x):
    db, dminb, sc, mn, q = _k_super(x, 15)
    return torch.cat([db, dminb, _k_scale_bytes(sc, mn), _k_nibble_bytes(q)], 1)


def _enc_q5_k(x):
    db, dminb, sc, mn, q = _k_super(x, 31)
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)[None, :, None]
    qh = ((q >> 4) << shifts).sum(1).to(torch.uint8)                     # bit j of qh[l]: sub-block j
    return torch.cat([db, dminb, _k_scale_bytes(sc, mn), qh, _k_nibble_bytes(q & 15)], 1)


def _enc_q6_k(x):
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    scales = fit_symmetric(xs, -32, 31)                                # signed: the int8 scales keep the sign
    d, db = _f16_bytes(scales.abs().amax(1) / 127.0)
    sc = torch.round(safe_div(scales, d[:, None])).clamp(-127, 127)
    step = (d[:, None] * sc)[..., None].expand_as(xs)
    q = (torch.round(safe_div(xs, step)).clamp(-32, 31) + 32).to(torch.uint8).reshape(n, 2, 4, 32)  # half, k, l
    ql = torch.cat([_pack_nibbles(q[:, :, 0], q[:, :, 2]), _pack_nibbles(q[:, :, 1], q[:, :, 3])], 2)  # [n, 2, 64]
    qh = sum(((q[:, :, k] >> 4) & 3) << (2 * k) for k in range(4)).to(torch.uint8)                 # [n, 2, 32]
    return torch.cat([ql.reshape(n, 128), qh.reshape(n, 64), sc.to(torch.int8).view(torch.uint8), db], 1)


_ENCODERS = {"Q8_0": _enc_q8_0, "Q4_0": _enc_q4_0, "Q4_1": _enc_q4_1, "Q5_0": _enc_q5_0, "Q5_1": _enc_q5_1,
             "Q4_K": _enc_q4_k, "Q5_K": _enc_q5_k, "Q6_K": _enc_q6_k}


def quantize_blocks(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """``weight [N, K]`` (float) -> uint8 ``[N, row_bytes(qtype, K)]`` GGML blocks of ``qtype``
    (round-to-nearest; :func:`~graphdsl.runtime.gguf_blocks.dequantize_blocks` reads them back)."""
    if qtype not in _ENCODERS:
        raise GraphDSLError(f"quantize_blocks: block type must be one of {list(_ENCODERS)}, got {qtype!r}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise GraphDSLError(f"quantize_blocks: weight must be a 2-D float [N, K], got {weight.dtype} "
                            f"{list(weight.shape)}")
    n, k = weight.shape
    rb = row_bytes(qtype, k)
    per = GGUF_BLOCKS[qtype][0]
    blocks = _ENCODERS[qtype](weight.detach().float().reshape(-1, per))
    return blocks.reshape(n, rb).contiguous()
