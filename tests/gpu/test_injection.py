"""Optimize rules on a real GPU (``pytest -m gpu tests/gpu/test_injection.py``): a Qwen2-MoE model of
real layer sizes (Qwen1.5-MoE-A2.7B, 3 layers, random weights) with its routed experts on the CPU
(``moe-experts-cpu``) gives the all-GPU model's greedy tokens and logits, keeps the expert weights
off the GPU, and decodes without CUDA graphs (the host op cannot be captured) while the all-GPU
model keeps them."""
from __future__ import annotations

import pytest
import torch

import graphdsl as gd
from graphdsl.layers import Phase

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

QWEN2_MOE = dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=2048,
                 intermediate_size=5632, num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16,
                 vocab_size=151936, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                 shared_expert_intermediate_size=5632, norm_topk_prob=False, tie_word_embeddings=False,
                 torch_dtype="bfloat16")
PROMPT = [[11, 22, 33, 44, 55, 66, 77, 88, 99]]


def _llm(rules=None, dtype="float32"):
    return gd.LLM.from_config(QWEN2_MOE, device="cuda", dtype=dtype, seed=0, max_model_len=128, max_num_seqs=2,
                              optimize_rules=rules)


def _greedy(llm, n=16):
    params = gd.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return llm.generate(PROMPT, params)[0].outputs[0].token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_experts_on_cpu_equal_all_gpu(dtype):
    from graphdsl.models.injection import builtin_rules
    start = torch.cuda.memory_allocated()
    gpu = _llm(dtype=dtype)
    gpu_bytes = torch.cuda.memory_allocated() - start
    want_tokens, want_logits = _greedy(gpu), gpu.score(PROMPT[0])
    del gpu
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    cpu = _llm(builtin_rules("moe-experts-cpu"), dtype=dtype)
    experts = [m for _, m in cpu.model.named_modules() if type(m).__name__ == "CPUExperts"]
    assert len(experts) == QWEN2_MOE["num_hidden_layers"]
    assert all(w.device.type == "cpu" for m in experts for w in m.host_weights)
    elem = 4 if dtype == "float32" else 2
    expert_bytes = 3 * 3 * 60 * 2048 * 1408 * elem
    assert torch.cuda.memory_allocated() - before < gpu_bytes - 0.9 * expert_bytes
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == "float32" else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(cpu.score(PROMPT[0]), want_logits, **tol)
    if dtype == "float32":
        assert _greedy(cpu) == want_tokens
    engine = cpu.model.engine(Phase.DECODE)
    assert "cpu_moe_experts" in {n.op for n in engine.net.nodes}
    assert not cpu.model.graph_capturable()
