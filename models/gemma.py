"""Gemma and Gemma 2: pure architecture on the Llama trunk.

* Gemma — Llama with GeGLU (tanh-approximate GELU) MLPs, RMSNorms that scale by ``1 + w``
  (:class:`~graphdsl.layers.GemmaRMSNorm`), the embedding multiplied by ``sqrt(hidden_size)``
  rounded to the model dtype, and tied embeddings.
* Gemma 2 — Gemma plus: sliding-window and global attention layers alternating (``layer_types``,
  layer 0 sliding by default), attention scores soft-capped (``cap * tanh(s / cap)``) and scaled by
  ``query_pre_attn_scalar ** -0.5``, norms after attention and around the MLP::

      x = x + post_attention_layernorm(self_attn(input_layernorm(x)))
      x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

  and the final logits soft-capped.
"""
from __future__ import annotations

import torch

from graphdsl import Module
from graphdsl import functional as F
from graphdsl.layers import Attention, ForwardContext, GatedMLP, GemmaRMSNorm, RotaryEmbedding

from .base import to_engine
from .config import ConfigBuilder, ModelConfig, UnsupportedModelError, dense_fields, register_config_builder
from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .registry import register_model

__all__ = ["GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma2Config", "GemmaConfigBuilder", "Gemma2ConfigBuilder"]


class Gemma2Config(ModelConfig):
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None


def _gemma_fields(hf: dict) -> dict:
    """What both generations read: the activation (``hidden_activation`` wins; Gemma's legacy
    ``"gelu"`` means the tanh approximation, as in transformers) and tied embeddings by default."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu", "gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"Gemma hidden activation {act!r} is not supported; supported: "
                                    f"['gelu', 'gelu_pytorch_tanh'] (both the tanh approximation)")
    fields = dense_fields({**hf, "hidden_act": "gelu_pytorch_tanh"})
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    bias = bool(hf.get("attention_bias", False))
    return dict(fields, qkv_bias=bias, o_bias=bias)


@register_config_builder
class GemmaConfigBuilder(ConfigBuilder):
    @classmethod
    def condition(cls, hf: dict) -> bool:
        return hf.get("model_type") == "gemma"

    @classmethod
    def build(cls, hf: dict) -> ModelConfig:
        return ModelConfig(**_gemma_fields(hf))


@register_config_builder
class Gemma2ConfigBuilder(ConfigBuilder):
    @classmethod
    def condition(cls, hf: dict) -> bool:
        return hf.get("model_type") == "gemma2"

    @classmethod
    def build(cls, hf: dict) -> Gemma2Config:
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        window = hf.get("sliding_window")
        return Gemma2Config(**_gemma_fields(hf), query_pre_attn_scalar=hf["query_pre_attn_scalar"],
                            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                            final_logit_softcapping=hf.get("final_logit_softcapping"),
                            sliding_window=int(window) if window else None,
                            sliding_layers=tuple(t == "sliding_attention" for t in types))


def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (transformers casts Gemma's embedding scale to the weights' dtype)."""
    return float(torch.tensor(value, dtype=dtype))


class GemmaDecoderLayer(LlamaDecoderLayer):
    norm_cls = GemmaRMSNorm


class GemmaModel(LlamaModel):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, config: ModelConfig, dtype=None):
        super().__init__(config, dtype)
        self.embed_tokens.scale = _in_dtype(config.hidden_size ** 0.5, dtype)


@register_model(architectures=["GemmaForCausalLM"], model_types=["gemma"])
@to_engine()
class GemmaForCausalLM(LlamaForCausalLM):
    model_types = ("gemma",)
    model_cls = GemmaModel


class Gemma2DecoderLayer(Module):
    def __init__(self, config: Gemma2Config, layer_idx: int, rotary: RotaryEmbedding, dtype=None):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.self_attn = Attention(h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                   layer_idx, rotary, qkv_bias=config.qkv_bias, o_bias=config.o_bias,
                                   sliding_window=config.layer_sliding_window(layer_idx),
                                   scale=config.query_pre_attn_scalar ** -0.5,
                                   soft_cap=config.attn_logit_softcapping, dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.mlp = GatedMLP(h, config.intermediate_size, act=F.ActType.GEGLU, dtype=dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, x, residual, ctx: ForwardContext):
        """``x + residual`` is the stream (``residual`` None: ``x`` alone), as in Llama's layer."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, ctx))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2Model(GemmaModel):
    layer_cls = Gemma2DecoderLayer


@register_model(architectures=["Gemma2ForCausalLM"], model_types=["gemma2"])
@to_engine()
class Gemma2ForCausalLM(LlamaForCausalLM):
    model_types = ("gemma2",)
    model_cls = Gemma2Model

    def forward(self, ctx: ForwardContext):
        logits = super().forward(ctx)
        cap = self.config.final_logit_softcapping
        return logits if not cap else F.tanh(logits.float() / cap) * cap
