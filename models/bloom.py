"""BLOOM (BloomForCausalLM): pure architecture.

embed → LayerNorm → N × [LayerNorm → attention (MHA, ALiBi, no RoPE) → add → LayerNorm →
GELU(tanh) MLP → add] → LayerNorm → tied lm_head. Every linear and norm has a bias.

The layers are the shared ones under their usual names; the checkpoint's names (``transformer.``
prefix or none, ``h.{i}``, ``self_attention.query_key_value``, ``mlp.dense_h_to_4h``, ``ln_f``, ...)
are mapped by ``checkpoint_renames``, and the fused ``query_key_value`` tensor, laid out per head
as ``[head, (q | k | v), head_dim]``, is reordered into the ``[q | k | v]`` projection by its
checkpoint slot (:class:`~graphdsl.layers.QKVLayout` ``PER_HEAD``).
"""
from __future__ import annotations

from graphdsl import Module, ModuleList
from graphdsl import functional as F
from graphdsl.layers import (MLP, Attention, ColumnParallelLinear, ForwardContext, LayerNorm, QKVLayout,
                             VocabParallelEmbedding, alibi_slopes)

from .base import FlashCausalLM, to_engine
from .config import ConfigBuilder, ModelConfig, eos_ids, register_config_builder
from .registry import register_model

__all__ = ["BloomForCausalLM", "BloomConfig", "BloomConfigBuilder"]


class BloomConfig(ModelConfig):
    layer_norm_epsilon: float = 1e-5
    apply_residual_connection_post_layernorm: bool = False


@register_config_builder
class BloomConfigBuilder(ConfigBuilder):
    @classmethod
    def condition(cls, hf: dict) -> bool:
        return hf.get("model_type") == "bloom"

    @classmethod
    def build(cls, hf: dict) -> BloomConfig:
        hidden = hf.get("hidden_size", hf.get("n_embed"))
        heads = hf.get("n_head", hf.get("num_attention_heads"))
        layers = hf.get("n_layer", hf.get("num_hidden_layers"))
        for key, value in (("hidden_size", hidden), ("n_head", heads), ("n_layer", layers)):
            if value is None:
                raise KeyError(key)
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        return BloomConfig(
            model_type="bloom", architectures=tuple(hf.get("architectures") or ()), vocab_size=hf["vocab_size"],
            hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, head_dim=hidden // heads, hidden_act="gelu_pytorch_tanh",
            layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            # ALiBi has no trained length limit; 2048 is what BLOOM was trained on
            max_position_embeddings=hf.get("seq_length") or 2048,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids(hf), torch_dtype=dtype if dtype in ("float32", "float16", "bfloat16") else "float32",
            apply_residual_connection_post_layernorm=bool(hf.get("apply_residual_connection_post_layernorm", False)))


class BloomBlock(Module):
    def __init__(self, config: BloomConfig, layer_idx: int, dtype=None):
        super().__init__()
        h, eps, heads = config.hidden_size, config.layer_norm_epsilon, config.num_attention_heads
        self.input_layernorm = LayerNorm(h, eps, dtype=dtype)
        self.self_attn = Attention(h, heads, heads, config.head_dim, layer_idx, None, qkv_bias=True, o_bias=True,
                                   alibi_slopes=alibi_slopes(heads), qkv_layout=QKVLayout.PER_HEAD, dtype=dtype)
        self.post_attention_layernorm = LayerNorm(h, eps, dtype=dtype)
        self.mlp = MLP(h, config.intermediate_size, bias=True, act=F.ActType.GELU_TANH, dtype=dtype)
        self.residual_is_normed = config.apply_residual_connection_post_layernorm

    def forward(self, x, ctx: ForwardContext):
        h = self.input_layernorm(x)
        x = (h if self.residual_is_normed else x) + self.self_attn(h, ctx)
        h = self.post_attention_layernorm(x)
        return (h if self.residual_is_normed else x) + self.mlp(h)


class BloomModel(Module):
    def __init__(self, config: BloomConfig, dtype=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.embed_layernorm = LayerNorm(config.hidden_size, config.layer_norm_epsilon, dtype=dtype)
        self.layers = ModuleList(BloomBlock(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_epsilon, dtype=dtype)

    def forward(self, ctx: ForwardContext):
        x = self.embed_layernorm(self.embed_tokens(ctx.input_ids))
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


@register_model(architectures=["BloomForCausalLM"], model_types=["bloom"])
@to_engine()
class BloomForCausalLM(FlashCausalLM):
    model_types = ("bloom",)
    # published checkpoints hold the bare BloomModel (no "transformer." prefix); save_pretrained adds it
    checkpoint_renames = ((r"^(transformer\.)?word_embeddings_layernorm\.", "model.embed_layernorm."),
                          (r"^(transformer\.)?word_embeddings\.", "model.embed_tokens."),
                          (r"^(transformer\.)?h\.(\d+)\.", r"model.layers.\2."),
                          (r"^(transformer\.)?ln_f\.", "model.norm."),
                          (r"\.self_attention\.query_key_value\.", ".self_attn.qkv_proj."),
                          (r"\.self_attention\.dense\.", ".self_attn.o_proj."),
                          (r"\.mlp\.dense_h_to_4h\.", ".mlp.up_proj."),
                          (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."))

    def __init__(self, config: BloomConfig, dtype=None):
        super().__init__(config, dtype)
        self.model = BloomModel(config, self.dtype)
        self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, False, self.dtype)
