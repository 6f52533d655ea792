"""Published ``config.json`` files of the newer families parse into the right config and model.

Each dict is the checkpoint's own ``config.json`` (transformers 4 layout, as published). The model
built from it must have the published parameter count (weights only allocate when bound, so this
is cheap), and the family's knobs must land in the typed config.
"""
import math

import pytest

from graphdsl.models import build_config, resolve_model_class

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000,
}
GEMMA_7B = {
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
    "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 24576, "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 16, "pad_token_id": 0, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "transformers_version": "4.38.0.dev0",
    "use_cache": True, "vocab_size": 256000,
}
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
    "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "sliding_window_size": 4096,
    "torch_dtype": "float32", "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 256000,
}

BLOOM_560M = {
    "apply_residual_connection_post_layernorm": False, "architectures": ["BloomForCausalLM"],
    "attention_dropout": 0.0, "attention_softmax_in_fp32": True, "bias_dropout_fusion": True, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_dropout": 0.0, "hidden_size": 1024, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "masked_softmax_fusion": True, "model_type": "bloom", "n_head": 16,
    "n_inner": None, "n_layer": 24, "offset_alibi": 100, "pad_token_id": 3, "pretraining_tp": 1,
    "skip_bias_add": True, "skip_bias_add_qkv": False, "slow_but_exact": False, "transformers_version": "4.21.0",
    "unk_token_id": 0, "use_cache": True, "vocab_size": 250880,
}
BLOOM_176B = {   # the big one spells the width n_embed
    "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0, "attention_softmax_in_fp32": True,
    "bias_dropout_fusion": True, "bos_token_id": 1, "eos_token_id": 2, "hidden_dropout": 0.0,
    "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "masked_softmax_fusion": True, "model_type": "bloom",
    "n_embed": 14336, "n_layer": 70, "num_attention_heads": 112, "pretraining_tp": 4, "slow_but_exact": False,
    "transformers_version": "4.21.0", "use_cache": True, "vocab_size": 250880,
}

_DEEPSEEK_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                  "original_max_position_embeddings": 4096, "type": "yarn"}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": _DEEPSEEK_YARN, "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}
DEEPSEEK_V2 = dict(DEEPSEEK_V2_LITE, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, n_group=8,
                   n_routed_experts=160, num_attention_heads=128, num_hidden_layers=60, num_key_value_heads=128,
                   q_lora_rank=1536, routed_scaling_factor=16.0, topk_group=3, topk_method="group_limited_greedy")


def _count(model) -> int:
    tied = model.tied_parameters()
    return sum(math.prod(p.shape) for name, p in model.named_parameters() if name not in tied)


@pytest.mark.parametrize("hf,cls_name,params", [
    (MIXTRAL_8X7B, "MixtralForCausalLM", 46_702_792_704),
    (GEMMA_7B, "GemmaForCausalLM", 8_537_680_896),
    (GEMMA2_9B, "Gemma2ForCausalLM", 9_241_705_984),
    (BLOOM_560M, "BloomForCausalLM", 559_214_592),
    (BLOOM_176B, "BloomForCausalLM", 176_247_271_424),
])
def test_published_config_builds_the_published_model(hf, cls_name, params):
    config = build_config(dict(hf))
    cls = resolve_model_class(config.model_type, config.architectures)
    assert cls.__name__ == cls_name
    assert _count(cls(config)) == params


def test_mixtral_fields():
    c = build_config(dict(MIXTRAL_8X7B))
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (8, 2, 14336, True)
    assert c.sliding_window is None and c.is_moe_layer(0) and c.is_moe_layer(31)


def test_gemma_fields():
    c = build_config(dict(GEMMA_7B))
    assert c.hidden_act == "gelu_pytorch_tanh"          # the legacy "gelu" means the tanh approximation
    assert c.tie_word_embeddings and c.head_dim == 256  # tied by default: the config does not say
    model = resolve_model_class("gemma")(c)
    assert model.model.embed_tokens.scale == 55.5       # sqrt(3072) = 55.43 rounded to bfloat16


def test_gemma2_fields():
    c = build_config(dict(GEMMA2_9B))
    assert c.query_pre_attn_scalar == 256 and c.attn_logit_softcapping == 50.0 and c.final_logit_softcapping == 30.0
    assert [c.layer_sliding_window(i) for i in range(4)] == [4096, None, 4096, None]   # layer 0 slides
    attn = resolve_model_class("gemma2")(c).model.layers[0].self_attn
    assert (attn.scale, attn.soft_cap, attn.sliding_window) == (256 ** -0.5, 50.0, 4096)
    explicit = build_config(dict(GEMMA2_9B, layer_types=["full_attention", "sliding_attention"] * 21))
    assert [explicit.layer_sliding_window(i) for i in range(2)] == [None, 4096]


def test_bloom_fields():
    c = build_config(dict(BLOOM_176B))
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.intermediate_size) == (14336, 112, 128, 57344)
    assert c.tie_word_embeddings and c.eos_token_ids == (2,)
    attn = resolve_model_class("bloom")(c).model.layers[0].self_attn
    slopes = attn.alibi_slopes            # 112 heads: 64 from the 2^(-8i/64) sequence, 48 odd ones of 2^(-4i/64)
    assert len(slopes) == 112 and slopes[0] == 2 ** -0.125 and slopes[64] == 2 ** -0.0625
    assert slopes[65] == 2 ** (-3 * 0.0625)


@pytest.mark.parametrize("hf", [DEEPSEEK_V2_LITE, DEEPSEEK_V2], ids=["v2-lite", "v2"])
def test_deepseek_v2_builds_the_transformers_model(hf):
    """Same parameter count as transformers' own model of the config (built on the meta device);
    the cache holds the 576-number latent a token and layer."""
    import torch
    import transformers
    config = build_config(dict(hf))
    with torch.device("meta"):
        ref = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**hf))
    assert _count(resolve_model_class("deepseek_v2")(config)) == sum(p.numel() for p in ref.parameters())
    assert 2 * config.num_key_value_heads * config.head_dim == 576 and config.rotary_dim == 64
    mscale = 0.1 * 0.707 * math.log(40) + 1
    assert config.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    assert config.rope_scaling.factor == 40 and config.rope_scaling.mscale_all_dim == 0.707


def test_deepseek_v2_routing_fields():
    c = build_config(dict(DEEPSEEK_V2))
    assert (c.topk_method.value, c.n_group, c.topk_group) == ("group_limited_greedy", 8, 3)
    assert c.routed_scaling_factor == 16.0
    assert c.moe_layers[:2] == (False, True) and c.shared_expert_intermediate_size == 2 * 1536 and c.q_lora_rank == 1536
    lite = build_config(dict(DEEPSEEK_V2_LITE))
    assert lite.topk_method.value == "greedy" and lite.q_lora_rank is None and lite.num_experts == 64
