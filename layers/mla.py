"""Multi-head latent attention (DeepSeek-V2/V3) over a compressed paged cache.

Each token's keys and values are generated from one latent: ``c = RMSNorm(x W_DKV)`` of
``kv_lora_rank`` dims and a shared RoPE key ``k_pe = RoPE(x W_KR)`` of ``qk_rope_head_dim`` dims.
Only ``[c | k_pe]`` is cached (576 numbers a token and layer for DeepSeek-V2, instead of
``heads * (192 + 128)`` for the expanded keys and values). Head ``h``'s key is
``[c W_UK[h] | k_pe]`` and its value ``c W_UV[h]``, where ``kv_b_proj`` stacks ``W_UK`` and
``W_UV``; attention runs weight-absorbed, in prefill and decode alike:

    q_lat[h] = q_nope[h] W_UK[h]ᵀ                    ([T, H, kv_lora_rank], folded per head)
    o_lat    = softmax([q_lat | q_pe] · [c | k_pe]ᵀ · scale) · c      (paged_mla_attention)
    out[h]   = o_lat[h] W_UV[h]ᵀ  → o_proj

which equals the expanded form (``q·k = q_nope·(c W_UK) + q_pe·k_pe``). The paged cache keeps the
latent ``[c | k_pe]`` split in two halves, the first in the layer's key cache and the second in its
value cache, both ``[num_blocks, block_size, 1, (kv_lora_rank + qk_rope_head_dim) / 2]``.
"""
from __future__ import annotations

from graphdsl import Module
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError

from .context import ForwardContext
from .linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, _tokens
from .norm import RMSNorm
from .rotary import RotaryEmbedding

__all__ = ["MLAttention"]


class MLAttention(Module):
    """Args:
        hidden_size, num_heads: geometry.
        q_lora_rank: rank of the low-rank query (``q_a_proj`` → RMSNorm → ``q_b_proj``); None: one
            ``q_proj``.
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: the latent and per-head sizes.
        layer_idx: which of ``ctx.kv_caches`` this layer owns.
        rotary: the model's :class:`RotaryEmbedding` over ``qk_rope_head_dim`` (GPT-J pairs for DeepSeek).
        scale: softmax scale (DeepSeek: ``(nope + rope) ** -0.5``, times YaRN's ``mscale²``).
        norm_eps: eps of the latent (and low-rank query) RMSNorms.
        bias: biases of the down projections and ``o_proj`` (``attention_bias``).
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, layer_idx: int,
                 rotary: RotaryEmbedding, *, scale: float, norm_eps: float = 1e-6, bias: bool = False, dtype=None):
        super().__init__()
        if (kv_lora_rank + qk_rope_head_dim) % 2:
            raise GraphDSLError(f"MLAttention: kv_lora_rank + qk_rope_head_dim must be even (the latent is cached "
                                f"in two halves), got {kv_lora_rank} + {qk_rope_head_dim}")
        self.num_heads, self.layer_idx, self.scale = num_heads, layer_idx, float(scale)
        self.kv_lora_rank, self.nope, self.rope, self.v_head_dim = kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, \
            v_head_dim
        q_out = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, q_out, False, dtype)
        else:
            self.q_a_proj = ReplicatedLinear(hidden_size, q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, q_out, False, dtype)
        self.q_lora = q_lora_rank is not None
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False, dtype)
        # its weight is absorbed into the attention's matmuls (forward), never run as a linear: online
        # quantization leaves it in the model dtype (a layer's 2.1 M of DeepSeek-V2-Lite's 15.7 B weights)
        self.kv_b_proj.online_quantized = False
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, bias, dtype)
        object.__setattr__(self, "rotary", rotary)   # shared across layers, not a child

    def forward(self, x, ctx: ForwardContext):
        t, h = _tokens(x), self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = F.split(q.reshape(t, h, self.nope + self.rope), [self.nope, self.rope], -1)
        c, k_pe = F.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.rope], -1)
        q_pe, k_pe = self.rotary(q_pe, k_pe.reshape(t, 1, self.rope), ctx.cos, ctx.sin)
        latent = F.cat([self.kv_a_layernorm(c).reshape(t, 1, self.kv_lora_rank), k_pe], -1)
        first, second = F.split(latent, 2, -1)
        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        key_cache, value_cache = F.reshape_and_cache(first, second, key_cache, value_cache, ctx.slot_mapping)
        w_uk, w_uv = F.split(self.kv_b_proj.weight.reshape(h, self.nope + self.v_head_dim, self.kv_lora_rank),
                             [self.nope, self.v_head_dim], 1)
        q_lat = F.matmul(q_nope.permute(1, 0, 2), w_uk).permute(1, 0, 2)               # [T, H, kv_lora_rank]
        o_lat = F.paged_mla_attention(F.cat([q_lat, q_pe], -1), key_cache, value_cache, ctx.block_tables,
                                      ctx.seq_lens, ctx.query_start_loc, scale=self.scale,
                                      value_dim=self.kv_lora_rank)
        out = F.matmul(o_lat.permute(1, 0, 2), w_uv, transpose_b=True).permute(1, 0, 2)  # [T, H, v_head_dim]
        return self.o_proj(out.reshape(t, h * self.v_head_dim))

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, q_lora={self.q_lora}, "
                f"kv_lora_rank={self.kv_lora_rank}, nope={self.nope}, rope={self.rope}, v={self.v_head_dim}")
