"""GGUFCheckpoint.iter_tensors(keep_quantized=True): linear weights stay GGUF block rows (GGUFBlockWeight)
that decode to exactly the dense path's tensors (q/k un-permute and expert split done on rows), one type
per tensor (a Q4_K_M-style Q4_K/Q6_K mix). (The kernels on such rows: tests/kernels/test_gguf_linear.py.)"""
import numpy as np
import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.runtime.gguf_blocks import GGUFBlockWeight, row_bytes
from graphdsl.runtime.loaders.gguf import GGUFCheckpoint
from tests.helpers.gguf_blocks import random_gguf_weight
from tests.helpers.gguf_files import hf_model_to_gguf, write_gguf

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402


def _tok_meta(vocab: int) -> dict:
    tokens = [f"t{i}" for i in range(vocab)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * vocab, "tokenizer.ggml.merges": ["t 1"],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def _compare(path, kept_types):
    ck = GGUFCheckpoint(path)
    dense = dict(ck.iter_tensors(torch.float32))
    kept = dict(ck.iter_tensors(torch.bfloat16, keep_quantized=True))
    assert set(kept) == set(dense)
    types = {}
    for name, v in kept.items():
        if isinstance(v, GGUFBlockWeight):
            types[name] = v.qtype
            assert v.shape == tuple(dense[name].shape) and v.data.dtype == torch.uint8
            assert torch.equal(v.dequantize(), dense[name]), name
        else:
            assert v.dtype == torch.bfloat16 and torch.equal(v, dense[name].to(torch.bfloat16)), name
    assert types == kept_types
    return kept


def test_tiny_llama_keeps_its_quantized_linears(tmp_path):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path / "q.gguf"
    hf_model_to_gguf(path, model, "llama", tokenizer_meta=_tok_meta(64),
                     quant={r"q_proj|k_proj": Q.Q8_0, r"mlp": Q.Q4_0, r"o_proj": Q.Q4_1, r"v_proj": Q.F16,
                            r"embed": Q.Q8_0, r"lm_head": Q.Q8_0})
    p = "model.layers.0."
    kept = _compare(path, {p + "self_attn.q_proj.weight": "Q8_0", p + "self_attn.k_proj.weight": "Q8_0",
                           p + "self_attn.o_proj.weight": "Q4_1", p + "mlp.gate_proj.weight": "Q4_0",
                           p + "mlp.up_proj.weight": "Q4_0", p + "mlp.down_proj.weight": "Q4_0",
                           "lm_head.weight": "Q8_0"})
    # the un-permuted q rows are close to the HF original (so the row reorder happened on the blocks)
    q = kept[p + "self_attn.q_proj.weight"].dequantize()
    assert (q - model.state_dict()[p + "self_attn.q_proj.weight"]).abs().max() < 0.02


def test_q4_k_m_style_mix_and_stacked_experts(tmp_path):
    """Per-tensor Q4_K / Q5_K / Q6_K in one file (written as raw blocks: gguf-py cannot quantize the K
    formats), and a stacked [E, N, K] expert tensor split into per-expert block rows."""
    h, ff, experts = 256, 512, 2
    meta = {"qwen2moe.context_length": 64, "qwen2moe.embedding_length": h, "qwen2moe.block_count": 1,
            "qwen2moe.feed_forward_length": ff, "qwen2moe.attention.head_count": 2,
            "qwen2moe.attention.head_count_kv": 2, "qwen2moe.attention.layer_norm_rms_epsilon": 1e-6,
            "qwen2moe.rope.freq_base": 10000.0, "qwen2moe.expert_count": experts,
            "qwen2moe.expert_used_count": 1, "qwen2moe.expert_feed_forward_length": ff, **_tok_meta(16)}

    def blocks(qtype, n, k, seed):
        return (random_gguf_weight(qtype, n, k, seed=seed)[0].numpy(), Q[qtype])

    down = np.stack([random_gguf_weight("Q6_K", h, ff, seed=10 + e)[0].numpy() for e in range(experts)])
    tensors = {
        "token_embd.weight": blocks("Q4_K", 16, h, 1),
        "blk.0.attn_norm.weight": (np.ones(h, np.float32), None),
        "blk.0.ffn_norm.weight": (np.ones(h, np.float32), None),
        "blk.0.attn_q.weight": blocks("Q4_K", h, h, 2),
        "blk.0.attn_k.weight": blocks("Q4_K", h, h, 3),
        "blk.0.attn_v.weight": blocks("Q6_K", h, h, 4),
        "blk.0.attn_output.weight": blocks("Q5_K", h, h, 5),
        "blk.0.ffn_gate_inp.weight": (np.zeros((experts, h), np.float32), None),
        "blk.0.ffn_gate_exps.weight": (np.stack([random_gguf_weight("Q4_K", ff, h, seed=20 + e)[0].numpy()
                                                 for e in range(experts)]), Q.Q4_K),
        "blk.0.ffn_down_exps.weight": (down, Q.Q6_K),
        "output_norm.weight": (np.ones(h, np.float32), None),
        "output.weight": blocks("Q6_K", 16, h, 6),
    }
    path = tmp_path / "mix.gguf"
    write_gguf(path, "qwen2moe", meta, tensors)
    p = "model.layers.0."
    want = {p + "self_attn.q_proj.weight": "Q4_K", p + "self_attn.k_proj.weight": "Q4_K",
            p + "self_attn.v_proj.weight": "Q6_K", p + "self_attn.o_proj.weight": "Q5_K", "lm_head.weight": "Q6_K"}
    for e in range(experts):
        want[f"{p}mlp.experts.{e}.gate_proj.weight"] = "Q4_K"
        want[f"{p}mlp.experts.{e}.down_proj.weight"] = "Q6_K"
    kept = _compare(path, want)
    assert kept[f"{p}mlp.experts.1.down_proj.weight"].shape == (h, ff)
    assert torch.equal(kept[f"{p}mlp.experts.1.down_proj.weight"].data, torch.from_numpy(down[1]))


def test_block_weight_validates():
    w = GGUFBlockWeight("Q4_K", (2, 256), torch.zeros(2, 144, dtype=torch.uint8))
    assert w.nbytes == 288 and w.to("cpu").qtype == "Q4_K" and row_bytes("Q4_K", 256) == 144
    with pytest.raises(GraphDSLError, match=r"Q6_K \[2, 256\] needs data uint8 \[2, 210\], got torch.uint8 \[2, 144\]"):
        GGUFBlockWeight("Q6_K", (2, 256), torch.zeros(2, 144, dtype=torch.uint8))
