"""``graphdsl serve``'s --host and --port: refused by name before the model loads (a port out of
range, a host that does not resolve, an address this machine cannot listen on), and "serving on"
printed only once the socket uvicorn will serve from is bound; the start-up warm-up (on CUDA by
default, ``--warmup`` / ``--no-warmup``) runs before it."""
from __future__ import annotations

import socket

import pytest

uvicorn = pytest.importorskip("uvicorn")

from graphdsl.entrypoints.cli import main  # noqa: E402
from tests.models.gguf_tiny import build_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return str(build_tiny_gguf(tmp_path_factory.mktemp("serve_cli"))[0])


def _no_weights(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before --host/--port were checked")
    monkeypatch.setattr("graphdsl.entrypoints.llm.load_weights", refuse)


def _run(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("flag,value,says", [
    ("--port", "70000", "argument --port: expected a TCP port, an integer in [1, 65535], got 70000"),
    ("--port", "65536", "got 65536"),
    ("--port", "-1", "got -1"),
    ("--port", "0", "got 0"),
    ("--host", "999.1.1.1", "argument --host: '999.1.1.1' is not an address to listen on"),
    ("--host", "no-such-host.invalid", "argument --host: 'no-such-host.invalid' is not an address"),
    ("--host", "192.0.2.1", "argument --host/--port: cannot listen on 192.0.2.1:"),     # TEST-NET-1: not ours
])
def test_bad_host_or_port_is_named_before_the_model_loads(gguf, flag, value, says, capsys, monkeypatch):
    _no_weights(monkeypatch)
    assert _run(["serve", gguf, flag, value]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and "serving" not in err, err


def test_a_port_in_use_is_named_before_the_model_loads(gguf, capsys, monkeypatch):
    _no_weights(monkeypatch)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert _run(["serve", gguf, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err and "serving" not in err, err


def _serve_until_uvicorn(gguf, capsys, monkeypatch, *extra) -> dict:
    """Run ``graphdsl serve`` on the CPU up to uvicorn's start; what stderr held then, the sockets."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen = {}

    def run(server, sockets=None):
        seen["err"] = capsys.readouterr().err
        seen["addr"] = [sock.getsockname() for sock in sockets]
        for sock in sockets:
            sock.close()
    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert _run(["serve", gguf, "--device", "cpu", "--port", str(port), "--max-model-len", "64", *extra]) == 0
    seen["port"] = port
    return seen


def test_serving_is_announced_once_the_socket_is_bound(gguf, capsys, monkeypatch):
    seen = _serve_until_uvicorn(gguf, capsys, monkeypatch)
    port = seen["port"]
    assert seen["addr"] == [("127.0.0.1", port)]
    assert f"on http://127.0.0.1:{port}/v1" in seen["err"]


@pytest.mark.parametrize("flag,warms", [((), False), (("--no-warmup",), False), (("--warmup",), True)])
def test_warmup_runs_before_serving_when_asked(gguf, capsys, monkeypatch, flag, warms):
    """On the CPU the default is no warm-up (nothing to compile or capture); --warmup forces it."""
    err = _serve_until_uvicorn(gguf, capsys, monkeypatch, "--max-num-seqs", "2", *flag)["err"]
    assert ("warm-up 1/3: prefill of 126 tokens in 2 prompts" in err) == warms, err
    assert ("warmed up in" in err) == warms
    if warms:
        assert err.index("warmed up in") < err.index("serving ")


@pytest.mark.parametrize("value", ["-2", "two", "1.5"])
def test_bad_api_processes_is_named_before_the_model_loads(gguf, value, capsys, monkeypatch):
    _no_weights(monkeypatch)
    assert _run(["serve", gguf, "--api-processes", value]) == 2
    err = capsys.readouterr().err
    assert "argument --api-processes: expected an integer >= 0" in err and "Traceback" not in err, err


@pytest.mark.parametrize("given, device, want", [(None, "cuda", 1), (None, "cuda:1", 1), (None, "cpu", 0),
                                                 (0, "cuda", 0), (3, "cpu", 3)])
def test_api_processes_default_to_one_on_cuda_and_none_on_the_cpu(given, device, want):
    from graphdsl.entrypoints.cli import DEFAULT_CUDA_API_PROCESSES, api_process_count
    assert DEFAULT_CUDA_API_PROCESSES == 1
    assert api_process_count(given, device) == want


@pytest.mark.parametrize("flag", [(), ("--api-processes", "0")])
def test_cpu_serves_http_from_the_engines_process_unless_asked(gguf, capsys, monkeypatch, flag):
    """On the CPU (and with ``--api-processes 0`` anywhere) no API process is started: uvicorn runs
    in this process."""
    import graphdsl.entrypoints.api_processes as AP

    def refuse(*a, **k):
        raise AssertionError("start_api_processes called")
    monkeypatch.setattr(AP, "start_api_processes", refuse)
    err = _serve_until_uvicorn(gguf, capsys, monkeypatch, "--max-num-seqs", "2", *flag)["err"]
    assert "API process" not in err and "serving " in err, err


def test_api_processes_serve_the_model(gguf, capsys, monkeypatch):
    """``--api-processes 2``: two HTTP processes on the one socket, the engine in this process; a
    completion through them is the one ``LLM.generate`` gives, and closing them ends ``serve``."""
    import os

    import httpx

    from tests.server.smollm2 import ServeInThread

    import graphdsl as gd
    serve = ServeInThread(monkeypatch, [gguf, "--device", "cpu", "--max-model-len", "64", "--api-processes", "2"])
    with serve:
        body = {"model": os.path.basename(gguf), "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0}
        outs = [httpx.post(f"{serve.base}/v1/completions", json=body, timeout=60) for _ in range(4)]
        assert [o.status_code for o in outs] == [200] * 4, [o.text for o in outs]
        want = gd.LLM(gguf, device="cpu", max_model_len=64).generate(
            [[1, 2, 3]], gd.SamplingParams(max_tokens=5, temperature=0))[0].outputs[0].text
        assert {o.json()["choices"][0]["text"] for o in outs} == {want}
        assert len(serve.started) == 1 and len(serve.started[0].processes) == 2
    assert serve.close() == 0
    err = capsys.readouterr().err
    assert "2 API processes started" in err and err.index("API processes started") < err.index("serving ")
