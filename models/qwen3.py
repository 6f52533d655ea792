"""Qwen3: Llama-style decoder with per-head RMSNorm on q and k before RoPE (``q_norm``/``k_norm``)."""
from __future__ import annotations

from .base import to_engine
from .config import ConfigBuilder, ModelConfig, check_activation, dense_fields, register_config_builder, sliding_fields
from .llama import LlamaForCausalLM
from .registry import register_model

__all__ = ["Qwen3ForCausalLM", "Qwen3ConfigBuilder"]


@register_config_builder
class Qwen3ConfigBuilder(ConfigBuilder):
    @classmethod
    def condition(cls, hf: dict) -> bool:
        return hf.get("model_type") == "qwen3"

    @classmethod
    def build(cls, hf: dict) -> ModelConfig:
        check_activation(hf)
        bias = bool(hf.get("attention_bias", False))
        return ModelConfig(**dense_fields(hf), **sliding_fields(hf), qkv_bias=bias, o_bias=bias, qk_norm=True)


@register_model(architectures=["Qwen3ForCausalLM"], model_types=["qwen3"])
@to_engine()
class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same modules as Llama; the config turns on q/k-norm (``self_attn.q_norm`` / ``k_norm``)."""

    model_types = ("qwen3",)
