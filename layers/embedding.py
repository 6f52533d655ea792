"""Token embedding, split along the vocabulary under tensor parallelism."""
from __future__ import annotations

from graphdsl import Module, Parameter
from graphdsl import functional as F

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(Module):
    """``out[t] = weight[ids[t]] (* scale)`` with ``weight: [num_embeddings, embedding_dim]`` (rows
    sharded). ``scale`` (Gemma's ``sqrt(hidden)``) multiplies in the weight's dtype; pass it already
    rounded to that dtype when the checkpoint's reference does so."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None, scale: float = 1.0):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.scale = num_embeddings, embedding_dim, float(scale)
        self.weight = Parameter((num_embeddings, embedding_dim), dtype, shard_dim=0)

    def forward(self, ids):
        out = F.embedding(ids, self.weight)
        return out if self.scale == 1.0 else out * self.scale

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}" + ("" if self.scale == 1.0 else f", scale={self.scale}")
