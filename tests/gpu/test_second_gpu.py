"""An engine and an LLM on the second GPU (``pytest -m gpu``, two GPUs: ``nvidia-h200-x2``) while
the first is the current device. Triton kernels, CUDA graph captures and events go to the calling
thread's current device, so the engine and the LLM make their own current around their work
(``runtime.device.on_device``), and so does the server's engine thread: each gives what the same
model gives on the first GPU."""
from __future__ import annotations

import time

import pytest
import torch

import graphdsl as gd
from tests.helpers.soak import random_requests, tiny_llm

pytestmark = pytest.mark.gpu

if torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs (nvidia-h200-x2)", allow_module_level=True)

REQUESTS = random_requests(12, seed=3)


def _tokens(llm):
    outs = llm.generate([p for p, _ in REQUESTS], [sp for _, sp in REQUESTS])
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(device):
    return tiny_llm(device, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)


def test_an_engine_on_the_second_gpu_runs_there():
    from graphdsl import Network, Parameter, Tensor
    from graphdsl import functional as F
    with Network("mlp") as net:
        w = Parameter((256, 512), torch.bfloat16, name="w")
        net.mark_output(F.silu(F.linear(Tensor("x", (4, 512), torch.bfloat16), w, None, transpose_b=True)), "y")
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda:1").manual_seed(0)
    feed = {"x": torch.randn(4, 512, device="cuda:1", generator=g, dtype=torch.bfloat16),
            "w": 0.05 * torch.randn(256, 512, device="cuda:1", generator=g, dtype=torch.bfloat16)}
    engine = net.build_engine(device="cuda:1", backend="triton")
    got = engine.forward(feed)["y"]
    want = net.build_engine(device="cuda:1", backend="torch").forward(feed)["y"]
    torch.cuda.synchronize(1)
    assert got.device == torch.device("cuda", 1) and torch.cuda.current_device() == 0
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    report = engine.profile(feed, iters=2)                    # its events on the engine's GPU too
    assert report.rows and all(r.ms > 0 for r in report.rows) and report.step_ms > 0


def test_an_llm_on_the_second_gpu_gives_the_first_gpus_tokens():
    torch.cuda.set_device(0)
    want = _tokens(_llm("cuda:0"))
    second = _llm("cuda:1")
    assert second.kv_cache.key_caches[0].device == torch.device("cuda", 1)
    assert _tokens(second) == want                     # decode graphs, the sampler, prefill graphs
    assert torch.cuda.current_device() == 0            # made current around its work, then given back
    torch.testing.assert_close(second.score(REQUESTS[0][0]).cpu(), _llm("cuda:0").score(REQUESTS[0][0]).cpu())


def test_the_servers_engine_thread_steps_on_the_llms_gpu():
    from graphdsl.entrypoints.openai_server import AsyncEngine
    torch.cuda.set_device(0)
    llm = _llm("cuda:1")
    prompt, params = [5, 17, 42, 9, 3], gd.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = llm.generate([prompt], params)[0].outputs[0].token_ids

    class Now:
        """Stands in for the server's asyncio loop: runs each hand-over at once."""

        def call_soon_threadsafe(self, fn, *args):
            fn(*args)
    engine = AsyncEngine(llm)
    t = engine.submit(llm._make_prompts([prompt], params, False)[0], Now(), stream=False)
    deadline = time.monotonic() + 120
    while t.out.empty():
        assert engine.error is None, engine.error
        assert time.monotonic() < deadline, "the engine thread did not finish the request"
        time.sleep(0.01)
    kind, result = t.out.get_nowait()[:2]
    assert kind == "done" and result.outputs[0].token_ids == want
    assert torch.cuda.current_device() == 0            # the thread's set_device is its own
