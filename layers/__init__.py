"""graphdsl.layers — torch-like building blocks over fake tensors.

Every layer is pure architecture: parameters with shapes, dtypes and tensor-parallel shard specs,
and a ``forward`` that records functional ops. Weights are bound afterwards by name.
"""
from .attention import Attention, alibi_slopes
from .checkpoint import CheckpointSlot, checkpoint_layout
from .context import ForwardContext, KVCacheSpec, Phase
from .embedding import VocabParallelEmbedding
from .linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVLayout, QKVParallelLinear,
                     ReplicatedLinear, RowParallelLinear)
from .mla import MLAttention
from .mlp import MLP, GatedMLP
from .moe import FusedExperts, MoE, Router, Scoring, TopkMethod
from .norm import GemmaRMSNorm, LayerNorm, RMSNorm
from .quantize import quantize_linears, quantize_weights, scheme_counts
from .rotary import RopeScaling, RopeType, RotaryEmbedding

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
           "QKVLayout", "ReplicatedLinear", "RMSNorm", "GemmaRMSNorm", "LayerNorm", "VocabParallelEmbedding",
           "RotaryEmbedding", "RopeType", "RopeScaling", "Attention", "MLAttention", "alibi_slopes", "GatedMLP",
           "MLP", "MoE", "Router", "TopkMethod", "FusedExperts", "Scoring", "ForwardContext", "KVCacheSpec",
           "Phase", "CheckpointSlot", "checkpoint_layout", "quantize_linears", "quantize_weights", "scheme_counts"]
