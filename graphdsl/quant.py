"""Quantization schemes of weights: what a quantized :class:`~graphdsl.Parameter` stores and means.

A scheme turns a logical weight ``W [out, in]`` into *companion* tensors bound by name beside it
(``<param>_packed``, ``<param>_scale``, ``<param>_zero_point``, compressed-tensors' naming), and
says how to read ``W`` back:

* ``fp8-tensor`` / ``fp8-channel`` — ``W = Wq * s``, ``Wq`` float8 e4m3 ``[out, in]`` stored under
  the parameter's own name, ``s`` float32 ``[1, 1]`` or ``[out, 1]``; with ``-dyn`` the
  activations are quantized too, per token (``x = xq * sx``, ``sx = max|x_row| / 448``), as the
  FP8 tensor cores need.
* ``int8-channel`` — ``W = q * s``, ``q`` int8 ``[out, in]`` (symmetric, -127..127), ``s [out, 1]``.
* ``gguf-<type>`` (``gguf-q4_k``, ``gguf-q6_k``, ``gguf-q8_0``, ...) — GGUF block types, one
  companion ``<param>_packed`` uint8 ``[out, row_bytes]``; registered by ``graphdsl.runtime``
  (its ``gguf_scheme`` module), whose block decoders define them.
* ``int4-g{32,64,128}`` (symmetric) / ``int4-g{..}-zp`` (zero points) — per group of ``g`` inputs,
  ``W = (q - z) * s`` with ``q`` in 0..15 packed two per byte (``packed[n, k // 2]``: even ``k`` in
  the low nibble, odd ``k`` in the high one), ``z = 8`` when symmetric else the companion
  ``zero_point [out, in // g]``, ``s [out, in // g]``. ``-act`` (``int4-g128-zp-act``, GPTQ's
  act-order): the groups take the inputs in the order of companion ``perm`` (int32 ``[in]``), the
  codes' columns stored in that order; ``F.linear`` gathers ``x[..., perm]`` and runs the plain
  scheme's ``quant_linear``. ``-kb`` (``int4-g128-kb``, after any other suffix): the same bytes in
  blocks of 128 inputs, ``packed [ceil(in / 128), out, 64]`` (:func:`int4_blocks`): a block's rows
  lie next to one another, so a decode GEMV's step over many rows reads one contiguous piece of
  memory. Models bound to a CUDA device store their int4 weights so (``FlashCausalLM.bind``).

Schemes are frozen, hashable and named by a canonical string (:attr:`QuantScheme.name`, what
graphs carry as the ``quant_linear`` op's ``scheme`` attribute, print and dump).
:func:`parse_scheme` reads a name back; :func:`register_scheme` adds a family (GGUF block types
register theirs: a :class:`QuantScheme` subclass with its companions, ``dequantize`` and, where
it can, ``quantize``), so ``F.linear`` and the backends dispatch on any registered scheme.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from .errors import GraphDSLError
from .quant_fit import fit_symmetric, fit_zero_point

__all__ = ["QuantMethod", "Companion", "PERM_SUFFIX", "QuantScheme", "Fp8Scheme", "IntScheme", "parse_scheme",
           "register_scheme", "registered_scheme_families", "online_scheme", "FP8_MAX", "INT4_BLOCK_BYTES",
           "int4_blocks", "int4_unblocks", "code_rows"]

FP8_MAX = 448.0          # largest finite float8 e4m3fn


class QuantMethod(enum.Enum):
    """The online quantization methods (``LLM(..., quantization=...)``, ``--quantization``)."""

    FP8 = "fp8"      # fp8 e4m3 weights, per-channel scales (weight-only; fp8-channel-dyn adds activations)
    INT8 = "int8"    # int8 weight-only, per-channel scales
    INT4 = "int4"    # int4 weight-only, groups of 128, symmetric
    GGUF = "gguf"    # keep a GGUF file's own blocks (gguf-<type> per weight); GGUF checkpoints only


@dataclass(frozen=True)
class Companion:
    """One stored tensor of a quantized weight: ``<param name><suffix>``, its shape and dtype
    (``None``: the model's compute dtype)."""

    suffix: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    per_row: bool = True     # dim 0 runs over the weight's output rows (False: over its inputs)


class QuantScheme:
    """Base of the schemes. Subclasses are frozen dataclasses and define :attr:`name`,
    :meth:`companions`, :meth:`dequantize` and :meth:`quantize`; :meth:`linear` defaults to
    ``x @ dequantize(...).T`` (the semantics every kernel is tested against)."""

    @property
    def name(self) -> str:
        raise NotImplementedError

    def companions(self, out_features: int, in_features: int) -> tuple[Companion, ...]:
        """The stored tensors, in the order ``quant_linear`` takes them."""
        raise NotImplementedError

    def dequantize(self, tensors: list[torch.Tensor], out_features: int, in_features: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """``W [out, in]`` in ``dtype`` from the companions (in :meth:`companions` order)."""
        raise NotImplementedError

    def quantize(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """The companions of ``weight [out, in]`` (scales in ``dtype``, default the weight's)."""
        raise GraphDSLError(f"quantization scheme {self.name!r} cannot quantize a weight online; "
                            "load a checkpoint already in this format")

    #: the codes are stored in blocks along the inputs (a scheme with two layouts, :meth:`with_blocks`):
    #: then the first companion is 3-D ``[blocks, out, bytes]``, block ``b`` of every row side by side
    blocked = False

    def with_blocks(self, blocked: bool = True) -> "QuantScheme":
        """This scheme with its codes stored in blocks along the inputs (``blocked``) or row by row;
        a scheme with one layout returns itself."""
        return self

    def in_layout(self, tensors: list[torch.Tensor], in_features: int) -> list[torch.Tensor]:
        """``tensors``, this scheme's companions with the codes in either layout (blocked when the
        first is 3-D), with the codes in this scheme's layout (the others as they are)."""
        return list(tensors)

    #: the last companion is a permutation ``perm`` of the inputs: ``F.linear`` records
    #: ``gather(x, -1, perm)`` and ``quant_linear`` of :attr:`kernel_scheme` on the other companions
    permutes_input = False

    @property
    def kernel_scheme(self) -> "QuantScheme":
        """The scheme ``quant_linear`` runs (the kernels' layout of the companions)."""
        return self

    def linear(self, x: torch.Tensor, tensors: list[torch.Tensor], out_features: int,
               in_features: int) -> torch.Tensor:
        """``x @ W.T`` in ``x``'s dtype (float32 accumulation)."""
        w = self.dequantize(tensors, out_features, in_features, torch.float32)
        return (x.float() @ w.T).to(x.dtype)

    def check(self, name: str, shape: tuple) -> None:
        """Raise unless a weight called ``name`` of logical ``shape`` can take this scheme."""
        if len(shape) != 2 or not all(isinstance(d, int) for d in shape):
            raise GraphDSLError(f"quantization scheme {self.name!r}: parameter {name!r} must be a 2-D "
                                f"[out, in] weight of int sizes, got shape {list(shape)}")

    #: a stack of expert weights ``[experts, out, in]`` can take this scheme: every companion runs
    #: over the output rows, so a stack's companions are the experts' companions stacked
    stackable = False

    def check_stack(self, name: str, shape: tuple) -> None:
        """Raise unless a stack of expert weights called ``name`` of logical ``shape`` ``[experts,
        out, in]`` can take this scheme (MoE expert stacks, :class:`~graphdsl.layers.FusedExperts`)."""
        if not self.stackable:
            raise GraphDSLError(f"quantization scheme {self.name!r} cannot store the expert stack {name!r}: stacks "
                                "take fp8-channel, int8-channel, int4-g{32,64,128}[-zp] and gguf-<type>")
        if len(shape) != 3 or not all(isinstance(d, int) for d in shape):
            raise GraphDSLError(f"quantization scheme {self.name!r}: expert stack {name!r} must be a 3-D "
                                f"[experts, out, in] weight of int sizes, got shape {list(shape)}")
        self.check(name, tuple(shape[1:]))

    def stack_companions(self, experts: int, out_features: int, in_features: int) -> tuple[Companion, ...]:
        """The stored tensors of a stack of ``experts`` weights: each expert's companions, stacked
        along a new first dim (``[experts, *shape]``)."""
        return tuple(Companion(c.suffix, (experts,) + c.shape, c.dtype, c.per_row)
                     for c in self.companions(out_features, in_features))

    def quantize_stack(self, weights: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """The companions of a stack ``weights [experts, out, in]``, quantized one expert at a time
        (one expert's float32 copy alive at once)."""
        parts = [self.quantize(w, dtype) for w in weights]
        return [torch.stack(ts) for ts in zip(*parts)]

    def dequantize_stack(self, tensors: list[torch.Tensor], out_features: int, in_features: int,
                         dtype: torch.dtype) -> torch.Tensor:
        """``W [experts, out, in]`` in ``dtype`` from a stack's companions (:meth:`stack_companions` order)."""
        return torch.stack([self.dequantize([t[e] for t in tensors], out_features, in_features, dtype)
                            for e in range(tensors[0].shape[0])])

    def check_tensors(self, name: str, tensors: Mapping[str, torch.Tensor], out_features: int,
                      in_features: int) -> list[torch.Tensor]:
        """The companions of parameter ``name`` from ``tensors`` (keyed by full name), checked
        against this scheme's layout; an error names the tensor, the scheme, expected and actual."""
        got = []
        for c in self.companions(out_features, in_features):
            full = f"{name}{c.suffix}"
            t = tensors.get(full)
            if t is None:
                raise GraphDSLError(f"quantized weight {name!r} ({self.name}): tensor {full!r} is missing")
            if tuple(t.shape) != c.shape or (c.dtype is not None and t.dtype != c.dtype):
                want = f"{list(c.shape)} {c.dtype if c.dtype is not None else 'any float'}"
                raise GraphDSLError(f"quantized weight {name!r} ({self.name}): tensor {full!r} should be "
                                    f"{want}, got {list(t.shape)} {t.dtype}")
            got.append(t)
        return got

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Fp8Scheme(QuantScheme):
    """float8 e4m3 weights with a per-tensor or per-output-channel float32 scale; optionally
    dynamic per-token activation scales (W8A8)."""

    per_channel: bool = True
    dynamic_activations: bool = False

    @property
    def stackable(self) -> bool:
        return self.per_channel and not self.dynamic_activations

    @property
    def name(self) -> str:
        return f"fp8-{'channel' if self.per_channel else 'tensor'}{'-dyn' if self.dynamic_activations else ''}"

    def companions(self, out_features, in_features):
        return (Companion("", (out_features, in_features), torch.float8_e4m3fn),
                Companion("_scale", (out_features if self.per_channel else 1, 1), torch.float32))

    def dequantize(self, tensors, out_features, in_features, dtype):
        q, s = tensors
        return (q.float() * s.float()).to(dtype)

    def quantize(self, weight, dtype=None):
        w = weight.float()
        amax = w.abs().amax(dim=1, keepdim=True) if self.per_channel else w.abs().amax().reshape(1, 1)
        s = (amax / FP8_MAX).clamp(min=1e-12)
        q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return [q, s]

    def linear(self, x, tensors, out_features, in_features):
        if not self.dynamic_activations:
            return super().linear(x, tensors, out_features, in_features)
        xq, sx = quantize_fp8_rows(x)
        w = self.dequantize(tensors, out_features, in_features, torch.float32)
        return ((xq.float() * sx) @ w.T).to(x.dtype)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 e4m3 quantization: ``x ≈ xq * sx``, ``sx = max|x_row| / 448`` (float32 ``[..., 1]``,
    a true division on every device: torch on CUDA multiplies by the reciprocal of a Python scalar
    divisor, so the divisor is a tensor), ``xq = round(x · (1 / sx))`` (the reciprocal once, as vLLM's
    dynamic fp8 quantization and the decode GEMV's kernel multiply by it)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    sx = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=1e-12)
    return (xf * sx.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), sx


PERM_SUFFIX = "_perm"     # the act-order int4 schemes' input-order companion (IntScheme.act_order)
_GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class IntScheme(QuantScheme):
    """Integer weight-only: ``bits`` 8 (per-channel, symmetric) or 4 (groups of ``group_size``
    inputs, symmetric or with zero points). ``act_order`` (int4, GPTQ's ``desc_act``): the groups
    gather inputs in another order, kept as companion ``_perm`` (int32 ``[in]``): the codes are
    stored with their columns in that order, ``W[:, perm] = (q - z) * s`` over contiguous groups,
    so ``x @ W.T = x[..., perm] @ W'.T`` runs the plain int4 kernels after one gather. ``blocked``
    (int4): the codes stored in blocks of 128 inputs (:func:`int4_blocks`)."""

    bits: int = 4
    group_size: int | None = 128
    zero_point: bool = False
    act_order: bool = False
    blocked: bool = False

    def __post_init__(self):
        for flag in ("act_order", "blocked"):
            if getattr(self, flag) and self.bits != 4:
                raise GraphDSLError(f"{flag} applies to int4 weights, got bits={self.bits}")
        if self.bits == 8:
            if self.group_size is not None or self.zero_point:
                raise GraphDSLError(f"int8 weights are per-channel and symmetric; got group_size={self.group_size}, "
                                    f"zero_point={self.zero_point}")
        elif self.bits == 4:
            if self.group_size not in _GROUPS:
                raise GraphDSLError(f"int4 group_size must be one of {list(_GROUPS)}, got {self.group_size!r}")
        else:
            raise GraphDSLError(f"integer weights have 8 or 4 bits, got bits={self.bits!r}")

    @property
    def name(self) -> str:
        if self.bits == 8:
            return "int8-channel"
        return (f"int4-g{self.group_size}{'-zp' if self.zero_point else ''}{'-act' if self.act_order else ''}"
                f"{'-kb' if self.blocked else ''}")

    @property
    def permutes_input(self) -> bool:
        return self.act_order

    @property
    def stackable(self) -> bool:
        return not (self.act_order or self.blocked)

    @property
    def kernel_scheme(self) -> "IntScheme":
        return IntScheme(self.bits, self.group_size, self.zero_point, blocked=self.blocked) if self.act_order else self

    def with_blocks(self, blocked: bool = True) -> "IntScheme":
        """This scheme with its int4 codes stored in blocks (``blocked``) or row by row (int8: itself)."""
        if self.bits != 4:
            return self
        return IntScheme(self.bits, self.group_size, self.zero_point, self.act_order, blocked)

    def in_layout(self, tensors, in_features):
        packed = tensors[0]
        if self.bits == 4 and (packed.dim() == 3) != self.blocked:
            packed = self._stored(packed) if self.blocked else int4_unblocks(packed, in_features)
        return [packed, *tensors[1:]]

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def check(self, name, shape):
        super().check(name, shape)
        k = shape[1]
        if self.bits == 4 and k % self.group_size:
            raise GraphDSLError(f"quantization scheme {self.name!r}: parameter {name!r} has {k} inputs, not a "
                                f"multiple of the group size {self.group_size}")

    def companions(self, out_features, in_features):
        g = self.groups(in_features)
        packed = (Companion("_packed", (out_features, in_features), torch.int8) if self.bits == 8 else
                  Companion("_packed", (-(-in_features // 128), out_features, INT4_BLOCK_BYTES), torch.uint8,
                            per_row=False) if self.blocked else
                  Companion("_packed", (out_features, in_features // 2), torch.uint8))
        out = (packed, Companion("_scale", (out_features, g), None))
        out += (Companion("_zero_point", (out_features, g), None),) if self.zero_point else ()
        return out + ((Companion(PERM_SUFFIX, (in_features,), torch.int32, per_row=False),) if self.act_order else ())

    def dequantize(self, tensors, out_features, in_features, dtype):
        if self.act_order:
            w = self.kernel_scheme.dequantize(tensors[:-1], out_features, in_features, dtype)
            return torch.empty_like(w).index_copy_(1, tensors[-1].long(), w)
        if self.bits == 8:
            return (tensors[0].float() * tensors[1].float()).to(dtype)
        n, g = out_features, self.groups(in_features)
        q = unpack_int4(self._rows(tensors[0], in_features)).reshape(n, g, self.group_size).float()
        q = q - (tensors[2].float()[..., None] if self.zero_point else 8.0)
        return (q * tensors[1].float()[..., None]).reshape(n, in_features).to(dtype)

    def linear(self, x, tensors, out_features, in_features):
        """``x @ W.T`` with the scales applied to partial sums: ``(x @ q.T) * s`` per channel, and per
        group ``sum_g s[n, g] * (x_g @ q_g.T - z[n, g] * sum(x_g))`` for a few rows (no dequantized
        ``W`` is written: the CPU reference stays near the bytes of the codes); more rows
        dequantize once and multiply."""
        if self.act_order:
            return self.kernel_scheme.linear(x.index_select(-1, tensors[-1].long()), tensors[:-1], out_features,
                                             in_features)
        lead, xf = x.shape[:-1], x.reshape(-1, in_features).float()
        if self.bits == 8:
            y = (xf @ tensors[0].float().T) * tensors[1].float().reshape(1, -1)
        elif xf.shape[0] > 16:
            y = xf @ self.dequantize(tensors, out_features, in_features, torch.float32).T
        else:
            n, g = out_features, self.groups(in_features)
            q = unpack_int4(self._rows(tensors[0], in_features)).float().reshape(n, g, self.group_size)
            xg = xf.reshape(-1, g, self.group_size)
            part = torch.einsum("mgk,ngk->mng", xg, q)
            zero = tensors[2].float() if self.zero_point else torch.full((1, 1), 8.0, device=part.device)
            part = part - zero[None] * xg.sum(-1)[:, None, :]
            y = (part * tensors[1].float()[None]).sum(-1)
        return y.reshape(*lead, out_features).to(x.dtype)

    def quantize(self, weight, dtype=None):
        if self.act_order:
            return super().quantize(weight, dtype)      # the order comes from a GPTQ checkpoint
        dtype = dtype or weight.dtype
        w = weight.float()
        if self.bits == 8:
            s = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
            return [torch.round(w / s).clamp(-127, 127).to(torch.int8), s.to(dtype)]
        n, k = w.shape
        wg = w.reshape(n, k // self.group_size, self.group_size)
        if self.zero_point:                    # the group's step and integer zero: quant_fit's search
            s, z = fit_zero_point(wg, 15)
            s = s.clamp(min=1e-12).to(dtype).float()            # quantize against the scale actually stored
            q = torch.round(wg / s[..., None] + z[..., None]).clamp(0, 15)
            return [self._stored(pack_int4(q.reshape(n, k).to(torch.uint8))), s.to(dtype), z.to(dtype)]
        s = fit_symmetric(wg, -8, 7, positive=True).clamp(min=1e-12).to(dtype).float()   # quant_fit's search
        q = (torch.round(wg / s[..., None]).clamp(-8, 7) + 8).reshape(n, k).to(torch.uint8)
        return [self._stored(pack_int4(q)), s.to(dtype)]

    def _stored(self, packed: torch.Tensor) -> torch.Tensor:
        return int4_blocks(packed) if self.blocked else packed

    def _rows(self, packed: torch.Tensor, in_features: int) -> torch.Tensor:
        return int4_unblocks(packed, in_features) if self.blocked else packed


INT4_BLOCK_BYTES = 64     # a block of int4 codes: 128 inputs of each row (IntScheme.blocked)


def int4_blocks(packed: torch.Tensor) -> torch.Tensor:
    """``[n, k // 2]`` int4 bytes (:func:`pack_int4`) -> ``[ceil(k / 128), n, 64]``: byte ``j`` of row
    ``r`` at ``[j // 64, r, j % 64]`` (a last block short of 128 inputs padded with zero bytes)."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise GraphDSLError(f"int4_blocks: packed must be a 2-D uint8 [out, in / 2] tensor, got "
                            f"{list(packed.shape)} {packed.dtype}")
    n, half = packed.shape
    blocks = -(-half // INT4_BLOCK_BYTES)
    out = torch.zeros(blocks, n, INT4_BLOCK_BYTES, dtype=torch.uint8, device=packed.device)
    whole = half // INT4_BLOCK_BYTES
    out[:whole] = packed[:, :whole * INT4_BLOCK_BYTES].reshape(n, whole, INT4_BLOCK_BYTES).transpose(0, 1)
    if whole < blocks:
        out[whole, :, :half - whole * INT4_BLOCK_BYTES] = packed[:, whole * INT4_BLOCK_BYTES:]
    return out


def int4_unblocks(blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of :func:`int4_blocks`: ``[ceil(in / 128), n, 64]`` -> ``[n, in // 2]`` bytes."""
    half = in_features // 2
    if blocks.dim() != 3 or blocks.shape[0] != -(-half // INT4_BLOCK_BYTES) or blocks.shape[2] != INT4_BLOCK_BYTES:
        raise GraphDSLError(f"int4_unblocks: blocks must be [{-(-half // INT4_BLOCK_BYTES)}, out, "
                            f"{INT4_BLOCK_BYTES}] for {in_features} inputs, got {list(blocks.shape)}")
    return blocks.transpose(0, 1).reshape(blocks.shape[1], -1)[:, :half].contiguous()


def code_rows(codes: torch.Tensor) -> int:
    """N, the output rows of a weight's codes (its first companion) in either layout: ``[N, ...]`` row
    by row, ``[blocks, N, bytes]`` in blocks (:attr:`QuantScheme.blocked`)."""
    return codes.shape[1] if codes.dim() == 3 else codes.shape[0]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` values 0..15 (uint8) -> ``[n, k // 2]`` bytes, even ``k`` in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[n, k // 2]`` bytes -> ``[n, k]`` uint8 values 0..15."""
    p = p.to(torch.uint8)
    out = torch.empty(p.shape[0], p.shape[1], 2, dtype=torch.uint8, device=p.device)
    torch.bitwise_and(p, 15, out=out[..., 0])
    torch.bitwise_right_shift(p, 4, out=out[..., 1])
    return out.reshape(p.shape[0], -1)


# -- names ---------------------------------------------------------------------------------------
_FAMILIES: dict[str, Callable[[str], QuantScheme]] = {}


def register_scheme(family: str, parse: Callable[[str], QuantScheme]) -> None:
    """Make names ``<family>-...`` parse through ``parse(name)`` (which raises on a bad name)."""
    if not family or "-" in family:
        raise GraphDSLError(f"register_scheme: family must be a non-empty name without '-', got {family!r}")
    _FAMILIES[family] = parse


def registered_scheme_families() -> list[str]:
    return sorted(_FAMILIES)


@functools.lru_cache(maxsize=None)
def parse_scheme(name: str) -> QuantScheme:
    """The scheme called ``name`` (:attr:`QuantScheme.name`); errors list the known families."""
    if isinstance(name, QuantScheme):
        return name
    family = str(name).split("-", 1)[0]
    parse = _FAMILIES.get(family)
    if parse is None:
        families = registered_scheme_families()
        gguf = ("gguf-q4_k" if "gguf" in families
                else "gguf-q4_k once graphdsl.runtime, which registers the GGUF block types, is imported")
        raise GraphDSLError(f"unknown quantization scheme {name!r}: families {families} "
                            f"(e.g. fp8-channel-dyn, int8-channel, int4-g128, int4-g64-zp, {gguf})")
    return parse(name)


def _parse_fp8(name: str) -> QuantScheme:
    parts = name.split("-")[1:]
    dyn = parts[-1:] == ["dyn"]
    parts = parts[:-1] if dyn else parts
    if parts not in (["tensor"], ["channel"]):
        raise GraphDSLError(f"unknown fp8 scheme {name!r}: fp8-tensor or fp8-channel, optionally with -dyn")
    return Fp8Scheme(per_channel=parts == ["channel"], dynamic_activations=dyn)


def _parse_int(name: str) -> QuantScheme:
    parts = name.split("-")
    if parts == ["int8", "channel"]:
        return IntScheme(8, None, False)
    blocked = parts[-1:] == ["kb"]
    parts = parts[:-1] if blocked else parts
    if parts[0] == "int4" and len(parts) in (2, 3, 4) and parts[1][:1] == "g" and parts[1][1:].isdigit() \
            and parts[2:] in ([], ["zp"], ["act"], ["zp", "act"]):
        return IntScheme(4, int(parts[1][1:]), "zp" in parts[2:], "act" in parts[2:], blocked)
    raise GraphDSLError(f"unknown integer scheme {name!r}: int8-channel or int4-g{{32,64,128}}[-zp][-act][-kb]")


register_scheme("fp8", _parse_fp8)
register_scheme("int8", _parse_int)
register_scheme("int4", _parse_int)


def online_scheme(method) -> QuantScheme:
    """The scheme ``LLM(..., quantization=method)`` applies: a :class:`QuantMethod`, its value, or a
    full scheme name (``int4-g64-zp``)."""
    if isinstance(method, QuantScheme):
        return method
    if isinstance(method, QuantMethod):
        method = method.value
    if not isinstance(method, str):
        raise GraphDSLError(f"quantization must be one of {[m.value for m in QuantMethod]} or a scheme name, "
                            f"got {method!r}")
    defaults = {QuantMethod.FP8.value: Fp8Scheme(True, False), QuantMethod.INT8.value: IntScheme(8, None, False),
                QuantMethod.INT4.value: IntScheme(4, 128, False)}
    if method in defaults:
        return defaults[method]
    if method == QuantMethod.GGUF.value:
        raise GraphDSLError("quantization='gguf' keeps the block types of a GGUF file: it names no single scheme "
                            "(use it with a .gguf checkpoint, or name a block type such as gguf-q4_k)")
    methods = [m.value for m in QuantMethod]
    try:
        scheme = parse_scheme(method)
    except GraphDSLError as e:
        hint, plain = "", method.strip().lower()
        if plain != method:
            try:
                if plain != QuantMethod.GGUF.value:         # 'gguf' itself names no scheme, yet is valid
                    online_scheme(plain)
                hint = f"; did you mean {plain!r}? (names are lower case, without spaces)"
            except GraphDSLError:
                pass
        raise GraphDSLError(f"quantization must be one of {methods} or a scheme name, got {method!r} "
                            f"({e}){hint}") from None
    if getattr(scheme, "act_order", False):
        raise GraphDSLError(f"quantization={method!r}: act-order schemes read their input order from a GPTQ "
                            "checkpoint and cannot be made online; name the scheme without -act")
    if scheme.blocked:
        raise GraphDSLError(f"quantization={method!r}: -kb is the layout graphdsl stores int4 codes and GGUF blocks "
                            "in on CUDA, chosen at bind; name the scheme without -kb")
    return scheme
