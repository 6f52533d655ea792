"""benchmarks/serve.py's client side against the real server on a tiny random Llama (CPU): clients
run in a process of their own, and every token they count is a first token or an inter-token gap."""
from __future__ import annotations

import re
import socket
import sys
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import graphdsl as gd  # noqa: E402
from graphdsl.entrypoints.openai_server import build_app  # noqa: E402
from tests.helpers.benchmarks import ROOT  # noqa: E402
from tests.helpers.soak import TINY_LLAMA  # noqa: E402


@pytest.fixture(scope="module")
def serve():
    sys.path.insert(0, str(ROOT))        # as `python benchmarks/serve.py` runs: its client processes import it by name
    try:
        import serve as mod
        yield mod
    finally:
        sys.path.remove(str(ROOT))


def test_shares_split_the_clients_evenly(serve):
    assert serve._shares(16, 1) == [(0, 16)]
    assert serve._shares(64, 3) == [(0, 22), (22, 21), (43, 21)]
    assert sum(n for _, n in serve._shares(257, 8)) == 257


def test_clients_in_their_own_process_count_every_token(serve):
    llm = gd.LLM.from_config(dict(TINY_LLAMA, max_position_embeddings=2048), device="cpu", max_model_len=1536,
                             max_num_seqs=4)        # the clients send prompts of up to 1024 tokens
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(llm, served_model_name="bench"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        while not server.started:
            time.sleep(0.05)
        r = serve._run(f"http://127.0.0.1:{port}/v1/completions", 2, 0.5, TINY_LLAMA["vocab_size"], 1)
    finally:
        server.should_exit = True
        th.join(timeout=10)
    assert len(r["ttft"]) >= 2                                  # each client finished at least one request
    assert r["tokens"] == len(r["ttft"]) + len(r["itl"]) >= 2 * 32   # 32-256 tokens a request
    assert r["tokens_s"] > 0 and all(x > 0 for x in r["itl"])


@pytest.mark.parametrize("argv, message", [(["--max-num-seqs", "0"], "--max-num-seqs must be a positive integer, got 0"),
                                           (["--clients", "16", "0"], r"--clients must be positive integers, got \[16, 0\]"),
                                           (["--api-processes", "-1"],
                                            "--api-processes must be 0 or a positive integer, got -1")])
def test_bad_arguments_are_refused_by_name(serve, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        serve.main(argv)
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_cpu_seconds_of_a_process_and_of_one_of_its_threads(serve):
    """``_cpu_s`` reads /proc: a thread that spins for 0.3 s of wall shows up to that much CPU, the
    process at least as much, a sleeping thread almost none; a pid that does not exist reads 0."""
    import os
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("needs Linux /proc")
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass
    sleeper = threading.Thread(target=stop.wait)
    spinner = threading.Thread(target=spin)
    sleeper.start()
    spinner.start()
    try:
        s0, p0 = serve._cpu_s(os.getpid(), sleeper.native_id), serve._cpu_s(os.getpid())
        t0 = serve._cpu_s(os.getpid(), spinner.native_id)
        time.sleep(0.3)
        spun = serve._cpu_s(os.getpid(), spinner.native_id) - t0
        slept = serve._cpu_s(os.getpid(), sleeper.native_id) - s0
        whole = serve._cpu_s(os.getpid()) - p0
    finally:
        stop.set()
        spinner.join()
        sleeper.join()
    assert 0.05 <= spun <= 0.45, spun                 # it shares the interpreter lock with this thread
    assert whole >= spun - 0.02 and slept <= 0.02, (whole, spun, slept)
    assert serve._cpu_s(2 ** 22 + 12345) == 0.0
