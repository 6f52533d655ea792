"""Qwen2 / Qwen2.5: the Llama architecture with q/k/v biases (and optional sliding-window layers)."""
from __future__ import annotations

from .base import to_engine
from .config import ConfigBuilder, ModelConfig, check_activation, dense_fields, register_config_builder, sliding_fields
from .llama import LlamaForCausalLM
from .registry import register_model

__all__ = ["Qwen2ForCausalLM", "Qwen2ConfigBuilder"]


@register_config_builder
class Qwen2ConfigBuilder(ConfigBuilder):
    @classmethod
    def condition(cls, hf: dict) -> bool:
        return hf.get("model_type") == "qwen2"

    @classmethod
    def build(cls, hf: dict) -> ModelConfig:
        check_activation(hf)
        return ModelConfig(**dense_fields(hf), **sliding_fields(hf), qkv_bias=True)


@register_model(architectures=["Qwen2ForCausalLM"], model_types=["qwen2"])
@to_engine()
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same modules as Llama; the config turns on the q/k/v biases."""

    model_types = ("qwen2",)
