"""``graphdsl serve --api-processes``: the HTTP side in a process of its own, the engine in this
one (``entrypoints/api_processes.py``). What only that split has: a prompt the model refuses is
still a 400 (the engine checks it before the handler answers), an engine that stops reaches the
API process (``/health`` and requests answer 500), and an API process that dies has its running
requests aborted. (``test_openai_server.py`` runs its tests in both forms.)"""
from __future__ import annotations

import socket
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from graphdsl.entrypoints.api_processes import start_api_processes  # noqa: E402
from tests.server.smollm2 import smollm2_llm  # noqa: E402

NAME = "smollm2"


def _start(llm):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    procs = start_api_processes(llm, 1, sock, served_model_name=NAME)
    procs.wait_ready()
    return procs, f"http://127.0.0.1:{sock.getsockname()[1]}", sock


@pytest.fixture(scope="module")
def llm():
    return smollm2_llm()


def _until(cond, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not cond():
        time.sleep(0.05)
    return cond()


def test_refused_prompt_failing_engine_and_lost_api_process(llm, capsys):
    procs, base, sock = _start(llm)
    engine = procs.engine
    try:
        # a prompt the model refuses: 400 naming the prompt, with the model's own message
        r = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": [1, 10 ** 9], "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "outside" in r.json()["error"]["message"] or "vocab" in r.json()["error"]["message"], r.text

        # the API process goes away mid-stream: the engine aborts its request (long before its 240 tokens)
        before = engine.generated_tokens
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                          json={"model": NAME, "prompt": "Hi", "max_tokens": 240, "stream": True,
                                "ignore_eos": True}) as s:
            next(s.iter_lines())
            assert engine.sched.running
            procs.processes[0].kill()
        assert _until(lambda: not engine.sched.running and llm.blocks.num_free_blocks == llm.blocks.num_blocks)
        assert engine.generated_tokens - before < 200
    finally:
        procs.close()
        sock.close()

    # an engine that stops: the API process says so on /health and to requests
    procs, base, sock = _start(llm)
    try:
        def boom():
            raise RuntimeError("boom in step")
        procs.engine.loop.step = boom
        r = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 500 and "boom in step" in r.json()["error"]["message"], r.text
        assert _until(lambda: httpx.get(f"{base}/health").status_code == 500)
        assert "the engine stopped" in httpx.get(f"{base}/health").json()["error"]["message"]
        r = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2,
                                                       "stream": True}, timeout=60)
        assert r.status_code == 500 and "the engine stopped" in r.json()["error"]["message"], r.text
    finally:
        procs.close()
        sock.close()
    assert "the engine thread stopped on RuntimeError: boom in step" in capsys.readouterr().err


def test_an_api_process_whose_engine_is_gone_fails_what_waits_and_stops(monkeypatch):
    """The engine's end of the pipe closes (its process died): a waiting request gets the error, and
    the API process asks itself to stop (SIGTERM: uvicorn's graceful shutdown)."""
    import asyncio
    import multiprocessing
    import os
    import signal

    from graphdsl.entrypoints import api_processes as AP
    killed = []
    monkeypatch.setattr(AP.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    engine_end, api_end = multiprocessing.Pipe()

    async def run():
        remote = AP.RemoteEngine(api_end)
        task = asyncio.ensure_future(remote.open([1, 2, 3], None, None, None, True))
        await asyncio.sleep(0.1)
        assert engine_end.recv()[0] == "add"              # the request reached the pipe
        engine_end.close()
        tracked = await asyncio.wait_for(task, 10)
        return remote, await asyncio.wait_for(tracked.out.get(), 10)
    remote, item = asyncio.run(run())
    assert item == ("error", "the engine process is gone") and remote.error == "the engine process is gone"
    assert killed == [(os.getpid(), signal.SIGTERM)]


def test_start_and_wait_ready_refuse_by_name(llm):
    from graphdsl.entrypoints.api_processes import ApiProcesses
    from graphdsl.errors import GraphDSLError
    with pytest.raises(GraphDSLError, match=r"start_api_processes: count must be a positive integer, got 0"):
        start_api_processes(llm, 0, None, served_model_name=NAME)

    class _Proc:
        def __init__(self, alive, exitcode=None):
            self.alive, self.exitcode = alive, exitcode

        def is_alive(self):
            return self.alive
    with socket.socket() as s:                  # bound, never listening: nothing accepts
        s.bind(("127.0.0.1", 0))
        addr = s.getsockname()
        with pytest.raises(GraphDSLError, match=r"the API processes ended before listening \(exit codes \[3\]\)"):
            ApiProcesses(None, [_Proc(False, 3)], addr).wait_ready(5)
        with pytest.raises(GraphDSLError, match=rf"no API process listened on \('127.0.0.1', {addr[1]}\) within 0 s"):
            ApiProcesses(None, [_Proc(True)], addr).wait_ready(0.3)
