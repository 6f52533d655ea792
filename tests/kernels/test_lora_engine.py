"""A tiny fp16 Llama with two LoRA adapters on the Triton backend (the CPU interpreter here, compiled on
CUDA) against the torch backend (the fused ops' references): a few rows run the BGMV shrink and the
decode GEMV with the LoRA epilogue, many rows the slot-dense shrink and one addmm (for gate/up: the
SwiGLU kernel that adds the term); a LoRA step runs
exactly one shrink launch more per adapted projection than the base step, and no expand kernel."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import graphdsl as gd
from graphdsl.layers import Phase
from tests.helpers.lora_files import write_random_adapter
from tests.helpers.soak import TINY_LLAMA

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    cfg = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 96}
    llm = gd.LLM.from_config(cfg, device=DEV, dtype="float16", seed=0, init_std=0.15, max_model_len=64,
                             max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=16, block_size=16)
    llm.enable_lora(max_loras=2, max_lora_rank=8)
    for i, (name, rank) in enumerate((("a", 8), ("b", 4))):
        llm.load_lora(name, write_random_adapter(llm, root / name, rank=rank, seed=i, std=0.3))
    return llm


def _count(monkeypatch):
    import graphdsl.runtime.kernels.gemv as gemv_mod
    import graphdsl.runtime.kernels.lora as lora_mod
    calls = {"gemv": 0, "gemv_lora": 0, "shrink": 0, "shrink_dense": 0, "expand": 0, "silu_mul_lora": 0}

    def spy(mod, name, key, *, lora_key=None):
        f = getattr(mod, name)

        def wrapped(*a, **k):
            calls[lora_key if lora_key and k.get("lora") is not None else key] += 1
            return f(*a, **k)
        monkeypatch.setattr(mod, name, wrapped)
    spy(gemv_mod, "gemv", "gemv", lora_key="gemv_lora")
    spy(lora_mod, "lora_shrink", "shrink")
    spy(lora_mod, "lora_shrink_dense", "shrink_dense")
    spy(lora_mod, "silu_mul_lora", "silu_mul_lora")
    expand = lora_mod._expand_kernel

    class _Expand:
        def __getitem__(self, grid):
            calls["expand"] += 1
            return expand[grid]
    monkeypatch.setattr(lora_mod, "_expand_kernel", _Expand())
    return calls


@pytest.mark.parametrize("tokens", [9, 37], ids=["bgmv_gemv", "dense"])
def test_triton_lora_engine_matches_torch_backend(llm, monkeypatch, tokens):
    ids = [(7 * i + 3) % 250 for i in range(tokens)]
    llm.model.configure_runtime(backend="torch", cuda_graphs=False)
    want, base = llm.score(ids, lora_request="a").float(), llm.score(ids).float()
    llm.model.configure_runtime(backend="triton", cuda_graphs=False)
    calls = _count(monkeypatch)
    got = llm.score(ids, lora_request="a").float()
    torch.testing.assert_close(got, want, atol=1e-1, rtol=5e-2)     # fp16, the term rounded once vs twice
    assert (want - base).abs().max() > 1.0
    layers = TINY_LLAMA["num_hidden_layers"]
    if tokens <= 16:          # 4 projections a layer, each one shrink + one GEMV with the LoRA epilogue
        assert calls["shrink"] == 4 * layers and calls["gemv_lora"] == 4 * layers
        assert calls["shrink_dense"] == 0
    else:                     # the gate/up term is added inside the SwiGLU launch
        assert calls["shrink_dense"] == 4 * layers and calls["shrink"] == 0
        assert calls["silu_mul_lora"] == layers
    assert calls["expand"] == 0


def test_mixed_decode_batch_equals_each_alone(llm):
    """Decode steps of 3 rows mixing two adapters and the base model run the GEMV's LoRA epilogue
    with per-row slots; each row's tokens equal its solo run."""
    llm.model.configure_runtime(backend="triton", cuda_graphs=False)
    prompts, loras = [[1, 2, 3, 4], [9, 8, 7], [5, 5, 6, 7, 8]], ["a", None, "b"]
    params = gd.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    together = llm.generate(prompts, params, lora_request=loras)
    for p, n, out in list(zip(prompts, loras, together))[::2]:       # the two adapter rows
        assert out.outputs[0].token_ids == llm.generate([p], params, lora_request=n)[0].outputs[0].token_ids
    assert {n.op for n in llm.model.engine(Phase.DECODE, lora=True).net.nodes} >= {"matmul_lora",
                                                                                   "matmul_silu_mul_lora"}


def _projection_net():
    """Every LoRA projection kind: a biased one (qwen2's qkv), SwiGLU, a residual epilogue, a bare one."""
    from graphdsl import Dim, Network, Tensor
    from graphdsl import functional as F
    n, h = Dim("num_tokens"), torch.float16
    slots, width = 3, 8

    def lora(x, y, name, k, out, idx):
        return F.lora_apply(y, x, Tensor(f"{name}.A", (slots, width, k), h), Tensor(f"{name}.B", (out, slots, width), h),
                            idx)
    with Network("lora_projections") as net:
        x, res, idx = Tensor("x", (n, 32), h), Tensor("res", (n, 32), h), Tensor("idx", (n,), torch.int32)
        q = lora(x, F.linear(x, Tensor("wq", (48, 32), h), Tensor("bq", (48,), h), transpose_b=True), "q", 32, 48, idx)
        gu = lora(q, F.linear(q, Tensor("wgu", (64, 48), h), transpose_b=True), "gu", 48, 64, idx)
        gate, up = F.split(gu, 2, -1)
        act = F.silu(gate) * up
        d = res + lora(act, F.linear(act, Tensor("wd", (32, 32), h), transpose_b=True), "d", 32, 32, idx)
        o = lora(d, F.linear(d, Tensor("wo", (40, 32), h), transpose_b=True), "o", 32, 40, idx)
        net.mark_output(F.rms_norm(o, Tensor("g", (40,), h)), "out")
    return net


@pytest.mark.parametrize("rows", [5, 20], ids=["gemv", "dense"])
def test_each_lora_projection_kind_on_the_triton_backend(rows, monkeypatch):
    net = _projection_net()
    g = torch.Generator().manual_seed(rows)
    feed = {}
    for name, t in net.inputs.items():
        shape = [rows if not isinstance(d, int) else d for d in t.shape]
        feed[name] = (torch.tensor([(i % 4) - 1 for i in range(rows)], dtype=torch.int32) if name == "idx"
                      else (torch.randn(*shape, generator=g) * 0.3).half()).to(DEV)
    ref = net.build_engine(backend="torch", passes=[]).forward({k: v.clone() for k, v in feed.items()})["out"]
    eng = net.build_engine(backend="triton")
    assert sorted(n.op for n in eng.net.nodes if "lora" in n.op) == ["matmul_add_lora", "matmul_add_lora",
                                                                     "matmul_lora", "matmul_silu_mul_lora"]
    calls = _count(monkeypatch)
    got = eng.forward({k: v.clone() for k, v in feed.items()})["out"]
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)
    assert (calls["gemv_lora"], calls["shrink"]) == ((4, 4) if rows <= 16 else (0, 0))     # the kernels ran,
    assert calls["shrink_dense"] == (0 if rows <= 16 else 4) and calls["expand"] == 0     # not the references
