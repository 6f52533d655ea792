"""Optimize rules on a real GPU (``pytest -m gpu tests/gpu/test_injection_gpu.py``): a Qwen2-MoE model of
real layer sizes (Qwen1.5-MoE-A2.7B, 3 layers, random weights) with its routed experts on the CPU
(``moe-experts-cpu``) gives the all-GPU model's greedy tokens and logits, keeps the expert weights
off the GPU, and decodes without CUDA graphs (the host op cannot be captured). A ``transfer_map``
split (cuda:0/cpu; cuda:0/cuda:1 on two GPUs) gives the unsplit tokens, with KV blocks on each
layer's device and one CUDA graph per CUDA part."""
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
    assert all(t.device.type == "cpu" for m in experts for stack in m.host_weights for t in stack.tensors)
    elem = 4 if dtype == "float32" else 2
    expert_bytes = 3 * 3 * 60 * 2048 * 1408 * elem
    assert torch.cuda.memory_allocated() - before < gpu_bytes - 0.9 * expert_bytes
    got = cpu.score(PROMPT[0])
    tol = 2e-3 if dtype == "float32" else 5e-2           # bf16: host GEMMs round unlike the grouped GEMM
    assert (got - want_logits).abs().max() <= tol * want_logits.abs().max()
    if dtype == "float32":
        assert _greedy(cpu) == want_tokens
    engine = cpu.model.engine(Phase.DECODE)
    assert "cpu_moe_experts" in {n.op for n in engine.net.nodes}
    assert not cpu.model.graph_capturable()


def _split(transfer_map):
    return [{"match": {"name": "^model$"}, "replace": {"kwargs": {"transfer_map": transfer_map}}}]


@pytest.mark.parametrize("devices", [("cuda:0", "cpu"), ("cuda:0", "cuda:1")], ids=["cuda0-cpu", "cuda0-cuda1"])
def test_transfer_map_split_equals_unsplit(devices):
    if devices[1] == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (nvidia-h200-x2)")
    base = gd.LLM.from_config(QWEN2_MOE, device="cuda:0", dtype="float32", seed=0, max_model_len=128,
                              max_num_seqs=2)
    want_tokens, want_logits = _greedy(base), base.score(PROMPT[0])
    del base
    split = gd.LLM.from_config(QWEN2_MOE, device="cuda:0", dtype="float32", seed=0, max_model_len=128,
                               max_num_seqs=2, optimize_rules=_split({0: devices[0], 2: devices[1]}))
    assert split.model.layer_devices("cuda:0") == [devices[0], devices[0], devices[1]]
    assert str(split.kv_cache.key_caches[2].device) == devices[1]
    engine = split.model.engine(Phase.DECODE)
    # the final norm and lm_head run back on the model's device, where their weights are
    assert [p.device for p in engine.partition.parts] == [devices[0], devices[1], devices[0]]
    assert [e.backend.name for e in engine.engines] == ["triton", "triton" if devices[1] != "cpu" else "torch",
                                                        "triton"]
    torch.testing.assert_close(split.score(PROMPT[0]), want_logits, rtol=2e-3, atol=2e-3)
    assert _greedy(split) == want_tokens
    # decode replays one CUDA graph per CUDA part (host parts run eagerly)
    from graphdsl.models.partitioned_graphs import PartitionedGraphRunner
    (runner,) = split.model._graph_runners.values()
    assert isinstance(runner, PartitionedGraphRunner)
    for part, r in zip(engine.partition.parts, runner.runners):
        assert (r is not None and len(r.graphs) > 0) == part.device.startswith("cuda")


def test_shipped_two_gpu_rules_split_the_stack():
    from graphdsl.models.injection import builtin_rules
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (nvidia-h200-x2)")
    hf = dict(QWEN2_MOE, num_hidden_layers=13)          # the rule file splits at layer 12
    llm = gd.LLM.from_config(hf, device="cuda:0", dtype="bfloat16", seed=0, max_model_len=128, max_num_seqs=2,
                             optimize_rules=builtin_rules("moe-two-gpu"))
    assert llm.model.layer_devices("cuda:0") == ["cuda:0"] * 12 + ["cuda:1"]
    assert len(_greedy(llm, 4)) == 4
