"""DeepSeek-V2 / V2-Lite (and DeepSeek-V3's routing): pure architecture on the Llama trunk.

* attention: multi-head latent attention (:class:`~graphdsl.layers.MLAttention`) caching only the
  ``kv_lora_rank`` latent and the RoPE key, weight-absorbed in prefill and decode; optional
  low-rank query (``q_lora_rank``); RoPE on GPT-J pairs, usually YaRN-scaled, with the softmax scale
  multiplied by YaRN's ``mscale(factor, mscale_all_dim)²``;
* MLP: dense in the first ``first_k_dense_replace`` layers (and off the ``moe_layer_freq`` grid),
  elsewhere ``n_routed_experts`` SwiGLU experts chosen per token by ``topk_method`` (``greedy``,
  ``group_limited_greedy`` over ``n_group`` groups, or V3's ``noaux_tc`` with the sigmoid scores'
  correction bias), weighted by ``routed_scaling_factor``, plus ``n_shared_experts`` always-on ones.

The paged cache geometry is the config's ``num_key_value_heads = 1`` and ``head_dim =
(kv_lora_rank + qk_rope_head_dim) / 2``: each layer's key and value caches hold the two halves of
the latent (576 numbers a token for DeepSeek-V2).
"""
from __future__ import annotations

import math

from graphdsl import Module
from graphdsl import functional as F
from graphdsl.layers import MLAttention, MoE, RopeType, RotaryEmbedding, Scoring, TopkMethod

from .base import to_engine
from .config import ConfigBuilder, ModelConfig, UnsupportedModelError, check_activation, dense_fields, \
    register_config_builder
from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .registry import register_model

__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV2Config", "DeepseekV2ConfigBuilder"]


class DeepseekV2Config(ModelConfig):
    q_lora_rank: int | None = None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False
    softmax_scale: float
    rope_interleave: bool = True
    scoring: Scoring = Scoring.SOFTMAX
    topk_method: TopkMethod = TopkMethod.GREEDY
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim


def _softmax_scale(qk_head_dim: int, rope) -> float:
    """``qk_head_dim ** -0.5``, times ``(0.1 * mscale_all_dim * ln(factor) + 1)²`` under YaRN."""
    scale = qk_head_dim ** -0.5
    if rope is not None and rope.rope_type is RopeType.YARN and rope.mscale_all_dim and rope.factor > 1:
        scale *= (0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0) ** 2
    return scale


def _enum(kind, value, what: str):
    try:
        return kind(value)
    except ValueError:
        raise UnsupportedModelError(f"{what} {value!r} is not supported; supported: {[k.value for k in kind]}") \
            from None


@register_config_builder
class DeepseekV2ConfigBuilder(ConfigBuilder):
    @classmethod
    def condition(cls, hf: dict) -> bool:
        return hf.get("model_type") in ("deepseek_v2", "deepseek_v3")

    @classmethod
    def build(cls, hf: dict) -> DeepseekV2Config:
        check_activation(hf)
        v3 = hf["model_type"] == "deepseek_v3"
        fields = dense_fields(hf)
        lora, rope = hf["kv_lora_rank"], hf["qk_rope_head_dim"]
        n, first, freq = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
        experts = hf.get("n_routed_experts")
        fields.update(num_key_value_heads=1, head_dim=(lora + rope) // 2)   # the latent cache, in two halves
        return DeepseekV2Config(
            **fields, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=lora, qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=rope, v_head_dim=hf["v_head_dim"], attention_bias=bool(hf.get("attention_bias", False)),
            softmax_scale=_softmax_scale(hf["qk_nope_head_dim"] + rope, fields["rope_scaling"]),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            num_experts=experts or 0, num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
            shared_expert_intermediate_size=(hf.get("moe_intermediate_size") or 0) * (hf.get("n_shared_experts") or 0),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_layers=tuple(bool(experts) and i >= first and i % freq == 0 for i in range(n)),
            scoring=_enum(Scoring, hf.get("scoring_func", "sigmoid" if v3 else "softmax"), "scoring_func"),
            topk_method=_enum(TopkMethod, hf.get("topk_method") or ("noaux_tc" if v3 else "greedy"), "topk_method"),
            n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    def make_attention(self, config: DeepseekV2Config, layer_idx: int, rotary: RotaryEmbedding, dtype) -> Module:
        return MLAttention(config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
                           config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, layer_idx, rotary,
                           scale=config.softmax_scale, norm_eps=config.rms_norm_eps, bias=config.attention_bias,
                           dtype=dtype)

    def make_mlp(self, config: DeepseekV2Config, layer_idx: int, dtype) -> Module:
        if not config.is_moe_layer(layer_idx):
            return super().make_mlp(config, layer_idx, dtype)
        return MoE(config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                   scoring=config.scoring, renormalize=config.norm_topk_prob, topk_method=config.topk_method,
                   num_groups=config.n_group, topk_groups=config.topk_group,
                   routed_scaling_factor=config.routed_scaling_factor, router_float32=True,
                   shared_intermediate_size=config.shared_expert_intermediate_size or None, dtype=dtype)


class DeepseekV2Model(LlamaModel):
    layer_cls = DeepseekV2DecoderLayer

    def __init__(self, config: DeepseekV2Config, dtype=None):
        super().__init__(config, dtype)
        self.rotary_emb.layout = F.RopeLayout.GPTJ if config.rope_interleave else F.RopeLayout.NEOX


@register_model(architectures=["DeepseekV2ForCausalLM"], model_types=["deepseek_v2"])
@to_engine()
class DeepseekV2ForCausalLM(LlamaForCausalLM):
    model_types = ("deepseek_v2",)
    model_cls = DeepseekV2Model
    checkpoint_renames = ((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),)


@register_model(architectures=["DeepseekV3ForCausalLM"], model_types=["deepseek_v3"])
@to_engine()
class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3's architecture is V2's with sigmoid ``noaux_tc`` routing (the config says so)."""

    model_types = ("deepseek_v3",)
