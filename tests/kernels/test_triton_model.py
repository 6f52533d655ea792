"""A tiny model end to end on the Triton backend: generated kernels, the Triton paged-attention
(prefill and decode) and cache-write kernels wired in by the backend; on CPU under
``TRITON_INTERPRET=1`` (see conftest.py), compiled on CUDA."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import graphdsl as gd
from graphdsl.layers import Phase
from tests.models.hf_tiny import hf_greedy, hf_logits, make_checkpoint


# family: (prefill attention op, decode attention op, kernels that must have run). mistral: sliding
# window; gemma2: + soft caps; bloom: ALiBi, no RoPE (so no rope_cache fusion in decode);
# deepseek_v2: latent attention over the compressed cache, sparse routed experts, its decoupled RoPE in one launch
FAMILIES = {
    "llama": ("paged_attention", "rope_cache_attention", ("paged_attention_prefill", "paged_attention_decode")),
    "mistral": ("paged_attention", "rope_cache_attention", ("paged_attention_prefill", "paged_attention_decode")),
    "gemma2": ("paged_attention", "rope_cache_attention", ("paged_attention_prefill", "paged_attention_decode")),
    "bloom": ("paged_attention", "paged_attention", ("paged_attention_prefill", "paged_attention_decode")),
    "deepseek_v2": ("paged_mla_attention", "paged_mla_attention", ("paged_mla_attention", "moe_experts", "rope")),
}
# fewer experts under the interpreter (the routing records a few ops per expert)
OVERRIDES = {"deepseek_v2": dict(num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                                 topk_group=1)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_model_on_triton_backend_matches_hf(family, tmp_path, monkeypatch):
    import importlib
    prefill_op, decode_op, kernels = FAMILIES[family]
    calls = dict.fromkeys(kernels + ("reshape_and_cache",), 0)
    for module in ("paged_attention", "paged_mla_attention", "cache_write", "moe", "rope"):
        mod = importlib.import_module(f"graphdsl.runtime.kernels.{module}")   # the module, not the function
        for name in calls:
            if hasattr(mod, name):
                def spy(*a, _f=getattr(mod, name), _n=name, **k):
                    calls[_n] += 1
                    return _f(*a, **k)
                monkeypatch.setattr(mod, name, spy)
    hf_model = make_checkpoint(family, tmp_path, **OVERRIDES.get(family, {}))
    llm = gd.LLM(tmp_path, device="cuda" if torch.cuda.is_available() else "cpu", dtype="float32",
                 max_model_len=64)
    llm.model.configure_runtime(backend="triton", max_blocks_per_seq=4)
    prompts = [[1, 5, 9, 33, 2, 77, 100, 3, 8, 9, 10], [4, 5, 6]]
    ours, ref = llm.score(prompts[0]).cpu(), hf_logits(hf_model, prompts[0])
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    outs = llm.generate(prompts, gd.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, ids, 4) for ids in prompts]
    assert all(calls[k] > 0 for k in kernels), calls
    for phase, attention in ((Phase.PREFILL, prefill_op), (Phase.DECODE, decode_op)):
        eng = llm.model.engine(phase)
        assert eng.backend.name == "triton"
        assert attention in {n.op for n in eng.net.nodes}


@pytest.mark.parametrize("prefill", [False, True])
def test_cache_write_and_attention_nodes_lower_to_kernels(prefill):
    """reshape_and_cache then paged_attention as graph nodes: the Triton backend's kernels (cache
    written in place, attention into the planned slot) equal the torch backend's references."""
    from graphdsl import Dim, Network, Tensor
    from graphdsl import functional as F
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    blocks, bs, kvh, heads, dim = 6, 4, 2, 4, 16
    seq_lens = [5, 9, 1]
    n_new = [2, 3, 1] if prefill else [1, 1, 1]
    N, S, S1 = Dim("n"), Dim("s"), Dim("s1")
    with Network("attn") as net:
        q, k, v = (Tensor(x, (N, h, dim), "float32") for x, h in (("q", heads), ("k", kvh), ("v", kvh)))
        kc, vc = (Tensor(x, (blocks, bs, kvh, dim), "float32") for x in ("kc", "vc"))
        kc2, vc2 = F.reshape_and_cache(k, v, kc, vc, Tensor("slots", (N,), "int64"))
        qsl = Tensor("qsl", (S1,), "int32") if prefill else None
        out = F.paged_attention(q * 1.0, kc2, vc2, Tensor("bt", (S, 3), "int32"), Tensor("lens", (S,), "int32"),
                                qsl, scale=0.3, soft_cap=5.0)
        net.mark_output(out, "out")
    g = torch.Generator().manual_seed(0)
    n = sum(n_new)
    # every written slot belongs to one sequence (a shared slot would make the parallel cache
    # write's winner, and so the attention result, arbitrary on a GPU)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [2, 0, 0]], dtype=torch.int32)
    slots = [int(tables[s, p // bs]) * bs + p % bs for s in range(3) for p in range(seq_lens[s] - n_new[s], seq_lens[s])]
    feed = {"q": torch.randn(n, heads, dim, generator=g), "k": torch.randn(n, kvh, dim, generator=g),
            "v": torch.randn(n, kvh, dim, generator=g), "slots": torch.tensor(slots),
            "bt": tables, "lens": torch.tensor(seq_lens, dtype=torch.int32)}
    if prefill:
        feed["qsl"] = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    caches = (torch.randn(blocks, bs, kvh, dim, generator=g), torch.randn(blocks, bs, kvh, dim, generator=g))
    results = {}
    for backend in ("torch", "triton"):
        kc_, vc_ = (c.clone().to(dev) for c in caches)
        eng = net.build_engine(backend=backend, passes=[])
        out = eng.forward({**{k_: t.to(dev) for k_, t in feed.items()}, "kc": kc_, "vc": vc_})["out"]
        results[backend] = (out.cpu(), kc_.cpu(), vc_.cpu())
    for ref, got in zip(results["torch"], results["triton"]):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert not torch.equal(results["triton"][1], caches[0])        # the cache really was written


def test_rope_and_cat_nodes_lower_to_one_launch_each(monkeypatch):
    """MLA's decode pieces as graph nodes — a ``rope`` of strided slices (not fused with a cache
    write) and a ``cat`` — run the rope kernel and ``torch.cat`` straight into the planned slot,
    equal to the torch backend's references."""
    from graphdsl import Dim, Network, Tensor
    from graphdsl import functional as F
    import importlib
    rope_mod = importlib.import_module("graphdsl.runtime.kernels.rope")
    ropes, cats = [], []
    real_rope, real_cat = rope_mod.rope, torch.cat
    monkeypatch.setattr(rope_mod, "rope", lambda *a, **k: ropes.append(1) or real_rope(*a, **k))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = Dim("n")
    with Network("mla_pieces") as net:
        q = Tensor("q", (n, 4, 48), "float32")
        k = Tensor("k", (n, 1, 48), "float32")
        cos, sin = Tensor("cos", (n, 8), "float32"), Tensor("sin", (n, 8), "float32")
        _, q_pe = F.split(q, [32, 16], -1)
        _, k_pe = F.split(k, [32, 16], -1)
        q_pe, k_pe = F.rope(q_pe, k_pe, cos, sin)
        net.mark_output(F.cat([q_pe * 2.0, k_pe.reshape(-1, 1, 16) + 1.0], 1), "out")
    g = torch.Generator().manual_seed(0)
    feed = {"q": torch.randn(3, 4, 48, generator=g), "k": torch.randn(3, 1, 48, generator=g),
            "cos": torch.randn(3, 8, generator=g), "sin": torch.randn(3, 8, generator=g)}
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(torch, "cat", lambda *a, **kw: cats.append(backend if "out" in kw else None)
                            or real_cat(*a, **kw))
        eng = net.build_engine(backend=backend, passes=[])
        results[backend] = eng.forward({name: t.to(dev) for name, t in feed.items()})["out"].cpu()
    torch.testing.assert_close(results["triton"], results["torch"], rtol=1e-6, atol=1e-6)
    assert ropes == [1] and "triton" in cats
    with Network("rope_strided") as net:               # a q whose last dim is not contiguous: the reference
        q = F.permute(Tensor("q", (n, 16, 4), "float32"), [0, 2, 1])
        q2, k2 = F.rope(q, Tensor("k", (n, 1, 16), "float32"), Tensor("cos", (n, 8), "float32"),
                        Tensor("sin", (n, 8), "float32"))
        net.mark_output(q2 * 1.0, "q")
        net.mark_output(k2 * 1.0, "k")
    feed = {"q": torch.randn(3, 16, 4, generator=g), "k": torch.randn(3, 1, 16, generator=g),
            "cos": torch.randn(3, 8, generator=g), "sin": torch.randn(3, 8, generator=g)}
    got = [net.build_engine(backend=b, passes=[]).forward({name: t.to(dev) for name, t in feed.items()})
           for b in ("torch", "triton")]
    for name in ("q", "k"):
        torch.testing.assert_close(got[1][name].cpu(), got[0][name].cpu(), rtol=1e-6, atol=1e-6)
    assert ropes == [1]


@pytest.mark.parametrize("lens_in_graph", [False, True])
def test_decode_reads_step_inputs_before_the_pdl_wait_only_when_no_kernel_writes_them(lens_in_graph, monkeypatch):
    """``inputs_ready`` (seq_lens and the RoPE inputs read before the PDL wait) is passed only for
    graph inputs that no node of the step writes; a seq_lens computed in the graph is not."""
    from graphdsl import Dim, Network, Tensor
    from graphdsl import functional as F
    import importlib
    paged_attention = importlib.import_module("graphdsl.runtime.kernels.paged_attention")
    ready = []
    real = paged_attention.paged_attention_decode
    monkeypatch.setattr(paged_attention, "paged_attention_decode",
                        lambda *a, **k: ready.append((k["inputs_ready"], k["cache_ready"])) or real(*a, **k))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n, s = Dim("n"), Dim("s")
    with Network("decode") as net:
        q, k, v = (Tensor(x, (n, h, 16), "float32") for x, h in (("q", 4), ("k", 2), ("v", 2)))
        cos, sin = Tensor("cos", (n, 8), "float32"), Tensor("sin", (n, 8), "float32")
        kc, vc = (Tensor(x, (6, 4, 2, 16), "float32") for x in ("kc", "vc"))
        q2, k2 = F.rope(q, k, cos, sin)
        kc, vc = F.reshape_and_cache(k2, v, kc, vc, Tensor("slots", (n,), "int64"))
        lens = Tensor("lens", (s,), "int32")
        if lens_in_graph:
            lens = F.cast(F.cast(lens, "float32") * 1.0, "int32")
        net.mark_output(F.paged_attention(q2, kc, vc, Tensor("bt", (s, 3), "int32"), lens), "out")
    g = torch.Generator().manual_seed(1)
    pos = torch.tensor([4, 8])
    freqs = pos[:, None].float() * (0.5 ** torch.arange(8.0))[None, :]
    feed = {"q": torch.randn(2, 4, 16, generator=g), "k": torch.randn(2, 2, 16, generator=g),
            "v": torch.randn(2, 2, 16, generator=g), "cos": freqs.cos(), "sin": freqs.sin(),
            "kc": torch.randn(6, 4, 2, 16, generator=g), "vc": torch.randn(6, 4, 2, 16, generator=g),
            "slots": torch.tensor([4, 20]), "bt": torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
            "lens": torch.tensor([5, 9], dtype=torch.int32)}
    ref = net.build_engine(backend="torch", passes=[]).forward({k_: t.clone() for k_, t in feed.items()})["out"]
    eng = net.build_engine(backend="triton")
    assert "rope_cache_attention" in {nd.op for nd in eng.net.nodes}
    got = eng.forward({k_: t.clone().to(dev) for k_, t in feed.items()})["out"]
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-4)
    assert ready == [(not lens_in_graph, True)]          # the fused node is its caches' only writer
    be, (node,) = eng.backend, [nd for nd in eng.net.nodes if nd.op == "rope_cache_attention"]
    kc_in = node.inputs[3]
    assert be.written_only_by(kc_in, node) and not be.step_constant(kc_in)
    be._step()[1][kc_in] = [node, node]                     # another writer in the step: no early cache reads
    assert not be.written_only_by(kc_in, node)


def test_engine_cache_hit_runs_on_triton_backend(tmp_path):
    """A cached optimised network (generated-kernel programs, fused norms, rope+cache write,
    attention) loads and runs on the Triton backend exactly like the freshly optimised one."""
    from graphdsl import Dim, Network, Tensor
    from graphdsl import functional as F
    from graphdsl.runtime.engine_cache import EngineCache
    from tests.helpers import tiny_block
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cache = EngineCache(tmp_path)

    def pointwise():
        with Network("pw") as net:
            x = Tensor("x", (Dim("n"), 16), torch.float32)
            net.mark_output(F.softmax(F.exp(x) * 0.5, -1) + F.sigmoid(x), "logits")
        return net

    x = torch.randn(3, 16)
    w, feed = tiny_block.weights(2), tiny_block.inputs(9)
    for build, weights, inputs in ((pointwise, {}, {"x": x}), (lambda: tiny_block.build(2), w, feed)):
        results = []
        for expect in ("cache miss", "cache hit"):
            eng = build().build_engine(backend="triton", cache=cache)
            assert dict((s, i) for s, _, i in eng.build_report)["cache lookup"] == expect
            if weights:
                eng.set_weights({k: v.to(dev) for k, v in weights.items()})
            results.append(eng.forward({k: v.clone().to(dev) for k, v in inputs.items()})["logits"].cpu())
        assert build is not pointwise or any(n.op == "fused" for n in eng.net.nodes)
        torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def test_lora_on_triton_backend_matches_peft(tmp_path, monkeypatch):
    """A tiny llama with two PEFT adapters (q/v and gate/down) on the Triton backend: the BGMV
    kernels run for prefill (20 tokens: the slot-dense path) and decode (BGMV), logits match peft's,
    and a mixed batch matches solo runs."""
    pytest.importorskip("peft")
    import graphdsl.runtime.kernels.lora as lora_kernels
    from tests.models.test_lora import make_adapter
    calls = {"n": 0}

    def spy(*a, _f=lora_kernels.lora_apply, **k):
        calls["n"] += 1
        return _f(*a, **k)
    monkeypatch.setattr(lora_kernels, "lora_apply", spy)
    hf = make_checkpoint("llama", tmp_path / "base", num_hidden_layers=1)
    pm = make_adapter(hf, tmp_path / "a", seed=7, r=4, targets=["q_proj", "v_proj", "gate_proj", "down_proj"])
    ids = [1, 5, 9, 33, 2, 77, 6, 8, 100, 31, 45, 12, 3, 4, 7, 150, 2, 9, 10, 11]
    want = hf_logits(pm, ids)
    llm = gd.LLM(tmp_path / "base", device="cuda" if torch.cuda.is_available() else "cpu", dtype="float32",
                 max_model_len=64)
    llm.model.configure_runtime(backend="triton", max_blocks_per_seq=4)
    llm.load_lora("a", tmp_path / "a")
    got = llm.score(ids, lora_request="a").cpu()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    params = gd.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    mixed = llm.generate([ids, ids], params, lora_request=["a", None])
    assert mixed[0].outputs[0].token_ids == llm.generate([ids], params, lora_request="a")[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == llm.generate([ids], params)[0].outputs[0].token_ids
    assert calls["n"] > 0


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_quantized_experts_on_triton_backend_match_the_reference_engine(quantization, tmp_path, monkeypatch):
    """Mixtral with its expert stacks quantized: the Triton backend runs the grouped kernels over
    the codes (``quant_moe_experts``), and its logits and greedy tokens equal the torch reference
    engine's on the same stored weights."""
    import graphdsl.runtime.kernels.moe as moe
    if quantization == "fp8" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 codes need sm_89+")
    calls = []
    kernel = moe.quant_moe_experts
    monkeypatch.setattr(moe, "quant_moe_experts", lambda *a, **k: calls.append(k["schemes"]) or kernel(*a, **k))
    make_checkpoint("mixtral", tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = gd.LLM(tmp_path, device=device, dtype="float32", quantization=quantization, max_model_len=64)
    ref.model.configure_runtime(backend="torch", max_blocks_per_seq=4)
    llm = gd.LLM(tmp_path, device=device, dtype="float32", quantization=quantization, max_model_len=64)
    llm.model.configure_runtime(backend="triton", max_blocks_per_seq=4)
    prompt = [1, 5, 9, 33, 2, 77, 100, 3, 8, 9, 10]
    want = ref.score(prompt).cpu()
    assert not calls                               # the reference engine ran the op's torch reference
    calls.clear()
    got = llm.score(prompt).cpu()
    assert calls and {s.name for pair in calls for s in pair} <= {"int4-g64", "int4-g32", "fp8-channel"}
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    params = gd.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == ref.generate([prompt], params)[0].outputs[0].token_ids
    assert "quant_moe_experts" in {n.op for n in llm.model.engine(Phase.DECODE).net.nodes}


def test_gguf_experts_on_triton_backend_match_the_reference_engine(tmp_path, monkeypatch):
    """A Mixtral GGUF whose experts stay in their blocks (gate/up Q8_0, down Q4_0): the Triton
    backend runs :mod:`~graphdsl.runtime.kernels.moe_gguf` over them (grouped for the prompt's 22
    pairs, one pair a program row for a decode step's 2), and its logits and greedy tokens equal
    the torch reference engine's on the same blocks."""
    from gguf import GGMLQuantizationType as Q

    import graphdsl.runtime.kernels.moe_gguf as moe_gguf
    from tests.models.test_gguf_quantization import _tiny_mixtral_gguf
    paths = []
    kernel = moe_gguf.gguf_experts
    monkeypatch.setattr(moe_gguf, "gguf_experts", lambda *a: paths.append(a[9]) or kernel(*a))
    path = tmp_path / "mixtral.gguf"
    _tiny_mixtral_gguf(path, {r"experts\.gate_up_proj": Q.Q8_0, r"experts\.down_proj": Q.Q4_0})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = gd.LLM(str(path), device=device, dtype="float32", quantization="gguf", max_model_len=64)
    ref.model.configure_runtime(backend="torch", max_blocks_per_seq=4)
    llm = gd.LLM(str(path), device=device, dtype="float32", quantization="gguf", max_model_len=64)
    llm.model.configure_runtime(backend="triton", max_blocks_per_seq=4)
    prompt = [1, 5, 9, 33, 2, 77, 90, 3, 8, 9, 10]
    want = ref.score(prompt).cpu()
    assert not paths
    got = llm.score(prompt).cpu()
    assert paths and set(paths) == {False}
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    params = gd.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    tokens = [m.generate([prompt], params)[0].outputs[0].token_ids for m in (llm, ref)]
    assert tokens[0] == tokens[1]
    assert True in paths
