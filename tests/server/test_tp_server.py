"""The server over a tensor-parallel ``LLM`` (two CPU ranks over gloo, the worker spawned): its
answers equal one process's, a worker's death fails the next request with the rank named and turns
``/health`` to 500, and the LLM then closes at once."""
from __future__ import annotations

import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import graphdsl as gd  # noqa: E402
from graphdsl.entrypoints.openai_server import build_app  # noqa: E402
from tests.models.hf_tiny import make_checkpoint  # noqa: E402
from tests.server.smollm2 import wait_healthy  # noqa: E402

IDS = [3, 17, 42, 99, 7, 150]
NEW = 5


def _serve(llm):
    """``llm``'s app on a free port in a uvicorn thread; returns (base URL, server, thread)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(build_app(llm, served_model_name="tiny"), log_level="warning"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    wait_healthy(base)
    return base, srv, th


def _complete(base: str) -> httpx.Response:
    return httpx.post(base + "/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": IDS, "max_tokens": NEW, "temperature": 0, "logprobs": 1,
                            "ignore_eos": True})


def test_tp2_server_answers_as_one_process_and_a_dead_worker_fails_requests(tmp_path):
    import torch.distributed as dist
    path = str(tmp_path / "llama")
    make_checkpoint("llama", path)
    one = gd.LLM(path, device="cpu", num_kv_blocks=16)
    want = one.generate([IDS], gd.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=1),
                        use_tqdm=False)[0].outputs[0]
    want_lps = [lp[t].logprob for t, lp in zip(want.token_ids, want.logprobs)]

    llm = gd.LLM(path, device="cpu", tensor_parallel_size=2, num_kv_blocks=16)
    srv = th = None
    try:
        base, srv, th = _serve(llm)
        r = _complete(base)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == NEW
        assert body["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want_lps, abs=1e-4)

        llm._tp.pool.procs[0].kill()                       # the worker dies between requests
        deadline = time.monotonic() + 10
        while llm._tp.broken is None and time.monotonic() < deadline:
            time.sleep(0.05)                               # rank 0's watch marks the group broken
        r = _complete(base)
        assert r.status_code == 500 and "worker rank 1 died (killed by signal 9)" in r.json()["error"]["message"]
        assert httpx.get(base + "/health").status_code == 500
    finally:
        if srv is not None:
            srv.should_exit = True
            th.join(timeout=10)
        t0 = time.monotonic()
        llm.close()
    assert time.monotonic() - t0 < 15 and not dist.is_initialized()
