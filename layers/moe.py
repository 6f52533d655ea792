"""Mixture of experts: a top-k router over stacked expert weights, plus an optional shared expert.

Routing: ``scores = softmax(router(x))`` (or ``sigmoid``) in float32 → top-k → optional
renormalisation of the k weights → a dense ``[num_tokens, num_experts]`` routing matrix (zero
off the chosen experts). Experts are computed densely as batched matmuls over the stacked weights
and summed with those weights — exact, and simple to fuse or replace by a grouped-GEMM kernel
later; a CPU reference does not need sparsity to be correct.
"""
from __future__ import annotations

import enum

from graphdsl import Module, Parameter
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError

from .linear import ReplicatedLinear
from .mlp import GatedMLP

__all__ = ["Scoring", "FusedExperts", "MoE"]


class Scoring(enum.Enum):
    SOFTMAX = "softmax"   # Mixtral, Qwen-MoE
    SIGMOID = "sigmoid"   # DeepSeek-V3 style


class FusedExperts(Module):
    """``num_experts`` gated MLPs with stacked weights ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``.

    ``forward(x [T, H], routing [T, E]) = Σ_e routing[:, e] * mlp_e(x)``. ``sources`` names each
    expert's checkpoint tensors (``experts.{e}.{gate,up,down}.weight``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act=F.ActType.SWIGLU,
                 dtype=None, sources: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.act, self.sources = act, sources
        self.gate_up_proj = Parameter((num_experts, 2 * intermediate_size, hidden_size), dtype, shard_dim=1)
        self.down_proj = Parameter((num_experts, hidden_size, intermediate_size), dtype, shard_dim=2)

    def forward(self, x, routing):
        h = F.activation(F.matmul(x, self.gate_up_proj, transpose_b=True), self.act)   # [E, T, I]
        y = F.matmul(h, self.down_proj, transpose_b=True)                               # [E, T, H]
        w = routing.permute(1, 0).unsqueeze(-1).to(y)                             # [E, T, 1]
        return (y * w).sum(0)

    def checkpoint_slots(self):
        gate, up, down = self.sources
        i, h = self.intermediate_size, self.hidden_size
        for e in range(self.num_experts):
            yield f"{e}.{gate}.weight", "gate_up_proj", (e, slice(0, i)), (i, h)
            yield f"{e}.{up}.weight", "gate_up_proj", (e, slice(i, 2 * i)), (i, h)
            yield f"{e}.{down}.weight", "down_proj", (e,), (h, i)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"


class MoE(Module):
    """Sparse MoE block.

    Args:
        num_experts, top_k, intermediate_size: routed experts.
        scoring: :class:`Scoring` of the router logits.
        renormalize: rescale the top-k weights to sum to one.
        shared_intermediate_size: add an always-on shared expert of this size (None: none).
        shared_expert_gate: scale the shared expert by ``sigmoid(gate(x))`` (Qwen2-MoE).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *,
                 scoring: Scoring = Scoring.SOFTMAX, renormalize: bool = False,
                 shared_intermediate_size: int | None = None, shared_expert_gate: bool = False,
                 act=F.ActType.SWIGLU, dtype=None):
        super().__init__()
        if not isinstance(scoring, Scoring):
            raise GraphDSLError(f"MoE: scoring must be a Scoring, one of {[s.value for s in Scoring]}, got {scoring!r}")
        if not 1 <= top_k <= num_experts:
            raise GraphDSLError(f"MoE: top_k must be in [1, num_experts={num_experts}], got {top_k!r}")
        if shared_expert_gate and not shared_intermediate_size:
            raise GraphDSLError("MoE: shared_expert_gate needs a shared expert (shared_intermediate_size)")
        self.num_experts, self.top_k, self.scoring, self.renormalize = num_experts, top_k, scoring, renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, dtype)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, act, dtype)
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, act=act, dtype=dtype)
        if shared_expert_gate:
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, False, dtype)
        self.has_shared, self.has_shared_gate = bool(shared_intermediate_size), shared_expert_gate

    def routing_weights(self, x):
        """``[T, E]`` float32: the chosen experts' weights, zero elsewhere."""
        logits = self.gate(x).float()
        scores = F.softmax(logits, -1) if self.scoring is Scoring.SOFTMAX else F.sigmoid(logits)
        weights, ids = F.topk(scores, k=self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        zero = weights * 0.0
        cols = [F.where(F.eq(ids, e), weights, zero).sum(-1, keepdim=True) for e in range(self.num_experts)]
        return F.cat(cols, -1)

    def forward(self, x):
        out = self.experts(x, self.routing_weights(x))
        if self.has_shared:
            shared = self.shared_expert(x)
            if self.has_shared_gate:
                shared = F.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, scoring={self.scoring.value}, renormalize={self.renormalize}"
