"""Mixtral (8x7B, 8x22B): Mistral attention, and every MLP replaced by a top-2 softmax MoE over
8 SwiGLU experts whose two weights are renormalised to sum to one (no shared expert).

The modules are Qwen2-MoE's decoder (``mlp.gate``, ``mlp.experts``); Mixtral checkpoints name the
block ``block_sparse_moe`` and each expert's gate/down/up ``w1``/``w2``/``w3``, which
``checkpoint_renames`` maps (llama.cpp's GGUF names arrive in the first form already).
"""
from __future__ import annotations

from .base import to_engine
from .config import ConfigBuilder, ModelConfig, check_activation, dense_fields, register_config_builder, sliding_fields
from .llama import LlamaForCausalLM
from .qwen2_moe import Qwen2MoeModel
from .registry import register_model

__all__ = ["MixtralForCausalLM", "MixtralConfigBuilder"]


@register_config_builder
class MixtralConfigBuilder(ConfigBuilder):
    @classmethod
    def condition(cls, hf: dict) -> bool:
        return hf.get("model_type") == "mixtral"

    @classmethod
    def build(cls, hf: dict) -> ModelConfig:
        check_activation(hf)
        return ModelConfig(**dense_fields(hf), **sliding_fields(hf), num_experts=hf["num_local_experts"],
                           num_experts_per_tok=hf["num_experts_per_tok"],
                           moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)


@register_model(architectures=["MixtralForCausalLM"], model_types=["mixtral"])
@to_engine()
class MixtralForCausalLM(LlamaForCausalLM):
    model_types = ("mixtral",)
    model_cls = Qwen2MoeModel
    checkpoint_renames = ((r"\.block_sparse_moe\.", ".mlp."),
                          (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
                          (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
                          (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."))
