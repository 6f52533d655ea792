"""Mixture of experts: a top-k router over stacked expert weights, plus an optional shared expert.

Routing, in float32: ``scores = softmax(router(x))`` (or ``sigmoid``) → the experts to use are the
top-k of ``scores`` (:class:`TopkMethod`: over all experts, or only within the best groups, the
DeepSeek ways) → a dense ``[num_tokens, num_experts]`` routing matrix holding the chosen experts'
scores, zero elsewhere → optional renormalisation to sum one → times ``routed_scaling_factor``.
Experts are one ``moe_experts`` op over the stacked weights: its reference computes every expert
densely and sums them with those weights (exact); the Triton backend computes only each token's
``top_k`` experts with grouped GEMMs over tokens sorted by expert (:mod:`graphdsl.runtime.kernels.moe`).
"""
from __future__ import annotations

import enum

import torch

from graphdsl import Module, Parameter
from graphdsl import functional as F
from graphdsl.errors import GraphDSLError

from .linear import ReplicatedLinear
from .mlp import GatedMLP

__all__ = ["Scoring", "TopkMethod", "Router", "FusedExperts", "MoE"]


class Scoring(enum.Enum):
    SOFTMAX = "softmax"   # Mixtral, Qwen-MoE, DeepSeek-V2
    SIGMOID = "sigmoid"   # DeepSeek-V3 style


class TopkMethod(enum.Enum):
    """Which experts a token uses (``k = top_k``; experts split into ``num_groups`` equal groups)."""

    GREEDY = "greedy"                              # the k best scores
    GROUP_LIMITED_GREEDY = "group_limited_greedy"  # DeepSeek-V2: the k best within the topk_groups groups of best max
    NOAUX_TC = "noaux_tc"                          # DeepSeek-V3: chosen by score + correction bias (groups ranked by
    #                                                their two best), weighted by the score without it


class Router(ReplicatedLinear):
    """The router projection ``[num_experts, hidden]``, with DeepSeek-V3's per-expert
    ``e_score_correction_bias`` (float32) when ``correction_bias``. ``float32_logits``: multiply
    ``x.float() @ weight.float()`` (DeepSeek keeps the router in float32) instead of in the model
    dtype. Online quantization leaves it in the model dtype: its logits choose the experts."""

    online_quantized = False

    def __init__(self, hidden_size: int, num_experts: int, dtype=None, *, correction_bias: bool = False,
                 float32_logits: bool = False):
        super().__init__(hidden_size, num_experts, False, dtype)
        self.float32_logits = float32_logits
        self.e_score_correction_bias = Parameter((num_experts,), torch.float32) if correction_bias else None

    def forward(self, x):
        if self.float32_logits:
            return F.linear(x.float(), self.weight.float(), None, transpose_b=True)
        return super().forward(x).float()


class FusedExperts(Module):
    """``num_experts`` gated MLPs with stacked weights ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``.

    ``forward(x [T, H], routing [T, E]) = Σ_e routing[:, e] * mlp_e(x)``, where ``routing`` has at
    most ``top_k`` non-zeros a row (None: any number). ``sources`` names each expert's checkpoint
    tensors (``experts.{e}.{gate,up,down}.weight``). With both stacks quantized
    (:meth:`~graphdsl.Parameter.quantize`, online quantization), ``forward`` records
    ``quant_moe_experts`` on their companions instead of ``moe_experts``.
    """

    online_quantized = True     # online quantization stores the stacks in its scheme
    runs_schemes = "fp8-channel, int8-channel, int4-g{32,64,128}[-zp] and gguf-<type> stacks"    # for messages

    def takes_scheme(self, scheme) -> bool:
        """Whether this module runs stacks stored in ``scheme`` (a module that runs them elsewhere
        may take fewer)."""
        return scheme.stackable

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act=F.ActType.SWIGLU,
                 dtype=None, sources: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 top_k: int | None = None):
        super().__init__()
        if act not in (F.ActType.SWIGLU, F.ActType.GEGLU):
            raise GraphDSLError(f"FusedExperts: act must be ActType.SWIGLU or ActType.GEGLU, got {act!r}")
        if top_k is not None and not 1 <= top_k <= num_experts:
            raise GraphDSLError(f"FusedExperts: top_k must be None or in [1, num_experts={num_experts}], got {top_k!r}")
        self.top_k = top_k
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.act, self.sources = act, sources
        self.gate_up_proj = Parameter((num_experts, 2 * intermediate_size, hidden_size), dtype, shard_dim=1)
        self.down_proj = Parameter((num_experts, hidden_size, intermediate_size), dtype, shard_dim=2)

    def forward(self, x, routing):
        up, down = self.gate_up_proj, self.down_proj
        if up.quant is None and down.quant is None:
            return F.moe_experts(x, routing, up, down, act=self.act, top_k=self.top_k)
        if up.quant is None or down.quant is None:
            raise GraphDSLError(f"FusedExperts: {up.name} ({up.quant or 'not quantized'}) and {down.name} "
                                f"({down.quant or 'not quantized'}) must both be quantized or neither")
        return F.quant_moe_experts(x, routing, *up.companions(), *down.companions(), gate_up_scheme=up.quant.name,
                                   down_scheme=down.quant.name, experts=self.num_experts, hidden=self.hidden_size,
                                   intermediate=self.intermediate_size, act=self.act, top_k=self.top_k)

    def checkpoint_slots(self):
        gate, up, down = self.sources
        i, h = self.intermediate_size, self.hidden_size
        for e in range(self.num_experts):
            yield f"{e}.{gate}.weight", "gate_up_proj", (e, slice(0, i)), (i, h)
            yield f"{e}.{up}.weight", "gate_up_proj", (e, slice(i, 2 * i)), (i, h)
            yield f"{e}.{down}.weight", "down_proj", (e,), (h, i)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"top_k={self.top_k}")


class MoE(Module):
    """Sparse MoE block.

    Args:
        num_experts, top_k, intermediate_size: routed experts.
        scoring: :class:`Scoring` of the router logits.
        renormalize: rescale the chosen experts' weights to sum to one.
        topk_method: :class:`TopkMethod`; the grouped ones split the experts into ``num_groups`` and
            choose within the ``topk_groups`` best groups.
        routed_scaling_factor: multiplies the routed experts' weights (after renormalising).
        router_float32: compute the router logits from float32 input and weight.
        shared_intermediate_size: add an always-on shared expert of this size (None: none).
        shared_expert_gate: scale the shared expert by ``sigmoid(gate(x))`` (Qwen2-MoE).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *,
                 scoring: Scoring = Scoring.SOFTMAX, renormalize: bool = False,
                 topk_method: TopkMethod = TopkMethod.GREEDY, num_groups: int = 1, topk_groups: int = 1,
                 routed_scaling_factor: float = 1.0, router_float32: bool = False,
                 shared_intermediate_size: int | None = None, shared_expert_gate: bool = False,
                 act=F.ActType.SWIGLU, dtype=None):
        super().__init__()
        if not isinstance(scoring, Scoring):
            raise GraphDSLError(f"MoE: scoring must be a Scoring, one of {[s.value for s in Scoring]}, got {scoring!r}")
        if not isinstance(topk_method, TopkMethod):
            raise GraphDSLError(f"MoE: topk_method must be a TopkMethod, one of {[m.value for m in TopkMethod]}, "
                                f"got {topk_method!r}")
        if not 1 <= top_k <= num_experts:
            raise GraphDSLError(f"MoE: top_k must be in [1, num_experts={num_experts}], got {top_k!r}")
        grouped = topk_method is not TopkMethod.GREEDY
        if grouped and (num_experts % num_groups or not 1 <= topk_groups <= num_groups
                        or topk_groups * (num_experts // num_groups) < top_k):
            raise GraphDSLError(f"MoE: {topk_method.value} needs num_groups dividing num_experts={num_experts} and "
                                f"1 <= topk_groups <= num_groups with at least top_k={top_k} experts in the chosen "
                                f"groups, got num_groups={num_groups}, topk_groups={topk_groups}")
        if shared_expert_gate and not shared_intermediate_size:
            raise GraphDSLError("MoE: shared_expert_gate needs a shared expert (shared_intermediate_size)")
        self.num_experts, self.top_k, self.scoring, self.renormalize = num_experts, top_k, scoring, renormalize
        self.topk_method, self.routed_scaling_factor = topk_method, float(routed_scaling_factor)
        self.num_groups, self.topk_groups = (num_groups, topk_groups) if grouped else (1, 1)
        self.gate = Router(hidden_size, num_experts, dtype, correction_bias=topk_method is TopkMethod.NOAUX_TC,
                           float32_logits=router_float32)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, act, dtype, top_k=top_k)
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, act=act, dtype=dtype)
        if shared_expert_gate:
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, False, dtype)
            self.shared_expert_gate.online_quantized = False       # one output row: nothing to save
        self.has_shared, self.has_shared_gate = bool(shared_intermediate_size), shared_expert_gate

    def routing_weights(self, x):
        """``[T, E]`` float32: the chosen experts' weights, zero elsewhere."""
        logits = self.gate(x)
        scores = F.softmax(logits, -1) if self.scoring is Scoring.SOFTMAX else F.sigmoid(logits)
        choice = scores
        if self.gate.e_score_correction_bias is not None:
            choice = scores + self.gate.e_score_correction_bias
        if self.num_groups > 1:
            choice = self._within_top_groups(choice)
        _, ids = F.topk(choice, k=self.top_k, dim=-1)
        weights = F.where(F.index_mask(ids, self.num_experts), scores, scores * 0.0)
        if self.renormalize:
            total = weights.sum(-1, keepdim=True)
            weights = weights / (total + 1e-20 if self.topk_method is TopkMethod.NOAUX_TC else total)
        return weights if self.routed_scaling_factor == 1.0 else weights * self.routed_scaling_factor

    def _within_top_groups(self, choice):
        """``choice`` with the experts outside the ``topk_groups`` best groups pushed to -1e30 (a
        group ranks by its best score, or by its two best summed for ``NOAUX_TC``)."""
        g, per = self.num_groups, self.num_experts // self.num_groups
        grouped = choice.reshape(-1, g, per)
        if self.topk_method is TopkMethod.NOAUX_TC:
            rank = F.topk(grouped, k=2, dim=-1)[0].sum(-1)
        else:
            rank = grouped.max(-1)
        _, best = F.topk(rank, k=self.topk_groups, dim=-1)
        kept = F.where(F.index_mask(best, g).unsqueeze(-1), grouped, grouped * 0.0 - 1e30)
        return kept.reshape(-1, self.num_experts)

    def forward(self, x):
        out = self.experts(x, self.routing_weights(x))
        if self.has_shared:
            shared = self.shared_expert(x)
            if self.has_shared_gate:
                shared = F.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def extra_repr(self) -> str:
        groups = "" if self.num_groups == 1 else f", groups={self.topk_groups}/{self.num_groups}"
        return (f"top_k={self.top_k}, scoring={self.scoring.value}, renormalize={self.renormalize}, "
                f"topk_method={self.topk_method.value}{groups}, scaling={self.routed_scaling_factor}")

