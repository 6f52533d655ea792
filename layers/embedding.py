"""Token embedding, split along the vocabulary under tensor parallelism."""
from __future__ import annotations

from graphdsl import Module, Parameter
from graphdsl import functional as F

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(Module):
    """``out[t] = weight[ids[t]]`` with ``weight: [num_embeddings, embedding_dim]`` (rows sharded)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter((num_embeddings, embedding_dim), dtype, shard_dim=0)

    def forward(self, ids):
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
