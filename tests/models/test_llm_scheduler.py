"""``LLM.generate`` over the continuous-batching scheduler: preemption, chunked prefill, aborted
streams and random-weight models (``LLM.from_config``) on the CPU."""
import pytest
import torch

import graphdsl as gd
from graphdsl import GraphDSLError
from tests.helpers.soak import TINY_LLAMA, random_requests, soak, tiny_llm


def test_soak_with_preemption_equals_one_by_one():
    llm = tiny_llm("cpu", num_kv_blocks=8, max_num_seqs=8, max_num_batched_tokens=32)
    stats = soak(llm, random_requests(60, seed=1), log=lambda *_: None)
    assert stats["preemptions"] > 0


def test_chunked_prefill_equals_one_step_prefill():
    one_step = tiny_llm("cpu", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    chunked = tiny_llm("cpu", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=7)
    prompt = list(range(3, 50))
    sp = gd.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a, b = one_step.generate([prompt], sp)[0].outputs[0], chunked.generate([prompt], sp)[0].outputs[0]
    assert a.token_ids == b.token_ids
    ids = prompt[:20]
    torch.testing.assert_close(chunked.score(ids), one_step.score(ids))


def test_abandoned_stream_returns_its_blocks(tmp_path):
    from tests.models.gguf_tiny import build_tiny_gguf
    path, _ = build_tiny_gguf(tmp_path)
    llm = gd.LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=2)
    it = llm.stream("hello there", gd.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    next(it)
    assert llm.blocks.num_free_blocks < llm.blocks.num_blocks
    it.close()
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks


def test_from_config_is_seeded_and_shaped():
    a = gd.LLM.from_config(TINY_LLAMA, device="cpu", dtype="float32", seed=3, max_model_len=32)
    b = gd.LLM.from_config(TINY_LLAMA, device="cpu", dtype="float32", seed=3, max_model_len=32)
    c = gd.LLM.from_config(TINY_LLAMA, device="cpu", dtype="float32", seed=4, max_model_len=32)
    ids = [5, 6, 7, 8]
    assert torch.equal(a.score(ids), b.score(ids)) and not torch.equal(a.score(ids), c.score(ids))
    w = a.model._bound
    assert torch.equal(w["model.norm.weight"], torch.ones(128))
    std = w["model.layers.0.mlp.down_proj.weight"].std().item()
    assert 0.015 < std < 0.025, std
    assert a.tokenizer is None and a.score(ids).shape == (4, 256)


def test_from_config_and_scheduler_errors():
    with pytest.raises(GraphDSLError, match="hf_config must be a dict"):
        gd.LLM.from_config("llama", device="cpu")
    with pytest.raises(GraphDSLError, match="init_std must be a float > 0, got 0"):
        gd.LLM.from_config(TINY_LLAMA, device="cpu", init_std=0)
    with pytest.raises(GraphDSLError, match="max_num_batched_tokens must be a positive int, got 0"):
        gd.LLM.from_config(TINY_LLAMA, device="cpu", max_num_batched_tokens=0)
    with pytest.raises(GraphDSLError, match="num_kv_blocks must be a positive int, got -1"):
        gd.LLM.from_config(TINY_LLAMA, device="cpu", num_kv_blocks=-1)
    llm = tiny_llm("cpu", num_kv_blocks=2, max_num_seqs=2, max_num_batched_tokens=16)
    with pytest.raises(GraphDSLError, match=r"need 4 KV blocks, but the cache has only 2"):
        llm.generate([[1] * 10], gd.SamplingParams(max_tokens=40))
    assert llm.blocks.num_free_blocks == 2
