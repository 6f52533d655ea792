"""Continuous batching: chunked prefill, budgets, preemption by recompute, and outputs equal to
running each request alone — checked with a fake model that reads its context only through the
paged KV cache (so a wrong slot or block table changes the output)."""
import random

import pytest
import torch

from graphdsl import GraphDSLError
from graphdsl.runtime.serving.kv_cache import BlockManager
from graphdsl.runtime.serving.sampling import SamplingParams
from graphdsl.runtime.serving.loop import ServingLoop
from graphdsl.runtime.serving.scheduler import RequestStatus, Scheduler
from tests.helpers.fake_model import VOCAB, FakeModel


def _run(requests, *, num_blocks, block_size=4, max_num_seqs=8, budget=32, max_model_len=64, eos=(), overlap=True):
    blocks = BlockManager(num_blocks, block_size)
    sched = Scheduler(blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      max_model_len=max_model_len, eos_token_ids=eos)
    reqs = [sched.add_request(i, p, sp) for i, (p, sp) in enumerate(requests)]
    streamed = {i: [] for i in range(len(reqs))}
    loop = ServingLoop(FakeModel(blocks, max_model_len), sched, overlap=overlap)
    while loop.has_work():
        for ev in loop.step():
            streamed[ev.request.request_id].append(ev.token_id)
    assert blocks.num_free_blocks == num_blocks
    for r in reqs:
        assert r.status is RequestStatus.FINISHED and streamed[r.request_id] == r.output_ids
        assert r.num_pending == 0
    return reqs


def _random_requests(n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        temp = rng.choice([0.0, 0.8, 1.3])
        sp = SamplingParams(max_tokens=rng.randint(1, 20), temperature=temp, top_k=rng.choice([0, 5]),
                            top_p=rng.choice([1.0, 0.9]), seed=1000 + i)
        out.append((prompt, sp))
    return out


@pytest.mark.parametrize("overlap", [True, False])
def test_many_requests_with_preemption_equal_one_by_one(overlap):
    reqs = _random_requests(120, seed=0)
    together = _run(reqs, num_blocks=24, max_num_seqs=16, budget=24, overlap=overlap)
    assert sum(r.num_preemptions for r in together) > 0, "pool was meant to force preemption"
    for i, (prompt, sp) in enumerate(reqs):
        (alone,) = _run([(prompt, sp)], num_blocks=24, max_num_seqs=16, budget=24)
        assert alone.output_ids == together[i].output_ids, f"request {i} differs"
        assert alone.finish_reason == together[i].finish_reason


def test_chunked_prefill_respects_the_budget_and_decodes_batch():
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64)
    a = sched.add_request("a", list(range(25)), SamplingParams(max_tokens=3, temperature=0))
    b = sched.add_request("b", [1, 2], SamplingParams(max_tokens=3, temperature=0))
    step1 = sched.schedule()
    assert [(c.request.request_id, c.start, c.end) for c in step1.chunks] == [("a", 0, 10)]
    assert not step1.chunks[0].samples
    sched.update(step1, [])
    step2 = sched.schedule()
    assert [(c.request.request_id, c.start, c.end) for c in step2.chunks] == [("a", 10, 20)]
    sched.update(step2, [])
    step3 = sched.schedule()
    assert [(c.request.request_id, c.start, c.end) for c in step3.chunks] == [("a", 20, 25), ("b", 0, 2)]
    sched.update(step3, [7, 8])
    step4 = sched.schedule()
    assert step4.is_decode and [(c.start, c.end) for c in step4.chunks] == [(25, 26), (2, 3)]
    t = step4.model_inputs(blocks)
    assert t["input_ids"].tolist() == [7, 8] and t["seq_lens"].tolist() == [26, 3]
    assert t["lm_head_indices"].tolist() == [0, 1] and t["query_start_loc"].tolist() == [0, 1, 2]
    assert t["slot_mapping"].tolist() == blocks.slot_mapping("a", 25, 26) + blocks.slot_mapping("b", 2, 3)
    assert a.status is b.status is RequestStatus.RUNNING


def test_stop_conditions():
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=8, eos_token_ids=[3])
    eos = sched.add_request(0, [1, 2], SamplingParams(max_tokens=5))
    ign = sched.add_request(1, [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    stp = sched.add_request(2, [1, 2], SamplingParams(max_tokens=5, stop_token_ids=[9]))
    cap = sched.add_request(3, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=9))
    b = sched.schedule()
    ev = sched.update(b, [3, 3, 9, 1])
    assert [e.finished for e in ev] == [True, False, True, False]
    assert eos.finish_reason == "stop" and stp.finish_reason == "stop"
    b = sched.schedule()
    sched.update(b, [5, 5])
    assert ign.finish_reason == "length" and cap.finish_reason == "length"   # max_tokens; max_model_len
    assert not sched.has_unfinished() and blocks.num_free_blocks == 16


def test_max_tokens_none_runs_to_max_model_len():
    """vLLM's ``max_tokens=None``: as many tokens as ``max_model_len`` leaves room for (an int
    before: None was refused); ``min_tokens`` has no upper bound then."""
    reqs = _run([([1, 2, 3], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)),
                 ([4] * 10, SamplingParams(max_tokens=None, min_tokens=30, temperature=0.0))],
                num_blocks=32, max_model_len=20)
    assert [len(r.output_ids) for r in reqs] == [17, 10]
    assert [r.finish_reason for r in reqs] == ["length", "length"]
    with pytest.raises(GraphDSLError, match=r"max_tokens must be an integer >= 1, or None \(as many as max_model_len "
                                            r"leaves room for\), got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(GraphDSLError, match="need 8 KV blocks, but the cache has only 4"):
        Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=8,
                  max_model_len=32).add_request(0, [1] * 10, SamplingParams(max_tokens=None))


def test_request_errors():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32)
    with pytest.raises(GraphDSLError, match="the prompt is empty"):
        sched.add_request(0, [], SamplingParams())
    with pytest.raises(GraphDSLError, match="the prompt has 40 tokens, but max_model_len is 32"):
        sched.add_request(0, [1] * 40, SamplingParams())
    with pytest.raises(GraphDSLError, match="need 6 KV blocks, but the cache has only 4"):
        sched.add_request(0, [1] * 10, SamplingParams(max_tokens=12))
    sched.add_request("x", [1], SamplingParams(max_tokens=2))
    with pytest.raises(GraphDSLError, match="request id 'x' is already in use"):
        sched.add_request("x", [1], SamplingParams(max_tokens=2))
    with pytest.raises(GraphDSLError, match="max_num_seqs must be an integer >= 1, got 0"):
        Scheduler(BlockManager(4, 4), max_num_seqs=0, max_num_batched_tokens=8, max_model_len=32)


def test_lora_requests_wait_for_a_free_adapter_slot():
    """With max_loras=2, a request for a third adapter waits (FIFO) until a running adapter's
    requests finish; base requests and more requests of a running adapter are admitted."""
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, max_loras=2)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    a = sched.add_request("a", [1, 2], sp, lora="x")
    b = sched.add_request("b", [1, 2], sp, lora="y")
    a2 = sched.add_request("a2", [3], sp, lora="x")
    c = sched.add_request("c", [1, 2], sp, lora="z")
    base = sched.add_request("base", [1, 2], sp)
    batch = sched.schedule()
    assert [ch.request for ch in batch.chunks] == [a, b, a2]
    assert sched.waiting == [c, base]
    for r in (a, b, a2):
        sched.finish(r, "stop")
    batch = sched.schedule()
    assert [ch.request for ch in batch.chunks] == [c, base]


def test_step_inputs_pack_into_one_aligned_buffer():
    """``to_device``: every field a view of one buffer, starting on a 16-byte boundary, with the
    values (negatives, empty fields, float32) as given; an int out of its dtype's range refused."""
    from graphdsl.runtime.serving.scheduler import to_device
    fields = {"a": ([1, -1, 2**40], torch.int64), "b": ([], torch.int64), "c": ([7, 8, 9, -2, 5], torch.int32),
              "d": ([3], torch.int32), "t": (list(range(6)), torch.int32), "f": ([0.8, 1, -2.5], torch.float32)}
    out = to_device("cpu", fields, shapes={"t": (2, 3)})
    for k, (vals, dt) in fields.items():
        assert out[k].dtype == dt and out[k].flatten().tolist() == torch.tensor(vals, dtype=dt).tolist()
        assert out[k].data_ptr() % 16 == 0 or not vals
    assert out["t"].shape == (2, 3)
    assert len({v.untyped_storage().data_ptr() for v in out.values()}) == 1           # one buffer, one copy
    with pytest.raises(OverflowError):
        to_device("cpu", {"x": ([2**31], torch.int32)})
