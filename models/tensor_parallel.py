"""Models-side glue of tensor parallelism: which layers of a :class:`FlashCausalLM` are the
vocabulary heads, and the per-rank KV-cache geometry. The transform itself is
:func:`graphdsl.layers.tensor_parallel.shard_tensor_parallel`; model files never see the world size."""
from __future__ import annotations

from graphdsl.layers.tensor_parallel import TensorParallel, local_kv_heads, shard_tensor_parallel

from .base import FlashCausalLM

__all__ = ["shard_model", "kv_heads_per_rank"]


def shard_model(model: FlashCausalLM, tp: TensorParallel, *, expert_parallel: bool = False) -> FlashCausalLM:
    """``model`` (in place, before weights load) as rank ``tp.rank``'s shard; the LM head is
    vocab-parallel with its logits all-gathered, so every rank's engine returns whole logits."""
    model._engines.clear()
    return shard_tensor_parallel(model, tp.rank, tp.world_size, vocab_heads=("lm_head",),
                                 expert_parallel=expert_parallel)


def kv_heads_per_rank(model: FlashCausalLM, world_size: int) -> int:
    """KV heads in one rank's cache (``K / W``, or 1 when the ``K < W`` heads are replicated)."""
    return local_kv_heads(model.config.num_key_value_heads, world_size)
