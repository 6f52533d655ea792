"""Self-attention over a paged KV cache: MHA/GQA, optional q/k RMSNorm, sliding window, soft-capping,
RoPE or ALiBi positions.

``forward(x, ctx)``: fused qkv projection → (q/k-norm) → RoPE with the step's cos/sin (when the
layer has a rotary embedding) → write the new k/v into this layer's cache blocks
(``reshape_and_cache``) → paged attention (prefill when the context has ``query_start_loc``, decode
otherwise; ALiBi biases the scores there) → output projection.
"""
from __future__ import annotations

import math

from graphdsl import Module
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError

from .context import ForwardContext
from .linear import QKVLayout, QKVParallelLinear, RowParallelLinear
from .norm import RMSNorm
from .rotary import RotaryEmbedding

__all__ = ["Attention", "alibi_slopes"]


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """ALiBi's per-head slopes (Press et al., as Bloom uses them): for ``n`` the largest power of two
    ``<= num_heads``, head ``i < n`` gets ``2^(-8 (i + 1) / n)``; the remaining heads take every other
    slope of the ``2n`` sequence, ``2^(-4 (2j + 1) / n)`` for ``j = 0, 1, ...``."""
    if not isinstance(num_heads, int) or num_heads < 1:
        raise GraphDSLError(f"alibi_slopes: num_heads must be a positive int, got {num_heads!r}")
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    slopes += [2.0 ** (-4.0 * (2 * j + 1) / n) for j in range(min(n, num_heads - n))]
    return tuple(slopes)


class Attention(Module):
    """Args:
        hidden_size, num_heads, num_kv_heads, head_dim: geometry (``num_heads % num_kv_heads == 0``).
        layer_idx: which of ``ctx.kv_caches`` this layer owns.
        rotary: the model's :class:`RotaryEmbedding` (shared, parameter-free); None: no RoPE.
        qkv_bias / o_bias: projection biases.
        qk_norm_eps: if set, RMSNorm over each q and k head before RoPE (Qwen3).
        sliding_window: attend to at most this many most recent positions (None: all).
        scale: softmax scale, default ``head_dim ** -0.5``.
        soft_cap: if set, scores become ``soft_cap * tanh(scores / soft_cap)`` (Gemma 2).
        alibi_slopes: one slope per query head (:func:`alibi_slopes`): ``slope * (key - query
            position)`` is added to the scores (Bloom).
        qkv_layout: how the checkpoint stores q/k/v (:class:`~graphdsl.layers.QKVLayout`).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding | None, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm_eps: float | None = None, sliding_window: int | None = None, scale: float | None = None,
                 soft_cap: float | None = None, alibi_slopes: tuple[float, ...] | None = None,
                 qkv_layout: QKVLayout = QKVLayout.SEPARATE, dtype=None):
        super().__init__()
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
            raise GraphDSLError(f"Attention: sliding_window must be a positive int or None, got {sliding_window!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        if soft_cap is not None and not soft_cap > 0:
            raise GraphDSLError(f"Attention: soft_cap must be > 0 or None, got {soft_cap!r}")
        if alibi_slopes is not None and len(alibi_slopes) != num_heads:
            raise GraphDSLError(f"Attention: alibi_slopes has {len(alibi_slopes)} slopes for {num_heads} heads")
        self.layer_idx, self.sliding_window, self.soft_cap = layer_idx, sliding_window, soft_cap
        self.alibi_slopes = None if alibi_slopes is None else tuple(float(x) for x in alibi_slopes)
        self.scale = head_dim ** -0.5 if scale is None else float(scale)
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias, dtype,
                                          layout=qkv_layout)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, o_bias, dtype)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
        self.qk_norm = qk_norm_eps is not None
        object.__setattr__(self, "rotary", rotary)   # shared across layers, not a child

    def forward(self, x, ctx: ForwardContext):
        q, k, v = self.qkv_proj(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, k, ctx.cos, ctx.sin)
        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        key_cache, value_cache = F.reshape_and_cache(k, v, key_cache, value_cache, ctx.slot_mapping)
        out = F.paged_attention(q, key_cache, value_cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
                                scale=self.scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap,
                                alibi_slopes=self.alibi_slopes)
        tokens = x.shape[0] if x.shape is not None else -1
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, qk_norm={self.qk_norm}, sliding_window={self.sliding_window}"
                + ("" if self.soft_cap is None else f", soft_cap={self.soft_cap}")
                + ("" if self.alibi_slopes is None else ", alibi"))
