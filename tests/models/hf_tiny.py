"""Tiny random HF checkpoints for the model tests (built with transformers, saved as safetensors)."""
from __future__ import annotations

import torch

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def make_config(family: str, **overrides):
    """A transformers config of ``family`` with the tiny geometry."""
    import transformers as tf
    kw = dict(TINY)
    if family == "llama":
        cls = tf.LlamaConfig
    elif family == "mistral":
        cls = tf.MistralConfig
        kw.update(sliding_window=8)
    elif family == "qwen2":
        cls = tf.Qwen2Config
    elif family == "qwen3":
        cls = tf.Qwen3Config
        kw.update(head_dim=32)
    elif family == "qwen3_moe":
        cls = tf.Qwen3MoeConfig
        kw.update(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                  mlp_only_layers=[1])
    elif family == "mixtral":
        cls = tf.MixtralConfig
        kw.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)
    elif family == "gemma":
        cls = tf.GemmaConfig
        kw.update(head_dim=32)
    elif family == "gemma2":
        cls = tf.Gemma2Config
        kw.update(head_dim=32, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                  final_logit_softcapping=6.0)
    elif family == "bloom":
        cls = tf.BloomConfig
        kw = dict(vocab_size=TINY["vocab_size"], hidden_size=TINY["hidden_size"], n_layer=2, n_head=4)
    elif family in ("deepseek_v2", "deepseek_v3"):
        cls = tf.DeepseekV2Config if family == "deepseek_v2" else tf.DeepseekV3Config
        kw.update(num_hidden_layers=3, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16, num_experts_per_tok=3,
                  moe_intermediate_size=32, n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  num_key_value_heads=4,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.707,
                                   "beta_fast": 32.0, "beta_slow": 1.0})
        if family == "deepseek_v2":
            kw.update(topk_method="group_limited_greedy")
        else:
            kw.update(norm_topk_prob=True)
    elif family == "granite":
        cls = tf.GraniteConfig
        kw.update(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5)
    elif family == "qwen2_moe":
        cls = tf.Qwen2MoeConfig
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, norm_topk_prob=False)
    else:
        raise ValueError(family)
    kw.update(overrides)
    return cls(**kw)


def make_checkpoint(family: str, directory, *, seed: int = 0, max_shard_size=None, **overrides):
    """Build a random ``family`` model, save it to ``directory``; return the HF model (eval, float32)."""
    import transformers as tf
    torch.manual_seed(seed)
    config = make_config(family, **overrides)
    # the reference must apply every feature: transformers 5.17's SDPA path drops Gemma 2's attention
    # soft-capping (its eager path matches ours to 2e-6 on the H200), so references run eager
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():   # HF init is tiny (std 0.02); widen it so logits are far from ties
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):     # DeepSeek-V3's router bias (zeros at init)
                b.normal_(0.0, 0.1)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kw)
    model.generation_config.eos_token_id = None     # compare full-length greedy continuations
    model.generation_config.pad_token_id = 0
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()
