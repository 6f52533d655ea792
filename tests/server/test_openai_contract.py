"""The server's request contract, in process (FastAPI's TestClient) on the SmolLM2 GGUF on the CPU:
``n`` samples equal ``LLM.generate``'s (every token, stop strings, logprobs, streamed or not), a
failing engine says why on stderr and answers 500 (a failure while adding a request fails that
request alone), fields map to SamplingParams or are refused by name, token budgets the context
cannot hold are refused, routing errors have OpenAI's shape, streamed ``text_offset``s count from
the completion's start."""
from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import graphdsl as gd  # noqa: E402
from graphdsl.entrypoints.openai_server import build_app  # noqa: E402
from tests.server.smollm2 import smollm2_llm  # noqa: E402

NAME = "smollm2"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def llm():
    return smollm2_llm(MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(llm):
    from fastapi.testclient import TestClient
    with TestClient(build_app(llm, served_model_name=NAME)) as c:
        yield c


def _fresh_client(llm):
    """A client of a new app (its own engine thread), for tests that break the engine. Used without
    ``with``, each request runs on its own event loop thread, so one that hangs cannot block the rest."""
    from fastapi.testclient import TestClient
    app = build_app(llm, served_model_name=NAME)
    return TestClient(app), app.state.engine


def _post_within(c, path: str, body: dict, seconds: float = 120):
    """``c.post``, failing the test instead of hanging when no answer comes."""
    out = {}
    th = threading.Thread(target=lambda: out.update(r=c.post(path, json=body)), daemon=True)
    th.start()
    th.join(timeout=seconds)
    assert "r" in out, f"no answer to {body} within {seconds} s"
    return out["r"]


def _chunks(r) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def _error(r, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


# -- n samples: every event of every sample ---------------------------------------------------
def _n_params(llm, with_stop: bool) -> dict:
    """n=3 seeded samples of 3 tokens; with_stop: a stop string that sample 2's last token completes."""
    kw = dict(max_tokens=3, n=3, seed=1, temperature=1.0, logprobs=1)
    if with_stop:
        last = llm.generate("Hi", gd.SamplingParams(**kw))[0].outputs[2]
        kw["stop"] = [llm.tokenizer.decode([last.token_ids[-1]])]
        assert llm.generate("Hi", gd.SamplingParams(**kw))[0].outputs[2].finish_reason == "stop"
    return kw


@pytest.mark.parametrize("with_stop", [False, True], ids=["length", "stop-string"])
def test_n_samples_equal_llm_generate(llm, client, with_stop):
    kw = _n_params(llm, with_stop)
    want = llm.generate("Hi", gd.SamplingParams(**kw))[0].outputs
    body = {"model": NAME, "prompt": "Hi", **kw}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in got] == [o.text for o in want]
    assert [c["finish_reason"] for c in got] == [o.finish_reason for o in want]
    assert [len(c["logprobs"]["tokens"]) for c in got] == [len(o.token_ids) for o in want]
    assert r.json()["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in want)

    chunks = _chunks(client.post("/v1/completions", json={**body, "stream": True}))
    for o in want:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == o.index]
        assert len(mine) == len(o.token_ids), mine                 # one chunk per token, the last one included
        assert "".join(c["text"] for c in mine) == o.text
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [o.finish_reason]
        assert sum(len(c["logprobs"]["tokens"]) for c in mine) == len(o.logprobs)


def test_streamed_text_offsets_count_from_the_completions_start(client):
    body = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    streamed = [c["choices"][0]["logprobs"] for c in _chunks(client.post("/v1/completions",
                                                                         json={**body, "stream": True}))]
    assert [t for lp in streamed for t in lp["tokens"]] == whole["tokens"]
    assert [o for lp in streamed for o in lp["text_offset"]] == whole["text_offset"]
    assert whole["text_offset"][-1] == sum(len(t) for t in whole["tokens"][:-1]) > 0


def test_a_sample_whose_last_event_never_comes_still_ends(llm):
    """If the loop ever ends a request without its last event, the idle engine answers with what it has."""
    c, engine = _fresh_client(llm)
    step = engine.loop.step

    def lossy():
        return [e for e in step() if not (e.finished and e.request.request_id[1] == 1)]
    engine.loop.step = lossy
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 3, "n": 2, "seed": 3, "ignore_eos": True}
    r = _post_within(c, "/v1/completions", body)
    assert [ch["finish_reason"] for ch in r.json()["choices"]] == ["length", "length"]


# -- a failing engine -------------------------------------------------------------------------
def test_a_failing_step_stops_the_engine_loudly(llm, capsys):
    c, engine = _fresh_client(llm)
    step = engine.loop.step
    calls = []

    def boom():
        if not calls:
            calls.append(1)
            raise RuntimeError("boom in step")
        return step()
    engine.loop.step = boom
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 4}
    err = _error(_post_within(c, "/v1/completions", body), 500, None)
    assert err["type"] == "server_error" and "RuntimeError: boom in step" in err["message"]
    health = _error(c.get("/health"), 500, None)
    assert "the engine stopped" in health["message"] and "boom in step" in health["message"]
    for b in (body, {**body, "stream": True}):
        assert "the engine stopped" in _error(_post_within(c, "/v1/completions", b), 500, None)["message"]
    log = capsys.readouterr().err
    assert "the engine thread stopped on RuntimeError: boom in step" in log
    assert "Traceback (most recent call last)" in log and "in boom" in log
    assert llm.blocks.num_free_blocks == llm.blocks.num_blocks           # its requests gave their blocks back


def test_a_request_that_fails_when_added_fails_alone(llm, capsys):
    c, engine = _fresh_client(llm)
    add = engine.sched.add_request
    calls = []

    def flaky(*a, **k):
        if not calls:
            calls.append(1)
            raise RuntimeError("cannot add this one")
        return add(*a, **k)
    engine.sched.add_request = flaky
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2, "n": 2}
    err = _error(_post_within(c, "/v1/completions", body), 500, None)
    assert "RuntimeError: cannot add this one" in err["message"]
    assert c.get("/health").json() == {"status": "ok"}
    assert _post_within(c, "/v1/completions", body).status_code == 200
    assert engine.error is None
    log = capsys.readouterr().err
    assert "failed while being added; the engine keeps serving" in log and "Traceback" in log


# -- fields ---------------------------------------------------------------------------------
def test_min_tokens_and_stop_token_ids_reach_sampling(llm, client):
    base = dict(max_tokens=8, temperature=0, ignore_eos=True)
    ids = llm.generate("1, 2, 3,", gd.SamplingParams(**base))[0].outputs[0].token_ids
    stop_id = ids[2]
    for extra in ({"stop_token_ids": [stop_id]}, {"stop_token_ids": [stop_id], "min_tokens": 5}):
        want = llm.generate("1, 2, 3,", gd.SamplingParams(**base, **extra))[0].outputs[0]
        r = client.post("/v1/completions", json={"model": NAME, "prompt": "1, 2, 3,", **base, **extra}).json()
        assert r["choices"][0]["text"] == want.text and r["choices"][0]["finish_reason"] == want.finish_reason
        assert r["usage"]["completion_tokens"] == len(want.token_ids)
    assert len(want.token_ids) > 3                      # min_tokens changed the answer


@pytest.mark.parametrize("body,param", [
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": "3"}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": "2"}, "stop_token_ids"),
    ({"seed": 2**63}, "seed"),                                 # would overflow the sampler's int64 seeds
    ({"seed": 2**63 - 1, "n": 2}, "seed"),
])
def test_bad_sampling_extras_are_refused(client, body, param):
    _error(client.post("/v1/completions", json={"model": NAME, "prompt": "Hi", **body}), 400, param)


_UNSUPPORTED = [
    ("completions", "echo", True), ("completions", "best_of", 2), ("completions", "suffix", "end"),
    ("completions", "logit_bias", {"50256": -100}), ("chat", "logit_bias", {"50256": -100}),
    ("chat", "response_format", {"type": "json_object"}),
    ("chat", "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}]), ("chat", "tool_choice", "auto"),
    ("chat", "functions", [{"name": "f"}]), ("chat", "function_call", "auto"),
    ("chat", "store", True), ("chat", "service_tier", "flex"), ("chat", "modalities", ["text", "audio"]),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}), ("chat", "reasoning_effort", "low"),
    ("chat", "prediction", {"type": "content", "content": "x"}), ("chat", "web_search_options", {}),
]


def _body(endpoint: str, **extra) -> tuple[str, dict]:
    """A 2-token request, greedy so that its length is 2 (a sample can end the turn at once)."""
    if endpoint == "chat":
        return "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": 2, "temperature": 0, **extra}
    return "/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 2, "temperature": 0, **extra}


@pytest.mark.parametrize("endpoint,name,value", _UNSUPPORTED, ids=[f"{e}-{n}-{v}" for e, n, v in _UNSUPPORTED])
def test_unimplemented_openai_fields_are_refused_by_name(client, endpoint, name, value):
    path, body = _body(endpoint, **{name: value})
    err = _error(client.post(path, json=body), 400, name)
    assert err["message"].startswith(f"unsupported field {name!r}")


@pytest.mark.parametrize("endpoint,extra", [
    ("completions", {"echo": False, "best_of": 1, "suffix": "", "logit_bias": {}, "user": "u1"}),
    ("completions", {"n": 2, "best_of": 2}),
    ("chat", {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "logit_bias": {},
              "user": "u1", "max_completion_tokens": 2}),
    ("chat", {"parallel_tool_calls": True, "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
              "modalities": ["text"]}),
])
def test_neutral_values_of_unimplemented_fields_are_accepted(client, endpoint, extra):
    path, body = _body(endpoint, **extra)
    assert client.post(path, json=body).status_code == 200


@pytest.mark.parametrize("endpoint,name", [("completions", "x"), ("completions", "messages"),
                                           ("completions", "max_completion_tokens"), ("chat", "prompt"),
                                           ("chat", "echo"), ("chat", "use_beam_search")])
def test_unknown_fields_are_named(client, endpoint, name):
    path, body = _body(endpoint, **{name: 1})
    err = _error(client.post(path, json=body), 400, name)
    assert err["message"].startswith(f"unknown field {name!r}; allowed fields: [") and "'min_tokens'" in err["message"]


@pytest.mark.parametrize("endpoint,opts,stream,param,says", [
    ("completions", {"include_usage": True, "x": 1}, True, "stream_options.x", "unknown field stream_options.x; allowed"),
    ("chat", {"continuous_usage_stats": True}, True, "stream_options.continuous_usage_stats", "unknown field"),
    ("chat", {"include_usage": "yes"}, True, "stream_options.include_usage", "must be a boolean, got 'yes'"),
    ("completions", {"include_usage": True}, False, "stream_options", "only allowed when stream is true"),
    ("completions", [True], True, "stream_options", "must be an object"),
])
def test_stream_options_are_checked(client, endpoint, opts, stream, param, says):
    path, body = _body(endpoint, stream=stream, stream_options=opts)
    assert says in _error(client.post(path, json=body), 400, param)["message"]


def test_stream_options_obfuscation_is_accepted(client):
    path, body = _body("chat", stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    chunks = _chunks(client.post(path, json=body))
    assert chunks[-1]["usage"]["completion_tokens"] == 2 and chunks[-1]["choices"] == []


def test_the_openai_client_is_served(llm, client):
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)
    msgs = [{"role": "user", "content": "Hi"}]
    # greedy: at the default temperature 1.0 a 2-token sample can be the end-of-turn token, whose
    # text is empty (CI met it once)
    whole = api.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, temperature=0)
    assert whole.choices[0].message.content
    streamed = api.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=2, stream=True,
                                           temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole.choices[0].message.content
    assert api.completions.create(model=NAME, prompt="Hi", max_tokens=2, user="me", temperature=0).choices[0].text
    extras = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [2],
              "ignore_eos": True}
    r = api.completions.create(model=NAME, prompt="Hi", max_tokens=3, seed=4, extra_body=extras)
    assert r.usage.completion_tokens == 3


# -- token budgets ----------------------------------------------------------------------------
def test_a_budget_the_context_cannot_hold_is_refused(client):
    prompt = [42] * 251
    err = _error(client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 50}),
                 400, "max_tokens")
    assert err["message"].startswith("max_model_len is 256; this request asks 301 tokens (251 prompt + 50 completion)")
    _error(client.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 100000}), 400,
           "max_tokens")
    path, body = _body("chat", max_completion_tokens=100000)
    err = _error(client.post(path, json=body), 400, "max_completion_tokens")
    assert "lower max_completion_tokens" in err["message"]
    r = client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 5, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"


def test_default_budgets(client):
    """No max_tokens: 16 tokens for a completion (fewer if the context has less room), the room left
    for a chat."""
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 16
    r = client.post("/v1/completions", json={"model": NAME, "prompt": [42] * 250, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 6
    long = "Say nothing. " * 58                  # 205 prompt tokens
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": long}],
                                                  "ignore_eos": True}).json()
    assert 16 < r["usage"]["completion_tokens"] == MAX_MODEL_LEN - r["usage"]["prompt_tokens"] <= 64


@pytest.mark.parametrize("n", [0, 129, 1000])
def test_n_is_capped(client, n):
    err = _error(client.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "n": n}), 400, "n")
    assert "[1, 128]" in err["message"]


# -- error messages -----------------------------------------------------------------------------
def test_errors_name_the_field_the_client_sent(client):
    path, body = _body("chat", max_completion_tokens=-2)
    assert _error(client.post(path, json=body), 400, "max_completion_tokens")["message"].startswith(
        "max_completion_tokens must be")
    path, body = _body("chat", logprobs=True, top_logprobs=25)
    assert _error(client.post(path, json=body), 400, "top_logprobs")["message"].startswith("top_logprobs must be")
    path, body = _body("chat", logprobs=1)
    _error(client.post(path, json=body), 400, "logprobs")
    err = _error(client.post("/v1/completions", json={"prompt": "Hi"}), 400, "model")
    assert err["message"].startswith("model is required") and NAME in err["message"]
    _error(client.post("/v1/completions", json={"model": 3, "prompt": "Hi"}), 400, "model")


def test_refusals_name_the_field_in_words_the_client_knows(client):
    path, body = _body("chat", logprobs=True, top_logprobs=25)
    assert "top top_logprobs" not in _error(client.post(path, json=body), 400, "top_logprobs")["message"]
    err = _error(client.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "stop_token_ids": [10**8]}),
                 400, "stop_token_ids")
    assert err["message"].startswith("stop_token_ids must be token ids in [0, ")
    err = _error(client.post("/v1/completions", json={"model": NAME, "prompt": ""}), 400, "prompt")
    assert err["message"].endswith('got ""')
    path, body = _body("chat", messages=[{"role": "user", "content": "hi " * 300}])
    err = _error(client.post(path, json=body), 400, "messages")
    assert not err["message"].startswith("prompt 0") and f"max_model_len={MAX_MODEL_LEN}" in err["message"]
    err = _error(client.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "logprobs": 21}), 400, "logprobs")
    assert err["message"].startswith("logprobs must be null or an integer in [0, 20]"), err["message"]
    path, body = _body("chat", user=5)                   # OpenAI's user is a string
    assert _error(client.post(path, json=body), 400, "user")["message"] == "user must be a string, got 5"
    path, body = _body("chat", stream="yes")             # the value as the client wrote it (JSON)
    assert _error(client.post(path, json=body), 400, "stream")["message"] == 'stream must be true or false, got "yes"'
    path, body = _body("chat", messages=[{"content": "hi"}])
    assert _error(client.post(path, json=body), 400, "messages")["message"].startswith("messages[0].role must be")


def test_a_stream_that_fails_ends_with_done_as_vllm(llm):
    c, engine = _fresh_client(llm)

    def boom():
        raise RuntimeError("boom in step")
    engine.loop.step = boom
    r = _post_within(c, "/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 4, "stream": True})
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert "boom in step" in json.loads(lines[-2][len("data: "):])["error"]["message"]
    assert lines[-1] == "data: [DONE]"


def test_routing_errors_have_openai_shape(client):
    err = _error(client.get("/v1/nope"), 404, None)
    assert "GET /v1/nope" in err["message"] and "POST /v1/completions" in err["message"]
    r = client.get("/v1/completions")
    err = _error(r, 405, None)
    assert "/v1/completions does not take GET" in err["message"] and r.headers["allow"] == "POST"


def test_chat_content_as_text_parts_is_the_joined_text_and_other_parts_are_refused(client):
    """OpenAI's content parts: text parts read as their text joined by newlines (the same answer as
    that string), an image part is a 400 naming the message, as is content of another shape."""
    def ask(content):
        return client.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 6, "temperature": 0,
                                                         "messages": [{"role": "user", "content": content}]})
    parts = ask([{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}])
    joined = ask("What is the capital\nof France?")
    assert parts.status_code == joined.status_code == 200, parts.text
    assert parts.json()["choices"][0]["message"] == joined.json()["choices"][0]["message"]
    image = ask([{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}])
    assert image.status_code == 400 and image.json()["error"]["param"] == "messages"
    assert "messages[0].content holds parts of type ['image_url']" in image.json()["error"]["message"]
    for bad in (5, [], [{"type": "text"}]):
        r = ask(bad)
        assert r.status_code == 400 and "messages[0].content must be a string or a non-empty list" in \
            r.json()["error"]["message"], r.text


@pytest.mark.parametrize("chat", [False, True])
def test_a_streamed_choice_is_what_json_dumps_writes(chat):
    """``_choice_json`` formats the common token (no logprobs, not the last) around its encoded text;
    every form must be byte for byte ``json.dumps`` of the choice's dict."""
    import random

    from graphdsl.entrypoints.openai_server import _choice_json
    rng = random.Random(0)
    alphabet = ['a', ' ', '"', '\\', '\n', '\t', '\x00', '\x1f', 'é', '€', '😀', '\u2028', '{', '}', ':', ',']
    for _ in range(300):
        delta = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 8)))
        index, role = rng.randrange(0, 130), rng.random() < 0.5
        lp = rng.choice([None, None, {"content": [{"token": delta, "logprob": -0.5}]}])
        fr = rng.choice([None, None, "stop", "length"])
        d = ({"content": delta, "role": "assistant"} if role else {"content": delta}) if chat else None
        want = json.dumps({"index": index, "delta": d, "logprobs": lp, "finish_reason": fr} if chat else
                          {"index": index, "text": delta, "logprobs": lp, "finish_reason": fr})
        assert _choice_json(index, delta, chat, role and chat, lp, fr) == want
