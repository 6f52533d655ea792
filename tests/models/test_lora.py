"""LoRA: PEFT adapters made with ``peft`` on tiny random llama/qwen2 checkpoints, served by graphdsl.

Differential: logits against peft's own model; a mixed batch (three adapters + base) against each
request run alone; bad adapters against named errors; the no-LoRA engine against today's graph.
"""
import json
import os

import pytest
import torch

import graphdsl as gd
from graphdsl.layers import Phase
from graphdsl.runtime.loaders.peft import LoRAError, load_peft_adapter

from tests.models.hf_tiny import hf_logits, make_checkpoint

peft = pytest.importorskip("peft")

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model, directory, *, seed, r=4, alpha=8, targets=ALL_LINEAR, rslora=False):
    """A PEFT LoRA adapter of ``hf_model`` with random (non-zero) A and B, saved to ``directory``;
    returns the peft model (eval) for reference logits."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.1,
                          use_rslora=rslora, init_lora_weights=False)
    pm = peft.get_peft_model(hf_model, cfg).eval()
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    pm.save_pretrained(directory)
    return pm


def _unwrap(pm):
    """Undo get_peft_model so the next adapter is made on the clean base model."""
    return pm.unload()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_llama")
    hf = make_checkpoint("llama", root / "base")
    refs, paths = {}, {}
    ids = [3, 17, 42, 99, 5, 64, 120, 7, 11]
    refs["base"] = hf_logits(hf, ids)
    specs = {"a": dict(seed=1), "b": dict(seed=2, r=8, alpha=4, rslora=True),
             "c": dict(seed=3, r=2, targets=["q_proj", "v_proj", "down_proj"])}
    for name, kw in specs.items():
        pm = make_adapter(hf, root / name, **kw)
        refs[name] = hf_logits(pm, ids)
        hf = _unwrap(pm)
        paths[name] = str(root / name)
    llm = gd.LLM(str(root / "base"), device="cpu", max_model_len=64, max_num_seqs=4)
    llm.enable_lora(max_loras=2, max_lora_rank=8)
    return llm, ids, refs, paths, root


def test_load_peft_adapter_reads_rank_alpha_and_targets(llama):
    _, _, _, paths, _ = llama
    ad = load_peft_adapter(paths["b"])
    assert ad.rank == 8 and ad.use_rslora and ad.scaling_of("model.layers.0.self_attn.q_proj") == pytest.approx(4 / 8 ** 0.5)
    assert set(ad.weights) == {f"model.layers.{i}.{p}.{m}" for i in range(2)
                               for p, ms in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                             ("mlp", ("gate_proj", "up_proj", "down_proj"))) for m in ms}
    a, b = ad.weights["model.layers.1.mlp.down_proj"]
    assert a.shape == (8, 96) and b.shape == (64, 8)


@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_single_adapter_matches_peft(llama, name):
    llm, ids, refs, paths, _ = llama
    got = llm.score(ids, lora_request=gd.LoRARequest(name, ord(name), paths[name]))
    torch.testing.assert_close(got, refs[name], atol=2e-4, rtol=2e-4)
    assert not torch.allclose(refs[name], refs["base"], atol=1e-2)     # the adapter changes the logits


def test_base_engine_is_unchanged_by_lora(llama):
    """A step without lora_indices runs the plain engine: the same graph as a model that never saw
    LoRA (same ops, no lora inputs), and base logits."""
    llm, ids, refs, _, root = llama
    torch.testing.assert_close(llm.score(ids), refs["base"], atol=2e-4, rtol=2e-4)
    plain = gd.LLM(str(root / "base"), device="cpu", max_model_len=64, max_num_seqs=4)
    plain.score(ids)
    mine, theirs = llm.model.engine(Phase.PREFILL).net, plain.model.engine(Phase.PREFILL).net
    assert [n.op for n in mine.nodes] == [n.op for n in theirs.nodes]
    assert sorted(mine.inputs) == sorted(theirs.inputs)
    assert mine.to_json() == theirs.to_json()          # what the engine cache key hashes
    lora_net = llm.model.engine(Phase.PREFILL, lora=True).net
    lora_ops = [n.op for n in lora_net.nodes]
    assert lora_ops.count("matmul_lora") + lora_ops.count("matmul_silu_mul_lora") == 4 * 2   # qkv, o, gate_up, down
    assert lora_ops.count("matmul_silu_mul_lora") == 2 and "lora_apply" not in lora_ops    # fused, SwiGLU kept
    assert "lora_indices" in lora_net.inputs


@pytest.mark.parametrize("buckets", ["0", "1"])
def test_mixed_batch_equals_each_alone(llama, monkeypatch, buckets):
    """Three adapters and the base model in one generate call (two GPU slots: the scheduler keeps at
    most two adapters running and the pool evicts to the host) give each request's solo output,
    with and without padded prefill buckets (padding tokens use no adapter)."""
    monkeypatch.setenv("GRAPHDSL_PREFILL_BUCKETS", buckets)
    llm, ids, _, paths, _ = llama
    reqs = [gd.LoRARequest(n, i + 1, paths[n]) for i, n in enumerate("abc")] + [None]
    prompts = [ids, ids[:5], ids[2:], ids[1:7]]
    params = gd.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    together = llm.generate(prompts, params, lora_request=reqs)
    for p, r, out in zip(prompts, reqs, together):
        alone = llm.generate([p], params, lora_request=r)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    solo_ids = [o.outputs[0].token_ids for o in together]
    assert len({tuple(x) for x in solo_ids}) > 1
    assert len(llm.model.lora.resident()) <= 2


def test_hot_swap_keeps_the_engine(llama):
    llm, ids, refs, paths, _ = llama
    llm.load_lora("swap", paths["a"])
    engine = llm.model.engine(Phase.PREFILL, lora=True)
    torch.testing.assert_close(llm.score(ids, lora_request="swap"), refs["a"], atol=2e-4, rtol=2e-4)
    llm.load_lora("swap", paths["b"])
    torch.testing.assert_close(llm.score(ids, lora_request="swap"), refs["b"], atol=2e-4, rtol=2e-4)
    assert llm.model.engine(Phase.PREFILL, lora=True) is engine
    llm.remove_lora("swap")


def _copy_adapter(src, dst, *, config=None, tensors=None):
    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    cfg = json.load(open(os.path.join(src, "adapter_config.json")))
    cfg.update(config or {})
    json.dump(cfg, open(os.path.join(dst, "adapter_config.json"), "w"))
    t = load_file(os.path.join(src, "adapter_model.safetensors"))
    t = tensors(t) if tensors else t
    save_file(t, os.path.join(dst, "adapter_model.safetensors"))
    return str(dst)


def test_bad_adapters_get_named_errors(llama, tmp_path):
    llm, _, _, paths, _ = llama
    with pytest.raises(LoRAError, match="missing adapter_config.json"):
        os.makedirs(tmp_path / "empty")
        llm.load_lora("x", tmp_path / "empty")
    with pytest.raises(LoRAError, match="rank mismatch.*config r=3"):
        llm.load_lora("x", _copy_adapter(paths["a"], tmp_path / "rank", config={"r": 3}))

    def rename(t):
        return {k.replace("mlp.down_proj", "mlp.out_proj"): v for k, v in t.items()}
    with pytest.raises(LoRAError, match="unknown target module 'model.layers.0.mlp.out_proj'"):
        llm.load_lora("x", _copy_adapter(paths["a"], tmp_path / "unknown", tensors=rename))
    with pytest.raises(LoRAError, match="rank 16 exceeds max_lora_rank=8"):
        big = {}
        for k, v in load_peft_adapter(paths["a"]).weights.items():
            big[f"base_model.model.{k}.lora_A.weight"] = torch.randn(16, v[0].shape[1])
            big[f"base_model.model.{k}.lora_B.weight"] = torch.randn(v[1].shape[0], 16)
        llm.load_lora("x", _copy_adapter(paths["a"], tmp_path / "big", config={"r": 16}, tensors=lambda _: big))
    with pytest.raises(LoRAError, match="no adapter named 'nope'"):
        llm.score([1, 2, 3], lora_request="nope")
    assert "x" not in llm.list_loras()


def test_qwen2_adapter_matches_peft(tmp_path):
    """Qwen2 has q/k/v biases: the adapter adds to the biased fused projection."""
    hf = make_checkpoint("qwen2", tmp_path / "base")
    pm = make_adapter(hf, tmp_path / "ad", seed=5, r=4, targets=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    ids = [4, 8, 15, 16, 23, 42]
    want = hf_logits(pm, ids)
    llm = gd.LLM(str(tmp_path / "base"), device="cpu", max_model_len=64, max_num_seqs=2)
    llm.load_lora("q", tmp_path / "ad")
    torch.testing.assert_close(llm.score(ids, lora_request="q"), want, atol=2e-4, rtol=2e-4)
    out = llm.generate([ids], gd.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), lora_request="q")
    with torch.no_grad():
        ref = pm.generate(input_ids=torch.tensor([ids]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert out[0].outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_slot_pool_evicts_the_least_recently_used(llama):
    llm, ids, refs, paths, _ = llama
    pool = llm.model.lora
    for n, p in (("l1", "a"), ("l2", "b"), ("l3", "c")):
        llm.load_lora(n, paths[p])
    s1, = pool.slots_for(["l1"])
    s2, = pool.slots_for(["l2"])
    assert s1 != s2
    assert pool.slots_for(["l1", None]) == [s1, -1]          # l1 used again: l2 is now the oldest
    assert pool.slots_for(["l3"]) == [s2]                      # l3 takes l2's slot
    assert list(pool.resident())[-2:] == ["l1", "l3"]
    torch.testing.assert_close(llm.score(ids, lora_request="l2"), refs["b"], atol=2e-4, rtol=2e-4)   # back from the host
    with pytest.raises(LoRAError, match="a step uses 3 adapters but max_loras=2"):
        pool.slots_for(["l1", "l2", "l3"])
    for n in ("l1", "l2", "l3"):
        llm.remove_lora(n)
