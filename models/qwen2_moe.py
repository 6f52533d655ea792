"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Llama-style attention with q/k/v biases; sparse layers
replace the MLP by a softmax top-k MoE plus a sigmoid-gated shared expert. Qwen3-MoE: the same
decoder with Qwen3's q/k-norm attention and no shared expert."""
from __future__ import annotations

from graphdsl import Module
from graphdsl import functional as F
from graphdsl.layers import MoE, Scoring

from .base import to_engine
from .config import (ACTIVATIONS, ConfigBuilder, ModelConfig, check_activation, dense_fields, register_config_builder,
                     sliding_fields)
from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .registry import register_model

__all__ = ["Qwen2MoeForCausalLM", "Qwen2MoeConfigBuilder", "Qwen3MoeForCausalLM", "Qwen3MoeConfigBuilder"]


@register_config_builder
class Qwen2MoeConfigBuilder(ConfigBuilder):
    @classmethod
    def condition(cls, hf: dict) -> bool:
        return hf.get("model_type") == "qwen2_moe"

    @classmethod
    def build(cls, hf: dict) -> ModelConfig:
        check_activation(hf)
        n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1) or 1
        dense = set(hf.get("mlp_only_layers") or ())
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
        return ModelConfig(**dense_fields(hf), **sliding_fields(hf), qkv_bias=bool(hf.get("qkv_bias", True)),
                           num_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                           moe_intermediate_size=hf["moe_intermediate_size"],
                           shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
                           norm_topk_prob=bool(hf.get("norm_topk_prob", False)), moe_layers=moe_layers)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype) -> Module:
        if not config.is_moe_layer(layer_idx):
            return super().make_mlp(config, layer_idx, dtype)
        shared = config.shared_expert_intermediate_size or None
        return MoE(config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                   scoring=Scoring.SOFTMAX, renormalize=config.norm_topk_prob, shared_intermediate_size=shared,
                   shared_expert_gate=bool(shared), act=getattr(F.ActType, ACTIVATIONS[config.hidden_act]),
                   dtype=dtype)


class Qwen2MoeModel(LlamaModel):
    layer_cls = Qwen2MoeDecoderLayer


@register_model(architectures=["Qwen2MoeForCausalLM"], model_types=["qwen2_moe"])
@to_engine()
class Qwen2MoeForCausalLM(LlamaForCausalLM):
    model_types = ("qwen2_moe",)
    model_cls = Qwen2MoeModel


@register_config_builder
class Qwen3MoeConfigBuilder(ConfigBuilder):
    """Qwen3-MoE: Qwen3 attention (q/k-norm, no q/k/v bias) and routed experts without a shared one."""

    @classmethod
    def condition(cls, hf: dict) -> bool:
        return hf.get("model_type") == "qwen3_moe"

    @classmethod
    def build(cls, hf: dict) -> ModelConfig:
        check_activation(hf)
        n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1) or 1
        dense = set(hf.get("mlp_only_layers") or ())
        bias = bool(hf.get("attention_bias", False))
        experts = hf.get("num_experts", hf.get("num_local_experts"))   # transformers 4 / 5 spelling
        if experts is None:
            raise KeyError("num_experts")
        return ModelConfig(**dense_fields(hf), **sliding_fields(hf), qkv_bias=bias, o_bias=bias, qk_norm=True,
                           num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                           moe_intermediate_size=hf["moe_intermediate_size"],
                           norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                           moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(n)))


@register_model(architectures=["Qwen3MoeForCausalLM"], model_types=["qwen3_moe"])
@to_engine()
class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Same modules as Qwen2-MoE; the config turns on q/k-norm and leaves out the shared expert."""

    model_types = ("qwen3_moe",)
    model_cls = Qwen2MoeModel
