"""Llama (2, 3, 3.1, 3.2), Mistral and SmolLM: pure architecture.

embed → N × [RMSNorm → attention (GQA, RoPE, paged cache) → add+RMSNorm → gated MLP] → add+RMSNorm
→ lm_head. Module names follow the HF checkpoints (``model.layers.3.self_attn.qkv_proj`` packs
``q_proj``/``k_proj``/``v_proj``), so the weight table is derived from the layers.
"""
from __future__ import annotations

from graphdsl import Module, ModuleList
from graphdsl import functional as F
from graphdsl.layers import (Attention, ColumnParallelLinear, ForwardContext, GatedMLP, RMSNorm, RotaryEmbedding,
                             VocabParallelEmbedding)

from .base import FlashCausalLM, to_engine
from .config import (ACTIVATIONS, ConfigBuilder, ModelConfig, check_activation, dense_fields,
                     register_config_builder, sliding_fields)
from .registry import register_model

__all__ = ["LlamaAttention", "LlamaDecoderLayer", "LlamaModel", "LlamaForCausalLM", "LlamaConfigBuilder"]


@register_config_builder
class LlamaConfigBuilder(ConfigBuilder):
    @classmethod
    def condition(cls, hf: dict) -> bool:
        return hf.get("model_type") in ("llama", "mistral")

    @classmethod
    def build(cls, hf: dict) -> ModelConfig:
        check_activation(hf)
        bias = bool(hf.get("attention_bias", False))
        return ModelConfig(**dense_fields(hf), **sliding_fields(hf), qkv_bias=bias, o_bias=bias,
                           mlp_bias=bool(hf.get("mlp_bias", False)))


def make_rotary(config: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings,
                           config.rope_scaling, rotary_dim=config.rotary_dim)


def LlamaAttention(config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, dtype) -> Attention:
    """The attention block of this family, configured from the model config."""
    return Attention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                     layer_idx, rotary, qkv_bias=config.qkv_bias, o_bias=config.o_bias,
                     qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
                     sliding_window=config.layer_sliding_window(layer_idx), dtype=dtype)


class LlamaDecoderLayer(Module):
    norm_cls = RMSNorm

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, dtype=None):
        super().__init__()
        self.input_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = self.make_attention(config, layer_idx, rotary, dtype)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = self.make_mlp(config, layer_idx, dtype)

    def make_attention(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, dtype) -> Module:
        return LlamaAttention(config, layer_idx, rotary, dtype)

    def make_mlp(self, config: ModelConfig, layer_idx: int, dtype) -> Module:
        act = getattr(F.ActType, ACTIVATIONS[config.hidden_act])
        return GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, act, dtype)

    def forward(self, x, residual, ctx: ForwardContext):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(Module):
    layer_cls = LlamaDecoderLayer
    norm_cls = RMSNorm

    def __init__(self, config: ModelConfig, dtype=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.rotary_emb = make_rotary(config)
        self.layers = ModuleList(self.layer_cls(config, i, self.rotary_emb, dtype)
                                 for i in range(config.num_hidden_layers))
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, ctx: ForwardContext):
        x, residual = self.embed_tokens(ctx.input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x


@register_model(architectures=["LlamaForCausalLM", "MistralForCausalLM"], model_types=["llama", "mistral"])
@to_engine()
class LlamaForCausalLM(FlashCausalLM):
    model_types = ("llama", "mistral")
    model_cls = LlamaModel

    def __init__(self, config: ModelConfig, dtype=None):
        super().__init__(config, dtype)
        self.model = self.model_cls(config, self.dtype)
        self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, False, self.dtype)
