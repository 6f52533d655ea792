"""LoRA on a real GPU (``pytest -m gpu``): the kernels at Llama-3-8B projection shapes against the
op's reference, and a tiny model serving adapters through CUDA graphs, the Triton backend against
the torch backend, a mixed batch against solo runs, hot swap under a captured graph."""
from __future__ import annotations

import pytest
import torch

import graphdsl as gd
from graphdsl.layers import Phase
from graphdsl.opdef import get_op
from tests.helpers.lora_files import write_random_adapter
from tests.helpers.soak import tiny_llm

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("dense", [False, True], ids=["bgmv", "dense"])
@pytest.mark.parametrize("t", [1, 7, 64, 300])
@pytest.mark.parametrize("k,n,width", [(4096, 6144, 48), (4096, 28672, 32), (14336, 4096, 16)])
def test_lora_kernels_at_8b_shapes(dense, t, k, n, width):
    from graphdsl.runtime.kernels.lora import lora_apply
    g = torch.Generator(device="cuda").manual_seed(t + k)
    slots = 8
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    y = torch.randn(t, n, device="cuda", generator=g).bfloat16()
    a = (torch.randn(slots, width, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    b = (torch.randn(n, slots, width, device="cuda", generator=g) * 0.1).bfloat16()
    idx = torch.randint(-1, slots, (t,), device="cuda", generator=g, dtype=torch.int32)
    want = get_op("lora_apply").reference(y, x, a, b, idx).float()
    got = lora_apply(y, x, a, b, idx, dense=dense).float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


@pytest.fixture
def llm_with_adapters(tmp_path):
    llm = tiny_llm("cuda", num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
    llm.enable_lora(max_loras=2, max_lora_rank=8)
    paths = {n: write_random_adapter(llm, tmp_path / n, rank=r, seed=i, std=0.2)
             for i, (n, r) in enumerate((("a", 8), ("b", 4), ("c", 2)))}
    for n, p in paths.items():
        llm.load_lora(n, p)
    return llm, paths


def test_triton_backend_matches_torch_backend(llm_with_adapters):
    llm, _ = llm_with_adapters
    ids = list(range(3, 40))        # 37 tokens: the slot-dense prefill path
    got = {n: llm.score(ids, lora_request=n) for n in ("a", "b", None)}
    llm.model.configure_runtime(backend="torch", cuda_graphs=False)
    for n, g in got.items():
        torch.testing.assert_close(g, llm.score(ids, lora_request=n), atol=2e-3, rtol=2e-3)
    assert not torch.allclose(got["a"], got[None], atol=1e-2)


def test_mixed_batch_through_cuda_graphs_equals_solo(llm_with_adapters):
    llm, _ = llm_with_adapters
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4], [11, 12, 13, 14, 15, 16]]
    loras = ["a", "b", "c", None]
    params = gd.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    together = llm.generate(prompts, params, lora_request=loras)
    for p, n, out in zip(prompts, loras, together):
        assert out.outputs[0].token_ids == llm.generate([p], params, lora_request=n)[0].outputs[0].token_ids
    lora_engine = llm.model.engine(Phase.DECODE, lora=True)
    assert llm.model._graph_runners.get(id(lora_engine)) is not None       # decode replayed a CUDA graph


def test_hot_swap_under_a_captured_graph(llm_with_adapters):
    llm, paths = llm_with_adapters
    params = gd.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = [[5, 6, 7, 8]]
    want_b = llm.generate(prompt, params, lora_request="b")[0].outputs[0].token_ids
    llm.load_lora("swap", paths["a"])
    first = llm.generate(prompt, params, lora_request="swap")[0].outputs[0].token_ids
    llm.load_lora("swap", paths["b"])                # same name, new weights, same engine and graphs
    assert llm.generate(prompt, params, lora_request="swap")[0].outputs[0].token_ids == want_b
    assert first == llm.generate(prompt, params, lora_request="a")[0].outputs[0].token_ids
