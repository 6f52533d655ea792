"""Rotary position embedding: the scaled frequency tables (host side) and the rotation (graph side).

The graph takes per-token ``cos``/``sin`` tables ``[num_tokens, rotary_dim / 2]`` as inputs; the
runtime builds them each step with :meth:`RotaryEmbedding.cos_sin` from the token positions, so
every scaling variant (including dynamic NTK, which depends on the sequence length) is host code
and the graph is the same for all of them.

Scaling variants (``RopeType``), with ``inv_freq_i = base^(-2i / d)``:

* ``DEFAULT`` — as above.
* ``LINEAR`` — ``inv_freq / factor`` (position interpolation).
* ``DYNAMIC`` — NTK-aware: once ``seq_len > max_position_embeddings``,
  ``base' = base * (factor * seq_len / max_pos - (factor - 1)) ^ (d / (d - 2))``.
* ``LLAMA3`` — low frequencies (wavelength above ``orig / low_freq_factor``) divided by ``factor``,
  high ones kept, a smooth blend between.
* ``YARN`` — per-dim blend of interpolated and extrapolated frequencies over the correction range
  of ``beta_fast``/``beta_slow`` rotations, and cos/sin scaled by the attention factor
  ``0.1 * mscale * ln(factor) + 1`` (or the ``mscale / mscale_all_dim`` ratio).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from graphdsl import Module
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError

__all__ = ["RopeType", "RopeScaling", "RotaryEmbedding"]


class RopeType(enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    DYNAMIC = "dynamic"
    LLAMA3 = "llama3"
    YARN = "yarn"


@dataclass(frozen=True)
class RopeScaling:
    """Scaling parameters (HF ``rope_scaling`` / ``rope_parameters`` fields, parsed once)."""

    rope_type: RopeType = RopeType.DEFAULT
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0          # llama3
    high_freq_factor: float = 4.0         # llama3
    beta_fast: float = 32.0               # yarn
    beta_slow: float = 1.0                # yarn
    mscale: float | None = None           # yarn
    mscale_all_dim: float | None = None   # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool = True                 # yarn

    def __post_init__(self):
        if not isinstance(self.rope_type, RopeType):
            raise GraphDSLError(f"RopeScaling: rope_type must be a RopeType, one of "
                                f"{[t.value for t in RopeType]}, got {self.rope_type!r}")
        if self.rope_type is not RopeType.DEFAULT and not self.factor > 0:
            raise GraphDSLError(f"RopeScaling: factor must be > 0 for {self.rope_type.value} scaling, got {self.factor!r}")
        if self.rope_type in (RopeType.LLAMA3, RopeType.YARN) and not self.original_max_position_embeddings:
            raise GraphDSLError(f"RopeScaling: {self.rope_type.value} scaling needs original_max_position_embeddings")


class RotaryEmbedding(Module):
    """Rotates the first ``rotary_dim`` dims of every q/k head; no parameters.

    Args:
        head_dim: per-head size; ``rotary_dim`` (default ``head_dim``) the rotated part.
        base: ``rope_theta``.
        max_position_embeddings: the model's trained context (dynamic NTK threshold).
        scaling: a :class:`RopeScaling` (None: default).
        layout: ``F.RopeLayout.NEOX`` (HF rotate_half) or ``GPTJ`` (interleaved pairs).
    """

    def __init__(self, head_dim: int, base: float = 10000.0, max_position_embeddings: int = 2048,
                 scaling: RopeScaling | None = None, rotary_dim: int | None = None, layout=F.RopeLayout.NEOX):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise GraphDSLError(f"RotaryEmbedding: rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        if not isinstance(layout, F.RopeLayout):
            raise GraphDSLError(f"RotaryEmbedding: layout must be a RopeLayout, got {layout!r}")
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, float(base)
        self.max_position_embeddings = max_position_embeddings
        self.scaling = scaling or RopeScaling()
        self.layout = layout

    # -- host side ---------------------------------------------------------------------------
    def inv_freq(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """``(inv_freq [rotary_dim/2] float32, attention_scaling)``; ``seq_len`` matters only for
        dynamic NTK (the longest context in the step)."""
        d, base, sc = self.rotary_dim, self.base, self.scaling
        exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
        kind = sc.rope_type
        if kind is RopeType.DYNAMIC:
            max_pos = self.max_position_embeddings
            seq_len = max(seq_len or max_pos, max_pos)
            base = base * ((sc.factor * seq_len / max_pos) - (sc.factor - 1)) ** (d / (d - 2))
        inv = 1.0 / (base ** exponents)
        if kind is RopeType.LINEAR:
            return inv / sc.factor, 1.0
        if kind is RopeType.LLAMA3:
            return _llama3(inv, sc), 1.0
        if kind is RopeType.YARN:
            return _yarn(d, base, sc)
        return inv, 1.0

    def cos_sin(self, positions: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables ``cos, sin: [len(positions), rotary_dim/2]`` float32 on positions' device."""
        if seq_len is None and self.scaling.rope_type is RopeType.DYNAMIC and positions.numel():
            seq_len = int(positions.max()) + 1
        inv, scale = self._device_inv_freq(seq_len, positions.device)
        freqs = positions[:, None] * inv[None, :]          # int x float32 -> float32, one kernel
        if scale == 1.0:
            return freqs.cos(), freqs.sin()
        return freqs.cos() * scale, freqs.sin() * scale

    @property
    def captures_tables(self) -> bool:
        """Whether :meth:`cos_sin` runs without host synchronisation (so a CUDA graph can capture it):
        all but dynamic NTK, whose frequencies depend on the step's longest position."""
        return self.scaling.rope_type is not RopeType.DYNAMIC

    def device_inv_freq(self, device: torch.device) -> tuple[torch.Tensor, float]:
        """``(inv_freq, attention_scaling)`` as :meth:`cos_sin` uses them on ``device`` (made once
        there): what a kernel computing the tables itself takes. Not for dynamic NTK, whose
        frequencies depend on the step (:attr:`captures_tables` is False)."""
        if not self.captures_tables:
            raise GraphDSLError("RotaryEmbedding.device_inv_freq: dynamic NTK's frequencies depend on the step's "
                                "longest position; use cos_sin(positions)")
        return self._device_inv_freq(None, device)

    def _device_inv_freq(self, seq_len: int | None, device: torch.device) -> tuple[torch.Tensor, float]:
        """:meth:`inv_freq` on ``device``, kept per device (and per effective length for dynamic NTK):
        copying a fresh CPU table every step would make each decode step wait for the previous one."""
        key = (str(device), self._ntk_len(seq_len))
        cache = self.__dict__.setdefault("_inv_cache", {})
        hit = cache.get(key)
        if hit is None:
            if len(cache) >= 64:                 # dynamic NTK over ever longer contexts: keep it bounded
                cache.clear()
            inv, scale = self.inv_freq(seq_len)
            hit = cache[key] = (inv.to(device), scale)
        return hit

    def _ntk_len(self, seq_len: int | None) -> int | None:
        """The length :meth:`inv_freq` depends on: dynamic NTK's ``max(seq_len, max_positions)``, else none."""
        if self.scaling.rope_type is not RopeType.DYNAMIC:
            return None
        return max(seq_len or self.max_position_embeddings, self.max_position_embeddings)

    # -- graph side --------------------------------------------------------------------------
    def forward(self, q, k, cos, sin):
        """Rotate ``q [T, H, D]`` and ``k [T, Hk, D]`` with the step's tables."""
        return F.rope(q, k, cos, sin, layout=self.layout)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, base={self.base}, scaling={self.scaling.rope_type.value}, " \
               f"layout={self.layout.value}"


def _llama3(inv: torch.Tensor, sc: RopeScaling) -> torch.Tensor:
    orig = sc.original_max_position_embeddings
    low_wavelen, high_wavelen = orig / sc.low_freq_factor, orig / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (orig / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    blended = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(d: int, base: float, sc: RopeScaling) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, orig = sc.factor, sc.original_max_position_embeddings
    attention = sc.attention_factor
    if attention is None:
        attention = (mscale(factor, sc.mscale) / mscale(factor, sc.mscale_all_dim)
                     if sc.mscale and sc.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention)
