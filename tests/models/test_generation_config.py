"""Per-model sampling defaults (vLLM's get_default_sampling_params): read from generation_config.json
or GGUF general.sampling.* metadata, used by generate/chat/stream when they get no params."""
import json

import pytest

import graphdsl as gd
from graphdsl.errors import GraphDSLError
from graphdsl.runtime.loaders.generation_config import gguf_generation_config, read_generation_config
from tests.models.gguf_tiny import build_tiny_gguf
from tests.models.hf_tiny import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", d)
    return d


def _with_generation_config(ckpt, tmp_path, **fields):
    d = tmp_path / "m"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    return d


def test_reads_vllm_fields_whatever_do_sample_says(ckpt, tmp_path):
    assert read_generation_config(ckpt) == {}                 # transformers' file: no sampling keys
    d = _with_generation_config(ckpt, tmp_path, do_sample=False, temperature=0.6, top_p=0.9, top_k=20, min_p=None,
                                repetition_penalty=1.1, max_new_tokens=3, num_beams=1)
    assert read_generation_config(d) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                                         "max_tokens": 3}
    assert read_generation_config(tmp_path / "no-such-dir") == {}


def test_a_value_of_the_wrong_type_names_file_and_key(ckpt, tmp_path):
    d = _with_generation_config(ckpt, tmp_path, temperature="hot", top_k=2.5)
    with pytest.raises(GraphDSLError, match=r"generation_config.json'.*: temperature must be a number, got 'hot'"):
        read_generation_config(d)


def test_gguf_metadata():
    meta = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40, "general.sampling.top_p": 0.95,
            "general.sampling.penalty_repeat": 1.05, "general.sampling.mirostat": 0, "llama.block_count": 2}
    assert gguf_generation_config(meta) == {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.05}
    with pytest.raises(GraphDSLError, match=r"x.gguf: general.sampling.top_k must be an integer, got 4.5"):
        gguf_generation_config({"general.sampling.top_k": 4.5}, "x.gguf")


def test_generate_without_params_uses_the_checkpoint_defaults(ckpt, tmp_path):
    d = _with_generation_config(ckpt, tmp_path, temperature=0.0, max_new_tokens=3, min_p=0.1)
    llm = gd.LLM(d, device="cpu", max_model_len=32)
    assert llm.generation_config == {"temperature": 0.0, "min_p": 0.1, "max_tokens": 3}
    p = llm.get_default_sampling_params()
    assert p.temperature == 0.0 and p.max_tokens == 3 and p.top_p == 1.0      # min_p: not a SamplingParams field
    ids = [5, 7, 11, 13]
    want = llm.generate([ids], gd.SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].token_ids
    assert llm.generate([ids])[0].outputs[0].token_ids == want and 1 <= len(want) <= 3


def test_no_recommendation_means_vllm_defaults(ckpt):
    llm = gd.LLM(ckpt, device="cpu", max_model_len=32)
    assert llm.generation_config == {} and llm.get_default_sampling_params() == gd.SamplingParams()
    rnd = gd.LLM.from_config(json.loads((ckpt / "config.json").read_text()), device="cpu", max_model_len=32)
    assert rnd.generation_config == {} and rnd.get_default_sampling_params() == gd.SamplingParams()


def test_invalid_recommendation_is_reported_when_used(ckpt, tmp_path):
    llm = gd.LLM(_with_generation_config(ckpt, tmp_path, top_p=0.0), device="cpu", max_model_len=32)
    with pytest.raises(GraphDSLError, match=r"recommended sampling settings \{'top_p': 0.0\} are not valid .*top_p"):
        llm.generate([[1, 2]])
    assert llm.generate([[1, 2]], gd.SamplingParams(max_tokens=1))[0].outputs[0].token_ids


def test_gguf_file_defaults(tmp_path):
    path, _ = build_tiny_gguf(tmp_path, **{"general.sampling.temp": 0.25, "general.sampling.top_k": 7})
    llm = gd.LLM(path, device="cpu", max_model_len=32)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k) == (0.25, 7)
