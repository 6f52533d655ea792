"""The OpenAI server serving LoRA adapters as models (``--lora NAME=PATH``): a tiny llama without a
tokenizer (prompts as token ids), one PEFT adapter, requests for the base and the adapter."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("peft")

import graphdsl as gd  # noqa: E402
from graphdsl.entrypoints.openai_server import build_app  # noqa: E402
from tests.models.hf_tiny import make_checkpoint  # noqa: E402
from tests.models.test_lora import make_adapter  # noqa: E402


def test_lora_adapters_are_served_as_models(tmp_path):
    from fastapi.testclient import TestClient
    hf = make_checkpoint("llama", tmp_path / "base")
    make_adapter(hf, tmp_path / "ad", seed=11)
    llm = gd.LLM(str(tmp_path / "base"), device="cpu", max_model_len=64, max_num_seqs=4)
    llm.load_lora("tuned", tmp_path / "ad")
    app = build_app(llm, served_model_name="base")
    engine = app.state.engine
    groups = []
    submit = engine.submit

    def spy(group, aloop: asyncio.AbstractEventLoop, **kw):
        groups.append(group)
        return submit(group, aloop, **kw)
    engine.submit = spy
    prompt = [3, 17, 42, 99, 5]
    with TestClient(app) as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == ["base", "tuned"]
        for model in ("tuned", "base"):
            r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 5,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
        bad = client.post("/v1/completions", json={"model": "nope", "prompt": prompt, "max_tokens": 2})
        assert bad.status_code == 404 and "tuned" in bad.json()["error"]["message"]
    params = gd.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    tuned, base = (g.samples[0].req.output_ids for g in groups)
    assert [g.lora for g in groups] == ["tuned", None]
    assert tuned == llm.generate([prompt], params, lora_request="tuned")[0].outputs[0].token_ids
    assert base == llm.generate([prompt], params)[0].outputs[0].token_ids
    assert tuned != base
