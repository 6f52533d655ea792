"""The server's engine thread (``AsyncEngine``) on a tiny random Llama on the CPU: every delta and
result reaches its request, and a step's deltas reach the asyncio side in one wake-up, not one
per token (each ``call_soon_threadsafe`` is a socket write that wakes the server's loop)."""
from __future__ import annotations

import threading
import time

import graphdsl as gd
from graphdsl.entrypoints.openai_server import AsyncEngine, _Histogram
from tests.helpers.soak import TINY_LLAMA


class RecordingLoop:
    """Stands in for the server's asyncio loop: counts ``call_soon_threadsafe`` calls and runs each
    at once (on the engine thread)."""

    def __init__(self):
        self.calls = 0
        self._lock = threading.Lock()

    def call_soon_threadsafe(self, fn, *args):
        with self._lock:
            self.calls += 1
        fn(*args)


def _drain(tracked, items, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not all(any(it[0] == "done" for it in items[i]) for i in range(len(tracked))):
        assert time.monotonic() < deadline, "the engine thread did not finish the requests"
        for i, t in enumerate(tracked):
            while not t.out.empty():
                items[i].append(t.out.get_nowait())
        time.sleep(0.01)


def test_a_step_hands_over_all_its_deltas_in_one_wakeup():
    llm = gd.LLM.from_config(TINY_LLAMA, device="cpu", max_model_len=64, max_num_seqs=16)
    engine = AsyncEngine(llm)
    steps = [0]
    step = engine.loop.step

    def counted_step():
        steps[0] += 1
        return step()
    engine.loop.step = counted_step            # the thread is idle until the first submit
    aloop = RecordingLoop()
    params = gd.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=3)
    prompts = [[5 + i, 17, 42, 9, 3] for i in range(3)]
    tracked = [engine.submit(llm._make_prompts([p], params, False)[0], aloop) for p in prompts]
    items = [[] for _ in tracked]
    _drain(tracked, items)

    deltas = [[it for it in got if it[0] == "delta"] for got in items]
    assert [len(d) for d in deltas] == [3 * 10] * 3          # every token of every sample
    assert aloop.calls <= steps[0], (aloop.calls, steps[0])   # 93 calls a token at a time; now one a step at most
    # and what arrived is what LLM.generate gives the same prompts
    ref = llm.generate(prompts, params)
    for got, want in zip(items, ref):
        result = next(it[1] for it in got if it[0] == "done")
        assert [o.token_ids for o in result.outputs] == [o.token_ids for o in want.outputs]
        for o in want.outputs:
            assert [it[3] for it in got if it[0] == "delta" and it[1] == o.index] == o.token_ids


def test_a_request_that_does_not_stream_gets_its_result_alone():
    llm = gd.LLM.from_config(TINY_LLAMA, device="cpu", max_model_len=64, max_num_seqs=4)
    engine = AsyncEngine(llm)
    params = gd.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2)
    t = engine.submit(llm._make_prompts([[3, 1, 4, 1, 5]], params, False)[0], RecordingLoop(), stream=False)
    items = [[]]
    _drain([t], items)
    assert [it[0] for it in items[0]] == ["done"]           # no per-token deltas to wake the handler for
    assert [o.token_ids for o in items[0][0][1].outputs] == [o.token_ids for o in llm.generate([[3, 1, 4, 1, 5]],
                                                                                                  params)[0].outputs]
    assert engine.generated_tokens == 12


def test_latency_histogram_counts_each_value_in_every_bucket_that_holds_it():
    h = _Histogram((0.001, 0.01, 0.1))
    for v in (0.0005, 0.001, 0.002, 0.05, 0.5):
        h.observe(v)
    assert h.lines("x") == ["# TYPE x histogram", 'x_bucket{le="0.001"} 2', 'x_bucket{le="0.01"} 3',
                            'x_bucket{le="0.1"} 4', 'x_bucket{le="+Inf"} 5', "x_sum 0.5535", "x_count 5"]


def test_the_engine_thread_makes_the_llms_gpu_its_current_one(monkeypatch):
    """Each thread has its own current CUDA device, and kernels launch on it: an LLM on ``cuda:1``
    stepped from a fresh thread (current device 0) would run its kernels on GPU 0."""
    import torch
    llm = gd.LLM.from_config(TINY_LLAMA, device="cpu", max_model_len=64, max_num_seqs=2)
    made = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.append((threading.current_thread().name, d)))
    llm.device = torch.device("cuda", 1)           # only the thread's device is looked at here
    engine = AsyncEngine(llm)
    deadline = time.monotonic() + 10
    while not made and time.monotonic() < deadline:
        time.sleep(0.01)
    assert made == [("graphdsl-engine", torch.device("cuda", 1))]
    assert engine.error is None
