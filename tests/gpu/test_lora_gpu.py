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


def test_mixed_batch_through_cuda_graphs_equals_solo(llm_with_adapters, monkeypatch):
    """Decode steps with adapters replay the LoRA engine's bucket graph from the loop (its static
    ``lora_indices`` written when the rows change or a slot moves: three adapters over two slots
    evict one another between steps), and every request gets its solo tokens."""
    from graphdsl.runtime.serving.cuda_graphs import CudaGraphRunner
    llm, _ = llm_with_adapters
    lora_engine = llm.model.engine(Phase.DECODE, lora=True)
    replays = []
    real = CudaGraphRunner.replay
    monkeypatch.setattr(CudaGraphRunner, "replay",
                        lambda self, bucket, width=None: replays.append(self.engine is lora_engine)
                        or real(self, bucket, width))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4], [11, 12, 13, 14, 15, 16]]
    loras = ["a", "b", "c", None]
    params = gd.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    together = llm.generate(prompts, params, lora_request=loras)
    assert sum(replays) >= 20                                            # LoRA decode steps were graph replays
    for p, n, out in zip(prompts, loras, together):
        assert out.outputs[0].token_ids == llm.generate([p], params, lora_request=n)[0].outputs[0].token_ids


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


# -- the fused LoRA projections (matmul_lora & co.): shrink + GEMV epilogue, slot-dense shrink + addmm --
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("k,n,width,epilogue", [(4096, 6144, 48, "none"), (4096, 28672, 32, "silu_mul"),
                                                (14336, 4096, 16, "residual"), (4096, 4096, 16, "residual")])
def test_gemv_lora_epilogue_at_8b_shapes(m, k, n, width, epilogue):
    """The decode GEMV with the LoRA term in its float32 epilogue (default launch: split-K where the
    heuristic splits) against the fused op's reference, 8 slots, base rows mixed in."""
    from graphdsl.runtime.kernels.gemv import GemvLoRA, GemvWorkspace, gemv
    from graphdsl.runtime.kernels.lora import lora_shrink, lora_splits
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    slots = 8
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    a = (torch.randn(slots, width, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    b = (torch.randn(n, slots, width, device="cuda", generator=g) * 0.2).bfloat16()
    idx = torch.randint(-1, slots, (m,), device="cuda", generator=g, dtype=torch.int32)
    idx[0] = 3
    res = torch.randn(m, n, device="cuda", generator=g).bfloat16() if epilogue == "residual" else None
    p = torch.empty(m * lora_splits(k) * width, device="cuda")
    got = gemv(x, w, res, silu_mul=epilogue == "silu_mul", workspace=GemvWorkspace(),
               lora=GemvLoRA(lora_shrink(x, a, idx, p), b, idx)).float()
    f = lambda t: t.float()  # noqa: E731
    if epilogue == "silu_mul":
        want = get_op("matmul_silu_mul_lora").reference(f(x), f(w), f(a), f(b), idx)
    elif res is None:
        want = get_op("matmul_lora").reference(f(x), f(w), f(a), f(b), idx)
    else:
        want = get_op("matmul_add_lora").reference(f(x), f(w), f(res), f(a), f(b), idx)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("t", [17, 64, 300])
@pytest.mark.parametrize("k,width", [(4096, 48), (14336, 16)])
def test_dense_shrink_at_8b_shapes(t, k, width):
    from graphdsl.runtime.kernels.lora import lora_shrink_dense
    g = torch.Generator(device="cuda").manual_seed(t + k)
    slots = 8
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    a = (torch.randn(slots, width, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    idx = torch.randint(-1, slots, (t,), device="cuda", generator=g, dtype=torch.int32)
    got = lora_shrink_dense(x, a, idx, torch.full((t, slots * width), float("nan"), device="cuda").bfloat16())
    want = torch.zeros(t, slots * width, device="cuda")
    for s in range(slots):
        rows = idx == s
        want[rows, s * width:(s + 1) * width] = x[rows].float() @ a[s].float().T
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.fixture
def fp16_llm_with_adapters(tmp_path):
    from tests.helpers.soak import TINY_LLAMA
    sys_path_benchmarks()
    from llm import random_kv
    llm = gd.LLM.from_config(TINY_LLAMA, device="cuda", dtype="float16", seed=0, init_std=0.15, max_model_len=64,
                             max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=64 * 3 + 16, block_size=16)
    random_kv(llm)
    llm.enable_lora(max_loras=4, max_lora_rank=16)
    names = []
    for i, r in enumerate((16, 8, 4)):
        names.append(f"ad{i}")
        llm.load_lora(names[-1], write_random_adapter(llm, tmp_path / names[-1], rank=r, seed=i, std=0.2))
    return llm, names


def sys_path_benchmarks():
    import os
    import sys
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
    if here not in sys.path:
        sys.path.insert(0, here)


def _close_but_for_rounding(got, want):
    """fp16 engines of several layers: the fused projection rounds its LoRA term once (base product
    + term in float32), the reference twice, and cuBLAS picks other reductions at 64 rows, so a few
    logits drift by an ulp or two of their magnitude; a wrong slot or a dropped term moves whole rows.
    So: every logit within 0.15, at most 0.5% of them outside the strict 5e-2 / 2e-2."""
    torch.testing.assert_close(got, want, atol=0.15, rtol=2e-2)
    strict = (got - want).abs() > 5e-2 + 2e-2 * want.abs()
    assert strict.float().mean().item() <= 5e-3, f"{int(strict.sum())} of {strict.numel()} logits off"


@pytest.mark.parametrize("batch", [1, 4, 64])
def test_fused_lora_decode_step_matches_reference(fp16_llm_with_adapters, batch):
    """One decode step of the fused LoRA engine (fp16: the GEMV with the LoRA epilogue up to 16 rows,
    cuBLAS + slot-dense shrink + addmm at 64; through a CUDA graph) against the torch backend's
    references, rows over three adapters and the base model."""
    from llm import _decode_inputs
    llm, names = fp16_llm_with_adapters
    gen = torch.Generator(device="cuda").manual_seed(batch)
    inputs, ids = _decode_inputs(llm, batch, 40, gen)
    want_slots = [names[i % 3] if i % 4 != 3 else None for i in range(batch)]
    slots = llm.model.lora.slots_for(want_slots)
    inputs["lora_indices"] = torch.tensor(slots, dtype=torch.int32, device="cuda")
    lora_engine = llm.model.engine(Phase.DECODE, lora=True)
    assert "matmul_silu_mul_lora" in {n.op for n in lora_engine.net.nodes}
    got = llm.model.execute(Phase.DECODE, dict(inputs)).float().clone()
    got2 = llm.model.execute(Phase.DECODE, dict(inputs)).float().clone()       # a graph replay
    base = llm.model.execute(Phase.DECODE, {k: v for k, v in inputs.items() if k != "lora_indices"}).float()
    llm.model.configure_runtime(backend="torch", cuda_graphs=False)
    want = llm.model.execute(Phase.DECODE, dict(inputs)).float()
    for sid in ids:
        llm.blocks.free(sid)
    _close_but_for_rounding(got, want)
    assert torch.equal(got, got2)
    rows = inputs["lora_indices"] >= 0
    assert (got[rows] - base[rows]).abs().max() > 0.5
    torch.testing.assert_close(got[~rows], base[~rows], atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens", [9, 64])
def test_fused_lora_prefill_matches_reference(fp16_llm_with_adapters, tokens):
    llm, names = fp16_llm_with_adapters
    ids = [(5 * i + 1) % 250 for i in range(tokens)]
    got = llm.score(ids, lora_request=names[0])
    llm.model.configure_runtime(backend="torch", cuda_graphs=False)
    _close_but_for_rounding(got, llm.score(ids, lora_request=names[0]))
