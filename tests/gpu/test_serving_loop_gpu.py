"""The serving loop on a real GPU (``pytest -m gpu``): steady-state decode steps launch without any
host-device synchronisation (checked with ``torch.cuda.set_sync_debug_mode("error")``, which raises
on a synchronising CUDA call), overlap on and off give the same tokens (greedy, seeded sampling with
penalties, n > 1, logprobs), and the steady state replays one graph per step."""
from __future__ import annotations

import pytest
import torch

import graphdsl as gd
from graphdsl.runtime.serving.loop import ServingLoop
from tests.helpers.soak import tiny_llm

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _params(**kw):
    return gd.SamplingParams(max_tokens=40, ignore_eos=True, **kw)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_steady_decode_steps_do_not_synchronise(kind):
    llm = tiny_llm("cuda", num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
    sp = _params(temperature=0) if kind == "greedy" else \
        _params(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, presence_penalty=0.5, frequency_penalty=0.3,
                repetition_penalty=1.1, seed=5, logprobs=2)
    sched = llm._scheduler()
    loop = ServingLoop(llm._executor, sched, overlap=True)
    for i in range(4):
        sched.add_request(i, [1 + i, 2, 3, 4, 5], sp)
    for _ in range(6):                                  # prefill, first decode steps, graph capture
        loop.step()
    launch = loop._launch
    checked = []

    def launch_without_sync(batch):
        assert batch.is_decode
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(len(batch.chunks))
    loop._launch = launch_without_sync
    for _ in range(20):
        loop.step()
    assert checked == [4] * 20
    loop._launch = launch
    while loop.has_work():
        loop.step()
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks


def test_sync_debug_mode_catches_a_host_read():
    """The check above can fail: reading a device value on the host raises under the same mode."""
    x = torch.ones(4, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            x.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_overlap_on_and_off_give_the_same_tokens():
    prompts = [[7, 8, 9], list(range(20, 45)), [3] * 17, [100, 1]]
    params = [_params(temperature=0), _params(temperature=0.8, top_k=30, seed=1, presence_penalty=1.0),
              _params(temperature=1.0, top_p=0.8, seed=2, frequency_penalty=0.5, n=3, logprobs=3),
              _params(temperature=0.7, min_p=0.05, seed=3, repetition_penalty=1.3, min_tokens=5)]
    outs = {}
    for overlap in (True, False):
        llm = tiny_llm("cuda", num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
        llm.overlap = overlap
        res = llm.generate(prompts, params)
        outs[overlap] = [[(o.token_ids, o.finish_reason) for o in r.outputs] for r in res]
        lp = res[2].outputs[0].logprobs
        assert len(lp) == 40 and all(len(d) in (3, 4) for d in lp)
    assert outs[True] == outs[False]
    assert len({tuple(t) for t, _ in outs[True][2]}) == 3, "the n=3 samples should differ"
