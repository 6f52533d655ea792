"""``graphdsl serve`` end to end: the real server (uvicorn, in a thread) on the SmolLM2 GGUF on the
CPU, driven by the real ``openai`` client and by raw HTTP for the error shapes, streaming
disconnects and metrics."""
from __future__ import annotations

import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import graphdsl as gd  # noqa: E402
from graphdsl.entrypoints.api_processes import start_api_processes  # noqa: E402
from graphdsl.entrypoints.openai_server import build_app  # noqa: E402
from tests.server.smollm2 import smollm2_llm, wait_healthy  # noqa: E402

NAME = "smollm2"
KEY = "sekret"


@pytest.fixture(scope="module", params=["one process", "api process"])
def server(request):
    """The server on SmolLM2, its HTTP side in this process (a uvicorn thread) or in an API process
    of its own (``--api-processes 1``); the engine thread runs here either way."""
    llm = smollm2_llm()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if request.param == "one process":
        app = build_app(llm, served_model_name=NAME, api_key=KEY)
        engine = app.state.engine
        srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
        th.start()
    else:
        procs = start_api_processes(llm, 1, sock, served_model_name=NAME, api_key=KEY)
        engine = procs.engine
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base)
    yield base, llm, engine
    if request.param == "one process":
        srv.should_exit = True
        th.join(timeout=10)
    else:
        procs.close()
    sock.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY)


def _post(base, path, body, key=KEY):
    return httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}


def test_chat_answers_paris(client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_equals_llm_generate(server, client):
    llm = server[1]
    r = client.completions.create(model=NAME, prompt="The capital of Germany is", max_tokens=8, temperature=0)
    want = llm.generate("The capital of Germany is", gd.SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)
    assert r.choices[0].finish_reason == want.finish_reason


def test_streaming_chat_with_usage(client):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full and len([c for c in chunks if c.choices]) > 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_n_logprobs_seed_and_stop(client):
    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2,
                                  seed=7, logprobs=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    again = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2,
                                      seed=7, logprobs=3)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) >= 1 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Count: 1, 2, 3"}],
                                       max_tokens=20, temperature=0, logprobs=True, top_logprobs=2)
    assert len(c.choices[0].logprobs.content[0].top_logprobs) == 2
    full = client.completions.create(model=NAME, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    stop = full.strip()[:1]
    cut = client.completions.create(model=NAME, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert stop not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,status,param", [
    ({"model": NAME, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"model": NAME, "prompt": "hi", "n": "two"}, 400, "n"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"model": NAME, "prompt": "word " * 400}, 400, "prompt"),
    ({"model": NAME, "prompt": ""}, 400, "prompt"),
])
def test_errors_have_openai_shape(server, body, status, param):
    r = _post(server[0], "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and "Traceback" not in err["message"]


def test_api_key_is_required(server):
    r = _post(server[0], "/v1/completions", {"model": NAME, "prompt": "hi"}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server[0] + "/v1/models").status_code == 401
    assert httpx.get(server[0] + "/health").status_code == 200       # the server keeps serving


def test_disconnect_aborts_and_frees_blocks(server):
    base, llm, engine = server
    body = {"model": NAME, "prompt": "Tell me a long story about a dragon.", "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break                                            # one token arrived; hang up
    for _ in range(200):
        if llm.blocks.num_free_blocks == llm.blocks.num_blocks and not engine.sched.running:
            break
        time.sleep(0.05)
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks and not engine.sched.running


def test_disconnect_before_the_first_token_aborts_too(server):
    """A client that hangs up while its stream waits for a token (no write to fail yet): Starlette's
    disconnect listener cancels the stream, and the request stops long before its 200 tokens."""
    base, llm, engine = server
    before = engine.generated_tokens
    body = {"model": NAME, "prompt": "Tell me a long story about a knight.", "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        assert r.status_code == 200                              # headers only; hang up before any event
    for _ in range(200):
        if llm.blocks.num_free_blocks == llm.blocks.num_blocks and not engine.sched.running:
            break
        time.sleep(0.05)
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks and not engine.sched.running
    assert engine.generated_tokens - before < 200


def test_a_client_that_hangs_up_on_a_request_that_does_not_stream_aborts_it(server):
    """Without ``stream`` Starlette does not listen for the disconnect, so the handler does: the request
    stops long before its 200 tokens and gives its KV blocks back."""
    base, llm, engine = server
    before = engine.generated_tokens
    body = {"model": NAME, "prompt": "Tell me a long story about a wizard.", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):                       # the client gives up and hangs up
        httpx.post(base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(60, read=1.0))
    for _ in range(400):
        if llm.blocks.num_free_blocks == llm.blocks.num_blocks and not engine.sched.running:
            break
        time.sleep(0.05)
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks and not engine.sched.running
    assert engine.generated_tokens - before < 200


def test_concurrent_requests_share_the_batch(server, client):
    base, _, engine = server
    results = [None] * 4

    def ask(i):
        results[i] = client.completions.create(model=NAME, prompt=f"Number {i}:", max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True})
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.usage.completion_tokens == 16 for r in results)
    assert engine.max_running_seen > 1
    text = httpx.get(base + "/metrics").text
    assert "graphdsl_requests_running" in text and "graphdsl_time_to_first_token_seconds_count" in text
    assert int(next(line.split()[1] for line in text.splitlines()
                    if line.startswith("graphdsl_generated_tokens_total"))) >= 64


def test_64_concurrent_streams_get_their_solo_outputs(server, client):
    base, llm, engine = server
    prompts = [f"Item {i}: the" for i in range(64)]
    solo = [o.outputs[0].text for o in (llm.generate(p, gd.SamplingParams(max_tokens=6, temperature=0,
                                                                             ignore_eos=True)) [0] for p in prompts)]
    got = [None] * 64

    def stream(i):
        chunks = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=6, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        got[i] = "".join(c.choices[0].text for c in chunks if c.choices)
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == solo
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks
