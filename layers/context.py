"""The per-step context a model's ``forward`` takes: one object, so signatures never change.

A :class:`ForwardContext` holds the *graph inputs* of one engine step (fake tensors while
recording). The runtime fills the same names with real tensors each step
(:meth:`ForwardContext.input_names` lists them). Prefill packs the new tokens of several sequences
into one ``num_tokens`` axis (``query_start_loc`` marks where each sequence's queries start);
decode has one token per sequence and no ``query_start_loc``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from graphdsl import Dim, Tensor

__all__ = ["Phase", "KVCacheSpec", "ForwardContext"]


class Phase(enum.Enum):
    """Which engine entry point a step runs."""

    PREFILL = "prefill"   # packed new tokens of each sequence; logits only at ``lm_head_indices``
    DECODE = "decode"     # one new token per sequence; logits for every token


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one layer's paged cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @staticmethod
    def key_name(layer: int) -> str:
        return f"k_cache.{layer}"

    @staticmethod
    def value_name(layer: int) -> str:
        return f"v_cache.{layer}"


@dataclass
class ForwardContext:
    """Graph inputs of one step.

    Attributes:
        phase: prefill or decode.
        input_ids: ``[num_tokens]`` int64 token ids.
        positions: ``[num_tokens]`` int64 absolute positions (for models that embed positions).
        cos, sin: ``[num_tokens, rotary_dim / 2]`` float32 rotary tables gathered per token on the host.
        slot_mapping: ``[num_tokens]`` int64 cache slot of each new token.
        block_tables: ``[num_seqs, max_blocks]`` int32 cache blocks of each sequence.
        seq_lens: ``[num_seqs]`` int32 context length of each sequence including this step.
        query_start_loc: ``[num_seqs + 1]`` int32 (prefill only).
        lm_head_indices: ``[num_logits]`` int64 rows of the hidden states to project (prefill only).
        kv_caches: per layer ``(key_cache, value_cache)``.
    """

    phase: Phase
    input_ids: Tensor
    positions: Tensor
    cos: Tensor
    sin: Tensor
    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor | None
    lm_head_indices: Tensor | None
    kv_caches: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    @classmethod
    def symbolic(cls, phase: Phase, cache: KVCacheSpec, rotary_dim: int) -> "ForwardContext":
        """Fake inputs with named symbolic dims, for recording ``forward`` once per phase."""
        n = Dim("num_tokens")
        s = Dim("num_seqs")
        blocks, max_blocks = Dim("num_blocks"), Dim("max_blocks_per_seq")
        prefill = phase is Phase.PREFILL
        cache_shape = (blocks, cache.block_size, cache.num_kv_heads, cache.head_dim)
        return cls(
            phase=phase,
            input_ids=Tensor("input_ids", (n,), torch.int64),
            positions=Tensor("positions", (n,), torch.int64),
            cos=Tensor("cos", (n, rotary_dim // 2), torch.float32),
            sin=Tensor("sin", (n, rotary_dim // 2), torch.float32),
            slot_mapping=Tensor("slot_mapping", (n,), torch.int64),
            block_tables=Tensor("block_tables", (s, max_blocks), torch.int32),
            seq_lens=Tensor("seq_lens", (s,), torch.int32),
            query_start_loc=Tensor("query_start_loc", (s + 1,), torch.int32) if prefill else None,
            lm_head_indices=Tensor("lm_head_indices", (Dim("num_logits"),), torch.int64) if prefill else None,
            kv_caches=[(Tensor(cache.key_name(i), cache_shape, cache.dtype),
                        Tensor(cache.value_name(i), cache_shape, cache.dtype)) for i in range(cache.num_layers)],
        )

    @staticmethod
    def input_names(phase: Phase) -> list[str]:
        """Names of the per-step inputs the runtime feeds (caches are bound once)."""
        names = ["input_ids", "positions", "cos", "sin", "slot_mapping", "block_tables", "seq_lens"]
        return names + (["query_start_loc", "lm_head_indices"] if phase is Phase.PREFILL else [])
